"""The controller's side of the reduction shards (docs/wire.md, "Shards" and "A lost shard").

With shards, a round's lane 0 (no payload) is all the controller reduces: once
it is complete, its contributors are the round's, and every shard is told to
sum exactly those hosts' pieces (``Decide``). The controller's consensus lane 0
goes out only when every target relay said it holds every shard's lane of that
decision (``LanesIn``): that is the round's commit. A shard lost before it (its
connection ended, or no ``ShardAlive`` for a heartbeat timeout) gives its lanes
to the next live shard, every relay and shard is told (``ShardLost``), and the
round is decided again under a new number; so is a round one of whose decided
relays is lost (its pieces may never come). No relay has used a lane before
the commit, so every rank gets one consensus.

While a rank is rejoining, or a checkpoint is due, the controller needs rounds
whole (a joiner starts from a window's consensus; a checkpoint saves it):
those decisions ask the shards for a copy (``Decide.copy``), and the commit
waits for every lane of it here too. A checkpoint's params round also asks
for each stepped lane's outer state (``copy`` 2), so the checkpoint holds the
optimizer state a single controller would.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import attrs
import trio

from ..errors import ConnectFailed, FlodlError, ProtocolError, SchemaError
from ..fold.outer import F32Array, lane_state_bytes, read_lane_state, state_frame
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import Connector, connect_with_retry, is_loopback, local_host
from ..transport.hashing import encode_enveloped_frame
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal
from ..wire.constants import CHANNEL_MAGIC_SHARD, DTYPE_F32
from ..wire.fragment import FragmentTag
from ..wire.lanes import LaneLayout, lane_owner, read_lane_tag
from ..wire.mux import (
    COPY_NONE,
    COPY_WITH_STATE,
    Decide,
    Decided,
    Mirrored,
    MuxKind,
    Outage,
    PieceRefused,
    RelayControlMsg,
    Seed,
    ShardAlive,
    ShardBack,
    ShardLost,
    ShardMoved,
    ShardOuter,
    Shards,
    ShardSetup,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.quant import DeltaCodec
from ..wire.round_frame import EncodedFrame, RoundFrame, TensorPayload, decode_round_frame
from .config import ControllerConfig
from .stats import ControllerStats

log = logging.getLogger("flodl_trio.controller")


# The longest a lost shard's connection is written its last word (Outage 0) before it closes.
LET_GO_S = 1.0

# Decision numbers skipped when a shard holding nothing comes in at a controller's start:
# relays may have marks of decisions a lost controller made after its record.
DECISIONS_AFTER_A_NEW_SHARD = 1 << 20


class ShardHere(Protocol):
    """How the controller serves a shard itself (when every other is lost, or beside the
    last live one)."""

    ports: dict[int, int]  # shard -> the port the controller serves it at

    async def start(self) -> tuple[str, int]:
        """A new shard of its own, listening: where the controller dials it, and its port."""

    def tell_relays(self, index: int, port: int) -> None:
        """Every relay told (``ShardMoved``) that shard ``index`` is on the controller's host at ``port``."""


# How a controller starts a shard of its own: given its nursery and the host to listen on,
# the port it listens at (the daemon passes one that runs ``flodl_trio.shard.open_shard``).
ShardServer = Callable[[trio.Nursery, str], Awaitable[int]]

# Where this process dials a shard of its own listening on every address.
_LOOPBACK_OF_ANY = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class HereOnListener:
    """:class:`ShardHere` for a controller on TCP: its shard listens on the host the
    controller's listener is bound to; each relay is told the address its own connection
    to the controller has."""

    def __init__(self, serve: ShardServer, bound_host: str, nursery: Callable[[], trio.Nursery | None],
                 relays: Callable[[], Iterable[tuple[MessageStream, Callable[[RelayControlMsg], None]]]]) -> None:
        self._serve = serve
        self._bound = bound_host
        self._nursery = nursery
        self._relays = relays  # each live relay's connection, and how to queue it a control message
        self.ports: dict[int, int] = {}  # shard -> the port the controller serves it at

    async def start(self) -> tuple[str, int]:
        nursery = self._nursery()
        if nursery is None:
            raise FlodlError("controller: no nursery to serve a shard in yet")
        port = await self._serve(nursery, self._bound)
        return _LOOPBACK_OF_ANY.get(self._bound, self._bound), port

    def address_for(self, conn: MessageStream, port: int) -> tuple[str, int]:
        """Where a relay on ``conn`` reaches the controller's shard."""
        host = local_host(conn.stream) or self._bound
        return host, port

    def tell_relays(self, index: int, port: int) -> None:
        self.ports[index] = port
        for conn, queue in self._relays():
            queue(ShardMoved(index, *self.address_for(conn, port)))


