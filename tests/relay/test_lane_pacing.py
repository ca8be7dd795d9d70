"""A relay's HostFrame lanes go up at most LANES_AHEAD ahead of the consensus lanes.

The controller finishes lane i only once every relay's lane i is in; on a link
several relays share, a relay that ran ahead only took bandwidth from the lane
everyone waits for. So the relay's writer holds its next lane back until the
consensus lanes catch up - and stops waiting (the connection's loss) when the
controller is lost, so the channel's writer lets go of the connection.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from flodl_trio.relay.config import ChannelKind, RelayConfig
from flodl_trio.relay.lanes import LANES_AHEAD, LaneFrames
from flodl_trio.transport.buffers import BufferPool
from flodl_trio.transport.stream import MessageStream
from flodl_trio.wire.constants import DTYPE_F32
from flodl_trio.wire.lanes import LaneLayout
from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload, encode_round_frame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"lane-pacing-salt")
LANES = LANES_AHEAD + 3


def frame(value: float) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, (600,), np.full(600, value, "<f4"))], RoundKind.MODEL, 1.0)


async def test_a_relay_has_at_most_lanes_ahead_lanes_up_beyond_the_consensus() -> None:
    config = RelayConfig(ChannelKind.DATA, ("h", 1), "h", (0,), 1, SALT, lanes=LANES, lane_min_bytes=0)
    frames = LaneFrames(config, BufferPool(1))
    sent: list[int] = []
    upstream_end, far_end = trio.testing.memory_stream_pair()
    layout = LaneLayout.of(frame(0.0), LANES)
    consensus_lanes = [encode_round_frame(lane, SALT) for lane in layout.split(frame(2.0))]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, far_end)
            uplink = await frames.uplink(frame(1.0))
            nursery.start_soon(frames.send, uplink, MessageStream(upstream_end), sent.append)
            await trio.testing.wait_all_tasks_blocked()
            assert len(sent) == LANES_AHEAD  # and no more until a consensus lane is in
            for k in range(LANES - LANES_AHEAD):
                async with frames.consensus(memoryview(consensus_lanes[k]), True, lambda: False) as joined:
                    assert joined is None
                await trio.testing.wait_all_tasks_blocked()
                assert len(sent) == LANES_AHEAD + k + 1
            nursery.cancel_scope.cancel()


async def test_a_writer_waiting_for_consensus_lanes_stops_when_the_connection_is_lost() -> None:
    config = RelayConfig(ChannelKind.DATA, ("h", 1), "h", (0,), 1, SALT, lanes=LANES, lane_min_bytes=0)
    frames = LaneFrames(config, BufferPool(1))
    upstream_end, far_end = trio.testing.memory_stream_pair()
    sent: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, far_end)
            uplink = await frames.uplink(frame(1.0))
            failed = trio.Event()

            async def write() -> None:
                with pytest.raises(trio.BrokenResourceError, match="connection was lost"):
                    await frames.send(uplink, MessageStream(upstream_end), sent.append)
                failed.set()

            nursery.start_soon(write)
            await trio.testing.wait_all_tasks_blocked()
            frames.connection_lost()
            await failed.wait()
            # What was not sent goes up whole on the new connection (every lane, in order).
            again = await uplink.every_record()
            assert len(uplink.records) == LANES and again.nbytes == sum(r.nbytes for r in uplink.records)
            assert len(sent) == LANES_AHEAD
            nursery.cancel_scope.cancel()


async def drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass
