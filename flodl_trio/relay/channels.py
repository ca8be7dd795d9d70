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

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import attrs
import trio

from ..errors import FlodlError, MacError, ProtocolError
from ..fold.speculative import Speculation, SpeculativeFrame, receive_speculating
from ..transport.arrival import ArrivalWatch, receive_with_followers
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.hashing import RunningMac, hash_as_it_lands
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal
from ..wire.constants import (
    CONTROL_FRAME_HEADER_LEN,
    CONTROL_FRAME_MAX_PAYLOAD,
    FINISHED_LENGTH,
    MAC_LEN,
    MUX_HEADER_LEN,
)
from ..wire.mux import (
    DeclareDead,
    Lanes,
    MuxHeader,
    MuxKind,
    RankAway,
    RankExit,
    RankFinished,
    RankJoin,
    RelayControlMsg,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
    mux_signed_header,
)
from ..wire.round_frame import (
    EncodedFrame,
    RoundFrame,
    check_payloads,
    decode_round_frame,
)
from ..wire.salt import Buffer
from .config import RelayConfig, RelayStats
from .host_fold import FoldedHostFrame, HostFold
from .cut_through import stream_consensus
from .host_ranks import HostRanks
from .lanes import frames_for

log = logging.getLogger("flodl_trio.relay")

# Records queued toward the controller; a full queue back-pressures rank readers.
OUTBOUND_DEPTH = 16
# Model-sized receive buffers shared by all of a channel's readers. Two let two
# rank frames arrive and verify at once (their MACs hash on two cores) and let
# the last frame's HostFrame be finished ahead; memory stays near three model
# sizes (these two + the f32 fold) for any number of ranks. The data channel
# starts with one and gets the second once a verified frame has shown the
# model's size (so the two never grow and copy at the same time), and only if
# the relay then stays within its memory budget: for a large model one buffer
# and the fold are what fits.
RECEIVE_BUFFERS = 2

# A control-channel blob is one ControlFrame: 24-byte header + at most 16 MiB.
CONTROL_BLOB_CEILING = CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD
MiB = 1 << 20
# What a data relay holds besides its model-sized buffers (the interpreter, numpy,
# trio, small buffers): a relay daemon with 4 KiB frames is ~42 MiB resident.
RELAY_BASELINE = 48 * MiB


@attrs.frozen
class _RawHostFrame:
    """A single rank's verified frame, forwarded upstream byte for byte; ``buffer``
    (lent from the pool) holds it until it has been written."""

    body: memoryview
    buffer: ReceiveBuffer


@attrs.frozen
class _SealedHostFrame:
    """A HostFrame record computed and signed while the round's last frame arrived;
    ``buffer`` (lent from the pool) holds it until it has been written."""

    record: EncodedFrame
    buffer: ReceiveBuffer


@attrs.frozen
class _DataRecord:
    """A control-channel blob going upstream, tagged with its rank, never parsed."""

    rank: int
    payload: bytes


# What rank readers and the upstream reader hand the outbound writer.
_Outbound = _RawHostFrame | _SealedHostFrame | FoldedHostFrame | _DataRecord | RankExit | RankJoin | RankFinished
_HOST_FRAMES = (_RawHostFrame, _SealedHostFrame, FoldedHostFrame)