LaneState = tuple[list[F32Array], list[F32Array]]  # a stepped lane's x_prev and momentum pieces


@attrs.frozen
class Committed:
    """A round's commit: the seats to send lane 0 to, and what the shards copied here (None:
    nothing asked, or nobody was left to sum)."""

    targets: list[int]
    lanes: list[RoundFrame] | None = None  # lanes 1.., as the shards sent them
    states: list[LaneState] | None = None  # each lane's outer state after the step (copy 2)


# A delta round's consensus lanes from its lanes' means (lanes 1.., f32): the controller's
# lineage (LaneWindows.delta_lanes).
DeltaLanes = Callable[[list[RoundFrame]], Awaitable[list[RoundFrame]]]


def mean_layout(layout: LaneLayout) -> LaneLayout:
    """The layout of a delta round's means as the shards send them: its pieces summed
    into f32 (a coded tensor's piece becomes its f32 elements)."""
    schema = tuple((DTYPE_F32 if DeltaCodec.of_tag(dtype) is not None else dtype, shape)
                   for dtype, shape in layout.schema)
    return LaneLayout(schema, layout.lanes)


def _empty_pieces_f32(frame: RoundFrame) -> RoundFrame:
    """A delta round's mean lane with its empty pieces said f32 (the fold keeps an empty
    coded piece's tag: it has nothing to decode), so it is checked as f32 means."""
    tensors = [TensorPayload(DTYPE_F32, t.shape, t.data) if t.numel == 0 and DeltaCodec.of_tag(t.dtype) else t
               for t in frame.tensors]
    return RoundFrame(tensors, frame.kind, frame.weight)


def _copy_limit(layout: LaneLayout | None, with_state: bool) -> int:
    """The longest record a shard may send its controller while a copy is due: a lane,
    or with the state, a lane's state (f32, twice the pieces)."""
    if layout is None:
        return SMALL_MESSAGE
    longest = layout.max_frame_bytes
    if with_state:
        longest = max(longest, *(lane_state_bytes(layout, k) for k in range(1, layout.count)))
    return SMALL_MESSAGE + longest


@attrs.frozen
class Seat:
    """A relay in a decision: its seat here, and its name to the shards (its lowest rank)."""

    id: int
    lowest_rank: int


