"""Moving protocol messages over trio streams, fast and with bounds.

* Reads go straight into reusable buffers (``recv_into`` on real sockets), grown
  only as bytes actually arrive, so a lying length prefix costs nothing.
* A message that stops making progress after its first byte is an error after
  :data:`MID_FRAME_STARVATION_S`; waiting for the *first* byte has no bound
  here (a round has no deadline), callers add one where they need it.
* Writes are shielded per message (a frame is never half-written by a
  cancellation) and each piece has the write-stall bound.

This module knows bytes and streams, not roles: relay, controller and client
all build on it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import trio

from ..errors import ConnectFailed, FramingError, PeerClosedMidFrame, PeerTimeout
from .constants import DEFAULT_FRAME_CEILING, MAC_LEN, MUX_HEADER_LEN
from .mux import (
    MuxHeader,
    MuxKind,
    encode_mux_record,
    mux_signed_header,
    parse_mux_header,
    verify_mux_payload,
)
from .netenv import (
    CONNECT_RETRY_ATTEMPTS,
    MID_FRAME_STARVATION_S,
    connect_retry_interval,
    warn_if_public_peer,
    write_stall_timeout,
)
from .round_frame import (
    EncodedFrame,
    RoundFrame,
    encode_round_frame_chunks,
    frame_body_chunks,
)
from .salt import Buffer, SessionSalt
from .tasks import sole_exception

T = TypeVar("T")
_U32 = struct.Struct("<I")
# First allocation of an empty receive buffer; it doubles from here as bytes arrive.
INITIAL_RECEIVE = 64 << 10
# Pieces a write is split into, so "no progress" can be told from "slow".
WRITE_PIECE = 4 << 20
# Inside a large message, a read waits for at least this many bytes.
RECEIVE_LOW_WATER = 256 << 10
# Consecutive chunks smaller than this are joined into one send.
SMALL_CHUNK = 64 << 10


class ReceiveBuffer:
    """A reusable receive buffer that grows as bytes arrive, never ahead of them.

    Capacity is kept between messages, so steady-state rounds allocate nothing.
    Growth is geometric from a small start (the filled part is copied at most
    about once overall) and never reserves more than ``max(filled, 64 KiB)``
    bytes beyond what the peer has actually sent: a lying length prefix costs
    nothing until the bytes really arrive.
    """

    def __init__(self, capacity: int = 0) -> None:
        """``capacity``: bytes to reserve now, only for a size already proven (a verified frame)."""
        self._array = np.empty(capacity, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        return self._array.size

    def writable(self, filled: int, total: int) -> memoryview:
        """A view of ``[filled, cap)`` where ``cap <= total``, growing if full."""
        if filled >= self._array.size:
            new_cap = min(total, max(INITIAL_RECEIVE, 2 * filled, self._array.size + 1))
            grown = np.empty(new_cap, dtype=np.uint8)
            grown[:filled] = self._array[:filled]
            self._array = grown
        end = min(total, self._array.size)
        return self._array.data[filled:end]

    def view(self, n: int) -> memoryview:
        return self._array.data[:n]

    def reserve(self, n: int) -> None:
        """At least ``n`` bytes of capacity, contents discarded: only for a size
        already proven (computed from verified frames)."""
        if self._array.size < n:
            self._array = np.empty(n, dtype=np.uint8)


class BufferPool:
    """A small set of receive buffers shared by many readers.

    Taking a buffer before receiving a payload bounds memory by the pool size,
    whatever the number of peers; peers beyond it wait in TCP backpressure.
    The pool starts with ``size`` buffers and may be given more with
    :meth:`add`, up to ``limit``.
    """

    def __init__(self, size: int, *, limit: int | None = None) -> None:
        self.size = size
        self.limit = max(size, limit or 0)
        self._send, self._receive = trio.open_memory_channel[ReceiveBuffer](self.limit)
        for _ in range(size):
            self._send.send_nowait(ReceiveBuffer())

    def add(self, buf: ReceiveBuffer) -> None:
        """One more buffer for the pool; a pool already at its limit refuses it."""
        if self.size >= self.limit:
            raise RuntimeError(f"buffer pool already holds its limit of {self.limit} buffers")
        self.size += 1
        self._send.send_nowait(buf)

    async def acquire(self) -> ReceiveBuffer:
        return await self._receive.receive()

    def try_acquire(self) -> ReceiveBuffer | None:
        """A free buffer now, or None."""
        try:
            return self._receive.receive_nowait()
        except trio.WouldBlock:
            return None

    def release(self, buf: ReceiveBuffer) -> None:
        self._send.send_nowait(buf)


class RunningMac:
    """An HMAC over bytes ``[0, end)`` of a message, fed chunk by chunk as they arrive,
    so verifying a frame costs no second pass over it (and overlaps the network)."""

    __slots__ = ("end", "mac")

    def __init__(self, mac: Any, end: int) -> None:
        self.mac = mac
        self.end = end

    def feed(self, chunk: memoryview, offset: int) -> None:
        stop = min(offset + len(chunk), self.end)
        if stop > offset:
            self.mac.update(chunk[: stop - offset])

    def tag(self) -> bytes:
        return self.mac.digest()[:MAC_LEN]


class ArrivalWatch:
    """How much of a message being received has landed, for tasks that work on it
    while it arrives (forwarding it, signing it, computing from it) and must not
    let anything out before it is verified.

    The receiving task calls :meth:`advance` as bytes land, then exactly one of
    :meth:`verified` or :meth:`abort`; watchers step through the arrival with
    :meth:`landed_past` and end with :meth:`wait_done`.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.filled = 0
        self.done = False
        self.ok = False
        self._changed = trio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def advance(self, filled: int) -> None:
        self.filled = filled
        self._wake()

    def verified(self) -> None:
        self.done, self.ok = True, True
        self._wake()

    def abort(self) -> None:
        self.done = True
        self._wake()

    async def wait_past(self, n: int) -> None:
        """Until more than ``n`` bytes have landed, or the message ended either way."""
        while self.filled <= n and not self.done:
            await self._changed.wait()

    async def landed_past(self, pos: int, *, step: int | None = None, stop: int | None = None) -> int | None:
        """Once more than ``pos`` bytes have landed, how far a watcher may now work: at
        most ``step`` bytes past ``pos`` and never past ``stop`` (default: the whole
        message). None when there is no more: ``stop`` reached, or the receive
        failed (``ok`` tells which). Yields to the event loop at least once, so a
        burst of landed bytes is worked through a step at a time."""
        stop = self.length if stop is None else stop
        if pos >= stop:
            return None
        if self.filled > pos or self.done:
            await trio.lowlevel.checkpoint()
        else:
            await self.wait_past(pos)
        if (self.done and not self.ok) or self.filled <= pos:
            return None
        return min(self.filled, stop, pos + step if step is not None else stop)

    async def wait_done(self) -> None:
        while not self.done:
            await self._changed.wait()


