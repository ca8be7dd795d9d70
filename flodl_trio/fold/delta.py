"""The arithmetic of a pseudo-gradient round, with no I/O: quantized deltas and error feedback.

A pseudo-gradient round carries deltas, not params: a rank sends what its
window changed (its params minus the consensus it started the window from,
the *base*), in a blockwise code of :mod:`flodl_trio.wire.quant`; every hop
that decodes sums in f32; the mean delta plus the previous consensus is the
new consensus. The pieces, each used by one role:

- :class:`DeltaUplink` (a rank, or a relay re-encoding its host's sum):
  quantizes a delta after adding back what its previous encode dropped, and
  keeps what this one drops (error feedback: nothing is lost, only late).
- :class:`DeltaSum` (a relay's or the controller's fold): decodes payloads
  into f32 sums, in place, one payload at a time.
- :class:`DeltaDownlink` (the controller): quantizes the new consensus as a
  delta against the base every rank holds, and advances its copy of that base
  exactly as the ranks will (:func:`apply_delta`, the same f32 operations), so
  the ranks and the controller hold the same bits. What the code dropped stays
  in the gap between the consensus and that base, and goes out with the next
  window's delta: the downlink's error feedback needs no residual of its own.

Every array is a 1-d f32 view of one tensor; model-sized work is numpy,
in cache-sized chunks (:mod:`flodl_trio.wire.quant`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SchemaError
from ..wire.quant import F32, Code, F32Array, decode, encode, payload_bytes

Payload = bytearray | memoryview


def _check_shapes(what: str, arrays: Sequence[F32Array], sizes: Sequence[int]) -> None:
    """``arrays`` must be 1-d f32 of ``sizes`` (named by tensor index when not)."""
    if len(arrays) != len(sizes):
        raise SchemaError(f"{what}: {len(arrays)} tensors, expected {len(sizes)}")
    for index, (array, size) in enumerate(zip(arrays, sizes)):
        if array.dtype != F32 or array.ndim != 1 or array.size != size:
            raise SchemaError(
                f"{what}: tensor {index} is {array.dtype} of shape {array.shape}, expected float32 of ({size},)"
            )


class DeltaUplink:
    """Quantizes one delta per window with error feedback (see the module docstring).

    A rank passes its delta pre-multiplied by its realized-work mass, as it does
    its params in a params round, so a fold's sums divide once by the round's
    accepted mass. ``error_feedback=False`` drops what the code cannot carry,
    every window: there only to show what error feedback buys.
    """

    def __init__(self, code: Code, block: int, sizes: Sequence[int], *, error_feedback: bool = True) -> None:
        self.code = code
        self.block = block
        self.sizes = tuple(sizes)
        self.error_feedback = error_feedback
        # What the previous encode dropped, per tensor; a scratch copy holds delta + residual.
        self.residual = [np.zeros(size, dtype=F32) for size in self.sizes]
        self._scratch = [np.empty(size, dtype=F32) for size in self.sizes]

    def payload_sizes(self) -> list[int]:
        return [payload_bytes(self.code, size, self.block) for size in self.sizes]

    def encode(self, deltas: Sequence[F32Array], out: Sequence[Payload]) -> None:
        """Quantize ``deltas`` (plus the residual) into ``out``, one payload per tensor."""
        _check_shapes("delta", deltas, self.sizes)
        for delta, residual, scratch, payload in zip(deltas, self.residual, self._scratch, out):
            if self.error_feedback:
                np.add(delta, residual, out=scratch)
                encode(scratch, payload, self.code, self.block, residual=residual)
            else:
                encode(delta, payload, self.code, self.block)


class DeltaSum:
    """f32 sums of quantized deltas, one per tensor, added one payload at a time."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self.sums = [np.zeros(size, dtype=F32) for size in self.sizes]
        self.count = 0

    def add(self, payloads: Sequence[Payload], code: Code, block: int) -> None:
        """Decode one contributor's payloads into the sums (a wrong length: SchemaError, nothing added)."""
        if len(payloads) != len(self.sizes):
            raise SchemaError(f"a delta of {len(payloads)} tensors, expected {len(self.sizes)}")
        for index, (payload, size) in enumerate(zip(payloads, self.sizes)):
            want = payload_bytes(code, size, block)
            if len(payload) != want:
                raise SchemaError(
                    f"tensor {index}: a {code.value} payload of {size} elements in blocks of {block} "
                    f"has {want} bytes, got {len(payload)}"
                )
        for payload, size, total in zip(payloads, self.sizes, self.sums):
            decode(payload, code, block, size, total, add=True)
        self.count += 1

    def mean(self, mass: float) -> list[F32Array]:
        """The sums divided once by the accepted mass (the contributors pre-multiplied by their weights)."""
        if not mass > 0:
            raise SchemaError(f"a round's accepted mass must be positive, got {mass}")
        return [np.divide(total, np.float32(mass), dtype=F32) for total in self.sums]

    def reset(self) -> None:
        for total in self.sums:
            total.fill(0.0)
        self.count = 0


def apply_delta(base: Sequence[F32Array], payloads: Sequence[Payload], code: Code, block: int) -> None:
    """A rank's side of the downlink: ``base += decoded delta``, in place, per tensor."""
    for array, payload in zip(base, payloads):
        decode(payload, code, block, array.size, array, add=True)


class DeltaDownlink:
    """The controller's downlink: the new consensus as a delta against the ranks' base."""

    def __init__(self, code: Code, block: int, base: Sequence[F32Array]) -> None:
        self.code = code
        self.block = block
        # The base every rank holds, bit for bit (a copy: the caller's arrays stay its own).
        self.base = [np.array(array, dtype=F32, copy=True) for array in base]
        self._scratch = [np.empty_like(array) for array in self.base]

    def encode(self, consensus: Sequence[F32Array], out: Sequence[Payload]) -> None:
        """Quantize ``consensus - base`` into ``out``; the base then advances as each rank's will."""
        _check_shapes("consensus", consensus, [array.size for array in self.base])
        for target, base, scratch, payload in zip(consensus, self.base, self._scratch, out):
            np.subtract(target, base, out=scratch)
            encode(scratch, payload, self.code, self.block)
        apply_delta(self.base, out, self.code, self.block)


__all__ = ["DeltaDownlink", "DeltaSum", "DeltaUplink", "apply_delta"]
