"""The per-host relay: K local ranks in, one upstream connection out, per channel.

Task structure of one data channel (all in one nursery)::

    rank socket r0 --> rank_reader(r0) --\\
    rank socket r1 --> rank_reader(r1) ---+--[outbound channel]--> outbound_writer --> controller
    rank socket rk --> rank_reader(rk) --/                          (sole upstream writer)

    controller --> upstream_reader --> fan-out to every rank socket (sole rank-socket writer)

Rank readers verify each frame's MAC and fold it straight into one f32
accumulator (the fold never divides). The deposit, exit or controller-declared
death that completes the round ships one HostFrame. A host with a single rank
forwards that rank's frame byte for byte. Shutdown - upstream EOF, a fatal
error, or the last local rank leaving - cancels the nursery; writes in flight
are shielded so no frame is left half-written.
"""

from __future__ import annotations

import enum
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio

from ..errors import (
    ConfigError,
    DesyncError,
    FlodlError,
    FramingError,
    HandshakeError,
    MacError,
    PeerTimeout,
    ProtocolError,
    SchemaError,
)
from ..wire.constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    CONTROL_FRAME_HEADER_LEN,
    CONTROL_FRAME_MAX_PAYLOAD,
    DEFAULT_FRAME_CEILING,
    MAC_LEN,
    MUX_HEADER_LEN,
)
from ..wire.finish_ahead import FinishAhead
from ..wire.fold import FoldAccumulator, ImageCache
from ..wire.handshake import (
    CONTROL_HANDSHAKE_LEN,
    DATA_HANDSHAKE_LEN,
    decode_control_handshake,
    decode_data_handshake,
    encode_control_ack,
    encode_data_ack,
)
from ..wire.mux import (
    DeclareDead,
    Hello,
    HelloAck,
    MuxHeader,
    MuxKind,
    RankExit,
    RelayControlMsg,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
    mux_signed_header,
)
from ..wire.netenv import handshake_timeout
from ..wire.round_frame import EncodedFrame, RoundFrame, decode_round_frame
from ..wire.salt import Buffer, SessionSalt
from ..wire.stream import (
    WRITE_PIECE,
    ArrivalWatch,
    BufferPool,
    MessageStream,
    ReceiveBuffer,
    RunningMac,
    connect_with_retry,
    encode_enveloped_frame,
    hash_as_it_lands,
    peer_host,
    receive_followed,
    tune_socket,
)
from ..wire.tasks import service_nursery

log = logging.getLogger("flodl_trio.relay")

# Records queued toward the controller; a full queue back-pressures rank readers.
OUTBOUND_DEPTH = 16
# Model-sized receive buffers shared by all of a channel's readers. Two let two
# rank frames arrive and verify at once (their MACs hash on two cores); memory
# stays near three model sizes (these two + the f32 fold) for any number of ranks.
# The data channel starts with one and gets the second once a verified frame has
# shown the model's size, so the two never grow (and copy) at the same time.
RECEIVE_BUFFERS = 2
# Upstream records up to this size use a private buffer, not the shared pool.
SMALL_RECORD = 64 << 10
# A control-channel blob is one ControlFrame: 24-byte header + at most 16 MiB.
CONTROL_BLOB_CEILING = CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD
_U32 = struct.Struct("<I")
_DISCONNECTS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, PeerTimeout, FramingError)


class ChannelKind(enum.Enum):
    """Which protocol a relay channel terminates toward its local ranks."""

    DATA = "data"
    CONTROL = "control"

    @property
    def magic(self) -> int:
        return CHANNEL_MAGIC_DATA if self is ChannelKind.DATA else CHANNEL_MAGIC_CONTROL


@attrs.define
class RelayStats:
    """Counters a relay keeps; the fold ratio is local bytes over uplink bytes."""

    rounds: int = 0
    bytes_local: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: int = 0
    live_ranks: int = 0
    mac_failures: int = 0
    broadcasts_streamed: int = 0  # consensus frames fanned out while still arriving
    rounds_finished_ahead: int = 0  # HostFrames computed and signed while the last frame arrived
    fold_images_reused: int = 0  # rounds folded into an earlier round's f32 images instead of new ones

    @property
    def fold_ratio(self) -> float:
        return self.bytes_local / self.bytes_up if self.bytes_up else 0.0