async def receive_followed(
    watch: ArrivalWatch, receive: Callable[[], Awaitable[T]], *followers: Callable[[], Awaitable[None]]
) -> T:
    """Run ``receive`` (which advances ``watch``) with ``followers`` working beside it.

    The watch is marked verified when ``receive`` returns (it verifies before
    returning) and aborted if it raises, so a follower never acts on bytes that
    failed; the receive's own error comes out unwrapped.
    """
    result: list[T] = []
    try:
        async with trio.open_nursery() as nursery:
            for follower in followers:
                nursery.start_soon(follower)
            try:
                result.append(await receive())
            except BaseException:
                watch.abort()
                raise
            watch.verified()
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None
    return result[0]


async def hash_as_it_lands(buf: ReceiveBuffer, watch: ArrivalWatch, mac: RunningMac) -> bool:
    """Feed ``mac`` the message ``watch`` follows, as its bytes land in ``buf``
    (a follower for :func:`receive_followed`); True once every byte was fed and
    the receive verified, False if it failed."""
    fed = 0
    async with _mac_feeder(mac, watch.length) as feed:
        assert feed is not None
        while (upto := await watch.landed_past(fed)) is not None:
            await feed(buf.view(upto)[fed:], fed)
            fed = upto
    await watch.wait_done()
    return watch.ok and fed == watch.length


OnBytes = Callable[[memoryview, int], Awaitable[None]]
# Messages at least this big are hashed by a worker thread while the event loop
# keeps moving bytes (hashlib releases the GIL), in slices of HASH_SLICE.
THREADED_HASH_MIN = 4 << 20
HASH_SLICE = 1 << 20
HASH_BACKLOG = 4


