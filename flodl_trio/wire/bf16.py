"""bf16 <-> f32 conversion and payload scaling, bit-identical to torch except NaN payloads.

f32 -> bf16 rounds to nearest, ties to even, on the raw bits; a NaN keeps its
top 16 bits with the quiet bit (0x0040) forced so it stays a NaN (the
protocol's rule; torch's own kernels write 0xFFFF or 0x7FC0 depending on the
CPU path, so no implementation can match torch's NaN bits). bf16 -> f32 is exact. Work is done in cache-sized blocks with preallocated scratch so a
64 MiB tensor costs a few passes over L2 rather than a dozen over DRAM.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..errors import SchemaError
from .constants import DTYPE_BF16, DTYPE_F32

F32 = np.dtype("<f4")
U16 = np.dtype("<u2")
U32 = np.dtype("<u4")
BLOCK = 1 << 16  # elements per block: 256 KiB of f32, fits L2 with scratch

ITEMSIZE = {DTYPE_F32: 4, DTYPE_BF16: 2}
DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_BF16: "bf16"}


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype; SchemaError for an unknown tag."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise SchemaError(f"unknown wire dtype tag {dtype} (0 = f32, 1 = bf16)") from None


def _round_block(
    bits: npt.NDArray[np.uint32],
    values: npt.NDArray[np.float32],
    out: npt.NDArray[np.uint16],
    tmp: npt.NDArray[np.uint32],
    nan: npt.NDArray[np.bool_],
) -> None:
    """Round one block of f32 bit patterns to bf16 into ``out`` (same length).

    ``bits`` and ``values`` are the same memory seen as u32 and f32; ``tmp``
    and ``nan`` are scratch of at least the block's length. Four in-cache
    passes for the rounding, one for the narrowing store, and a max()
    reduction (NaN-propagating, SIMD) that keeps the exact NaN fix-up off the
    common path.
    """
    # (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, in wrapping u32 math. No
    # non-NaN pattern overflows: the largest, 0xFF800000 (-inf), stays far
    # below 2**32 - 0x8000.
    np.right_shift(bits, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, bits, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.right_shift(tmp, 16, out=out, casting="unsafe")
    if not np.isnan(values.max()):
        return
    # Rare path: a NaN keeps its top 16 bits with the quiet bit forced.
    np.isnan(values, out=nan)
    np.right_shift(bits, 16, out=tmp)
    np.bitwise_or(tmp, 0x0040, out=tmp)
    np.copyto(out, tmp, where=nan, casting="unsafe")


class _Scratch:
    """Per-call scratch for blocked conversions (two small arrays, reused per block)."""

    __slots__ = ("nan", "tmp", "wide")

    def __init__(self, n: int) -> None:
        width = max(1, min(BLOCK, n))
        self.tmp = np.empty(width, dtype=U32)
        self.wide = np.empty(width, dtype=U32)
        self.nan = np.empty(width, dtype=bool)


def f32_to_bf16(
    src: npt.NDArray[np.float32], out: npt.NDArray[np.uint16] | None = None
) -> npt.NDArray[np.uint16]:
    """Round f32 values to bf16 bit patterns exactly as ``Tensor.to(torch.bfloat16)``."""
    values = np.ascontiguousarray(src).reshape(-1)
    bits = values.view(U32)
    values = bits.view(F32)
    if out is None:
        out = np.empty(bits.size, dtype=U16)
    flat_out = out.reshape(-1)
    scratch = _Scratch(bits.size)
    for start in range(0, bits.size, BLOCK):
        stop = min(start + BLOCK, bits.size)
        n = stop - start
        _round_block(
            bits[start:stop], values[start:stop], flat_out[start:stop], scratch.tmp[:n], scratch.nan[:n]
        )
    return out


def f32_to_bf16_in_place(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Round f32 values to bf16 (as :func:`f32_to_bf16`) over the first half of their
    own memory, returned as a u16 view: no new model-sized block. The f32 values
    are gone afterwards.

    Block by block, each block's input copied to scratch first: its output
    (bytes ``[2a, 2b)``) may overlap its own input (``[4a, 4b)``) but never a
    later block's.
    """
    if not values.flags.c_contiguous:
        raise ValueError("f32_to_bf16_in_place needs a contiguous array (a copy would defeat it)")
    flat = values.reshape(-1)
    bits_all = flat.view(U32)
    out = flat.view(U16)[: flat.size]
    scratch = _Scratch(flat.size)
    block = np.empty(max(1, min(BLOCK, flat.size)), dtype=U32)
    for start in range(0, flat.size, BLOCK):
        stop = min(start + BLOCK, flat.size)
        n = stop - start
        np.copyto(block[:n], bits_all[start:stop])
        _round_block(block[:n], block[:n].view(F32), out[start:stop], scratch.tmp[:n], scratch.nan[:n])
    return out