@attrs.frozen
class RelayConfig:
    kind: ChannelKind
    listen: tuple[str, int]
    upstream: tuple[str, int]
    host_name: str
    ranks: tuple[int, ...]
    world_size: int
    salt: SessionSalt
    ceiling: int = DEFAULT_FRAME_CEILING
    connect_attempts: int = 60
    connect_interval: float | None = None


class RelayHandle:
    """A running relay: its bound port, counters, and how it ended."""

    def __init__(self, config: RelayConfig, port: int) -> None:
        self.config = config
        self.port = port
        self.stats = RelayStats()
        self.rejections: list[str] = []
        self._finished = trio.Event()
        self._error: BaseException | None = None
        self._error_seen = False

    @property
    def host_name(self) -> str:
        return self.config.host_name

    async def wait_finished(self) -> None:
        """Wait until the relay ends on its own (last rank gone, controller closed);
        raise the error that stopped it, if one did."""
        await self._finished.wait()
        if self._error is not None:
            self._error_seen = True
            raise self._error


def validate_config(config: RelayConfig) -> None:
    if config.world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {config.world_size}")
    if not config.ranks:
        raise ConfigError(f"relay {config.host_name}: the host's rank set is empty")
    if len(set(config.ranks)) != len(config.ranks):
        raise ConfigError(f"relay {config.host_name}: duplicate ranks in {list(config.ranks)}")
    outside = [r for r in config.ranks if not 0 <= r < config.world_size]
    if outside:
        raise ConfigError(f"relay {config.host_name}: ranks {outside} are outside world_size {config.world_size}")


@asynccontextmanager
async def open_relay(
    kind: ChannelKind,
    *,
    listen: tuple[str, int],
    upstream: tuple[str, int],
    host_name: str,
    ranks: Sequence[int],
    world_size: int,
    salt: SessionSalt | bytes,
    ceiling: int = DEFAULT_FRAME_CEILING,
    connect_attempts: int = 60,
    connect_interval: float | None = None,
) -> AsyncIterator[RelayHandle]:
    """Run a relay channel for one host while the block runs.

    ``handle.port`` is bound on entry (port 0 picks a free one). Leaving the
    block shuts the relay down; an error it hit that nobody awaited through
    ``wait_finished()`` is raised on exit.
    """
    config = RelayConfig(
        kind, listen, upstream, host_name, tuple(sorted(ranks)), world_size, SessionSalt.coerce(salt),
        ceiling, connect_attempts, connect_interval,
    )
    validate_config(config)
    async with service_nursery() as nursery:
        handle: RelayHandle = await nursery.start(_serve_relay, config)
        yield handle
    if handle._error is not None and not handle._error_seen:
        raise handle._error


async def _serve_relay(config: RelayConfig, *, task_status: trio.TaskStatus[RelayHandle]) -> None:
    listeners = await trio.open_tcp_listeners(config.listen[1], host=config.listen[0])
    handle = RelayHandle(config, listeners[0].socket.getsockname()[1])
    task_status.started(handle)
    relay = _Relay(config, handle, listeners)
    try:
        await relay.run()
    except Exception as exc:
        handle._error = exc
        log.error("relay %s: %s", config.host_name, exc)
    finally:
        for listener in listeners:
            await listener.aclose()
        relay.log_summary()
        handle._finished.set()


