"""Blockwise quantization of f32 deltas: int8, and two 4-bit codes, vectorised.

A quantized payload is the deltas of one tensor in blocks of ``block``
elements (the last block may be shorter): first every block's f32 scale,
then the codes. A block's scale is its largest magnitude divided by the
code's largest level, so every block uses its code's full range and a block
of zeros is all zeros; decoding is ``code_level * scale``.

- **int8**: levels -127..127, one byte each (two's complement).
- **int4**: levels -7..7, two per byte (low nibble first), stored as
  ``level + 8``.
- **fp4** (E2M1): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit, two
  per byte (low nibble first): finer near zero, where most of a delta's
  values are.

Encoding rounds to the nearest level (ties to even for int8 and int4, to the
lower magnitude for fp4) and can write what it dropped into a
residual array in the same pass: the error feedback a caller adds to its next
window's delta. Work goes block by block through cache-sized chunks with
preallocated scratch, so a model-sized tensor costs a few in-cache passes.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, SchemaError

F32 = np.dtype("<f4")
F32Array = npt.NDArray[np.float32]
CHUNK = 1 << 16  # elements per pass: 256 KiB of f32 plus scratch fits L2


class Code(enum.Enum):
    INT8 = "int8"
    INT4 = "int4"
    FP4 = "fp4"

    @property
    def max_level(self) -> float:
        return {Code.INT8: 127.0, Code.INT4: 7.0, Code.FP4: 6.0}[self]

    @property
    def bits(self) -> int:
        return 8 if self is Code.INT8 else 4


# The 4-bit codes' levels by nibble. int4: nibble = level + 8 (nibble 0 unused, 0.0).
# fp4: bit 3 is the sign, bits 0-2 index the E2M1 magnitudes.
_FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F32)
_NIBBLE_LEVELS = {
    Code.INT4: np.array([0.0, *range(-7, 8)], dtype=F32),
    Code.FP4: np.concatenate([_FP4_MAGNITUDES, -_FP4_MAGNITUDES]).astype(F32),
}
# Encoding gives every element a one-byte key, then looks up each pair of keys (read
# as one little-endian uint16) in a table holding their packed byte: sign, nearest
# level and packing in one gather (a numpy gather costs about what three arithmetic
# passes do, so fewer passes is what makes the 4-bit codes fast).
# int4: the key is the nibble. fp4: the key is ceil(4 |x|) (clipped to 24) plus 32 for
# a negative x. The nearest fp4 magnitude of |x| is the number of midpoints between
# neighbouring levels (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) strictly below |x|, ties
# going to the lower level; every midpoint is a multiple of 1/4, so that count depends
# only on ceil(4 |x|).
_FP4_MIDPOINTS = ((_FP4_MAGNITUDES[1:] + _FP4_MAGNITUDES[:-1]) / 2).astype(F32)
_FP4_SIGN_KEY = 32
_FP4_TOP_QUARTERS = int(4 * _FP4_MAGNITUDES[-1])  # the largest magnitude's key


def _fp4_nibble_of_key(key: int) -> int:
    quarters, negative = key % _FP4_SIGN_KEY, key >= _FP4_SIGN_KEY
    magnitude = int(np.count_nonzero(4 * _FP4_MIDPOINTS <= quarters - 1))
    return magnitude | (8 if negative and magnitude else 0)  # -0 is 0


def _pair_table(code: Code) -> npt.NDArray[np.uint8]:
    """Packed byte of every pair of keys, indexed by ``low_key + 256 * high_key``."""
    keys = 16 if code is Code.INT4 else 2 * _FP4_SIGN_KEY
    nibble = np.array([k if code is Code.INT4 else _fp4_nibble_of_key(k) for k in range(keys)], dtype=np.uint8)
    table = np.zeros((keys, 256), dtype=np.uint8)
    table[:, :keys] = nibble[:, None] << 4 | nibble[None, :]
    return table.reshape(-1)


def _byte_levels(code: Code) -> npt.NDArray[np.uint64]:
    """Both levels of every byte as one 8-byte word (low nibble's f32 first in memory),
    so a decode gathers two values per lookup."""
    levels = _NIBBLE_LEVELS[code]
    byte = np.arange(256)
    return np.stack([levels[byte & 0xF], levels[byte >> 4]], axis=1).astype(F32).view(np.uint64).reshape(-1)


_PAIR_TABLES = {code: _pair_table(code) for code in (Code.INT4, Code.FP4)}
_BYTE_LEVELS = {code: _byte_levels(code) for code in (Code.INT4, Code.FP4)}
_PAD_KEY = {Code.INT4: 8, Code.FP4: 0}  # the key of level 0, padding an odd count


# A delta payload's dtype tag on the wire (docs/wire.md, "Delta rounds"): bit 7 set,
# the code in bits 4-6, log2 of the block in bits 0-3 (blocks of 256-4096 elements).
DELTA_TAG_BIT = 0x80
_CODE_OF_INDEX = (Code.INT8, Code.INT4, Code.FP4)
MIN_BLOCK, MAX_BLOCK = 256, 4096
# The base digest: the last tensor of every delta-round frame, 16 bytes.
DTYPE_BASE_DIGEST = 0x7F
DIGEST_LEN = 16


class CodecTextError(ConfigError, SchemaError):
    """A codec text that names no codec (:meth:`DeltaCodec.parse`): the caller's bad
    argument, a :class:`ConfigError`. Also a :class:`SchemaError`, which it was
    before, for callers that still catch that (the demo's ``--codec`` check)."""


@attrs.frozen
class DeltaCodec:
    """A delta code and its block size: what a pseudo-gradient round's payloads use."""

    code: Code = attrs.field(converter=Code)
    block: int = 1024

    def __attrs_post_init__(self) -> None:
        if self.block not in _BLOCKS:
            raise SchemaError(f"delta block {self.block} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}")

    @property
    def tag(self) -> int:
        return DELTA_TAG_BIT | _CODE_OF_INDEX.index(self.code) << 4 | self.block.bit_length() - 1

    @classmethod
    def of_tag(cls, tag: int) -> DeltaCodec | None:
        """The codec a dtype tag names (None: not a delta tag, or not one this version reads)."""
        index, log2 = (tag >> 4) & 0x7, tag & 0xF
        if not tag & DELTA_TAG_BIT or index >= len(_CODE_OF_INDEX) or (1 << log2) not in _BLOCKS:
            return None
        return cls(_CODE_OF_INDEX[index], 1 << log2)

    @classmethod
    def parse(cls, text: str) -> DeltaCodec:
        """``int8``, ``fp4``, ``int4``, optionally ``:BLOCK`` (default: 1024 for int8, 256 for 4-bit).
        A text that names no codec is the caller's argument error: ConfigError."""
        name, _, block = str(text).partition(":")
        try:
            code = Code(name)
        except ValueError:
            raise CodecTextError(f"unknown delta code {name!r} in {text!r} (int8, int4 or fp4)") from None
        if not block:
            return cls(code, 1024 if code is Code.INT8 else 256)
        if not block.isdigit():
            raise CodecTextError(f"delta block {block!r} in {text!r} is not a number")
        if int(block) not in _BLOCKS:
            raise CodecTextError(f"delta block {block} in {text!r} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}")
        return cls(code, int(block))

    def payload_bytes(self, numel: int) -> int:
        return payload_bytes(self.code, numel, self.block)

    def __str__(self) -> str:
        return f"{self.code.value}:{self.block}"


_BLOCKS = frozenset(1 << k for k in range(MIN_BLOCK.bit_length() - 1, MAX_BLOCK.bit_length()))


def base_digest(base: Sequence[F32Array]) -> bytes:
    """What identifies a delta round's base: a 16-byte BLAKE2b of its tensors' f32 bytes, in order."""
    h = hashlib.blake2b(digest_size=DIGEST_LEN)
    for array in base:
        h.update(np.ascontiguousarray(array, dtype=F32).reshape(-1).view(np.uint8).data)
    return h.digest()


def block_count(numel: int, block: int) -> int:
    return -(-numel // block)


def code_bytes(code: Code, numel: int) -> int:
    return numel if code is Code.INT8 else (numel + 1) // 2


def payload_bytes(code: Code, numel: int, block: int) -> int:
    """Bytes of a quantized payload of ``numel`` elements: the scales, then the codes."""
    return 4 * block_count(numel, block) + code_bytes(code, numel)


def _check_block(block: int) -> None:
    if block <= 0 or block % 2 or CHUNK % block:
        raise SchemaError(f"quantization block {block} must be even and divide {CHUNK}")


def _split(payload: memoryview | bytearray, code: Code, numel: int, block: int) -> tuple[F32Array, npt.NDArray[np.uint8]]:
    """The scales and the codes of a payload, as views."""
    want = payload_bytes(code, numel, block)
    if len(payload) != want:
        raise SchemaError(
            f"a {code.value} payload of {numel} elements in blocks of {block} has {want} bytes, got {len(payload)}"
        )
    raw = np.frombuffer(payload, dtype=np.uint8)
    n_scales = 4 * block_count(numel, block)
    return raw[:n_scales].view(F32), raw[n_scales:]


def encode(
    values: F32Array, payload: memoryview | bytearray, code: Code, block: int, *, residual: F32Array | None = None
) -> None:
    """Quantize ``values`` (1-d f32) into ``payload`` (exactly :func:`payload_bytes` long);
    with ``residual``, also write ``values - decoded`` there (it may be ``values`` itself)."""
    _check_block(block)
    numel = len(values)
    scales, codes = _split(payload, code, numel, block)
    scratch = np.empty(CHUNK, dtype=F32)
    keys = None if code is Code.INT8 else _KeyScratch()
    for start in range(0, numel, CHUNK):
        stop = min(start + CHUNK, numel)
        chunk = values[start:stop]
        first_block = start // block
        chunk_scales = scales[first_block:first_block + block_count(stop - start, block)]
        _block_scales(chunk, block, code.max_level, chunk_scales)
        if not np.isfinite(chunk_scales).all():  # a block's max is NaN or inf iff it holds one
            raise SchemaError(f"cannot quantize a delta holding a NaN or an infinity (near element {start}; {code.value})")
        levels = scratch[: stop - start]
        _divide_by_block(chunk, chunk_scales, block, levels)
        if code is Code.INT8:
            np.rint(levels, out=levels)
            np.clip(levels, -127, 127, out=levels)
            codes[start:stop] = levels.astype(np.int8).view(np.uint8)
        else:
            assert keys is not None
            packed = codes[start // 2:(stop + 1) // 2]
            _pack_pairs(keys.of(levels, code), code, packed)
            if residual is not None:
                _levels_of_nibbles(packed, code, levels)
        if residual is not None:
            _times_block_scale(levels, chunk_scales, block, out=levels)
            np.subtract(chunk, levels, out=residual[start:stop])


def decode(payload: memoryview | bytearray, code: Code, block: int, numel: int, out: F32Array, *, add: bool = False) -> None:
    """Decode a payload into ``out`` (1-d f32 of ``numel``); with ``add``, add it to ``out``
    instead (a fold sums deltas without a temporary)."""
    _check_block(block)
    scales, codes = _split(payload, code, numel, block)
    scratch = np.empty(CHUNK, dtype=F32)
    for start in range(0, numel, CHUNK):
        stop = min(start + CHUNK, numel)
        first_block = start // block
        chunk_scales = scales[first_block:first_block + block_count(stop - start, block)]
        levels = scratch[: stop - start]
        if code is Code.INT8:
            levels[:] = codes[start:stop].view(np.int8)
        else:
            _levels_of_nibbles(codes[start // 2:(stop + 1) // 2], code, levels)
        if add:
            _times_block_scale(levels, chunk_scales, block, out=levels)
            out[start:stop] += levels
        else:
            _times_block_scale(levels, chunk_scales, block, out=out[start:stop])


def _block_scales(chunk: F32Array, block: int, max_level: float, out: F32Array) -> None:
    """Each block's largest magnitude / ``max_level`` (0 for a block of zeros)."""
    full = len(chunk) // block * block
    if full:
        np.abs(chunk[:full]).reshape(-1, block).max(axis=1, out=out[: full // block])
    if full < len(chunk):
        out[-1] = np.abs(chunk[full:]).max()
    out /= np.float32(max_level)


def _divide_by_block(chunk: F32Array, scales: F32Array, block: int, out: F32Array) -> None:
    """``chunk / scale`` of its block, element by element (0 where the scale is 0: such
    a block is all zeros). A true division, not a product with ``1 / scale``: the
    inverse of a subnormal scale overflows to inf."""
    divisors = np.where(scales > 0, scales, np.float32(1.0))
    full = len(chunk) // block * block
    if full:
        np.divide(chunk[:full].reshape(-1, block), divisors[: full // block, None], out=out[:full].reshape(-1, block))
    if full < len(chunk):
        np.divide(chunk[full:], divisors[-1], out=out[full:])


def _times_block_scale(levels: F32Array, scales: F32Array, block: int, *, out: F32Array) -> None:
    """``level * scale`` of its block, element by element."""
    full = len(levels) // block * block
    if full:
        np.multiply(levels[:full].reshape(-1, block), scales[: full // block, None], out=out[:full].reshape(-1, block))
    if full < len(levels):
        np.multiply(levels[full:], scales[-1], out=out[full:])


class _KeyScratch:
    """Preallocated per-chunk arrays for the 4-bit codes' keys."""

    def __init__(self) -> None:
        self.work = np.empty(CHUNK, dtype=F32)
        self.keys = np.empty(CHUNK + 2, dtype=np.uint8)  # room for an odd count's padding
        self.signs = np.empty(CHUNK, dtype=np.bool_)

    def of(self, scaled: F32Array, code: Code) -> npt.NDArray[np.uint8]:
        """Each scaled value's key (see ``_pair_table``), padded to an even count."""
        n = len(scaled)
        work, keys = self.work[:n], self.keys[: n + n % 2]
        if code is Code.INT4:
            np.rint(scaled, out=work)
            np.clip(work, -7, 7, out=work)
            work += np.float32(8)
            np.copyto(keys[:n], work, casting="unsafe")
        else:
            np.abs(scaled, out=work)
            work *= np.float32(4)
            np.ceil(work, out=work)
            np.clip(work, 0, _FP4_TOP_QUARTERS, out=work)
            np.copyto(keys[:n], work, casting="unsafe")
            signs = np.signbit(scaled, out=self.signs[:n]).view(np.uint8)
            signs *= np.uint8(_FP4_SIGN_KEY)
            keys[:n] |= signs
        if n % 2:
            keys[n] = _PAD_KEY[code]
        return keys


def _pack_pairs(keys: npt.NDArray[np.uint8], code: Code, out: npt.NDArray[np.uint8]) -> None:
    """An even count of keys -> their packed bytes, two nibbles per byte, low first."""
    np.take(_PAIR_TABLES[code], keys.view("<u2"), out=out, mode="clip")


def _levels_of_nibbles(packed: npt.NDArray[np.uint8], code: Code, out: F32Array) -> None:
    """Packed nibbles -> their levels (one 8-byte gather per byte, two values at once)."""
    table = _BYTE_LEVELS[code]
    even = len(out) // 2 * 2
    np.take(table, packed[: even // 2], out=out[:even].view(np.uint64), mode="clip")
    if even < len(out):
        last = int(packed[-1])
        out[-1] = table[last:last + 1].view(F32)[0]  # the low nibble's level


__all__ = [
    "CHUNK",
    "DIGEST_LEN",
    "DTYPE_BASE_DIGEST",
    "Code",
    "DeltaCodec",
    "base_digest",
    "block_count",
    "code_bytes",
    "decode",
    "encode",
    "payload_bytes",
]
