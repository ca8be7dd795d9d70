"""Cases: the relay -> controller data link - bit flips, a cut, a replay, a write that stalls."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..proxy import CutAt, DuplicateRecord, Fault, FlipBit, Stall
from .clusters import BIG_NUMEL, SCALE, daemon_cluster, diagnose, formed, pause
from .offsets import FRAME_PAYLOAD, MUX_HEADER, MUX_MAC, uplink_host_frame_record, uplink_host_frame_start
from .oracle import everyone, expect_consensus, expect_error, expect_replay_costs_its_sender, last_outcome, trio_to_mono
from .registry import MatrixFailure, Outcome, case, short

# Host 1 carries rank 2: where its first HostFrame record starts on its uplink (after
# the ShardOffer of the shard its relay daemon serves by default).
UPLINK_HOST1 = uplink_host_frame_start("host1", [2], 0, offers_shard=True)
# ... and its index among the uplink's records (after the Hello and the ShardOffer).
UPLINK_HOST1_FIRST_FRAME = uplink_host_frame_record(0, offers_shard=True)


async def _uplink_dropped(fault: Fault, controller_log: Sequence[str]) -> Outcome:
    """Host 1's uplink carries ``fault``: the controller drops relay host1 (naming it and
    the fault); its rank 2 raises; host 0's ranks get their 2-rank consensus."""
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={2: pause(0)}, upstream_faults={1: [fault]},
    ) as c:
        with diagnose(c):
            await c.wait_event(2, "paused", round=0)
            await formed(c)  # the whole cluster is up before host 1's first frame goes out
            await c.resume(2)
            events = await c.upstream_proxies[1].wait_fired(type(fault))
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 1], 2, lambda _k: {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            assert c.controller is not None
            match = await c.controller.wait_log(re.compile(r"relay host1 \(ranks \[2\]\) dropped for breaking the protocol .*"))
            line = match.group(0)
            if not any(f in line for f in controller_log):
                raise MatrixFailure(f"the controller dropped relay host1 for another reason: {line!r}, want {list(controller_log)}")
            seconds = last_outcome(rounds, 1, error["time"]) - t0
    kind = re.search(r"(MAC mismatch|bad magic 0x[0-9A-F]+|HostFrame before the consensus)", line)
    return Outcome(
        f"controller dropped relay host1 ({kind.group(1) if kind else short(line)}); rank 2 raised {error['type']}; "
        "ranks 0,1 got their 2-rank consensus", seconds,
    )


@case("uplink-flip-payload", fault="one bit flipped in a HostFrame's payload", leg="relay -> controller (data)")
async def uplink_flip_payload() -> Outcome:
    return await _uplink_dropped(FlipBit(UPLINK_HOST1 + MUX_HEADER + FRAME_PAYLOAD + 3, bit=1), ["MAC mismatch"])


@case("uplink-flip-header", fault="one bit flipped in a MuxRecord header (its magic)", leg="relay -> controller (data)")
async def uplink_flip_header() -> Outcome:
    return await _uplink_dropped(FlipBit(UPLINK_HOST1, bit=0), ["bad magic"])


@case("uplink-flip-mac", fault="one bit flipped in a MuxRecord's MAC", leg="relay -> controller (data)")
async def uplink_flip_mac() -> Outcome:
    return await _uplink_dropped(FlipBit(UPLINK_HOST1 + MUX_MAC + 3, bit=5), ["MAC mismatch"])


@case("uplink-cut", fault="connection reset mid-HostFrame", leg="relay -> controller (data)")
async def uplink_cut() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, upstream_faults={1: [CutAt(UPLINK_HOST1 + 40)]}) as c:
        with diagnose(c):
            events = await c.upstream_proxies[1].wait_fired(CutAt)
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 1], 2, lambda _k: {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            seconds = last_outcome(rounds, 0, error["time"]) - t0
    return Outcome(f"host 1's rank declared dead and raised {error['type']}; host 0 got its 2-rank consensus", seconds)


@case("uplink-replay", fault="a HostFrame delivered twice (replay) while its round is open", leg="relay -> controller (data)")
async def uplink_replay() -> Outcome:
    """Host 0 is held back, so host 1's frame and its copy both land while round 0 waits.

    A copy arriving after the round's consensus went out cannot be told from the
    next round's frame: the wire format has no sequence number (see wire.md,
    "Replays"); run the relay links in a tunnel with anti-replay when an
    attacker could sit on them.
    """
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={0: pause(0)},
        upstream_faults={1: [DuplicateRecord(index=UPLINK_HOST1_FIRST_FRAME, framing="mux")]},
    ) as c:
        with diagnose(c):
            # Host 0 is let go only once the controller has read the copy. Released earlier,
            # host 0 could complete the round first, and the copy would then be
            # (undetectably) the next round's frame.
            assert c.controller is not None
            dropped = re.compile(r"relay host1 .*dropped for breaking the protocol .*HostFrame before the consensus")
            error, seconds = await expect_replay_costs_its_sender(
                c, c.upstream_proxies[1], c.controller, dropped, sender=2, survivors=[0, 1],
            )
    return Outcome(
        f"controller dropped relay host1 (DesyncError: a HostFrame before its consensus); rank 2 raised {error['type']}; "
        "ranks 0,1 got round 0 with host 1's first frame and round 1 without it", seconds,
    )


@case("uplink-write-stall", fault="relay's upstream write makes no progress (16 MB frame, Stall)", leg="relay -> controller (data)")
async def uplink_write_stall() -> Outcome:
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=1, numel=BIG_NUMEL,
        upstream_faults={1: [Stall(UPLINK_HOST1, 60.0)]}, relay_env={1: {"FLODL_NET_TIMEOUT_SCALE": SCALE}},
    ) as c:
        with diagnose(c):
            await c.upstream_proxies[1].wait_fired(Stall)
            sending = await c.wait_event(2, "sending", round=0)
            t0 = sending["time"]
            rounds = await expect_consensus(c, [0, 1], 1, lambda _k: {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            data_relay = c.relay_processes(1)[0]
            await data_relay.wait_log(re.compile(r"relay failed: .*write stalled for 3 s"))
            if await data_relay.wait() != 1:
                raise MatrixFailure(f"relay host1 exited {data_relay.returncode}, want 1")
            seconds = last_outcome(rounds, 0, error["time"]) - t0
    return Outcome(f"relay host1 gave up (write stalled for 3 s); rank 2 raised {error['type']}; host 0 went on", seconds)