def bf16_to_f32(src: npt.NDArray[np.uint16], out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
    """Widen bf16 bit patterns to f32 (exact: the pattern becomes the top 16 bits)."""
    flat = np.ascontiguousarray(src).reshape(-1)
    if out is None:
        out = np.empty(flat.size, dtype=F32)
    wide = out.reshape(-1).view(U32)
    np.left_shift(flat, 16, out=wide, dtype=U32, casting="unsafe")
    return out


def add_bf16_into(acc: npt.NDArray[np.float32], src: npt.NDArray[np.uint16]) -> None:
    """``acc += widen(src)`` in f32, blockwise, without a full-size widened copy."""
    acc_flat = acc.reshape(-1)
    src_flat = np.ascontiguousarray(src).reshape(-1)
    if acc_flat.size != src_flat.size:
        raise SchemaError(f"bf16 add: {src_flat.size} elements into an accumulator of {acc_flat.size}")
    wide = np.empty(max(1, min(BLOCK, src_flat.size)), dtype=U32)
    wide_f = wide.view(F32)
    for start in range(0, src_flat.size, BLOCK):
        stop = min(start + BLOCK, src_flat.size)
        n = stop - start
        np.left_shift(src_flat[start:stop], 16, out=wide[:n], dtype=U32, casting="unsafe")
        np.add(acc_flat[start:stop], wide_f[:n], out=acc_flat[start:stop])


def payload_as_f32(data: memoryview | bytes | bytearray | np.ndarray, dtype: int) -> npt.NDArray[np.float32]:
    """A payload's values as f32: a zero-copy view for f32, a widened copy for bf16."""
    if dtype == DTYPE_F32:
        return np.frombuffer(data, dtype=F32)
    if dtype == DTYPE_BF16:
        return bf16_to_f32(np.frombuffer(data, dtype=U16))
    itemsize(dtype)  # raises the named error
    raise AssertionError("unreachable")


def encode_f32_as(values: npt.NDArray[np.float32], dtype: int) -> npt.NDArray[np.generic]:
    """Re-encode f32 values in a wire dtype (f32: the array itself, no copy)."""
    if dtype == DTYPE_F32:
        return values
    if dtype == DTYPE_BF16:
        return f32_to_bf16(values)
    itemsize(dtype)
    raise AssertionError("unreachable")


def scale_payload(data: bytearray | memoryview | np.ndarray, dtype: int, factor: float) -> None:
    """Multiply a payload by ``f32(factor)`` in place, like torch's ``mul`` on that dtype.

    torch computes a float or bfloat16 scalar multiply in f32 with the scalar
    rounded to f32, then rounds to the tensor dtype; so does this.
    """
    f = np.float32(factor)
    with np.errstate(over="ignore", invalid="ignore"):
        _scale_in_place(data, dtype, f)


def _scale_in_place(data: bytearray | memoryview | np.ndarray, dtype: int, f: np.float32) -> None:
    if dtype == DTYPE_F32:
        view = np.frombuffer(data, dtype=F32)
        np.multiply(view, f, out=view)
        return
    if dtype == DTYPE_BF16:
        view16 = np.frombuffer(data, dtype=U16)
        scratch = _Scratch(view16.size)
        wide_f = scratch.wide.view(F32)
        for start in range(0, view16.size, BLOCK):
            stop = min(start + BLOCK, view16.size)
            n = stop - start
            bits, values = scratch.wide[:n], wide_f[:n]
            np.left_shift(view16[start:stop], 16, out=bits, dtype=U32, casting="unsafe")
            np.multiply(values, f, out=values)
            _round_block(bits, values, view16[start:stop], scratch.tmp[:n], scratch.nan[:n])
        return
    itemsize(dtype)
