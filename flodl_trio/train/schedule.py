"""Where a rank's windows end and when their consensus merges: arithmetic on steps, no I/O."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from ..errors import ConfigError
from ..wire.fragment import MAX_FRAGMENTS

if TYPE_CHECKING:
    import torch


@attrs.frozen
class WindowSchedule:
    """How a rank's windows run (see :func:`open_window_trainer` for each field)."""

    sync_every: int
    overlap: int = 0
    gamma: float = 1.0
    merge_after: int | None = None
    fragments: int = 1
    merge_by: int | None = None

    def __attrs_post_init__(self) -> None:
        self._check_types()
        if self.sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1 inner step, got {self.sync_every}")
        if self.overlap not in (0, 1):
            raise ConfigError(f"overlap must be 0 (wait for each window's round) or 1 (overlap it), got {self.overlap}")
        if not 1 <= self.fragments <= min(self.sync_every, MAX_FRAGMENTS):
            raise ConfigError(
                f"fragments must be 1..sync_every={self.sync_every} (each fragment syncs at its own step) "
                f"and at most {MAX_FRAGMENTS}, got {self.fragments}"
            )
        for name, steps in (("merge_after", self.merge_after), ("merge_by", self.merge_by)):
            if steps is not None and not 1 <= steps <= self.sync_gap:
                raise ConfigError(
                    f"{name} must be None (when it lands) or 1..{self.sync_gap} steps (sync_every / fragments: "
                    f"the next fragment's round starts then), got {steps}"
                )
        if self.merge_after is not None and self.merge_by is not None:
            raise ConfigError(
                f"give merge_after (merge after exactly that many steps) or merge_by (when it lands, at the latest "
                f"after that many), not both: got merge_after={self.merge_after}, merge_by={self.merge_by}"
            )

    def _check_types(self) -> None:
        """Step counts are whole numbers and gamma a finite number: a ConfigError naming the
        field, before any arithmetic trips over a float or a string."""
        for name in ("sync_every", "overlap", "fragments", "merge_after", "merge_by"):
            value = getattr(self, name)
            if value is None and name in ("merge_after", "merge_by"):
                continue
            try:
                if isinstance(value, bool):
                    raise TypeError
                operator.index(value)
            except TypeError:
                raise ConfigError(f"{name} must be a whole number of inner steps, got {value!r}") from None
        gamma = self.gamma
        if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not math.isfinite(gamma):
            raise ConfigError(f"gamma must be a finite number (the mass exponent), got {gamma!r}")

    @property
    def merge_deadline(self) -> int | None:
        """The step of the next window at which a consensus still in flight is waited for."""
        return self.merge_after if self.merge_after is not None else self.merge_by

    @property
    def sync_gap(self) -> int:
        """The fewest steps between two syncs (of consecutive fragments)."""
        return self.sync_every // self.fragments

    def first_sync(self, fragment: int) -> int:
        """Steps before ``fragment``'s first sync (the stagger); ``sync_every`` after that."""
        return (fragment + 1) * self.sync_every // self.fragments

    def boundary_step(self, window: int) -> int:
        """The inner step (counted from the run's start) at which the cluster's window
        ``window`` ends: windows sync the fragments in turn, window ``k`` fragment
        ``k % fragments`` in its cycle ``k // fragments``. -1 gives 0 (the start)."""
        if window < 0:
            return 0
        return self.first_sync(window % self.fragments) + (window // self.fragments) * self.sync_every

    def steps_to_first_sync(self, fragment: int, start_window: int) -> int:
        """Steps a rank entering at ``start_window`` (what ``join`` returned) takes before
        ``fragment``'s first sync: to that fragment's next sync in the cluster's schedule."""
        now = self.boundary_step(start_window - 1)
        first = self.first_sync(fragment)
        cycles = 0 if now < first else (now - first) // self.sync_every + 1
        return first + cycles * self.sync_every - now


def merge_late_consensus(
    live: Sequence[torch.Tensor], stand_in: Sequence[torch.Tensor], consensus: Sequence[torch.Tensor],
    *, moved: bool = True,
) -> None:
    """The merge rule, in place: ``live += consensus - stand_in``, tensor by tensor.

    ``stand_in`` (what the rank trained on from since the boundary: the params it
    sent, or the eager outer step of them) is overwritten with the correction
    ``consensus - stand_in`` (computed first, in the tensors' dtype), so the
    merge allocates nothing. When the rank has not ``moved`` since the boundary
    the rule says ``live = consensus``, and that is what it gets, bit for bit
    (``live + (consensus - live)`` may round differently on every rank).
    A model's parameters are written through ``detach()`` (their data, outside
    autograd), as an optimizer step writes them.
    """
    for p, b, c in zip(live, stand_in, consensus, strict=True):
        if not moved:
            p.detach().copy_(c)
            continue
        b.neg_().add_(c)
        p.detach().add_(b)


__all__ = ["WindowSchedule", "merge_late_consensus"]
