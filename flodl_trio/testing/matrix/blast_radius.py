"""Cases: the blast radius of a peer that has the salt and says something impossible -
an unknown dtype, a schema that changes, a mass that overflows. It costs that peer only."""

from __future__ import annotations

import re

from ...wire.round_frame import encode_round_frame
from .clusters import SALT, daemon_cluster, diagnose, formed
from .hostile import UNKNOWN_DTYPE, contribution_frame, length_prefixed, raw_data_rank, wait_closed_by_peer, with_unknown_dtype
from .oracle import after, check_round, everyone, expect_consensus, expect_error, last_outcome, mono
from .registry import MatrixFailure, Outcome, case, fmt_ranks


async def _bad_schema(hosts: list[list[int]], attacker: int, world: int = 3) -> Outcome:
    honest = [r for r in range(world) if r != attacker]
    async with daemon_cluster(world_size=world, hosts=hosts, rounds=2, control=False, external_ranks={attacker}) as c:
        with diagnose(c):
            stream = await raw_data_rank(c.relay_address(attacker), attacker, world)
            async with stream:
                await formed(c)
                bad = with_unknown_dtype(contribution_frame(attacker, 0))
                t0 = mono()
                await stream.send_all(length_prefixed(bad))
                await wait_closed_by_peer(stream)
                refused = mono() - t0
            relay = c.relay_processes(c.host_of(attacker))[0]
            await relay.wait_log(re.compile(rf"rank {attacker} dropped: .*unknown dtype tag {UNKNOWN_DTYPE}"))
            rounds = await expect_consensus(c, honest, 2, lambda _k: set(honest))
            assert c.controller is not None
            if "dropped for breaking the protocol" in c.controller.text:
                raise MatrixFailure("the bad frame reached the controller")
            seconds = last_outcome(rounds, 1, t0 + refused) - t0
    return Outcome(
        f"its relay dropped rank {attacker} (SchemaError: unknown dtype tag {UNKNOWN_DTYPE}); nothing reached the controller; "
        f"ranks {fmt_ranks(honest)} got their {len(honest)}-rank consensus", seconds,
    )


@case("rank-bad-schema", fault="an authenticated frame with an unknown dtype tag, beside an honest rank", leg="rank -> relay (data)")
async def rank_bad_schema() -> Outcome:
    return await _bad_schema([[0, 1], [2]], attacker=1)


@case("rank-bad-schema-alone", fault="an authenticated frame with an unknown dtype tag, alone on its host", leg="rank -> relay (data)")
async def rank_bad_schema_alone() -> Outcome:
    return await _bad_schema([[0], [1, 2]], attacker=0)


@case("rank-schema-change-first", fault="a rank's round-1 frame has 5 elements where round 0 completed with 4, folded first",
      leg="rank -> relay (data)")
async def rank_schema_change_first() -> Outcome:
    """In deterministic mode host 0 folds its ranks in rank order, so rank 0's wrong frame
    is its round's first: the relay takes it out when rank 1's arrives (with the schema
    round 0 completed with) and drops rank 0 alone."""
    ordered = {"FLODL_DETERMINISTIC": "1"}
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={0: ["--numel-at", "1:5"]},
                              controller_env=ordered, relay_env={0: ordered, 1: ordered}) as c:
        with diagnose(c):
            t0 = (await c.wait_event(0, "sending", round=1))["time"]
            relay = c.relay_processes(0)[0]
            await relay.wait_log(re.compile(r"rank 0 dropped: .*shape \[5\], not \[4\].*taken out of the round"))
            rounds = await expect_consensus(c, [1, 2], 2, after(1, [0, 1, 2], [1, 2]))
            error = await expect_error(c, 0, before_round=1, contributors=everyone(3))
            seconds = last_outcome(rounds, 1, error["time"]) - t0
    return Outcome(
        f"relay host0 took rank 0's frame out of the round and dropped it (tensor 0 of shape [5], not [4]), which "
        f"raised {error['type']}; ranks 1,2 got round 1 without it, exact", seconds,
    )


@case("rank-mass-overflow", fault="two ranks of a host each send weight 1e308 (finite alone)", leg="rank -> relay (data)")
async def rank_mass_overflow() -> Outcome:
    """The second 1e308 would make the host's mass infinite: its sender is dropped. The
    first is realized work: round 0's consensus is the honest values over a mass of
    1e308 (0 in f32); after the first attacker leaves, round 1 is the honest mean."""
    async with daemon_cluster(world_size=4, hosts=[[0, 1, 2], [3]], rounds=2, control=False, external_ranks={0, 1}) as c:
        with diagnose(c):
            streams = [await raw_data_rank(c.relay_address(r), r, 4) for r in (0, 1)]
            await formed(c)
            t0 = mono()
            for rank, stream in zip((0, 1), streams):
                await stream.send_all(length_prefixed(encode_round_frame(contribution_frame(rank, 0, weight=1e308), SALT)))
            relay = c.relay_processes(0)[0]
            match = await relay.wait_log(re.compile(r"rank ([01]) dropped: .*accepted mass inf"))
            first = await c.wait_round(2, 0)
            for stream in streams:  # the survivor leaves too: round 1 is the honest ranks'
                await stream.aclose()
            for rank in (2, 3):
                event = await c.wait_round(rank, 0)
                if not (event["value"] == event["min"] == event["max"] == 0.0 and event["mass"] == 1e308):
                    raise MatrixFailure(f"rank {rank} round 0: {event}; want 0.0 everywhere with mass 1e308")
            final = [await c.wait_outcome(r) for r in (2, 3)]
            for rank in (2, 3):
                check_round(await c.wait_round(rank, 1), {2, 3})
            if any(f["event"] != "done" for f in final):
                raise MatrixFailure(f"the honest ranks did not finish: {final}")
            seconds = first["time"] - t0
    return Outcome(
        f"relay dropped rank {match.group(1)} (its weight would make the mass inf); round 0 kept the other 1e308 "
        "(honest ranks got 0 with mass 1e308), round 1 the honest mean", seconds,
    )