class _Channel:
    """What both channel kinds share: the nursery, the sole upstream writer,
    the upstream read loop, ranks joining and leaving, and how it ends.

    Ranks join with :meth:`join` (the relay's connection handler calls it once
    a rank's handshake is done); each gets a reader task in the channel's
    nursery. How it ends: upstream EOF cancels the nursery (nothing more can
    be written); the last of the host's ranks leaving stops the upstream
    reader and the intake of joiners, so every producer has closed its clone
    of the outbound channel and the writer drains what is queued (the ranks'
    RankExits) and returns; any error raised by a task travels out through
    the nursery.
    """

    def __init__(
        self, config: RelayConfig, upstream: MessageStream, stats: RelayStats, host: HostRanks,
        released: Callable[[int], None], ranks: Iterable[int] | None = None, away: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.host = host
        self._released = released  # told when a rank's connection is done with (it may connect again)
        self.ranks = frozenset(config.ranks if ranks is None else ranks)
        self.conns: dict[int, MessageStream] = {}
        self.upstream = upstream
        self.stats = stats
        self.gone: set[int] = set(away)  # away ranks may connect later: as ranks coming back
        self.reader_scopes: dict[int, trio.CancelScope] = {}
        self.pool = BufferPool(1, limit=RECEIVE_BUFFERS)
        self._small = ReceiveBuffer()
        self._upstream_reading = trio.CancelScope()
        self._admitting = trio.CancelScope()
        # (rank, whether it is coming back); unbounded, each entry is a rank's connection.
        self._joins_send, self._joins = trio.open_memory_channel[tuple[int, bool]](math.inf)
        self._nursery: trio.Nursery | None = None

    @property
    def live(self) -> set[int]:
        """The host's ranks still in the barrier: joined, or not joined yet, and not gone."""
        return set(self.ranks) - self.gone

    def join(self, rank: int, conn: MessageStream) -> bool:
        """A rank whose handshake is done enters the channel; False if it may not
        (not one of this channel's ranks, or it left or was declared dead meanwhile)."""
        if rank not in self.ranks or rank in self.gone or rank in self.conns:
            return False
        self._start_reader(rank, conn, rejoined=False)
        return True

    def rejoin(self, rank: int, conn: MessageStream) -> bool:
        """A rank that had left reconnected; False if it is not one that left."""
        if rank not in self.ranks or rank not in self.gone:
            return False
        self.gone.discard(rank)
        self.stats.live_ranks = len(self.live)
        log.info("relay %s: rank %d reconnected", self.config.host_name, rank)
        self._start_reader(rank, conn, rejoined=True)
        return True

    def _start_reader(self, rank: int, conn: MessageStream, *, rejoined: bool) -> None:
        self.conns[rank] = conn
        self.reader_scopes[rank] = trio.CancelScope()
        self._joins_send.send_nowait((rank, rejoined))

    async def run(self) -> None:
        """Run until upstream EOF or the last rank leaves; a task's error comes out of the nursery."""
        send, receive = trio.open_memory_channel[_Outbound](OUTBOUND_DEPTH)
        self.stats.live_ranks = len(self.live)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._outbound_writer, receive)
                nursery.start_soon(self._upstream_reader, send.clone())
                nursery.start_soon(self._admit_joiners, send.clone(), nursery)
                await send.aclose()
        finally:
            await self.upstream.aclose()

    async def _admit_joiners(self, out: trio.MemorySendChannel[_Outbound], nursery: trio.Nursery) -> None:
        """Start a reader for each rank as it joins (each reader holds its own clone)."""
        async with out:
            with self._admitting:
                async for rank, rejoined in self._joins:
                    if rejoined:
                        await self._on_rejoin(rank, out)
                    nursery.start_soon(self._rank_reader, rank, out.clone())

    async def _on_rejoin(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Channel-specific: what a rank coming back means (the data channel asks the controller)."""

    def _log_shutdown(self, why: str) -> None:
        log.info("relay %s: shutting down: %s", self.config.host_name, why)

    # -- rank side -----------------------------------------------------------

    async def _rank_reader(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Read one rank until it leaves; its bad bytes cost only itself."""
        async with out:
            reason = "closed its connection"
            with self.reader_scopes[rank]:
                try:
                    await self._read_rank(rank, out)
                except (ProtocolError, *CONNECTION_LOST) as exc:
                    if isinstance(exc, MacError):
                        self.stats.mac_failures += 1
                    reason = f"dropped: {exc}"
            await self._rank_gone(rank, out, reason)

    async def _read_rank(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        raise NotImplementedError

    async def _rank_gone(self, rank: int, out: trio.MemorySendChannel[_Outbound], reason: str, *, report: bool = True) -> None:
        """A local rank left (EOF, error, write failure, or declared dead, joined or not)."""
        if rank in self.gone:
            return
        self.gone.add(rank)
        self.stats.live_ranks = len(self.live)
        level = logging.WARNING if reason.startswith("dropped") else logging.INFO
        log.log(level, "relay %s: rank %d %s", self.config.host_name, rank, reason)
        scope = self.reader_scopes.get(rank)
        if scope is not None:
            scope.cancel()
        await self._after_rank_gone(rank, out)
        if report:
            await out.send(self._exit_message(rank))
        conn = self.conns.get(rank)
        if conn is not None:
            await conn.aclose()
        self._released(rank)
        if not self.live:
            self._after_last_rank_left()

    def _exit_message(self, rank: int) -> RankExit | RankFinished:
        """What tells the controller a rank left (the data channel knows who finished)."""
        return RankExit(rank)

    def _after_last_rank_left(self) -> None:
        """Shut down - unless a rank that left may still come back (it called join()
        and did not say it finished): then keep serving until the controller closes."""
        waiting_for = self.host.may_return(self.ranks)
        if waiting_for:
            log.info("relay %s: every local rank has left; staying up for ranks %s, which may come back",
                     self.config.host_name, waiting_for)
            return
        self._log_shutdown("every local rank has left")
        # The writer then drains the RankExits and returns.
        self._upstream_reading.cancel()
        self._admitting.cancel()

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
                try:
                    await self._write_upstream(item)
                except CONNECTION_LOST as exc:
                    if isinstance(item, RankExit | RankFinished):
                        # Only a rank's goodbye was lost: the controller closed the connection (it
                        # does once every rank has finished) before this write, as when the reader
                        # sees EOF first - a shutdown, not a failure.
                        self._log_shutdown(f"the controller closed the upstream connection ({exc})")
                        assert self._nursery is not None
                        self._nursery.cancel_scope.cancel()
                        return
                    raise FlodlError(f"relay {self.config.host_name}: connection to the controller failed: {exc}") from exc
                del item  # a sent HostFrame must not outlive its write while we wait for the next

    async def _write_upstream(self, item: _Outbound) -> None:
        salt = self.config.salt
        if isinstance(item, _DataRecord):
            record = encode_mux_record(MuxKind.DATA, item.payload, salt, rank=item.rank)
            self.stats.bytes_up += record.nbytes
        elif isinstance(item, RankExit | RankJoin | RankFinished):
            record = encode_mux_record(MuxKind.CONTROL, encode_control_msg(item), salt)
        else:
            raise TypeError(f"the {self.config.kind.value} channel cannot send {type(item).__name__}")
        await self.upstream.send_chunks(record.chunks)

    async def _upstream_reader(self, out: trio.MemorySendChannel[_Outbound]) -> None:
        async with out:
            with self._upstream_reading:
                try:
                    await self._read_upstream(out)
                except CONNECTION_LOST as exc:
                    raise FlodlError(f"relay {self.config.host_name}: connection to the controller failed: {exc}") from exc

    async def _read_upstream(self, out: trio.MemorySendChannel[_Outbound]) -> None:
        while True:
            header = await self.upstream.receive_mux_header(self.config.ceiling)
            if header is None:
                self._log_shutdown("the controller closed the upstream connection")
                assert self._nursery is not None
                self._nursery.cancel_scope.cancel()
                return
            buf, pooled = await self._upstream_buffer(header)
            try:
                await self._receive_record(header, buf, out)
            finally:
                if pooled:
                    self.pool.release(buf)

    async def _upstream_buffer(self, header: MuxHeader) -> tuple[ReceiveBuffer, bool]:
        """Where a record from the controller lands, and whether it is lent from the pool."""
        if header.length <= SMALL_MESSAGE:
            return self._small, False
        return await self.pool.acquire(), True

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
            if msg.rank in self.ranks:
                # Joined or not: a rank that never connected leaves the barrier too.
                self.host.declare_dead(msg.rank)
                how = "connection closed" if msg.rank in self.conns else "it had not connected"
                await self._rank_gone(msg.rank, out, f"declared dead by the controller; {how}", report=False)
            return
        raise ProtocolError(f"relay {self.config.host_name}: unexpected {type(msg).__name__} from the controller mid-session")


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
        elif rank in self.conns and rank not in self.gone:
            await self._send_to_rank(rank, [payload], len(payload), out)
        # else: the rank already left; its RankExit is on the way or delivered.


class DataChannel(_Channel):
    """The data channel folds: K local frames in, one HostFrame up, consensus fanned out.

    Its round state is the :class:`HostFold`; the tasks only move bytes and
    tell the fold what happened.
    """

    def __init__(
        self, config: RelayConfig, upstream: MessageStream, stats: RelayStats, host: HostRanks,
        released: Callable[[int], None],
    ) -> None:
        super().__init__(config, upstream, stats, host, released)
        self.fold_changed = ChangeSignal()
        self.fold = HostFold(config.host_name, config.ranks, on_change=self.fold_changed.notify)
        # Whole records each way, or lanes (:mod:`.lanes`): chosen once, here.
        self.frames = frames_for(config, self.pool)
        # A single rank's frame goes up as it is, unless it must be cut into lanes.
        self.single = len(config.ranks) == 1 and self.frames.whole
        self._budget_refused = False

    async def _read_rank(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        while True:
            length = await self.conns[rank].receive_length_prefix(self.config.ceiling)
            if length is None:
                return
            if length == FINISHED_LENGTH:  # flodl_trio: "I finished my training" (no frame is empty)
                self.host.finished.add(rank)
                return
            await self._take_frame(rank, length, out)

    def _exit_message(self, rank: int) -> RankExit | RankFinished:
        return RankFinished(rank) if rank in self.host.finished else RankExit(rank)

    async def _take_frame(self, rank: int, length: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Receive, verify and fold (or forward) one frame of ``rank``'s.

        A function of its own so nothing model-sized it touched (the fold a
        HostFrame was finished ahead from, say) outlives it while the reader
        waits for the rank's next frame. Pool buffers go back on the way out
        unless a queued item took them over.
        """
        if rank in self.fold.joining and rank not in self.host.elastic:
            raise ProtocolError(
                f"relay {self.config.host_name}: rank {rank} came back and sent a frame without calling join() "
                "first (a restarted trainer must call client.join(params, buffers) before its first window)"
            )
        if self.config.deterministic and not self.single:
            await self._wait_for_turn(rank)
        with contextlib.ExitStack() as owned:
            buf = await self.pool.acquire()
            owned.callback(self.pool.release, buf)
            if self.single and not self.fold.waiting_to_enter(rank):
                item = await self._receive_single(rank, buf, length)
                self.fold.forward(rank)
                self._count_frame(length)
                owned.pop_all()  # the queued item owns the buffer now
                await self._queue_owning(out, item)
                return
            frame, speculation = await self._receive_folding(rank, buf, length)
            if speculation.frame is not None:
                owned.callback(self.pool.release, speculation.frame.buffer)
            if speculation.record is not None and speculation.frame is not None and self.fold.complete_ahead(rank, speculation.frame.acc):
                self._count_frame(length, frame)
                self.stats.rounds_finished_ahead += 1
                owned.pop_all()
                self.pool.release(buf)
                await self._queue_owning(out, _SealedHostFrame(speculation.record, speculation.frame.buffer))
                return
            folded = self.fold.deposit(rank, frame)
            self._count_frame(length, frame)
            if folded is not None:
                await out.send(folded)
            await self._drop_expelled(out)

    async def _wait_for_turn(self, rank: int) -> None:
        """Deterministic mode: leave the frame in its socket until the ranks before
        ``rank`` are folded (or gone), so the host's sum is taken in rank order."""
        while not self.fold.may_fold_now(rank):
            await self.fold_changed.wait()

    def _count_frame(self, length: int, frame: RoundFrame | None = None) -> None:
        self.stats.bytes_local += length + 4
        # Once a verified frame proved the model's size, let frames arrive two at a
        # time (a single rank has nothing to overlap), if memory allows.
        if frame is not None and self.pool.size < self.pool.limit and not self.single and not self._budget_refused:
            self._lend_second_buffer(length, frame)

    def _lend_second_buffer(self, length: int, frame: RoundFrame) -> None:
        """Add a receive buffer of ``length`` bytes if the relay's model-sized memory
        (two receive buffers and the f32 fold) plus its baseline fits its budget;
        decided once, from the first verified frame."""
        budget = self.config.memory_budget_for(length)
        fold = 4 * sum(math.prod(t.shape) for t in frame.tensors)
        lane = self.frames.extra_bytes(length)
        needed = 2 * length + fold + lane + RELAY_BASELINE
        if needed > budget:
            self._budget_refused = True
            log.info(
                "relay %s: one receive buffer: with a second, %.0f MiB each, and the %.0f MiB f32 fold%s the relay "
                "would need %.0f MiB, over its memory budget of %.0f MiB (frames are received one at a time)",
                self.config.host_name, length / MiB, fold / MiB, " (and a consensus lane's buffer)" if lane else "",
                needed / MiB, budget / MiB,
            )
            return
        self.pool.add(ReceiveBuffer(length))
        self.stats.receive_buffers = self.pool.size

    async def _queue_owning(self, out: trio.MemorySendChannel[_Outbound], item: _RawHostFrame | _SealedHostFrame) -> None:
        """Queue an item that owns a pool buffer; the buffer comes back if it never gets queued."""
        try:
            await out.send(item)
        except BaseException:
            self.pool.release(item.buffer)
            raise

    async def _receive_verified(
        self, rank: int, buf: ReceiveBuffer, length: int, watch: ArrivalWatch | None = None, *, forwarded: bool = False
    ) -> tuple[memoryview, RoundFrame]:
        """``rank``'s frame, its MAC computed as the bytes land and checked at the end.

        On the local leg the frame is not signed: it is taken as it is, unless it
        is ``forwarded`` upstream byte for byte - then the relay computes its MAC
        the same way and writes it where the rank left zeros.
        """
        conn = self.conns[rank]
        salt = self.config.salt
        what = f"rank {rank}'s {length}-byte frame"
        source = f"rank {rank} on host {self.config.host_name}"
        mac: bytes | None = None
        if conn.signed_frames or forwarded:  # the MAC, to check or to write in, hashed as the bytes land
            body, mac = await conn.receive_round_frame_body(buf, length, salt, what, watch)
        else:
            body = await conn.receive_into_buffer(buf, length, what, None, watch)
        unsigned = not conn.signed_frames
        frame = decode_round_frame(
            body, salt, ceiling=self.config.ceiling, source=source, mac_of_body=mac, authenticated=unsigned
        )
        if unsigned and mac is not None:
            body[-MAC_LEN:] = mac
        # Its bytes are authentic; now they must also make sense (checked here, at
        # the first hop, so a single rank's frame is not forwarded unchecked).
        check_payloads(frame, source)
        return body, frame

    async def _receive_folding(self, rank: int, buf: ReceiveBuffer, length: int) -> tuple[RoundFrame, Speculation]:
        """Receive and verify ``rank``'s frame; a large one that is the last the host
        waits for has its HostFrame computed and signed beside it (not with lanes:
        the HostFrame goes up as lane frames, signed as they are cut)."""
        if length <= SMALL_MESSAGE or not self.frames.whole:
            return (await self._receive_verified(rank, buf, length))[1], Speculation()
        watch = ArrivalWatch(length)

        def begin() -> SpeculativeFrame | None:
            # Nothing else arrives now: the pool's other buffer is free to hold the output.
            out = self.pool.try_acquire()
            if out is None:
                return None
            frame = SpeculativeFrame(self.fold.acc, divide=False, in_length=length, out=out)
            if not frame.supported:
                self.pool.release(out)
                return None
            return frame

        (_body, frame), speculation = await receive_speculating(
            watch, partial(self._receive_verified, rank, buf, length, watch),
            is_last=partial(self.fold.only_missing, rank), begin=begin, changes=self.fold_changed,
            buf=buf, kind=MuxKind.HOST_FRAME, salt=self.config.salt,
        )
        return frame, speculation

    async def _receive_single(self, rank: int, buf: ReceiveBuffer, length: int) -> _RawHostFrame | _SealedHostFrame:
        """A single rank's frame goes up byte for byte as the host's frame. A large one
        has its HostFrame record's MAC computed over the same bytes as they land
        (all but the frame's own tag, fed last: on the local leg the relay only
        knows it once the frame is in), so the record is ready the moment the
        frame is."""
        receive = partial(self._receive_verified, rank, buf, length, forwarded=True)
        if length <= SMALL_MESSAGE:
            body, _frame = await receive()
            return _RawHostFrame(body, buf)
        watch = ArrivalWatch(length)
        signed = mux_signed_header(MuxKind.HOST_FRAME, length)
        record_mac = self.config.salt.hmac()
        record_mac.update(signed)
        running = RunningMac(record_mac, length - MAC_LEN)
        (body, _frame), (hashed_all,) = await receive_with_followers(
            watch, partial(receive, watch), partial(hash_as_it_lands, buf, watch, running)
        )
        if not hashed_all:
            return _RawHostFrame(body, buf)
        record_mac.update(body[-MAC_LEN:])
        self.stats.rounds_finished_ahead += 1
        return _SealedHostFrame(EncodedFrame([signed + running.tag(), body], MUX_HEADER_LEN + length), buf)

    async def _after_rank_gone(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        folded = self.fold.mark_dead(rank)
        if folded is not None:
            await out.send(folded)

    async def _on_rejoin(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Ask the controller to let the rank back in; it stays out of the fold until then."""
        self.fold.rejoin(rank)
        await out.send(RankJoin(rank))

    async def _on_control(self, msg: RelayControlMsg, out: trio.MemorySendChannel[_Outbound]) -> None:
        if isinstance(msg, Lanes):
            return self.frames.confirm(msg.count, msg.min_bytes)
        if isinstance(msg, RankAway):
            return await self._on_away(msg.rank, out)
        if not isinstance(msg, RankJoin):
            return await super()._on_control(msg, out)
        if self.fold.approve(msg.rank):
            self.host.revive(msg.rank)
            log.info("relay %s: rank %d is let back in; it enters at the next window start", self.config.host_name, msg.rank)
            if self.fold.idle and msg.rank in self.fold.held:  # its first frame beat this answer: in now
                await self._enter_approved(out)

    async def _write_upstream(self, item: _Outbound) -> None:
        if not isinstance(item, _HOST_FRAMES):
            return await super()._write_upstream(item)
        self.fold.host_frame_sent()  # before the write: the answer may beat our resumption
        if isinstance(item, FoldedHostFrame):
            sent = await self.frames.send(item.frame, self.upstream)
            self.fold.images.give(item.images)  # written: nothing reads them now
            return self._count_round(sent)
        try:
            record = item.record if isinstance(item, _SealedHostFrame) else encode_mux_record(
                MuxKind.HOST_FRAME, item.body, self.config.salt
            )
            await self.upstream.send_chunks(record.chunks)
        finally:
            self.pool.release(item.buffer)
        self._count_round(record.nbytes)

    def _count_round(self, nbytes: int) -> None:
        self.stats.rounds += 1
        self.stats.fold_images_reused = self.fold.images.reused
        self.stats.bytes_up += nbytes

    async def _receive_record(self, header: MuxHeader, buf: ReceiveBuffer, out: trio.MemorySendChannel[_Outbound]) -> None:
        # The kind byte is not authenticated yet: it only picks the path. A record
        # that is not what it claims fails its MAC before any rank sees its end.
        if header.kind == MuxKind.BROADCAST and self.fold.host_frame_up and header.length > SMALL_MESSAGE and self.frames.whole:
            await self._cut_through_broadcast(header, buf, out)
        else:
            await super()._receive_record(header, buf, out)

    async def _cut_through_broadcast(
        self, header: MuxHeader, buf: ReceiveBuffer, out: trio.MemorySendChannel[_Outbound]
    ) -> None:
        """Fan a large whole consensus out while it arrives, instead of after (:mod:`.cut_through`)."""
        targets = self.fold.consensus_arrived()
        await self._enter_approved(out)

        async def rank_failed(rank: int, why: str) -> None:
            await self._rank_gone(rank, out, why)

        await stream_consensus(self.upstream, header, buf, self.config.salt, self.conns, targets, rank_failed)
        self.stats.bytes_down += header.length
        self.stats.broadcasts_streamed += 1

    async def _upstream_buffer(self, header: MuxHeader) -> tuple[ReceiveBuffer, bool]:
        own = self.frames.downlink_buffer(header.length)
        if own is not None:
            return own, False
        return await super()._upstream_buffer(header)

    async def _on_record(self, kind: MuxKind, rank: int, payload: memoryview, out: trio.MemorySendChannel[_Outbound]) -> None:
        if kind is not MuxKind.BROADCAST:
            return await super()._on_record(kind, rank, payload, out)
        async with self.frames.consensus(payload, self.fold.host_frame_up, self._a_waiting_rank_reads_macs) as consensus:
            if consensus is not None:  # None: more lanes to come
                await self._fan_out(consensus, out)

    def _a_waiting_rank_reads_macs(self) -> bool:
        """Ranks on the local leg take frames unsigned: a joined consensus is signed only for one on TCP."""
        return any(self.conns[r].signed_frames for r in self.fold.awaiting_reply if r in self.conns)

    async def _fan_out(self, payload: memoryview, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Send the consensus to every rank waiting for it, concurrently."""
        targets = self.fold.consensus_arrived()
        await self._enter_approved(out)
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(self._send_to_rank, target, [payload], len(payload), out)

    async def _on_away(self, rank: int, out: trio.MemorySendChannel[_Outbound]) -> None:
        """The controller says ``rank`` is dead but may come back (this relay was
        restarted, or the cluster formed without it). If it already connected here,
        it is a rank coming back: out of the barrier, and the controller is asked."""
        if rank not in self.ranks:
            raise ProtocolError(f"relay {self.config.host_name}: RankAway for rank {rank}, not one of ours")
        self.host.declare_away(rank)
        if rank in self.conns and rank not in self.gone:
            self.fold.mark_dead(rank)  # it has sent nothing: it waits for its state first
            self.fold.rejoin(rank)
            log.info("relay %s: rank %d connected before the controller said it was away; asking it back in",
                     self.config.host_name, rank)
            await out.send(RankJoin(rank))
        else:
            await self._rank_gone(rank, out, "is away (it may come back)", report=False)

    async def _enter_approved(self, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Ranks let back in join the barrier of the round this consensus opens."""
        folded = self.fold.enter_approved()
        if folded is not None:
            await out.send(folded)
        await self._drop_expelled(out)

    async def _drop_expelled(self, out: trio.MemorySendChannel[_Outbound]) -> None:
        """Drop the ranks whose folded frames a later one proved wrong (their part of
        the round's sum is gone already; the round may complete without them now)."""
        for rank, why in self.fold.take_expelled().items():
            await self._rank_gone(rank, out, f"dropped: {why}")


__all__ = ["ControlChannel", "DataChannel"]
