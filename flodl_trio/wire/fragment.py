"""flodl_trio convention: the fragment tag of a window's Control round.

A trainer that syncs its parameters in ``P`` fragments (streamed windows)
opens each fragment's window with the usual step-count gather, plus one more
tensor: an empty f32 tensor whose *shape* names the fragment::

    tensor 0: f32 [world_size]      the step counts (as in any window)
    tensor 1: f32 [0, P, p]         no payload bytes: fragment p of P

The frame stays an ordinary RoundFrame (any relay, flodl's included, folds
it), and because a fold refuses a frame whose shapes differ from the
round's, a rank that disagrees about which fragment is being synced is
refused alone, by its own relay. The controller reads the tag to keep its
outer-optimizer and checkpoint state per fragment. A cluster that does not
use fragments never sends it. See docs/wire.md ("Fragment tag").
"""

from __future__ import annotations

import attrs
import numpy as np

from ..errors import ConfigError
from .constants import DTYPE_F32
from .round_frame import RoundFrame, RoundKind, TensorPayload

_EMPTY = np.zeros(0, dtype="<f4")
MAX_FRAGMENTS = 256  # a model cut finer than this gains nothing: a fragment per layer group


@attrs.frozen(order=True)
class FragmentTag:
    """Fragment ``index`` of ``count`` (0 <= index < count)."""

    index: int
    count: int

    def __attrs_post_init__(self) -> None:
        if not 2 <= self.count <= MAX_FRAGMENTS or not 0 <= self.index < self.count:
            raise ConfigError(
                f"fragment tag must be index 0..count-1 of count 2..{MAX_FRAGMENTS}, got {self.index} of {self.count}"
            )

    def payload(self) -> TensorPayload:
        """The tag as the Control round's extra tensor."""
        return TensorPayload(DTYPE_F32, (0, self.count, self.index), _EMPTY)

    def key(self) -> str:
        """A name for this fragment's state (in checkpoints and logs): ``"p/P"``."""
        return f"{self.index}/{self.count}"


def fragment_of(frame: RoundFrame) -> FragmentTag | None:
    """The fragment a window's Control round (or its consensus) opens; None when the
    frame carries no tag (an unfragmented window, or not a window round at all)."""
    if frame.kind != RoundKind.CONTROL or len(frame.tensors) != 2:
        return None
    tag = frame.tensors[1]
    shape = tuple(tag.shape)
    if tag.dtype != DTYPE_F32 or len(shape) != 3 or shape[0] != 0 or len(frame.tensors[0].shape) != 1:
        return None
    _, count, index = shape
    if not 2 <= count <= MAX_FRAGMENTS or not 0 <= index < count:
        return None
    return FragmentTag(index, count)


__all__ = ["MAX_FRAGMENTS", "FragmentTag", "fragment_of"]