@asynccontextmanager
async def _mac_feeder(mac: RunningMac | None, length: int) -> AsyncIterator[OnBytes | None]:
    """How a receive or send feeds ``mac``: inline for small messages, through a
    worker thread for big ones (so hashing overlaps the socket on another core)."""
    if mac is None or length < THREADED_HASH_MIN:
        if mac is None:
            yield None
            return
        inline = mac.feed

        async def feed_inline(chunk: memoryview, offset: int) -> None:
            inline(chunk, offset)

        yield feed_inline
        return
    # A short queue: a reader that outruns the hash waits for it, so the views
    # held in the queue (which pin a receive buffer that has since grown) stay few.
    send, receive = trio.open_memory_channel[list[tuple[memoryview, int]]](HASH_BACKLOG)
    batch: list[tuple[memoryview, int]] = []
    batched = 0

    async def feed(chunk: memoryview, offset: int) -> None:
        nonlocal batch, batched
        batch.append((chunk, offset))
        batched += len(chunk)
        if batched >= HASH_SLICE:
            ready, batch, batched = batch, [], 0
            await send.send(ready)

    def hash_batch(items: list[tuple[memoryview, int]]) -> None:
        for chunk, offset in items:
            mac.feed(chunk, offset)

    async def worker() -> None:
        async for items in receive:
            await trio.to_thread.run_sync(hash_batch, items)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker)
            try:
                yield feed
                if batch:
                    await send.send(batch)
            finally:
                send.close()
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None


