"""With lanes: what the controller's windows do with a round that finishes lane by lane.

Each lane's round (:class:`~.round.ControllerRound`) knows nothing of windows:
it folds its lane and divides. This object sees their consensus in lane order
and does the per-window work a whole frame gets without lanes:

- it places the round in the windows (a Control round opens one), reading the
  round's schema, which lane 0 carries (docs/wire.md, "lanes");
- it steps each lane of a params round with the outer optimizer's
  ``step_lane`` before the lane goes out, so lane i's consensus still goes
  down while lane i + 1 comes up (the step is elementwise: the ranks get the
  bytes a whole-frame step gives them);
- it joins the lanes of a round the checkpoint sink or the joiners need into
  one frame in the model's shapes, as the ranks receive it;
- with shards it sees lane 0 alone, and a round ends at its commit: joined
  whole only when the shards sent a copy of its other lanes (a rank rejoins);
- a delta round's lanes (docs/wire.md, "Delta rounds", "In lanes") come in as
  f32 mean deltas of runs of whole blocks: each piece is added to the exact
  consensus, stepped, and coded against the ranks' base on its own (the bytes
  the whole tensor's coding gives those blocks); the last lane carries the new
  base's digest. The hooks see the exact consensus, the joiners the base.

It never awaits, so it reads and tests without trio.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from ..errors import FlodlError, ProtocolError, SchemaError
from ..fold.delta import DeltaLineage, DeltaLineages, flat_f32, is_delta_schema
from ..wire.constants import DTYPE_F32
from ..wire.fragment import FragmentTag, fragment_of
from ..wire.lanes import LaneAssembler, LaneLayout, goes_through_shards
from ..wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec
from ..wire.round_frame import RoundFrame, RoundKind, TensorPayload, decode_round_frame
from ..wire.salt import SessionSalt
from .round import CheckpointSink, Consensus, OuterOptimizer, WindowCounter, WindowPart
from .shards import Committed, LaneState

log = logging.getLogger("flodl_trio.controller")


@attrs.frozen
class LaneOut:
    """One lane's consensus to send, and - with a round's last lane - the round's place
    in the windows and, if the joiners keep it, the whole frame (unsigned); for a
    delta round, the whole coded consensus as the ranks get it (``catch_up``, unsigned:
    what brings a joiner from an older state up to the base). ``opens_round`` and
    ``ends_round``: whether it is its round's first lane, its last (a whole frame is both)."""

    consensus: Consensus
    part: WindowPart | None = None
    kept: memoryview | None = None
    catch_up: memoryview | None = None
    opens_round: bool = True
    ends_round: bool = True
    # The round's consensus joined whole (unsigned), for relays that send whole frames.
    whole: memoryview | None = None
    # With shards: the round's lanes 1.. were not copied here, so no state can be kept of it.
    not_held: bool = False


@attrs.frozen
class _DeltaRound:
    """A delta round going out lane by lane: the layout of its params alone (the
    digest's piece left out), which the outer step reads."""

    params: LaneLayout
    lineage: DeltaLineage  # the params set's (the model's, or the window's fragment's)

    @classmethod
    def of(cls, layout: LaneLayout, lineage: DeltaLineage) -> _DeltaRound:
        count = len(layout.schema) - 1
        schema = tuple((DTYPE_F32, shape) for _, shape in layout.schema[:count])
        lanes = tuple(tuple(p for p in pieces if p.tensor < count) for pieces in layout.lanes)
        return cls(LaneLayout(schema, lanes), lineage)


