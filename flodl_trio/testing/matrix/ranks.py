"""Cases: rank processes killed, frozen or blocked - before, during and after their frame."""

from __future__ import annotations

import re
from collections.abc import Callable

import trio

from ..processes import ProcessCluster
from ..proxy import BandwidthCap
from .clusters import BIG_NUMEL, HEARTBEAT_TIMEOUT, MiB, daemon_cluster, diagnose, pause, wait_until
from .offsets import frame_len, rank_frame_start, rank_leg_bytes
from .oracle import after, everyone, expect_consensus, expect_error, killed, last_outcome, mono
from .registry import MatrixFailure, Outcome, case, short

SURVIVORS_FROM_ROUND_2 = after(2, range(4), [0, 1, 2])


async def rank_3_lost_before_round_2(c: ProcessCluster, fault: Callable[[int], None]) -> float:
    """Hit rank 3 with ``fault`` while it holds before round 2; once ranks 0-2 have
    their rounds (all four before round 2, three from it on), the seconds from the
    fault to their round 2."""
    await c.wait_event(3, "paused", round=2)
    t0 = mono()
    fault(3)
    rounds = await expect_consensus(c, [0, 1, 2], 4, SURVIVORS_FROM_ROUND_2)
    return last_outcome(rounds, 2) - t0


@case("rank-kill-before-frame", fault="rank SIGKILLed before sending its round-2 frame", leg="rank process")
async def rank_kill_before_frame() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=4, worker_args={3: pause(2)}) as c:
        with diagnose(c):
            seconds = await rank_3_lost_before_round_2(c, c.kill)
            killed(c, 3, before_round=2, contributors=SURVIVORS_FROM_ROUND_2)
    return Outcome("survivors 0,1,2 got the 3-rank consensus (mass 3) from round 2 on; rounds 0-1 had all 4", seconds)


@case("rank-kill-mid-frame", fault="rank SIGKILLed mid-frame (16 MB frame on a 8 MB/s leg)", leg="rank process")
async def rank_kill_mid_frame() -> Outcome:
    total = rank_leg_bytes(1, BIG_NUMEL)  # the handshake and the whole frame
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=1, numel=BIG_NUMEL, proxy_faults={2: [BandwidthCap(8e6)]},
    ) as c:
        with diagnose(c):
            proxy = c.proxies[2]
            await wait_until(lambda: bool(proxy.connections) and proxy.connections[0].up.bytes_out > rank_frame_start(0) + MiB)
            t0 = mono()
            c.kill(2)
            rounds = await expect_consensus(c, [0, 1], 1, lambda _k: {0, 1})
            killed(c, 2, before_round=0, contributors=everyone(3))
            record = await proxy.wait_closed(0)
            if record.up.bytes_out >= total:
                raise MatrixFailure(f"the whole frame reached the relay ({record.up.bytes_out} bytes): no partial frame")
            # The data relay sees the truncated frame end, unless the death (via the control
            # channel) reaches it first: either way the partial frame never counts.
            await c.relay_processes(1)[0].wait_log(re.compile(r"rank 2 (dropped|declared dead)"))
            seconds = last_outcome(rounds, 0) - t0
    return Outcome(
        f"the partial frame ({record.up.bytes_out / 1e6:.1f} of {total / 1e6:.1f} MB) never counted; "
        "survivors 0,1 got the 2-rank consensus", seconds,
    )


@case("rank-kill-after-frame", fault="rank SIGKILLed after its round-1 frame was folded", leg="rank process")
async def rank_kill_after_frame() -> Outcome:
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={2: pause(1)}, proxy_faults={3: []},
    ) as c:
        with diagnose(c):
            proxy = c.proxies[3]
            await c.wait_event(2, "paused", round=1)
            sent = rank_frame_start(1) + frame_len(4)
            await wait_until(lambda: bool(proxy.connections) and proxy.connections[0].up.bytes_out >= sent)
            await trio.sleep(0.2)  # the relay folds it (held back: rank 2 has not sent round 1)
            t0 = mono()
            c.kill(3)
            # Data and control both see it go: as EOF, or as a reset if bytes were still unread.
            relay = c.relay_processes(1)[0]
            await wait_until(lambda: sum(map(relay.text.count, ("rank 3 closed its connection", "rank 3 dropped:"))) >= 2)
            await c.resume(2)
            who = after(2, range(4), [0, 1, 2])
            rounds = await expect_consensus(c, [0, 1, 2], 3, who)
            killed(c, 3, before_round=2, contributors=who)
            seconds = last_outcome(rounds, 1) - t0
    return Outcome("round 1 kept the dead rank's folded frame (mass 4, realized work); 3-rank consensus after", seconds)


@case("rank-freeze-thaw", fault="rank SIGSTOPped before round 2, SIGCONT later", leg="rank process")
async def rank_freeze_thaw() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=4, worker_args={3: pause(2)}) as c:
        with diagnose(c):
            seconds = await rank_3_lost_before_round_2(c, c.freeze)
            if seconds < HEARTBEAT_TIMEOUT * 0.9:
                raise MatrixFailure(f"survivors moved on {seconds:.2f} s after the freeze, before the heartbeat timeout")
            c.thaw(3)
            error = await expect_error(
                c, 3, before_round=2, contributors=SURVIVORS_FROM_ROUND_2, fragments=("declared dead",)
            )
    return Outcome(
        f"declared dead after the heartbeat timeout, survivors 0,1,2 went on; thawed, it raised "
        f"{error['type']} ({short(error['message'], 60)})", seconds,
    )


@case("rank-loop-blocked", fault="rank's event loop blocked 3 s by synchronous work (no await)", leg="rank process")
async def rank_loop_blocked() -> Outcome:
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={3: ["--block-before", "1:3", *pause(1)]},
    ) as c:
        with diagnose(c):
            blocking = await c.wait_event(3, "blocking", round=1)
            t0 = blocking["time"]
            who = after(1, range(4), [0, 1, 2])
            rounds = await expect_consensus(c, [0, 1, 2], 3, who)
            # Unblocked, it has been declared dead: it must say so (or that the coordinator is
            # gone), not return a round and not blame the bytes on the wire.
            error = await expect_error(c, 3, before_round=1, contributors=who, fragments=("declared dead", "no beacon", "closed the connection"))
            seconds = last_outcome(rounds, 1) - t0
    return Outcome(
        f"declared dead after the heartbeat timeout, survivors 0,1,2 went on; unblocked, it raised {error['type']} "
        f"({short(error['message'], 60)})", seconds,
    )
