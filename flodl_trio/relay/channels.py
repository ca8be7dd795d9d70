"""A relay channel: K local rank connections in, one upstream connection out.

Task structure of one channel (all in one nursery)::

    rank socket r0 --> rank_reader(r0) --\\
    rank socket r1 --> rank_reader(r1) ---+--[outbound channel]--> outbound_writer --> controller
    rank socket rk --> rank_reader(rk) --/                          (sole upstream writer)

    controller --> upstream_reader --> fan-out to every rank socket (sole rank-socket writer)

With a controller outage bound (``NetBounds.controller_outage`` > 0), a broken
upstream connection is not the end: the task that notices starts a reconnect
task, which dials the controller again (backing off) while the rank side
keeps running, sends ``Resume`` and what the role holds in flight, and swaps
the new connection in; the writer and reader wait for it and go on.

:class:`Channel` owns those tasks, its ranks' comings and goings and how it
ends. What the bytes mean is its role's, a :class:`ChannelRole` it is built
with: :class:`~.router.ControlRouter` (the control channel routes rank-tagged
blobs without parsing them) or :class:`~.data_plane.DataPlane` (the data
channel folds; its round state is a :class:`~.host_fold.HostFold`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import trio

from ..errors import ConnectFailed, FlodlError, HandshakeError, MacError, ProtocolError
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal
from ..wire.mux import (
    DeclareDead,
    MuxHeader,
    MuxKind,
    Outage,
    RankExit,
    RankFinished,
    RankJoin,
    RelayControlMsg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.round_frame import EncodedFrame
from ..wire.salt import Buffer
from .config import ChannelKind, RelayConfig, RelayStats
from .host_ranks import HostRanks
from .outbound import Outbound, Outbox, RankNotice

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
# The longest pause between two dials of a controller that is away.
REDIAL_BACKOFF_MAX_S = 5.0

Redial = Callable[[], Awaitable[MessageStream]]


class ChannelRole(Protocol):
    """What one kind of channel does with its bytes. The :class:`Channel` calls these
    from its tasks; a role reaches the channel only through the channel it was built with."""

    async def read_rank(self, rank: int, conn: MessageStream, out: Outbox) -> None:
        """Read ``rank``'s connection until it closes (a ProtocolError drops that rank alone)."""

    async def rank_left(self, rank: int, out: Outbox) -> RankExit | RankFinished:
        """A rank left: the role's bookkeeping, and the notice that tells the controller."""

    async def rank_back(self, rank: int, out: Outbox) -> None:
        """A rank that had left connected again (before its reader starts)."""

    async def write(self, item: Outbound) -> None:
        """Write one of the role's queued items upstream (called by the sole upstream writer)."""

    async def on_upstream(self, header: MuxHeader, out: Outbox) -> None:
        """Receive, verify and act on the controller's record that ``header`` opens."""

    def resume_notice(self) -> RelayControlMsg | None:
        """What opens a connection that replaces a lost one (after HelloAck), if anything."""

    async def in_flight(self) -> EncodedFrame | None:
        """The records whose answer never came, to send again on a new connection;
        FlodlError if one is in flight that cannot be sent again."""

    def upstream_lost(self) -> None:
        """The connection broke: a task of the role waiting on it (not reading or writing
        it) stops, so the channel's writer lets the connection go."""

    def upstream_replaced(self) -> None:
        """A new connection replaced a lost one: forget whatever came half in on the old
        (called by the upstream reader before it reads the new connection)."""

    def asks_again(self) -> list[RelayControlMsg]:
        """Requests still unanswered, said again on a new connection (after the goodbyes)."""

    def write_goes_on(self) -> bool:
        """Whether the write a lost connection broke goes on over the new one (a round
        whose commit is still to come), instead of being sent again whole."""

    async def go_on_writing(self) -> None:
        """Go on with that write over the new connection (called by the sole upstream writer)."""


