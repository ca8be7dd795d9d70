"""A shard's outer state, mirrored to the shard that would take its lanes over.

Lane k's owner is the first live shard from (k - 1) mod S on; if it is lost, the
next live one after it takes its lanes - its **backup**. So each shard, as it
steps a lane, sends its backup the lane divided but not yet stepped (the round's
bytes of that lane, in the round's dtype), and the backup steps a mirror of the
same state with the same math. A shard that takes a lost shard's lanes over starts
them from its mirror, and the run goes on with the bytes a single controller would
send (docs/wire.md, "The outer state through a lost shard").

Task structure (one mirror connection per owner, to its current backup)::

    owner:  decider --Mirror{shard, decision, start} [+ lane state] + lane--> MirrorLink.outbox
            MirrorLink.run: dial the backup, write the outbox; a backup it cannot reach
                            or write to is reported to the controller (ShardLost)
    backup: route --CHANNEL_MAGIC_MIRROR--> read records --> MirrorBook: each lane of the
            latest decision stepped on the mirror; all of them in -> Mirrored{decision}

The controller commits a stepped round only once every live shard said ``Mirrored``
for its decision, so a backup never misses a committed step.

A shard served again (``ShardBack``) starts with no state: the shard that held its
lanes meanwhile hands it their state (``Handoff`` + a lane state, then ``HandedBack``)
on a mirror connection, and it steps none of them before that (``Handback``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import attrs
import trio

from ..errors import ProtocolError, SchemaError
from ..fold.outer import F32Array, LaneKey, ShardLanesOuter, lane_key, lane_state_frame, read_lane_state, state_frame
from ..transport.connect import Connector, connect_with_retry
from ..transport.hashing import encode_enveloped_frame
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..wire.constants import CHANNEL_MAGIC_MIRROR
from ..wire.fragment import FragmentTag
from ..wire.lanes import MAX_LANES, LaneLayout, lane_owner, read_lane_tag
from ..wire.mux import Decide, HandedBack, Handoff, Mirror, MuxKind, encode_control_msg, encode_mux_record
from ..wire.round_frame import EncodedFrame, RoundFrame
from ..wire.salt import SessionSalt

log = logging.getLogger("flodl_trio.shard")

LaneState = tuple[list[F32Array], list[F32Array]]

# Mirror.start: how the lane's step at the backup starts.
START_MIRRORED = 0  # from the backup's own mirror (it stepped every earlier round of the lane)
START_SENT = 1  # from the lane state record that follows (a new backup, or lanes taken over)
START_AFRESH = 2  # from nothing: the lane's first params window (its step only starts its state)

# Lanes of decisions the backup has not been told of yet that it keeps (a decision's
# Decide may come after its first mirrored lanes): at most two decisions' worth.
_EARLY_LIMIT = 2 * MAX_LANES
# Records an owner's mirror writer may lag behind before its backup counts as not reading:
# up to 3 a lane (Mirror, a state, the lane), every lane of a few decisions (a round decided
# again while the last decision's mirror is still going out).
_OUTBOX_DEPTH = 12 * MAX_LANES


def backup_of(shard: int, count: int, lost: set[int]) -> int | None:
    """The shard that takes ``shard``'s lanes over if it is lost: the next live one after
    it, cyclically (None: it is the only live one)."""
    for step in range(1, count):
        other = (shard + step) % count
        if other not in lost:
            return other
    return None


class MirrorLink:
    """An owner's connection to its backup: the records to send, which lanes' state the
    backup holds, and the task that dials and writes."""

    def __init__(self, backup: int, address: tuple[str, int], owner: int) -> None:
        self.backup = backup
        self.address = address
        self.owner = owner
        self.seeded: set[LaneKey] = set()  # lane keys whose state the backup holds
        self.broken = False
        self._send, self._receive = trio.open_memory_channel[EncodedFrame](_OUTBOX_DEPTH)
        self.scope = trio.CancelScope()

    def queue(self, records: list[EncodedFrame]) -> bool:
        """False if the backup reads too slowly to keep (the caller reports it)."""
        if self.broken:
            return True
        try:
            for record in records:
                self._send.send_nowait(record)
        except trio.WouldBlock:
            return False
        return True

    def close(self) -> None:
        self.broken = True
        self.scope.cancel()

    async def run(self, bounds: NetBounds, connect: Connector, report: Callable[[str], None]) -> None:
        """Dial the backup and write what is queued, until closed; ``report(why)`` once if
        the backup cannot be reached or written to."""
        with self.scope:
            try:
                conn = await dial_mirror(self.address, f"shard {self.owner}: its backup, shard {self.backup}",
                                         f"shard {self.backup} (backup)", bounds, connect)
                try:
                    async for record in self._receive:
                        await conn.send_chunks(record.chunks)
                finally:
                    await conn.aclose()
            except (OSError, *CONNECTION_LOST) as exc:
                self.broken = True
                report(f"its mirror connection failed: {exc}")
            except ProtocolError as exc:  # (ConnectFailed is one)
                self.broken = True
                report(str(exc))


async def dial_mirror(
    address: tuple[str, int], what: str, peer: str, bounds: NetBounds, connect: Connector,
) -> MessageStream:
    """A mirror connection to the shard at ``address``, its channel magic sent."""
    stream = await connect_with_retry(*address, what, bounds, connect)
    conn = MessageStream(stream, peer, bounds)
    try:
        await conn.send_chunks([CHANNEL_MAGIC_MIRROR.to_bytes(4, "little")])
    except BaseException:
        await conn.aclose()
        raise
    return conn


@attrs.define
class MirrorLane:
    """One mirrored lane as it came: its decision, where its step starts, and its bytes."""

    shard: int
    decision: int
    start: int
    state: RoundFrame | None
    mean: RoundFrame


class MirrorBook:
    """A backup's side: the mirror of its predecessors' lane state, stepped as they step."""

    def __init__(self, outer: ShardLanesOuter) -> None:
        self.outer = outer
        self._early: list[MirrorLane] = []  # lanes of decisions not decided here yet
        self._decision: Decide | None = None  # the latest decision this shard was told of
        self._done: set[int] = set()  # its lanes stepped on the mirror
        self._said: int | None = None  # the decision Mirrored was said for
        self._from: dict[LaneKey, int] = {}  # each mirrored lane's owner

    def decided(self, msg: Decide) -> list[MirrorLane]:
        """A new decision: the lanes that came early for it, to step now."""
        if self._decision is None or msg.decision != self._decision.decision:
            self._decision, self._done = msg, set()
        ready = [lane for lane in self._early if lane.decision == msg.decision]
        self._early = [lane for lane in self._early if lane.decision > msg.decision]
        return ready

    def arrived(self, lane: MirrorLane) -> bool:
        """True if ``lane`` is of the latest decision (step it now); an older one's is
        dropped, a newer one's kept until its decision comes."""
        latest = -1 if self._decision is None else self._decision.decision
        if lane.decision == latest:
            return True
        if lane.decision > latest:
            if len(self._early) >= _EARLY_LIMIT:
                raise ProtocolError(f"sent lanes of {len(self._early) + 1} decisions this shard was not told of")
            self._early.append(lane)
        return False

    def step(self, lane: MirrorLane, me: int, count: int, lost: set[int]) -> LaneKey | None:
        """Step the mirror of ``lane`` (of the latest decision), if it is a lane this shard
        backs up under the lost set it knows (another view is a passing one: the round
        is decided again): the lane's key, or None if it was not stepped."""
        msg = self._decision
        assert msg is not None and lane.decision == msg.decision
        layout = decision_layout(msg)
        tag = read_lane_tag(lane.mean)
        if tag is None or not 1 <= tag.index < layout.count or tag.count != layout.count:
            raise ProtocolError(f"mirrored lane tag {tag} in a round of {layout.count} lanes")
        owner = lane_owner(tag.index, count, lost)
        if owner != lane.shard or backup_of(owner, count, lost) != me:
            log.info("shard %d: a mirror of lane %d from shard %d, which it does not back up now; ignored",
                     me, tag.index, lane.shard)
            return None
        fragment = None if msg.fragment is None else FragmentTag(*msg.fragment)
        try:
            layout.check_lane(tag.index, lane.mean)
            if lane.start == START_SENT:
                assert lane.state is not None
                self.outer.adopt(msg.round, layout, tag.index, fragment, read_lane_state(lane.state, layout, tag.index))
            elif lane.start == START_AFRESH:
                self.outer.forget(layout, tag.index, fragment)
        except SchemaError as exc:
            raise ProtocolError(f"mirrored lane {tag.index}: {exc}") from None
        self.outer.step(msg.round, lane.mean, layout, tag.index, fragment)
        key = lane_key(layout, tag.index, fragment)
        self._from[key] = lane.shard
        self._done.add(tag.index)
        return key

    def backups_changed(self, me: int, count: int, lost: set[int]) -> None:
        """The lost set changed: the mirror of a shard this one no longer backs up goes
        (its new backup is sent its state; a stale copy here must never be taken)."""
        for key, owner in list(self._from.items()):
            if backup_of(owner, count, lost) != me:
                self.outer.forget_key(key)
                del self._from[key]

    def held(self) -> dict[LaneKey, LaneState]:
        return self.outer.held()

    def due(self, me: int, count: int, lost: set[int]) -> int | None:
        """The decision to say ``Mirrored`` for now: the latest, stepped, once every lane
        this shard backs up in it is stepped here (None: not yet, or said)."""
        msg = self._decision
        if msg is None or not msg.step or self._said == msg.decision:
            return None
        for lane in range(1, msg.lanes):
            owner = lane_owner(lane, count, lost)
            if owner != me and backup_of(owner, count, lost) == me and lane not in self._done:  # type: ignore[arg-type]
                return None
        self._said = msg.decision
        return msg.decision

    def take(self, round_: int, layout: LaneLayout, lane: int, fragment: FragmentTag | None) -> LaneState | None:
        """A lost shard's lane this shard steps now: its mirrored state as the round
        starts (None: none mirrored), no longer kept here."""
        state = self.outer.start_state(round_, layout, lane, fragment)
        if state is not None:
            self.outer.forget(layout, lane, fragment)
            self._from.pop(lane_key(layout, lane, fragment), None)
        return state


