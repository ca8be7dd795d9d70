"""Blockwise quantization (flodl_trio.wire.quant): bounds, residuals, layout, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_trio.errors import SchemaError
from flodl_trio.wire.quant import CHUNK, Code, decode, encode, payload_bytes

CODES = list(Code)


def roundtrip(values: np.ndarray, code: Code, block: int) -> tuple[bytearray, np.ndarray, np.ndarray]:
    payload = bytearray(payload_bytes(code, len(values), block))
    residual = np.empty_like(values)
    encode(values, payload, code, block, residual=residual)
    out = np.empty_like(values)
    decode(payload, code, block, len(values), out)
    return payload, out, residual


def block_scales(values: np.ndarray, block: int, code: Code) -> np.ndarray:
    """Each element's block scale, computed independently in float64."""
    pad = (-len(values)) % block
    blocks = np.abs(np.concatenate([values, np.zeros(pad, values.dtype)])).astype(np.float64).reshape(-1, block)
    return np.repeat(blocks.max(axis=1) / code.max_level, block)[: len(values)]


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.value)
@pytest.mark.parametrize("numel", [1, 7, 256, 257, CHUNK + 3, 3 * CHUNK])
def test_every_element_is_within_half_a_step_and_the_residual_is_what_was_dropped(code, numel):
    values = (np.random.default_rng(numel).standard_t(3, numel) * 1e-3).astype("<f4")
    _payload, out, residual = roundtrip(values, code, 256)
    scale = block_scales(values, 256, code)
    # The widest gap between neighbouring levels: 1 (int8, int4) or 2 (fp4, between 4 and 6).
    widest = 2.0 if code is Code.FP4 else 1.0
    assert (np.abs(values.astype(np.float64) - out) <= widest / 2 * scale * (1 + 1e-5) + 1e-12).all()
    np.testing.assert_array_equal(residual, values - out)


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.value)
def test_zeros_and_each_blocks_largest_value_come_back_exactly(code):
    values = np.zeros(1000, dtype="<f4")
    values[300], values[700] = -2.5e-3, 7.0
    _payload, out, residual = roundtrip(values, code, 256)
    assert out[300] == pytest.approx(-2.5e-3, rel=1e-6) and out[700] == pytest.approx(7.0, rel=1e-6)
    mask = np.ones(1000, bool)
    mask[[300, 700]] = False
    assert (out[mask][:256] == 0).all() and (out[768:] == 0).all()  # blocks with only zeros stay zero
    assert (out[512:768] == 0).sum() == 255  # block 2: 7.0 plus zeros
    assert np.isfinite(residual).all()


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.value)
def test_the_layout_is_the_scales_then_the_codes(code):
    top = code.max_level  # block 0's scale is exactly 1: its levels are the values themselves
    values = np.array([top, -top / 2, 0.25, 0.0], dtype="<f4")
    payload, _out, _res = roundtrip(values, code, 2)
    scales = np.frombuffer(payload[:8], dtype="<f4")
    np.testing.assert_allclose(scales, [1.0, 0.25 / top], rtol=1e-6)
    assert len(payload) == 8 + (4 if code is Code.INT8 else 2)
    if code is Code.INT8:
        assert list(np.frombuffer(payload[8:], dtype=np.int8)) == [127, -64, 127, 0]  # -63.5 ties to even
    if code is Code.INT4:
        assert list(payload[8:]) == [(8 - 4) << 4 | (8 + 7), 8 << 4 | (8 + 7)]  # -3.5 ties to even (-4)
    if code is Code.FP4:
        assert list(payload[8:]) == [(8 | 5) << 4 | 7, 0 << 4 | 7]  # 6 is magnitude 7; -3 is sign | 5


def test_decode_adds_into_an_accumulator():
    values = np.linspace(-1, 1, 513, dtype="<f4")
    payload, out, _ = roundtrip(values, Code.INT8, 256)
    acc = np.full_like(values, 10.0)
    decode(payload, Code.INT8, 256, len(values), acc, add=True)
    np.testing.assert_array_equal(acc, np.float32(10.0) + out)


