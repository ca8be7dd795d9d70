"""bf16 <-> f32 conversion and payload scaling, bit-identical to torch.

f32 -> bf16 rounds to nearest, ties to even, on the raw bits; a NaN keeps its
top 16 bits with the quiet bit (0x0040) forced so it stays a NaN. bf16 -> f32
is exact. Work is done in cache-sized blocks with preallocated scratch so a
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


def f32_to_bf16(
    src: npt.NDArray[np.float32], out: npt.NDArray[np.uint16] | None = None
) -> npt.NDArray[np.uint16]:
    """Round f32 values to bf16 bit patterns exactly as ``Tensor.to(torch.bfloat16)``."""
    bits = np.ascontiguousarray(src).reshape(-1).view(U32)
    if out is None:
        out = np.empty(bits.size, dtype=U16)
    flat_out = out.reshape(-1)
    width = min(BLOCK, bits.size)
    rounded = np.empty(width, dtype=U32)
    magnitude = np.empty(width, dtype=U32)
    is_nan = np.empty(width, dtype=bool)
    for start in range(0, bits.size, BLOCK):
        block = bits[start:start + BLOCK]
        n = block.size
        tmp, mag, nan = rounded[:n], magnitude[:n], is_nan[:n]
        # tmp = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, in wrapping u32 math
        np.right_shift(block, 16, out=tmp)
        np.bitwise_and(tmp, 1, out=tmp)
        np.add(tmp, 0x7FFF, out=tmp)
        np.add(tmp, block, out=tmp)
        np.right_shift(tmp, 16, out=tmp)
        np.bitwise_and(block, 0x7FFFFFFF, out=mag)
        np.greater(mag, 0x7F800000, out=nan)
        if nan.any():
            np.copyto(tmp, (block >> 16) | 0x0040, where=nan)
        flat_out[start:start + n] = tmp
    return out


def bf16_to_f32(src: npt.NDArray[np.uint16], out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
    """Widen bf16 bit patterns to f32 (exact: the pattern becomes the top 16 bits)."""
    flat = np.ascontiguousarray(src).reshape(-1)
    if out is None:
        out = np.empty(flat.size, dtype=F32)
    wide = out.reshape(-1).view(U32)
    np.left_shift(flat, 16, out=wide, dtype=U32, casting="unsafe")
    return out


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
    if dtype == DTYPE_F32:
        view = np.frombuffer(data, dtype=F32)
        np.multiply(view, f, out=view)
        return
    if dtype == DTYPE_BF16:
        view16 = np.frombuffer(data, dtype=U16)
        for start in range(0, view16.size, BLOCK):
            block = view16[start:start + BLOCK]
            wide = bf16_to_f32(block)
            np.multiply(wide, f, out=wide)
            f32_to_bf16(wide, out=block)
        return
    itemsize(dtype)
