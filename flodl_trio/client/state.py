"""What a (re)starting rank fetches to start from the cluster's consensus.

The controller keeps the consensus of the last completed window exactly as
the ranks received it. A rank asks for it through its host's relay (which
pipes the connection to the controller) with a request signed with the
session salt; the reply is bound to the request's fresh nonce and each frame
carries its own MAC, so a rank with another salt gets nothing and a tampered
or replayed reply is refused. See docs/wire.md ("State for joiners").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import trio

from ..errors import (
    FlodlError,
    FramingError,
    JoinRefused,
    PeerClosedMidFrame,
    PeerTimeout,
    SchemaError,
)
from ..transport.buffers import ReceiveBuffer
from ..transport.connect import Connector, connect_with_retry
from ..transport.hashing import RunningMac
from ..transport.settings import NetBounds
from ..transport.stream import MessageStream
from ..wire.constants import DEFAULT_FRAME_CEILING, MAC_LEN
from ..wire.fragment import piece_range
from ..wire.round_frame import RoundFrame, check_payloads, decode_round_frame
from ..wire.salt import SessionSalt
from ..wire.state import (
    STATE_REPLY_HEADER_LEN,
    StateReply,
    StateStatus,
    decode_state_reply,
    decode_state_reply_header,
    encode_state_request,
    new_nonce,
    state_reply_tail_len,
)


@attrs.frozen
class ClusterState:
    """The last completed window's consensus: ``window`` is its index (-1 with no frames:
    no window has completed yet); ``frames`` are what every rank adopted, in order: the
    params (one frame, or one per fragment), then the float buffers if the model has any."""

    window: int
    frames: tuple[RoundFrame, ...] = ()
    nbytes: int = 0  # the frames' bytes on the wire
    transfer_seconds: float = 0.0  # from the reply's header to its last byte (not the wait before)

    def split(
        self, params: Sequence[Shape], buffers: Sequence[Shape]
    ) -> tuple[list[RoundFrame], RoundFrame | None]:
        """The frames as (params frames, buffers frame) for a model whose parameters and
        float buffers have these shapes. The params come as one frame of whole tensors,
        or - from a cluster that syncs in P >= 2 fragments - as P frames of pieces,
        frame p holding run p of every parameter's elements (docs/wire.md, "fragment
        tag"); then at most one buffers frame. Every shape is checked here, before
        anything is copied; a SchemaError names the first tensor that does not fit and
        both shapes (or the counts, when not even those agree)."""
        frames = self.frames
        numels = [math.prod(shape) for shape in params]
        for count in (1, len(frames), len(frames) - 1):  # the whole model; fragments, with or without buffers
            head, rest = frames[:count], frames[count:]
            if count < 1 or len(rest) > 1 or (rest and buffers and len(rest[0].tensors) != len(buffers)):
                continue
            wanted = [_run_shapes(params, numels, p, count) for p in range(count)]
            if all(_shapes(frame) == shapes for frame, shapes in zip(head, wanted)):
                if rest and buffers and _shapes(rest[0]) != list(buffers):
                    raise SchemaError(self._first_difference(rest[0], list(buffers), "float buffer"))
                # A model without float buffers ignores the cluster's (as a window would not send them).
                return list(head), (rest[0] if rest and buffers else None)
        whole_model = 1 <= len(frames) <= 2 and len(frames[0].tensors) == len(params)
        if whole_model:  # one params frame whose count agrees: say which tensor differs
            raise SchemaError(self._first_difference(frames[0], list(params), "parameter"))
        counts = [len(f.tensors) for f in frames]
        raise SchemaError(
            f"the cluster's state of window {self.window} has frames of {counts} tensors; "
            f"this model has {len(params)} params and {len(buffers)} float buffers"
        )

    def _first_difference(self, frame: RoundFrame, shapes: list[Shape], what: str) -> str:
        got = _shapes(frame)
        index = next(i for i, (a, b) in enumerate(zip(got, shapes)) if a != b)
        return (
            f"the cluster's state of window {self.window} has {what} {index} of shape {list(got[index])}, "
            f"this model's {what} {index} has shape {list(shapes[index])}; nothing was copied"
        )


Shape = tuple[int, ...]


def _shapes(frame: RoundFrame) -> list[Shape]:
    return [tuple(t.shape) for t in frame.tensors]


def _run_shapes(shapes: Sequence[Shape], numels: Sequence[int], index: int, count: int) -> list[Shape]:
    """The shapes frame ``index`` of ``count`` carries: the parameters themselves when
    ``count`` is 1, else run ``index`` of every parameter's elements, flat."""
    if count == 1:
        return list(shapes)
    return [(stop - start,) for start, stop in (piece_range(n, count, index) for n in numels)]


