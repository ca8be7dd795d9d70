"""A relay channel: K local rank connections in, one upstream connection out.

Task structure of one channel (all in one nursery)::

    rank socket r0 --> rank_reader(r0) --\\
    rank socket r1 --> rank_reader(r1) ---+--[outbound channel]--> outbound_writer --> controller
    rank socket rk --> rank_reader(rk) --/                          (sole upstream writer)

    controller --> upstream_reader --> fan-out to every rank socket (sole rank-socket writer)

The data channel folds (its round state is a :class:`HostFold`); the control
channel routes rank-tagged blobs without parsing them.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from ..errors import (
    DesyncError,
    FlodlError,
    MacError,
    ProtocolError,
    SchemaError,
)
from ..fold.speculative import SpeculativeFrame
from ..transport.arrival import ArrivalWatch, receive_with_followers
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.hashing import RunningMac, encode_enveloped_frame, hash_as_it_lands
from ..transport.stream import CONNECTION_LOST, WRITE_PIECE, MessageStream
from ..wire.constants import (
    CONTROL_FRAME_HEADER_LEN,
    CONTROL_FRAME_MAX_PAYLOAD,
    MAC_LEN,
    MUX_HEADER_LEN,
)
from ..wire.mux import (
    DeclareDead,
    MuxHeader,
    MuxKind,
    RankExit,
    RelayControlMsg,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
    mux_signed_header,
)
from ..wire.round_frame import EncodedFrame, RoundFrame, decode_round_frame
from ..wire.salt import Buffer
from .config import RelayConfig, RelayStats
from .host_fold import FoldedHostFrame, HostFold

log = logging.getLogger("flodl_trio.relay")

# Records queued toward the controller; a full queue back-pressures rank readers.
OUTBOUND_DEPTH = 16
# Model-sized receive buffers shared by all of a channel's readers. Two let two
# rank frames arrive and verify at once (their MACs hash on two cores); memory
# stays near three model sizes (these two + the f32 fold) for any number of ranks.
# The data channel starts with one and gets the second once a verified frame has
# shown the model's size, so the two never grow (and copy) at the same time.
RECEIVE_BUFFERS = 2

# A control-channel blob is one ControlFrame: 24-byte header + at most 16 MiB.
CONTROL_BLOB_CEILING = CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD
_U32 = struct.Struct("<I")


@attrs.frozen
class _RawHostFrame:
    """A single rank's verified frame, forwarded upstream byte for byte."""

    body: memoryview
    buffer: ReceiveBuffer


@attrs.frozen
class _SealedHostFrame:
    """A HostFrame record computed and signed while the round's last frame arrived;
    ``buffer`` (lent from the pool) holds it until it has been written."""

    record: EncodedFrame
    buffer: ReceiveBuffer


@attrs.frozen
class _FoldedHostFrame:
    """The host's fold, ready to sign and send; ``images`` (the fold's f32 sums, which
    its payloads may alias) go back to the fold's cache once it has been written."""

    frame: RoundFrame
    images: list[Any]


@attrs.define
class _AheadAttempt:
    """What finishing a HostFrame ahead of the last frame got to (see DataChannel)."""

    finisher: SpeculativeFrame | None = None
    out: ReceiveBuffer | None = None
    sealed: EncodedFrame | None = None


# What rank readers and the upstream reader hand the outbound writer (defined
# below): a folded frame, a single rank's frame verbatim, one sealed ahead, a
# control-channel blob, or a control message.
_Outbound = Any