async def mirror_records(
    salt: SessionSalt, me: int, decision: int, mean: RoundFrame, pieces: int, start: LaneState | None, seeded: bool,
) -> list[EncodedFrame]:
    """The records that mirror one lane to the backup: ``Mirror``, the lane's state if the
    backup does not hold it (``seeded`` False), and the lane, divided, not yet stepped."""
    how = START_AFRESH if start is None else START_MIRRORED if seeded else START_SENT
    records = [encode_mux_record(MuxKind.CONTROL, encode_control_msg(Mirror(me, decision, how)), salt)]
    if how == START_SENT:
        assert start is not None
        records.append(await encode_enveloped_frame(MuxKind.BROADCAST, lane_state_frame(mean, pieces, start), salt,
                                                      frame_mac=False))
    records.append(await encode_enveloped_frame(MuxKind.BROADCAST, mean, salt, frame_mac=False))
    return records


# -- a shard served again: its lanes' state handed back ---------------------------

# Lane states a served-again shard keeps from its handback: a lane per fragment and lane.
_HANDED_LIMIT = 64 * MAX_LANES


def handback_states(
    me: int, shard: int, count: int, lost_before: set[int], lost_after: set[int], *held: dict[LaneKey, LaneState],
) -> dict[LaneKey, LaneState]:
    """The lane states this shard hands ``shard`` (served again): of every lane it owned
    and ``shard`` owns now, the first of ``held`` that has it."""
    out: dict[LaneKey, LaneState] = {}
    for states in reversed(held):  # (the first wins)
        for key, state in states.items():
            lane = key[2]
            if lane_owner(lane, count, lost_before) == me and lane_owner(lane, count, lost_after) == shard:
                out[key] = state
    return out