class LaneWindows:
    """The windows of a controller that reduces in lanes (see the module docstring)."""

    def __init__(
        self, salt: SessionSalt, outer_optimizer: OuterOptimizer | None, checkpoint: CheckpointSink | None,
        lineages: DeltaLineages | None = None,
    ) -> None:
        self.salt = salt
        # Delta rounds: per params set, the exact consensus and the ranks' base (shared
        # with the lane rounds, which check each relay's digest against it).
        self.lineages = lineages if lineages is not None else DeltaLineages()
        self._delta: _DeltaRound | None = None
        self.outer_optimizer = outer_optimizer
        self.checkpoint = checkpoint
        self.counter = WindowCounter()
        self.keep_window_state = False  # whether params and buffers rounds are kept for joiners
        self.join_whole = False  # whether the round about to open is joined whole (relays sent it so)
        self._joins_whole = False  # the round in progress's
        self.shards = 0  # how many reduction shards (lane 0 of a round through them carries no payload)
        self.rounds = 0  # whole rounds finished (each counts once, whatever its lanes)
        self._layout: LaneLayout | None = None
        self._part: WindowPart | None = None
        self._assembler: LaneAssembler | None = None
        self._next_lane = 0
        self._sharded = False  # the round in progress is the shards' (they step its lanes 1..)
        self._digest: bytes | None = None  # a delta round through the shards: its new base's digest
        # The params sets a round stepped on the shards committed for: their state is the
        # shards' (until then, what the optimizer holds of a set is seeded to them).
        self._on_shards: set[FragmentTag | None] = set()

    @property
    def windows(self) -> int:
        """Windows opened (Control rounds finished)."""
        return self.counter.windows

    def restart_windows_at(self, window: int) -> None:
        """The next Control round opens ``window``; a round cut short is forgotten."""
        self.counter.restart_at(window)
        self._layout, self._assembler, self._next_lane = None, None, 0

    def take(self, lane: int, consensus: Consensus) -> LaneOut:
        """Lane ``lane``'s consensus, as it finished (lanes come in order: 0 opens a round)."""
        frame = consensus.outgoing
        if not isinstance(frame, RoundFrame):
            raise FlodlError("a lane's consensus came signed already: lanes never compute a consensus ahead")
        if lane == 0:
            self._begin_round(frame)
        layout = self._layout
        if layout is None or lane != self._next_lane:
            # A lane of a round that was abandoned (every rank died and the cluster
            # started again from the last window): nothing of a window to do with it.
            log.warning("controller: lane %d's consensus finished outside the round in progress; sent as it is", lane)
            return LaneOut(attrs.evolve(consensus, part=None), opens_round=False, ends_round=False)
        part = self._part
        # (lane 0 of a delta round through the shards is taken as it is: it carries the
        # new digest at the commit, end_sharded)
        if self._delta is not None and not self._sharded:
            frame = self._delta_lane(frame, layout, lane, part)
        elif self._steps(part, frame) and not self._sharded:
            assert part is not None
            frame = self._outer_step(frame, layout, lane, part)
        if self._assembler is not None and not self.sharded_delta:
            self._assembler.add(frame)
        out = attrs.evolve(consensus, outgoing=frame, part=None)
        self._next_lane = lane + 1
        if self._next_lane < layout.count:
            return LaneOut(out, opens_round=lane == 0, ends_round=False)
        return attrs.evolve(self._end_round(out, part), opens_round=lane == 0)

    # -- internals -------------------------------------------------------------

    def _steps(self, part: WindowPart | None, frame: RoundFrame) -> bool:
        """Whether the outer optimizer steps this lane (a params round's, with mass)."""
        return part is not None and part.is_params and self.outer_optimizer is not None and frame.weight > 0

    def steps_round(self, lane0: RoundFrame) -> bool:
        """Whether the round lane 0 just opened is a params round the outer optimizer
        steps (with shards, they step its lanes: ``round_fragment``'s state). With shards
        the round's schema is checked here first, as a step here checks it: a SchemaError
        stops the controller before any shard steps it."""
        steps = self._delta is None and self._steps(self._part, lane0)
        check = getattr(self.outer_optimizer, "check_sharded_schema", None)
        if steps and self._sharded and self._layout is not None and callable(check):
            part = self._part
            assert part is not None
            try:
                check(self._layout.schema, part.fragment)
            except SchemaError as exc:
                raise SchemaError(f"the outer optimizer refused window {part.window}'s params consensus "
                                  f"(stepped on the shards): {exc}") from exc
        return steps

    def seeds(self) -> dict[int, LaneState] | None:
        """The optimizer's state of each lane 1.. of the params round in progress, for the
        shards to start it from, until a round of its params set stepped on them (None:
        nothing to seed). The state a resumed optimizer holds, or windows stepped here
        before the shards came, so reaches them. Called once :meth:`steps_round` said the
        round steps."""
        layout, fragment = self._layout, self.round_fragment
        seed_state = getattr(self.outer_optimizer, "seed_state", None)
        if layout is None or fragment in self._on_shards or not callable(seed_state):
            return None
        states = {lane: seed_state(layout, lane, fragment) for lane in range(1, layout.count)}
        return {lane: state for lane, state in states.items() if state is not None} or None

    @property
    def round_fragment(self) -> FragmentTag | None:
        """The params fragment of the round in progress (None: the whole model)."""
        return None if self._part is None else self._part.fragment

    def _begin_round(self, lane0: RoundFrame) -> None:
        # Every relay's lane 0 was checked against the schema it carries, and the
        # fold made them agree: the consensus carries the same schema (a delta
        # round's pieces come out as f32 means: only the schema is checked then).
        through = self.shards > 0 and goes_through_shards(LaneLayout.declared_by(lane0).schema, self.shards)
        layout = LaneLayout.declared_by(lane0, lane0_empty=through)
        self._layout = layout
        delta = is_delta_schema(layout.schema) and lane0.kind == RoundKind.MODEL
        if not delta:
            layout.check_lane(0, lane0)
        self._delta = _DeltaRound.of(layout, self.lineages.current) if delta else None
        schema = self._delta.params.schema if self._delta is not None else layout.schema
        whole = RoundFrame([TensorPayload(dtype, shape) for dtype, shape in schema], lane0.kind)
        part = self._part = self.counter.place(lane0.kind, fragment_of(whole))
        if lane0.kind == RoundKind.CONTROL:  # a window opens: its params round is this set's
            self.lineages.window_fragment = part.fragment.index if part is not None and part.fragment else None
        self._joins_whole = self.join_whole
        if self._delta is not None:
            self._delta.lineage.begin_lanes([shape for _, shape in schema], DeltaCodec.of_tag(layout.schema[0][0]),
                                             lane0.weight)
            # The coded consensus joined for the joiners' catch-up; the checkpoint gets x.
            joined = self._joins_whole or (self.keep_window_state and part is not None)
        else:
            joined = self._joins_whole or self.checkpoint is not None or (
                self.keep_window_state and part is not None and part.kept
            )
        self._sharded = through and layout.count > 1
        self._digest = None
        if self._sharded and not delta:
            joined = False  # with shards: joined at the commit, if a copy came (end_sharded)
        self._assembler = LaneAssembler(layout) if joined else None
        if self._assembler is not None:
            self._assembler.begin()  # a frame of its own: a hook or the joiners may keep it
        self._next_lane = 0

    def checkpoint_wants(self, lane0: RoundFrame) -> bool:
        """Whether the checkpoint sink records the round lane 0 opened, so the shards copy
        it here (a sink that cannot say gets every round)."""
        if self.checkpoint is None:
            return False
        wants = getattr(self.checkpoint, "wants_round", None)
        return True if wants is None else bool(wants(lane0.kind))

    def end_sharded(self, lane0: LaneOut, committed: Committed) -> LaneOut:
        """With shards, a round's commit ends it here: joined whole from its lane 0 and
        the copy of its other lanes the shards sent (``committed.lanes``), or - no copy -
        held nowhere here (``not_held``: its window keeps no state, the checkpoint sink
        is told it skipped the round). A stepped round's window is counted in the
        controller's optimizer, and the lanes' state the shards copied is adopted there."""
        layout, part = self._layout, self._part
        if layout is None or self._next_lane != 1:
            return lane0  # abandoned meanwhile (every rank died)
        assert isinstance(lane0.consensus.outgoing, RoundFrame)
        frame = lane0.consensus.outgoing
        if self._delta is not None and self._digest is not None:
            return self._end_sharded_delta(lane0, frame)
        if self._sharded and self._delta is None and self._steps(part, frame):
            self._adopt_shards_state(layout, committed.states)
        if committed.lanes is None:
            self.rounds += 1
            self._layout, self._assembler = None, None
            skip = getattr(self.checkpoint, "skip_round", None)
            if skip is not None:
                skip(self.rounds, frame.kind, frame.weight)
            return attrs.evolve(lane0, part=part, ends_round=True, not_held=True)
        self._assembler = LaneAssembler(layout)
        self._assembler.begin()
        self._assembler.add(frame)
        last = lane0
        for lane, lane_frame in enumerate(committed.lanes, 1):
            last = self.take(lane, Consensus(lane_frame))
        return attrs.evolve(last, consensus=lane0.consensus, opens_round=True)

    @property
    def sharded_delta(self) -> bool:
        """Whether the round lane 0 opened is a delta round through the shards (they send
        their lanes' means here: :meth:`delta_lanes`)."""
        return self._sharded and self._delta is not None

    def delta_lanes(self, means: Sequence[RoundFrame]) -> list[RoundFrame]:
        """A delta round through the shards: lanes 1.. from their means (as the shards
        summed and divided them), each added to ``x``, stepped and coded against the base
        as a lane reduced here is; the consensus lanes the shards fan out. Lane 0 carries
        the new base's digest at the commit (:meth:`end_sharded`)."""
        layout, part = self._layout, self._part
        assert layout is not None and self._delta is not None and len(means) == layout.count - 1
        out = []
        for lane, mean in enumerate(means, 1):
            frame = self._delta_lane(mean, layout, lane, part)
            if self._assembler is not None:
                self._assembler.add(frame, lane)
            out.append(frame)
        self._digest = self._delta.lineage.lanes_done()
        return out

    def _end_sharded_delta(self, lane0: LaneOut, frame: RoundFrame) -> LaneOut:
        """A delta round through the shards commits: lane 0 carries the new digest (in
        place of the relays' old one), and the round ends as one reduced here does."""
        assert self._digest is not None
        out = RoundFrame([TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), self._digest), *frame.tensors[1:]],
                         frame.kind, frame.weight)
        if self._assembler is not None:
            self._assembler.add(out, 0)
        ended = self._end_round(attrs.evolve(lane0.consensus, outgoing=out), self._part)
        return attrs.evolve(ended, opens_round=True)

    def _adopt_shards_state(self, layout: LaneLayout, states: Sequence[LaneState] | None) -> None:
        """The shards stepped this window: the controller's optimizer counts it, and takes
        each lane's state when they sent it (a checkpoint saves the optimizer's state)."""
        fragment = self.round_fragment
        self._on_shards.add(fragment)  # its state is the shards' now
        count = getattr(self.outer_optimizer, "count_sharded_window", None)
        if count is not None:
            count(fragment)
        adopt = getattr(self.outer_optimizer, "adopt_lane", None)
        if states is not None and adopt is not None:
            for lane, state in enumerate(states, 1):
                adopt(layout, lane, fragment, state)

    def _outer_step(self, frame: RoundFrame, layout: LaneLayout, lane: int, part: WindowPart) -> RoundFrame:
        step_lane = getattr(self.outer_optimizer, "step_lane")
        try:
            stepped: RoundFrame = step_lane(frame, layout, lane, part.fragment)
        except ProtocolError as exc:
            # Not the fault of the relay whose frame closed the lane: the controller's own. A
            # schema change stops the controller with a SchemaError (docs, "Guards"): this runs
            # in its broadcaster, where no relay's reader can take it for that relay's error.
            why = f"the outer optimizer refused window {part.window}'s params consensus (lane {lane}): {exc}"
            raise (SchemaError(why) if isinstance(exc, SchemaError) else FlodlError(why)) from exc
        return stepped

    def _delta_lane(self, frame: RoundFrame, layout: LaneLayout, lane: int, part: WindowPart | None) -> RoundFrame:
        """A delta round's lane out: each piece's mean delta added to the exact consensus,
        stepped, and coded against the ranks' base; on the last lane, the new digest."""
        assert self._delta is not None
        lineage = self._delta.lineage
        pieces, params = layout.lanes[lane], self._delta.params.lanes[lane]
        means = frame.tensors[:len(params)]
        values = [lineage.lane_params(p.tensor, p.start, flat_f32(t)) for p, t in zip(params, means)]
        stepping = RoundFrame([TensorPayload(DTYPE_F32, (p.numel,), v) for p, v in zip(params, values)],
                              RoundKind.MODEL, frame.weight)
        if self._steps(part, frame):
            assert part is not None
            stepping = self._outer_step(stepping, self._delta.params, lane, part)
        out = []
        for p, t in zip(params, stepping.tensors):
            dtype, payload = lineage.lane_downlink(p.tensor, p.start, flat_f32(t))
            out.append(TensorPayload(dtype, (p.numel,), payload))
        if len(pieces) > len(params):  # the digest: the round's last piece
            out.append(TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), lineage.lanes_done()))
        return RoundFrame([*out, *frame.tensors[len(pieces):]], frame.kind, frame.weight)

    def _end_round(self, out: Consensus, part: WindowPart | None) -> LaneOut:
        self.rounds += 1
        if self._delta is not None:
            return self._end_delta_round(out, part)
        assembler, self._assembler, self._layout = self._assembler, None, None
        if assembler is None:
            return LaneOut(out, part)
        joined = assembler.finish(None)  # signed by the caller, off the event loop, if it is kept
        if self.checkpoint is not None:
            self.checkpoint(self.rounds, decode_round_frame(joined, self.salt, authenticated=True))
        kept = self.keep_window_state and part is not None and part.kept
        return LaneOut(out, part, joined if kept else None, whole=joined if self._joins_whole else None)

    def _end_delta_round(self, out: Consensus, part: WindowPart | None) -> LaneOut:
        """The hooks see the exact consensus ``x``; a joiner starts from the base in f32
        and is brought up to date with the coded consensus frames since its state."""
        assert self._delta is not None
        lineage = self._delta.lineage
        assembler, self._assembler, self._layout, self._delta = self._assembler, None, None, None
        weight = out.outgoing.weight if isinstance(out.outgoing, RoundFrame) else 0.0
        if self.checkpoint is not None:
            self.checkpoint(self.rounds, lineage.params_frame(weight))
        for_joiners = lineage.joiner_frame(weight) if self.keep_window_state else None
        catch_up = assembler.finish(None) if assembler is not None else None
        return LaneOut(attrs.evolve(out, for_joiners=for_joiners, after_write=None), part, None, catch_up,
                       whole=catch_up if self._joins_whole else None)


__all__ = ["LaneOut", "LaneWindows"]
