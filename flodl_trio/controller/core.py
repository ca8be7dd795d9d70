"""The controller: one port, one connection per host relay, one consensus per round.

Task structure::

    serve_listeners --> route(conn) --peek channel magic--> data: relay session
                                                         \\-> control: coordinator (if attached)
                                                          \\-> state: a rank coming back (joins.Returns)
                                                           \\-> "GET ": a JSON status page (status.py)

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

import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Literal

import attrs
import trio

from ..errors import ConfigError, DesyncError, FlodlError, HandshakeError, MacError, ProtocolError
from ..fold.schemas import schema_of
from ..fold.outer import shard_outer_config
from ..fold.speculative import Speculation, receive_speculating
from ..transport.arrival import ArrivalWatch
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.connect import (
    Connector,
    Listeners,
    listener_port,
    peer_host,
    tune_socket,
    warn_if_public_peer,
)
from ..transport.hashing import encode_enveloped_frame
from ..transport.hello import receive_hello
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
from ..wire.lanes import DEFAULT_LANE_MIN_BYTES, LaneLayout, goes_through_shards, read_lane_tag, sharded_lane_count
from ..wire.mux import (
    COPY_LANES,
    COPY_NONE,
    COPY_WITH_STATE,
    DeclareDead,
    HelloAck,
    LanesIn,
    Lanes,
    MuxHeader,
    MuxKind,
    Outage,
    RankAway,
    RankExit,
    RankFinished,
    RankJoin,
    RelayControlMsg,
    Resume,
    ShardLost,
    ShardBack,
    ShardMoved,
    ShardOffer,
    ShardOuter,
    Shards,
    decode_control_msg,
    encode_mux_record,
    record_payload,
)
from ..wire.round_frame import (
    EncodedFrame,
    RoundFrame,
    check_payloads,
    decode_round_frame,
    encode_round_frame_chunks,
)
from ..wire.salt import SessionSalt
from .config import (
    AUTO_SHARDS_MIN_RELAYS,
    ControllerConfig,
    check_lanes,
    check_shards,
    lanes_or_default,
    membership_policy,
    why_no_shards,
)
from .coordinator import Coordinator
from .dead_ranks import DeadRanks
from .joins import Returns
from .lane_windows import LaneOut
from .links import AfterAllWrites, RelayLink
from .membership import Membership
from .resumption import Resumption
from .round import (
    CheckpointSink,
    Consensus,
    ControllerRound,
    OuterSchemaRefused,
    OuterOptimizer,
    WindowStore,
)
from .seats import Seats
from .shards import Committed, HereOnListener, Seat, ShardServer, ShardSet
from .stats import ControllerStats
from .status import serve_status
from .windows import rounds_and_windows

log = logging.getLogger("flodl_trio.controller")



def attributed_to(exc: FlodlError, who: str) -> FlodlError:
    """The same error type, its message prefixed with the peer it came from."""
    if who in str(exc):
        return exc
    try:
        return type(exc)(f"{who}: {exc}")
    except TypeError:
        return FlodlError(f"{who}: {exc}")


async def _encoded(frame: RoundFrame, salt: SessionSalt) -> EncodedFrame:
    """A frame kept for joiners, signed off the event loop."""
    return await trio.to_thread.run_sync(encode_round_frame_chunks, frame, salt)


async def _signed(frame: memoryview, salt: SessionSalt) -> EncodedFrame:
    """A frame joined from lanes, its MAC (the last 8 bytes) written in (off the event
    loop unless it is small)."""

    def sign() -> None:
        frame[-MAC_LEN:] = salt.mac8(frame[:-MAC_LEN])

    if len(frame) <= SMALL_MESSAGE:
        sign()
    else:
        await trio.to_thread.run_sync(sign)
    return EncodedFrame([frame], len(frame))


async def _enveloped(kind: MuxKind, frame: EncodedFrame, salt: SessionSalt) -> EncodedFrame:
    """A signed frame wrapped in a MuxRecord (its record MAC off the event loop unless it is small)."""
    if frame.nbytes <= SMALL_MESSAGE:
        return encode_mux_record(kind, frame, salt)
    return await trio.to_thread.run_sync(encode_mux_record, kind, frame, salt)


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
    lanes: int | None = None,
    lane_min_bytes: int = DEFAULT_LANE_MIN_BYTES,
    resume_dir: str | os.PathLike[str] | None = None,
    shards: Sequence[tuple[str, int]] | Literal["auto"] = (),
    connect: Connector = trio.open_tcp_stream,
    serve_shard: ShardServer | None = None,
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
    ``lanes``: reduce each round in up to this many lanes (default
    :data:`~.config.DEFAULT_LANES`, or 1 with an outer optimizer that has no
    ``step_lane``; 1: flodl's whole frames): a lane's consensus goes down while
    the next lane is still coming up (an outer optimizer steps each lane as it
    finishes). Data relays take this count (a flodl relay, which takes no
    extensions, sends and gets whole frames, cut and joined here). A round goes
    in one lane per ``lane_min_bytes`` of its frame's payload (0: always
    ``lanes``), so small rounds stay one record each way.
    ``resume_dir``: keep the run's resume record there (written each round before
    its consensus goes out), and take the run on from it if one is there: relays
    and ranks holding through a controller outage then carry on where they were
    (docs/liveness.md, "A lost controller").
    ``shards``: reduction shards (docs/wire.md, "Shards"), dialed with ``connect``
    (a test's memory network, say); ``"auto"``: the shards the data relays offer,
    fixed once the cluster has formed with two relays or more, each offering one
    (docs/wire.md, "Shards by default"); if this controller cannot have shards (an
    outer optimizer, say) it says why in its log and reduces every lane itself.
    """
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    lanes = lanes_or_default(lanes, outer_optimizer=outer_optimizer)
    check_lanes(lanes, outer_optimizer=outer_optimizer)
    offered = isinstance(shards, str)
    if offered and shards != "auto":
        raise ConfigError(f"shards takes (host, port) pairs or 'auto', got {shards!r}")
    if shards and not offered:
        check_shards(lanes=lanes, outer_optimizer=outer_optimizer)
    why_not = why_no_shards(lanes=lanes, outer_optimizer=outer_optimizer)
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
    if listeners is None:  # host None: every interface, as trio.open_tcp_listeners
        listeners = await trio.open_tcp_listeners(port, host=host)
    handle = ControllerHandle(listener_port(listeners[0]), ledger, ControllerStats(), coordinator)
    controller = _Controller(config, handle, listeners, outer_optimizer, checkpoint, membership, resume_dir)
    coordinator.on_refuse = controller.control_refused
    controller.connect = connect
    controller.serve_shard = serve_shard
    if isinstance(shards, str):
        controller.take_offered_shards = controller.offered_shards = why_not is None
        if why_not is not None:
            log.info("controller: the shards relays offer will not be used: %s", why_not)
    elif shards:
        controller.use_shards(controller.shard_set([(str(h), int(p)) for h, p in shards]))
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
        resume_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = config
        self.membership = membership
        self.membership_changed = ChangeSignal()
        self.window_store = WindowStore()
        handle.coordinator.may_return = lambda rank: membership.may_return(rank, trio.current_time())
        self.handle = handle
        self.listeners = listeners
        self.stats = handle.stats
        self.dead = handle.dead_ranks
        self.round_changed = ChangeSignal()
        # The relays and their ranks: one registry, read by every lane's round.
        self.seats = Seats(config.world_size, self.dead)
        # One round per lane (one in all without lanes); the windows (outer step,
        # checkpoints, joiners' state) are kept over whole rounds by ``windows``.
        self.rounds, self.windows = rounds_and_windows(
            config.lanes, self.seats, self.stats, config.salt, outer_optimizer, checkpoint, self.round_changed.notify
        )
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
        self.returns = Returns(
            config, membership, self.membership_changed, self.dead, self.stats, self.window_store, self.windows,
            self.links, self._refuse, self._revive,
        )
        self._consensus_send, self._consensus_receive = trio.open_memory_channel[tuple[int, Consensus]](config.lanes)
        self.resumption = Resumption(
            resume_dir, salt=config.salt, windows=self.windows, window_store=self.window_store, checkpoint=checkpoint,
            membership=membership, dead=self.dead, coordinator=handle.coordinator, stats=self.stats,
        )
        handle.coordinator.outage_ms = self.resumption.announced_outage_ms(config.bounds)
        self._after_record = []

    shards: ShardSet | None = None  # the reduction shards, if any (docs/wire.md, "Shards")
    take_offered_shards = False  # shards="auto": fix the relays' offered shards once the cluster formed
    offered_shards = False  # shards="auto": a lost shard is served again by a relay's later offer
    connect: Connector = staticmethod(trio.open_tcp_stream)  # how shards are dialed
    serve_shard: ShardServer | None = None  # how it serves the last live shard itself (None: it stops)
    _own_shards: trio.Nursery | None = None  # where a shard of its own runs
    # Shard news for relays, queued once the round's record is written (_tell_after_record).
    _after_record: list[tuple[RelayLink, RelayControlMsg]]
    _here_shards: HereOnListener | None = None
    _nursery: trio.Nursery | None = None

    def shard_set(self, addresses: Sequence[tuple[str, int]]) -> ShardSet:
        return ShardSet(addresses, self.config, self._relay_live, self._tell_relays, self.stats,
                        self._drop_relay_named, self.connect, outer=self._shard_outer(),
                        outage_ms=self.handle.coordinator.outage_ms, here=self._here())

    def _here(self) -> HereOnListener | None:
        """How this controller serves a shard itself: on the host its TCP listener is bound
        to (None: no ``serve_shard``, or a test's memory network)."""
        listener = self.listeners[0]
        if self.serve_shard is None or not isinstance(listener, trio.SocketListener):
            return None
        bound = str(listener.socket.getsockname()[0])
        salt = self.config.salt

        def relays() -> list[tuple[MessageStream, Callable[[RelayControlMsg], None]]]:
            return [(link.conn, partial(link.queue_control, salt=salt)) for link in self.links.values()
                    if not link.closed and link.takes_extensions]

        self._here_shards = HereOnListener(self.serve_shard, bound, lambda: self._own_shards, relays)
        return self._here_shards

    def _shard_outer(self) -> ShardOuter | None:
        """What the shards step each params round's lanes with (None: nothing to step)."""
        outer = self.windows.outer_optimizer
        config = None if outer is None else shard_outer_config(outer)
        return None if config is None or config[0] == 0 else ShardOuter(*config)

    def use_shards(self, shards: ShardSet) -> None:
        """From now on lane 0 of a round in several lanes carries no payload (the shards
        carry it all), and the controller keeps a window whole only while a rank rejoins."""
        self.shards = shards
        self.resumption.shards = shards
        self.windows.shards = len(shards.addresses)
        self.returns.kept_state_may_be_old = True

    async def _fix_offered_shards(self) -> None:
        """shards="auto": at a round's first consensus, once AUTO_SHARDS_MIN_RELAYS live relays are
        seated and each offered a shard, dial them and tell every relay (before this
        consensus, so its next round goes through them; docs/wire.md, "Shards by default")."""
        links = sorted((link for link in self.links.values() if self._relay_live(link.id)),
                       key=lambda link: min(link.ranks))
        if len(links) < AUTO_SHARDS_MIN_RELAYS or any(link.shard_offer is None or link.whole for link in links):
            return
        self.take_offered_shards = False  # once: a cluster whose offers cannot be reached stays without
        shards = self.shard_set([link.shard_offer for link in links if link.shard_offer is not None])
        try:
            await shards.dial()
        except FlodlError as exc:
            return log.warning("controller: the relays' shards are not used: %s", exc)
        self.use_shards(shards)
        assert self._nursery is not None
        shards.start_watching(self._nursery)
        for link in self.links.values():
            if not link.closed and link.takes_extensions:
                told = [Shards(shards.addresses_for(link.conn)), *shards.told_at_hello()]
                self._after_record += [(link, msg) for msg in told]
                link.sharded_next = True
        log.info("controller: reducing with the %d shards the relays offered (%s)", len(shards.addresses),
                 ", ".join(f"{h}:{p}" for h, p in shards.addresses))

    async def _serve_lost_shards_again(self) -> None:
        """shards="auto", between rounds: a live relay's offer that no shard is at (a host
        brought back, its relay serving a new shard) serves the lowest lost shard again,
        and every relay is told before the commit, for its next round (docs/wire.md, "A
        lost shard served again"). Each address is tried once (``ShardSet.serve_again``)."""
        shards = self.shards
        if shards is None or not shards.lost:
            return
        for link in sorted(self.links.values(), key=lambda link: min(link.ranks)):
            offer = link.shard_offer
            if offer is None or not self.offered_shards or not self._relay_live(link.id):
                continue
            index = await shards.serve_again(offer)
            if index is None:
                continue
            self._tell_served_again(index)
            if not shards.lost:
                return
        index = await shards.serve_standby_here()  # (one left live: docs/wire.md, "When every shard is lost")
        if index is not None:
            self._tell_served_again(index)

    def _tell_served_again(self, index: int) -> None:
        """Every relay is told, once the round's record names it, that shard ``index`` is
        served again: for its next round."""
        assert self.shards is not None
        self._after_record += [(other, ShardBack(index, *self.shards.address_for(index, other.conn)))
                               for other in self.links.values() if not other.closed and other.takes_extensions]

    def _served_here(self) -> dict[int, int]:
        """The shards this controller serves itself, and their ports."""
        here, shards = self._here_shards, self.shards
        return {} if here is None or shards is None else {i: here.ports[i] for i in sorted(shards.served_here)}

    def _shard_addresses_for(self, link: RelayLink) -> list[tuple[str, int]]:
        """The shards' addresses as ``link``'s relay reaches them (``ShardSet.address_for``)."""
        assert self.shards is not None
        return self.shards.addresses_for(link.conn)

    def _tell_after_record(self) -> None:
        """What relays are told of the shards (fixed, or one served again) once the round's
        record names it: a relay never holds shards a controller started again lacks."""
        told, self._after_record = self._after_record, []
        for link, msg in told:
            if not link.closed:
                link.queue_control(msg, self.config.salt)

    def _sharded(self, consensus: Consensus) -> bool:
        """Whether this lane-0 consensus is of a round the shards reduce (several lanes, and
        not a delta round the star carries better: ``goes_through_shards``)."""
        if self.shards is None or not isinstance(consensus.outgoing, RoundFrame):
            return False
        tag = read_lane_tag(consensus.outgoing)
        return tag is not None and tag.count >= 2 and goes_through_shards(
            LaneLayout.declared_by(consensus.outgoing).schema, len(self.shards.addresses))

    async def _decide(self, consensus: Consensus, targets: list[int]) -> Committed:
        """A round in lanes whose lane 0 finished: every shard sums the same hosts' pieces;
        the targets still live once every one holds them (lane 0, the commit, goes to
        those), and - while a rank rejoins, or a checkpoint is due - the round's other
        lanes, copied here (a checkpoint's params round with their outer state)."""
        assert self.shards is not None and isinstance(consensus.outgoing, RoundFrame)
        lane0 = consensus.outgoing
        tag = read_lane_tag(lane0)
        assert tag is not None
        step = self.shards.outer is not None and self.windows.steps_round(lane0)
        produce = self._delta_lanes if self.windows.sharded_delta else None
        if produce is not None:
            copy = COPY_NONE  # the means come here: the controller holds the round whole
        elif self.windows.checkpoint_wants(lane0):
            copy = COPY_WITH_STATE if step else COPY_LANES
        else:
            copy = COPY_LANES if self.returns.needs_whole_rounds() else COPY_NONE
        return await self.shards.decide(
            [Seat(sid, self.seats.lowest_rank(sid)) for sid in consensus.delivered_by],
            [Seat(sid, self.seats.lowest_rank(sid)) for sid in targets], tag.count,
            LaneLayout.declared_by(lane0, lane0_empty=True).schema,
            copy=copy, step=step, fragment=self.windows.round_fragment if step else None, produce=produce,
            seeds=self.windows.seeds() if step else None,
        )

    async def _delta_lanes(self, means: list[RoundFrame]) -> list[RoundFrame]:
        """A delta round through the shards: its consensus lanes from their means (the
        lineage's step is the controller's own, as for a delta round reduced here)."""
        return self.windows.delta_lanes(means)

    def _drop_relay_named(self, lowest_rank: int, why: str) -> None:
        """A shard refused a relay's piece: that relay is dropped (its ranks die), and the
        round is decided again without it."""
        seat_id = self.seats.seat_of(lowest_rank)
        if seat_id is not None and lowest_rank == self.seats.lowest_rank(seat_id) and seat_id in self.links:
            log.warning("controller: %s dropped: %s", self.links[seat_id].name, why)
            self.links[seat_id].expel(why)

    def _relay_live(self, seat_id: int) -> bool:
        """Whether a relay is connected and carries a rank not dead."""
        return self.seats.is_connected(seat_id) and not all(self.dead.is_dead(r) for r in self.seats.ranks_of(seat_id))

    def _tell_relays(self, msg: RelayControlMsg) -> None:
        for link in self.links.values():
            if not link.closed:
                link.queue_control(msg, self.config.salt)

    async def run(self) -> None:
        self.resumption.restore()
        self._resume_shards()
        async with trio.open_nursery() as own_shards:  # a shard this controller serves itself, if any
            self._own_shards = own_shards
            try:
                if self.shards is not None:
                    await self.shards.dial()
                await self._serve()
            finally:
                if self.shards is not None:
                    await self.shards.aclose()
                own_shards.cancel_scope.cancel()

    def _resume_shards(self) -> None:
        """A record of a run with shards: the same shards, taken on where it left them
        (docs/wire.md, "Shards through a lost controller")."""
        run = self.resumption.restored
        if run is None or not run.shards:
            return
        shards = self.shard_set(run.shards)
        shards.resume(run.shards_lost, run.sharded_rounds, run.decisions)
        self.use_shards(shards)
        self.take_offered_shards = False
        log.info("controller: resuming with the record's %d shards (lost: %s)", len(run.shards),
                 list(run.shards_lost) or "none")

    async def _serve(self) -> None:
        async with self._consensus_send, trio.open_nursery() as nursery:
            self.returns.nursery = nursery
            self._nursery = nursery
            nursery.start_soon(self.dead.watch, self._forward_new_deaths)
            nursery.start_soon(self._finish_when_nobody_can_return)
            nursery.start_soon(self._form_without_everyone)
            nursery.start_soon(self._broadcaster, self._consensus_receive)
            nursery.start_soon(self.handle.coordinator.run)
            if self.shards is not None:
                self.shards.start_watching(nursery)
            await nursery.start(trio.serve_listeners, self._route, self.listeners)

    def _refuse(self, message: str) -> None:
        log.warning("controller: %s", message)
        self.handle.rejections.add(message)
        self.stats.rejected += 1

    def control_refused(self, message: str, exc: BaseException | None) -> None:
        """A control-channel connection the coordinator refused: recorded as the data
        plane's are (it logged it already)."""
        self.handle.rejections.add(message)
        self.stats.rejected += 1
        if isinstance(exc, MacError):
            self.stats.mac_failures += 1

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
            await self.returns.serve(conn, magic)
        elif magic in (b"GET ", b"POST"):
            await serve_status(conn, self._status(), self.config.bounds.handshake)
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
                    try:
                        await self._link_reader(link)
                    except ProtocolError as exc:
                        if isinstance(exc, OuterSchemaRefused):
                            raise  # the controller's own error (it stops), not this relay's
                        why = f"dropped for breaking the protocol ({exc})"
                        self.stats.relays_dropped += 1
                        log.warning("controller: %s %s; its ranks are dead", link.name, why)
                        # At once, closing its socket: a write to a relay that also stopped
                        # reading ends now, not after the write-stall bound.
                        await self._drop_link(link, why)
                    nursery.cancel_scope.cancel()
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
            self.seats.check_hello(hello)
            if self.shards is not None and not hello.takes_extensions:
                raise HandshakeError(
                    f"the relay of host {hello.host!r} does not say it takes flodl_trio's extensions (a flodl relay?), "
                    "and this controller reduces with shards, which such a relay cannot reach: start the controller "
                    "without --shards, or use flodl_trio relays"
                )
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            if isinstance(exc, MacError):
                self.stats.mac_failures += 1
            reason = "no Hello within the handshake deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"data relay {conn.peer} refused: {reason}")
            await conn.aclose()
            return None
        link = RelayLink.accept(hello, conn, self.config.world_size + 8)
        if self.config.lanes > 1 and not link.takes_extensions:
            # A flodl relay: it sends whole frames and is sent whole ones, and the cluster
            # still reduces in lanes (its frames are cut here, its consensus joined).
            link.whole = True
            log.info("controller: %s sends whole frames (no extensions mark); cut into lanes here", link.name)
        self.links[link.id] = link
        self.seats.seat(link.id, hello, link.name)
        self._next_lane[link.id] = 0
        self.stats.relays += 1
        # Extensions go only to a relay that said it takes them: a flodl relay gets flodl's bytes.
        # The lanes come before HelloAck, so the relay knows how it sends before it sends anything.
        if self.config.lanes > 1 and link.takes_extensions:
            link.queue_control(Lanes(self.config.lanes, self.config.lane_min_bytes), self.config.salt)
            if self.shards is not None:
                link.queue_control(Shards(self._shard_addresses_for(link)), self.config.salt)
                link.sharded = True
        link.queue_control(HelloAck(), self.config.salt)
        if self.shards is not None and link.takes_extensions:  # once its channel is up to take them
            for msg in self.shards.told_at_hello():
                link.queue_control(msg, self.config.salt)
            for index, port in self._served_here().items():  # (a relay resuming may know of another)
                assert self._here_shards is not None
                link.queue_control(ShardMoved(index, *self._here_shards.address_for(link.conn, port)),
                                   self.config.salt)
        if link.takes_extensions:
            self.handle.coordinator.host_takes_extensions(link.host)
            if self.handle.coordinator.outage_ms > 0:  # it keeps a resume record: hold for it if it is lost
                link.queue_control(Outage(self.handle.coordinator.outage_ms), self.config.salt)
        now = trio.current_time()
        for rank in link.ranks:
            if self.dead.is_dead(rank):
                # A restarted host whose rank may come back (flodl's relays know only DeclareDead).
                away = link.takes_extensions and self.membership.may_return(rank, now)
                link.queue_control(RankAway(rank) if away else DeclareDead(rank), self.config.salt)
        log.info("controller: accepted %s", link.name)
        return link

    async def _drop_link(self, link: RelayLink, why: str) -> None:
        """A relay is gone: its live ranks are dead, the survivors carry on."""
        self.seats.unseat(link.id)
        self.resumption.forget(link.id)
        if self.shards is not None:
            self.shards.relays_changed()
        for rank in self.membership.seat_gone(link.id):
            self.returns.call_off(rank, f"{link.name} left before it was let back in")
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
            if header.kind == MuxKind.HOST_FRAME and not link.whole and not self.resumption.sends_stale(link.id):
                if self.config.deterministic:
                    await self._wait_for_turn(link)  # its payload waits in the socket meanwhile
                await self._wait_for_lane_0(link)  # (the same)
            big = header.length > SMALL_MESSAGE
            pooled = big and not (link.whole and self.config.deterministic)
            buf = await self.pool.acquire() if pooled else self._own_buffer(link, big)
            try:
                if not await self._read_record(link, header, buf):
                    return
            finally:
                if pooled:
                    self.pool.release(buf)
            if big and self.pool.size < self.pool.limit and len(self.links) > 1:
                # Let two relays' frames arrive at once, now that a verified record proved the size.
                self.pool.add(ReceiveBuffer(header.length))

    def _own_buffer(self, link: RelayLink, big: bool) -> ReceiveBuffer:
        """A link's own buffer: its small one, or (a whole relay's large frame in
        deterministic mode, which waits in it for its turn lane by lane) a model-sized one."""
        if not big:
            return link.small
        if link.own is None:
            link.own = ReceiveBuffer()
        return link.own

    async def _wait_for_turn(self, link: RelayLink) -> None:
        """Deterministic mode: fold this relay's HostFrame only after those of the
        relays before it (by their lowest rank) are folded or gone."""
        while not self.rounds[self._next_lane[link.id]].may_fold_now(link.id):
            await self.round_changed.wait()

    async def _wait_for_lane_0(self, link: RelayLink) -> None:
        """Lanes: a relay's lane 1.. is folded only while its lane 0 stands. Its lane 0 is
        folded as it comes, and a later relay's lane 0 with the schema the cluster's
        completed rounds had proves it wrong (its relay is then dropped: ``_expel``); its
        other lanes must not be in its neighbours' sums by then. So while its round's
        schema is not one the cluster agreed on (the first rounds; a new kind of round),
        its next lane waits in the socket until the round's lane 0 is complete."""
        while self._lane_0_holds(link):
            await self.round_changed.wait()

    def _lane_0_holds(self, link: RelayLink) -> bool:
        """Whether ``link``'s next lane (1.. of a round reduced here) must wait for its lane 0."""
        if self.config.lanes == 1 or self._next_lane.get(link.id, 0) == 0 or link.dropped_for is not None:
            return False
        lane0 = self.rounds[0]
        return link.id in lane0.delivered and link.lane0_schema not in lane0.agreed

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
                link.spoke = True
                # The record's MAC (same key, verified as the bytes arrived) covers every byte of the frame.
                frame = decode_round_frame(
                    payload, self.config.salt, ceiling=self.config.ceiling, source=link.name, authenticated=True
                )
                if self._goes_whole(link, frame):
                    await self._on_whole_host_frame(link, frame)
                else:
                    used = self._on_host_frame(link, frame, speculation)
            elif kind is MuxKind.CONTROL:
                self._on_relay_control(link, decode_control_msg(payload))
            else:
                raise ProtocolError(f"unexpected {kind.name} record on the data channel")
            return True
        finally:
            if not used:
                self.rounds[0].give_back(speculation.frame)

    async def _receive_record(
        self, link: RelayLink, header: MuxHeader, buf: ReceiveBuffer
    ) -> tuple[MuxKind, memoryview, Speculation]:
        """A record's payload, verified as it arrives. A large HostFrame that becomes the
        round's last has the consensus computed and signed beside it (without lanes:
        only a whole frame's round computes ahead)."""
        salt = self.config.salt
        whole = self.rounds[0]
        if header.length <= SMALL_MESSAGE or not whole.may_speculate(link.id, header.kind):
            kind, payload = await link.conn.receive_mux_payload(header, buf, salt)
            return kind, payload, Speculation()
        watch = ArrivalWatch(header.length)
        (kind, payload), speculation = await receive_speculating(
            watch, partial(link.conn.receive_mux_payload, header, buf, salt, watch),
            is_last=partial(whole.is_last, link.id), begin=partial(whole.begin_speculation, header.length),
            changes=self.round_changed, buf=buf, kind=MuxKind.BROADCAST, salt=salt,
        )
        return kind, payload, speculation

    def _goes_whole(self, link: RelayLink, frame: RoundFrame) -> bool:
        """Whether a HostFrame came whole while the cluster reduces in lanes: always from
        a flodl relay, and from a flodl_trio relay when its round goes in one lane (it
        sends that untagged, as flodl does, where its lane 0 is due)."""
        if self.config.lanes == 1:
            return False
        return link.whole or (self._next_lane[link.id] == 0 and read_lane_tag(frame) is None)

    def _on_host_frame(self, link: RelayLink, frame: RoundFrame, speculation: Speculation) -> bool:
        """Fold a relay's HostFrame (with lanes: one of its lanes) into its lane's round,
        whose consensus goes down once every live relay delivered; whether the
        speculation became the round's consensus."""
        lane = self._lane_of(link, frame)
        link.sent_whole = False
        if self.resumption.stale_host_frame(link.id, last_lane=self._next_lane[link.id] == 0):
            self.stats.stale_host_frames += 1
            log.info("controller: dropped %s's HostFrame (lane %d) sent again for a round already finished",
                     link.name, lane)
            return False
        return self._deposit(link, lane, frame, speculation)

    async def _on_whole_host_frame(self, link: RelayLink, frame: RoundFrame) -> None:
        """A whole HostFrame while the cluster reduces in lanes: cut here as a relay would
        cut it (views of the payload) and folded lane by lane - in deterministic mode each
        lane when its turn comes, so the relays before it can finish their lanes
        meanwhile. Its relay is sent the round's consensus whole."""
        check_payloads(frame, f"HostFrame from {link.name}")  # named as the fold names them, before any cut
        layout = LaneLayout.of(frame, self.config.lanes, self.config.lane_min_bytes)
        if not link.whole:
            # A flodl_trio relay sends a frame whole only when it goes in one lane (so it
            # never holds a buffer here waiting for a later lane's turn).
            if layout.count > 1:
                raise DesyncError(
                    f"sent a whole HostFrame that goes in {layout.count} lanes (a relay sends only a frame of one "
                    "lane whole)"
                )
            if self.resumption.stale_host_frame(link.id):
                self.stats.stale_host_frames += 1
                log.info("controller: dropped %s's HostFrame sent again for a round already finished", link.name)
                return
        link.sent_whole = True
        for lane, part in enumerate(layout.split(frame)):
            if self.config.deterministic:
                while not self.rounds[lane].may_fold_now(link.id):
                    await self.round_changed.wait()
                if link.closed:
                    return
            self._deposit(link, lane, part, Speculation())

    def _deposit(self, link: RelayLink, lane: int, frame: RoundFrame, speculation: Speculation) -> bool:
        """Fold one lane's frame (the whole round's, without lanes); whether the
        speculation became the round's consensus."""
        lane_round = self.rounds[lane]
        if not lane_round.accepts_host_frame(link.id):
            log.info("controller: dropped a late lane-%d frame from %s (all its ranks are dead)", lane, link.name)
            return False
        now = trio.current_time()
        self._finish_lanes_before(lane, now)
        if speculation.frame is not None and speculation.record is not None:
            consensus = lane_round.commit_speculation(link.id, speculation.frame, speculation.record, now)
            if consensus is not None:
                self._consensus_send.send_nowait((lane, consensus))
                return True
        consensus = lane_round.deposit(link.id, frame, now)
        self._expel(lane_round)
        if consensus is not None:
            self._consensus_send.send_nowait((lane, consensus))
        return False

    def _finish_lanes_before(self, lane: int, now: float) -> None:
        """Every relay takes a round's lanes in order. A death is in the ledger before the
        task that tells the rounds of it runs (``_forward_new_deaths``), so a later lane's
        frame may complete its round while an earlier lane's round, complete by the same
        death, has not been told yet: finish those first, in lane order."""
        for earlier in range(lane):
            consensus = self.rounds[earlier].consensus_if_complete(now)
            if consensus is not None:
                self._consensus_send.send_nowait((earlier, consensus))

    def _lane_of(self, link: RelayLink, frame: RoundFrame) -> int:
        """Which lane ``frame`` is: its tag says (and of how many), and it must be the
        one due from this relay and fit the schema its lane 0 carried (else
        DesyncError / SchemaError: this relay is dropped). Without lanes every
        HostFrame is the whole round, as flodl sends it: lane 0, untagged."""
        if self.config.lanes == 1:
            return 0
        tag = read_lane_tag(frame)
        expected = self._next_lane[link.id]
        most = self._most_lanes(link)
        if tag is None or tag.index != expected or tag.count > most:
            raise DesyncError(f"sent a HostFrame with lane tag {tag} where lane {expected} of at most {most} was due")
        if tag.index == 0:
            link.lane0_schema = schema_of(frame)
            schema = LaneLayout.declared_by(frame, ceiling=self.config.ceiling).schema
            if link.sharded_next:  # its first round since the shards were fixed
                link.sharded, link.sharded_next = True, False
            link.round_sharded = link.sharded and self.shards is not None and goes_through_shards(
                schema, len(self.shards.addresses))
            self._lane_layout[link.id] = LaneLayout.of_lane0(frame, link.round_sharded)
        else:
            self._lane_layout[link.id].check_lane(tag.index, frame)
        # With shards a relay sends the controller lane 0 alone.
        last = tag.index == tag.count - 1 or link.round_sharded
        self._next_lane[link.id] = 0 if last else tag.index + 1
        return tag.index

    def _most_lanes(self, link: RelayLink) -> int:
        """The most lanes a round of this relay may come in: the cluster's count, or with
        shards (from its next round, once they are fixed) the count that spreads evenly
        over them."""
        if self.shards is None or not (link.sharded or link.sharded_next):
            return self.config.lanes
        return max(self.config.lanes, sharded_lane_count(self.config.lanes, len(self.shards.addresses)))

    def _refuse_resumption(self, link: RelayLink, why: DesyncError) -> None:
        """A relay that resumes somewhere this controller never was: its ranks are dead
        (each is told, so the relay ends with them instead of dialing on)."""
        log.warning("controller: %s may not resume: %s; its ranks are dead", link.name, why)
        self.stats.resumptions_refused += 1
        for rank in link.ranks:
            self.handle.coordinator.death_reasons.setdefault(rank, f"its relay {link.name} could not resume: {why}")
            self.dead.declare_dead(rank)

    def _expel(self, lane_round: ControllerRound) -> None:
        """Cut off the relays whose folded frames a later one proved wrong (their part
        of the round's sum is gone already; their ranks' deaths let it complete)."""
        for seat_id, why in lane_round.take_expelled().items():
            link = self.links.get(seat_id)
            if link is not None:
                link.expel(why)

    def _on_relay_control(self, link: RelayLink, msg: RelayControlMsg) -> None:
        if isinstance(msg, ShardOffer):
            link.shard_offer = (msg.host, msg.port)  # used only by a controller with shards="auto"
            return
        spoke, link.spoke = link.spoke, True
        if isinstance(msg, Resume):
            if spoke:
                # Answered, it would clear the relay's place in the open round (the last
                # Broadcast again) and let a second HostFrame of it be folded.
                raise ProtocolError("said Resume after other records; a relay says it once, as the first record "
                                    "on a connection that replaces a lost one")
            try:
                again = self.resumption.answer(link.id, link.name, msg)
            except DesyncError as exc:
                return self._refuse_resumption(link, exc)
            if again is not None:
                link.queue(again, before_write=partial(self.rounds[0].broadcast_going_out, link.id))
            return
        if isinstance(msg, LanesIn) and self.shards is not None:
            return self.shards.lanes_in(link.id, msg.decision)
        if isinstance(msg, ShardLost) and self.shards is not None:
            return self.shards.reported_lost(msg.shard, link.name)
        if not isinstance(msg, RankExit | RankJoin | RankFinished):
            raise ProtocolError(f"unexpected {type(msg).__name__} mid-session")
        if msg.rank not in link.ranks:
            raise ProtocolError(f"{type(msg).__name__} for rank {msg.rank}, which this relay does not carry")
        if isinstance(msg, RankJoin):
            return self.returns.relay_asks(link, msg.rank)
        if isinstance(msg, RankFinished):
            self.membership.said_finished(msg.rank)
            self.handle.coordinator.finished.add(msg.rank)  # no death notice: it left by itself
        else:
            self.membership.left_plainly(msg.rank)
        self.membership_changed.notify()
        self._exited.add(msg.rank)
        if msg.rank in self.membership.asked:
            self.returns.call_off(msg.rank, f"its connection to {link.name} closed before it was let back in")
        if self.dead.declare_dead(msg.rank):
            how = "finished its training" if isinstance(msg, RankFinished) else "exited"
            log.info("controller: rank %d %s (%s)", msg.rank, how, link.name)

    # -- the consensus out, and deaths -----------------------------------------

    async def _broadcaster(self, inbox: trio.MemoryReceiveChannel[tuple[int, Consensus]]) -> None:
        """Sign each consensus once (both MACs in parallel) and queue it to every live relay."""
        async for lane, consensus in inbox:
            lane_round = self.rounds[lane]
            self.membership.formed = True
            # Relays that sent this round whole are sent it whole, joined from its lanes.
            self.windows.join_whole = any(
                self.links[sid].sent_whole for sid in consensus.delivered_by if sid in self.links
            )
            out = self.windows.take(lane, consensus)  # the outer step and checkpoint, if due
            # Before any joiner is revived (they did not ask), and every relay that delivered.
            targets = self.seats.broadcast_targets(consensus.delivered_by)
            if lane == 0 and self._sharded(out.consensus):
                # The shards' commit first: the round ends with it (whole, if they sent a copy).
                committed = await self._decide(out.consensus, targets)
                targets = committed.targets
                out = self.windows.end_sharded(out, committed)
                await self._serve_lost_shards_again()  # between rounds: each relay takes it for its next
            elif out.opens_round and self.take_offered_shards:
                await self._fix_offered_shards()  # before this consensus: the relays' next rounds use them
            consensus, part = out.consensus, out.part
            kept = None if out.kept is None else await _signed(out.kept, self.config.salt)
            if consensus.for_joiners is not None and self.windows.keep_window_state:
                kept = await _encoded(consensus.for_joiners, self.config.salt)
            whole_targets = [sid for sid in targets if self.links[sid].sent_whole]
            lane_targets = [sid for sid in targets if not self.links[sid].sent_whole]
            whole_record = None if out.whole is None or not whole_targets else await self._whole_record(out, kept)
            if whole_record is not None and not lane_targets:
                record = whole_record  # every relay sent the round whole: no lane record to sign
            elif isinstance(consensus.outgoing, EncodedFrame):
                record = consensus.outgoing
            else:
                record = await encode_enveloped_frame(MuxKind.BROADCAST, consensus.outgoing, self.config.salt)
            if consensus.for_joiners is not None and part is not None and self.windows.keep_window_state:
                # A delta round's consensus as the ranks got it (joined from its lanes, with lanes).
                whole = record_payload(record) if out.catch_up is None else await _signed(out.catch_up, self.config.salt)
                self.window_store.keep_catch_up(part.window, whole)
            boundary = (
                part is not None
                and self.windows.keep_window_state
                and self.window_store.keep(part, None if out.not_held else kept or record_payload(record))
            )
            # Returns let in are live in the record, and told only once it is durable, as the
            # consensus goes out only then: a controller started again resumes from it.
            tell_returns = self.returns.at_boundary() if boundary else None
            # A relay resumes from what it was sent: the lane record, or (no relay took
            # lanes) the whole one; flodl relays never resume.
            await self.resumption.record(
                record, part, self.window_store.latest if boundary else None,
                opens_round=out.opens_round, ends_round=out.ends_round,
            )
            if tell_returns is not None:
                tell_returns()
            self._tell_after_record()
            if whole_record is not None:
                for seat_id in whole_targets:
                    self.links[seat_id].queue(whole_record, before_write=partial(self._whole_going_out, seat_id))
            written = None
            if consensus.after_write is not None:
                if lane_targets:
                    written = AfterAllWrites(len(lane_targets), consensus.after_write)
                else:
                    consensus.after_write()
            for seat_id in lane_targets:
                self.links[seat_id].queue(
                    record,
                    before_write=partial(lane_round.broadcast_going_out, seat_id),
                    on_written=None if written is None else written.one,
                )
            # Only the link outboxes may keep this round's consensus alive (until written).
            del consensus, record, written, out, whole_record

    async def _whole_record(self, out: LaneOut, kept: EncodedFrame | None) -> EncodedFrame:
        """A round's consensus joined from its lanes as one Broadcast, for the relays that
        sent it whole: the bytes a controller without lanes sends them."""
        assert out.whole is not None
        if kept is not None and out.whole is out.kept:
            return await _enveloped(MuxKind.BROADCAST, kept, self.config.salt)
        return await _enveloped(MuxKind.BROADCAST, await _signed(out.whole, self.config.salt), self.config.salt)

    def _whole_going_out(self, seat_id: int) -> None:
        """A whole relay is being written its consensus: every lane's round may take its next frame."""
        for lane_round in self.rounds:
            lane_round.broadcast_going_out(seat_id)

    def _revive(self, rank: int) -> None:
        """A return let in: the rank is live again, and a later death is news."""
        self._forwarded.discard(rank)
        self._exited.discard(rank)
        self.dead.revive(rank)

    def _forward_new_deaths(self) -> None:
        """Each new death: one DeclareDead to the relay carrying it; the round may complete."""
        new = self.dead.snapshot() - self._forwarded
        if not new:
            return
        now = trio.current_time()
        for rank in sorted(new):
            self._forwarded.add(rank)
            self.membership.died(rank, now)
            seat_id = self.seats.seat_of(rank)
            if seat_id is not None and rank not in self._exited:
                link = self.links[seat_id]
                away = link.takes_extensions and rank in self.membership.absent  # formed without it: it may come
                link.queue_control(RankAway(rank) if away else DeclareDead(rank), self.config.salt)
        self.membership_changed.notify()
        if self.shards is not None:
            self.shards.relays_changed()  # a relay whose last rank died is decided out
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
                self.resumption.run_over()
                if self.shards is not None:
                    await self.shards.close_cleanly()  # they hold for no controller now
                await self.handle.coordinator.say_run_over()  # before the connections close
                self.handle.outcome.end()
                return
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self.membership_changed.wait()

    # -- status page ---------------------------------------------------------

    def _status(self) -> dict[str, object]:
        """What an operator sees on the status page (docs/operations.md)."""
        return {
            "world_size": self.config.world_size,
            "dead_ranks": sorted(self.dead.snapshot()),
            # Returns with both halves in (relay's ask, state request): their state is on its way.
            "joining": [rank for rank, _seat in self.membership.ready()],
            # Of those, the ones that have their state: they enter at the next boundary.
            "primed": [rank for rank, _seat in self.membership.entering()],
            "relays": [
                {"host": self.links[sid].host, "ranks": list(seat.ranks), "delivered": sid in self.rounds[0].delivered}
                for sid, seat in self.seats.connected()
            ],
            "shards": None if self.shards is None else self.shards.status(),
            "stats": attrs.asdict(self.stats),
        }


__all__ = ["CheckpointSink", "ControllerHandle", "ControllerStats", "OuterOptimizer", "open_controller"]
