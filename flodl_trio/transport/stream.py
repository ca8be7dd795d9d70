"""Moving protocol messages over trio streams, fast and with bounds.

* Reads go straight into reusable buffers (``recv_into`` on real sockets), grown
  only as bytes actually arrive, so a lying length prefix costs nothing.
* A message that stops making progress after its first byte is an error after
  the mid-frame starvation bound; waiting for the *first* byte has no bound
  here (a round has no deadline), callers add one where they need it.
* Writes are shielded per message (a frame is never half-written by a
  cancellation) and each piece has the write-stall bound.

This module knows bytes and streams, not roles: relay, controller and client
all build on it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import trio

from ..errors import FramingError, PeerClosedMidFrame, PeerTimeout
from ..wire.constants import DEFAULT_FRAME_CEILING, MAC_LEN, MUX_HEADER_LEN, UNSIGNED_TAG
from ..wire.mux import MuxHeader, MuxKind, parse_mux_header, verify_mux_payload
from ..wire.round_frame import EncodedFrame
from ..wire.salt import Buffer, SessionSalt
from .arrival import ArrivalWatch
from .buffers import ReceiveBuffer
from .hashing import THREADED_HASH_MIN, OnBytes, RunningMac, mac_feeder
from .settings import NetBounds

_U32 = struct.Struct("<I")
# Pieces a write is split into, so "no progress" can be told from "slow".
WRITE_PIECE = 4 << 20
# Inside a large message, a read waits for at least this many bytes.
RECEIVE_LOW_WATER = 256 << 10
# Consecutive chunks smaller than this are joined into one send.
SMALL_CHUNK = 64 << 10
# What a read or write raises when the peer went away or stopped moving: the
# connection is over. (Bytes that break the protocol are ProtocolErrors instead.)
CONNECTION_LOST = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, PeerClosedMidFrame, PeerTimeout)


class MessageStream:
    """A trio stream plus the protocol's framing, bounds and fast paths."""

    def __init__(self, stream: trio.abc.Stream, peer: str = "peer", bounds: NetBounds | None = None) -> None:
        self.stream = stream
        self.peer = peer
        self.bounds = bounds if bounds is not None else NetBounds()
        self._closed = trio.Event()
        sock = getattr(stream, "socket", None)
        self._sock: trio.socket.SocketType | None = sock if isinstance(stream, trio.SocketStream) else None
        self._small = bytearray(8)
        self._low_water = 1
        # False on the same-uid local leg, where round frames are neither signed
        # nor verified (docs/wire.md, "The local leg").
        self.signed_frames = True
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
            starvation = self.bounds.mid_frame_starvation
            with trio.move_on_after(starvation):
                n = await self._recv_into(view[pos:])
            if n < 0:
                raise PeerTimeout(
                    f"{self.peer}: no progress for {starvation:.0f} s inside {what} "
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
        # The last read may have taken a whole large stretch at once: never leave the
        # kernel waiting for RECEIVE_LOW_WATER bytes that a small next message lacks.
        self._wake_for(0)
        return filled + pos

    def _wake_for(self, remaining: int) -> None:
        """Inside a large message, have the kernel wake us only once RECEIVE_LOW_WATER
        bytes are waiting (SO_RCVLOWAT): far fewer, fuller reads on a slow link.
        Back to 1 for the message's last stretch, so its end and the next
        message's header are read the moment they land."""
        want = RECEIVE_LOW_WATER if remaining >= 2 * RECEIVE_LOW_WATER else 1
        if want != self._low_water and self._sock is not None and self._sock.family != socket.AF_UNIX:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self._low_water = want

    async def receive_into(self, view: memoryview, what: str, mac: RunningMac | None = None) -> None:
        """Fill a caller-owned view completely (feeding ``mac``); EOF or starvation is an error."""
        async with mac_feeder(mac, len(view)) as feed:
            await self._fill(view, 0, what, len(view), feed)

    async def receive_available(self, view: memoryview) -> int:
        """Whatever has arrived, up to ``len(view)`` bytes, into ``view``; 0 at EOF. No
        bound on the wait: for a byte pipe whose two ends keep the deadlines."""
        return await self._recv_into(view)

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
        async with mac_feeder(mac, length) as feed:
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
        length: int = _U32.unpack(head)[0]
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
        stall = self.bounds.write_stall
        with trio.CancelScope(shield=True):
            for piece in _pieces(chunks):
                await self._send_piece(piece, stall)

    async def send_piece(self, piece: Buffer) -> None:
        """Write one piece of a message that is being forwarded as it arrives.

        Not shielded: the caller owns the message's integrity (a forwarder that
        is cancelled half-way closes the connection).
        """
        await self._send_piece(piece, self.bounds.write_stall)

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
        stall = self.bounds.write_stall
        with trio.CancelScope(shield=True):
            await self._send_piece(_U32.pack(total), stall)
            async with mac_feeder(mac, body.nbytes) as feed:
                assert feed is not None
                offset = 0
                for piece in _pieces(body.chunks):
                    await feed(memoryview(piece), offset)
                    await self._send_piece(piece, stall)
                    offset += len(piece)
            await self._send_piece(mac.tag(), stall)

    async def send_frame(self, body: EncodedFrame, salt: SessionSalt) -> None:
        """Send a rank's RoundFrame the way this connection wants it: signed, or on
        the local leg with zeros where the MAC goes (nobody checks them there)."""
        if self.signed_frames:
            await self.send_signed_frame(body, salt)
        else:
            await self.send_len_framed([*body.chunks, UNSIGNED_TAG], body.nbytes + MAC_LEN)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()
        self._closed.set()

    @property
    def closed(self) -> bool:
        """Whether someone closed this stream (here: nothing more goes over it)."""
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Until someone closed this stream (a server's handler waits here while
        another task serves the connection)."""
        await self._closed.wait()

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
            except CONNECTION_LOST:
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