class MessageStream:
    """A trio stream plus the protocol's framing, bounds and fast paths."""

    def __init__(self, stream: trio.abc.Stream, peer: str = "peer") -> None:
        self.stream = stream
        self.peer = peer
        sock = getattr(stream, "socket", None)
        self._sock: trio.socket.SocketType | None = sock if isinstance(stream, trio.SocketStream) else None
        self._small = bytearray(8)
        self._low_water = 1
        self.bytes_received = 0
        self.bytes_sent = 0

    # -- receiving -----------------------------------------------------------

    async def _recv_into(self, view: memoryview) -> int:
        if self._sock is not None:
            n = await self._sock.recv_into(view)
        else:
            data = await self.stream.receive_some(len(view))
            n = len(data)
            view[:n] = data
        self.bytes_received += n
        return n

    async def _fill(
        self, view: memoryview, filled: int, what: str, total: int, on_bytes: OnBytes | None = None
    ) -> int:
        """Receive into ``view`` until full; EOF or starvation here is mid-message.

        ``on_bytes(chunk, offset)`` sees every chunk as it lands (MACs are fed this way).
        """
        pos = 0
        while pos < len(view):
            self._wake_for(total - filled - pos)
            n = -1
            with trio.move_on_after(MID_FRAME_STARVATION_S):
                n = await self._recv_into(view[pos:])
            if n < 0:
                raise PeerTimeout(
                    f"{self.peer}: no progress for {MID_FRAME_STARVATION_S:.0f} s inside {what} "
                    f"after {filled + pos} of {total} bytes"
                )
            if n == 0:
                raise PeerClosedMidFrame(
                    f"{self.peer} closed the connection mid-frame: {what} ended after "
                    f"{filled + pos} of {total} bytes"
                )
            if on_bytes is not None:
                await on_bytes(view[pos:pos + n], filled + pos)
            pos += n
        return filled + pos

    def _wake_for(self, remaining: int) -> None:
        """Inside a large message, have the kernel wake us only once RECEIVE_LOW_WATER
        bytes are waiting (SO_RCVLOWAT): far fewer, fuller reads on a slow link.
        Back to 1 for the message's last stretch, so its end and the next
        message's header are read the moment they land."""
        want = RECEIVE_LOW_WATER if remaining >= 2 * RECEIVE_LOW_WATER else 1
        if want != self._low_water and self._sock is not None:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self._low_water = want

    async def receive_into(self, view: memoryview, what: str, mac: RunningMac | None = None) -> None:
        """Fill a caller-owned view completely (feeding ``mac``); EOF or starvation is an error."""
        async with _mac_feeder(mac, len(view)) as feed:
            await self._fill(view, 0, what, len(view), feed)

    async def receive_exactly(self, n: int, what: str) -> bytes:
        """Small fixed-size reads (headers, handshakes): EOF anywhere is an error."""
        view = memoryview(bytearray(n))
        await self._fill(view, 0, what, n)
        return bytes(view)

    async def receive_first(self, view: memoryview, what: str) -> bool:
        """Fill ``view``; False on a clean EOF before its first byte (no bound on the wait)."""
        n = await self._recv_into(view)
        if n == 0:
            return False
        if n < len(view):
            await self._fill(view[n:], n, what, len(view))
        return True

    async def receive_into_buffer(
        self,
        buf: ReceiveBuffer,
        length: int,
        what: str,
        mac: RunningMac | None = None,
        watch: ArrivalWatch | None = None,
    ) -> memoryview:
        """Receive ``length`` bytes into ``buf`` (growing it as they arrive), feeding
        ``mac`` and advancing ``watch`` chunk by chunk."""
        filled = 0
        async with _mac_feeder(mac, length) as feed:
            on_bytes = feed if watch is None else _watched(feed, watch)
            while filled < length:
                filled = await self._fill(buf.writable(filled, length), filled, what, length, on_bytes)
        return buf.view(length)

    async def receive_round_frame_body(
        self, buf: ReceiveBuffer, length: int, salt: SessionSalt, what: str, watch: ArrivalWatch | None = None
    ) -> tuple[memoryview, bytes]:
        """A length-framed RoundFrame's bytes, and the MAC of all but its last 8 bytes
        (the frame's tag) computed as they arrived - ready for ``decode_round_frame``.

        ``watch`` follows the arrival (the caller marks it verified or aborted)."""
        mac = RunningMac(salt.hmac(), max(length - MAC_LEN, 0))
        body = await self.receive_into_buffer(buf, length, what, mac, watch)
        return body, mac.tag()

    async def receive_length_prefix(self, ceiling: int = DEFAULT_FRAME_CEILING) -> int | None:
        """The next length prefix, or None on a clean EOF; oversize refused before buffering."""
        head = memoryview(self._small)[:4]
        if not await self.receive_first(head, "a length prefix"):
            return None
        (length,) = _U32.unpack(head)
        if length > ceiling:
            raise FramingError(
                f"{self.peer}: length prefix {length} exceeds the frame ceiling {ceiling}; "
                "refused before buffering"
            )
        return length

    async def receive_len_framed(self, buf: ReceiveBuffer, ceiling: int = DEFAULT_FRAME_CEILING) -> memoryview | None:
        """One length-framed message into ``buf``; None on clean EOF."""
        length = await self.receive_length_prefix(ceiling)
        if length is None:
            return None
        return await self.receive_into_buffer(buf, length, f"a {length}-byte message")

    async def receive_mux_header(self, ceiling: int = DEFAULT_FRAME_CEILING) -> MuxHeader | None:
        head = memoryview(bytearray(MUX_HEADER_LEN))
        if not await self.receive_first(head, "a MuxRecord header"):
            return None
        return parse_mux_header(head, ceiling=ceiling, source=self.peer)

    async def receive_mux_payload(
        self, header: MuxHeader, buf: ReceiveBuffer, salt: SessionSalt, watch: ArrivalWatch | None = None
    ) -> tuple[MuxKind, memoryview]:
        """The record's payload into ``buf``, MAC-verified while it arrives, kind checked after the MAC.

        ``watch`` follows the arrival (the caller marks it verified or aborted).
        """
        running = salt.hmac()
        running.update(header.signed)
        mac = RunningMac(running, header.length)
        what = f"a {header.length}-byte MuxRecord payload"
        payload = await self.receive_into_buffer(buf, header.length, what, mac, watch)
        kind = verify_mux_payload(header, payload, salt, source=self.peer, tag=mac.tag())
        return kind, payload

    # -- sending -------------------------------------------------------------

    async def send_chunks(self, chunks: Sequence[Buffer]) -> None:
        """Write one message; shielded so it is never half-written, each piece stall-bounded."""
        stall = write_stall_timeout()
        with trio.CancelScope(shield=True):
            for piece in _pieces(chunks):
                await self._send_piece(piece, stall)

    async def send_piece(self, piece: Buffer) -> None:
        """Write one piece of a message that is being forwarded as it arrives.

        Not shielded: the caller owns the message's integrity (a forwarder that
        is cancelled half-way closes the connection).
        """
        await self._send_piece(piece, write_stall_timeout())

    async def _send_piece(self, piece: Buffer, stall: float) -> None:
        with trio.move_on_after(stall) as scope:
            await self.stream.send_all(piece)
        if scope.cancelled_caught:
            raise PeerTimeout(
                f"{self.peer}: write stalled for {stall:.0f} s (peer not reading); "
                f"{self.bytes_sent} bytes sent on this connection so far"
            )
        self.bytes_sent += len(piece)

    async def send_len_framed(self, chunks: Sequence[Buffer], nbytes: int) -> None:
        await self.send_chunks([_U32.pack(nbytes), *chunks])

    async def send_signed_frame(self, body: EncodedFrame, salt: SessionSalt) -> None:
        """Send ``prefix | body | MAC8(body)`` (a rank's RoundFrame).

        The frame's MAC comes last, so a large body streams out while a worker
        thread hashes it: the send and the hash overlap instead of adding up.
        """
        total = body.nbytes + MAC_LEN
        if body.nbytes < THREADED_HASH_MIN:
            await self.send_len_framed([*body.chunks, salt.mac8_of(body.chunks)], total)
            return
        mac = RunningMac(salt.hmac(), body.nbytes)
        stall = write_stall_timeout()
        with trio.CancelScope(shield=True):
            await self._send_piece(_U32.pack(total), stall)
            async with _mac_feeder(mac, body.nbytes) as feed:
                assert feed is not None
                offset = 0
                for piece in _pieces(body.chunks):
                    await feed(memoryview(piece), offset)
                    await self._send_piece(piece, stall)
                    offset += len(piece)
            await self._send_piece(mac.tag(), stall)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    async def finish_gracefully(self) -> None:
        """Half-close and drain until the peer closes too.

        Closing with unread bytes makes the kernel send a reset, and a reset can
        destroy data the peer has not read yet - such as our last message to it.
        The caller bounds the wait.
        """
        if isinstance(self.stream, trio.abc.HalfCloseableStream):
            try:
                await self.stream.send_eof()
                while await self.stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass


