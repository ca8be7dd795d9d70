"""The realized-work fold: sum frames in f32, sum masses, divide exactly once.

Relays fold their local ranks' frames and controllers fold hosts' frames with
the same :class:`FoldAccumulator`; only the controller calls
:func:`finish_consensus`, which divides by the accepted mass. Folding is
streaming: each verified frame is added into one f32 image and can then be
released, so memory does not grow with the number of contributors. A daemon
hands finished images back to an :class:`ImageCache`, so a steady state of
rounds reuses them instead of asking the kernel for (and zeroing) a fresh
model-sized block every round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from ..errors import SchemaError
from ..wire.bf16 import (
    F32,
    U16,
    add_bf16_into,
    bf16_to_f32,
    encode_f32_as,
    f32_to_bf16_in_place,
)
from ..wire.constants import DTYPE_BF16, DTYPE_F32
from ..wire.quant import DTYPE_BASE_DIGEST, DeltaCodec, decode
from ..wire.round_frame import (
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_payload,
    describe_dtype,
)
from .schemas import Schema


class ImageCache:
    """The f32 sum images of finished rounds, kept a round at a time, for a later
    round with the same tensor sizes to fold into.

    Only an owner that knows a round's images are no longer read by anyone (its
    frame was written, or a frame finished ahead no longer needs them) gives
    them back. At most ``limit`` rounds are kept (alternating schemas, such as a
    window's params and buffers rounds, each find theirs); beyond that the
    oldest is let go.
    """

    def __init__(self, limit: int = 4) -> None:
        self.limit = limit
        self._free: list[list[npt.NDArray[np.float32] | None]] = []
        self.reused = 0  # rounds that folded into images of an earlier one

    def __len__(self) -> int:
        return len(self._free)

    def take(self, numels: Sequence[int]) -> list[npt.NDArray[np.float32] | None]:
        """Images for a round whose tensors have ``numels`` elements: a kept round's
        where every image fits its position exactly, else none (all None)."""
        for i, images in enumerate(self._free):
            if len(images) == len(numels) and all(im is None or im.size == n for im, n in zip(images, numels)):
                self.reused += 1
                return self._free.pop(i)
        return [None] * len(numels)

    def give(self, images: Sequence[npt.NDArray[np.float32] | None]) -> None:
        """Return one round's images (None where it had none), which nobody reads any more."""
        kept = {id(im) for round_images in self._free for im in round_images if im is not None}
        if any(im is not None for im in images) and not any(id(im) in kept for im in images if im is not None):
            self._free.append(list(images))
        del self._free[: max(0, len(self._free) - self.limit)]


class _Slot:
    """Running f32 sum of one tensor position; None until a non-elided payload lands."""

    __slots__ = ("digest", "dtype", "shape", "spare", "sum")

    def __init__(self, dtype: int, shape: tuple[int, ...], spare: npt.NDArray[np.float32] | None = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.sum: npt.NDArray[np.float32] | None = None
        self.spare = spare  # an earlier round's image to copy the first payload into
        self.digest: bytes | None = None  # a delta round's base digest

    def _add_delta(self, t: TensorPayload, codec: DeltaCodec) -> None:
        """Decode a delta payload into the f32 sum (the first straight into it)."""
        numel = t.numel
        first = self.sum is None
        if first:
            image, self.spare = self.spare, None
            self.sum = image if image is not None else np.empty(numel, dtype=F32)
        assert self.sum is not None
        decode(t.data, codec.code, codec.block, numel, self.sum.reshape(-1), add=not first)

    def add(self, t: TensorPayload) -> None:
        if t.nbytes == 0:
            return  # elided: all zeros
        if self.dtype == DTYPE_BASE_DIGEST:
            self.digest = bytes(t.data)  # every contributor's is the same (checked first)
            return
        codec = DeltaCodec.of_tag(self.dtype)
        if codec is not None:
            self._add_delta(t, codec)
            return
        # Overflow to inf and inf - inf = NaN are the defined f32 results
        # (torch gives the same without a warning); keep numpy quiet about them.
        with np.errstate(over="ignore", invalid="ignore"):
            if self.sum is None:
                # The one required copy (the payload lives in a reused receive
                # buffer), into a reused image when the cache has one.
                image, self.spare = self.spare, None
                if t.dtype == DTYPE_F32:
                    source = np.frombuffer(t.data, dtype=F32)
                    if image is None:
                        image = source.copy()
                    else:
                        np.copyto(image, source)
                    self.sum = image
                else:
                    self.sum = bf16_to_f32(np.frombuffer(t.data, dtype=U16), out=image)
            elif t.dtype == DTYPE_F32:
                np.add(self.sum, np.frombuffer(t.data, dtype=F32), out=self.sum)
            else:
                # Widened block by block in cache, no full-size f32 temporary.
                add_bf16_into(self.sum, np.frombuffer(t.data, dtype=U16))


class FoldAccumulator:
    """Streaming element-wise sum of one round's frames; never divides.

    ``images``: where the first frame's copy takes its f32 images from (a
    daemon's cache of images from earlier rounds); fresh ones otherwise.
    """

    def __init__(self, images: ImageCache | None = None) -> None:
        self.images = images
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.weight = 0.0
        self.kind: RoundKind | None = None
        self._slots: list[_Slot] = []
        self._first_source = ""

    def add(self, frame: RoundFrame, source: str) -> None:
        """Fold one verified frame; ``source`` ("rank 3", "host h1 ranks [2, 3]") names it in errors.

        On a schema error nothing of ``frame`` has been added.
        """
        self._check_schema(frame, source)
        self._check_mass(frame, source)
        if self.count == 0:
            self.kind = frame.kind
            self._first_source = source
            spares = self._spares_for(frame)
            self._slots = [_Slot(t.dtype, t.shape, spare) for t, spare in zip(frame.tensors, spares)]
        for slot, t in zip(self._slots, frame.tensors):
            slot.add(t)
        self.weight += frame.weight
        self.count += 1

    def _check_mass(self, frame: RoundFrame, source: str) -> None:
        """Each weight is finite alone (the decoder checks); their sum must stay finite,
        or the consensus could not even be encoded: the contribution that would
        overflow it is refused, and costs only its sender."""
        total = self.weight + frame.weight
        if not math.isfinite(total):
            raise SchemaError(
                f"round fold: {source}'s weight {frame.weight!r} would make the round's accepted mass "
                f"{total!r} (over the {self.count} contribution(s) so far); refused"
            )

    def _spares_for(self, frame: RoundFrame) -> list[npt.NDArray[np.float32] | None]:
        if self.images is None:
            return [None] * len(frame.tensors)
        return self.images.take([t.numel for t in frame.tensors])

    def _check_schema(self, frame: RoundFrame, source: str) -> None:
        for i, t in enumerate(frame.tensors):
            check_payload(t, i, source)
        if self.count == 0:
            return
        first, kind = self._first_source, self.kind
        if kind is not None and frame.kind != kind:  # a folded frame set it
            raise SchemaError(f"round fold: {source} sent a {frame.kind.name} frame, {first} sent {kind.name}")
        if len(frame.tensors) != len(self._slots):
            raise SchemaError(
                f"round fold: {source} sent {len(frame.tensors)} tensors, {first} sent {len(self._slots)}"
            )
        for i, (slot, t) in enumerate(zip(self._slots, frame.tensors)):
            if t.dtype == slot.dtype == DTYPE_BASE_DIGEST and slot.digest is not None and bytes(t.data) != slot.digest:
                raise SchemaError(
                    f"round fold: {source}'s delta is against another base than {first}'s "
                    f"(base digest {bytes(t.data).hex()}, not {slot.digest.hex()}): it missed a consensus"
                )
            if t.dtype != slot.dtype:
                raise SchemaError(
                    f"round fold: {source} tensor {i} is {describe_dtype(t.dtype)}, "
                    f"{first} sent {describe_dtype(slot.dtype)}"
                )
            if t.shape != slot.shape:
                raise SchemaError(
                    f"round fold: {source} tensor {i} has shape {list(t.shape)}, "
                    f"{first} sent {list(slot.shape)}"
                )

    @property
    def schema(self) -> Schema | None:
        """The folded frames' schema (None before the first)."""
        if self.count == 0 or self.kind is None:
            return None
        return self.kind, tuple((slot.dtype, tuple(slot.shape)) for slot in self._slots)

    def layout(self) -> list[tuple[int, tuple[int, ...], npt.NDArray[np.float32] | None]]:
        """(dtype, shape, running f32 sum or None) of every tensor position, in order."""
        return [(slot.dtype, slot.shape, slot.sum) for slot in self._slots]

    def sums(self) -> list[npt.NDArray[np.float32] | None]:
        """The f32 running sums (None = every contribution was elided)."""
        return [slot.sum for slot in self._slots]

    def result(self, *, overwrite_sums: bool = False) -> RoundFrame:
        """The folded frame, re-encoded in the input dtypes, mass = summed weights.
        A delta round's tensors come out as their f32 sums (a relay re-encodes
        them with its own error feedback; the controller divides them), its base
        digest as it came in.

        ``overwrite_sums``: bf16 tensors are rounded over their own f32 sums instead
        of into new arrays (the frame then aliases every sum, as an f32 one
        always does, and the sums are no longer f32 values).
        """
        if self.count == 0 or self.kind is None:
            raise SchemaError("round fold: no frame was folded")
        return _frame_from_sums(self._slots, self.kind, self.weight, overwrite_sums)


def _frame_from_sums(slots: list[_Slot], kind: RoundKind, weight: float, overwrite_sums: bool = False) -> RoundFrame:
    def encoded(s: _Slot) -> npt.NDArray[np.generic] | bytes:
        if s.dtype == DTYPE_BASE_DIGEST:
            return s.digest or b""
        if s.sum is None:
            return b""
        if DeltaCodec.of_tag(s.dtype) is not None:
            return s.sum  # a delta round's sums stay f32: the caller re-encodes (or divides) them
        if overwrite_sums and s.dtype == DTYPE_BF16:
            return f32_to_bf16_in_place(s.sum)
        return encode_f32_as(s.sum, s.dtype)

    def dtype(s: _Slot) -> int:
        # A coded tensor's sums are f32; an empty one (a lane-0 schema tensor, an
        # empty piece) keeps its code, which is what the schema says it is.
        coded = DeltaCodec.of_tag(s.dtype) is not None
        return DTYPE_F32 if coded and math.prod(s.shape) > 0 else s.dtype

    return RoundFrame([TensorPayload(dtype(s), s.shape, encoded(s)) for s in slots], kind, weight)


def shares_sums(acc: FoldAccumulator, frame: RoundFrame) -> bool:
    """Whether ``frame`` (``acc``'s result) still reads any of ``acc``'s sums.

    An f32 result is the sums themselves; a bf16 one was re-encoded into
    arrays of its own, so its sums are free as soon as the frame exists.
    """
    payloads = [t.data for t in frame.tensors if t.data.nbytes]
    return any(np.may_share_memory(s, p) for s in acc.sums() if s is not None for p in payloads)


def sum_frames(frames: Iterable[tuple[str, RoundFrame]]) -> RoundFrame:
    """Fold ``(source, frame)`` pairs; masses summed, values summed, nothing divided."""
    acc = FoldAccumulator()
    for source, frame in frames:
        acc.add(frame, source)
    return acc.result()


def finish_consensus(acc: FoldAccumulator, *, overwrite_sums: bool = False) -> RoundFrame:
    """The controller's divide-once reduce over the accepted contributions.

    Model rounds with accepted mass > 0 are multiplied by the f32-rounded
    reciprocal of the mass; Control rounds and zero-mass rounds are returned
    as sums. The weight sent back is the accepted mass.
    """
    if acc.count == 0 or acc.kind is None:
        raise SchemaError("consensus: no contribution was accepted this round")
    if acc.kind == RoundKind.MODEL and acc.weight > 0:
        reciprocal = np.float32(1.0 / acc.weight)
        with np.errstate(over="ignore", invalid="ignore"):
            for s in acc.sums():
                if s is not None:
                    np.multiply(s, reciprocal, out=s)
    return acc.result(overwrite_sums=overwrite_sums)


__all__ = [
    "DTYPE_BF16",
    "DTYPE_F32",
    "FoldAccumulator",
    "ImageCache",
    "finish_consensus",
    "shares_sums",
    "sum_frames",
]
