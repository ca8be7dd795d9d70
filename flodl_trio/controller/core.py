"""The controller: one port, one connection per host relay, one consensus per round.

Task structure::

    accept loop --> route(conn) --peek channel magic--> data: relay session
                                                     \\-> control: coordinator (if attached)
                                                      \\-> "GET ": a plain-text status page

    relay session (one per host):  link_reader  --HostFrame--> round fold (shared state)
                                   link_writer  <--Broadcast / DeclareDead-- outbox channel
    death_watcher: DeadRanks --> DeclareDead to the owning relay, re-check the round

A round completes when every rank is dead or carried by a relay that has
delivered; the sum is divided once by the accepted mass, serialized once and
queued to every relay that still has a live rank. A bad connection is refused
and logged while the controller keeps serving; a malformed or wrongly-salted
frame from an accepted relay is fatal (``wait_finished`` raises, naming it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Protocol

import attrs
import trio

from ..errors import (
    ConfigError,
    DesyncError,
    FlodlError,
    MacError,
    ProtocolError,
)
from ..fold.accumulator import (
    FoldAccumulator,
    ImageCache,
    finish_consensus,
    shares_sums,
)
from ..fold.speculative import SpeculativeFrame
from ..settings import channel_magic_timeout, handshake_timeout
from ..transport.arrival import ArrivalWatch, receive_with_followers
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.connect import peer_host, tune_socket, warn_if_public_peer
from ..transport.hashing import encode_enveloped_frame
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import service_nursery
from ..wire.constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    DEFAULT_FRAME_CEILING,
)
from ..wire.mux import (
    DeclareDead,
    HelloAck,
    MuxHeader,
    MuxKind,
    RankExit,
    RelayControlMsg,
    decode_control_msg,
)
from ..wire.round_frame import EncodedFrame, RoundFrame, RoundKind, decode_round_frame
from ..wire.salt import SessionSalt
from .coordinator import Coordinator
from .dead_ranks import DeadRanks
from .links import (
    AfterAllWrites,
    RelayLink,
    check_hello_ranks,
    receive_hello,
)

log = logging.getLogger("flodl_trio.controller")



def _naming(exc: FlodlError, who: str) -> FlodlError:
    """The same error type, its message prefixed with the peer it came from."""
    if who in str(exc):
        return exc
    try:
        return type(exc)(f"{who}: {exc}")
    except TypeError:
        return FlodlError(f"{who}: {exc}")


class OuterOptimizer(Protocol):
    """Transforms the params consensus of each window (DiLoCo, SlowMo, ...)."""

    def __call__(self, consensus: RoundFrame) -> RoundFrame: ...


class CheckpointSink(Protocol):
    """Receives every round's consensus (Model and Control); must return quickly (write elsewhere).

    Windows are told apart by ``consensus.kind``: a Control round opens a
    window, the first Model round after it is the params round (already
    transformed by the outer optimizer: what the ranks receive), the second
    the buffers round. See ``flodl_trio.checkpoint.ConsensusCheckpointer``.
    """

    def __call__(self, round_index: int, consensus: RoundFrame) -> None: ...


ROUND_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@attrs.define
class LatencyHistogram:
    """Cumulative-bucket histogram of round latencies (exported as a Prometheus histogram)."""

    bounds: tuple[float, ...] = ROUND_SECONDS_BUCKETS
    counts: list[int] = attrs.field(factory=lambda: [0] * (len(ROUND_SECONDS_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if seconds <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += seconds


@attrs.define
class ControllerStats:
    """Counters of a running controller (read by the metrics endpoint)."""

    round_seconds: LatencyHistogram = attrs.field(factory=LatencyHistogram)
    rounds: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    last_mass: float = 0.0
    relays: int = 0
    rejected: int = 0
    mac_failures: int = 0
    rounds_finished_ahead: int = 0  # consensus computed and signed while the last frame arrived
    fold_images_reused: int = 0  # rounds folded into an earlier round's f32 images instead of new ones


@attrs.frozen
class ControllerConfig:
    host: str
    port: int
    world_size: int
    salt: SessionSalt
    ceiling: int = DEFAULT_FRAME_CEILING


class ControllerHandle:
    """A running controller: its port, the dead-rank ledger, counters, and how it ended."""

    def __init__(self, port: int, dead_ranks: DeadRanks, stats: ControllerStats) -> None:
        self.port = port
        self.dead_ranks = dead_ranks
        self.stats = stats
        self.rejections: list[str] = []
        self._finished = trio.Event()
        self._error: BaseException | None = None
        self._error_seen = False
        self.coordinator: Coordinator | None = None

    async def wait_finished(self) -> None:
        """Return once every rank is dead or exited; raise the error that stopped it."""
        await self._finished.wait()
        if self._error is not None:
            self._error_seen = True
            raise self._error


@asynccontextmanager
async def open_controller(
    host: str,
    port: int,
    *,
    world_size: int,
    salt: SessionSalt | bytes,
    dead_ranks: DeadRanks | None = None,
    outer_optimizer: OuterOptimizer | None = None,
    checkpoint: CheckpointSink | None = None,
    ceiling: int = DEFAULT_FRAME_CEILING,
    heartbeat_timeout: float | None = None,
    beacon_interval: float | None = None,
) -> AsyncIterator[ControllerHandle]:
    """Serve the cluster's controller on ``host:port`` (0 = any free port) for the block.

    The same port serves the coordinator (control channel): a rank silent for
    ``heartbeat_timeout`` (default 30 s x FLODL_NET_TIMEOUT_SCALE) is declared dead.
    """
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    ledger = dead_ranks if dead_ranks is not None else DeadRanks(world_size)
    if ledger.world_size != world_size:
        raise ConfigError(f"dead_ranks covers world_size {ledger.world_size}, controller has {world_size}")
    config = ControllerConfig(host, port, world_size, SessionSalt.coerce(salt), ceiling)
    coordinator = Coordinator(
        world_size, config.salt, ledger, heartbeat_timeout=heartbeat_timeout, beacon_interval=beacon_interval
    )
    async with service_nursery() as nursery:
        handle: ControllerHandle = await nursery.start(
            _serve_controller, config, ledger, coordinator, outer_optimizer, checkpoint
        )
        yield handle
    if handle._error is not None and not handle._error_seen:
        raise handle._error


async def _serve_controller(
    config: ControllerConfig,
    ledger: DeadRanks,
    coordinator: Coordinator,
    outer_optimizer: OuterOptimizer | None,
    checkpoint: CheckpointSink | None,
    *,
    task_status: trio.TaskStatus[ControllerHandle],
) -> None:
    listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    handle = ControllerHandle(listeners[0].socket.getsockname()[1], ledger, ControllerStats())
    handle.coordinator = coordinator
    controller = _Controller(config, handle, outer_optimizer, checkpoint)
    task_status.started(handle)
    try:
        await controller.run(listeners)
    except Exception as exc:
        handle._error = exc
        log.error("controller: %s", exc, exc_info=isinstance(exc, BaseExceptionGroup))
    finally:
        for listener in listeners:
            await listener.aclose()
        handle._finished.set()


class _Round:
    """State of the round in progress: the fold so far and who delivered it."""

    def __init__(self, images: ImageCache | None = None) -> None:
        self.acc = FoldAccumulator(images)
        self.delivered: set[int] = set()
        self.started = 0.0  # when its first contribution arrived


class _Controller:
    def __init__(
        self,
        config: ControllerConfig,
        handle: ControllerHandle,
        outer_optimizer: OuterOptimizer | None,
        checkpoint: CheckpointSink | None,
    ) -> None:
        self.config = config
        self.handle = handle
        self.stats = handle.stats
        self.dead = handle.dead_ranks
        self.outer_optimizer = outer_optimizer
        self.checkpoint = checkpoint
        self.links: dict[int, RelayLink] = {}
        self.owner: dict[int, RelayLink] = {}
        self.images = ImageCache()
        # Buffers of consensus frames finished ahead and since sent to every relay.
        self._consensus_buffers: list[ReceiveBuffer] = []
        self.round = _Round(self.images)
        self.previous_kind: RoundKind | None = None
        # One model-sized receive buffer; a second (sized by a verified record, so
        # it never grows) once there are two relays whose frames can overlap.
        self.pool = BufferPool(1, limit=2)
        self._scope = trio.CancelScope()
        self._deaths_send, self._deaths_receive = trio.open_memory_channel[int](2 * config.world_size + 1)
        self._forwarded: set[int] = set()
        self._round_changed = trio.Event()
        # A consensus to sign, or one signed already (computed ahead of the last frame).
        self._consensus_send, self._consensus_receive = trio.open_memory_channel[
            tuple[RoundFrame | EncodedFrame, Callable[[], None] | None]
        ](1)

    def _on_death(self, rank: int) -> None:
        """DeadRanks callback (runs outside any task: must never raise)."""
        try:
            self._deaths_send.send_nowait(rank)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def run(self, listeners: list[trio.SocketListener]) -> None:
        unsubscribe = self.dead.subscribe(self._on_death)
        error: Exception | None = None
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._death_watcher)
                    nursery.start_soon(self._broadcaster)
                    if self.handle.coordinator is not None:
                        nursery.start_soon(self.handle.coordinator.run)
                    for listener in listeners:
                        nursery.start_soon(self._accept_loop, listener, nursery)
                    for rank in sorted(self.dead.snapshot()):
                        self._on_death(rank)
        except Exception as exc:
            error = exc
        finally:
            unsubscribe()
        if self.handle._error is None and error is not None:
            raise error

    def _fail(self, exc: BaseException) -> None:
        if self.handle._error is None:
            self.handle._error = exc
            log.error("controller stopping: %s", exc)
        self._scope.cancel()

    # -- connections ---------------------------------------------------------

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                log.warning("controller: accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            tune_socket(stream)
            nursery.start_soon(self._route, stream)

    def _refuse(self, message: str) -> None:
        log.warning("controller: %s", message)
        self.handle.rejections.append(message)
        self.stats.rejected += 1

    async def _route(self, stream: trio.SocketStream) -> None:
        """Peek the channel magic and hand the connection to its subsystem."""
        host = peer_host(stream)
        conn = MessageStream(stream, f"connection from {host}")
        try:
            with trio.fail_after(channel_magic_timeout()):
                magic = await conn.receive_exactly(4, "the channel-select magic")
        except (trio.TooSlowError, *CONNECTION_LOST) as exc:
            self._refuse(f"{conn.peer}: no channel magic ({'timed out' if isinstance(exc, trio.TooSlowError) else exc})")
            await conn.aclose()
            return
        warn_if_public_peer("controller", host)
        value = int.from_bytes(magic, "little")
        if value == CHANNEL_MAGIC_DATA:
            await self._serve_relay(conn)
        elif value == CHANNEL_MAGIC_CONTROL and self.handle.coordinator is not None:
            await self.handle.coordinator.serve_connection(conn)
        elif magic in (b"GET ", b"POST"):
            await self._serve_status(conn)
        else:
            self._refuse(f"{conn.peer}: unknown channel magic {magic.hex()}; closed")
            await conn.aclose()

    async def _serve_relay(self, conn: MessageStream) -> None:
        link = await self._accept_relay(conn)
        if link is None:
            return
        try:
            with link.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._link_writer, link)
                    try:
                        await self._link_reader(link)
                    except FlodlError as exc:
                        self._fail(_naming(exc, link.name))
                    nursery.cancel_scope.cancel()
        finally:
            await self._drop_link(link, "connection closed")

    async def _accept_relay(self, conn: MessageStream) -> RelayLink | None:
        """Read and check the Hello; register the relay or refuse it (logged, not fatal)."""
        try:
            hello = await receive_hello(conn, self.config.salt)
            check_hello_ranks(hello, self.config.world_size, self.owner)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            if isinstance(exc, MacError):
                self.stats.mac_failures += 1
            reason = "no Hello within the handshake deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"data relay {conn.peer} refused: {reason}")
            await conn.aclose()
            return None
        link = RelayLink.accept(hello, conn, self.config.world_size + 8)
        self.links[link.id] = link
        for rank in link.ranks:
            self.owner[rank] = link
        self.stats.relays += 1
        link.queue_control(HelloAck(), self.config.salt)
        for rank in link.ranks:
            if self.dead.is_dead(rank):
                link.queue_control(DeclareDead(rank), self.config.salt)
        log.info("controller: accepted %s", link.name)
        return link

    async def _drop_link(self, link: RelayLink, why: str) -> None:
        """A relay is gone: its live ranks are dead, the survivors carry on."""
        await link.close_and_declare_dead(self.dead, why, log)

    # -- per relay tasks -----------------------------------------------------

    async def _link_writer(self, link: RelayLink) -> None:
        """Sole writer of a relay's socket; a failed write makes its ranks dead."""

        async def write_failed(why: str) -> None:
            await self._drop_link(link, why)

        def written(nbytes: int) -> None:
            self.stats.bytes_out += nbytes

        await link.drain_outbox(write_failed, written)

    async def _link_reader(self, link: RelayLink) -> None:
        while True:
            try:
                header = await link.conn.receive_mux_header(self.config.ceiling)
            except CONNECTION_LOST as exc:
                return await self._drop_link(link, f"read failed: {exc}")
            if header is None:
                return await self._drop_link(link, "closed by the relay")
            big = header.length > SMALL_MESSAGE
            buf = await self.pool.acquire() if big else link.small
            try:
                if not await self._read_record(link, header, buf):
                    return
            finally:
                if big:
                    self.pool.release(buf)
            if big:
                self._lend_second_buffer(header.length)

    def _lend_second_buffer(self, verified_length: int) -> None:
        """Let two relays' frames arrive at once, once a verified record proved the size."""
        if self.pool.size < self.pool.limit and len(self.links) > 1:
            self.pool.add(ReceiveBuffer(verified_length))

    async def _read_record(self, link: RelayLink, header: MuxHeader, buf: ReceiveBuffer) -> bool:
        """Receive, verify and act on one record; False once the link is gone.

        A function of its own so nothing model-sized it touched (a consensus
        computed ahead, say) outlives it while the reader waits for the next record.
        """
        ahead: SpeculativeFrame | None = None
        sealed: EncodedFrame | None = None
        try:
            try:
                if header.length > SMALL_MESSAGE and self._may_finish_ahead(link, header):
                    kind, payload, ahead, sealed = await self._receive_finishing_ahead(link, header, buf)
                else:
                    kind, payload = await link.conn.receive_mux_payload(header, buf, self.config.salt)
            except CONNECTION_LOST as exc:
                await self._drop_link(link, f"read failed: {exc}")
                return False
            except MacError:
                self.stats.mac_failures += 1
                raise
            self.stats.bytes_in += 25 + header.length
            if kind is MuxKind.HOST_FRAME:
                self._on_host_frame(link, payload, ahead if sealed is not None else None, sealed)
            elif kind is MuxKind.CONTROL:
                self._on_relay_control(link, decode_control_msg(payload))
            else:
                raise ProtocolError(f"unexpected {kind.name} record on the data channel")
            return True
        finally:
            self._return_unused(ahead)

    def _on_relay_control(self, link: RelayLink, msg: RelayControlMsg) -> None:
        if not isinstance(msg, RankExit):
            raise ProtocolError(f"unexpected {type(msg).__name__} mid-session")
        if msg.rank not in link.ranks:
            raise ProtocolError(f"RankExit for rank {msg.rank}, which this relay does not carry")
        if self.dead.declare_dead(msg.rank):
            log.info("controller: rank %d exited (%s)", msg.rank, link.name)

    def _may_finish_ahead(self, link: RelayLink, header: MuxHeader) -> bool:
        """Whether this record (by its still unverified header) may be a HostFrame whose
        consensus goes out unchanged, should it become the round's last."""
        if header.kind != MuxKind.HOST_FRAME or link.awaiting_broadcast or link.id in self.round.delivered:
            return False
        # A params round's consensus is transformed by the outer step before it is signed.
        return self.outer_optimizer is None or self.previous_kind != RoundKind.CONTROL

    def _finish_ahead_now(self, link: RelayLink, header: MuxHeader) -> SpeculativeFrame | None:
        """A SpeculativeFrame if ``link``'s frame would now complete the round; else None."""
        if not self._completes(link) or all(self.dead.is_dead(r) for r in link.ranks):
            return None
        # The output goes into the buffer of an earlier consensus sent everywhere, if any.
        out = self._consensus_buffers.pop() if self._consensus_buffers else None
        ahead = SpeculativeFrame(self.round.acc, divide=True, in_length=header.length, out=out)
        if ahead.supported:
            return ahead
        self._return_unused(ahead)
        return None

    def _return_unused(self, ahead: SpeculativeFrame | None) -> None:
        """An attempt that did not become the round's consensus gives its buffer back."""
        if ahead is not None and not ahead.committed:
            ahead.committed = True  # once
            self._consensus_buffers.append(ahead.buffer)

    async def _receive_finishing_ahead(
        self, link: RelayLink, header: MuxHeader, buf: ReceiveBuffer
    ) -> tuple[MuxKind, memoryview, SpeculativeFrame | None, EncodedFrame | None]:
        """Receive a HostFrame; as soon as it is the only one the round still waits for
        (at once, or when the others have landed), compute and sign the consensus beside it."""
        watch = ArrivalWatch(header.length)
        ahead: SpeculativeFrame | None = None
        sealed: EncodedFrame | None = None
        waiting = trio.CancelScope()

        async def finish() -> None:
            nonlocal ahead, sealed
            with waiting:
                while (ahead := self._finish_ahead_now(link, header)) is None:
                    await self._round_changed.wait()
            if ahead is not None:
                sealed = await ahead.follow(buf, watch, MuxKind.BROADCAST, self.config.salt)

        async def receive() -> tuple[MuxKind, memoryview]:
            try:
                return await link.conn.receive_mux_payload(header, buf, self.config.salt, watch)
            finally:
                waiting.cancel()  # not the last one by now: too late to help

        kind, payload = await receive_with_followers(watch, receive, finish)
        return kind, payload, ahead, sealed

    def _on_host_frame(
        self, link: RelayLink, payload: memoryview, ahead: SpeculativeFrame | None = None, sealed: EncodedFrame | None = None
    ) -> None:
        if all(self.dead.is_dead(r) for r in link.ranks):
            log.info("controller: dropped a late frame from %s (all its ranks are dead)", link.name)
            return
        if link.awaiting_broadcast:
            raise DesyncError(
                "sent a HostFrame before the consensus of its previous one went out "
                "(a replayed record, or the ping-pong broke)"
            )
        # The record's MAC (same key, verified as the bytes arrived) covers every byte of the frame.
        frame = decode_round_frame(
            payload, self.config.salt, ceiling=self.config.ceiling, source=link.name, envelope_verified=True
        )
        if self.round.acc.count == 0:
            self.round.started = trio.current_time()
        if ahead is not None and sealed is not None and ahead.acc is self.round.acc and self._completes(link):
            # The consensus was computed from exactly the frames folded so far plus this one.
            self.round.delivered.add(link.id)
            link.awaiting_broadcast = True
            self.stats.rounds_finished_ahead += 1
            self._complete_round(
                ahead.frame(self.config.salt), sealed, after_write=partial(self._consensus_buffers.append, ahead.buffer)
            )
            # The consensus lives in the finisher's own buffer: the sums it read are free.
            self.images.give(ahead.acc.sums())
            ahead.committed = True
            return
        self.round.acc.add(frame, link.name)
        self.round.delivered.add(link.id)
        link.awaiting_broadcast = True
        self._note_round_changed()
        self._maybe_complete()

    def _note_round_changed(self) -> None:
        """Wake whoever waits for the round's set of outstanding frames to shrink."""
        self._round_changed.set()
        self._round_changed = trio.Event()

    def _completes(self, link: RelayLink | None) -> bool:
        """Whether every live rank's frame is in once ``link``'s is (None: as things stand)."""
        for rank in range(self.config.world_size):
            if self.dead.is_dead(rank):
                continue
            owner = self.owner.get(rank)
            if owner is None or (owner is not link and owner.id not in self.round.delivered):
                return False
        return True

    # -- rounds and deaths ---------------------------------------------------

    def _round_ready(self) -> bool:
        return self.round.acc.count > 0 and self._completes(None)

    def _maybe_complete(self) -> None:
        if self._round_ready():
            acc = self.round.acc
            # Without hooks the consensus's memory is reused once written, so a bf16
            # one may as well be rounded over the sums as into new arrays.
            consensus = finish_consensus(acc, overwrite_sums=not self._hooked)
            # Only through the consensus could anyone still read the sums: free now if
            # it does not alias them (re-encoded to bf16), else once every relay has
            # been sent it - and never if a hook saw it (a hook may keep the frame).
            sums = acc.sums()
            if not shares_sums(acc, consensus):
                self.images.give(sums)
                self._complete_round(consensus)
            else:
                self._complete_round(consensus, after_write=partial(self.images.give, sums))

    def _complete_round(
        self, consensus: RoundFrame, sealed: EncodedFrame | None = None, after_write: Callable[[], None] | None = None
    ) -> None:
        """Account for the finished round and hand its consensus (signed already, when
        computed ahead) to the broadcaster.

        ``after_write`` (giving the consensus's memory back for reuse) runs once
        every relay has been sent it - or never, if a hook saw the consensus
        (the outer optimizer or a checkpoint sink may keep the frame).
        """
        finished, self.round = self.round, _Round(self.images)
        self._note_round_changed()
        self.stats.rounds += 1
        self.stats.fold_images_reused = self.images.reused
        self.stats.round_seconds.observe(trio.current_time() - finished.started)
        self.stats.last_mass = consensus.weight
        transformed = self._apply_hooks(consensus)
        if self._hooked:
            after_write = None
        # Capacity 1 suffices: the next round cannot complete before this one's
        # consensus reached the relays, so the broadcaster never falls behind.
        outgoing = sealed if sealed is not None and transformed is consensus else transformed
        self._consensus_send.send_nowait((outgoing, after_write))

    async def _broadcaster(self) -> None:
        """Sign each consensus once (both MACs in parallel) and queue it to every live relay."""
        async for consensus, after_write in self._consensus_receive:
            if isinstance(consensus, EncodedFrame):
                record = consensus
            else:
                record = await encode_enveloped_frame(MuxKind.BROADCAST, consensus, self.config.salt)
            targets = [
                link for link in self.links.values()
                if not link.closed and any(not self.dead.is_dead(r) for r in link.ranks)
            ]
            written = None if after_write is None else AfterAllWrites(len(targets), after_write)
            for link in targets:
                link.queue(record, broadcast=True, on_written=None if written is None else written.one)
            # Only the link outboxes may keep this round's consensus alive (until written).
            del consensus, record, after_write, written

    @property
    def _hooked(self) -> bool:
        """Whether an outer optimizer or checkpoint sink sees each consensus (and may keep it)."""
        return self.outer_optimizer is not None or self.checkpoint is not None

    def _apply_hooks(self, consensus: RoundFrame) -> RoundFrame:
        is_params_round = consensus.kind == RoundKind.MODEL and self.previous_kind == RoundKind.CONTROL
        self.previous_kind = consensus.kind
        if is_params_round and self.outer_optimizer is not None and consensus.weight > 0:
            consensus = self.outer_optimizer(consensus)
        if self.checkpoint is not None:
            self.checkpoint(self.stats.rounds, consensus)
        return consensus

    async def _death_watcher(self) -> None:
        """Each new death: one DeclareDead to the relay carrying it, then re-check the round."""
        async for rank in self._deaths_receive:
            if rank in self._forwarded:
                continue
            self._forwarded.add(rank)
            link = self.owner.get(rank)
            if link is not None and not link.closed:
                link.queue_control(DeclareDead(rank), self.config.salt)
            self._note_round_changed()
            try:
                self._maybe_complete()
            except FlodlError as exc:
                self._fail(exc)
                return
            if self.dead.all_dead() and not self.handle._finished.is_set():
                log.info("controller: every rank is dead or has exited; finished after %d rounds", self.stats.rounds)
                self.handle._finished.set()

    # -- status page ---------------------------------------------------------

    async def _serve_status(self, conn: MessageStream) -> None:
        """A plain JSON status for operators who curl the controller port."""
        request = bytearray()
        with trio.move_on_after(handshake_timeout()):
            while b"\r\n\r\n" not in request and len(request) < 8192:
                try:
                    chunk = await conn.stream.receive_some(4096)
                except CONNECTION_LOST:
                    break
                if not chunk:
                    break
                request += chunk
        body = json.dumps(
            {
                "world_size": self.config.world_size,
                "dead_ranks": sorted(self.dead.snapshot()),
                "relays": [{"host": l.host, "ranks": list(l.ranks)} for l in self.links.values() if not l.closed],
                "stats": attrs.asdict(self.stats),
            }
        ).encode()
        head = f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        try:
            await conn.send_chunks([head, body])
        except CONNECTION_LOST:
            pass
        await conn.aclose()


__all__ = ["CheckpointSink", "ControllerHandle", "ControllerStats", "OuterOptimizer", "open_controller"]