class Channel:
    """A channel's nursery, its ranks joining and leaving, the sole upstream
    writer, the upstream read loop, and how it ends; the rest is ``role``'s.

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
        released: Callable[[int], None], role: Callable[[Channel], ChannelRole],
        ranks: Iterable[int] | None = None, away: Iterable[int] = (), redial: Redial | None = None,
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
        self._side_tasks: list[trio.CancelScope] = []  # the role's own tasks (shard readers): end with the channel
        # (rank, whether it is coming back); unbounded, each entry is a rank's connection.
        self._joins_send, self._joins = trio.open_memory_channel[tuple[int, bool]](math.inf)
        self._nursery: trio.Nursery | None = None
        # A lost controller: who dials it again, and how the tasks wait for that.
        self._redial = redial
        self._epoch = 0  # connections that replaced a lost one, so far
        self._reconnecting = False
        self._reconnected = ChangeSignal()
        self._write_lock = trio.Lock()  # the writer's per item, the reconnect's while it lasts
        # Each rank's last goodbye and the life it ended (HostRanks.life): told again to a
        # controller that comes back, unless that rank was let back in since.
        self._goodbyes: dict[int, tuple[RankExit | RankFinished, int]] = {}
        self._goodbyes_queued: dict[int, int] = {}  # a rank's goodbyes not yet out of the writer's hands
        self._goodbye_written = ChangeSignal()
        self.announced_outage = 0.0  # what the controller said it may be away for (Outage)
        self._shutdown_said = False
        self.role = role(self)

    @property
    def outage(self) -> float:
        """How long a lost controller is waited for: this relay's bound, else what the
        controller said (``Outage``), else 0."""
        configured = self.config.bounds.controller_outage
        return self.announced_outage if configured is None else configured

    @property
    def holds(self) -> bool:
        """Whether a lost controller is waited for, up to the outage bound (docs/liveness.md)."""
        return self._redial is not None and self.outage > 0

    @property
    def controller_away(self) -> bool:
        """Whether the controller was lost and its place is not taken yet."""
        return self._reconnecting

    async def controller_back(self) -> None:
        """Until a lost controller's place is taken (at once when none is lost); a
        reconnect that fails ends the channel, and its waiters with it."""
        while self._reconnecting:
            await self._reconnected.wait()

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
        send, receive = trio.open_memory_channel[Outbound](OUTBOUND_DEPTH)
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

    async def _admit_joiners(self, out: Outbox, nursery: trio.Nursery) -> None:
        """Start a reader for each rank as it joins (each reader holds its own clone)."""
        async with out:
            with self._admitting:
                async for rank, rejoined in self._joins:
                    if rejoined:
                        await self.role.rank_back(rank, out)
                    nursery.start_soon(self._rank_reader, rank, out.clone())

    def start_side_task(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Run a task of the role's own (a shard connection's reader) beside the channel's,
        until the channel ends; its error ends the channel."""

        scope = trio.CancelScope()
        self._side_tasks.append(scope)

        async def side() -> None:
            with scope:
                await fn(*args)

        assert self._nursery is not None
        self._nursery.start_soon(side)

    def log_shutdown(self, why: str) -> None:
        """Say once why the channel shuts down (what follows, the controller closing
        behind the last rank say, is logged at DEBUG)."""
        level = logging.DEBUG if self._shutdown_said else logging.INFO
        self._shutdown_said = True
        log.log(level, "relay %s: shutting down: %s", self.config.host_name, why)

    def _stop_after_shutdown(self, why: str) -> None:
        """Nothing more can be written upstream: cancel every task."""
        self.log_shutdown(why)
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    # -- rank side -----------------------------------------------------------

    async def _rank_reader(self, rank: int, out: Outbox) -> None:
        """Read one rank until it leaves; its bad bytes cost only itself."""
        async with out:
            reason = "closed its connection"
            with self.reader_scopes[rank]:
                try:
                    await self.role.read_rank(rank, self.conns[rank], out)
                except (ProtocolError, *CONNECTION_LOST) as exc:
                    if isinstance(exc, MacError):
                        self.stats.mac_failures += 1
                    reason = f"dropped: {exc}"
            await self.drop(rank, out, reason)

    async def drop(self, rank: int, out: Outbox, reason: str, *, report: bool = True) -> None:
        """A local rank left (EOF, error, write failure, or declared dead, joined or not)."""
        if rank in self.gone:
            return
        self.gone.add(rank)
        if self.config.kind is ChannelKind.DATA:
            self.host.leave_data(rank)
        self.stats.live_ranks = len(self.live)
        level = logging.WARNING if reason.startswith("dropped") else logging.INFO
        log.log(level, "relay %s: rank %d %s", self.config.host_name, rank, reason)
        scope = self.reader_scopes.get(rank)
        if scope is not None:
            scope.cancel()
        notice = await self.role.rank_left(rank, out)
        if report:
            self._goodbyes[rank] = (notice, self.host.life(rank))
            self._goodbyes_queued[rank] = self._goodbyes_queued.get(rank, 0) + 1
            await out.send(notice)
        conn = self.conns.get(rank)
        if conn is not None:
            await conn.aclose()
        self._released(rank)
        if not self.live:
            self._after_last_rank_left()

    def _after_last_rank_left(self) -> None:
        """Shut down - unless a rank that left may still come back (it called join()
        and did not say it finished): then keep serving until the controller closes,
        a lost one included (held for up to the outage bound: the controller that comes
        back hears who left from this relay alone, its record may have them live)."""
        waiting_for = self.host.may_return(self.ranks)
        if waiting_for:
            log.info("relay %s: every local rank has left%s; staying up for ranks %s, which may come back",
                     self.config.host_name, " while the controller was away" if self._reconnecting else "",
                     waiting_for)
            return
        if self._reconnecting:
            return self._stop_after_shutdown("every local rank has left while the controller was away")
        self.log_shutdown("every local rank has left")
        # The writer then drains the RankExits and returns.
        self._upstream_reading.cancel()
        self._admitting.cancel()
        for scope in self._side_tasks:
            scope.cancel()

    async def send_to_rank(self, rank: int, chunks: Sequence[Buffer], nbytes: int, out: Outbox) -> None:
        """Deliver one length-framed message; a rank that cannot take it is gone."""
        try:
            await self.conns[rank].send_len_framed(chunks, nbytes)
        except CONNECTION_LOST as exc:
            await self.drop(rank, out, f"could not take a message: {exc}")

    # -- upstream side -------------------------------------------------------

    async def _outbound_writer(self, inbox: trio.MemoryReceiveChannel[Outbound]) -> None:
        async with inbox:
            async for item in inbox:
                resumed = False
                while True:
                    async with self._write_lock:
                        epoch = self._epoch
                        try:
                            await (self.role.go_on_writing() if resumed else self._write(item))
                            break
                        except CONNECTION_LOST as exc:
                            lost: BaseException = exc
                    if isinstance(item, RankExit | RankFinished) and not self.holds:
                        # Only a rank's goodbye was lost: the controller closed the connection (it
                        # does once every rank has finished) before this write, as when the reader
                        # sees EOF first - a shutdown, not a failure.
                        return self._stop_after_shutdown(f"the controller closed the upstream connection ({lost})")
                    await self._upstream_lost(epoch, lost)
                    resumed = self.role.write_goes_on()
                    if resumed:
                        continue  # a round through the shards: its commit comes on the new connection
                    if not isinstance(item, RankJoin):
                        break  # resent by the reconnect (a HostFrame, a goodbye), or stale (a heartbeat)
                if isinstance(item, RankExit | RankFinished):
                    self._goodbye_out(item.rank)
                del item  # a sent HostFrame must not outlive its write while we wait for the next

    def _goodbye_out(self, rank: int) -> None:
        """A goodbye of ``rank`` left the writer's hands (written, or the reconnect's to resend)."""
        left = self._goodbyes_queued.get(rank, 0) - 1
        if left > 0:
            self._goodbyes_queued[rank] = left
        else:
            self._goodbyes_queued.pop(rank, None)
        self._goodbye_written.notify()

    async def goodbyes_written(self, rank: int) -> None:
        """Until every goodbye of ``rank`` queued so far is written upstream. A restarted
        rank's state request waits for it: the controller must hear that the rank's last
        connection ended before it hears the new one ask to come back, or it finds the
        rank live and refuses it (a restart quicker than the relay's writer)."""
        while self._goodbyes_queued.get(rank, 0) > 0:
            await self._goodbye_written.wait()

    async def _write(self, item: Outbound) -> None:
        if isinstance(item, RankNotice):
            return await self.write_notice(item)
        await self.role.write(item)

    async def write_notice(self, notice: RankNotice) -> None:
        """A rank's exit, finish or join request, as a Control record."""
        record = encode_mux_record(MuxKind.CONTROL, encode_control_msg(notice), self.config.salt)
        await self.upstream.send_chunks(record.chunks)

    async def _upstream_reader(self, out: Outbox) -> None:
        async with out:
            with self._upstream_reading:
                while True:
                    epoch = self._epoch
                    try:
                        if not await self._read_upstream(out):
                            return self._stop_after_shutdown("the controller closed the upstream connection")
                    except CONNECTION_LOST as exc:
                        await self._upstream_lost(epoch, exc)
                        self.role.upstream_replaced()

    async def _read_upstream(self, out: Outbox) -> bool:
        """Act on the controller's records until EOF: False, or - when a lost controller
        is waited for - ConnectionError, so the connection is replaced."""
        while True:
            header = await self.upstream.receive_mux_header(self.config.ceiling)
            if header is None:
                if self.holds:
                    raise ConnectionError("the controller closed the connection")
                return False
            await self.role.on_upstream(header, out)

    # -- a lost controller ------------------------------------------------------

    async def _upstream_lost(self, epoch: int, why: BaseException) -> None:
        """The connection of ``epoch`` broke: return once another is up and resumed (or
        FlodlError at once, unless the channel holds through a lost controller)."""
        if not self.holds:
            raise FlodlError(f"relay {self.config.host_name}: connection to the controller failed: {why}") from why
        if epoch == self._epoch and not self._reconnecting:
            self._reconnecting = True
            assert self._nursery is not None
            self._nursery.start_soon(self._reconnect, why)
        while epoch == self._epoch:  # a reconnect that fails raises, which cancels this wait
            await self._reconnected.wait()

    async def _reconnect(self, why: BaseException) -> None:
        """Dial the controller until it answers and takes our resumption, within the outage bound."""
        outage = self.outage
        host, port = self.config.upstream
        self.stats.outages += 1
        log.warning(
            "relay %s: lost the controller %s:%d (%s); holding the %s channel's ranks and redialing for up to %g s",
            self.config.host_name, host, port, why, self.config.kind.value, outage,
        )
        await self.upstream.aclose()
        self.role.upstream_lost()  # before the writer's lock is waited for: a writer waiting on the role lets go
        started = trio.current_time()
        with trio.move_on_after(outage):
            async with self._write_lock:  # nothing else goes up until the new connection has resumed
                self.upstream = await self._dial_until_resumed()
                self._epoch += 1
                self._reconnecting = False
                self.stats.resumed += 1
                log.info("relay %s: resumed with the controller after %.1f s", self.config.host_name,
                         trio.current_time() - started)
                self._reconnected.notify()
                return
        raise FlodlError(
            f"relay {self.config.host_name}: the controller at {host}:{port} did not come back within the "
            f"controller outage bound of {outage:g} s (it was lost: {why})"
        )

    async def _dial_until_resumed(self) -> MessageStream:
        """A new connection that has said ``Resume`` and sent what was in flight."""
        assert self._redial is not None
        delay = self.config.bounds.connect_interval
        while True:
            in_flight = await self.role.in_flight()  # FlodlError: nothing we could resume
            try:
                conn = await self._redial()
            except (*CONNECTION_LOST, ConnectFailed, HandshakeError, trio.TooSlowError) as exc:
                log.info("relay %s: the controller is not back yet (%s)", self.config.host_name, exc)
                await trio.sleep(delay)
                delay = min(2 * delay, REDIAL_BACKOFF_MAX_S)
                continue
            try:
                await self._resume_on(conn, in_flight)
                return conn
            except CONNECTION_LOST as exc:
                log.info("relay %s: the new connection to the controller broke while resuming (%s)",
                         self.config.host_name, exc)
                await conn.aclose()

    async def _resume_on(self, conn: MessageStream, in_flight: EncodedFrame | None) -> None:
        """Tell the controller where we are: the role's Resume, the record it holds in
        flight, the goodbyes of the ranks that left (it may not have heard them), and
        the role's unanswered requests (ranks asking back in)."""
        salt = self.config.salt
        notice = self.role.resume_notice()
        if notice is not None:
            await conn.send_chunks(encode_mux_record(MuxKind.CONTROL, encode_control_msg(notice), salt).chunks)
        if in_flight is not None:
            await conn.send_chunks(in_flight.chunks)
        for msg in [*self._untold_goodbyes(), *self.role.asks_again()]:
            await conn.send_chunks(encode_mux_record(MuxKind.CONTROL, encode_control_msg(msg), salt).chunks)

    def _untold_goodbyes(self) -> list[RankExit | RankFinished]:
        """The goodbyes a controller that comes back may not have heard: each rank's last,
        unless it was let back in since. A rank that reconnected and waits to be let in is
        still dead to the controller, so its goodbye goes before its join request: the new
        controller's record may have it live (it died while the controller was away)."""
        return [notice for rank, (notice, life) in self._goodbyes.items() if self.host.life(rank) == life]

    @asynccontextmanager
    async def record_buffer(self, header: MuxHeader) -> AsyncIterator[ReceiveBuffer]:
        """Where a record from the controller lands: the small buffer, or one lent from
        the pool for as long as the record is being handled."""
        if header.length <= SMALL_MESSAGE:
            yield self._small
            return
        buf = await self.pool.acquire()
        try:
            yield buf
        finally:
            self.pool.release(buf)

    async def receive_record(self, header: MuxHeader, buf: ReceiveBuffer) -> tuple[MuxKind, memoryview]:
        """Receive and verify the record ``header`` opens, into ``buf``."""
        kind, payload = await self.upstream.receive_mux_payload(header, buf, self.config.salt)
        self.stats.bytes_down += header.length
        return kind, payload

    def unexpected_record(self, kind: MuxKind) -> ProtocolError:
        return ProtocolError(
            f"relay {self.config.host_name}: controller sent a {kind.name} record on the {self.config.kind.value} channel"
        )

    async def on_control(self, msg: RelayControlMsg, out: Outbox) -> None:
        """The control messages every channel takes: a rank declared dead, how long the
        controller may be away."""
        if isinstance(msg, Outage):
            self.announced_outage = msg.millis / 1000
            return
        if isinstance(msg, DeclareDead):
            if msg.rank in self.ranks:
                # Joined or not: a rank that never connected leaves the barrier too.
                self.host.declare_dead(msg.rank)
                how = "connection closed" if msg.rank in self.conns else "it had not connected"
                await self.drop(msg.rank, out, f"declared dead by the controller; {how}", report=False)
            return
        raise ProtocolError(f"relay {self.config.host_name}: unexpected {type(msg).__name__} from the controller mid-session")


__all__ = ["Channel", "ChannelRole", "OUTBOUND_DEPTH", "RECEIVE_BUFFERS"]
