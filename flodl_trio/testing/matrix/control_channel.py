"""Cases: the control channel - heartbeats that stop, garbage beside them, replayed copies."""

from __future__ import annotations

import re

import trio

from ...client import connect_reduce_client
from ...wire.constants import CHANNEL_MAGIC_CONTROL
from ...wire.control_frame import ControlFrame, ControlKind, encode_control_frame
from ...wire.handshake import CONTROL_HANDSHAKE_LEN
from ...wire.liveness import HEARTBEAT_TAG, heartbeat_frame
from ...wire.mux import Hello, MuxKind, encode_mux_record
from ..proxy import Stall
from .clusters import HEARTBEAT_TIMEOUT, SALT, SIGNATURE, daemon_cluster, diagnose, pause
from .hostile import contribution_frame, length_prefixed, raw_control_rank, raw_relay
from .oracle import everyone, expect_consensus, expect_error, last_outcome, mono, trio_to_mono
from .registry import MatrixFailure, Outcome, case, short


@case("control-leg-stall", fault="a rank's heartbeats stop getting through (Stall after the handshake)", leg="rank -> relay (control)")
async def control_leg_stall() -> Outcome:
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=2, worker_args={3: pause(0)},
        control_proxy_faults={3: [Stall(CONTROL_HANDSHAKE_LEN, 60.0)]},
    ) as c:
        with diagnose(c):
            events = await c.control_proxies[3].wait_fired(Stall)
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 1, 2], 2, lambda _k: {0, 1, 2})
            error = await expect_error(c, 3, before_round=0, contributors=everyone(4), types=("RankDeadError",), fragments=("no heartbeat",))
            seconds = last_outcome(rounds, 0, error["time"]) - t0
    return Outcome(f"declared dead after the heartbeat timeout; it raised RankDeadError ({short(error['message'], 60)}); 0,1,2 went on", seconds)


def control_junk() -> list[bytes]:
    """Control frames a coordinator must ignore: no ControlFrame at all, a heartbeat of the
    wrong size, and a legal 100 KiB Metrics frame."""
    return [
        b"\x00\x01 this is not a control frame",
        encode_control_frame(ControlFrame(ControlKind.HEARTBEAT, HEARTBEAT_TAG + b"\x01\x00\x00"), SALT),
        encode_control_frame(ControlFrame(ControlKind.METRICS, bytes(100 << 10)), SALT),
    ]


async def noisy_heartbeats(control: trio.SocketStream, rank: int) -> None:
    """Rank ``rank``'s real heartbeats, each followed by one of :func:`control_junk`, until cancelled."""
    junk = control_junk()
    seq = 0
    while True:
        seq += 1
        for blob in (encode_control_frame(heartbeat_frame(rank, seq), SALT), junk[seq % len(junk)]):
            await control.send_all(length_prefixed(blob))
        await trio.sleep(HEARTBEAT_TIMEOUT / 6)


@case("control-garbage", fault="a rank's control connection carries garbage, a short heartbeat and a 100 KiB Metrics frame", leg="rank -> relay (control)")
async def control_garbage() -> Outcome:
    """Rank 1 (played here) takes part in every data round, and on its control
    connection sends its real heartbeats interleaved with bytes that are no
    ControlFrame, a correctly tagged heartbeat of the wrong size and a legal 100 KiB
    Metrics frame. The coordinator ignores and counts them; nobody dies."""
    rounds = 3
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=rounds, pause=HEARTBEAT_TIMEOUT / 2,
                              external_ranks={1}) as c:
        with diagnose(c):
            control = await raw_control_rank(c.control_address(1), 1, 3)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(noisy_heartbeats, control, 1)
                t0 = mono()
                async with connect_reduce_client(c.relay_address(1), 1, 3, SALT) as client:
                    for k in range(rounds):
                        await client.all_reduce(contribution_frame(1, k))
                    done = await expect_consensus(c, [0, 2], rounds, everyone(3))
                    nursery.cancel_scope.cancel()  # before rank 1 leaves (its control connection then closes)
            await control.aclose()
            assert c.controller is not None
            await c.controller.wait_log(re.compile(r"ignored a control frame from rank 1 \(malformed"))
            await c.controller.wait_log(re.compile(r"ignored a control frame from rank 1 \(not a heartbeat"))
            if "declared dead" in c.controller.text:
                raise MatrixFailure("a rank was declared dead")
            seconds = last_outcome(done, rounds - 1) - t0
    return Outcome(f"ignored and counted (malformed, not a heartbeat); nobody declared dead; {rounds} rounds over 0,1,2", seconds)


@case("heartbeat-replay", fault="byte-identical copies of a frozen rank's last heartbeat record", leg="relay -> controller (control)")
async def heartbeat_replay() -> Outcome:
    """Rank 1's control relay (played here) sends one valid heartbeat record, then only
    copies of it, as an attacker replaying captured bytes would: the copies' sequence
    number does not increase, so rank 1 is declared dead on time and rank 0 goes on."""
    async with daemon_cluster(world_size=2, hosts=[[0]], rounds=2) as c:
        with diagnose(c):
            assert c.controller is not None
            stream = await raw_relay(c.controller_address, CHANNEL_MAGIC_CONTROL, Hello("replayer", (1,), (SIGNATURE,)))
            async with stream:
                heartbeat = encode_control_frame(heartbeat_frame(1, 1), SALT)
                record = encode_mux_record(MuxKind.DATA, heartbeat, SALT, rank=1).tobytes()
                t0 = mono()
                with trio.move_on_after(HEARTBEAT_TIMEOUT * 4):
                    while "rank 1 declared dead" not in c.controller.text:
                        await stream.send_all(record)
                        await trio.sleep(HEARTBEAT_TIMEOUT / 8)
                seconds = mono() - t0
            await c.controller.wait_log(re.compile(r"rank 1 declared dead: no heartbeat"))
            await c.controller.wait_log("replayed heartbeat")
            if seconds > HEARTBEAT_TIMEOUT * 2:
                raise MatrixFailure(f"rank 1 was declared dead only after {seconds:.2f} s of replays")
            await expect_consensus(c, [0], 2, lambda _k: {0})
    return Outcome("copies ignored (sequence not increasing); rank 1 declared dead on time; rank 0 went on alone", seconds)
