"""What a (re)starting rank fetches to start from the cluster's consensus.

The controller keeps the consensus of the last completed window exactly as
the ranks received it. A rank asks for it through its host's relay (which
pipes the connection to the controller): a signed request, the controller's
challenge, the rank's answer, then the state; the rank says it has every
frame, and the controller lets it into its host's barrier at the next window
boundary and says which window that is. Every step is bound to both sides'
fresh nonces and each frame carries its own MAC, so a rank with another salt
gets nothing, and a tampered or replayed exchange is refused in either
direction. See docs/wire.md ("The join exchange").
"""

from __future__ import annotations

import logging
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
from ..transport.settings import DEFAULT_CONTROLLER_OUTAGE, NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..wire.constants import DEFAULT_FRAME_CEILING, MAC_LEN
from ..wire.fragment import piece_range
from ..wire.round_frame import RoundFrame, check_payloads, decode_round_frame
from ..wire.salt import SessionSalt
from ..wire.state import (
    STATE_CHALLENGE_LEN,
    STATE_ENTRY_LEN,
    STATE_REPLY_HEADER_LEN,
    EntryStatus,
    JoinNonces,
    StateReply,
    StateStatus,
    decode_state_challenge,
    decode_state_entry,
    decode_state_reply,
    decode_state_reply_header,
    encode_state_answer,
    encode_state_receipt,
    encode_state_request,
    new_nonce,
    state_reply_tail_len,
)



log = logging.getLogger("flodl_trio.client")


class _StateLost(FlodlError):
    """The state connection closed or broke before the exchange ended (the relay's pipe
    to the controller broke: the controller may be coming back)."""

@attrs.frozen
class ClusterState:
    """The last completed window's consensus: ``window`` is its index (-1 with no frames:
    no window has completed yet); ``frames`` are what every rank adopted, in order: the
    params (one frame, or one per fragment), then the float buffers if the model has any.
    ``entry`` is the first window the rank runs in its host's barrier: ``window + 1``
    when it entered at once, later when windows finished while its state travelled
    (it is then :attr:`behind`)."""

    window: int
    frames: tuple[RoundFrame, ...] = ()
    nbytes: int = 0  # the frames' bytes on the wire
    transfer_seconds: float = 0.0  # from the reply's header to its last byte (not the wait before)
    entry: int = attrs.field()
    # A delta run's params consensus of each window between the state's and the entry
    # (docs/wire.md, "Delta rounds"): what brings the state up to its host's base.
    catch_up: tuple[RoundFrame, ...] = attrs.field(default=(), kw_only=True)

    @entry.default
    def _entered_next(self) -> int:
        return self.window + 1

    @property
    def behind(self) -> bool:
        """Windows finished between the state's and the rank's entry: its params are older
        than its host's, so its first window of each fragment must carry no work (it
        takes that window's consensus and contributes from the next; average_window
        does this by itself)."""
        return self.entry > self.window + 1 and not self.catch_up

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
        # Any sequence of ints is a shape (a list, a torch.Size): compared as tuples.
        params = [tuple(int(d) for d in shape) for shape in params]
        buffers = [tuple(int(d) for d in shape) for shape in buffers]
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

    A fresh cluster answers at once (window -1, nothing to load). A rank
    coming back gets the newest finished window's consensus as soon as its
    relay has asked it back in, while the others train on; it then waits
    for the next window boundary, where the controller lets it into its
    host's barrier (:attr:`ClusterState.entry`). Both waits are a round's
    wait, each bounded by ``reply_timeout`` if given. Raises
    :class:`JoinRefused` with the controller's reason if it may not join.
    A state connection that breaks after the controller answered the request
    (the controller died) is opened again, for up to ``bounds.controller_outage``
    (None: the default a controller with a resume record announces): a
    controller that comes back takes the request.
    """
    outage = DEFAULT_CONTROLLER_OUTAGE if bounds.controller_outage is None else bounds.controller_outage
    give_up_at = trio.current_time() + outage
    while True:
        try:
            return await _fetch_once(host, port, rank, world_size, salt, bounds, connect, ceiling, reply_timeout)
        except _StateLost as exc:
            if trio.current_time() >= give_up_at:
                raise
            log.warning("rank %d: %s; asking again (the controller may be coming back)", rank, exc)
            await trio.sleep(bounds.connect_interval)


async def _fetch_once(
    host: str, port: int, rank: int, world_size: int, salt: SessionSalt, bounds: NetBounds, connect: Connector,
    ceiling: int, reply_timeout: float | None,
) -> ClusterState:
    """One state exchange, from the request to the entry window."""
    where = f"data relay {host}:{port}"
    stream = await connect_with_retry(host, port, f"rank {rank} -> data relay (state)", bounds, connect)
    conn = MessageStream(stream, f"{where} (state)", bounds)
    try:
        return await _exchange(conn, rank, world_size, salt, ceiling, reply_timeout, where)
    except CONNECTION_LOST as exc:
        raise _StateLost(f"rank {rank}: the state connection through {where} broke: {exc}") from exc
    finally:
        await conn.aclose()


async def _exchange(
    conn: MessageStream, rank: int, world_size: int, salt: SessionSalt, ceiling: int, reply_timeout: float | None,
    where: str,
) -> ClusterState:
    """The request, the challenge answered, the state, the receipt, the entry window."""
    nonce = new_nonce()
    await conn.send_chunks([encode_state_request(rank, world_size, nonce, salt)])
    nonces = await _receive_challenge(conn, rank, nonce, salt, where)
    await conn.send_chunks([encode_state_answer(rank, nonces, salt)])
    reply = await _receive_reply(conn, rank, nonces, salt, reply_timeout, where)
    if reply.status is StateStatus.REFUSED:
        raise JoinRefused(f"rank {rank} may not join: {reply.reason}")
    started, received = trio.current_time(), conn.bytes_received
    frames = [
        await _receive_frame(conn, rank, f"state frame {index}", length, salt, ceiling)
        for index, length in enumerate(reply.lengths)
    ]
    seconds = trio.current_time() - started
    nbytes = conn.bytes_received - received
    if not frames:
        return ClusterState(reply.window, (), nbytes, seconds)
    await conn.send_chunks([encode_state_receipt(nonces, salt)])
    entry, status = await _receive_entry(conn, rank, nonces, salt, reply_timeout, where)
    catch_up: list[RoundFrame] = []
    if status is EntryStatus.CATCH_UP:
        # No frame of a window's params round is more than twice its f32 frame (a
        # code's block scale per element at worst), so that bounds each read (and
        # the frame ceiling does, as it bounds every frame).
        bound = min(2 * reply.lengths[0] + 64, ceiling)
        for window in range(reply.window + 1, entry):
            catch_up.append(await _receive_frame(conn, rank, f"catch-up frame of window {window}", None, salt, bound))
    return ClusterState(reply.window, tuple(frames), nbytes, seconds, entry, catch_up=tuple(catch_up))


async def _receive_challenge(conn: MessageStream, rank: int, nonce: bytes, salt: SessionSalt, where: str) -> JoinNonces:
    """The controller's fresh nonce (it answers a request it verified at once)."""
    try:
        with trio.fail_after(conn.bounds.handshake):
            raw = await conn.receive_exactly(STATE_CHALLENGE_LEN, "the state challenge")
    except PeerClosedMidFrame as exc:
        raise FlodlError(
            f"rank {rank}: no state from the controller through {where}: the request was refused unread "
            "(a different session salt? see the controller's log) or the controller is gone"
        ) from exc
    except trio.TooSlowError as exc:
        raise PeerTimeout(
            f"rank {rank}: no state challenge through {where} within {conn.bounds.handshake:g} s"
        ) from exc
    return decode_state_challenge(raw, nonce, salt)