class ShardSet:
    """The shards' connections, which are lost, and the round waiting for its commit."""

    def __init__(
        self, addresses: Sequence[tuple[str, int]], config: ControllerConfig,
        live: Callable[[int], bool], tell_relays: Callable[[RelayControlMsg], None], stats: ControllerStats,
        drop_relay: Callable[[int, str], None], connect: Connector = trio.open_tcp_stream,
        outer: ShardOuter | None = None, outage_ms: int = 0, here: ShardHere | None = None,
    ) -> None:
        self.addresses = tuple(addresses)
        self.outage_ms = outage_ms  # how long shards hold for this controller if it is lost (0: not at all)
        self._here = here  # how the controller serves the last live shard itself (None: it cannot)
        self.served_here: set[int] = set()  # the shards this controller serves itself
        self.resumed = False  # taken on from a resume record: each shard says where it is first
        self._closing = False  # the run is over
        self._used = set(self.addresses)  # every address a shard was set up at (none is set up twice)
        self.outer = outer  # how the shards step a params round's lanes (None: no outer optimizer)
        self._config = config
        self._live = live  # whether a relay is still connected with a live rank
        self._tell_relays = tell_relays
        self._stats = stats
        self._drop_relay = drop_relay  # (lowest rank, why): a relay a shard refused
        self._connect = connect
        self.conns: dict[int, MessageStream] = {}
        self._nursery: trio.Nursery | None = None
        self._locks: dict[int, trio.Lock] = {}
        self.lost: dict[int, str] = {}  # shard -> why
        self.decisions = 0  # numbers given so far
        self.rounds = 0  # rounds decided so far (a round decided again counts once)
        self._changed = ChangeSignal()
        self._hosts: list[Seat] = []  # the pending decision's
        self._lanes_in: set[int] = set()  # seats that sent LanesIn for the pending decision
        self._pending: int | None = None
        self._again = False  # the pending decision must be made again
        # A copy of the pending decision's lanes, when it asked for one (else None), and
        # with copy 2 each lane's outer state, which follows that lane from its shard.
        self._copy: dict[int, RoundFrame] | None = None
        self._copy_layout: LaneLayout | None = None
        self._states: dict[int, LaneState] | None = None
        self._state_due: dict[int, int] = {}  # shard -> the lane whose state comes next from it
        self._copy_limit = SMALL_MESSAGE  # the longest record a shard may send here now
        self._marks: dict[int, int] = {}  # shard -> the decision its copy lanes are of (Decided)
        # A stepped decision commits once every live shard mirrored its predecessors' lanes
        # (docs/wire.md, "The outer state through a lost shard"):
        self._mirror_due = False
        self._mirrored: set[int] = set()  # shards that said Mirrored for the pending decision
        self._hosts_final = False  # a delta round's means are in: a relay lost now is not decided out
        self._means = False  # the pending decision's copy is a delta round's means
        self._telling = 0  # lost shards the live ones are being told of (no decision meanwhile)

    def _record(self, msg: RelayControlMsg) -> EncodedFrame:
        return encode_mux_record(MuxKind.CONTROL, encode_control_msg(msg), self._config.salt)

    async def dial(self) -> None:
        """Tell each reduction shard which it is, all at once. One that cannot be reached
        within the connect bounds is lost from the start (relays are told at their
        HelloAck); none reachable is an error."""
        async with trio.open_nursery() as nursery:
            for index, address in enumerate(self.addresses):
                if index not in self.lost:
                    nursery.start_soon(self._dial_one, index, address)
        if len(self.lost) == len(self.addresses):
            why = "; ".join(f"shard {i}: {why}" for i, why in sorted(self.lost.items()))
            if self._here is None:
                raise FlodlError(f"controller: none of the {len(self.addresses)} shards could be reached: {why}")
            index = min(self.lost)
            del self.lost[index]
            self.decisions += DECISIONS_AFTER_A_NEW_SHARD  # (relays may have marks of a lost controller's)
            await self._serve_here(index, f"no shard could be reached ({why})")

    async def _dial_one(self, index: int, address: tuple[str, int]) -> None:
        try:
            if self.resumed:
                conn = await self._take_on_again(index, address)
            else:
                conn = await self._set_up(index, address)
        except (ConnectFailed, ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            log.warning("controller: shard %d at %s:%d lost from the start: %s", index, *address, exc)
            self.lost[index] = f"unreachable at the start ({exc})"
            self._stats.shards_lost += 1
            return
        self.conns[index] = conn
        self._locks[index] = trio.Lock()

    def resume(self, lost: Sequence[int], rounds: int, decisions: int) -> None:
        """Take the shards on where the resume record left them: the same shards (the
        addresses this set was made with), lost ones, and rounds; decisions are numbered
        above the record's and above the newest any shard says it was given."""
        self.resumed = True
        self.lost = {index: "lost before this controller was started again" for index in lost}
        self.rounds, self.decisions = rounds, decisions

    async def _take_on_again(self, index: int, address: tuple[str, int]) -> MessageStream:
        """A shard of the record set up again: one dial, and its word, within half the
        handshake bound. A shard that holds for this controller is listening; relays
        redialing meanwhile wait for their HelloAck within the handshake bound, so a
        shard that is gone must not hold up the start."""
        with trio.fail_after(self._config.bounds.handshake / 2):
            conn = await self._set_up(index, address, attempts=1)
            try:
                await self._take_where_it_is(index, conn)
            except BaseException:
                await conn.aclose()
                raise
        return conn

    async def _take_where_it_is(self, index: int, conn: MessageStream) -> None:
        """A shard taken on again says first the newest decision it was given (``Decided``);
        a shard that says anything else was started anew, holds nothing of this run, and
        is lost (ProtocolError)."""
        header = await conn.receive_mux_header(SMALL_MESSAGE)
        if header is None:
            raise ProtocolError(f"shard {index} closed the connection when taken on again")
        kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), self._config.salt)
        msg = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
        if not isinstance(msg, Decided):
            raise ProtocolError(f"shard {index} holds nothing of this run (its first word was {msg or kind.name}, "
                                "not the newest decision it was given): it was started anew")
        self.decisions = max(self.decisions, msg.decision + 1)

    async def close_cleanly(self) -> None:
        """The run is over: shards told not to hold for this controller, then closed."""
        self._closing = True  # (their connections ending is no loss now)
        if self.outage_ms > 0:
            await self._tell_shards(Outage(0))
        await self.aclose()

    async def _set_up(
        self, index: int, address: tuple[str, int], attempts: int | None = None, again: bool = False,
    ) -> MessageStream:
        """Dial the shard at ``address`` (``attempts``: at most that many tries) and say it is
        shard ``index``: its setup, the outer step, and the shards already lost (all in one write);
        ``again``: it serves a lost shard again, and is told so (its lanes' state is handed to it)."""
        host, port = address
        bounds = self._config.bounds if attempts is None else attrs.evolve(self._config.bounds, connect_attempts=attempts)
        stream = await connect_with_retry(host, port, f"controller: shard {index}", bounds, self._connect)
        conn = MessageStream(stream, f"shard {index} {host}:{port}", self._config.bounds)
        heartbeat_ms = max(1, round(self._config.bounds.heartbeat_timeout * 1000))
        setup: list[RelayControlMsg] = [ShardSetup(index, len(self.addresses), heartbeat_ms)]
        if self.outer is not None:
            setup += [self.outer, Shards(self.addresses_for(conn))]  # (where its backup is)
        if self.outage_ms > 0:
            setup.append(Outage(self.outage_ms))  # hold for a controller started again (docs/wire.md)
        setup += [ShardLost(lost) for lost in sorted(self.lost) if lost != index]
        if again and self.outer is not None:
            setup.append(ShardBack(index, host, port))
        records = [self._record(msg) for msg in setup]
        await conn.send_chunks([CHANNEL_MAGIC_SHARD.to_bytes(4, "little"), *(c for r in records for c in r.chunks)])
        return conn

    def addresses_for(self, conn: MessageStream) -> list[tuple[str, int]]:
        """Every shard's address as the peer on ``conn`` (a relay, a shard) reaches it."""
        return [self.address_for(index, conn) for index in range(len(self.addresses))]

    def address_for(self, index: int, conn: MessageStream) -> tuple[str, int]:
        """Shard ``index``'s address as the peer on ``conn`` reaches it. A shard on this
        controller's host - one it serves itself, or one a relay beside it offered at a
        loopback address (that relay reaches the controller over loopback) - is at the
        address that connection has here; any other, where it was offered or named."""
        here = local_host(conn.stream)
        if here and index in self.served_here:
            return here, self.addresses[index][1]
        return self._address_as(self.addresses[index], conn)

    async def serve_again(self, address: tuple[str, int]) -> int | None:
        """A relay offers a shard at ``address`` while some are lost (a host brought back):
        it becomes the lowest lost shard, and the live shards are told (``ShardBack``).
        Only between rounds (the caller's commit): every relay takes it for its next round.
        None - nothing taken - when no shard is lost, a shard was set up at ``address``
        before (live, or lost: a shard that comes back holds a state nobody follows), or it
        cannot be reached within the connect bounds."""
        if not self.lost or address in self._used:
            return None
        self._used.add(address)
        index = min(self.lost)
        try:
            conn = await self._set_up(index, address, again=True)
        except (ConnectFailed, *CONNECTION_LOST) as exc:
            log.warning("controller: the offered shard at %s:%d could not serve shard %d: %s", *address, index, exc)
            return None
        for other, other_conn in list(self.conns.items()):  # (the new one knows)
            await self._tell_shard(other, ShardBack(index, *self._address_as(address, other_conn)))
        del self.lost[index]
        self._install(index, address, conn)
        self._stats.shards_served_again += 1
        log.info("controller: shard %d is served again, at %s:%d", index, *address)
        return index

    async def serve_standby_here(self) -> int | None:
        """One shard left live, and a way to serve one here: the lowest lost shard is served
        again by the controller itself (between rounds, as a relay's offer is), so the last
        live shard has a backup - its lanes' outer state outlives it - and shares the lanes.
        The shard's index, or None: nothing to do (the one left is served here already:
        a standby in the same process would back nothing up), or it could not be set up."""
        if self._here is None or len(self.conns) != 1 or not self.lost or set(self.conns) <= self.served_here:
            return None
        try:
            address = await self._here.start()
        except FlodlError as exc:
            log.warning("controller: no standby shard served here: %s", exc)
            return None
        index = await self.serve_again(address)
        if index is not None:
            self.served_here.add(index)
            self._here.ports[index] = address[1]
            self._stats.shards_served_here += 1
            log.info("controller: one shard left live; the controller serves shard %d beside it", index)
        return index

    def start_watching(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        for index in list(self.conns):
            nursery.start_soon(self._watch, index)

    def reported_lost(self, shard: int, relay: str, why: str | None = None) -> None:
        """A relay's connection to ``shard`` failed (closed, silent, or bytes that broke
        the protocol): the shard is lost for everyone, as a shard that cannot serve every
        relay cannot reduce its lanes - unless it is the last live one (ProtocolError:
        the relay is dropped instead)."""
        if not 0 <= shard < len(self.addresses):
            raise ProtocolError(f"said shard {shard} is lost; there are {len(self.addresses)}")
        if shard in self.served_here:
            # This process serves it: up while the controller is (its own watcher sees it end).
            # Such a word is of the shard it replaced (a relay says again, after a new
            # connection, what it found lost), or the relay's alone to bear.
            return log.info("controller: %s says shard %d is lost; it is served here, and is not", relay, shard)
        if shard not in self.lost and len(self.lost) == len(self.addresses) - 1 and self._here is None:
            # The last live shard is lost only on the controller's own evidence: one relay's
            # word would stop the run, so the relay that cannot reach it is the one dropped.
            raise ProtocolError(f"said shard {shard}, the last live one, is lost; its connection here is fine, so "
                                "this relay is dropped, not the shard")
        if shard not in self.lost and self._nursery is not None:
            self._nursery.start_soon(self._lose_reported, shard, self.conns.get(shard),
                                     why or f"{relay} lost its connection to it")

    async def _lose_reported(self, index: int, conn: MessageStream | None, why: str) -> None:
        """A relay's word that shard ``index`` is lost, of the connection it had then: not
        of one set up since (the shard moved here or was served again meanwhile)."""
        if conn is not None and self.conns.get(index) is conn:
            await self._lose(index, why)

    async def aclose(self) -> None:
        for conn in self.conns.values():
            await conn.aclose()  # a shard ends with its controller

    def status(self) -> dict[str, object]:
        """For the status page: each shard's address, which are lost (and why), and which
        this controller serves itself."""
        return {
            "addresses": [f"{host}:{port}" for host, port in self.addresses],
            "lost": {str(index): why for index, why in sorted(self.lost.items())},
            "served_here": sorted(self.served_here),
        }

    def told_at_hello(self) -> list[RelayControlMsg]:
        """What a relay seated now must know: the shards already lost."""
        return [ShardLost(index) for index in sorted(self.lost)]

    # -- a shard's liveness ------------------------------------------------------

    async def _watch(self, index: int) -> None:
        """A shard's heartbeats; none for a heartbeat timeout, or its connection
        ending, and it is lost."""
        conn = self.conns[index]
        bound = self._config.bounds.heartbeat_timeout
        buf = ReceiveBuffer()
        why = "it closed its connection"
        try:
            while True:
                with trio.move_on_after(bound) as waited:
                    header = await conn.receive_mux_header(self._config.ceiling)
                    if header is None:
                        break
                    self._check_length(index, header.length)
                    kind, payload = await conn.receive_mux_payload(header, buf, self._config.salt)
                if waited.cancelled_caught:
                    why = f"nothing from it for the heartbeat timeout ({bound:g} s): frozen, or cut off"
                    break
                if kind is MuxKind.BROADCAST:
                    self._copy_lane(index, decode_round_frame(
                        bytes(payload), self._config.salt, ceiling=self._config.ceiling, source=f"shard {index}",
                        authenticated=True,
                    ))
                    if len(payload) > SMALL_MESSAGE:
                        buf = ReceiveBuffer()  # a copy's lane buffer is not kept between copies
                    continue
                msg = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
                if isinstance(msg, PieceRefused):
                    self._drop_relay(msg.host, f"shard {index} refused its piece: {msg.reason}")
                elif isinstance(msg, Decided):
                    self._marks[index] = msg.decision
                elif isinstance(msg, Mirrored):
                    if msg.decision == self._pending:
                        self._mirrored.add(index)
                        self._changed.notify()
                elif isinstance(msg, ShardLost):  # it cannot mirror to its backup, or its backup to it
                    if msg.shard in self.served_here:  # (up while this controller is: the fault is the sender's)
                        raise ProtocolError(f"shard {index} cannot mirror to shard {msg.shard}, which the "
                                            "controller serves")
                    self.reported_lost(msg.shard, f"shard {index}",
                                       f"shard {index} says the mirror connection between them failed")
                elif not isinstance(msg, ShardAlive):
                    raise ProtocolError(f"shard {index} sent the controller {msg or kind.name}, not ShardAlive")
        except (ProtocolError, *CONNECTION_LOST) as exc:
            why = str(exc)
        if self.conns.get(index) is conn:  # (not one that was replaced meanwhile)
            await self._lose(index, why)

    def _check_length(self, index: int, length: int) -> None:
        """A record longer than a control message only while a copy is due, and never
        longer than the copy's largest lane could be (no untrusted allocation)."""
        limit = self._copy_limit
        if length > limit:
            raise ProtocolError(f"shard {index} sent a {length}-byte record where at most {limit} bytes could be due")

    def _copy_lane(self, index: int, frame: RoundFrame) -> None:
        """A lane of a copy: kept if it is of the pending decision (an older one's are
        late, and dropped), owned by the shard that sent it, and what the schema says;
        with copy 2, the record after it is its outer state."""
        tag = read_lane_tag(frame)
        copy, layout = self._copy, self._copy_layout
        if self._marks.get(index) != self._pending or copy is None or layout is None:
            self._state_due.pop(index, None)
            return  # of a decision made again since
        if index in self._state_due:
            lane = self._state_due.pop(index)
            return None if lane < 0 else self._copy_state(index, frame, layout, lane)
        if tag is None or not 1 <= tag.index < layout.count or tag.count != layout.count:
            raise ProtocolError(f"shard {index} sent the controller lane tag {tag} in a round of {layout.count} lanes")
        owner = lane_owner(tag.index, len(self.addresses), self.lost)
        if owner != index:
            # It knows of a lost shard this controller does not yet (a relay told it): the
            # lane is taken from the decision made once this controller knows too.
            log.info("controller: shard %d sent lane %d, shard %s's here; not taken", index, tag.index, owner)
            if self._states is not None:
                self._state_due[index] = -1  # (its state, next, is not taken either)
            return
        if tag.index in copy:
            raise ProtocolError(f"shard {index} sent the controller lane {tag.index} twice")
        layout.check_lane(tag.index, _empty_pieces_f32(frame) if self._means else frame)
        copy[tag.index] = frame
        if self._states is not None:
            self._state_due[index] = tag.index
        self._changed.notify()

    def _copy_state(self, index: int, frame: RoundFrame, layout: LaneLayout, lane: int) -> None:
        """Lane ``lane``'s outer state, right after the lane: its tag and shapes checked."""
        assert self._states is not None
        tag = read_lane_tag(frame)
        if tag is None or tag.index != lane or tag.count != layout.count:
            raise ProtocolError(f"shard {index} sent lane tag {tag} where lane {lane}'s outer state was due")
        try:
            self._states[lane] = read_lane_state(frame, layout, lane)
        except SchemaError as exc:
            raise ProtocolError(f"shard {index}: {exc}") from None
        self._changed.notify()

    async def _lose(self, index: int, why: str) -> None:
        if index in self.lost or self._closing or index not in self.conns:
            return
        if len(self.lost) == len(self.addresses) - 1 and self._here is not None:
            return await self._move_here(index, why)
        self.lost[index] = why
        self.served_here.discard(index)
        self._stats.shards_lost += 1
        conn = self.conns.pop(index)
        await self._let_go(index, conn)  # its watcher ends too (and finds it lost already)
        if len(self.lost) == len(self.addresses):
            raise FlodlError(f"controller: every one of the {len(self.addresses)} shards is lost "
                             f"(shard {index}: {why})")
        log.warning("controller: shard %d lost (%s); its lanes go to the next live shard", index, why)
        if self._pending is not None:
            self._again = True
        self._tell_relays(ShardLost(index))
        # Every shard knows before the round is decided again (``decide`` waits): the new
        # owners then take a delta round's consensus lanes as theirs ("Delta rounds
        # through the shards").
        self._telling += 1
        try:
            await self._tell_shards(ShardLost(index))
        finally:
            self._telling -= 1
            self._changed.notify()

    async def _move_here(self, index: int, why: str) -> None:
        """The last live shard is lost: the controller serves it itself from now on, rather
        than stop the run (docs/wire.md, "When every shard is lost"). The round in progress
        is decided again; every relay sends the new shard its lanes of it."""
        log.warning("controller: shard %d, the last live one, is lost (%s); the controller serves it itself", index, why)
        self._stats.shards_lost += 1
        old = self.conns.pop(index)
        await self._let_go(index, old)
        await self._serve_here(index, why)
        if self._pending is not None:
            self._again = True
        self._changed.notify()

    async def _serve_here(self, index: int, why: str) -> None:
        """Shard ``index`` served by a shard of the controller's own, set up, watched, and
        told to every relay (``ShardMoved``)."""
        assert self._here is not None
        address = await self._here.start()
        port = address[1]
        conn = await self._set_up(index, address)
        self._used.add(address)
        self._install(index, address, conn)
        self.served_here.add(index)
        self._stats.shards_served_here += 1
        self._here.tell_relays(index, port)
        log.info("controller: shard %d is served by the controller, on port %d (%s)", index, port, why)

    def _install(self, index: int, address: tuple[str, int], conn: MessageStream) -> None:
        """A shard set up anew as ``index`` at ``address``: its connection, lock and watcher."""
        self.addresses = (*self.addresses[:index], address, *self.addresses[index + 1:])
        self.conns[index], self._locks[index] = conn, trio.Lock()
        self._marks.pop(index, None)
        if self._nursery is not None:
            self._nursery.start_soon(self._watch, index)

    async def _let_go(self, index: int, conn: MessageStream) -> None:
        """Close a lost shard's connection; one told to hold for this controller is told
        first not to, if that costs no wait (a shard still running then ends now, not
        after the outage bound; a frozen one whose socket is full is not waited for)."""
        lock = self._locks[index]
        if self.outage_ms > 0 and not lock.locked():
            with trio.move_on_after(LET_GO_S), contextlib.suppress(*CONNECTION_LOST, trio.ClosedResourceError):
                async with lock:
                    await conn.send_chunks(self._record(Outage(0)).chunks)
        await conn.aclose()

    async def _tell_shards(self, msg: RelayControlMsg) -> None:
        for index in list(self.conns):
            await self._tell_shard(index, msg)

    async def _tell_shard(self, index: int, msg: RelayControlMsg) -> None:
        await self._send_records(index, [self._record(msg)])

    async def _send_records(self, index: int, records: Sequence[EncodedFrame]) -> None:
        """``records`` to shard ``index``, one after another with nothing between them."""
        conn = self.conns.get(index)
        if conn is None:
            return
        try:
            async with self._locks[index]:
                for record in records:
                    await conn.send_chunks(record.chunks)
        except (*CONNECTION_LOST, trio.ClosedResourceError):
            pass  # its watcher sees the end and loses it

    @staticmethod
    def _address_as(address: tuple[str, int], conn: MessageStream) -> tuple[str, int]:
        """An offered ``address`` as the peer on ``conn`` reaches it (see ``address_for``)."""
        here = local_host(conn.stream)
        return (here, address[1]) if here and is_loopback(address[0]) else address

    # -- a round's decision and commit -------------------------------------------

    async def decide(
        self, hosts: Sequence[Seat], targets: Sequence[Seat], lanes: int, schema: Sequence[tuple[int, tuple[int, ...]]],
        *, copy: int = COPY_NONE, step: bool = False, fragment: FragmentTag | None = None,
        produce: DeltaLanes | None = None, seeds: Mapping[int, LaneState] | None = None,
    ) -> Committed:
        """Decide the round (hosts: its contributors) until every live target holds the
        decision's lanes: the seats of the targets to send lane 0 to, the commit, and
        with ``copy`` the decision's lanes 1.. as the shards sent them (and with
        ``COPY_WITH_STATE`` of a stepped round, each lane's outer state).

        A round is decided from the live relays only, and decided again when a shard or
        a decided relay is lost before the commit: a lost relay's pieces may never reach
        the shards (lane 0 goes up first), or may have been only on the lost shard.
        ``step``: a params round, whose lanes the shards step (``fragment``'s state).

        ``produce``: a delta round (docs/wire.md, "Delta rounds through the shards"): the
        shards send their lanes' means here, ``produce`` turns them into the consensus
        lanes once, and each goes to the shard that fans it out. From then on the round's
        contributors are fixed (the means hold every one): it is decided again only when
        a shard is lost, and the new owner is sent the same lanes.

        ``seeds``: a stepped round's lane states (lane -> state) from the controller's own
        optimizer, each sent before the decision to the shard that owns the lane, which
        starts from it if no shard holds that lane's state (docs/wire.md, "Seeding the
        shards' outer state")."""
        hosts = sorted(hosts, key=lambda seat: seat.lowest_rank)
        round_ = self.rounds
        self.rounds += 1
        layout = LaneLayout.for_schema(schema, lanes, lane0_empty=True) if copy or produce else None
        if produce is not None:
            assert layout is not None and not copy and not step
            layout = mean_layout(layout)
        with_state = copy == COPY_WITH_STATE and step
        copied: list[RoundFrame] | None = None
        states: list[LaneState] | None = None
        produced: list[EncodedFrame] | None = None
        self._hosts_final = False
        while True:
            while self._telling:  # (a lost shard is told to every live one first)
                await self._changed.wait()
            if not self._hosts_final:
                hosts = [seat for seat in hosts if self._live(seat.id)]
            live_targets = [seat for seat in targets if self._live(seat.id)]
            if not hosts or not live_targets:
                break  # nobody left to sum, or to send to
            self._pending, self._hosts, self._lanes_in, self._again = self.decisions, hosts, set(), False
            self._mirror_due, self._mirrored = step and self.outer is not None, set()
            self._copy, self._copy_layout = ({}, layout) if copy or (produce and produced is None) else (None, None)
            self._means = produce is not None
            self._states, self._state_due = ({} if with_state else None), {}
            self._copy_limit = _copy_limit(layout, with_state)
            self.decisions += 1
            lost = set(self.lost)  # as every shard knows it at this decision
            await self._tell_decision(Decide(
                self._pending, round_, lanes, schema, [seat.lowest_rank for seat in hosts],
                sorted(seat.lowest_rank for seat in live_targets), copy,
                step, None if fragment is None else (fragment.index, fragment.count),
            ), seeds if step else None, lost)
            if produce is not None and produced is None:
                if not await self._copied():
                    self._stats.decisions_again += 1
                    continue
                assert self._copy is not None
                means = [self._copy[lane] for lane in range(1, lanes)]
                self._copy, self._hosts_final = None, True
                produced = [await encode_enveloped_frame(MuxKind.BROADCAST, frame, self._config.salt, frame_mac=False)
                            for frame in await produce(means)]
                self._stats.delta_rounds_sharded += 1
            if produced is not None:
                await self._send_down(produced, lost)
            if await self._committed(live_targets):
                if self._copy is not None:
                    copied = [self._copy[lane] for lane in range(1, lanes)]
                    self._stats.rounds_copied += 1
                if self._states is not None:
                    states = [self._states[lane] for lane in range(1, lanes)]
                break
            self._stats.decisions_again += 1
        self._pending, self._copy, self._copy_layout, self._states = None, None, None, None
        self._copy_limit, self._hosts_final = SMALL_MESSAGE, False
        return Committed([seat.id for seat in targets if self._live(seat.id)], copied, states)

    async def _tell_decision(self, decide: Decide, seeds: Mapping[int, LaneState] | None, lost: set[int]) -> None:
        """``decide`` to every live shard, each one's ``Seed`` and lane states (of the lanes
        it owns under ``lost``) right before it in the same write."""
        for index in list(self.conns):
            owned = {} if not seeds else {
                lane: state for lane, state in seeds.items() if lane_owner(lane, len(self.addresses), lost) == index}
            records = [self._record(Seed(decide.decision, len(owned)))] if owned else []
            self._stats.lanes_seeded += len(owned)
            for lane, state in owned.items():
                records.append(await encode_enveloped_frame(
                    MuxKind.BROADCAST, state_frame(lane, decide.lanes, state), self._config.salt, frame_mac=False))
            await self._send_records(index, [*records, self._record(decide)])

    async def _copied(self) -> bool:
        """Wait for every lane of the pending decision's copy (True), or until the decision
        must be made again (False)."""
        while not self._again:
            if self._copy is not None and self._copy_layout is not None and \
                    len(self._copy) == self._copy_layout.count - 1:
                return True
            await self._changed.wait()
        return False

    async def _send_down(self, lanes: Sequence[EncodedFrame], lost: Collection[int]) -> None:
        """A delta round's consensus lanes, each to the shard that owns it as the decision
        was made (``lost``: every shard was told of those, before the decision; one lost
        since is sent its lanes with the decision made again)."""
        for lane, record in enumerate(lanes, 1):
            owner = lane_owner(lane, len(self.addresses), lost)
            conn = self.conns.get(owner) if owner is not None else None
            if owner is None or conn is None:
                continue  # lost meanwhile: the decision is made again
            try:
                async with self._locks[owner]:
                    await conn.send_chunks(record.chunks)
            except (*CONNECTION_LOST, trio.ClosedResourceError):
                pass  # its watcher sees the end and loses it

    async def _committed(self, targets: Sequence[Seat]) -> bool:
        """Wait for every live target's LanesIn and the copy's every lane, if one is due
        (True), or until the decision must be made again (False)."""
        while True:
            if self._again:
                return False
            layout = self._copy_layout
            copied = self._copy is None or layout is None or (
                len(self._copy) == layout.count - 1 and (self._states is None or len(self._states) == layout.count - 1)
            )
            mirrored = not self._mirror_due or len(self.conns) < 2 or self._mirrored.issuperset(self.conns)
            if copied and mirrored and all(seat.id in self._lanes_in or not self._live(seat.id) for seat in targets):
                return True
            await self._changed.wait()

    def lanes_in(self, seat_id: int, decision: int) -> None:
        """A relay holds every shard's lane of ``decision``."""
        if decision == self._pending:
            self._lanes_in.add(seat_id)
            self._changed.notify()

    def relays_changed(self) -> None:
        """A relay left, or its last rank died: it is waited for no longer, and if it was
        decided in, the round is decided again without it."""
        if self._pending is not None and not self._hosts_final and any(not self._live(seat.id) for seat in self._hosts):
            self._again = True
        self._changed.notify()


__all__ = ["Committed", "HereOnListener", "LaneState", "Seat", "ShardHere", "ShardServer", "ShardSet"]
