"""The controller's rounds and the windows they make, chosen once from the lane count.

However many lanes, the controller's tasks see one shape: a list of rounds
(one per lane, all over the one :class:`~.seats.Seats` registry) and a
:class:`Windows` keeper that every finished lane's consensus passes through
before it is signed. Without lanes the single round applies the outer step and
the checkpoint itself (:class:`WholeFrameWindows` only hands its consensus
on), so a flodl cluster's consensus may still be computed while its last frame
arrives; with lanes, :class:`~.lane_windows.LaneWindows` does the windows'
work lane by lane. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import FlodlError
from ..fold.delta import DeltaLineages
from ..wire.fragment import FragmentTag
from ..wire.round_frame import RoundFrame
from ..wire.salt import SessionSalt
from .lane_windows import LaneOut, LaneWindows
from .round import CheckpointSink, Consensus, ControllerRound, OuterOptimizer, WindowCounter
from .seats import Seats
from .shards import Committed, LaneState
from .stats import ControllerStats


class Windows(Protocol):
    """Who counts the windows and does their work (outer step, checkpoint, joiners' state)."""

    keep_window_state: bool
    # Whether relays that send whole frames are seated (with lanes: each round is joined for them).
    join_whole: bool
    # How many reduction shards (lane 0 of a round through them carries no payload).
    shards: int
    # Whole rounds finished (with lanes the stats count each lane's round).
    rounds: int

    @property
    def counter(self) -> WindowCounter: ...

    @property
    def outer_optimizer(self) -> OuterOptimizer | None: ...

    @property
    def lineages(self) -> DeltaLineages: ...

    @property
    def windows(self) -> int: ...

    def restart_windows_at(self, window: int) -> None: ...

    def take(self, lane: int, consensus: Consensus) -> LaneOut: ...

    def end_sharded(self, lane0: LaneOut, committed: Committed) -> LaneOut: ...

    def steps_round(self, lane0: RoundFrame) -> bool: ...

    def checkpoint_wants(self, lane0: RoundFrame) -> bool: ...

    @property
    def round_fragment(self) -> FragmentTag | None: ...

    @property
    def sharded_delta(self) -> bool: ...

    def delta_lanes(self, means: Sequence[RoundFrame]) -> list[RoundFrame]: ...

    def seeds(self) -> dict[int, LaneState] | None: ...


class WholeFrameWindows:
    """Without lanes: the one round already placed its consensus in the windows and
    applied the hooks; this only hands it on."""

    join_whole = False  # every relay sends and gets whole frames: nothing to join
    shards = 0

    def __init__(self, round_: ControllerRound) -> None:
        self._round = round_

    @property
    def keep_window_state(self) -> bool:
        return self._round.keep_window_state

    @keep_window_state.setter
    def keep_window_state(self, keep: bool) -> None:
        self._round.keep_window_state = keep

    @property
    def rounds(self) -> int:
        return self._round.stats.rounds

    @rounds.setter
    def rounds(self, rounds: int) -> None:
        self._round.stats.rounds = rounds

    @property
    def counter(self) -> WindowCounter:
        return self._round.counter

    @property
    def outer_optimizer(self) -> OuterOptimizer | None:
        return self._round.outer_optimizer

    @property
    def lineages(self) -> DeltaLineages:
        return self._round.lineages

    @property
    def windows(self) -> int:
        return self._round.windows

    def restart_windows_at(self, window: int) -> None:
        self._round.restart_windows_at(window)

    def take(self, lane: int, consensus: Consensus) -> LaneOut:
        return LaneOut(consensus, consensus.part)

    def end_sharded(self, lane0: LaneOut, committed: Committed) -> LaneOut:
        raise FlodlError("shards reduce rounds in lanes: a controller without lanes has none to end")

    def steps_round(self, lane0: RoundFrame) -> bool:
        return False  # (no lanes: no shards)

    def checkpoint_wants(self, lane0: RoundFrame) -> bool:
        return False  # (no lanes: no shards)

    round_fragment = None
    sharded_delta = False

    def delta_lanes(self, means: Sequence[RoundFrame]) -> list[RoundFrame]:
        raise FlodlError("shards reduce rounds in lanes: a controller without lanes has no delta lanes")

    def seeds(self) -> dict[int, LaneState] | None:
        return None  # (no lanes: no shards)


def rounds_and_windows(
    lanes: int,
    seats: Seats,
    stats: ControllerStats,
    salt: SessionSalt,
    outer_optimizer: OuterOptimizer | None,
    checkpoint: CheckpointSink | None,
    on_change: Callable[[], None],
) -> tuple[list[ControllerRound], Windows]:
    """One round per lane over ``seats``, and the keeper of their windows."""
    if lanes == 1:
        whole = ControllerRound(seats, stats, outer_optimizer=outer_optimizer, checkpoint=checkpoint, on_change=on_change)
        return [whole], WholeFrameWindows(whole)
    rounds = [ControllerRound(seats, stats, on_change=on_change, computes_ahead=False) for _ in range(lanes)]
    windows = LaneWindows(salt, outer_optimizer, checkpoint)
    for lane_round in rounds:  # one set of delta lineages: each lane's round checks relays' digests against it
        lane_round.lineages = windows.lineages
        lane_round.names_window_fragment = False  # LaneWindows does, from the round's lane 0
    return rounds, windows


__all__ = ["Windows", "WholeFrameWindows", "rounds_and_windows"]
