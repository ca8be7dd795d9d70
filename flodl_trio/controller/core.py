"""The controller: one port, one connection per host relay, one consensus per round.

Task structure::

    serve_listeners --> route(conn) --peek channel magic--> data: relay session
                                                         \\-> control: coordinator (if attached)
                                                          \\-> "GET ": a JSON status page

    relay session (one per host):  link_reader  --HostFrame--> ControllerRound --Consensus-->
                                   link_writer  <--Broadcast / DeclareDead-- outbox channel
    broadcaster:    Consensus --> signed once --> every live relay's outbox
    DeadRanks.watch: each new death --> DeclareDead to the owning relay; the round may complete

The round and its membership live in :class:`~.round.ControllerRound`, which
does no I/O; the tasks here move bytes and tell it what happened. A bad
connection is refused and logged while the controller keeps serving; a
malformed or wrongly-salted frame from an accepted relay raises out of its
session, through the nurseries, to :func:`open_controller`'s boundary, which
records it for ``wait_finished`` (naming the relay).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import attrs
import trio

from ..errors import ConfigError, DesyncError, FlodlError, MacError, ProtocolError
from ..fold.speculative import Speculation, receive_speculating
from ..transport.arrival import ArrivalWatch
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.connect import (
    listener_port,
    peer_host,
    tune_socket,
    warn_if_public_peer,
)
from ..transport.hashing import encode_enveloped_frame
from ..transport.refusals import Refusals
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import (
    ChangeSignal,
    RunOutcome,
    one_error,
    serving,
)
from ..wire.constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    CHANNEL_MAGIC_STATE,
    DEFAULT_FRAME_CEILING,
    MAC_LEN,
    MUX_HEADER_LEN,
)
from ..wire.lanes import DEFAULT_LANE_MIN_BYTES, MAX_LANES, LaneLayout, read_lane_tag
from ..wire.mux import (
    DeclareDead,
    HelloAck,
    Lanes,
    MuxHeader,
    MuxKind,
    RankAway,
    RankExit,
    RankFinished,
    RankJoin,
    RelayControlMsg,
    decode_control_msg,
    record_payload,
)
from ..wire.round_frame import EncodedFrame, decode_round_frame
from ..wire.salt import Buffer, SessionSalt
from ..wire.state import (
    STATE_ANSWER_LEN,
    STATE_RECEIPT_LEN,
    STATE_REQUEST_LEN,
    EntryStatus,
    JoinNonces,
    StateEntry,
    StateReply,
    StateRequest,
    StateStatus,
    check_state_answer,
    check_state_receipt,
    decode_state_request,
    encode_state_challenge,
    encode_state_entry,
    encode_state_reply,
    new_nonce,
)
from .coordinator import Coordinator
from .dead_ranks import DeadRanks
from .lane_windows import LaneWindows
from .links import AfterAllWrites, RelayLink, receive_hello
from .membership import Membership
from .round import (
    CheckpointSink,
    Consensus,
    ControllerRound,
    OuterOptimizer,
    WindowState,
    WindowStore,
)
from .stats import ControllerStats

log = logging.getLogger("flodl_trio.controller")

Listeners = Sequence[trio.abc.Listener[trio.abc.Stream]]


def attributed_to(exc: FlodlError, who: str) -> FlodlError:
    """The same error type, its message prefixed with the peer it came from."""
    if who in str(exc):
        return exc
    try:
        return type(exc)(f"{who}: {exc}")
    except TypeError:
        return FlodlError(f"{who}: {exc}")


@attrs.frozen
class ControllerConfig:
    world_size: int
    salt: SessionSalt
    ceiling: int = DEFAULT_FRAME_CEILING
    bounds: NetBounds = attrs.field(factory=NetBounds)
    deterministic: bool = False  # fold hosts in a fixed order (by their lowest rank)
    lanes: int = 1  # each round reduced in up to this many lanes (docs/wire.md, "Lanes")
    lane_min_bytes: int = DEFAULT_LANE_MIN_BYTES  # a lane per this many payload bytes (0: always ``lanes``)


@attrs.define(eq=False)
class _Joiner:
    """A dead rank's verified state request, from its answer to its entry: its state
    goes out once both halves of the return are in (``state_due``), and it enters
    at a boundary once it has it (``decided``), unless the return is called off."""

    nonces: JoinNonces
    state_due: trio.Event = attrs.field(factory=trio.Event)
    decided: trio.Event = attrs.field(factory=trio.Event)
    state: WindowState | None = None
    entry: int | None = None  # the first window it runs in its host's barrier
    refusal: str | None = None

    def send_state(self, state: WindowState | None) -> None:
        self.state = state
        self.state_due.set()

    def enter(self, window: int) -> None:
        self.entry = window
        self.decided.set()

    def refuse(self, reason: str) -> None:
        if self.entry is None:
            self.refusal = reason
            self.state_due.set()
            self.decided.set()


async def _signed(frame: memoryview, salt: SessionSalt) -> EncodedFrame:
    """A frame joined from lanes, its MAC (the last 8 bytes) written in off the event loop."""

    def sign() -> None:
        frame[-MAC_LEN:] = salt.mac8(frame[:-MAC_LEN])

    await trio.to_thread.run_sync(sign)
    return EncodedFrame([frame], len(frame))


async def _cancel_on_eof(conn: MessageStream, scope: trio.CancelScope) -> None:
    """A waiting state request has nothing more to say: any byte, or the end, ends the wait."""
    try:
        await conn.stream.receive_some(1)
    except CONNECTION_LOST:
        pass
    scope.cancel()


async def _wait_unless_peer_leaves(conn: MessageStream, event: trio.Event) -> bool:
    """Wait for ``event``; False if the peer closed (or spoke out of turn) first."""
    with trio.CancelScope() as waiting:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_eof, conn, waiting)
            await event.wait()
            nursery.cancel_scope.cancel()
    return not waiting.cancelled_caught


class ControllerHandle:
    """A running controller: its port, the dead-rank ledger, counters, and how it ended."""

    def __init__(self, port: int, dead_ranks: DeadRanks, stats: ControllerStats, coordinator: Coordinator) -> None:
        self.port = port
        self.dead_ranks = dead_ranks
        self.stats = stats
        self.coordinator = coordinator
        self.rejections = Refusals()
        self.outcome = RunOutcome()

    async def wait_finished(self) -> None:
        """Return once every rank is dead or exited; raise the error that stopped it."""
        await self.outcome.wait()


def check_lanes(lanes: int, *, outer_optimizer: object) -> None:
    """Lanes need a count the relays share and, with an outer optimizer, one that can
    step a lane at a time (``step_lane``: the built-in ones can)."""
    if not 1 <= lanes <= MAX_LANES:
        raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
    if lanes > 1 and outer_optimizer is not None and not callable(getattr(outer_optimizer, "step_lane", None)):
        raise ConfigError(
            f"lanes={lanes} steps each lane of a params consensus as it finishes: the outer optimizer "
            f"{type(outer_optimizer).__name__} needs a step_lane(consensus, layout, lane, fragment) method "
            "(the built-in ones have it), or use lanes=1"
        )


def membership_policy(
    world_size: int, rejoin_timeout: float, min_ranks: int | None, formation_timeout: float | None
) -> Membership:
    """The membership policy, its arguments checked."""
    if not (math.isfinite(rejoin_timeout) and rejoin_timeout >= 0):
        raise ConfigError(f"rejoin_timeout must be a finite number >= 0, got {rejoin_timeout!r}")
    if formation_timeout is not None and not (math.isfinite(formation_timeout) and formation_timeout > 0):
        raise ConfigError(f"formation_timeout must be a finite number of seconds > 0, got {formation_timeout!r}")
    if min_ranks is not None and not 1 <= min_ranks <= world_size:
        raise ConfigError(f"min_ranks must be between 1 and world_size {world_size}, got {min_ranks}")
    if min_ranks is not None and min_ranks < world_size:
        if formation_timeout is None:
            raise ConfigError(f"min_ranks {min_ranks} < world_size {world_size} needs a formation_timeout")
        if rejoin_timeout <= 0:
            raise ConfigError("min_ranks below world_size needs rejoin_timeout > 0: the late ranks join by rejoining")
    return Membership(world_size, rejoin_timeout, min_ranks=min_ranks, formation_timeout=formation_timeout)


@asynccontextmanager
async def open_controller(
    host: str | None = None,
    port: int = 0,
    *,
    world_size: int,
    salt: SessionSalt | bytes,
    dead_ranks: DeadRanks | None = None,
    outer_optimizer: OuterOptimizer | None = None,
    checkpoint: CheckpointSink | None = None,
    ceiling: int = DEFAULT_FRAME_CEILING,
    heartbeat_timeout: float | None = None,
    beacon_interval: float | None = None,
    bounds: NetBounds | None = None,
    listeners: Listeners | None = None,
    rejoin_timeout: float = 0.0,
    min_ranks: int | None = None,
    formation_timeout: float | None = None,
    deterministic: bool = False,
    lanes: int = 1,
    lane_min_bytes: int = DEFAULT_LANE_MIN_BYTES,
) -> AsyncIterator[ControllerHandle]:
    """Serve the cluster's controller on ``host:port`` (0 = any free port), or on the
    given ``listeners``, for the block.

    The same port serves the coordinator (control channel): a rank silent for
    ``heartbeat_timeout`` (default ``bounds.heartbeat_timeout``, 30 s x
    FLODL_NET_TIMEOUT_SCALE) is declared dead. ``bounds`` defaults to
    :meth:`NetBounds.from_env`. A dead rank may rejoin for ``rejoin_timeout``
    seconds after its death (0: never, as in flodl); the cluster is finished
    once every rank is dead and none may come back. The first round waits for
    every rank, or - with ``formation_timeout`` - for ``min_ranks`` of them
    once that many seconds have passed; the others join later (a rank is
    present once its trainer called ``join``). ``deterministic``: add the hosts'
    frames in a fixed order (by each relay's lowest rank) whatever order they
    arrive in; with deterministic relays, the same frames give the same bytes.
    ``lanes``: reduce each round in this many lanes (every data relay must be
    started with the same count): a lane's consensus goes down while the next
    lane is still coming up (an outer optimizer steps each lane as it finishes).
    A round goes in one lane per ``lane_min_bytes`` of its frame's payload (0:
    always ``lanes``), so small rounds stay one record each way.
    """
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    check_lanes(lanes, outer_optimizer=outer_optimizer)
    membership = membership_policy(world_size, rejoin_timeout, min_ranks, formation_timeout)
    ledger = dead_ranks if dead_ranks is not None else DeadRanks(world_size)
    if ledger.world_size != world_size:
        raise ConfigError(f"dead_ranks covers world_size {ledger.world_size}, controller has {world_size}")
    net = bounds if bounds is not None else NetBounds.from_env()
    if heartbeat_timeout is not None:
        net = attrs.evolve(net, heartbeat_timeout=heartbeat_timeout)
    if lane_min_bytes < 0:
        raise ConfigError(f"lane_min_bytes must be >= 0, got {lane_min_bytes}")
    config = ControllerConfig(world_size, SessionSalt.coerce(salt), ceiling, net, deterministic, lanes, lane_min_bytes)
    coordinator = Coordinator(world_size, config.salt, ledger, heartbeat_timeout=net.heartbeat_timeout,
                              beacon_interval=beacon_interval, bounds=net)
    if listeners is None:
        if host is None:
            raise ConfigError("open_controller needs a host to listen on, or listeners=")
        listeners = await trio.open_tcp_listeners(port, host=host)
    handle = ControllerHandle(listener_port(listeners[0]), ledger, ControllerStats(), coordinator)
    controller = _Controller(config, handle, listeners, outer_optimizer, checkpoint, membership)
    async with serving(controller.run, handle.outcome, log, "controller"):
        yield handle


class _Controller:
    def __init__(
        self,
        config: ControllerConfig,
        handle: ControllerHandle,
        listeners: Listeners,
        outer_optimizer: OuterOptimizer | None,
        checkpoint: CheckpointSink | None,
        membership: Membership,
    ) -> None:
        self.config = config
        self.membership = membership
        self.membership_changed = ChangeSignal()
        self.window_store = WindowStore()
        self._joiners: dict[int, _Joiner] = {}  # rank -> its verified state request
        self._asks: dict[int, int] = {}  # rank -> how many times its relay asked it back (names each ask)
        self._nursery: trio.Nursery | None = None
        handle.coordinator.may_return = lambda rank: membership.may_return(rank, trio.current_time())
        self.handle = handle
        self.listeners = listeners
        self.stats = handle.stats
        self.dead = handle.dead_ranks
        self.round_changed = ChangeSignal()
        # One round per lane (one in all without lanes); membership lives in each alike.
        # With lanes, the windows (outer step, checkpoints, joiners' state) are the
        # LaneWindows' to keep, over whole rounds; the lanes' rounds have no hooks.
        laned = config.lanes > 1
        self.rounds = [
            ControllerRound(
                config.world_size, self.dead, self.stats, on_change=self.round_changed.notify,
                outer_optimizer=None if laned else outer_optimizer, checkpoint=None if laned else checkpoint,
            )
            for _ in range(config.lanes)
        ]
        self.round = self.rounds[0]
        self.lane_windows = LaneWindows(config.salt, outer_optimizer, checkpoint) if laned else None
        self.windows: ControllerRound | LaneWindows = self.lane_windows or self.round
        self._next_lane: dict[int, int] = {}  # link id -> the lane its next HostFrame is
        self._lane_layout: dict[int, LaneLayout] = {}  # link id -> its round's layout (from its lane 0)
        self.links: dict[int, RelayLink] = {}
        # One model-sized receive buffer; a second (sized by a verified record, so
        # it never grows) once there are two relays whose frames can overlap.
        self.pool = BufferPool(1, limit=2)
        self._forwarded: set[int] = set()
        self._exited: set[int] = set()  # ranks whose own relay reported them gone (no DeclareDead needed)
        # Capacity 1 suffices: the next round cannot complete before this one's
        # consensus has been queued to the relays (every relay that delivered
        # waits for it), so a second send_nowait here would be a bug and raise.
        # With lanes, each lane's round may have one consensus waiting.
        self._consensus_send, self._consensus_receive = trio.open_memory_channel[tuple[int, Consensus]](config.lanes)

    async def run(self) -> None:
        async with self._consensus_send, trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.dead.watch, self._forward_new_deaths)
            nursery.start_soon(self._finish_when_nobody_can_return)
            nursery.start_soon(self._form_without_everyone)
            nursery.start_soon(self._broadcaster, self._consensus_receive)
            nursery.start_soon(self.handle.coordinator.run)
            await nursery.start(trio.serve_listeners, self._route, self.listeners)

    def _refuse(self, message: str) -> None:
        log.warning("controller: %s", message)
        self.handle.rejections.add(message)
        self.stats.rejected += 1

    # -- connections ---------------------------------------------------------

    async def _route(self, stream: trio.abc.Stream) -> None:
        """Peek the channel magic and hand the connection to its subsystem."""
        tune_socket(stream)
        host = peer_host(stream)
        conn = MessageStream(stream, f"connection from {host}", self.config.bounds)
        try:
            with trio.fail_after(self.config.bounds.channel_magic):
                magic = await conn.receive_exactly(4, "the channel-select magic")
        except (trio.TooSlowError, *CONNECTION_LOST) as exc:
            self._refuse(f"{conn.peer}: no channel magic ({'timed out' if isinstance(exc, trio.TooSlowError) else exc})")
            await conn.aclose()
            return
        warn_if_public_peer("controller", host)
        value = int.from_bytes(magic, "little")
        if value == CHANNEL_MAGIC_DATA:
            await self._serve_relay(conn)
        elif value == CHANNEL_MAGIC_CONTROL:
            await self.handle.coordinator.serve_connection(conn)
        elif value == CHANNEL_MAGIC_STATE:
            await self._serve_state(conn, magic)
        elif magic in (b"GET ", b"POST"):
            await self._serve_status(conn)
        else:
            self._refuse(f"{conn.peer}: unknown channel magic {magic.hex()}; closed")
            await conn.aclose()

    async def _serve_relay(self, conn: MessageStream) -> None:
        """One data relay's session: a writer task beside the reader, until either ends.

        When the session ends its ranks are dead. Bytes from the relay that break
        the protocol (a bad MAC, a malformed frame, a broken ping-pong) cost only
        that relay: it is dropped, logged and counted, and the survivors' round
        completes without it. Any other error is the controller's own and stops
        it; it leaves here naming the relay. Neither that nor a cancellation (the
        controller is stopping) declares deaths, which would race the error to
        ``wait_finished``.
        """
        link = await self._accept_relay(conn)
        if link is None:
            return
        why = "connection closed"
        try:
            with link.scope, one_error():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._link_writer, link)
                    await self._link_reader(link)
                    nursery.cancel_scope.cancel()
        except ProtocolError as exc:
            why = f"dropped for breaking the protocol ({exc})"
            self.stats.relays_dropped += 1
            log.warning("controller: %s %s; its ranks are dead", link.name, why)
        except FlodlError as exc:
            named = attributed_to(exc, link.name)
            if named is exc:
                raise
            raise named from exc
        if link.dropped_for is not None:
            why = f"dropped: {link.dropped_for}"
            self.stats.relays_dropped += 1
            log.warning("controller: %s %s; its ranks are dead", link.name, why)
        await self._drop_link(link, why)

    async def _accept_relay(self, conn: MessageStream) -> RelayLink | None:
        """Read and check the Hello; seat the relay or refuse it (logged, not fatal)."""
        try:
            hello = await receive_hello(conn, self.config.salt, self.config.bounds)
            self.round.check_hello(hello)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            if isinstance(exc, MacError):
                self.stats.mac_failures += 1
            reason = "no Hello within the handshake deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"data relay {conn.peer} refused: {reason}")
            await conn.aclose()
            return None
        link = RelayLink.accept(hello, conn, self.config.world_size + 8)
        self.links[link.id] = link
        for lane_round in self.rounds:
            lane_round.seat(link.id, hello, link.name)
        self._next_lane[link.id] = 0
        self.stats.relays += 1
        link.queue_control(HelloAck(), self.config.salt)
        if self.config.lanes > 1:
            link.queue_control(Lanes(self.config.lanes, self.config.lane_min_bytes), self.config.salt)
        now = trio.current_time()
        for rank in link.ranks:
            if self.dead.is_dead(rank):
                away = self.membership.may_return(rank, now)  # a restarted host: it may come back
                link.queue_control(RankAway(rank) if away else DeclareDead(rank), self.config.salt)
        log.info("controller: accepted %s", link.name)
        return link

    async def _drop_link(self, link: RelayLink, why: str) -> None:
        """A relay is gone: its live ranks are dead, the survivors carry on."""
        for lane_round in self.rounds:
            lane_round.unseat(link.id)
        for rank in self.membership.seat_gone(link.id):
            self._call_off_return(rank, f"{link.name} left before it was let back in")
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
            if self.config.deterministic and header.kind == MuxKind.HOST_FRAME:
                await self._wait_for_turn(link)  # its payload waits in the socket meanwhile
            big = header.length > SMALL_MESSAGE
            buf = await self.pool.acquire() if big else link.small
            try:
                if not await self._read_record(link, header, buf):
                    return
            finally:
                if big:
                    self.pool.release(buf)
            if big and self.pool.size < self.pool.limit and len(self.links) > 1:
                # Let two relays' frames arrive at once, now that a verified record proved the size.
                self.pool.add(ReceiveBuffer(header.length))

    async def _wait_for_turn(self, link: RelayLink) -> None:
        """Deterministic mode: fold this relay's HostFrame only after those of the
        relays before it (by their lowest rank) are folded or gone."""
        while not self.rounds[self._next_lane[link.id]].may_fold_now(link.id):
            await self.round_changed.wait()

    async def _read_record(self, link: RelayLink, header: MuxHeader, buf: ReceiveBuffer) -> bool:
        """Receive, verify and act on one record; False once the link is gone.

        A function of its own so nothing model-sized it touched (a consensus
        computed ahead, say) outlives it while the reader waits for the next record.
        """
        speculation = Speculation()
        used = False
        try:
            try:
                kind, payload, speculation = await self._receive_record(link, header, buf)
            except CONNECTION_LOST as exc:
                await self._drop_link(link, f"read failed: {exc}")
                return False
            except MacError:
                self.stats.mac_failures += 1
                raise
            self.stats.bytes_in += MUX_HEADER_LEN + header.length
            if kind is MuxKind.HOST_FRAME:
                used = self._on_host_frame(link, payload, speculation)
            elif kind is MuxKind.CONTROL:
                self._on_relay_control(link, decode_control_msg(payload))
            else:
                raise ProtocolError(f"unexpected {kind.name} record on the data channel")
            return True
        finally:
            if not used:
                self.round.give_back(speculation.frame)

    async def _receive_record(
        self, link: RelayLink, header: MuxHeader, buf: ReceiveBuffer
    ) -> tuple[MuxKind, memoryview, Speculation]:
        """A record's payload, verified as it arrives. A large HostFrame that becomes the
        round's last has the consensus computed and signed beside it."""
        salt = self.config.salt
        if header.length <= SMALL_MESSAGE or self.config.lanes > 1 or not self.round.may_speculate(link.id, header.kind):
            kind, payload = await link.conn.receive_mux_payload(header, buf, salt)
            return kind, payload, Speculation()
        watch = ArrivalWatch(header.length)
        (kind, payload), speculation = await receive_speculating(
            watch, partial(link.conn.receive_mux_payload, header, buf, salt, watch),
            is_last=partial(self.round.is_last, link.id), begin=partial(self.round.begin_speculation, header.length),
            changes=self.round_changed, buf=buf, kind=MuxKind.BROADCAST, salt=salt,
        )
        return kind, payload, speculation

    def _on_host_frame(self, link: RelayLink, payload: memoryview, speculation: Speculation) -> bool:
        """Fold a relay's HostFrame (with lanes: its next lane's); whether the speculation
        became the round's consensus."""
        if self.config.lanes > 1:
            return self._on_lane_frame(link, payload)
        if not self.round.accepts_host_frame(link.id):
            log.info("controller: dropped a late frame from %s (all its ranks are dead)", link.name)
            return False
        # The record's MAC (same key, verified as the bytes arrived) covers every byte of the frame.
        frame = decode_round_frame(
            payload, self.config.salt, ceiling=self.config.ceiling, source=link.name, authenticated=True
        )
        now = trio.current_time()
        if speculation.frame is not None and speculation.record is not None:
            consensus = self.round.commit_speculation(link.id, speculation.frame, speculation.record, now)
            if consensus is not None:
                self._consensus_send.send_nowait((0, consensus))
                return True
        consensus = self.round.deposit(link.id, frame, now)
        self._expel(self.round)
        if consensus is not None:
            self._consensus_send.send_nowait((0, consensus))
        return False

    def _expel(self, lane_round: ControllerRound) -> None:
        """Cut off the relays whose folded frames a later one proved wrong (their part
        of the round's sum is gone already; their ranks' deaths let it complete)."""
        for seat_id, why in lane_round.take_expelled().items():
            link = self.links.get(seat_id)
            if link is not None:
                link.expel(why)

    def _on_lane_frame(self, link: RelayLink, payload: memoryview) -> bool:
        """One lane of a relay's HostFrame (its tag says which, and of how many): folded
        into that lane's round, whose consensus goes down as soon as every live relay
        delivered its lane."""
        frame = decode_round_frame(
            payload, self.config.salt, ceiling=self.config.ceiling, source=link.name, authenticated=True
        )
        tag = read_lane_tag(frame)
        expected = self._next_lane[link.id]
        if tag is None or tag.index != expected or tag.count > self.config.lanes:
            raise DesyncError(
                f"sent a HostFrame with lane tag {tag} where lane {expected} of at most {self.config.lanes} was due"
            )
        lane, count = tag.index, tag.count
        # Each lane must be what the schema its lane 0 carried says (SchemaError: this relay is dropped).
        if lane == 0:
            self._lane_layout[link.id] = LaneLayout.of_lane0(frame)
        else:
            self._lane_layout[link.id].check_lane(lane, frame)
        self._next_lane[link.id] = 0 if lane == count - 1 else lane + 1
        lane_round = self.rounds[lane]
        if not lane_round.accepts_host_frame(link.id):
            log.info("controller: dropped a late lane-%d frame from %s (all its ranks are dead)", lane, link.name)
            return False
        consensus = lane_round.deposit(link.id, frame, trio.current_time())
        self._expel(lane_round)
        if consensus is not None:
            self._consensus_send.send_nowait((lane, consensus))
        return False

    def _on_relay_control(self, link: RelayLink, msg: RelayControlMsg) -> None:
        if not isinstance(msg, RankExit | RankJoin | RankFinished):
            raise ProtocolError(f"unexpected {type(msg).__name__} mid-session")
        if msg.rank not in link.ranks:
            raise ProtocolError(f"{type(msg).__name__} for rank {msg.rank}, which this relay does not carry")
        if isinstance(msg, RankJoin):
            return self._on_rank_join(link, msg.rank)
        if isinstance(msg, RankFinished):
            self.membership.said_finished(msg.rank)
            self.handle.coordinator.finished.add(msg.rank)  # no death notice: it left by itself
        else:
            self.membership.left_plainly(msg.rank)
        self.membership_changed.notify()
        self._exited.add(msg.rank)
        if msg.rank in self.membership.asked:
            self._call_off_return(msg.rank, f"its connection to {link.name} closed before it was let back in")
        if self.dead.declare_dead(msg.rank):
            how = "finished its training" if isinstance(msg, RankFinished) else "exited"
            log.info("controller: rank %d %s (%s)", msg.rank, how, link.name)

    def _on_rank_join(self, link: RelayLink, rank: int) -> None:
        """A rank that had left reconnected to its relay: say no now, or send it its
        state once its verified state request is in too (it must come within the
        handshake bound: a connection that only replays a rank's handshake holds
        the rank's seat no longer than that)."""
        refusal = self.membership.refusal(rank, trio.current_time(), dead=self.dead.is_dead(rank))
        if refusal is not None:
            return self._refuse_return(rank, link, refusal)
        self.membership.ask(rank, link.id)
        ask = self._asks[rank] = self._asks.get(rank, 0) + 1
        log.info("controller: rank %d asks to rejoin (%s); its state goes out once it asks for it", rank, link.name)
        if self._nursery is not None and rank not in self.membership.waiting:
            self._nursery.start_soon(self._expect_state_request, rank, ask, link)
        self._send_states_due()

    async def _expect_state_request(self, rank: int, ask: int, link: RelayLink) -> None:
        """Call a return off whose rank sends no verified state request in time."""
        bound = self.config.bounds.handshake
        await trio.sleep(bound)
        if self._asks.get(rank) == ask and rank in self.membership.asked and rank not in self.membership.waiting:
            self._refuse_return(rank, link, f"it reconnected to {link.name} but sent no verified state request "
                                            f"within {bound:g} s (join() comes right after connecting)")

    def _refuse_return(self, rank: int, link: RelayLink | None, reason: str) -> None:
        """Say no to a return: its relay drops the connection; a waiting state request
        is answered with the reason (and counted, like every refused state request)."""
        log.warning("controller: rank %d may not rejoin: %s", rank, reason)
        if link is not None:
            link.queue_control(DeclareDead(rank), self.config.salt)
        if rank in self._joiners:
            self.stats.rejoins_refused += 1
        self._call_off_return(rank, reason)

    def _call_off_return(self, rank: int, reason: str) -> None:
        """A return cannot go on: forget both halves; a waiting state request is refused."""
        self.membership.withdraw(rank)
        joiner = self._joiners.get(rank)
        if joiner is not None:
            joiner.refuse(reason)

    def _send_states_due(self) -> None:
        """Each return whose both halves are in gets the newest finished window now,
        while it is in no barrier (the others train on); one whose cluster has no
        finished window yet waits for the first."""
        state = self.window_store.latest
        for rank, _seat in self.membership.ready():
            joiner = self._joiners.get(rank)
            if joiner is not None and not joiner.state_due.is_set() and state is not None:
                joiner.send_state(state)
        self._let_joiners_in_if_nobody_is_live()

    def _let_joiners_in_if_nobody_is_live(self) -> None:
        """With every rank dead no window will end, so now is a boundary: the cluster
        starts again from the last finished window (a window cut short by the deaths
        is abandoned), with whoever has come back and has its state (with no
        finished window, whoever has come back: there is nothing to send)."""
        if self.dead.dead_count() < self.config.world_size:
            return
        state = self.window_store.latest
        if state is None:
            for rank, _seat in self.membership.ready():
                joiner = self._joiners.get(rank)
                if joiner is not None and not joiner.state_due.is_set():
                    joiner.send_state(None)
                    self.membership.prime(rank)
        if not self.membership.entering():
            return
        next_window = 0 if state is None else state.window + 1
        self.windows.restart_windows_at(next_window)
        self.window_store.abandon_window()
        log.info("controller: every rank is dead; restarting at window %d with those who came back", next_window)
        self._let_joiners_in(next_window)

    def _let_joiners_in(self, window: int) -> None:
        """A window boundary: every return that has its state becomes live, and its
        relay hears so before the window's last consensus (it enters the next round,
        the start of ``window``); the rank is told it enters ``window``."""
        now = trio.current_time()
        for rank, seat in self.membership.entering():
            link = self.links.get(seat)
            refusal = self.membership.refusal(rank, now, dead=self.dead.is_dead(rank))
            if link is None or link.closed or refusal is not None:
                self._refuse_return(rank, None, refusal or "its relay left before it could be let in")
                continue
            link.queue_control(RankJoin(rank), self.config.salt)
            self.membership.rejoined(rank)
            self._forwarded.discard(rank)
            self._exited.discard(rank)
            self.dead.revive(rank)
            self.stats.rejoins, self.stats.late_joins = self.membership.rejoins, self.membership.late_joins
            joiner = self._joiners[rank]
            joiner.enter(window)
            loaded = -1 if joiner.state is None else joiner.state.window
            behind = " (behind: its first window carries no work)" if loaded + 1 < window else ""
            log.info("controller: rank %d rejoins (%s) with the consensus of window %d; it enters window %d%s",
                     rank, link.name, loaded, window, behind)
        self.membership_changed.notify()

    # -- the consensus out, and deaths -----------------------------------------

    async def _broadcaster(self, inbox: trio.MemoryReceiveChannel[tuple[int, Consensus]]) -> None:
        """Sign each consensus once (both MACs in parallel) and queue it to every live relay."""
        async for lane, consensus in inbox:
            lane_round = self.rounds[lane]
            self.membership.formed = True
            part, kept = consensus.part, None
            if self.lane_windows is not None:
                laned = self.lane_windows.take(lane, consensus)
                consensus, part = laned.consensus, laned.part
                if laned.kept is not None:
                    kept = await _signed(laned.kept, self.config.salt)
            if isinstance(consensus.outgoing, EncodedFrame):
                record = consensus.outgoing
            else:
                record = await encode_enveloped_frame(MuxKind.BROADCAST, consensus.outgoing, self.config.salt)
            targets = lane_round.broadcast_targets()  # before any joiner is revived: they did not ask
            if (
                part is not None
                and self.windows.keep_window_state
                and self.window_store.keep(part, kept or record_payload(record))
            ):
                self._at_boundary()
            written = None if consensus.after_write is None else AfterAllWrites(len(targets), consensus.after_write)
            for seat_id in targets:
                self.links[seat_id].queue(
                    record,
                    before_write=partial(lane_round.broadcast_going_out, seat_id),
                    on_written=None if written is None else written.one,
                )
            # Only the link outboxes may keep this round's consensus alive (until written).
            del consensus, record, written

    def _at_boundary(self) -> None:
        """A window just finished (its state is kept): returns that have their state
        enter the next window; those waiting for a first finished window get this one."""
        latest = self.window_store.latest
        if latest is None:
            return
        self._let_joiners_in(latest.window + 1)
        self._send_states_due()

    def _forward_new_deaths(self) -> None:
        """Each new death: one DeclareDead to the relay carrying it; the round may complete."""
        new = self.dead.snapshot() - self._forwarded
        if not new:
            return
        now = trio.current_time()
        for rank in sorted(new):
            self._forwarded.add(rank)
            self.membership.died(rank, now)
            seat_id = self.round.seat_of(rank)
            if seat_id is not None and rank not in self._exited:
                away = rank in self.membership.absent  # the cluster formed without it: it may come
                self.links[seat_id].queue_control(RankAway(rank) if away else DeclareDead(rank), self.config.salt)
        self.membership_changed.notify()
        for lane, lane_round in enumerate(self.rounds):  # in lane order: the relays take them so
            consensus = lane_round.rank_died(now)
            if consensus is not None:
                self._consensus_send.send_nowait((lane, consensus))

    async def _form_without_everyone(self) -> None:
        """With a formation_timeout: once it has passed and min_ranks ranks are present,
        start without the others (they are away: dead for now, they may join later).
        Nothing to do once a round has completed - everyone was there."""
        timeout = self.membership.formation_timeout
        if timeout is None:
            return
        started = trio.current_time()
        await trio.sleep_until(started + timeout)
        while self.stats.rounds == 0:
            absent = self.membership.absent_at_formation(trio.current_time() - started)
            if absent is not None:
                return self._start_without(absent)
            log.warning("controller: %d of %d ranks present after formation_timeout %g s; waiting for min_ranks %d",
                        len(self.membership.elastic), self.config.world_size, timeout, self.membership.min_ranks)
            await self.membership_changed.wait()

    def _start_without(self, absent: list[int]) -> None:
        if not absent:
            return
        now = trio.current_time()
        log.warning("controller: starting without ranks %s (absent after formation_timeout); they join later", absent)
        for rank in absent:
            self.membership.formed_without(rank, now)
            self.handle.coordinator.death_reasons.setdefault(rank, "absent when the cluster formed")
            self.dead.declare_dead(rank)

    async def _finish_when_nobody_can_return(self) -> None:
        """End ``wait_finished`` once every rank is dead and none may rejoin any more
        (at once when rejoining is off; else when the last rejoin window closes)."""
        while True:
            deadline = self.membership.finish_deadline(self.dead.snapshot())
            if deadline is not None and trio.current_time() >= deadline:
                log.info("controller: every rank is dead or has exited; finished after %d rounds", self.stats.rounds)
                await self.handle.coordinator.say_run_over()  # before the connections close
                self.handle.outcome.end()
                return
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self.membership_changed.wait()

    # -- state for joiners ---------------------------------------------------

    async def _serve_state(self, conn: MessageStream, magic: bytes) -> None:
        """A rank asks (through its relay) for the state to start from: at once for a
        fresh start or a refusal, at the next window boundary for a return. Nothing
        is sent to a request that does not verify; the frames go out from the
        memory they were kept in, so joiners cost no copy."""
        try:
            request = await self._read_state_request(conn, magic)
            if request is not None:
                await self._answer_state_request(conn, request)
        except CONNECTION_LOST as exc:
            log.info("controller: a state request's connection closed: %s", exc)
        finally:
            await conn.aclose()

    async def _read_state_request(self, conn: MessageStream, magic: bytes) -> StateRequest | None:
        try:
            with trio.fail_after(self.config.bounds.handshake):
                rest = await conn.receive_exactly(STATE_REQUEST_LEN - 4, "the state request")
            return decode_state_request(magic + rest, self.config.world_size, self.config.salt)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            if isinstance(exc, MacError):
                self.stats.mac_failures += 1
            reason = "no complete request within the handshake deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"state request from {conn.peer} refused: {reason}")
            return None

    async def _answer_state_request(self, conn: MessageStream, request: StateRequest) -> None:
        """Challenge a verified request; once answered, the rank is present: a fresh
        start or a refusal is said at once, and a dead rank's return goes on."""
        rank = request.rank
        conn.peer = f"rank {rank} (state request)"
        nonces = await self._challenge(conn, request)
        if nonces is None:
            return
        self.membership.joined(rank)
        self.membership_changed.notify()  # one more rank present (formation counts them)
        if self.membership.rejoin_timeout > 0:
            self.windows.keep_window_state = True  # an elastic rank: keep each window's state from now on
        dead = self.dead.is_dead(rank)
        if not dead and self.windows.windows == 0:
            return await conn.send_chunks([encode_state_reply(StateReply(StateStatus.OK), nonces, self.config.salt)])
        refusal = self.membership.refusal(rank, trio.current_time(), dead=dead)
        if refusal is None and rank in self._joiners:
            refusal = f"rank {rank} already has a state request waiting"
        if refusal is not None:
            self.stats.rejoins_refused += 1
            log.warning("controller: rank %d may not rejoin: %s", rank, refusal)
            return await conn.send_chunks([encode_state_reply(StateReply.refused(refusal), nonces, self.config.salt)])
        await self._serve_return(conn, rank, _Joiner(nonces))

    async def _challenge(self, conn: MessageStream, request: StateRequest) -> JoinNonces | None:
        """The controller's fresh nonce out, the rank's answer in: a replayed request
        (a peer without the salt) cannot answer, and gets nothing more."""
        nonces = JoinNonces(request.nonce, new_nonce())
        try:
            await conn.send_chunks([encode_state_challenge(nonces, self.config.salt)])
            with trio.fail_after(self.config.bounds.handshake):
                answer = await conn.receive_exactly(STATE_ANSWER_LEN, "the state answer")
            check_state_answer(answer, request.rank, nonces, self.config.salt)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            if isinstance(exc, MacError):
                self.stats.mac_failures += 1
            reason = "no answer to its challenge within the handshake deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"state request from {conn.peer} refused: {reason}")
            return None
        return nonces

    async def _serve_return(self, conn: MessageStream, rank: int, joiner: _Joiner) -> None:
        """A dead rank coming back: its state once both halves are in, its receipt,
        then its entry at the next boundary. Until the receipt it is in no barrier,
        so a joiner that reads slowly or not at all costs only itself."""
        self._joiners[rank] = joiner
        self.membership.wait_for_state(rank)
        self._send_states_due()
        salt = self.config.salt
        try:
            if not await _wait_unless_peer_leaves(conn, joiner.state_due):
                return log.info("controller: rank %d left while it waited to rejoin", rank)
            if joiner.refusal is not None:
                return await conn.send_chunks([encode_state_reply(StateReply.refused(joiner.refusal), joiner.nonces, salt)])
            if joiner.state is not None:
                await self._send_state(conn, rank, joiner)
            self.membership.prime(rank)
            self._let_joiners_in_if_nobody_is_live()
            self.membership_changed.notify()
            if joiner.state is None:  # nothing was sent, so the rank is in already (a fresh start)
                return
            if not await _wait_unless_peer_leaves(conn, joiner.decided):
                return log.info("controller: rank %d left while it waited for its window", rank)
            entry = StateEntry.called_off() if joiner.entry is None else StateEntry(EntryStatus.ENTERED, joiner.entry)
            await conn.send_chunks([encode_state_entry(entry, joiner.nonces, salt)])
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            reason = "its receipt did not come in time" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse_return(rank, self.links.get(self.membership.asked.get(rank, -1)), f"its state transfer failed: {reason}")
        finally:
            del self._joiners[rank]
            if joiner.entry is None:
                self.membership.withdraw(rank)
                self.membership_changed.notify()

    async def _send_state(self, conn: MessageStream, rank: int, joiner: _Joiner) -> None:
        """The reply and its frames (from the memory they were kept in: no copy), then
        the rank's receipt; the write and the receipt are bounded by the write-stall bound."""
        state = joiner.state
        assert state is not None
        frames = state.frames
        reply = StateReply(StateStatus.OK, state.window, len(frames), lengths=tuple(f.nbytes for f in frames))
        chunks: list[Buffer] = [encode_state_reply(reply, joiner.nonces, self.config.salt)]
        for frame in frames:
            chunks += [frame.nbytes.to_bytes(4, "little"), *frame.chunks]
        await conn.send_chunks(chunks)
        with trio.fail_after(self.config.bounds.write_stall):
            receipt = await conn.receive_exactly(STATE_RECEIPT_LEN, "the state receipt")
        check_state_receipt(receipt, rank, joiner.nonces, self.config.salt)
        self.stats.states_served += 1
        log.info("controller: rank %d has the consensus of window %d; it enters at the next boundary", rank, state.window)

    # -- status page ---------------------------------------------------------

    async def _serve_status(self, conn: MessageStream) -> None:
        """A plain JSON status for operators who curl the controller port."""
        request = bytearray()
        with trio.move_on_after(self.config.bounds.handshake):
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
                # Returns with both halves in (relay's ask, state request): their state is on its way.
                "joining": [rank for rank, _seat in self.membership.ready()],
                # Of those, the ones that have their state: they enter at the next boundary.
                "primed": [rank for rank, _seat in self.membership.entering()],
                "relays": [
                    {"host": self.links[sid].host, "ranks": list(seat.ranks)}
                    for sid, seat in self.round.seats.items() if seat.connected
                ],
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
