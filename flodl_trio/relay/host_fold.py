"""The host's fold barrier, free of I/O: which local ranks must deposit this
round, who did, and the f32 sum of their frames.

The relay's tasks call into it (a frame verified, a rank gone) and act on what
it returns (a HostFrame to ship); it never awaits anything itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ..fold.accumulator import FoldAccumulator, ImageCache
from ..wire.round_frame import RoundFrame


@attrs.frozen
class FoldedHostFrame:
    """The host's fold, ready to sign and send; ``images`` (the fold's f32 sums, which
    its payloads may alias) go back to the fold's cache once it has been written."""

    frame: RoundFrame
    images: list[Any]



class HostFold:
    """The host's fold barrier: every live local rank deposits, then one frame ships."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = frozenset(ranks)
        self.dead: set[int] = set()
        self.deposited: set[int] = set()
        self.images = ImageCache()
        self.acc = FoldAccumulator(self.images)
        self.changed = trio.Event()  # set (and replaced) whenever the barrier moves

    @property
    def live(self) -> frozenset[int]:
        return self.ranks - self.dead

    def _note_change(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def deposit(self, rank: int, frame: RoundFrame) -> FoldedHostFrame | None:
        """Fold one verified frame; the folded round when this deposit completes it."""
        self.acc.add(frame, f"rank {rank}")
        self.deposited.add(rank)
        self._note_change()
        return self._take_if_complete()

    def mark_dead(self, rank: int) -> FoldedHostFrame | None:
        """Drop ``rank`` from the barrier (a frame it already folded stays: realized work)."""
        self.dead.add(rank)
        self._note_change()
        return self._take_if_complete()

    def only_missing(self, rank: int) -> bool:
        """Whether ``rank``'s frame is the last one this round waits for (after another)."""
        return bool(self.deposited) and self.live - self.deposited == {rank}

    def complete_ahead(self, rank: int, acc: FoldAccumulator) -> bool:
        """Close the round with a frame computed ahead from ``acc`` plus ``rank``'s
        verified frame, if that is still exactly what the round needs."""
        if acc is not self.acc or not self.only_missing(rank):
            return False
        self._next_round()
        # The frame computed ahead has its own buffer: nothing reads these sums now.
        self.images.give(acc.sums())
        return True

    def _take_if_complete(self) -> FoldedHostFrame | None:
        if not self.deposited or not self.live <= self.deposited:
            return None
        # The frame may alias the sums (it always does for f32): they go back once it is written.
        folded = FoldedHostFrame(self.acc.result(overwrite_sums=True), self.acc.sums())
        self._next_round()
        return folded

    def _next_round(self) -> None:
        self.acc = FoldAccumulator(self.images)
        self.deposited.clear()
        self._note_change()


__all__ = ["FoldedHostFrame", "HostFold"]
