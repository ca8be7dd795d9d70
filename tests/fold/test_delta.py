"""Pseudo-gradient arithmetic (flodl_trio.fold.delta), I/O-free: deltas quantized with error
feedback on every hop track an f32 run over many windows; without error feedback they do not."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.errors import SchemaError
from flodl_trio.fold.delta import DeltaDownlink, DeltaSum, DeltaUplink, apply_delta
from flodl_trio.wire.quant import Code, payload_bytes

SIZES = (4096, 1000)  # the second is not a multiple of the block: a short last block
BLOCK = 256
RANKS = 4
DRIFT = 1e-3  # what every rank's window moves every element by: far below a 4-bit step


def window_deltas(rng: np.random.Generator) -> list[list[np.ndarray]]:
    """Each rank's delta: a steady drift with noise, and one large value per block, which
    sets the block's scale so the drift alone rounds to zero every single window."""
    deltas = []
    for _rank in range(RANKS):
        tensors = []
        for size in SIZES:
            delta = (DRIFT + rng.normal(0, DRIFT / 4, size)).astype(np.float32)
            spikes = np.arange(0, size, BLOCK) + rng.integers(0, 16, len(range(0, size, BLOCK)))
            delta[np.minimum(spikes, size - 1)] = rng.choice([-1.0, 1.0], len(spikes))
            tensors.append(delta)
        deltas.append(tensors)
    return deltas


def run(code: Code, windows: int, *, error_feedback: bool) -> list[float]:
    """The largest distance from the f32 run's consensus after each window."""
    rng = np.random.default_rng(7)
    exact = [np.zeros(size, np.float32) for size in SIZES]
    held = [np.zeros(size, np.float32) for size in SIZES]  # what every rank holds (the compressed consensus)
    uplinks = [DeltaUplink(code, BLOCK, SIZES, error_feedback=error_feedback) for _ in range(RANKS)]
    downlink = DeltaDownlink(code, BLOCK, held)
    consensus = [np.zeros(size, np.float32) for size in SIZES]
    payloads = [bytearray(n) for n in uplinks[0].payload_sizes()]
    down = [bytearray(n) for n in uplinks[0].payload_sizes()]
    fold = DeltaSum(SIZES)
    gaps = []
    for _window in range(windows):
        deltas = window_deltas(rng)
        for tensors, mean in zip(zip(*deltas), exact):
            mean += np.mean(tensors, axis=0, dtype=np.float32)
        fold.reset()
        for uplink, delta in zip(uplinks, deltas):
            uplink.encode(delta, payloads)
            fold.add(payloads, code, BLOCK)
        for x, mean in zip(consensus, fold.mean(RANKS)):  # the controller's consensus: previous + mean delta
            x += mean
        downlink.encode(consensus, down)
        apply_delta(held, down, code, BLOCK)
        if not error_feedback:  # the controller forgets what its downlink dropped
            consensus = [h.copy() for h in held]
        gaps.append(max(float(np.max(np.abs(h - e))) for h, e in zip(held, exact)))
    return gaps


@pytest.mark.parametrize("code", [Code.INT8, Code.INT4, Code.FP4])
def test_with_error_feedback_the_compressed_run_stays_within_a_few_steps_of_the_f32_run(code):
    gaps = run(code, 400, error_feedback=True)
    step = 1.0 / code.max_level  # the largest block value is about 1: one code step
    assert max(gaps) < step, (code, max(gaps))
    assert max(gaps[200:]) < 1.5 * max(gaps[:200]) + 1e-6, "the gap does not grow with the windows"


def test_without_error_feedback_the_drift_is_lost_and_the_gap_grows_with_the_windows():
    gaps = run(Code.INT4, 400, error_feedback=False)
    assert gaps[-1] > 400 * DRIFT * 0.8  # nearly all of the f32 run's drift never arrived
    assert gaps[-1] > 1.5 * gaps[199] and gaps[199] > gaps[99]
    with_feedback = run(Code.INT4, 400, error_feedback=True)
    assert gaps[-1] > 2 * max(with_feedback)


def test_the_ranks_and_the_controller_hold_the_same_bits_after_every_downlink():
    rng = np.random.default_rng(3)
    base = [rng.normal(size=size).astype(np.float32) for size in SIZES]
    rank_copy = [b.copy() for b in base]
    downlink = DeltaDownlink(Code.FP4, BLOCK, base)
    out = [bytearray(payload_bytes(Code.FP4, size, BLOCK)) for size in SIZES]
    for _ in range(20):
        target = [b + rng.normal(0, 0.01, b.size).astype(np.float32) for b in downlink.base]
        downlink.encode(target, out)
        apply_delta(rank_copy, out, Code.FP4, BLOCK)
        assert all(np.array_equal(r, c) for r, c in zip(rank_copy, downlink.base))
    assert all(not np.shares_memory(b, c) for b, c in zip(base, downlink.base))  # the caller's arrays stay its own


def test_a_payload_of_the_wrong_length_names_the_tensor_and_adds_nothing():
    fold = DeltaSum(SIZES)
    good = bytearray(payload_bytes(Code.INT8, SIZES[0], BLOCK))
    with pytest.raises(SchemaError, match=r"tensor 1: a int8 payload of 1000 elements in blocks of 256 has 1016 bytes, got 5"):
        fold.add([good, bytearray(5)], Code.INT8, BLOCK)
    assert fold.count == 0 and all(not s.any() for s in fold.sums)


