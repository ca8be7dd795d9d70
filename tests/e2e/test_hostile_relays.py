"""A relay that breaks the protocol costs itself alone, at once, whatever else it does.

Here the bad relay has also stopped reading, so the controller's write of the last
consensus to it is stuck: the relay must still be dropped the moment its bad record
is read, not once that write gives up after the write-stall bound.
"""

from __future__ import annotations

import numpy as np
import torch
import trio

from flodl_trio import SessionSalt, connect_reduce_client
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire import DTYPE_F32, Hello, MuxKind, RoundFrame, TensorPayload
from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA
from flodl_trio.wire.mux import encode_control_record, encode_mux_record
from flodl_trio.wire.round_frame import encode_round_frame

LOOP = "127.0.0.1"
NUMEL = 4 << 20  # 16 MiB of f32: more than the sockets between the two hold, so a write to it blocks


async def test_a_relay_that_stops_reading_and_breaks_the_protocol_is_dropped_at_once(salt):
    bounds = NetBounds(write_stall=600.0)  # far past this test's deadline: only an immediate drop passes
    got: dict[int, list[float]] = {}
    with trio.fail_after(60):
        async with open_local_cluster(world_size=3, hosts=[[0, 1]], salt=salt, bounds=bounds, lanes=1) as cluster:
            evil = await trio.open_tcp_stream(LOOP, cluster.controller.port)
            hello = encode_control_record(Hello("evil", [2], []), salt)
            await evil.send_all(CHANNEL_MAGIC_DATA.to_bytes(4, "little") + bytes(hello))
            frame = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (NUMEL,), np.full(NUMEL, 2.0, "<f4"))]), salt)
            await evil.send_all(encode_mux_record(MuxKind.HOST_FRAME, frame, salt).tobytes())
            first_round = trio.Event()

            async def honest(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                    for round_ in range(2):
                        out = await client.all_reduce_tensors([torch.full((NUMEL,), float(rank))])
                        got.setdefault(rank, []).append(out[0][0].item())
                        if round_ == 0:
                            first_round.set()

            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(honest, rank)
                await first_round.wait()  # its consensus is being written to a relay that reads nothing
                bad = encode_mux_record(MuxKind.HOST_FRAME, frame, SessionSalt(b"\x07" * 16)).tobytes()
                await evil.send_all(bad)  # signed with another salt: a MAC mismatch
            assert cluster.controller.dead_ranks.snapshot() == {2}
            assert cluster.controller.stats.relays_dropped == 1
    assert got == {0: [1.0, 0.5], 1: [1.0, 0.5]}


async def test_a_control_relay_refused_is_recorded_with_the_controllers_rejections(salt):
    """Whichever channel a bad connection came on, handle.rejections names it and the
    counters count it (docs/wire.md: bad connections are refused, not fatal)."""
    from flodl_trio.controller import open_controller
    from flodl_trio.wire.constants import CHANNEL_MAGIC_CONTROL

    async with open_controller(LOOP, 0, world_size=2, salt=salt) as ctl:
        for hello, hello_salt in ((Hello("wrong-salt", [0], [b"\x11" * 32]), SessionSalt(b"\x07" * 16)),
                                  (Hello("no-sigs", [0], []), salt)):
            stream = await trio.open_tcp_stream(LOOP, ctl.port)
            await stream.send_all(CHANNEL_MAGIC_CONTROL.to_bytes(4, "little") + bytes(encode_control_record(hello, hello_salt)))
            with trio.fail_after(10):
                assert await stream.receive_some(16) == b""
        reasons = "\n".join(ctl.rejections)
        assert "control relay" in reasons and "MAC mismatch" in reasons and "0 model signatures" in reasons, reasons
        assert ctl.stats.rejected == 2 and ctl.stats.mac_failures == 1
        assert len(ctl.coordinator.rejections) == 2