class _Channel:
    """What both channel kinds share: the nursery, the sole upstream writer,
    the upstream read loop, local exits and shutdown-by-cancellation."""

    def __init__(self, config: RelayConfig, conns: dict[int, MessageStream], upstream: MessageStream, stats: RelayStats) -> None:
        self.config = config
        self.conns = conns
        self.upstream = upstream
        self.stats = stats
        self.gone: set[int] = set()
        self.reader_scopes = {rank: trio.CancelScope() for rank in conns}
        self.pool = BufferPool(1, limit=RECEIVE_BUFFERS)
        self._small = ReceiveBuffer()
        self._scope = trio.CancelScope()
        self._error: BaseException | None = None

    @property
    def live(self) -> set[int]:
        return set(self.conns) - self.gone

    async def run(self) -> None:
        """Run until upstream EOF or the last rank leaves; raise a fatal error if one happened."""
        send, receive = trio.open_memory_channel[_Outbound](OUTBOUND_DEPTH)
        self.stats.live_ranks = len(self.live)
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._guard, self._outbound_writer, receive)
                nursery.start_soon(self._guard, self._upstream_reader, send.clone())
                for rank in self.conns:
                    nursery.start_soon(self._guard, self._rank_reader, rank, send.clone())
                await send.aclose()
        await self.upstream.aclose()
        if self._error is not None:
            raise self._error

    async def _guard(self, task: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await task(*args)
        except FlodlError as exc:
            self._fail(exc)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(FlodlError(f"relay {self.config.host_name}: connection to the controller failed: {exc}"))

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._scope.cancel()

    def _shutdown(self, why: str) -> None:
        if not self._scope.cancel_called:
            log.info("relay %s: shutting down: %s", self.config.host_name, why)
        self._scope.cancel()

    # -- rank side -----------------------------------------------------------

    async def _rank_reader(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        async with out:
            reason = "closed its connection"
            with self.reader_scopes[rank]:
                try:
                    await self._read_rank(rank, out)
                except (ProtocolError, *CONNECTION_LOST) as exc:
                    if isinstance(exc, (SchemaError, DesyncError)):
                        raise
                    if isinstance(exc, MacError):
                        self.stats.mac_failures += 1
                    reason = f"dropped: {exc}"
            await self._rank_gone(rank, out, reason)

    async def _read_rank(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        raise NotImplementedError

    async def _rank_gone(self, rank: int, out: trio.MemorySendChannel[_Outbound], reason: str, *, report: bool = True) -> None:
        """A local rank left (EOF, error, write failure, or declared dead)."""
        if rank in self.gone:
            return
        self.gone.add(rank)
        self.stats.live_ranks = len(self.live)
        level = logging.WARNING if reason.startswith("dropped") else logging.INFO
        log.log(level, "relay %s: rank %d %s", self.config.host_name, rank, reason)
        self.reader_scopes[rank].cancel()
        await self._after_rank_gone(rank, out)
        if report:
            await out.send(RankExit(rank))
        await self.conns[rank].aclose()
        if not self.live:
            self._shutdown("every local rank has left")

    async def _after_rank_gone(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Channel-specific bookkeeping when a rank leaves (the data fold shrinks)."""

    async def _send_to_rank(self, rank: int, chunks: Sequence[Buffer], nbytes: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Deliver one length-framed message; a rank that cannot take it is gone."""
        try:
            await self.conns[rank].send_len_framed(chunks, nbytes)
        except CONNECTION_LOST as exc:
            await self._rank_gone(rank, out, f"could not take a message: {exc}")

    # -- upstream side -------------------------------------------------------

    async def _outbound_writer(self, inbox: trio.MemoryReceiveChannel[_Outbound]) -> None:
        async with inbox:
            async for item in inbox:
                await self._write_upstream(item)
                del item  # a sent HostFrame must not outlive its write while we wait for the next

    async def _write_upstream(self, item: _Outbound) -> None:
        salt = self.config.salt
        if isinstance(item, _DataRecord):
            record = encode_mux_record(MuxKind.DATA, item.payload, salt, rank=item.rank)
            self.stats.bytes_up += record.nbytes
        else:
            record = encode_mux_record(MuxKind.CONTROL, encode_control_msg(item), salt)  # type: ignore[arg-type]
        await self.upstream.send_chunks(record.chunks)

    async def _upstream_reader(self, out: trio.MemorySendChannel[_Outbound]) -> None:
        async with out:
            while True:
                header = await self.upstream.receive_mux_header(self.config.ceiling)
                if header is None:
                    self._shutdown("the controller closed the upstream connection")
                    return
                big = header.length > SMALL_MESSAGE
                buf = await self.pool.acquire() if big else self._small
                try:
                    await self._receive_record(header, buf, out)
                finally:
                    if big:
                        self.pool.release(buf)

    async def _receive_record(self, header: MuxHeader, buf: ReceiveBuffer, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Receive and verify one record from the controller, then act on it."""
        kind, payload = await self.upstream.receive_mux_payload(header, buf, self.config.salt)
        self.stats.bytes_down += header.length
        if kind is MuxKind.CONTROL:
            await self._on_control(decode_control_msg(payload), out)
        else:
            await self._on_record(kind, header.rank, payload, out)

    async def _on_record(self, kind: MuxKind, rank: int, payload: memoryview, out: trio.MemorySendChannel[_Outbound]) -> None:
        raise ProtocolError(
            f"relay {self.config.host_name}: controller sent a {kind.name} record on the {self.config.kind.value} channel"
        )

    async def _on_control(self, msg: RelayControlMsg, out: trio.MemorySendChannel[_Outbound]) -> None:
        if isinstance(msg, DeclareDead):
            if msg.rank in self.conns:
                await self._rank_gone(msg.rank, out, "declared dead by the controller; connection closed", report=False)
            return
        raise ProtocolError(f"relay {self.config.host_name}: unexpected {type(msg).__name__} from the controller mid-session")


@attrs.frozen
class _DataRecord:
    """A control-channel blob going upstream, tagged with its rank, never parsed."""

    rank: int
    payload: bytes


class ControlChannel(_Channel):
    """The control channel is a byte router: rank blobs <-> rank-tagged Data records."""

    async def _read_rank(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        conn = self.conns[rank]
        buf = ReceiveBuffer()
        while True:
            blob = await conn.receive_len_framed(buf, CONTROL_BLOB_CEILING)
            if blob is None:
                return
            self.stats.bytes_local += len(blob) + 4
            await out.send(_DataRecord(rank, bytes(blob)))

    async def _on_record(self, kind: MuxKind, rank: int, payload: memoryview, out: trio.MemorySendChannel[_Outbound]) -> None:
        if kind is not MuxKind.DATA:
            await super()._on_record(kind, rank, payload, out)
        elif rank in self.live:
            await self._send_to_rank(rank, [payload], len(payload), out)
        # else: the rank already left; its RankExit is on the way or delivered.


class DataChannel(_Channel):
    """The data channel folds: K local frames in, one HostFrame up, consensus fanned out."""

    def __init__(self, config: RelayConfig, conns: dict[int, MessageStream], upstream: MessageStream, stats: RelayStats) -> None:
        super().__init__(config, conns, upstream, stats)
        self.fold = HostFold(list(conns))
        self.single = len(config.ranks) == 1
        self.awaiting_reply: set[int] = set()
        self.second_buffer_lent = False
        # A HostFrame went up and its Broadcast has not come back: the only time one may.
        self.expecting_broadcast = False

    async def _read_rank(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        while True:
            length = await self.conns[rank].receive_length_prefix(self.config.ceiling)
            if length is None:
                return
            await self._take_frame(rank, length, out)

    async def _take_frame(self, rank: int, length: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Receive, verify and fold (or forward) one frame of ``rank``'s.

        A function of its own so nothing model-sized it touched (the fold a
        HostFrame was finished ahead from, say) outlives it while the reader
        waits for the rank's next frame.
        """
        buf = await self.pool.acquire()
        handed_off = False
        ahead = _AheadAttempt()
        try:
            what = f"rank {rank}'s {length}-byte frame"
            sealed: EncodedFrame | None = None
            if length > SMALL_MESSAGE and self.single:
                body, frame, sealed = await self._receive_signing_record(rank, buf, length, what)
            elif length > SMALL_MESSAGE:
                body, frame = await self._receive_finishing_ahead(rank, buf, length, what, ahead)
            else:
                body, frame = await self._receive_verified(rank, buf, length, what)
            if rank in self.awaiting_reply:
                raise DesyncError(
                    f"relay {self.config.host_name}: rank {rank} deposited twice in one round "
                    "(sent a frame before receiving the last consensus; stream desynced)"
                )
            self.awaiting_reply.add(rank)
            self.stats.bytes_local += length + 4
            self._lend_second_buffer(length)
            if self.single:
                self.stats.rounds_finished_ahead += sealed is not None
                await out.send(_SealedHostFrame(sealed, buf) if sealed is not None else _RawHostFrame(body, buf))
                handed_off = True
            elif self._commit_ahead(rank, ahead):
                assert ahead.sealed is not None and ahead.out is not None
                finished, ahead.out = _SealedHostFrame(ahead.sealed, ahead.out), None
                await out.send(finished)
            else:
                await self._deposit(rank, frame, out)
        finally:
            if not handed_off:
                self.pool.release(buf)
            if ahead.out is not None:
                self.pool.release(ahead.out)

    async def _receive_verified(
        self, rank: int, buf: ReceiveBuffer, length: int, what: str, watch: ArrivalWatch | None = None
    ) -> tuple[memoryview, RoundFrame]:
        """``rank``'s frame, its MAC computed as the bytes land and checked at the end."""
        salt = self.config.salt
        body, mac = await self.conns[rank].receive_round_frame_body(buf, length, salt, what, watch)
        frame = decode_round_frame(
            body, salt, ceiling=self.config.ceiling, source=f"rank {rank} on host {self.config.host_name}",
            mac_of_body=mac,
        )
        return body, frame

    async def _receive_finishing_ahead(
        self, rank: int, buf: ReceiveBuffer, length: int, what: str, ahead: _AheadAttempt
    ) -> tuple[memoryview, RoundFrame]:
        """Receive and verify ``rank``'s frame; as soon as it is the last one the host
        waits for, compute and sign the HostFrame beside it (into ``ahead``)."""
        watch = ArrivalWatch(length)
        waiting = trio.CancelScope()
        salt = self.config.salt

        async def finish() -> None:
            with waiting:
                while not self.fold.only_missing(rank):
                    await self.fold.changed.wait()
                # Nothing else arrives now: the pool's other buffer is free to hold the output.
                ahead.out = self.pool.try_acquire()
                if ahead.out is None:
                    return
                finisher = SpeculativeFrame(self.fold.acc, divide=False, in_length=length, out=ahead.out)
                if not finisher.supported:
                    return
                ahead.finisher = finisher
            if ahead.finisher is not None:
                ahead.sealed = await ahead.finisher.follow(buf, watch, MuxKind.HOST_FRAME, salt)

        async def receive() -> tuple[memoryview, RoundFrame]:
            try:
                return await self._receive_verified(rank, buf, length, what, watch)
            finally:
                waiting.cancel()  # not the last frame by now: too late to help

        return await receive_with_followers(watch, receive, finish)

    async def _receive_signing_record(
        self, rank: int, buf: ReceiveBuffer, length: int, what: str
    ) -> tuple[memoryview, RoundFrame, EncodedFrame | None]:
        """A single rank's frame goes up byte for byte as the host's frame: receive and
        verify it while the HostFrame record's MAC is computed over the same bytes,
        so the record is ready the moment the frame verifies (None if it did not)."""
        salt = self.config.salt
        watch = ArrivalWatch(length)
        signed = mux_signed_header(MuxKind.HOST_FRAME, length)
        record_mac = salt.hmac()
        record_mac.update(signed)
        running = RunningMac(record_mac, length)
        signed_ok: list[bool] = []

        async def sign() -> None:
            signed_ok.append(await hash_as_it_lands(buf, watch, running))

        body, frame = await receive_with_followers(watch, partial(self._receive_verified, rank, buf, length, what, watch), sign)
        if not (signed_ok and signed_ok[0]):
            return body, frame, None
        return body, frame, EncodedFrame([signed + running.tag(), body], MUX_HEADER_LEN + length)

    def _commit_ahead(self, rank: int, ahead: _AheadAttempt) -> bool:
        """Whether the HostFrame finished ahead closes the round (it was computed from
        exactly the frames folded so far plus ``rank``'s, now verified)."""
        if ahead.finisher is None or ahead.sealed is None:
            return False
        if not self.fold.complete_ahead(rank, ahead.finisher.acc):
            return False
        self.stats.rounds_finished_ahead += 1
        return True

    def _lend_second_buffer(self, verified_length: int) -> None:
        """Once a verified frame proved the model's size, let frames arrive two at a time
        (a single rank has nothing to overlap)."""
        if not self.second_buffer_lent and not self.single:
            self.second_buffer_lent = True
            self.pool.add(ReceiveBuffer(verified_length))

    async def _deposit(self, rank: int, frame: RoundFrame, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Fold a verified frame; ship the host's frame if it completed the round."""
        folded = self.fold.deposit(rank, frame)
        if folded is not None:
            await out.send(folded)

    async def _after_rank_gone(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        self.awaiting_reply.discard(rank)
        folded = self.fold.mark_dead(rank)
        if folded is not None:
            await out.send(folded)

    async def _write_upstream(self, item: _Outbound) -> None:
        salt = self.config.salt
        if isinstance(item, (_RawHostFrame, _SealedHostFrame, FoldedHostFrame)):
            self.expecting_broadcast = True  # before the write: the answer may beat our resumption
        if isinstance(item, _SealedHostFrame):
            record = item.record
            try:
                await self.upstream.send_chunks(record.chunks)
            finally:
                self.pool.release(item.buffer)
        elif isinstance(item, _RawHostFrame):
            try:
                record = encode_mux_record(MuxKind.HOST_FRAME, item.body, salt)
                await self.upstream.send_chunks(record.chunks)
            finally:
                self.pool.release(item.buffer)
        elif isinstance(item, FoldedHostFrame):
            record = await encode_enveloped_frame(MuxKind.HOST_FRAME, item.frame, salt)
            await self.upstream.send_chunks(record.chunks)
            self.fold.images.give(item.images)  # written: nothing reads them now
        else:
            return await super()._write_upstream(item)
        self.stats.rounds += 1
        self.stats.fold_images_reused = self.fold.images.reused
        self.stats.bytes_up += record.nbytes

    async def _receive_record(self, header: MuxHeader, buf: ReceiveBuffer, out: trio.MemorySendChannel[_Outbound]) -> None:
        # The kind byte is not authenticated yet: it only picks the path. A record
        # that is not what it claims fails its MAC before any rank sees its end.
        if header.kind == MuxKind.BROADCAST and self.expecting_broadcast and header.length > SMALL_MESSAGE:
            await self._cut_through_broadcast(header, buf, out)
        else:
            await super()._receive_record(header, buf, out)

    async def _cut_through_broadcast(
        self, header: MuxHeader, buf: ReceiveBuffer, out: trio.MemorySendChannel[_Outbound]
    ) -> None:
        """Fan a large consensus out while it arrives, instead of after.

        Every waiting rank gets the frame's bytes as they land, except its last
        8 (the frame's own MAC), which go out only once the record's MAC has
        verified: a rank cannot complete a frame the relay has not authenticated.
        If verification fails the relay stops, closing every rank connection
        mid-frame.
        """
        self.expecting_broadcast = False
        targets = sorted(self.awaiting_reply)
        self.awaiting_reply.clear()
        watch = ArrivalWatch(header.length)
        await receive_with_followers(
            watch,
            partial(self.upstream.receive_mux_payload, header, buf, self.config.salt, watch),
            *(partial(self._forward_consensus, target, buf, watch, out) for target in targets),
        )
        self.stats.bytes_down += header.length
        self.stats.broadcasts_streamed += 1

    async def _forward_consensus(
        self, rank: int, buf: ReceiveBuffer, watch: ArrivalWatch, out: trio.MemorySendChannel[_Outbound]
    ) -> None:
        """One rank's share of a cut-through fan-out: a length prefix, the bytes so far, the tag last."""
        conn = self.conns[rank]
        gate = watch.length - MAC_LEN
        sent = 0
        try:
            await conn.send_piece(_U32.pack(watch.length))
            while (end := await watch.next_stretch(sent, step=WRITE_PIECE, stop=gate)) is not None:
                await conn.send_piece(buf.view(end)[sent:])
                sent = end
            await watch.wait_done()
            if watch.ok:
                await conn.send_piece(buf.view(watch.length)[gate:])
        except CONNECTION_LOST as exc:
            await self._rank_gone(rank, out, f"could not take the consensus: {exc}")

    async def _on_record(self, kind: MuxKind, rank: int, payload: memoryview, out: trio.MemorySendChannel[_Outbound]) -> None:
        if kind is not MuxKind.BROADCAST:
            return await super()._on_record(kind, rank, payload, out)
        if not self.expecting_broadcast:
            raise DesyncError(
                f"relay {self.config.host_name}: the controller sent a Broadcast this host did not ask for "
                "(a replayed record, or the ping-pong broke)"
            )
        self.expecting_broadcast = False
        # Send the consensus to every rank waiting for it, concurrently.
        targets = sorted(self.awaiting_reply)
        self.awaiting_reply.clear()
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(self._send_to_rank, target, [payload], len(payload), out)


__all__ = ["ControlChannel", "DataChannel"]