def _watched(feed: OnBytes | None, watch: ArrivalWatch) -> OnBytes:
    """``feed`` (the MAC) first, then tell ``watch`` how far the message has arrived."""

    async def on_bytes(chunk: memoryview, offset: int) -> None:
        if feed is not None:
            await feed(chunk, offset)
        watch.advance(offset + len(chunk))

    return on_bytes


def _pieces(chunks: Sequence[Buffer]) -> list[Buffer]:
    """Join small neighbours, split big ones into WRITE_PIECE views."""
    out: list[Buffer] = []
    small = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B") if not isinstance(chunk, memoryview) or chunk.format != "B" else chunk
        if len(view) < SMALL_CHUNK:
            small += view
            continue
        if small:
            out.append(bytes(small))
            small = bytearray()
        out.extend(view[i:i + WRITE_PIECE] for i in range(0, len(view), WRITE_PIECE))
    if small:
        out.append(bytes(small))
    return out


# Below this, two worker threads cost more than the hashing they would split.
PARALLEL_SIGN_MIN = 1 << 20


async def encode_enveloped_frame(kind: MuxKind, frame: RoundFrame, salt: SessionSalt) -> EncodedFrame:
    """A RoundFrame signed and wrapped in a MuxRecord (HostFrame or Broadcast).

    The frame's MAC and the record's MAC cover the same bytes; for a large
    frame the two passes run in two worker threads at once (hashlib releases
    the GIL), halving the time this step holds the round up.
    """
    body = frame_body_chunks(frame)
    if body.nbytes < PARALLEL_SIGN_MIN:
        return encode_mux_record(kind, encode_round_frame_chunks(frame, salt), salt)
    signed = mux_signed_header(kind, body.nbytes + MAC_LEN)
    frame_mac, record_mac = salt.hmac(), salt.hmac()
    record_mac.update(signed)

    def hash_body(mac: Any) -> None:
        for chunk in body.chunks:
            mac.update(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, hash_body, frame_mac)
        nursery.start_soon(trio.to_thread.run_sync, hash_body, record_mac)
    tag = frame_mac.digest()[:MAC_LEN]
    record_mac.update(tag)
    header = signed + record_mac.digest()[:MAC_LEN]
    return EncodedFrame([header, *body.chunks, tag], MUX_HEADER_LEN + body.nbytes + MAC_LEN)


def tune_socket(stream: trio.abc.Stream) -> None:
    """TCP_NODELAY (ping-pong latency) and keepalive (find partitioned peers)."""
    if isinstance(stream, trio.SocketStream):
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, True)


def peer_host(stream: trio.abc.Stream) -> str:
    if isinstance(stream, trio.SocketStream):
        try:
            return str(stream.socket.getpeername()[0])
        except OSError:
            return "?"
    return "in-memory"


async def connect_with_retry(
    host: str,
    port: int,
    what: str,
    *,
    attempts: int = CONNECT_RETRY_ATTEMPTS,
    interval: float | None = None,
) -> trio.SocketStream:
    """Dial ``host:port``, retrying while the peer is not up yet; ConnectFailed after the budget."""
    delay = connect_retry_interval() if interval is None else interval
    last: OSError | None = None
    for attempt in range(max(attempts, 1)):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            last = exc
            if attempt + 1 < attempts:
                await trio.sleep(delay)
            continue
        tune_socket(stream)
        warn_if_public_peer(what, peer_host(stream))
        return stream
    raise ConnectFailed(
        f"{what}: connect to {host}:{port} failed after {attempts} attempts "
        f"{delay:.2f} s apart: {last}"
    )