async def _receive_reply(
    conn: MessageStream, rank: int, nonces: JoinNonces, salt: SessionSalt, timeout: float | None, where: str
) -> StateReply:
    header = await _wait_for(conn, STATE_REPLY_HEADER_LEN, "the state reply", rank, timeout, where)
    _status, frames, _window, reason_len = decode_state_reply_header(header)
    with trio.fail_after(conn.bounds.handshake):
        tail = await conn.receive_exactly(state_reply_tail_len(frames, reason_len), "the state reply's tail")
    return decode_state_reply(header, tail, nonces, salt)


async def _receive_entry(
    conn: MessageStream, rank: int, nonces: JoinNonces, salt: SessionSalt, timeout: float | None, where: str
) -> tuple[int, EntryStatus]:
    """The window this rank enters its host's barrier at (the next boundary's), and how."""
    raw = await _wait_for(conn, STATE_ENTRY_LEN, "the state entry", rank, timeout, where)
    entry = decode_state_entry(raw, nonces, salt)
    if entry.status is EntryStatus.CALLED_OFF:
        raise JoinRefused(
            f"rank {rank}: the controller called its join off after sending its state "
            "(its data connection or relay left first, or - in a delta run - it fell too many "
            "windows behind; see the controller's log)"
        )
    return entry.window, entry.status


async def _wait_for(conn: MessageStream, n: int, what: str, rank: int, timeout: float | None, where: str) -> bytes:
    """A message that comes at a window boundary: a round's wait, bounded only by ``timeout``
    (the stall bound on a read in progress starts at its first byte, not before: a
    window may take far longer than that bound)."""
    closed = (f"rank {rank}: the controller closed the state connection through {where} before {what} "
              "(it called the join off, or it is gone; see its log)")
    view = memoryview(bytearray(n))
    try:
        with trio.fail_after(math.inf if timeout is None else timeout):
            if not await conn.receive_first(view, what):
                raise _StateLost(closed)
    except PeerClosedMidFrame as exc:
        raise _StateLost(closed) from exc
    except trio.TooSlowError as exc:
        raise PeerTimeout(f"rank {rank}: no {what[4:]} through {where} within reply_timeout {timeout:g} s") from exc
    return bytes(view)


async def _receive_frame(
    conn: MessageStream, rank: int, what: str, announced: int | None, salt: SessionSalt, ceiling: int
) -> RoundFrame:
    """One consensus frame of the reply, its MAC checked as it arrives, into memory of
    the size the reply announced under its MAC (checked against the frame's prefix;
    a catch-up frame, announced by nobody, within ``ceiling``)."""
    length = await conn.receive_length_prefix(ceiling)
    if length is None:
        raise FramingError(f"rank {rank}: the state reply ended before {what}")
    if announced is not None and length != announced:
        raise FramingError(f"rank {rank}: {what} is {length} bytes, the reply announced {announced}")
    mac = RunningMac(salt.hmac(), max(length - MAC_LEN, 0))
    # A length the reply announced under its MAC is taken into memory at once; a
    # catch-up frame's prefix is under no MAC, so its buffer grows only as its
    # bytes arrive (a lying prefix costs nothing).
    buf = ReceiveBuffer(length) if announced is not None else ReceiveBuffer()
    body = await conn.receive_into_buffer(buf, length, what, mac)
    source = f"the cluster's {what}"
    frame = decode_round_frame(body, salt, source=source, mac_of_body=mac.tag(), ceiling=ceiling)
    check_payloads(frame, source)
    return frame


__all__ = ["ClusterState", "fetch_cluster_state"]
