"""The realized-work fold (PROTOCOL.md 4.1): sums in f32, masses summed and never
divided while folding, one division by f32(1 / mass) at the controller.

Every numeric check is bit-exact against a plain numpy reference that does the
same f32 operations in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.errors import SchemaError
from flodl_trio.fold import (
    FoldAccumulator,
    ImageCache,
    finish_consensus,
    shares_sums,
    sum_frames,
)
from flodl_trio.wire import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    bf16_to_f32,
    decode_round_frame,
    encode_round_frame,
    f32_to_bf16,
)

SALT = SessionSalt(b"\x42" * 16)
SHAPES = [(3, 4), (17,), (2, 2, 2)]


def f32_payload(values) -> TensorPayload:
    arr = np.ascontiguousarray(values, dtype="<f4")
    return TensorPayload(DTYPE_F32, arr.shape, arr)


def bf16_payload(values_f32) -> TensorPayload:
    arr = np.ascontiguousarray(values_f32, dtype="<f4")
    return TensorPayload(DTYPE_BF16, arr.shape, f32_to_bf16(arr))


def random_frames(rng, n, dtype, kind=RoundKind.MODEL):
    frames, arrays = [], []
    for r in range(n):
        vals = [(rng.standard_normal(s) * 10).astype(np.float32) for s in SHAPES]
        if dtype == DTYPE_BF16:
            vals = [bf16_to_f32(f32_to_bf16(v)).reshape(v.shape) for v in vals]  # exactly representable
            tensors = [bf16_payload(v) for v in vals]
        else:
            tensors = [f32_payload(v) for v in vals]
        frames.append((f"rank {r}", RoundFrame(tensors, kind, float(r + 1) * 0.5)))
        arrays.append(vals)
    return frames, arrays


def ref_sum(arrays):
    """Sequential f32 sums per tensor position, in fold order."""
    sums = [a.astype(np.float32).copy() for a in arrays[0]]
    for vals in arrays[1:]:
        for s, v in zip(sums, vals):
            s += v.astype(np.float32)
    return sums


def values_of(t: TensorPayload) -> np.ndarray:
    if t.dtype == DTYPE_F32:
        return np.frombuffer(t.data, "<f4").reshape(t.shape)
    return bf16_to_f32(np.frombuffer(t.data, "<u2")).reshape(t.shape)


def bits32(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# -- sums ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5])
def test_sum_frames_f32_bit_exact(n):
    frames, arrays = random_frames(np.random.default_rng(n), n, DTYPE_F32)
    out = sum_frames(frames)
    assert out.kind == RoundKind.MODEL
    assert out.weight == sum(f.weight for _, f in frames)  # masses summed, never divided
    for t, want in zip(out.tensors, ref_sum(arrays)):
        assert t.dtype == DTYPE_F32 and t.shape == want.shape
        np.testing.assert_array_equal(bits32(values_of(t)), bits32(want))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_sum_frames_bf16_accumulates_in_f32(n):
    frames, arrays = random_frames(np.random.default_rng(100 + n), n, DTYPE_BF16)
    acc = FoldAccumulator()
    for source, frame in frames:
        acc.add(frame, source)
    want = ref_sum(arrays)
    for s, w in zip(acc.sums(), want):
        np.testing.assert_array_equal(bits32(s).reshape(-1), bits32(w).reshape(-1))
    out = acc.result()
    assert out.weight == sum(f.weight for _, f in frames)
    for t, w in zip(out.tensors, want):
        assert t.dtype == DTYPE_BF16 and t.nbytes == w.size * 2  # re-encoded in the input dtype
        np.testing.assert_array_equal(np.frombuffer(t.data, "<u2"), f32_to_bf16(w))


def test_bf16_sum_is_not_a_bf16_running_sum():
    """1 + 2**-8 + 2**-8 in f32 then rounded differs from rounding after each add."""
    frames = [
        ("rank 0", RoundFrame([bf16_payload([1.0])], RoundKind.CONTROL, 0.0)),
        ("rank 1", RoundFrame([bf16_payload([2.0**-8])], RoundKind.CONTROL, 0.0)),
        ("rank 2", RoundFrame([bf16_payload([2.0**-8])], RoundKind.CONTROL, 0.0)),
    ]
    out = sum_frames(frames)
    # f32 accumulation: 1 + 2**-7 is exactly representable in bf16 (0x3F81)
    assert np.frombuffer(out.tensors[0].data, "<u2").tolist() == [0x3F81]


def test_elided_tensors_count_as_zeros():
    a = np.array([1.5, -2.0, 3.25], np.float32)
    frames = [
        ("rank 0", RoundFrame([TensorPayload(DTYPE_F32, (3,)), TensorPayload(DTYPE_F32, (2,))], RoundKind.CONTROL, 0.0)),
        ("rank 1", RoundFrame([f32_payload(a), TensorPayload(DTYPE_F32, (2,))], RoundKind.CONTROL, 0.0)),
        ("rank 2", RoundFrame([TensorPayload(DTYPE_F32, (3,)), TensorPayload(DTYPE_F32, (2,))], RoundKind.CONTROL, 0.0)),
    ]
    out = sum_frames(frames)
    assert values_of(out.tensors[0]).tolist() == a.tolist()
    assert out.tensors[1].elided  # everyone elided: still elided (zeros)
    assert out.weight == 0.0


def test_elided_bf16_and_broadcast_from_root():
    root = np.array([[1.0, 2.0], [3.0, -4.0]], np.float32)
    frames = [("rank 1", RoundFrame([TensorPayload(DTYPE_BF16, (2, 2))], RoundKind.CONTROL, 0.0))]
    frames.insert(0, ("rank 0", RoundFrame([bf16_payload(root)], RoundKind.CONTROL, 0.0)))
    frames.append(("rank 2", RoundFrame([TensorPayload(DTYPE_BF16, (2, 2))], RoundKind.CONTROL, 0.0)))
    out = sum_frames(frames)
    assert values_of(out.tensors[0]).tolist() == root.tolist()


def test_fold_copies_payloads_out_of_receive_buffers():
    """The payload lives in a reused receive buffer: the fold must not alias it."""
    raw = bytearray(np.array([1.0, 2.0], "<f4").tobytes())
    acc = FoldAccumulator()
    acc.add(RoundFrame([TensorPayload(DTYPE_F32, (2,), memoryview(raw))], RoundKind.MODEL, 1.0), "rank 0")
    raw[:] = np.array([100.0, 200.0], "<f4").tobytes()
    acc.add(RoundFrame([TensorPayload(DTYPE_F32, (2,), memoryview(raw))], RoundKind.MODEL, 1.0), "rank 1")
    raw[:] = bytes(8)
    assert acc.sums()[0].tolist() == [101.0, 202.0]


def test_fold_of_decoded_frames():
    frames, arrays = random_frames(np.random.default_rng(9), 3, DTYPE_F32)
    decoded = [(s, decode_round_frame(encode_round_frame(f, SALT), SALT)) for s, f in frames]
    out = sum_frames(decoded)
    for t, want in zip(out.tensors, ref_sum(arrays)):
        np.testing.assert_array_equal(bits32(values_of(t)), bits32(want))


def test_fold_overflow_and_nan_are_defined_results():
    big = np.array([3e38, 1.0, np.inf], np.float32)
    frames = [
        ("rank 0", RoundFrame([f32_payload(big)], RoundKind.CONTROL, 0.0)),
        ("rank 1", RoundFrame([f32_payload(np.array([3e38, np.nan, -np.inf], np.float32))], RoundKind.CONTROL, 0.0)),
    ]
    with np.errstate(all="ignore"):
        want = big + np.array([3e38, np.nan, -np.inf], np.float32)
    out = sum_frames(frames)
    got = values_of(out.tensors[0])
    assert got[0] == np.inf and np.isnan(got[1]) and np.isnan(got[2])
    assert np.isnan(want[1]) and np.isnan(want[2])


# -- schema errors ------------------------------------------------------------------------------


def _two(first: RoundFrame, second: RoundFrame):
    acc = FoldAccumulator()
    acc.add(first, "rank 0")
    before = ([None if s is None else s.copy() for s in acc.sums()], acc.weight, acc.count)
    with pytest.raises(SchemaError) as info:
        acc.add(second, "rank 3")
    after = ([None if s is None else s.copy() for s in acc.sums()], acc.weight, acc.count)
    # nothing of the bad frame was added
    assert before[1:] == after[1:]
    for b, a in zip(before[0], after[0]):
        assert (b is None and a is None) or b.tobytes() == a.tobytes()
    return str(info.value)


def test_kind_mismatch():
    msg = _two(
        RoundFrame([f32_payload([1.0])], RoundKind.MODEL, 1.0),
        RoundFrame([f32_payload([1.0])], RoundKind.CONTROL, 0.0),
    )
    assert "rank 3" in msg and "rank 0" in msg and "CONTROL" in msg and "MODEL" in msg


def test_count_mismatch():
    msg = _two(
        RoundFrame([f32_payload([1.0]), f32_payload([2.0])], RoundKind.MODEL, 1.0),
        RoundFrame([f32_payload([1.0])], RoundKind.MODEL, 1.0),
    )
    assert "rank 3" in msg and "1 tensors" in msg and "2" in msg


def test_dtype_mismatch_names_tensor_index():
    msg = _two(
        RoundFrame([f32_payload([1.0]), f32_payload([1.0, 2.0])], RoundKind.MODEL, 1.0),
        RoundFrame([f32_payload([1.0]), bf16_payload([1.0, 2.0])], RoundKind.MODEL, 1.0),
    )
    assert "rank 3 tensor 1" in msg and "bf16" in msg and "f32" in msg


def test_dtype_mismatch_even_when_elided():
    msg = _two(
        RoundFrame([f32_payload([1.0, 2.0])], RoundKind.MODEL, 1.0),
        RoundFrame([TensorPayload(DTYPE_BF16, (2,))], RoundKind.MODEL, 1.0),
    )
    assert "rank 3 tensor 0" in msg


def test_shape_mismatch_names_tensor_index():
    msg = _two(
        RoundFrame([f32_payload([1.0]), f32_payload(np.zeros((2, 3)))], RoundKind.MODEL, 1.0),
        RoundFrame([f32_payload([1.0]), f32_payload(np.zeros((3, 2)))], RoundKind.MODEL, 1.0),
    )
    assert "rank 3 tensor 1" in msg and "[3, 2]" in msg and "[2, 3]" in msg


def test_byte_length_mismatch_names_tensor_index():
    bad = TensorPayload(DTYPE_F32, (4,), bytes(8))
    msg = _two(
        RoundFrame([f32_payload([1.0]), f32_payload(np.zeros(4))], RoundKind.MODEL, 1.0),
        RoundFrame([f32_payload([1.0]), bad], RoundKind.MODEL, 1.0),
    )
    assert "rank 3 tensor 1" in msg and "numel" in msg and "expected 16" in msg and "8 payload bytes" in msg


def test_bad_first_frame_is_refused_too():
    acc = FoldAccumulator()
    with pytest.raises(SchemaError, match=r"rank 0 tensor 0: 6 payload bytes, expected 8"):
        acc.add(RoundFrame([TensorPayload(DTYPE_BF16, (4,), bytes(6))], RoundKind.MODEL, 1.0), "rank 0")
    with pytest.raises(SchemaError, match=r"rank 0 tensor 0: unknown dtype tag 2"):
        acc.add(RoundFrame([TensorPayload(2, (4,), bytes(8))], RoundKind.MODEL, 1.0), "rank 0")
    assert acc.count == 0
    with pytest.raises(SchemaError, match="no frame"):
        acc.result()


def test_sum_frames_reports_the_offending_source():
    good = RoundFrame([f32_payload([1.0, 2.0])], RoundKind.MODEL, 1.0)
    bad = RoundFrame([f32_payload([1.0, 2.0, 3.0])], RoundKind.MODEL, 1.0)
    with pytest.raises(SchemaError, match=r"host h2 ranks \[4, 5\] tensor 0"):
        sum_frames([("host h1 ranks [0]", good), ("host h2 ranks [4, 5]", bad)])


# -- consensus ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [DTYPE_F32, DTYPE_BF16])
def test_finish_consensus_divides_once_by_f32_reciprocal(dtype):
    frames, arrays = random_frames(np.random.default_rng(7 + dtype), 3, dtype)
    acc = FoldAccumulator()
    for s, f in frames:
        acc.add(f, s)
    mass = sum(f.weight for _, f in frames)  # 0.5 + 1.0 + 1.5
    out = finish_consensus(acc)
    assert out.weight == mass == 3.0
    recip = np.float32(1.0 / mass)
    for t, s in zip(out.tensors, ref_sum(arrays)):
        want = s * recip
        assert want.dtype == np.float32
        if dtype == DTYPE_F32:
            np.testing.assert_array_equal(bits32(values_of(t)), bits32(want))
        else:
            np.testing.assert_array_equal(np.frombuffer(t.data, "<u2"), f32_to_bf16(want))


def test_finish_consensus_uses_f32_reciprocal_not_true_division():
    """mass 3: x * f32(1/3) differs from x / 3 for some x; the protocol says multiply."""
    x = np.arange(1, 2001, dtype=np.float32)
    acc = FoldAccumulator()
    acc.add(RoundFrame([f32_payload(x)], RoundKind.MODEL, 3.0), "rank 0")
    out = values_of(finish_consensus(acc).tensors[0])
    want = x * np.float32(1.0 / 3.0)
    np.testing.assert_array_equal(bits32(out), bits32(want))
    assert not np.array_equal(bits32(want), bits32(x / np.float32(3.0)))  # the test can tell them apart


def test_finish_consensus_control_round_is_not_divided():
    frames = [
        ("rank 0", RoundFrame([f32_payload([1.0, 2.0])], RoundKind.CONTROL, 2.0)),
        ("rank 1", RoundFrame([f32_payload([3.0, 5.0])], RoundKind.CONTROL, 3.0)),
    ]
    acc = FoldAccumulator()
    for s, f in frames:
        acc.add(f, s)
    out = finish_consensus(acc)
    assert out.kind == RoundKind.CONTROL
    assert values_of(out.tensors[0]).tolist() == [4.0, 7.0]
    assert out.weight == 5.0


def test_finish_consensus_zero_mass_model_round_is_not_divided():
    acc = FoldAccumulator()
    acc.add(RoundFrame([f32_payload([1.0, 2.0]), TensorPayload(DTYPE_F32, (3,))], RoundKind.MODEL, 0.0), "rank 0")
    acc.add(RoundFrame([f32_payload([3.0, 4.0]), TensorPayload(DTYPE_F32, (3,))], RoundKind.MODEL, 0.0), "rank 1")
    out = finish_consensus(acc)
    assert values_of(out.tensors[0]).tolist() == [4.0, 6.0]
    assert out.tensors[1].elided
    assert out.weight == 0.0


def test_finish_consensus_weight_is_accepted_mass_only():
    """Only the contributions that were added count (a dead rank's frame is never added)."""
    acc = FoldAccumulator()
    acc.add(RoundFrame([f32_payload([2.0])], RoundKind.MODEL, 0.25), "rank 0")
    acc.add(RoundFrame([f32_payload([6.0])], RoundKind.MODEL, 0.75), "rank 2")
    out = finish_consensus(acc)
    assert out.weight == 1.0
    assert values_of(out.tensors[0]).tolist() == [8.0]


def test_finish_consensus_without_contributions():
    with pytest.raises(SchemaError, match="no contribution"):
        finish_consensus(FoldAccumulator())


def test_accumulator_reset_and_reuse():
    acc = FoldAccumulator()
    acc.add(RoundFrame([f32_payload([1.0])], RoundKind.MODEL, 1.0), "rank 0")
    acc.reset()
    assert acc.count == 0 and acc.weight == 0.0 and acc.kind is None
    acc.add(RoundFrame([f32_payload([1.0, 2.0])], RoundKind.CONTROL, 0.0), "rank 0")  # new schema is fine
    assert values_of(acc.result().tensors[0]).tolist() == [1.0, 2.0]


def test_mass_is_summed_in_f64():
    acc = FoldAccumulator()
    weights = [0.1, 0.2, 0.3, 1e-9, 12345.678]
    for i, w in enumerate(weights):
        acc.add(RoundFrame([f32_payload([1.0])], RoundKind.MODEL, w), f"rank {i}")
    total = 0.0
    for w in weights:
        total += w
    assert acc.weight == total
    assert acc.result().weight == total
    assert values_of(acc.result().tensors[0]).tolist() == [5.0]


# -- reusing sum images across rounds ----------------------------------------------------------


def test_image_cache_keeps_whole_rounds_and_matches_them_by_size():
    cache = ImageCache(limit=2)
    a, b, c = (np.empty(n, np.float32) for n in (8, 16, 8))
    cache.give([a, None, b])  # one round: tensor 1 was elided, so it had no image
    cache.give([a, None, b])  # the same round twice is kept once
    cache.give([None, None])  # a round with no image at all is not kept
    assert len(cache) == 1
    assert cache.take([8, 4]) == [None, None]  # another schema: nothing
    assert cache.take([8, 5, 15]) == [None] * 3  # sizes must match exactly
    got = cache.take([8, 5, 16])
    assert got[0] is a and got[1] is None and got[2] is b and cache.reused == 1
    for images in ([a], [b], [c]):
        cache.give(images)
    assert len(cache) == 2  # [a], the oldest, was let go
    assert cache.take([8])[0] is c and cache.take([8])[0] is None


@pytest.mark.parametrize("dtype", [DTYPE_F32, DTYPE_BF16])
def test_fold_into_reused_images_is_bit_identical(dtype):
    """A round folded into images left over from an earlier round (full of its
    sums, here poisoned with NaN) gives exactly the fresh fold: the first frame
    overwrites every element."""
    rng = np.random.default_rng(7 + dtype)
    cache = ImageCache()
    for round_index in range(3):
        frames, _ = random_frames(rng, 3, dtype)
        fresh = FoldAccumulator()
        reused = FoldAccumulator(cache)
        for source, frame in frames:
            fresh.add(frame, source)
            reused.add(frame, source)
        assert cache.reused == round_index
        want, got = finish_consensus(fresh), finish_consensus(reused)
        assert encode_round_frame(got, SALT) == encode_round_frame(want, SALT)
        # An f32 consensus is the sums themselves; a bf16 one was re-encoded.
        assert shares_sums(reused, got) == (dtype == DTYPE_F32)
        images = reused.sums()
        for image in images:
            image.fill(np.nan)
        cache.give(images)


def test_a_kept_round_of_another_shape_is_left_alone():
    cache = ImageCache()
    stale = np.full(5, 9.0, np.float32)
    cache.give([stale])
    acc = FoldAccumulator(cache)
    acc.add(RoundFrame([f32_payload(np.arange(4.0))], RoundKind.MODEL, 1.0), "rank 0")
    assert cache.reused == 0 and len(cache) == 1
    np.testing.assert_array_equal(stale, 9.0)


@pytest.mark.parametrize("n", [1, 3])
def test_spent_sums_give_the_same_frame(n):
    """Rounding bf16 over the sums themselves (no new arrays) changes no byte of the
    result, for bf16, f32 and mixed frames; the frame then aliases the sums."""
    rng = np.random.default_rng(40 + n)
    for dtypes in ([DTYPE_BF16] * 3, [DTYPE_F32] * 3, [DTYPE_BF16, DTYPE_F32, DTYPE_BF16]):
        frames = []
        for r in range(n):
            tensors = []
            for dtype, shape in zip(dtypes, [(70_000,), (17,), (2, 2, 2)]):
                v = (rng.standard_normal(shape) * 10).astype(np.float32)
                v.reshape(-1)[:3] = [np.nan, np.inf, -0.0]
                tensors.append(bf16_payload(v) if dtype == DTYPE_BF16 else f32_payload(v))
            frames.append((f"rank {r}", RoundFrame(tensors, RoundKind.MODEL, 1.5)))
        accs = [FoldAccumulator(), FoldAccumulator()]
        for acc in accs:
            for source, frame in frames:
                acc.add(frame, source)
        want = encode_round_frame(finish_consensus(accs[0]), SALT)
        got = finish_consensus(accs[1], overwrite_sums=True)
        assert encode_round_frame(got, SALT) == want
        assert shares_sums(accs[1], got)
