"""Cases: the rank -> relay data leg - bit flips, a cut, a replay, a slow link, a huge length."""

from __future__ import annotations

import re

from ..proxy import CutAt, Delay, DuplicateRecord, Fault, FlipBit
from .clusters import MiB, cap_address_space, check_memory_growth, daemon_cluster, diagnose, formed, pause
from .hostile import huge_length_prefix, raw_data_rank, wait_closed_by_peer
from .offsets import FRAME_PAYLOAD, FRAME_WEIGHT_LOW_BYTE, frame_len, rank_frame_start
from .oracle import everyone, expect_consensus, expect_error, expect_replay_costs_its_sender, last_outcome, mono, trio_to_mono
from .registry import MatrixFailure, Outcome, case, short


async def _rank_leg_drop(fault: Fault, relay_log: str, *, numel: int | None = None) -> Outcome:
    """Rank 1's data leg carries ``fault``: rank 1 is dropped and raises, ranks 0 and 2 go on."""
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, numel=numel, proxy_faults={1: [fault]}) as c:
        with diagnose(c):
            events = await c.proxies[1].wait_fired(type(fault))
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 2], 2, lambda _k: {0, 2})
            error = await expect_error(c, 1, before_round=0, contributors=everyone(3))
            # A cut may reach the relay as the rank's death (via its control channel) first.
            pattern = r"rank 1 dropped: (.*?)\"?$" if relay_log else r"rank 1 (?:dropped: )?((?<=dropped: ).*?|declared dead.*?)\"?$"
            match = await c.relay_processes(0)[0].wait_log(re.compile(pattern, re.M))
            if relay_log not in match.group(1):
                raise MatrixFailure(f"the relay dropped rank 1 for another reason: {match.group(0)!r}, want {relay_log!r}")
            seconds = last_outcome(rounds, 0, error["time"]) - t0
    reason = relay_log or short(match.group(1).split(": ", 1)[-1], 40)
    return Outcome(f"relay dropped rank 1 ({reason}), which raised {error['type']}; ranks 0,2 got their 2-rank consensus", seconds)


@case("rank-leg-flip-payload", fault="one bit flipped in a frame's tensor payload", leg="rank -> relay (data)")
async def rank_leg_flip_payload() -> Outcome:
    return await _rank_leg_drop(FlipBit(rank_frame_start(0) + FRAME_PAYLOAD + 2, bit=3), "MAC mismatch")


@case("rank-leg-flip-header", fault="one bit flipped in a frame header (the weight)", leg="rank -> relay (data)")
async def rank_leg_flip_header() -> Outcome:
    return await _rank_leg_drop(FlipBit(rank_frame_start(0) + FRAME_WEIGHT_LOW_BYTE, bit=0), "MAC mismatch")


@case("rank-leg-flip-mac", fault="one bit flipped in a frame's MAC", leg="rank -> relay (data)")
async def rank_leg_flip_mac() -> Outcome:
    return await _rank_leg_drop(FlipBit(rank_frame_start(0) + frame_len(4) - 1, bit=7), "MAC mismatch")


@case("rank-leg-cut", fault="connection reset mid-frame", leg="rank -> relay (data)")
async def rank_leg_cut() -> Outcome:
    return await _rank_leg_drop(CutAt(rank_frame_start(0) + 20), "")


@case("rank-leg-replay", fault="a rank's frame delivered twice (replay)", leg="rank -> relay (data)")
async def rank_leg_replay() -> Outcome:
    # Rank 0 holds its round-0 frame, so host 0's fold cannot ship before the copy arrives.
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=2, worker_args={0: pause(0)},
        proxy_faults={1: [DuplicateRecord(index=0)]},
    ) as c:
        with diagnose(c):
            error, seconds = await expect_replay_costs_its_sender(
                c, c.proxies[1], c.relay_processes(0)[0], re.compile(r"rank 1 dropped: .*deposited twice in one round"),
                sender=1, survivors=[0, 2, 3],
            )
    return Outcome(
        f"relay host0 dropped rank 1 (DesyncError: deposited twice), which raised {error['type']}; "
        "ranks 0,2,3 got round 0 with rank 1's first frame and round 1 without it", seconds,
    )


@case("rank-leg-slow", fault="slow link: every chunk held 0.2 s, both ways", leg="rank -> relay (data)")
async def rank_leg_slow() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=3, proxy_faults={1: [Delay(0.2, direction="both")]}) as c:
        with diagnose(c):
            events = await c.proxies[1].wait_fired(Delay)
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, range(3), 3, everyone(3))
            seconds = last_outcome(rounds, 2) - t0
    return Outcome("no false death: every rank got every 3-rank consensus, just later", seconds)


@case("rank-leg-huge-length", fault="length prefix 2**32-1 after a valid data handshake", leg="rank -> relay (data)")
async def rank_leg_huge_length() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, control=False, external_ranks={1}) as c:
        with diagnose(c):
            relay = c.relay_processes(0)[0]
            attacker = await raw_data_rank(c.relay_address(1), 1, 3)
            async with attacker:
                await formed(c)
                await c.wait_event(0, "sending", round=0)
                cap_address_space(relay)
                before = relay.memory()
                t0 = mono()
                await attacker.send_all(huge_length_prefix() + b"\x00" * 64)
                await wait_closed_by_peer(attacker)
                refused = mono() - t0
            rounds = await expect_consensus(c, [0, 2], 2, lambda _k: {0, 2})
            await relay.wait_log("length prefix 4294967295 exceeds the frame ceiling")
            peak, hwm = check_memory_growth("relay", relay, before)
            seconds = last_outcome(rounds, 0, t0 + refused) - t0
    return Outcome(
        f"refused before buffering (relay VmPeak +{peak / MiB:.1f} MiB, VmHWM +{hwm / MiB:.1f} MiB); "
        "ranks 0,2 got their 2-rank consensus", seconds,
    )