def test_the_residual_may_overwrite_the_values_in_place():
    values = np.random.default_rng(1).standard_normal(1000).astype("<f4")
    copy = values.copy()
    payload = bytearray(payload_bytes(Code.FP4, 1000, 256))
    encode(values, payload, Code.FP4, 256, residual=values)
    out = np.empty_like(values)
    decode(payload, Code.FP4, 256, 1000, out)
    np.testing.assert_array_equal(values, copy - out)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_delta_is_refused_with_where_it_is(bad):
    values = np.zeros(CHUNK + 10, dtype="<f4")
    values[CHUNK + 5] = bad
    with pytest.raises(SchemaError, match=f"near element {CHUNK}"):
        encode(values, bytearray(payload_bytes(Code.INT8, len(values), 256)), Code.INT8, 256)


def test_a_payload_of_the_wrong_length_is_refused_naming_both_counts():
    with pytest.raises(SchemaError, match="1024 elements in blocks of 256 has 1040 bytes, got 1027"):
        decode(bytearray(1027), Code.INT8, 256, 1024, np.empty(1024, "<f4"))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=600),
    st.sampled_from(CODES),
    st.sampled_from([2, 16, 256]),
)
def test_any_finite_delta_round_trips_within_its_blocks_bound(values, code, block):
    array = np.array(values, dtype="<f4")
    _payload, out, residual = roundtrip(array, code, block)
    widest = 2.0 if code is Code.FP4 else 1.0
    bound = widest / 2 * block_scales(array, block, code) * (1 + 1e-5) + 1e-30
    assert (np.abs(array.astype(np.float64) - out) <= bound).all()
    np.testing.assert_array_equal(residual, array - out)


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.value)
def test_a_block_of_subnormal_deltas_keeps_its_bound(code):
    """A block whose largest magnitude is subnormal has a scale whose inverse overflows
    f32: the codes come from a true division, never inf * 0 = nan."""
    tiny = np.float32(1e-39)  # subnormal: 1 / (tiny / 7) is inf in f32
    array = np.array([tiny, -tiny / 2, 0.0, tiny / 3] * 64 + [1.0] * 256, dtype="<f4")
    with np.errstate(over="raise", invalid="raise"):
        _payload, out, residual = roundtrip(array, code, 256)
    widest = 2.0 if code is Code.FP4 else 1.0
    bound = widest / 2 * block_scales(array, 256, code) * (1 + 1e-5) + 1e-45
    assert np.isfinite(out).all()
    assert (np.abs(array.astype(np.float64) - out) <= bound).all()
    np.testing.assert_array_equal(residual, array - out)


def reference_level(x: float, code: Code) -> float:
    """The nearest level of one scaled value, the slow obvious way (the codes' rounding rules)."""
    if code is Code.INT4:
        return float(np.clip(np.rint(x), -7, 7))
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # nearest magnitude, a tie going to the lower one (min keeps the first of equals)
    best = min(magnitudes, key=lambda m: abs(abs(x) - m))
    return -best if x < 0 and best else best


@pytest.mark.parametrize("code", [Code.INT4, Code.FP4], ids=lambda c: c.value)
@pytest.mark.parametrize("numel_extra", [0, 1])  # an even and an odd count of codes
def test_every_eighth_of_a_level_step_rounds_as_the_reference_does(code, numel_extra):
    """Every multiple of 1/8 in the code's range (each tie between two levels among
    them) with the block's scale exactly 1: the decoded value is the reference level."""
    top = code.max_level
    grid = np.arange(-8 * top, 8 * top + 1) / 8
    values = np.concatenate([grid, [top] * (1 + numel_extra)]).astype("<f4")
    _payload, out, residual = roundtrip(values, code, 256)  # one block
    expected = np.array([reference_level(float(x), code) for x in values], dtype="<f4")
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(residual, values - expected)
