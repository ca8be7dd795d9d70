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
  one frame in the model's shapes, as the ranks receive it.

It never awaits, so it reads and tests without trio.
"""

from __future__ import annotations

import logging

import attrs

from ..errors import FlodlError, ProtocolError
from ..wire.fragment import fragment_of
from ..wire.lanes import LaneAssembler, LaneLayout
from ..wire.round_frame import RoundFrame, TensorPayload, decode_round_frame
from ..wire.salt import SessionSalt
from .round import CheckpointSink, Consensus, OuterOptimizer, WindowCounter, WindowPart

log = logging.getLogger("flodl_trio.controller")


@attrs.frozen
class LaneOut:
    """One lane's consensus to send, and - with a round's last lane - the round's place
    in the windows and, if the joiners keep it, the whole frame (unsigned)."""

    consensus: Consensus
    part: WindowPart | None = None
    kept: memoryview | None = None


class LaneWindows:
    """The windows of a controller that reduces in lanes (see the module docstring)."""

    def __init__(self, salt: SessionSalt, outer_optimizer: OuterOptimizer | None, checkpoint: CheckpointSink | None) -> None:
        self.salt = salt
        self.outer_optimizer = outer_optimizer
        self.checkpoint = checkpoint
        self.counter = WindowCounter()
        self.keep_window_state = False  # whether params and buffers rounds are kept for joiners
        self.rounds = 0  # whole rounds finished (each counts once, whatever its lanes)
        self._layout: LaneLayout | None = None
        self._part: WindowPart | None = None
        self._assembler: LaneAssembler | None = None
        self._next_lane = 0

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
            return LaneOut(attrs.evolve(consensus, part=None))
        part = self._part
        if part is not None and part.is_params and self.outer_optimizer is not None and frame.weight > 0:
            frame = self._outer_step(frame, layout, lane, part)
        if self._assembler is not None:
            self._assembler.add(frame)
        out = attrs.evolve(consensus, outgoing=frame, part=None)
        self._next_lane = lane + 1
        if self._next_lane < layout.count:
            return LaneOut(out)
        return self._end_round(out, part)

    # -- internals -------------------------------------------------------------

    def _begin_round(self, lane0: RoundFrame) -> None:
        # Every relay's lane 0 was checked against the schema it carries, and the
        # fold made them agree: the consensus carries the same schema.
        layout = self._layout = LaneLayout.of_lane0(lane0)
        whole = RoundFrame([TensorPayload(dtype, shape) for dtype, shape in layout.schema], lane0.kind)
        part = self._part = self.counter.place(lane0.kind, fragment_of(whole))
        joined = self.checkpoint is not None or (self.keep_window_state and part is not None and part.kept)
        self._assembler = LaneAssembler(layout) if joined else None
        if self._assembler is not None:
            self._assembler.begin()  # a frame of its own: a hook or the joiners may keep it
        self._next_lane = 0

    def _outer_step(self, frame: RoundFrame, layout: LaneLayout, lane: int, part: WindowPart) -> RoundFrame:
        step_lane = getattr(self.outer_optimizer, "step_lane")
        try:
            stepped: RoundFrame = step_lane(frame, layout, lane, part.fragment)
        except ProtocolError as exc:
            # Not the fault of the relay whose frame closed the lane: the controller's own.
            raise FlodlError(f"the outer optimizer refused window {part.window}'s params consensus (lane {lane}): {exc}") from exc
        return stepped

    def _end_round(self, out: Consensus, part: WindowPart | None) -> LaneOut:
        self.rounds += 1
        assembler, self._assembler, self._layout = self._assembler, None, None
        if assembler is None:
            return LaneOut(out, part)
        joined = assembler.finish(None)  # signed by the caller, off the event loop, if it is kept
        if self.checkpoint is not None:
            self.checkpoint(self.rounds, decode_round_frame(joined, self.salt, authenticated=True))
        kept = self.keep_window_state and part is not None and part.kept
        return LaneOut(out, part, joined if kept else None)


__all__ = ["LaneOut", "LaneWindows"]
