"""A reduction shard: some lanes of every round, summed where they land.

Task structure::

    serve_listeners --> route(conn) --peek channel magic--> data: a relay's pieces (one per relay)
                                                         \\-> shard: the controller's decisions (one)

    relay session:  reader  --Pieces{round}, lane frames (verified)--> kept (per relay, per lane);
                              ShardAck back; ShardLost: a lost shard's lanes are ours now
    mirror:         each stepped lane, divided, to the backup (the next live shard), which
                    steps a mirror of its state (mirror.py); a lost shard's lanes go on from it
                    writer  <--ShardAck / Decided{d} + consensus lanes-- outbox channel
    controller:     reader  --Decide / ShardLost--> the latest decision
                    decider --once every decided host's pieces are in--> each owned lane summed
                              over ``hosts`` in host order, divided once, stepped (``Decide.step``: the
                              outer optimizer ``ShardOuter`` named), signed, queued to the targets
                              (and, with ``Decide.copy``, to the controller after its own mark;
                              copy 2 adds each stepped lane's outer state: a checkpoint)
                    heartbeat --ShardAlive--> the controller (a frozen shard is noticed)

A shard folds nothing before the controller decides the round's contributors:
every shard then sums the same hosts' pieces in the same order, so the lanes
they send make one consensus, the bytes a deterministic controller would
compute (docs/wire.md, "Shards"). Pieces stay until the relay's next round
begins, so a round the controller decides again (a shard was lost before it
committed) is summed again from them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from ..errors import ConfigError, FlodlError, ProtocolError, SchemaError
from ..fold.accumulator import FoldAccumulator, finish_consensus
from ..fold.outer import SHARD_OUTER_KINDS, F32Array, LaneKey, ShardLanesOuter, lane_key, lane_state_frame
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import Connector, Listeners, listener_port, peer_host, tune_socket, warn_if_public_peer
from ..transport.hashing import encode_enveloped_frame
from ..transport.hello import check_ranks_listed, receive_hello
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal, RunOutcome, one_error, serving
from ..wire.constants import CHANNEL_MAGIC_DATA, CHANNEL_MAGIC_MIRROR, CHANNEL_MAGIC_SHARD, DEFAULT_FRAME_CEILING
from ..wire.fragment import FragmentTag
from ..wire.lanes import MAX_LANES, LaneLayout, lane_owner, read_lane_tag
from ..wire.mux import (
    COPY_WITH_STATE,
    Decide,
    Decided,
    HandedBack,
    Handoff,
    Mirror,
    Mirrored,
    MuxKind,
    Outage,
    PieceRefused,
    Pieces,
    RelayControlMsg,
    Seed,
    ShardAck,
    ShardAlive,
    ShardBack,
    ShardLost,
    ShardOuter,
    Shards,
    ShardSetup,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
)
from ..fold.delta import is_delta_schema
from ..wire.round_frame import EncodedFrame, RoundFrame, decode_round_frame
from ..wire.salt import SessionSalt
from .mirror import (
    Handback,
    LaneState,
    MirrorLane,
    MirrorBook,
    MirrorLink,
    backup_of,
    decision_layout,
    dial_mirror,
    handback_records,
    handback_states,
    mirror_records,
    new_lane,
)
from .seeds import check_seed, seeded_states

log = logging.getLogger("flodl_trio.shard")

# The longest a relay's connection stays silent: a relay takes no word from a shard
# for its heartbeat timeout as the shard lost (see ShardLinks in relay/shards.py).
RELAY_KEEPALIVE_S = 1.0

# Records a relay's writer may lag behind: a round's acks, and every lane of a few
# decisions (each after its mark), which share their bytes with the other relays'.
_OUTBOX_DEPTH = 4 * (MAX_LANES + 1)


@attrs.define(eq=False)
class _Relay:
    """One relay's connection to this shard, its outbox, and the pieces it sent this round."""

    host: str
    lowest_rank: int
    conn: MessageStream
    outbox: trio.MemorySendChannel[EncodedFrame]
    inbox: trio.MemoryReceiveChannel[EncodedFrame]
    pieces: dict[int, RoundFrame] = attrs.field(factory=dict)  # lane -> its verified frame, this round
    # Each piece's frame is a view of the buffer it was received into, kept with it; a
    # dropped piece's buffer takes a later record (no copy, no new model-sized memory).
    buffers: dict[int, ReceiveBuffer] = attrs.field(factory=dict)
    spare: list[ReceiveBuffer] = attrs.field(factory=list)
    round: int = -1  # the relay's round its pieces are of (Pieces)
    decided: bool = False  # the latest decision of its round summed its pieces
    used_in: int | None = None  # the controller's round its pieces were summed for (Decide.round)
    gone: bool = False  # its connection ended
    session: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def name(self) -> str:
        return f"relay {self.host} (lowest rank {self.lowest_rank})"

    def queue(self, record: EncodedFrame) -> None:
        if self.gone:
            return
        try:
            self.outbox.send_nowait(record)
        except trio.WouldBlock:  # it reads nothing: it costs only itself
            log.warning("shard: %s is %d records behind; its connection is closed", self.name, _OUTBOX_DEPTH)
            self.session.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # gone


def _outer_of(msg: ShardOuter) -> ShardLanesOuter:
    """The outer step the controller named; hyperparameters it could not have are its error."""
    try:
        return ShardLanesOuter(SHARD_OUTER_KINDS[msg.kind](lr=msg.lr, momentum=msg.momentum))
    except ConfigError as exc:
        raise ProtocolError(f"ShardOuter: {exc}") from None