class _Relay:
    """Formation (accept the host's ranks, dial the controller) then the channel."""

    def __init__(self, config: RelayConfig, handle: RelayHandle, listeners: list[trio.SocketListener]) -> None:
        self.config = config
        self.handle = handle
        self.listeners = listeners
        self.joined: dict[int, MessageStream] = {}
        self.signatures: dict[int, bytes] = {}
        self.all_joined = trio.Event()

    async def run(self) -> None:
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            for listener in self.listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            try:
                await self.all_joined.wait()
                upstream = await self._dial_controller()
                channel_type = DataChannel if self.config.kind is ChannelKind.DATA else ControlChannel
                await channel_type(self.config, self.joined, upstream, self.handle.stats).run()
            except Exception as exc:  # raised below, outside the nursery, unwrapped
                error = exc
            finally:
                nursery.cancel_scope.cancel()
                await self._close_all()
        if error is not None:
            raise error

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                log.warning("relay %s: accept failed: %s", self.config.host_name, exc)
                await trio.sleep(0.1)
                continue
            tune_socket(stream)
            nursery.start_soon(self._admit, stream)

    async def _admit(self, stream: trio.SocketStream) -> None:
        """Terminate one rank's handshake, refusing (and logging) anything wrong."""
        conn = MessageStream(stream, f"rank connection from {peer_host(stream)}")
        try:
            with trio.fail_after(handshake_timeout()):
                rank = await self._handshake(conn)
                ack = encode_data_ack() if self.config.kind is ChannelKind.DATA else encode_control_ack(self.config.salt)
                await conn.send_chunks([ack])
        except (ProtocolError, OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = "no complete handshake within the deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"relay {self.config.host_name}: refused {conn.peer}: {reason}")
            await conn.aclose()
            return
        conn.peer = f"rank {rank}"
        self.joined[rank] = conn
        if len(self.joined) == len(self.config.ranks):
            self.all_joined.set()

    async def _handshake(self, conn: MessageStream) -> int:
        if self.config.kind is ChannelKind.DATA:
            raw = await conn.receive_exactly(DATA_HANDSHAKE_LEN, "the data handshake")
            hello = decode_data_handshake(raw, self.config.world_size)
        else:
            raw = await conn.receive_exactly(CONTROL_HANDSHAKE_LEN, "the control handshake")
            hello = decode_control_handshake(raw, self.config.world_size, self.config.salt)
        if hello.rank not in self.config.ranks:
            raise HandshakeError(
                f"rank {hello.rank} is not in host {self.config.host_name}'s rank set {list(self.config.ranks)}"
            )
        if hello.rank in self.joined:
            state = "already connected" if not self.all_joined.is_set() else "already joined; rejoin is not supported"
            raise HandshakeError(f"duplicate rank {hello.rank}: {state}")
        self.signatures[hello.rank] = hello.model_signature
        return hello.rank

    def _refuse(self, message: str) -> None:
        log.warning("%s", message)
        self.handle.rejections.append(message)
        self.handle.stats.rejected += 1

    async def _dial_controller(self) -> MessageStream:
        host, port = self.config.upstream
        stream = await connect_with_retry(
            host, port, f"relay {self.config.host_name} upstream",
            attempts=self.config.connect_attempts, interval=self.config.connect_interval,
        )
        upstream = MessageStream(stream, f"controller {host}:{port}")
        salt = self.config.salt
        sigs = [self.signatures[r] for r in self.config.ranks] if self.config.kind is ChannelKind.CONTROL else []
        hello = Hello(self.config.host_name, self.config.ranks, sigs)
        magic = self.config.kind.magic.to_bytes(4, "little")
        await upstream.send_chunks([magic, *encode_mux_record(MuxKind.CONTROL, encode_control_msg(hello), salt).chunks])
        with trio.fail_after(handshake_timeout()):
            header = await upstream.receive_mux_header(SMALL_RECORD)
            if header is None:
                raise HandshakeError(f"relay {self.config.host_name}: controller {host}:{port} closed before HelloAck")
            kind, payload = await upstream.receive_mux_payload(header, ReceiveBuffer(), salt)
        reply = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
        if not isinstance(reply, HelloAck):
            raise HandshakeError(f"relay {self.config.host_name}: expected HelloAck from controller, got {kind.name} {reply}")
        log.info("relay %s: joined controller %s:%d with ranks %s", self.config.host_name, host, port, list(self.config.ranks))
        return upstream

    async def _close_all(self) -> None:
        for conn in self.joined.values():
            await conn.aclose()

    def log_summary(self) -> None:
        s = self.handle.stats
        log.info(
            "relay %s %s summary: ranks=%d rounds=%d local=%.2fMB uplink=%.2fMB fold-ratio=%.2fx",
            self.config.host_name, self.config.kind.value, len(self.config.ranks), s.rounds,
            s.bytes_local / 1e6, s.bytes_up / 1e6, s.fold_ratio,
        )


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

    finisher: FinishAhead | None = None
    out: ReceiveBuffer | None = None
    sealed: EncodedFrame | None = None


# What rank readers and the upstream reader hand the outbound writer (defined
# below): a folded frame, a single rank's frame verbatim, one sealed ahead, a
# control-channel blob, or a control message.
_Outbound = Any


class HostFold:
    """The host's fold barrier: every live local rank deposits, then one frame ships."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = frozenset(ranks)
        self.dead: set[int] = set()
        self.deposited: set[int] = set()
        self.images = ImageCache()
        self.acc = FoldAccumulator(self.images)
        self.changed = trio.Event()  # set (and replaced) whenever the barrier moves

    @property
    def live(self) -> frozenset[int]:
        return self.ranks - self.dead

    def _note_change(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def deposit(self, rank: int, frame: RoundFrame) -> _FoldedHostFrame | None:
        """Fold one verified frame; the folded round when this deposit completes it."""
        self.acc.add(frame, f"rank {rank}")
        self.deposited.add(rank)
        self._note_change()
        return self._take_if_complete()

    def mark_dead(self, rank: int) -> _FoldedHostFrame | None:
        """Drop ``rank`` from the barrier (a frame it already folded stays: realized work)."""
        self.dead.add(rank)
        self._note_change()
        return self._take_if_complete()

    def only_missing(self, rank: int) -> bool:
        """Whether ``rank``'s frame is the last one this round waits for (after another)."""
        return bool(self.deposited) and self.live - self.deposited == {rank}

    def complete_ahead(self, rank: int, acc: FoldAccumulator) -> bool:
        """Close the round with a frame computed ahead from ``acc`` plus ``rank``'s
        verified frame, if that is still exactly what the round needs."""
        if acc is not self.acc or not self.only_missing(rank):
            return False
        self._next_round()
        # The frame computed ahead has its own buffer: nothing reads these sums now.
        self.images.give(acc.sums())
        return True

    def _take_if_complete(self) -> _FoldedHostFrame | None:
        if not self.deposited or not self.live <= self.deposited:
            return None
        # The frame may alias the sums (it always does for f32): they go back once it is written.
        folded = _FoldedHostFrame(self.acc.result(spend_sums=True), self.acc.sums())
        self._next_round()
        return folded

    def _next_round(self) -> None:
        self.acc = FoldAccumulator(self.images)
        self.deposited.clear()
        self._note_change()


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
                except (ProtocolError, *_DISCONNECTS) as exc:
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
        except _DISCONNECTS as exc:
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
                big = header.length > SMALL_RECORD
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
            if length > SMALL_RECORD and self.single:
                body, frame, sealed = await self._receive_signing_record(rank, buf, length, what)
            elif length > SMALL_RECORD:
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
                finisher = FinishAhead(self.fold.acc, divide=False, in_length=length, out=ahead.out)
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

        return await receive_followed(watch, receive, finish)

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

        body, frame = await receive_followed(watch, partial(self._receive_verified, rank, buf, length, what, watch), sign)
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
        if isinstance(item, (_RawHostFrame, _SealedHostFrame, _FoldedHostFrame)):
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
        elif isinstance(item, _FoldedHostFrame):
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
        if header.kind == MuxKind.BROADCAST and self.expecting_broadcast and header.length > SMALL_RECORD:
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
        await receive_followed(
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
            while (end := await watch.landed_past(sent, step=WRITE_PIECE, stop=gate)) is not None:
                await conn.send_piece(buf.view(end)[sent:])
                sent = end
            await watch.wait_done()
            if watch.ok:
                await conn.send_piece(buf.view(watch.length)[gate:])
        except _DISCONNECTS as exc:
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


__all__ = ["ChannelKind", "ControlChannel", "DataChannel", "HostFold", "RelayHandle", "RelayStats", "open_relay"]
