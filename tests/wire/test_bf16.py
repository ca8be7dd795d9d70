"""bf16 <-> f32 conversion and payload scaling, bit-identical to torch (PROTOCOL.md 4.2).

Every comparison is on bit patterns (uint16 / uint32 views), never on float
values, so signed zeros, subnormals, ties and NaN payloads are all distinguished.

NaN inputs that produce a bf16 result are tested separately. torch's own bf16
NaN output is not a function of the input bits: with torch 2.13 on a vectorized
CPU build, ``Tensor.to(torch.bfloat16)`` writes 0xFFFF for every NaN, a bf16
``mul`` writes 0xFFFF in the SIMD body and 0x7FC0 in the scalar tail of the
same call (so which one depends on array length and position), and with
ATEN_CPU_CAPABILITY=default both write 0x7FC0. No conversion can match that
bit for bit, so for NaN inputs the tests require: NaN exactly where torch gives
NaN, and the documented payload-preserving rule of PROTOCOL.md 4.2
(top 16 bits | 0x0040). f32 results (bf16 -> f32, f32 scaling) are compared
bit for bit including NaN payloads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_trio.errors import SchemaError
from flodl_trio.wire import (
    DTYPE_BF16,
    DTYPE_F32,
    bf16_to_f32,
    f32_to_bf16,
    payload_as_f32,
    scale_payload,
)
from flodl_trio.wire.bf16 import BLOCK, encode_f32_as, f32_to_bf16_in_place, itemsize

N_RANDOM = 1_000_000


# -- inputs ----------------------------------------------------------------------


def _specials_f32() -> np.ndarray:
    """Hand-picked f32 bit patterns: zeros, infinities, extremes, subnormals, ties, NaNs."""
    positive = [
        0x00000000,  # +0
        0x7F800000,  # +inf
        0x7F7FFFFF,  # max finite: rounds up to inf in bf16
        0x7F7F7FFF,  # just below the tie under max: stays finite 0x7F7F
        0x7F7F8000,  # exact tie, odd bit 16 -> rounds up to inf
        0x7F7F8001,
        0x7F7E8000,  # exact tie, even bit 16 -> stays 0x7F7E
        0x7F7EFFFF,
        0x7F7F0000,  # largest finite bf16 exactly
        0x00000001,  # smallest subnormal
        0x00007FFF,
        0x00008000,  # subnormal tie, even
        0x00008001,
        0x00018000,  # subnormal tie, odd
        0x007FFFFF,  # largest subnormal: rounds to min normal
        0x007F8000,
        0x00800000,  # min normal
        0x3F800000,  # 1.0
        0x3F808000,  # 1 + tie, even
        0x3F818000,  # tie, odd
        0x3F807FFF,
        0x3F808001,
        0x4B7FFFFF,
        0x3EAAAAAB,  # 1/3
        0x7F800001,  # smallest signalling NaN payload
        0x7F8000FF,
        0x7F807FFF,  # sNaN whose top 16 bits are just the inf pattern
        0x7F808000,
        0x7F80FFFF,
        0x7F810000,
        0x7FA12345,
        0x7FBFFFFF,  # largest signalling NaN
        0x7FC00000,  # canonical quiet NaN
        0x7FC00001,
        0x7FC08000,
        0x7FE00000,
        0x7FFF8000,
        0x7FFFFFFF,
    ]
    bits = np.array(positive, dtype=np.uint32)
    return np.concatenate([bits, bits | np.uint32(0x80000000)])


def _ties_f32(rng: np.random.Generator, n: int = 200_000) -> np.ndarray:
    """Values whose low 16 bits are exactly 0x8000, half with even and half with odd bit 16."""
    hi = rng.integers(0, 1 << 16, size=n, dtype=np.uint32)
    hi[: n // 2] &= np.uint32(0xFFFE)
    hi[n // 2 :] |= np.uint32(1)
    return (hi << np.uint32(16)) | np.uint32(0x8000)


def _random_nans_f32(rng: np.random.Generator, n: int = 50_000) -> np.ndarray:
    """NaN bit patterns: random sign and mantissa, half signalling (bit 22 clear), half quiet."""
    mant = rng.integers(1, 1 << 23, size=n, dtype=np.uint32)
    mant[: n // 2] &= np.uint32(0x3FFFFF)
    mant[: n // 2] |= np.uint32(1)  # keep signalling NaNs non-zero (not inf)
    mant[n // 2 :] |= np.uint32(0x400000)
    sign = rng.integers(0, 2, size=n, dtype=np.uint32) << np.uint32(31)
    return sign | np.uint32(0x7F800000) | mant


@pytest.fixture(scope="module")
def f32_bits() -> np.ndarray:
    """More than 1,000,000 f32 bit patterns (uniform random bits + specials + ties + NaNs)."""
    rng = np.random.default_rng(20240517)
    out = np.concatenate(
        [
            rng.integers(0, 1 << 32, size=N_RANDOM, dtype=np.uint32),
            _specials_f32(),
            _ties_f32(rng),
            _random_nans_f32(rng),
        ]
    )
    assert out.size > 1_000_000
    return out


def _is_nan_bits32(bits: np.ndarray) -> np.ndarray:
    return (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)


def _is_nan_bits16(bits: np.ndarray) -> np.ndarray:
    return (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def _torch_f32_to_bf16(bits: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(bits.view(np.float32).copy())
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _torch_bf16_to_f32(bits16: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(bits16.view(np.int16).copy()).view(torch.bfloat16)
    return t.float().view(torch.int32).numpy().view(np.uint32)


def _assert_bits_equal(got: np.ndarray, want: np.ndarray, inputs: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    bad = np.flatnonzero(got != want)
    if bad.size:
        width = inputs.dtype.itemsize * 2
        shown = ", ".join(
            f"in=0x{int(inputs[i]):0{width}X} got=0x{int(got[i]):X} torch=0x{int(want[i]):X}" for i in bad[:8]
        )
        pytest.fail(f"{what}: {bad.size} of {got.size} bit patterns differ from torch, e.g. {shown}")


# -- f32 -> bf16 ------------------------------------------------------------------


def test_f32_to_bf16_matches_torch_non_nan(f32_bits):
    bits = f32_bits[~_is_nan_bits32(f32_bits)]
    assert bits.size > 1_000_000 - 10_000
    got = f32_to_bf16(bits.view(np.float32))
    _assert_bits_equal(got, _torch_f32_to_bf16(bits), bits, "f32_to_bf16 (non-NaN inputs)")


def test_f32_to_bf16_nans_are_nans_where_torch_gives_nans(f32_bits):
    bits = f32_bits[_is_nan_bits32(f32_bits)]
    assert bits.size > 50_000
    got = f32_to_bf16(bits.view(np.float32))
    want = _torch_f32_to_bf16(bits)
    assert _is_nan_bits16(want).all()
    assert _is_nan_bits16(got).all()


def test_f32_to_bf16_nan_rule_of_the_spec(f32_bits):
    """The documented rule: NaN keeps its top 16 bits with 0x0040 OR-ed in, and stays a NaN."""
    bits = f32_bits[_is_nan_bits32(f32_bits)]
    got = f32_to_bf16(bits.view(np.float32))
    want = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    _assert_bits_equal(got, want, bits, "f32_to_bf16 NaN rule")
    assert _is_nan_bits16(got).all()


def test_f32_to_bf16_formula_non_nan(f32_bits):
    """Round to nearest, ties to even: (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 (wrapping u32)."""
    bits = f32_bits[~_is_nan_bits32(f32_bits)]
    want = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )
    _assert_bits_equal(f32_to_bf16(bits.view(np.float32)), want, bits, "f32_to_bf16 formula")


@pytest.mark.parametrize(
    ("f32", "bf16"),
    [
        (0x00000000, 0x0000),
        (0x80000000, 0x8000),
        (0x7F800000, 0x7F80),
        (0xFF800000, 0xFF80),
        (0x7F7FFFFF, 0x7F80),  # max finite f32 overflows to inf
        (0xFF7FFFFF, 0xFF80),
        (0x7F7F8000, 0x7F80),  # tie, odd -> up (to inf)
        (0x7F7E8000, 0x7F7E),  # tie, even -> stays
        (0x3F808000, 0x3F80),  # tie, even -> down
        (0x3F818000, 0x3F82),  # tie, odd -> up
        (0x3F808001, 0x3F81),
        (0x00008000, 0x0000),  # subnormal tie, even
        (0x00018000, 0x0002),  # subnormal tie, odd
        (0x00000001, 0x0000),
        (0x007FFFFF, 0x0080),  # largest subnormal -> min normal
        (0x7FC00000, 0x7FC0),
        (0x7F800001, 0x7FC0),  # sNaN: quiet bit forced
        (0xFFA12345, 0xFFE1),
    ],
)
def test_f32_to_bf16_known_patterns(f32, bf16):
    got = f32_to_bf16(np.array([f32], np.uint32).view(np.float32))
    assert got.dtype == np.uint16
    assert int(got[0]) == bf16


def test_f32_to_bf16_out_param_blocks_and_shapes():
    rng = np.random.default_rng(1)
    n = 3 * BLOCK + 17  # several blocks plus a ragged tail
    bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint32)
    values = bits.view(np.float32).reshape(n, 1)
    out = np.empty(n, np.uint16)
    assert f32_to_bf16(values, out=out) is out
    _assert_bits_equal(out, f32_to_bf16(bits.view(np.float32)), bits, "out= path")
    # non-contiguous input
    strided = bits.view(np.float32)[::3]
    _assert_bits_equal(f32_to_bf16(strided), f32_to_bf16(strided.copy()), bits[::3], "strided input")
    assert f32_to_bf16(np.empty(0, np.float32)).size == 0


# -- bf16 -> f32 --------------------------------------------------------------------


def test_bf16_to_f32_every_pattern_matches_torch():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = bf16_to_f32(every).view(np.uint32)
    _assert_bits_equal(got, _torch_bf16_to_f32(every), every, "bf16_to_f32 (all 65536 patterns)")
    _assert_bits_equal(got, every.astype(np.uint32) << np.uint32(16), every, "bf16_to_f32 = bits << 16")


def test_bf16_to_f32_million_random_matches_torch():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=N_RANDOM + 12_345, dtype=np.uint16)
    got = bf16_to_f32(bits).view(np.uint32)
    _assert_bits_equal(got, _torch_bf16_to_f32(bits), bits, "bf16_to_f32 (random)")
    out = np.empty(bits.size, np.float32)
    assert bf16_to_f32(bits, out=out) is out
    _assert_bits_equal(out.view(np.uint32), got, bits, "bf16_to_f32 out=")


def test_bf16_round_trip_is_exact_for_bf16_values():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = f32_to_bf16(bf16_to_f32(every))
    non_nan = ~_is_nan_bits16(every)
    _assert_bits_equal(back[non_nan], every[non_nan], every[non_nan], "bf16 -> f32 -> bf16")
    # quiet NaNs survive unchanged; signalling ones come back quieted
    nan = every[~non_nan]
    _assert_bits_equal(back[~non_nan], nan | np.uint16(0x0040), nan, "bf16 NaN round trip")


# -- scale_payload ------------------------------------------------------------------

SEED_VALS = [0.7314426, -1.9023375, 3.017882e-3, -42.52386]
SEED_W = 0.8349217


@pytest.mark.parametrize(
    ("torch_dtype", "tag"), [(torch.float32, DTYPE_F32), (torch.bfloat16, DTYPE_BF16)], ids=["f32", "bf16"]
)
def test_fused_byte_scale_matches_mul_scalar(torch_dtype, tag):
    t = torch.tensor(SEED_VALS, dtype=torch_dtype)
    want = t.mul(SEED_W)
    raw = bytearray(t.view(torch.uint8).numpy().tobytes())
    scale_payload(raw, tag, SEED_W)
    assert bytes(raw) == want.view(torch.uint8).numpy().tobytes()


def _scales() -> list[float]:
    rng = np.random.default_rng(99)
    picked = [SEED_W, 1.0 / 3.0, -2.5, 1e-30, 7.123e20]
    picked += [float(s) for s in rng.choice([-1.0, 1.0], 3) * np.exp(rng.uniform(-20, 20, 3))]
    return picked


@pytest.fixture(scope="module")
def bf16_bits() -> np.ndarray:
    rng = np.random.default_rng(4242)
    random = rng.integers(0, 1 << 16, size=N_RANDOM, dtype=np.uint16)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    return np.concatenate([random, every])


@pytest.mark.parametrize("w", _scales())
def test_scale_payload_f32_matches_torch_mul(f32_bits, w):
    """All >1M f32 patterns (NaNs included: an f32 multiply keeps the quieted payload)."""
    t = torch.from_numpy(f32_bits.view(np.float32).copy())
    want = t.mul(w).view(torch.int32).numpy().view(np.uint32)
    raw = bytearray(f32_bits.tobytes())
    with np.errstate(all="ignore"):
        scale_payload(raw, DTYPE_F32, w)
    _assert_bits_equal(np.frombuffer(raw, np.uint32), want, f32_bits, f"scale_payload f32 x {w!r}")


def _torch_bf16_mul(bits16: np.ndarray, w: float) -> np.ndarray:
    t = torch.from_numpy(bits16.view(np.int16).copy()).view(torch.bfloat16)
    return t.mul(w).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("w", _scales())
def test_scale_payload_bf16_matches_torch_mul_non_nan(bf16_bits, w):
    bits = bf16_bits[~_is_nan_bits16(bf16_bits)]
    want = _torch_bf16_mul(bits, w)
    raw = bytearray(bits.tobytes())
    with np.errstate(all="ignore"):
        scale_payload(raw, DTYPE_BF16, w)
    _assert_bits_equal(np.frombuffer(raw, np.uint16), want, bits, f"scale_payload bf16 x {w!r} (non-NaN)")


@pytest.mark.parametrize("w", [SEED_W, -2.5, 1e-30])
def test_scale_payload_bf16_nans_where_torch_gives_nans(bf16_bits, w):
    """NaN inputs: NaN out exactly where torch's bf16 mul gives NaN, with the documented payload rule."""
    bits = bf16_bits[_is_nan_bits16(bf16_bits)]
    want = _torch_bf16_mul(bits, w)
    raw = bytearray(bits.tobytes())
    with np.errstate(all="ignore"):
        scale_payload(raw, DTYPE_BF16, w)
    got = np.frombuffer(raw, np.uint16)
    assert _is_nan_bits16(want).all()
    # NaN * w keeps the (quieted) payload in f32; rounding back keeps the top 16 bits | 0x0040.
    _assert_bits_equal(got, bits | np.uint16(0x0040), bits, f"scale_payload bf16 x {w!r} (NaN payload rule)")


def test_scale_payload_bf16_nan_stays_nan(bf16_bits):
    bits = bf16_bits[_is_nan_bits16(bf16_bits)]
    raw = bytearray(bits.tobytes())
    with np.errstate(all="ignore"):
        scale_payload(raw, DTYPE_BF16, -3.0)
    assert _is_nan_bits16(np.frombuffer(raw, np.uint16)).all()


def test_scale_payload_accepts_numpy_and_memoryview_buffers():
    vals = np.array(SEED_VALS, np.float32)
    want = torch.from_numpy(vals.copy()).mul(SEED_W).numpy()
    arr = vals.copy()
    scale_payload(arr.view(np.uint8), DTYPE_F32, SEED_W)
    assert arr.tobytes() == want.tobytes()
    buf = bytearray(vals.tobytes())
    scale_payload(memoryview(buf), DTYPE_F32, SEED_W)
    assert bytes(buf) == want.tobytes()


def test_scale_payload_bf16_spans_blocks():
    rng = np.random.default_rng(5)
    n = 2 * BLOCK + 3
    vals = rng.standard_normal(n).astype(np.float32)
    t = torch.from_numpy(vals).to(torch.bfloat16)
    want = t.mul(0.37).view(torch.int16).numpy().tobytes()
    raw = bytearray(t.view(torch.int16).numpy().tobytes())
    scale_payload(raw, DTYPE_BF16, 0.37)
    assert bytes(raw) == want


# -- helpers and unknown dtypes ---------------------------------------------------------


def test_payload_as_f32_and_encode_f32_as():
    vals = np.array([1.0, -2.5, 0.0, 42.0], np.float32)
    as_f32 = payload_as_f32(vals.tobytes(), DTYPE_F32)
    assert as_f32.tobytes() == vals.tobytes()
    bf = f32_to_bf16(vals)
    assert payload_as_f32(bf.tobytes(), DTYPE_BF16).tobytes() == vals.tobytes()
    assert encode_f32_as(vals, DTYPE_F32) is vals
    assert encode_f32_as(vals, DTYPE_BF16).tobytes() == bf.tobytes()
    assert itemsize(DTYPE_F32) == 4 and itemsize(DTYPE_BF16) == 2


@pytest.mark.parametrize("bad", [2, 7, 255])
def test_unknown_dtype_tags_are_schema_errors(bad):
    with pytest.raises(SchemaError, match="dtype"):
        itemsize(bad)
    with pytest.raises(SchemaError, match="dtype"):
        payload_as_f32(b"\0" * 8, bad)
    with pytest.raises(SchemaError, match="dtype"):
        encode_f32_as(np.zeros(2, np.float32), bad)
    with pytest.raises(SchemaError, match="dtype"):
        scale_payload(bytearray(8), bad, 2.0)


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 3])
def test_rounding_in_place_matches_the_copying_rounding(n):
    """Over the first half of the values' own memory, block boundaries included:
    random bit patterns (every NaN, inf and subnormal kind) and forced ties."""
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits[::5] = (bits[::5] & 0xFFFF0000) | 0x8000  # exact ties, both parities
    values = bits.view(np.float32)
    want = f32_to_bf16(values.copy())
    got = f32_to_bf16_in_place(values)
    assert np.array_equal(got, want)
    assert np.shares_memory(got, values) and got.size == n


def test_rounding_in_place_refuses_a_strided_array():
    with pytest.raises(ValueError, match="contiguous"):
        f32_to_bf16_in_place(np.zeros(10, np.float32)[::2])