async def handback_records(salt: SessionSalt, me: int, states: dict[LaneKey, LaneState]) -> list[EncodedFrame]:
    """``Handoff`` and the lane's state, per lane, then ``HandedBack``."""
    records = []
    for (fragment, lanes, lane, _), (xs, ms) in states.items():
        say = Handoff(me, None if fragment is None else (fragment.index, fragment.count))
        records.append(encode_mux_record(MuxKind.CONTROL, encode_control_msg(say), salt))
        records.append(await encode_enveloped_frame(MuxKind.BROADCAST, state_frame(lane, lanes, (xs, ms)), salt,
                                                      frame_mac=False))
    records.append(encode_mux_record(MuxKind.CONTROL, encode_control_msg(HandedBack(me, len(states))), salt))
    return records


class Handback:
    """A served-again shard's side: the lane states its lanes' holder hands it, which its
    first steps of them start from; it steps no lane until the holder said it is done
    (or is lost)."""

    def __init__(self) -> None:
        self.holder: int | None = None  # the shard that held its lanes (None: not served again)
        self._states: dict[tuple[FragmentTag | None, int, int], RoundFrame] = {}
        self._done: set[int] = set()  # holders that said HandedBack

    def expect(self, holder: int | None) -> None:
        self.holder = holder

    def waiting(self, lost: set[int]) -> bool:
        """Whether a stepped lane must wait for the handback now."""
        return self.holder is not None and self.holder not in self._done and self.holder not in lost

    def keep(self, msg: Handoff, frame: RoundFrame) -> None:
        tag = read_lane_tag(frame)
        if tag is None:
            raise ProtocolError("handed a lane state with no lane tag")
        if len(self._states) >= _HANDED_LIMIT:
            raise ProtocolError(f"handed more than {_HANDED_LIMIT} lane states")
        fragment = None if msg.fragment is None else FragmentTag(*msg.fragment)
        self._states[fragment, tag.index, tag.count] = frame

    def finished(self, msg: HandedBack) -> None:
        self._done.add(msg.shard)

    def take(self, layout: LaneLayout, lane: int, fragment: FragmentTag | None) -> LaneState | None:
        """The handed state of lane ``lane`` (None: none was handed); SchemaError if it is
        not what the layout says."""
        frame = self._states.pop((fragment, lane, layout.count), None)
        return None if frame is None else read_lane_state(frame, layout, lane)


def decision_layout(msg: Decide) -> LaneLayout:
    """The round's lanes, from the schema its decision carries."""
    return _layout_of(msg.schema, msg.lanes)


@functools.lru_cache(maxsize=8)
def _layout_of(schema: tuple[tuple[int, tuple[int, ...]], ...], lanes: int) -> LaneLayout:
    return LaneLayout.for_schema(schema, lanes, lane0_empty=True)


def new_lane(msg: Mirror, state: RoundFrame | None, mean: RoundFrame) -> MirrorLane:
    return MirrorLane(msg.shard, msg.decision, msg.start, state, mean)


__all__ = [
    "Handback", "MirrorBook", "MirrorLane", "MirrorLink", "backup_of", "decision_layout", "dial_mirror",
    "handback_records", "handback_states", "mirror_records", "new_lane",
]
