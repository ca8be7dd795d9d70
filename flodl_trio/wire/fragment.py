"""flodl_trio convention: the fragment tag of a window's Control round.

A trainer that syncs its parameters in ``P`` fragments (streamed windows)
cuts *every* parameter tensor into ``P`` runs of its elements (flattened,
row-major): fragment ``p`` of a tensor of ``n`` elements is elements
``n * p // P`` up to ``n * (p + 1) // P`` (:func:`piece_range`), sent flat
(shape ``[m]``). Each fragment's window opens with the usual step-count
gather, plus the tag and the model's shapes::

    tensor 0:      f32 [world_size]       the step counts (as in any window)
    tensor 1:      f32 [0, P, p]          no payload bytes: fragment p of P
    tensors 2...:  f32 [0, *shape_i]      no payload: parameter i's shape

The frame stays an ordinary RoundFrame (any relay, flodl's included, folds
it), and because a fold refuses a frame whose shapes differ from the
round's, a rank that disagrees about which fragment is being synced (or
about the model) is refused alone, by its own relay. The controller reads
the tag to keep its outer-optimizer and checkpoint state per fragment, and
the shapes to put the model back together for checkpoints. A cluster that
does not use fragments never sends it. See docs/wire.md ("Fragment tag").
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
    """Fragment ``index`` of ``count`` (0 <= index < count), and the whole model's
    parameter shapes (not part of its identity: state is kept per index and count)."""

    index: int
    count: int
    shapes: tuple[tuple[int, ...], ...] = attrs.field(default=(), eq=False, order=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not 2 <= self.count <= MAX_FRAGMENTS or not 0 <= self.index < self.count:
            raise ConfigError(
                f"fragment tag must be index 0..count-1 of count 2..{MAX_FRAGMENTS}, got {self.index} of {self.count}"
            )

    def payload(self) -> TensorPayload:
        """The tag as the Control round's second tensor."""
        return TensorPayload(DTYPE_F32, (0, self.count, self.index), _EMPTY)

    def payloads(self) -> list[TensorPayload]:
        """What the Control round carries after the step counts: the tag, then the shapes."""
        return [self.payload(), *(TensorPayload(DTYPE_F32, (0, *shape), _EMPTY) for shape in self.shapes)]

    def key(self) -> str:
        """A name for this fragment's state (in checkpoints and logs): ``"p/P"``."""
        return f"{self.index}/{self.count}"


def fragment_of(frame: RoundFrame) -> FragmentTag | None:
    """The fragment a window's Control round (or its consensus) opens, with the model's
    shapes; None when the frame carries no tag (an unfragmented window, or not a
    window round at all) or carries one that cannot be."""
    if frame.kind != RoundKind.CONTROL or len(frame.tensors) < 2 or len(frame.tensors[0].shape) != 1:
        return None
    tag, *schema = frame.tensors[1:]
    shape = tuple(tag.shape)
    if tag.dtype != DTYPE_F32 or len(shape) != 3 or shape[0] != 0:
        return None
    _, count, index = shape
    if not 2 <= count <= MAX_FRAGMENTS or not 0 <= index < count:
        return None
    if any(t.dtype != DTYPE_F32 or not t.shape or t.shape[0] != 0 for t in schema):
        return None
    return FragmentTag(index, count, tuple(tuple(t.shape[1:]) for t in schema))


def piece_range(numel: int, count: int, index: int) -> tuple[int, int]:
    """Fragment ``index`` of ``count`` of a tensor of ``numel`` elements: [start, stop)."""
    return numel * index // count, numel * (index + 1) // count


__all__ = ["MAX_FRAGMENTS", "FragmentTag", "fragment_of", "piece_range"]
