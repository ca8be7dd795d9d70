"""The joiner's side of the join exchange against a controller spoken raw, byte for byte
as docs/wire.md ("The join exchange") lays it out: the entry's catch-up frames.

A catch-up frame's length prefix sits under no MAC (only the entry before it and the
frame's own tag are signed), so a joiner must not reserve memory for it before the
bytes arrive: a peer on the path that rewrites the prefix costs the joiner nothing
but the bytes it really sends. A prefix above the documented bound (twice the state's
params frame + 64 bytes) is refused before any buffer exists.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Awaitable, Callable
from functools import partial

import numpy as np
import pytest
import trio

from flodl_trio.client import state as client_state
from flodl_trio.client.state import ClusterState, fetch_cluster_state
from flodl_trio.errors import FlodlError, FramingError
from flodl_trio.testing.matrix.hostile import receive_exactly
from flodl_trio.transport.buffers import ReceiveBuffer
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire import DTYPE_F32
from flodl_trio.wire.round_frame import RoundFrame, TensorPayload, encode_round_frame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"wire-audit-joins")
NUMEL = 1 << 18  # a 1 MiB params frame: its catch-up bound is 2 MiB + 64 bytes
FRAME = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (NUMEL,), np.ones(NUMEL, "<f4"))]), SALT)
BOUND = 2 * len(FRAME) + 64
STATE_WINDOW = 3

Script = Callable[[trio.SocketStream, bytes, bytes], Awaitable[None]]


def reply(nr: bytes, nc: bytes) -> bytes:
    """An ok reply carrying FRAME as the state of STATE_WINDOW, then the frame."""
    header = struct.pack("<IIIIqI", 0xF10D17E9, 2, 0, 1, STATE_WINDOW, 0)
    lengths = struct.pack("<I", len(FRAME))
    return header + lengths + SALT.mac8(header, b"", lengths, nr, nc) + lengths + FRAME


def entry(nr: bytes, nc: bytes, status: int, window: int) -> bytes:
    body = struct.pack("<IIIq", 0xF10D17ED, 2, status, window)
    return body + SALT.mac8(body, nr, nc)


async def serve_join(script: Script, stream: trio.SocketStream) -> None:
    """The controller's side up to the receipt, then ``script`` (what comes with the entry)."""
    async with stream:
        request = await receive_exactly(stream, 40)
        nr, nc = request[16:32], os.urandom(16)
        challenge = struct.pack("<II", 0xF10D17EA, 2) + nc
        await stream.send_all(challenge + SALT.mac8(challenge, nr))
        await receive_exactly(stream, 16)  # the answer
        await stream.send_all(reply(nr, nc))
        assert len(await receive_exactly(stream, 16)) == 16  # the receipt
        await script(stream, nr, nc)


async def join_against(script: Script) -> ClusterState:
    """``fetch_cluster_state`` against a fake controller that runs ``script``; its error as it is."""
    result: ClusterState | FlodlError | None = None
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, partial(serve_join, script), 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        try:
            result = await fetch_cluster_state(
                "127.0.0.1", port, 1, 2, SALT, bounds=NetBounds(controller_outage=0.0, connect_attempts=1),
            )
        except FlodlError as exc:
            result = exc
        nursery.cancel_scope.cancel()
    if isinstance(result, FlodlError):
        raise result
    assert result is not None
    return result


@pytest.fixture
def reserved(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The capacity every receive buffer the joiner makes reserves up front."""
    sizes: list[int] = []

    class Recorded(ReceiveBuffer):
        def __init__(self, capacity: int = 0) -> None:
            sizes.append(capacity)
            super().__init__(capacity)

    monkeypatch.setattr(client_state, "ReceiveBuffer", Recorded)
    return sizes


async def test_a_catch_up_prefix_reserves_nothing_before_its_bytes_arrive(reserved):
    """Entry status 2, then a catch-up prefix at the bound and ten bytes: the joiner
    reserved memory only for the frame the reply announced under its MAC."""
    async def lying_prefix(stream: trio.SocketStream, nr: bytes, nc: bytes) -> None:
        await stream.send_all(entry(nr, nc, 2, STATE_WINDOW + 2) + struct.pack("<I", BOUND) + b"0123456789")

    with trio.fail_after(20), pytest.raises(FlodlError, match="catch-up frame of window 4"):
        await join_against(lying_prefix)
    assert max(reserved) == len(FRAME), reserved


async def test_a_catch_up_prefix_above_the_bound_is_refused_before_buffering(reserved):
    async def too_long(stream: trio.SocketStream, nr: bytes, nc: bytes) -> None:
        await stream.send_all(entry(nr, nc, 2, STATE_WINDOW + 2) + struct.pack("<I", BOUND + 1))
        await trio.sleep_forever()

    with trio.fail_after(20), pytest.raises(FramingError, match="refused before buffering"):
        await join_against(too_long)
    assert reserved == [len(FRAME)]


async def test_a_catch_up_frame_at_the_bound_is_taken():
    """The bound itself is allowed: a signed frame of exactly 2 x the state's + 64 bytes."""
    numel = (BOUND - (len(FRAME) - 4 * NUMEL)) // 4
    big = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (numel,), np.full(numel, 2.0, "<f4"))]), SALT)
    assert len(big) <= BOUND

    async def one_frame(stream: trio.SocketStream, nr: bytes, nc: bytes) -> None:
        await stream.send_all(entry(nr, nc, 2, STATE_WINDOW + 2) + struct.pack("<I", len(big)) + big)

    with trio.fail_after(20):
        state = await join_against(one_frame)
    assert state.window == STATE_WINDOW and state.entry == STATE_WINDOW + 2
    assert [t.shape for t in state.catch_up[0].tensors] == [(numel,)]