def test_a_delta_of_the_wrong_shape_names_the_tensor():
    uplink = DeltaUplink(Code.INT8, BLOCK, SIZES)
    out = [bytearray(n) for n in uplink.payload_sizes()]
    with pytest.raises(SchemaError, match=r"tensor 1 is float64 of shape \(1000,\)"):
        uplink.encode([np.zeros(4096, np.float32), np.zeros(1000)], out)
    with pytest.raises(SchemaError, match="mass must be positive"):
        DeltaSum(SIZES).mean(0.0)


def test_the_joiners_frame_keeps_its_bytes_while_the_base_advances():
    """The controller keeps a joiner's state (signed, read as it is) while later rounds
    advance the base in place: the frame must hold a copy, not the base itself."""
    from flodl_trio.fold.delta import DeltaLineage
    from flodl_trio.wire.quant import DeltaCodec
    from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload

    lineage = DeltaLineage()
    start = np.arange(8, dtype=np.float32)
    lineage.downlink_frame(RoundFrame([TensorPayload(0, (8,), start)], RoundKind.MODEL, 1.0), None)
    kept = lineage.joiner_frame(1.0)
    before = bytes(kept.tensors[0].data)
    moved = RoundFrame([TensorPayload(0, (8,), start + 1)], RoundKind.MODEL, 1.0)
    lineage.downlink_frame(moved, DeltaCodec.parse("int8:256"))
    assert not np.array_equal(lineage.base[0], start)  # the base did advance
    assert bytes(kept.tensors[0].data) == before



@pytest.mark.parametrize("lanes", [1, 3, 7])
def test_a_relay_coding_lane_by_lane_sends_the_bytes_and_keeps_the_residual_of_whole_coding(lanes):
    """PendingHostDelta.lane over every lane, window after window, equals .whole() cut
    into lanes: the same coded bytes piece for piece, the same error feedback carried on."""
    from flodl_trio.fold.delta import HostDeltaUplink
    from flodl_trio.wire import RoundFrame, RoundKind, TensorPayload
    from flodl_trio.wire.lanes import LaneLayout
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec

    codec = DeltaCodec.parse("fp4:256")
    schema = (RoundKind.MODEL, (*((codec.tag, (n,)) for n in SIZES), (DTYPE_BASE_DIGEST, (DIGEST_LEN,))))
    whole_side, lane_side = HostDeltaUplink(), HostDeltaUplink()
    rng = np.random.default_rng(5)
    for _ in range(4):
        sums = [rng.standard_t(3, n).astype(np.float32) for n in SIZES]
        summed = RoundFrame([*(TensorPayload(0, (n,), s) for n, s in zip(SIZES, sums)),
                             TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), bytes(range(DIGEST_LEN)))],
                            RoundKind.MODEL, 3.0)
        pending = lane_side.pending(schema, summed)
        layout = LaneLayout.of(pending.schema_frame(), lanes)
        want = layout.split(whole_side.encode(schema, summed))
        got = [pending.lane(pieces, layout.trailer(k)) for k, pieces in enumerate(layout.lanes)]
        for w, g in zip(want, got):
            assert [(t.dtype, tuple(t.shape), bytes(t.data)) for t in w.tensors] == \
                   [(t.dtype, tuple(t.shape), bytes(t.data)) for t in g.tensors]


def test_a_delta_against_the_right_base_but_of_other_shapes_is_its_relays_fault_not_the_controllers():
    """Relays that all send deltas of other shapes than the lineage's params, under the
    right digest (no honest rank can), are refused at the deposit, naming the relay:
    the mean of such deltas could not be added to the params (it used to stop the controller)."""
    from flodl_trio.fold.delta import DeltaLineage
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec
    from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload

    lineage = DeltaLineage()
    lineage.downlink_frame(RoundFrame([TensorPayload(0, (8,), np.arange(8, dtype=np.float32))], RoundKind.MODEL, 1.0), None)
    codec = DeltaCodec.parse("int8:256")
    digest = TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), lineage.digest)
    same = RoundFrame([TensorPayload(codec.tag, (8,), b""), digest], RoundKind.MODEL, 1.0)
    lineage.check_base(same, "relay a")  # the lineage's shapes: fine
    other = RoundFrame([TensorPayload(codec.tag, (9,), b""), digest], RoundKind.MODEL, 1.0)
    with pytest.raises(SchemaError, match=r"relay b's delta has tensors of shapes \[\(9,\)\]; .* \[\(8,\)\]"):
        lineage.check_base(other, "relay b")


def test_a_lane_zero_declaring_other_shapes_than_the_lineages_is_its_relays_fault():
    from flodl_trio.fold.delta import DeltaLineage
    from flodl_trio.wire.lanes import LaneLayout
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec
    from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload

    lineage = DeltaLineage()
    lineage.downlink_frame(RoundFrame([TensorPayload(0, (512,), np.zeros(512, np.float32))], RoundKind.MODEL, 1.0), None)
    codec = DeltaCodec.parse("int8:256")
    digest = TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), lineage.digest)

    def lane0(n: int) -> RoundFrame:
        coded = TensorPayload(codec.tag, (n,), bytes(TensorPayload(codec.tag, (n,)).expected_nbytes()))
        frame = RoundFrame([coded, digest], RoundKind.MODEL, 1.0)
        return LaneLayout.of(frame, 2, 0).split(frame)[0]

    lineage.check_base(lane0(512), "relay a")
    with pytest.raises(SchemaError, match=r"relay b's delta has tensors of shapes \[\(600,\)\]"):
        lineage.check_base(lane0(600), "relay b")