async def fetch_cluster_state(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    salt: SessionSalt,
    *,
    bounds: NetBounds,
    connect: Connector = trio.open_tcp_stream,
    ceiling: int = DEFAULT_FRAME_CEILING,
    reply_timeout: float | None = None,
) -> ClusterState:
    """Ask the controller, through the data relay at ``host:port``, for the state to start from.

    A fresh cluster answers at once (window -1, nothing to load). For a rank
    coming back the answer waits for the next window boundary - the wait of
    a round, bounded by ``reply_timeout`` if given - where the controller
    also lets it into its host's barrier. Raises :class:`JoinRefused` with
    the controller's reason if it may not join.
    """
    stream = await connect_with_retry(host, port, f"rank {rank} -> data relay (state)", bounds, connect)
    conn = MessageStream(stream, f"data relay {host}:{port} (state)", bounds)
    try:
        nonce = new_nonce()
        await conn.send_chunks([encode_state_request(rank, world_size, nonce, salt)])
        reply = await _receive_reply(conn, rank, nonce, salt, reply_timeout, f"data relay {host}:{port}")
        if reply.status is StateStatus.REFUSED:
            raise JoinRefused(f"rank {rank} may not join: {reply.reason}")
        started, received = trio.current_time(), conn.bytes_received
        frames = [
            await _receive_frame(conn, rank, index, length, salt, ceiling) for index, length in enumerate(reply.lengths)
        ]
        seconds = trio.current_time() - started
    finally:
        await conn.aclose()
    return ClusterState(reply.window, tuple(frames), conn.bytes_received - received, seconds)


async def _receive_reply(
    conn: MessageStream, rank: int, nonce: bytes, salt: SessionSalt, timeout: float | None, where: str
) -> StateReply:
    try:
        with trio.fail_after(math.inf if timeout is None else timeout):
            header = await conn.receive_exactly(STATE_REPLY_HEADER_LEN, "the state reply")
    except PeerClosedMidFrame as exc:
        raise FlodlError(
            f"rank {rank}: no state from the controller through {where}: the request was refused unread "
            "(a different session salt? see the controller's log) or the controller is gone"
        ) from exc
    except trio.TooSlowError as exc:
        raise PeerTimeout(f"rank {rank}: no state reply through {where} within reply_timeout {timeout:g} s") from exc
    _status, frames, _window, reason_len = decode_state_reply_header(header)
    with trio.fail_after(conn.bounds.handshake):
        tail = await conn.receive_exactly(state_reply_tail_len(frames, reason_len), "the state reply's tail")
    return decode_state_reply(header, tail, nonce, salt)


async def _receive_frame(
    conn: MessageStream, rank: int, index: int, announced: int, salt: SessionSalt, ceiling: int
) -> RoundFrame:
    """One consensus frame of the reply, its MAC checked as it arrives, into memory of
    the size the reply announced under its MAC (checked against the frame's prefix)."""
    what = f"state frame {index}"
    length = await conn.receive_length_prefix(ceiling)
    if length is None:
        raise FramingError(f"rank {rank}: the state reply ended before {what}")
    if length != announced:
        raise FramingError(f"rank {rank}: {what} is {length} bytes, the reply announced {announced}")
    mac = RunningMac(salt.hmac(), max(length - MAC_LEN, 0))
    body = await conn.receive_into_buffer(ReceiveBuffer(length), length, what, mac)
    source = f"the cluster's {what}"
    frame = decode_round_frame(body, salt, source=source, mac_of_body=mac.tag(), ceiling=ceiling)
    check_payloads(frame, source)
    return frame


__all__ = ["ClusterState", "fetch_cluster_state"]