class ShardHandle:
    """A running shard: its port, counters, and how it ended."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.outcome = RunOutcome()
        self.index: int | None = None  # which shard the controller said it is (None: not set up yet)
        self.set_up = trio.Event()  # a controller said which shard it is
        self.rounds = 0
        self.lanes_summed = 0  # lanes it summed and sent, over every decision
        self.delta_lanes_summed = 0  # ... of delta rounds (their means went to the controller)
        self.pieces_dropped = 0  # pieces of hosts a decision left out
        self.refused = 0  # connections refused at their first record (wrong salt, not a setup or Hello)
        self.refused_pieces = 0  # pieces that were not what their round's schema says (their relay was named)
        self.controllers_resumed = 0  # controllers that took it on again after one was lost
        self.lanes_mirrored = 0  # lanes of other shards whose step it mirrored (it backs them up)
        self.lanes_taken_over = 0  # lanes of a lost shard it went on stepping from its mirror
        self.lanes_seeded = 0  # lanes it started from the controller's outer state (Seed)


@asynccontextmanager
async def open_shard(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    salt: SessionSalt | bytes,
    ceiling: int = DEFAULT_FRAME_CEILING,
    bounds: NetBounds | None = None,
    listeners: Listeners | None = None,
    connect: Connector = trio.open_tcp_stream,
) -> AsyncIterator[ShardHandle]:
    """Serve one reduction shard on ``host:port`` (0: any free port), or on the given
    ``listeners`` (a test's memory network), for the block. The controller that names it
    in ``shards=`` dials it and says which shard it is; ``connect`` is how it dials the
    shard it mirrors its lanes' outer state to."""
    bound: list[trio.abc.Listener[trio.abc.Stream]] = (
        list(listeners) if listeners is not None else list(await trio.open_tcp_listeners(port, host=host))
    )
    handle = ShardHandle(listener_port(bound[0]))
    shard = _Shard(SessionSalt.coerce(salt), ceiling, bounds or NetBounds.from_env(), handle, connect)
    async with serving(lambda: trio.serve_listeners(shard.route, bound), handle.outcome, log, "shard"):
        yield handle


def shard_server(
    *, salt: SessionSalt | bytes, ceiling: int = DEFAULT_FRAME_CEILING, bounds: NetBounds | None = None,
) -> Callable[[trio.Nursery, str], Awaitable[int]]:
    """What a controller starts a shard of its own with (``open_controller(serve_shard=)``):
    given a nursery and a host, a shard serving in that nursery on a free port of that
    host, and the port."""

    async def serve(nursery: trio.Nursery, host: str) -> int:
        port: int = await nursery.start(_serve_until_cancelled, host, salt, ceiling, bounds)
        return port

    return serve


async def _serve_until_cancelled(
    host: str, salt: SessionSalt | bytes, ceiling: int, bounds: NetBounds | None, *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with open_shard(host, 0, salt=salt, ceiling=ceiling, bounds=bounds) as handle:
        task_status.started(handle.port)
        with contextlib.suppress(FlodlError):  # (logged by the shard; its controller loses it)
            await handle.outcome.wait()


class _Shard:
    def __init__(
        self, salt: SessionSalt, ceiling: int, bounds: NetBounds, handle: ShardHandle, connect: Connector,
    ) -> None:
        self.salt = salt
        self._connect = connect
        self.ceiling = ceiling
        self.bounds = bounds
        self.handle = handle
        self.index: int | None = None
        self.count = 0
        self._heartbeat_s = bounds.heartbeat_timeout
        self.relays: dict[int, _Relay] = {}  # lowest rank -> relay
        self.lost: set[int] = set()  # shards lost: the next live one after each takes its lanes
        self._decision: Decide | None = None  # the latest decision, until every owned lane of it went out
        self._summing: Decide | None = None  # the decision whose lanes go out now
        self._lanes_sent: set[int] = set()  # ... and which of them went
        self._marked: set[int] = set()  # ... and which targets were sent its Decided mark
        self._controller_marked = False  # ... and whether the controller was (a copy: Decide.copy)
        # A delta round (docs/wire.md, "Delta rounds through the shards"): the owned lanes
        # whose mean went to the controller, and the consensus lanes it sent back.
        self._means_sent: set[int] = set()
        self._down: dict[int, RoundFrame] = {}
        self._down_for: Decide | None = None  # the decision those lanes are of
        self._blocked: set[int] = set()  # ... and which lanes hold a refused piece (a newer decision comes)
        self._to_controller: trio.MemorySendChannel[EncodedFrame]  # set once the controller connected
        self._changed = ChangeSignal()  # a piece, a decision or a lost shard came in
        self.outer: ShardLanesOuter | None = None  # the outer step of its lanes (ShardOuter)
        self._outer_said: ShardOuter | None = None
        # Through a lost controller (docs/wire.md, "Shards through a lost controller"):
        self._outage_s = 0.0  # how long to hold for it (Outage; 0: the shard ends with it)
        self._session: trio.CancelScope | None = None  # the current controller's session
        self._sessions = 0  # controller sessions so far
        self._controller_changed = ChangeSignal()  # a controller set this shard up
        self._latest_decision = 0  # the newest decision number any controller gave
        self._decided_any = False  # ... once one gave any
        # The outer state through a lost shard (mirror.py):
        self.addresses: list[tuple[str, int]] = []  # every shard's, as the controller said (Shards)
        self.mirrors: MirrorBook | None = None  # the mirror of the lanes this shard backs up
        self._link: MirrorLink | None = None  # to this shard's backup
        self._nursery: trio.Nursery | None = None  # the controller session's
        self.handback = Handback()  # served again: the lane states its lanes' holder hands it
        # The controller's outer state for lanes no shard holds (seeds.py): as read, then
        # checked against the decision that followed it.
        self._seed: tuple[Seed, list[RoundFrame]] | None = None
        self._seeded: tuple[Decide, dict[int, LaneState]] | None = None

    def _control(self, msg: RelayControlMsg) -> EncodedFrame:
        return encode_mux_record(MuxKind.CONTROL, encode_control_msg(msg), self.salt)

    def _owns(self, lane: int) -> bool:
        assert self.index is not None
        return lane_owner(lane, self.count, self.lost) == self.index

    def _shard_lost(self, shard: int) -> None:
        if shard != self.index and shard not in self.lost:
            log.info("shard %s: shard %d is lost; its lanes are the next live shard's", self.index, shard)
            self.lost.add(shard)
            self._changed.notify()
            self._backups_changed()

    def _shard_back(self, shard: int) -> None:
        """A lost shard is served again (a new one, between rounds): its lanes are its own
        again from the next round."""
        if shard in self.lost:
            log.info("shard %s: shard %d is served again; its lanes are its own again", self.index, shard)
            self.lost.discard(shard)
            self._changed.notify()
            self._backups_changed()

    async def route(self, stream: trio.abc.Stream) -> None:
        tune_socket(stream)
        host = peer_host(stream)
        conn = MessageStream(stream, f"connection from {host}", self.bounds)
        try:
            with trio.fail_after(self.bounds.channel_magic):
                magic = int.from_bytes(await conn.receive_exactly(4, "the channel-select magic"), "little")
        except (trio.TooSlowError, *CONNECTION_LOST):
            await conn.aclose()
            return
        warn_if_public_peer("shard", host)  # (the lanes reach it in cleartext too)
        if magic == CHANNEL_MAGIC_SHARD:
            await self._serve_controller(conn)
        elif magic == CHANNEL_MAGIC_DATA:
            await self._serve_relay(conn)
        elif magic == CHANNEL_MAGIC_MIRROR:
            await self._serve_mirror(conn)
        else:
            log.warning("shard: %s: unknown channel magic %08x; closed", conn.peer, magic)
            await conn.aclose()

    # -- the controller ------------------------------------------------------

    async def _serve_controller(self, conn: MessageStream) -> None:
        """Its setup, then its decisions, one per round in several lanes. A connection whose
        first record is not a signed ``ShardSetup`` is refused and costs nothing else; so is
        one that would make a shard set up before another shard (docs/wire.md, "Shards
        through a lost controller")."""
        try:
            with trio.fail_after(self.bounds.handshake):
                setup = await self._control_record(conn)
            if not isinstance(setup, ShardSetup) or not 0 <= setup.index < setup.count:
                raise ProtocolError(f"the first record must be a ShardSetup with index < count, got {setup}")
            if self.index is not None and (setup.index, setup.count) != (self.index, self.count):
                raise ProtocolError(f"it set up shard {setup.index} of {setup.count}; this one is shard {self.index} "
                                    f"of {self.count}")
        except (FlodlError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            why = str(exc) or "no ShardSetup within the handshake bound"
            self._refuse(f"controller connection {conn.peer} refused: {why}")
            await conn.aclose()
            return
        resumed = self.index is not None
        self.index, self.count, self._heartbeat_s = setup.index, setup.count, setup.heartbeat_ms / 1000
        self.handle.index = setup.index
        self.handle.set_up.set()
        conn.peer = "the controller"
        if self._session is not None:  # one controller at a time: the newest (the old is gone, or lost us)
            self._session.cancel()
        self._session = session = trio.CancelScope()
        self._sessions += 1
        self._controller_changed.notify()
        if resumed:
            log.info("shard %d of %d: a controller took it on again (its relays, pieces and outer state kept)",
                     setup.index, setup.count)
            self.handle.controllers_resumed += 1
            self._decision = self._summing = None  # the lost controller's; the new one decides again
        else:
            log.info("shard %d of %d: set up by the controller", setup.index, setup.count)
        error: FlodlError | None = None
        try:
            with session:
                await self._controller_session(conn, resumed)
        except FlodlError as exc:  # the controller broke the protocol: this shard's work ends, saying why
            log.warning("shard %s: ends: %s", self.index, exc)
            error = exc
        except CONNECTION_LOST as exc:  # the controller dropped this shard (lost it), or died
            log.info("shard %s: the controller's connection ended: %s", self.index, exc)
        finally:
            await conn.aclose()
        if session.cancelled_caught:
            return  # a newer controller took over
        if error is None and self._outage_s > 0:
            error = await self._hold_for_a_controller()
        if error is not None or session is self._session:
            self.handle.outcome.end(error)  # its controller is gone: the shard's work is over

    async def _controller_session(self, conn: MessageStream, resumed: bool) -> None:
        """One controller's session: its decisions followed, the lanes summed, its writer.
        A shard it takes on again says first the newest decision it was given, so the new
        controller numbers its own above it (a relay takes only a newer decision's lanes)."""
        self._to_controller, to_controller = trio.open_memory_channel[EncodedFrame](math.inf)
        self._link = None  # (a link of an earlier session ended with it)
        if resumed:
            await conn.send_chunks(self._control(Decided(self._latest_decision)).chunks)
        with one_error():
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._controller_writer, conn, to_controller)
                nursery.start_soon(self._decider)
                await self._follow_controller(conn)
                nursery.cancel_scope.cancel()

    async def _hold_for_a_controller(self) -> FlodlError | None:
        """The controller said it keeps a resume record (``Outage``): hold the relays, their
        pieces and the outer state for as long as it said, for the controller started again.
        None once one took over; else why the shard ends."""
        sessions, outage = self._sessions, self._outage_s
        log.warning("shard %s: lost its controller; holding for up to %g s for it to come back", self.index, outage)
        with trio.move_on_after(outage):
            while self._sessions == sessions:
                await self._controller_changed.wait()
            return None
        return FlodlError(f"shard {self.index}: the controller did not come back within its outage bound ({outage:g} s)")

    async def _follow_controller(self, conn: MessageStream) -> None:
        buf = ReceiveBuffer()
        while True:
            msg = await self._control_record(conn, buf, self._down_limit())
            if msg is None:
                log.info("shard %s: the controller closed its connection", self.index)
                return
            if self._seed is not None and not isinstance(msg, Decide):
                raise ProtocolError(f"the controller's Seed for decision {self._seed[0].decision} was followed by "
                                    f"{type(msg).__name__}, not its Decide")
            if isinstance(msg, RoundFrame):
                self._consensus_lane(msg)
            elif isinstance(msg, Seed):
                check_seed(msg)
                frames = await self._seed_frames(conn, msg)
                if frames is None:
                    log.info("shard %s: the controller closed its connection mid-seed", self.index)
                    return
                self._seed = (msg, frames)
            elif isinstance(msg, Decide) and self._decided_any and msg.decision <= self._latest_decision:
                self._seed = None  # (a Seed right before it was the copy's too)
                self._stale_decision(msg)
            elif isinstance(msg, Decide):
                if msg.step and self.outer is None:
                    raise ProtocolError(f"decision {msg.decision} steps its lanes, and no ShardOuter said how")
                if msg.step and is_delta_schema(msg.schema):
                    raise ProtocolError(f"decision {msg.decision} steps a delta round: the controller steps those")
                self._seeded = self._take_seed(msg)
                self._decision = self._down_for = msg
                self._down = {}
                self._latest_decision, self._decided_any = max(self._latest_decision, msg.decision), True
                self._changed.notify()
                self._mirror_decided(msg)
            elif isinstance(msg, ShardLost):
                self._shard_lost(msg.shard)
            elif isinstance(msg, ShardBack) and msg.shard == self.index:  # this one serves a lost shard again
                self.handback.expect(backup_of(self.index, self.count, self.lost))
            elif isinstance(msg, ShardBack):
                self._readdress(msg.shard, (msg.host, msg.port))
                self._hand_back(msg.shard)
                self._shard_back(msg.shard)
            elif isinstance(msg, Shards):
                self.addresses = list(msg.addresses)
            elif isinstance(msg, Outage):
                self._outage_s = msg.millis / 1000
            elif isinstance(msg, ShardOuter) and self.outer is None:
                self.outer, self._outer_said = _outer_of(msg), msg
                self.mirrors = MirrorBook(_outer_of(msg))
                log.info("shard %s: steps its lanes with %r", self.index, self.outer.optimizer)
            elif isinstance(msg, ShardOuter) and msg == self._outer_said:
                continue  # a controller that took this shard on again says it again: the state stays
            else:
                raise ProtocolError(f"the controller sent a shard {type(msg).__name__}"
                                    + (" unlike the one it said before" if isinstance(msg, ShardOuter) else ""))

    def _stale_decision(self, msg: Decide) -> None:
        """A ``Decide`` not newer than the newest taken: decision numbers only grow, over
        controllers too, so it is a copy of an authentic record (something on the link
        replayed it: docs/wire.md, "Replays"). Summing it again would send lanes the
        relays hold already; it is ignored, and logged."""
        log.warning("shard %s: the controller's Decide %d again (the newest it gave is %d): a replayed record? "
                    "ignored", self.index, msg.decision, self._latest_decision)

    async def _seed_frames(self, conn: MessageStream, msg: Seed) -> list[RoundFrame] | None:
        """The lane states a ``Seed`` promised, read now (each a Broadcast record of at most
        the frame ceiling; None: the connection ended)."""
        frames: list[RoundFrame] = []
        for i in range(msg.lanes):
            record = await self._control_record(conn, ReceiveBuffer(), self.ceiling)
            if record is None:
                return None
            if not isinstance(record, RoundFrame):
                raise ProtocolError(f"the controller's Seed for decision {msg.decision} promised {msg.lanes} lane "
                                    f"states; record {i} after it is {type(record).__name__}")
            frames.append(record)
        return frames

    def _take_seed(self, msg: Decide) -> tuple[Decide, dict[int, LaneState]] | None:
        """The seed that came right before ``msg``, checked against it (None: none came)."""
        seed, self._seed = self._seed, None
        if seed is None:
            return None
        states = seeded_states(seed[0], seed[1], msg, self._owns, self.index)
        return msg, states

    async def _controller_writer(self, conn: MessageStream, outbox: trio.MemoryReceiveChannel[EncodedFrame]) -> None:
        """The one writer to the controller: what the shard has to say (refused pieces),
        and ``ShardAlive`` whenever a quarter of its heartbeat timeout passes in silence.
        A connection that breaks ends it quietly: the reader sees the end too."""
        with contextlib.suppress(*CONNECTION_LOST):
            await self._write_keeping_alive(conn, outbox, self._heartbeat_s / 4)

    async def _write_keeping_alive(
        self, conn: MessageStream, outbox: trio.MemoryReceiveChannel[EncodedFrame], idle: float
    ) -> None:
        """Send what ``outbox`` holds, and ``ShardAlive`` after each ``idle`` seconds with
        nothing to send; return once the outbox is closed."""
        alive = self._control(ShardAlive())
        while True:
            record = alive
            with trio.move_on_after(idle):
                try:
                    record = await outbox.receive()
                except trio.EndOfChannel:
                    return
            await conn.send_chunks(record.chunks)

    async def _control_record(
        self, conn: MessageStream, buf: ReceiveBuffer | None = None, lane_limit: int = 0
    ) -> object | None:
        """The controller's next record: a control message, or (``lane_limit`` > 0: a delta
        decision is in progress) a consensus lane of at most that many bytes."""
        header = await conn.receive_mux_header(max(SMALL_MESSAGE, lane_limit))
        if header is None:
            return None
        kind, payload = await conn.receive_mux_payload(header, buf or ReceiveBuffer(), self.salt)
        if kind is MuxKind.BROADCAST and lane_limit > 0:
            return decode_round_frame(bytes(payload), self.salt, ceiling=self.ceiling, source=conn.peer,
                                      authenticated=True)
        if kind is not MuxKind.CONTROL:
            raise ProtocolError(f"{conn.peer} sent a {kind.name} record where a control message was due")
        if header.length > SMALL_MESSAGE:
            raise ProtocolError(f"{conn.peer} sent a {header.length}-byte control message (at most {SMALL_MESSAGE})")
        return decode_control_msg(payload)

    def _down_limit(self) -> int:
        """How large a record the controller may send now: a consensus lane of the delta
        decision in progress (0: none is)."""
        msg = self._down_for
        if msg is None or not is_delta_schema(msg.schema):
            return 0
        return decision_layout(msg).max_frame_bytes + SMALL_MESSAGE

    def _consensus_lane(self, frame: RoundFrame) -> None:
        """A delta round's consensus lane from the controller, for this shard to fan out:
        one it owns in the decision in progress, as the layout says."""
        msg = self._down_for
        assert msg is not None  # (_down_limit let a lane in only then)
        tag = read_lane_tag(frame)
        if tag is None or not 1 <= tag.index < msg.lanes or not self._owns(tag.index) or tag.index in self._down:
            raise ProtocolError(f"the controller sent consensus lane {tag} of decision {msg.decision}, which this "
                                f"shard does not fan out (or sent it twice)")
        try:
            decision_layout(msg).check_lane(tag.index, frame)
        except SchemaError as exc:
            raise ProtocolError(f"the controller's consensus lane of decision {msg.decision}: {exc}") from None
        self._down[tag.index] = frame
        self._changed.notify()

    async def _decider(self) -> None:
        """Follow the latest decision: sum and send each owned lane as soon as every
        decided host's piece of it is in (lost shards' lanes come again from the live
        relays), each target's first one after the decision's mark; a newer decision
        replaces it."""
        while True:
            msg = self._decision
            if msg is None:
                await self._changed.wait()
                continue
            if msg is not self._summing:
                self._summing, self._lanes_sent, self._marked, self._blocked = msg, set(), set(), set()
                self._controller_marked, self._means_sent = False, set()
            owned = [lane for lane in range(1, msg.lanes) if self._owns(lane)]
            back, ready = self._lanes_due(msg, owned)
            if back:
                for lane in back:
                    await self._fan_out(msg, lane)
            elif ready and msg.step and self.handback.waiting(self.lost):
                await self._changed.wait()  # served again: its lanes' state comes first
            elif ready:
                for lane in ready:
                    await self._sum_lane(msg, lane)
            elif self._lanes_sent.issuperset(owned):
                self._decided(msg)
            else:
                await self._changed.wait()

    def _lanes_due(self, msg: Decide, owned: list[int]) -> tuple[list[int], list[int]]:
        """The owned lanes to fan out now, and those to sum (every decided host's piece in).
        A delta round's lanes are summed into means for the controller, which steps them
        and sends each consensus lane back, to fan out (docs/wire.md, "Delta rounds
        through the shards"); one whose consensus is back is not summed."""
        if not is_delta_schema(msg.schema):
            return [], [lane for lane in owned
                        if lane not in self._lanes_sent | self._blocked and self._pieces_in(msg, lane)]
        down = self._down.keys() if self._down_for is msg else set()
        back = [lane for lane in owned if lane in down and lane not in self._lanes_sent]
        ready = [lane for lane in owned if lane not in self._means_sent | self._blocked | down
                 and self._pieces_in(msg, lane)]
        return back, ready

    async def _signed_lane(self, frame: RoundFrame) -> EncodedFrame:
        """A lane frame this shard sends, as a Broadcast record: its record's MAC alone
        (docs/wire.md, "One MAC a lane")."""
        return await encode_enveloped_frame(MuxKind.BROADCAST, frame, self.salt, frame_mac=False)

    async def _fan_out(self, msg: Decide, lane: int) -> None:
        """A consensus lane the controller sent, to the decision's targets."""
        self._to_targets(msg, await self._signed_lane(self._down[lane]))
        self._lanes_sent.add(lane)

    def _to_targets(self, msg: Decide, record: EncodedFrame) -> None:
        """A lane of the decision to each of its targets, its first after the decision's mark."""
        mark = self._control(Decided(msg.decision))
        for rank in msg.targets:  # each a decided host (so connected here: its pieces are in)
            target = self.relays.get(rank)
            if target is None:
                continue
            if rank not in self._marked:
                self._marked.add(rank)
                target.queue(mark)
            self._queue_lane(target, record)

    def _to_controller_marked(self, msg: Decide, record: EncodedFrame) -> None:
        """A lane of the decision to the controller, its first after the decision's mark."""
        if not self._controller_marked:
            self._controller_marked = True
            self._to_controller.send_nowait(self._control(Decided(msg.decision)))
        self._to_controller.send_nowait(record)

    def _pieces_in(self, msg: Decide, lane: int) -> bool:
        """Whether every decided host's piece of ``lane`` is in: of this round (the lane 0
        that decided it may beat a relay's pieces here, and its last round's are kept)."""
        return all(self._fresh(rank, msg.round) and lane in self.relays[rank].pieces for rank in msg.hosts)

    def _fresh(self, rank: int, round_: int) -> bool:
        relay = self.relays.get(rank)
        return relay is not None and relay.used_in in (None, round_)

    async def _sum_lane(self, msg: Decide, lane: int) -> None:
        """Lane ``lane`` summed over the decided hosts in host order, divided once, to the
        targets. A piece that is not what the round's schema says is refused, naming its
        relay to the controller (which drops that relay and decides again): it costs that
        relay, not this shard."""
        layout = decision_layout(msg)
        acc = FoldAccumulator()
        for rank in msg.hosts:
            relay = self.relays[rank]
            try:
                layout.check_lane(lane, relay.pieces[lane])
                # The fold checks what the layout cannot: payload bytes against the shape,
                # one kind, a finite mass. What it refuses it has not added (an arriving
                # piece is the wrong one, as at the controller's fold).
                acc.add(relay.pieces[lane], relay.name)
            except SchemaError as exc:
                self._blocked.add(lane)
                return self._refuse_piece(relay, f"{exc} (round of {msg.lanes} lanes)")
        for rank in msg.hosts:
            self.relays[rank].used_in = msg.round
        consensus = finish_consensus(acc)
        self.handle.lanes_summed += 1
        if is_delta_schema(msg.schema):  # the mean goes to the controller, which steps the lineage
            self._means_sent.add(lane)
            if not self.handle.delta_lanes_summed:
                log.info("shard %s: sums delta rounds; their means go to the controller, which steps them", self.index)
            self.handle.delta_lanes_summed += 1
            return self._to_controller_marked(msg, await self._signed_lane(consensus))
        fragment = None if msg.fragment is None else FragmentTag(*msg.fragment)
        mean = consensus
        if msg.step:
            assert self.outer is not None  # (checked as the decision came in)
            start = self._start_state(msg, layout, lane, fragment)
            consensus = self.outer.step(msg.round, consensus, layout, lane, fragment)
        record = await self._signed_lane(consensus)
        self._to_targets(msg, record)
        if msg.copy:  # the controller keeps this round whole (a rank rejoins, a checkpoint is due)
            self._to_controller_marked(msg, record)
            if msg.copy == COPY_WITH_STATE and msg.step:
                await self._copy_state(msg, consensus, layout, lane, fragment)
        if msg.step:
            await self._mirror_lane(msg, layout, lane, fragment, mean, start)
        self._lanes_sent.add(lane)

    async def _copy_state(
        self, msg: Decide, stepped: RoundFrame, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> None:
        """After a stepped lane's copy, its outer state (a checkpoint saves it)."""
        assert self.outer is not None
        state = self.outer.lane_state(msg.round, layout, lane, fragment)
        frame = lane_state_frame(stepped, len(layout.lanes[lane]), state)
        self._to_controller.send_nowait(await self._signed_lane(frame))

    def _refuse_piece(self, relay: _Relay, reason: str) -> None:
        log.warning("shard %s: %s sent a piece the round's schema does not allow: %s", self.index, relay.name, reason)
        self.handle.refused_pieces += 1
        self._to_controller.send_nowait(self._control(PieceRefused(relay.lowest_rank, reason)))

    def _queue_lane(self, target: _Relay, record: EncodedFrame) -> None:
        target.queue(record)

    def _decided(self, msg: Decide) -> None:
        """Every owned lane of the decision went out: the pieces of hosts it left out go."""
        if self._decision is msg:
            self._decision = None
        for relay in list(self.relays.values()):
            relay.decided = relay.lowest_rank in msg.hosts  # by the latest decision of its round
            if relay.gone and not relay.decided:  # left out: a later decision of its round leaves it out too
                self._drop_pieces(relay)
                del self.relays[relay.lowest_rank]
        self.handle.rounds += 1

    def _drop_pieces(self, relay: _Relay) -> None:
        """The relay's pieces go; counted if no decision summed them."""
        if not relay.decided:
            self.handle.pieces_dropped += len(relay.pieces)
        relay.pieces.clear()
        relay.spare.extend(relay.buffers.values())  # nothing reads a dropped piece: a sum adds, or copies, at once
        relay.buffers.clear()
        relay.decided, relay.used_in = False, None

    # -- the outer state's mirror (mirror.py) --------------------------------

    def _readdress(self, shard: int, address: tuple[str, int]) -> None:
        if 0 <= shard < len(self.addresses):
            self.addresses[shard] = address

    def _start_state(
        self, msg: Decide, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> tuple[list[F32Array], list[F32Array]] | None:
        """The state lane ``lane`` steps from in this round: a lost shard's lane this shard
        backed up goes on from the mirror (adopted here), any other from its own."""
        assert self.outer is not None
        try:
            handed = self.handback.take(layout, lane, fragment)
        except SchemaError as exc:
            log.warning("shard %s: the state handed back for lane %d is not its layout's: %s", self.index, lane, exc)
            handed = None
        if handed is not None:
            self.outer.adopt(msg.round, layout, lane, fragment, handed)
            return handed
        if self.mirrors is not None:
            taken = self.mirrors.take(msg.round, layout, lane, fragment)
            if taken is not None:
                log.info("shard %s: lane %d goes on from its mirrored outer state", self.index, lane)
                self.handle.lanes_taken_over += 1
                self.outer.adopt(msg.round, layout, lane, fragment, taken)
                return taken
        own = self.outer.start_state(msg.round, layout, lane, fragment)
        seeded = self._seeded
        if own is not None or seeded is None or seeded[0] is not msg or lane not in seeded[1]:
            return own
        self.handle.lanes_seeded += 1  # no shard held it: the controller's state, not a fresh start
        self.outer.adopt(msg.round, layout, lane, fragment, seeded[1][lane])
        return seeded[1][lane]

    async def _mirror_lane(
        self, msg: Decide, layout: LaneLayout, lane: int, fragment: FragmentTag | None, mean: RoundFrame,
        start: tuple[list[F32Array], list[F32Array]] | None,
    ) -> None:
        """Lane ``lane``, divided and not yet stepped, to the backup (with its state as the
        round started, if the backup does not hold it): the backup steps the same state."""
        link = self._mirror_link()
        if link is None:
            return
        key = lane_key(layout, lane, fragment)
        assert self.index is not None
        records = await mirror_records(self.salt, self.index, msg.decision, mean, len(layout.lanes[lane]), start,
                                       key in link.seeded)
        if link.queue(records):
            link.seeded.add(key)
        else:
            self._backup_failed(link, "it reads its mirror too slowly")

    def _mirror_link(self) -> MirrorLink | None:
        """The connection to this shard's backup as the lost set says now (None: no other
        live shard); a new backup gets a new one, and every lane's state again."""
        assert self.index is not None and self._nursery is not None
        backup = backup_of(self.index, self.count, self.lost)
        link = self._link
        address = self.addresses[backup] if backup is not None and backup < len(self.addresses) else None
        if link is not None and address is not None and (link.backup, link.address) == (backup, address):
            return link
        if link is not None:
            link.close()
        if backup is None or address is None:
            self._link = None
            return None
        self._link = link = MirrorLink(backup, address, self.index)
        self._nursery.start_soon(link.run, self.bounds, self._connect, functools.partial(self._backup_failed, link))
        return link

    def _backup_failed(self, link: MirrorLink, why: str) -> None:
        """This shard cannot mirror to its backup: the controller is told it is lost (a
        round cannot commit without its mirror), and decides."""
        log.warning("shard %s: its backup, shard %d, failed: %s", self.index, link.backup, why)
        link.close()
        self._say(ShardLost(link.backup))

    def _say(self, msg: RelayControlMsg) -> None:
        with contextlib.suppress(AttributeError, trio.BrokenResourceError, trio.ClosedResourceError):
            self._to_controller.send_nowait(self._control(msg))

    def _mirror_decided(self, msg: Decide) -> None:
        """A new decision: mirrored lanes that came before it are stepped now."""
        if self.mirrors is None:
            return
        for lane in self.mirrors.decided(msg):
            self._step_mirror(lane.shard, lane)
        self._say_mirrored()

    def _step_mirror(self, sender: int, lane: MirrorLane) -> None:
        """A mirrored lane stepped; a lane that breaks the protocol costs its sender (the
        controller is told it is lost), not this shard."""
        assert self.mirrors is not None and self.index is not None
        try:
            key = self.mirrors.step(lane, self.index, self.count, self.lost)
        except ProtocolError as exc:
            log.warning("shard %s: shard %d mirrored a lane wrongly: %s", self.index, sender, exc)
            self._say(ShardLost(sender))
            return
        if key is not None:
            self.handle.lanes_mirrored += 1
            if self.outer is not None:  # a lane this shard held once (it handed it back): the mirror is its state now
                self.outer.forget_key(key)
        self._say_mirrored()

    def _backups_changed(self) -> None:
        if self.mirrors is not None and self.index is not None:
            self.mirrors.backups_changed(self.index, self.count, self.lost)
        self._say_mirrored()

    def _hand_back(self, shard: int) -> None:
        """Shard ``shard`` is served again: if this shard held its lanes, it hands their
        outer state to the new one (then ``HandedBack``), which steps them on from it."""
        if self.outer is None or self.mirrors is None or self.index is None or self._nursery is None:
            return
        after = self.lost - {shard}
        if backup_of(shard, self.count, after) != self.index or not 0 <= shard < len(self.addresses):
            return
        states = handback_states(self.index, shard, self.count, self.lost, after,
                                 self.mirrors.held(), self.outer.held())
        self._nursery.start_soon(self._send_handback, shard, self.addresses[shard], states)

    async def _send_handback(
        self, shard: int, address: tuple[str, int], states: dict[LaneKey, tuple[list[F32Array], list[F32Array]]],
    ) -> None:
        assert self.index is not None
        records = await handback_records(self.salt, self.index, states)
        try:
            conn = await dial_mirror(address, f"shard {self.index}: shard {shard} served again",
                                     f"shard {shard} (served again)", self.bounds, self._connect)
            try:
                await conn.send_chunks([chunk for record in records for chunk in record.chunks])
            finally:
                await conn.aclose()
        except (OSError, FlodlError, *CONNECTION_LOST) as exc:
            log.warning("shard %s: could not hand shard %d its lanes' state: %s", self.index, shard, exc)
            self._say(ShardLost(shard))
            return
        log.info("shard %s: handed shard %d, served again, the state of %d lanes", self.index, shard, len(states))

    def _say_mirrored(self) -> None:
        if self.mirrors is None or self.index is None:
            return
        decision = self.mirrors.due(self.index, self.count, self.lost)
        if decision is not None:
            self._say(Mirrored(decision))

    async def _serve_mirror(self, conn: MessageStream) -> None:
        """A shard that this one backs up: each lane it steps, divided (and maybe its state
        as the round started), verified and stepped on the mirror. Bytes that break the
        protocol end the connection and cost the sender."""
        sender: int | None = None
        buf = ReceiveBuffer()
        try:
            while True:
                # Each lane starts with a small signed record (and the first within the handshake
                # bound), so a peer without the salt gets nothing more buffered, or held open.
                with trio.fail_after(self.bounds.handshake) if sender is None else contextlib.nullcontext():
                    first = await self._mirror_record(conn, buf, SMALL_MESSAGE)
                if first is None:
                    return
                if isinstance(first, Handoff | HandedBack):
                    sender = first.shard
                    await self._take_handback(conn, buf, first)
                    continue
                if not isinstance(first, Mirror) or self.mirrors is None or first.shard == self.index:
                    raise ProtocolError(f"sent a mirror connection {type(first).__name__}"
                                        + (" before this shard steps lanes" if self.mirrors is None else ""))
                sender = first.shard
                conn.peer = f"shard {sender} (mirror)"
                state = await self._mirror_record(conn, buf, self.ceiling) if first.start == 1 else None
                mean = await self._mirror_record(conn, buf, self.ceiling)
                if (state is not None and not isinstance(state, RoundFrame)) or not isinstance(mean, RoundFrame):
                    raise ProtocolError("sent a mirror connection something other than a lane where one was due")
                lane = new_lane(first, state, mean)
                if self.mirrors.arrived(lane):
                    self._step_mirror(sender, lane)
        except (FlodlError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            why = str(exc) or "nothing within the handshake bound"
            log.warning("shard %s: %s: mirror connection ended: %s", self.index, conn.peer, why)
            if sender is not None and isinstance(exc, FlodlError):
                self._say(ShardLost(sender))
        finally:
            await conn.aclose()

    async def _take_handback(self, conn: MessageStream, buf: ReceiveBuffer, msg: Handoff | HandedBack) -> None:
        if isinstance(msg, HandedBack):
            log.info("shard %s: shard %d handed back the state of %d lanes", self.index, msg.shard, msg.lanes)
            self.handback.finished(msg)
            self._changed.notify()
            return
        state = await self._mirror_record(conn, buf, self.ceiling)
        if not isinstance(state, RoundFrame):
            raise ProtocolError("sent a Handoff with no lane state after it")
        self.handback.keep(msg, state)

    async def _mirror_record(self, conn: MessageStream, buf: ReceiveBuffer, ceiling: int) -> object | None:
        """The next record on a mirror connection, at most ``ceiling`` bytes: a control message
        or a lane frame (None: it ended). A record that starts a lane is a small control
        message, so a peer without the salt never gets more than that buffered."""
        header = await conn.receive_mux_header(ceiling)
        if header is None:
            return None
        kind, payload = await conn.receive_mux_payload(header, buf, self.salt)
        if kind is MuxKind.CONTROL:
            return decode_control_msg(payload)
        if kind is not MuxKind.BROADCAST:
            raise ProtocolError(f"sent a {kind.name} record on a mirror connection")
        return decode_round_frame(bytes(payload), self.salt, ceiling=self.ceiling, source=conn.peer,
                                  authenticated=True)

    # -- the relays ----------------------------------------------------------

    def _refuse(self, message: str) -> None:
        log.warning("shard %s: %s", self.index, message)
        self.handle.refused += 1

    async def _serve_relay(self, conn: MessageStream) -> None:
        try:
            hello = await receive_hello(conn, self.salt, self.bounds)
            check_ranks_listed(hello)
        except (FlodlError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            why = str(exc) or "no Hello within the handshake bound"
            self._refuse(f"relay connection {conn.peer} refused: {why}")
            await conn.aclose()
            return
        send, receive = trio.open_memory_channel[EncodedFrame](_OUTBOX_DEPTH)
        relay = _Relay(hello.host, min(hello.ranks), conn, send, receive)
        conn.peer = relay.name
        self.relays[relay.lowest_rank] = relay
        try:
            with relay.session, one_error():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._relay_writer, relay)
                    await self._relay_reader(relay)
                    nursery.cancel_scope.cancel()
        except (FlodlError, *CONNECTION_LOST) as exc:
            log.warning("shard %s: %s dropped: %s", self.index, relay.name, exc)
            if isinstance(exc, ProtocolError) and not isinstance(exc, CONNECTION_LOST):
                # Its bytes broke the protocol (a failed MAC, a lane twice or not this shard's,
                # a record over the ceiling): its pieces here may never come, so the controller
                # drops it and decides again without it. It costs that relay, not the round.
                self._say(PieceRefused(relay.lowest_rank, f"its connection to shard {self.index} broke the "
                                                          f"protocol: {exc}"))
        finally:
            # Its pieces stay until the round is decided: a relay lost after its lane 0
            # reached the controller is in the round (realized work).
            relay.gone = True
            await conn.aclose()

    async def _relay_writer(self, relay: _Relay) -> None:
        """The one writer to a relay: its acks and lanes, and ``ShardAlive`` after each
        RELAY_KEEPALIVE_S of silence, so a relay cut off from this shard (while both
        still reach the controller) notices within its heartbeat timeout."""
        async with relay.inbox:
            await self._write_keeping_alive(relay.conn, relay.inbox, min(RELAY_KEEPALIVE_S, self._heartbeat_s / 4))

    async def _relay_reader(self, relay: _Relay) -> None:
        """Each lane frame verified and kept, with the buffer it landed in (a spare one takes
        the next record), then acknowledged."""
        buf = ReceiveBuffer()
        while True:
            header = await relay.conn.receive_mux_header(self.ceiling)
            if header is None:
                return
            kind, payload = await relay.conn.receive_mux_payload(header, buf, self.salt)
            if kind is MuxKind.CONTROL:
                self._on_relay_control(relay, decode_control_msg(payload))
                continue
            if kind is not MuxKind.HOST_FRAME:
                raise ProtocolError(f"sent a {kind.name} record to a shard")
            frame = decode_round_frame(payload, self.salt, ceiling=self.ceiling, source=relay.name,
                                       authenticated=True)
            self._keep(relay, frame, buf)
            buf = relay.spare.pop() if relay.spare else ReceiveBuffer()
            relay.queue(self._control(ShardAck(read_lane_tag(frame).index)))  # type: ignore[union-attr]

    def _on_relay_control(self, relay: _Relay, msg: RelayControlMsg) -> None:
        if isinstance(msg, Pieces):
            if msg.round != relay.round:  # its next round: the last one's pieces are done with
                self._drop_pieces(relay)
                relay.round = msg.round
        elif isinstance(msg, ShardLost):  # it resends a lost shard's lanes: ours now
            self._shard_lost(msg.shard)
        else:
            raise ProtocolError(f"sent a shard {type(msg).__name__}")

    def _keep(self, relay: _Relay, frame: RoundFrame, buf: ReceiveBuffer) -> None:
        tag = read_lane_tag(frame)
        if tag is None or tag.index == 0 or self.index is None or not self._owns(tag.index):
            raise ProtocolError(f"sent lane {tag} to shard {self.index} of {self.count} (lost: {sorted(self.lost)}), "
                                "which does not reduce it")
        if relay.round < 0:
            raise ProtocolError(f"sent lane {tag.index} before saying which of its rounds it is (Pieces)")
        if tag.index in relay.pieces:
            raise ProtocolError(f"sent lane {tag.index} of its round {relay.round} twice")
        relay.pieces[tag.index], relay.buffers[tag.index] = frame, buf
        self._changed.notify()


__all__ = ["ShardHandle", "open_shard", "shard_server"]
