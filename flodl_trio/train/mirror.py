"""The rank's mirror of the controller's outer optimizer, for overlapped windows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..fold.outer import DiLoCoNesterov, PlainAverage, SlowMo


class OuterMirror:
    """The controller's outer optimizer, followed from the rank's side: its state
    (the outer params ``x`` and momentum ``m``) recovered from the consensus frames
    the rank receives, so the rank can compute its eager stand-in - the outer step
    the controller would take if the average were the rank's own boundary params.

    The recovery inverts the controller's update: SlowMo gives
    ``m = (x - x_new) / lr``; DiLoCo's Nesterov step gives
    ``m = (momentum * m + (x - x_new) / lr) / (1 + momentum)``. It is exact up to
    rounding; it only shapes the stand-in, never the consensus the rank ends on.
    """

    def __init__(self, nesterov: bool, lr: float, momentum: float) -> None:
        self.nesterov, self.lr, self.momentum = nesterov, lr, momentum
        self._x: list[Any] | None = None
        self._m: list[Any] = []

    @classmethod
    def of(cls, outer: object | None) -> OuterMirror | None:
        """The mirror of the controller's ``outer`` (None for plain averaging)."""
        if outer is None or isinstance(outer, PlainAverage):
            return None
        if isinstance(outer, SlowMo | DiLoCoNesterov):
            return cls(isinstance(outer, DiLoCoNesterov), outer.lr, outer.momentum)
        raise ConfigError(f"outer must be None, PlainAverage, SlowMo or DiLoCoNesterov (the controller's); got {outer!r}")

    def stand_in(self, boundary: Sequence[Any], out: Sequence[Any]) -> bool:
        """Write into ``out`` the outer step from ``boundary`` as the average; False (nothing
        written) before the first consensus told the mirror where the outer params are."""
        if self._x is None:
            return False
        beta = self.momentum
        for x, m, b, o in zip(self._x, self._m, boundary, out, strict=True):
            o.copy_(x).sub_(b)  # g = x - c
            if self.nesterov:  # x - lr ((1 + beta) g + beta^2 m)
                o.mul_(1 + beta).add_(m, alpha=beta * beta)
            else:  # x - lr (beta m + g)
                o.add_(m, alpha=beta)
            o.mul_(-self.lr).add_(x)
        return True

    def follow(self, new_x: Sequence[Any]) -> None:
        """The controller's output for a window with mass: update the mirrored state."""
        if self._x is None:  # the controller's first window only sets x
            self._x = [t.detach().clone() for t in new_x]
            self._m = [t.detach().clone().zero_() for t in new_x]
            return
        for x, m, new in zip(self._x, self._m, new_x, strict=True):
            x.sub_(new).div_(self.lr)  # (x - x_new) / lr
            if self.nesterov:
                m.mul_(self.momentum).add_(x).div_(1 + self.momentum)
            else:
                m.copy_(x)
            x.copy_(new)


__all__ = ["OuterMirror"]
