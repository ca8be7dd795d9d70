"""Outer optimizers against independent references: torch.optim.SGD for DiLoCo,
a float64 loop for SlowMo, over several windows and both wire dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_trio import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SchemaError,
    TensorPayload,
)
from flodl_trio.errors import ConfigError
from flodl_trio.fold.outer import DiLoCoNesterov, PlainAverage, SlowMo, consensus_as_f32
from flodl_trio.wire.bf16 import bf16_to_f32, f32_to_bf16

SHAPES = [(4, 3), (3,), (), (2, 2, 2)]


def make_frame(values: list[np.ndarray], dtype: int = DTYPE_F32, weight: float = 3.0) -> RoundFrame:
    payloads = []
    for v in values:
        v = np.asarray(v, dtype=np.float32)
        data = v.reshape(-1) if dtype == DTYPE_F32 else f32_to_bf16(v.reshape(-1))
        payloads.append(TensorPayload(dtype, v.shape, data))
    return RoundFrame(payloads, RoundKind.MODEL, weight)


def decode(frame: RoundFrame) -> list[np.ndarray]:
    return consensus_as_f32(frame, copy=True)


def consensus_sequence(windows: int, seed: int = 0) -> list[list[np.ndarray]]:
    """A drifting sequence of window consensuses (like a model being trained)."""
    rng = np.random.default_rng(seed)
    current = [np.asarray(rng.standard_normal(s), dtype=np.float32) for s in SHAPES]
    out = []
    for _ in range(windows):
        current = [np.asarray(c - 0.1 * rng.standard_normal(c.shape), dtype=np.float32) for c in current]
        out.append([c.copy() for c in current])
    return out


def torch_diloco_reference(seq: list[list[np.ndarray]], lr: float, momentum: float) -> list[list[np.ndarray]]:
    """What ranks should receive each window, by torch.optim.SGD(nesterov=True)."""
    params = [torch.nn.Parameter(torch.from_numpy(c.copy())) for c in seq[0]]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)
    out = [[c.copy() for c in seq[0]]]
    for consensus in seq[1:]:
        opt.zero_grad()
        for p, c in zip(params, consensus):
            p.grad = p.detach() - torch.from_numpy(c)
        opt.step()
        out.append([p.detach().numpy().copy() for p in params])
    return out


def slowmo_reference(seq: list[list[np.ndarray]], lr: float, momentum: float) -> list[list[np.ndarray]]:
    """Hand-rolled SlowMo in float64."""
    x = [c.astype(np.float64) for c in seq[0]]
    m = [np.zeros_like(v) for v in x]
    out = [[c.copy() for c in seq[0]]]
    for consensus in seq[1:]:
        for i, c in enumerate(consensus):
            delta = x[i] - c.astype(np.float64)
            m[i] = momentum * m[i] + delta
            x[i] = x[i] - lr * m[i]
        out.append([v.copy() for v in x])
    return out


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.5), (0.3, 0.99)])
def test_diloco_matches_torch_sgd_nesterov(lr, momentum):
    seq = consensus_sequence(6)
    want = torch_diloco_reference(seq, lr, momentum)
    opt = DiLoCoNesterov(lr=lr, momentum=momentum)
    for k, consensus in enumerate(seq):
        frame = make_frame(consensus, weight=5.0 + k)
        got = opt(frame)
        assert got.kind == RoundKind.MODEL and got.weight == 5.0 + k
        assert [t.dtype for t in got.tensors] == [DTYPE_F32] * len(SHAPES)
        assert [t.shape for t in got.tensors] == SHAPES
        for i, (g, w) in enumerate(zip(decode(got), want[k])):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"window {k} tensor {i}")
        if k >= 2:  # from the third window on, momentum moves it off the consensus
            assert not np.allclose(decode(got)[0], consensus[0], rtol=1e-3, atol=1e-4)
    assert opt.windows == 6


def test_diloco_first_window_returns_consensus_unchanged():
    seq = consensus_sequence(1)
    frame = make_frame(seq[0])
    opt = DiLoCoNesterov()
    assert opt(frame) is frame
    state = opt.state_dict()
    for i, c in enumerate(seq[0]):
        np.testing.assert_array_equal(state[f"x_prev.{i}"], c)
        np.testing.assert_array_equal(state[f"momentum.{i}"], np.zeros_like(c))
    assert state["windows"].tolist() == [1]


@pytest.mark.parametrize("lr,momentum", [(1.0, 0.5), (0.8, 0.9), (1.0, 0.0)])
def test_slowmo_matches_hand_rolled_reference(lr, momentum):
    seq = consensus_sequence(7, seed=3)
    want = slowmo_reference(seq, lr, momentum)
    opt = SlowMo(lr=lr, momentum=momentum)
    for k, consensus in enumerate(seq):
        got = decode(opt(make_frame(consensus)))
        for i, (g, w) in enumerate(zip(got, want[k])):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6, err_msg=f"window {k} tensor {i}")


def test_slowmo_without_momentum_at_lr_one_is_plain_averaging():
    seq = consensus_sequence(4, seed=5)
    opt = SlowMo(lr=1.0, momentum=0.0)
    for consensus in seq:
        for g, c in zip(decode(opt(make_frame(consensus))), consensus):
            np.testing.assert_array_equal(g, c)


def test_plain_average_is_identity():
    frame = make_frame(consensus_sequence(1)[0])
    opt = PlainAverage()
    assert opt(frame) is frame
    assert opt.state_dict() == {}
    opt.load_state_dict({})
    with pytest.raises(ConfigError):
        opt.load_state_dict({"x": np.zeros(1)})


@pytest.mark.parametrize("cls", [DiLoCoNesterov, SlowMo])
def test_bf16_wire_decoded_stepped_and_reencoded(cls):
    seq = consensus_sequence(5, seed=11)
    bf16_seq = [[bf16_to_f32(f32_to_bf16(c.reshape(-1))).reshape(c.shape) for c in w] for w in seq]
    ref_f32 = cls(lr=0.6, momentum=0.8)
    opt = cls(lr=0.6, momentum=0.8)
    for k, consensus in enumerate(bf16_seq):
        frame = make_frame(consensus, dtype=DTYPE_BF16)
        got = opt(frame)
        assert [t.dtype for t in got.tensors] == [DTYPE_BF16] * len(SHAPES)
        assert got.weight == frame.weight and got.kind == frame.kind
        # the same math on the (exactly widened) f32 values, then torch's bf16 rounding
        want = decode(ref_f32(make_frame(consensus)))
        for i, (t, w) in enumerate(zip(got.tensors, want)):
            want_bits = torch.from_numpy(w.reshape(-1).copy()).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
            got_bits = np.frombuffer(t.data, dtype="<u2")
            # bit-identical except where f32 op ordering differs by an ulp at a rounding tie
            assert np.mean(got_bits == want_bits) > 0.99, f"window {k} tensor {i}"
            np.testing.assert_allclose(bf16_to_f32(got_bits), w.reshape(-1), rtol=1e-2, atol=1e-2)
    # the master copy stays f32 (not rounded to bf16)
    for key, value in opt.state_dict().items():
        if key.startswith("x_prev."):
            np.testing.assert_allclose(value, ref_f32.state_dict()[key], rtol=1e-6, atol=1e-6)
            assert value.dtype == np.float32


def test_elided_tensors_are_zeros():
    opt_elided = DiLoCoNesterov()
    opt_dense = DiLoCoNesterov()
    seq = consensus_sequence(3, seed=2)
    for consensus in seq:
        consensus = [c.copy() for c in consensus]
        consensus[1][:] = 0.0
        dense = make_frame(consensus)
        elided = RoundFrame(
            [t if i != 1 else TensorPayload(DTYPE_F32, t.shape) for i, t in enumerate(dense.tensors)],
            RoundKind.MODEL,
            dense.weight,
        )
        assert elided.tensors[1].elided
        for a, b in zip(decode(opt_elided(elided)), decode(opt_dense(dense))):
            np.testing.assert_array_equal(a, b)


def test_zero_mass_round_leaves_state_unchanged():
    seq = consensus_sequence(3, seed=4)
    opt = SlowMo()
    opt(make_frame(seq[0]))
    opt(make_frame(seq[1]))
    before = opt.state_dict()
    zero = make_frame(seq[2], weight=0.0)
    assert opt(zero) is zero
    after = opt.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])
    # and the zero-mass frame did not initialize a fresh optimizer either
    fresh = DiLoCoNesterov()
    fresh(zero)
    assert list(fresh.state_dict()) == ["windows"]
    assert fresh.state_dict()["windows"].tolist() == [0]


def test_schema_change_raises_naming_index_and_shapes():
    seq = consensus_sequence(2)
    opt = DiLoCoNesterov()
    opt(make_frame(seq[0]))
    before = opt.state_dict()
    reshaped = [c.copy() for c in seq[1]]
    reshaped[2] = np.zeros((5,), dtype=np.float32)
    with pytest.raises(SchemaError, match=r"tensor 2 has shape \[5\].*holds shape \[\]"):
        opt(make_frame(reshaped))
    with pytest.raises(SchemaError, match=r"3 tensors.*holds 4"):
        opt(make_frame(seq[1][:3]))
    after = opt.state_dict()
    for key in before:  # a refused window changes nothing
        np.testing.assert_array_equal(before[key], after[key])


def test_input_frame_is_not_modified():
    seq = consensus_sequence(3)
    opt = DiLoCoNesterov()
    opt(make_frame(seq[0]))
    frame = make_frame(seq[1])
    snapshot = [bytes(t.data) for t in frame.tensors]
    out = opt(frame)
    assert [bytes(t.data) for t in frame.tensors] == snapshot
    assert out is not frame


@pytest.mark.parametrize("cls", [DiLoCoNesterov, SlowMo])
def test_state_dict_round_trip_continues_identically(cls):
    seq = consensus_sequence(6, seed=9)
    a = cls(lr=0.5, momentum=0.7)
    for consensus in seq[:3]:
        a(make_frame(consensus))
    b = cls(lr=0.5, momentum=0.7)
    b.load_state_dict(a.state_dict())
    assert b.windows == a.windows == 3
    for consensus in seq[3:]:
        for x, y in zip(decode(a(make_frame(consensus))), decode(b(make_frame(consensus)))):
            np.testing.assert_array_equal(x, y)
    # state_dict hands out copies
    state = a.state_dict()
    state["x_prev.0"][:] = 123.0
    assert not np.any(a.state_dict()["x_prev.0"] == 123.0)


def test_load_state_dict_rejects_bad_state():
    opt = SlowMo()
    with pytest.raises(ConfigError, match="windows"):
        opt.load_state_dict({"x_prev.0": np.zeros(2), "momentum.0": np.zeros(2)})
    with pytest.raises(ConfigError, match="unexpected key"):
        opt.load_state_dict({"windows": np.array([1]), "bogus": np.zeros(1)})
    with pytest.raises(ConfigError, match="0..n-1"):
        opt.load_state_dict({"windows": np.array([1]), "x_prev.1": np.zeros(2), "momentum.1": np.zeros(2)})
    with pytest.raises(SchemaError, match=r"tensor 0: x_prev has shape \[2\], momentum has shape \[3\]"):
        opt.load_state_dict({"windows": np.array([1]), "x_prev.0": np.zeros(2), "momentum.0": np.zeros(3)})


def test_hyperparameters_validated():
    with pytest.raises(ConfigError):
        DiLoCoNesterov(lr=0.0)
    with pytest.raises(ConfigError):
        SlowMo(momentum=-0.1)
    with pytest.raises(ConfigError):
        SlowMo(lr=float("nan"))
    assert DiLoCoNesterov().config() == {"type": "DiLoCoNesterov", "lr": 0.7, "momentum": 0.9}
    assert SlowMo().config() == {"type": "SlowMo", "lr": 1.0, "momentum": 0.5}


def test_outer_and_checkpoint_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, flodl_trio.fold.outer, flodl_trio.wire.checkpoint, flodl_trio.controller; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("lanes", [1, 3, 7])
@pytest.mark.parametrize("dtype", [DTYPE_F32, DTYPE_BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("make", [lambda: SlowMo(lr=0.8, momentum=0.5), lambda: DiLoCoNesterov(0.7, 0.9), PlainAverage],
                         ids=["slowmo", "diloco", "plain"])
def test_stepping_lane_by_lane_gives_the_whole_frame_step_bit_for_bit(make, dtype, lanes):
    """With lanes the controller steps each lane's slice as it finishes: over several
    windows (the first only initializing, an elided tensor in one) the lanes, joined,
    are the bytes of the whole-frame step, and the state is the same state."""
    from flodl_trio.wire.lanes import LaneLayout

    whole, laned = make(), make()
    for window, values in enumerate(consensus_sequence(4, seed=lanes)):
        frame = make_frame(values, dtype)
        if window == 2:  # an all-zero tensor, elided on the wire
            frame = RoundFrame([TensorPayload(dtype, (3,)) if i == 1 else t for i, t in enumerate(frame.tensors)],
                               frame.kind, frame.weight)
        layout = LaneLayout.of(frame, lanes)
        want = whole.step(frame, None)
        parts = [laned.step_lane(part, layout, k, None) for k, part in enumerate(layout.split(frame))]
        for got, expect in zip(layout.join(parts).tensors, want.tensors, strict=True):
            assert got.shape == expect.shape and bytes(got.data) == bytes(expect.data), window
    a, b = whole.state_dict(), laned.state_dict()
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_lane_of_another_schema_is_refused_by_the_outer_state():
    from flodl_trio.wire.lanes import LaneLayout

    opt = SlowMo()
    frame = make_frame(consensus_sequence(1)[0])
    layout = LaneLayout.of(frame, 2)
    for k, part in enumerate(layout.split(frame)):
        opt.step_lane(part, layout, k, None)
    other = make_frame([np.zeros((5,), np.float32)])
    with pytest.raises(SchemaError, match="has 1 tensors, the outer state holds 4"):
        opt.step_lane(LaneLayout.of(other, 2).split(other)[0], LaneLayout.of(other, 2), 0, None)


@pytest.mark.parametrize("make", [DiLoCoNesterov, lambda: SlowMo(lr=0.9, momentum=0.5)], ids=["diloco", "slowmo"])
def test_a_shards_lanes_step_to_the_controllers_bytes_and_a_round_decided_again_starts_from_its_state(make):
    """Two shards each step their lanes of a lane-0-empty layout: joined, every window is
    the whole-frame step's bytes. Window 2 is decided twice, first from other values:
    the second decision steps from the state the round started with, as if the first
    had never been."""
    from flodl_trio.fold.outer import ShardLanesOuter
    from flodl_trio.wire.lanes import LaneLayout, lane_owner

    whole, shards = make(), [ShardLanesOuter(make()), ShardLanesOuter(make())]
    for window, values in enumerate(consensus_sequence(4, seed=3)):
        frame = make_frame(values)
        layout = LaneLayout.of(frame, 5, lane0_empty=True)
        want = whole.step(frame, None)
        parts = layout.split(frame)
        if window == 2:  # a first decision of this round, from other contributions
            wrong = layout.split(make_frame([v * 3 + 1 for v in values]))
            for k in range(1, 5):
                shards[lane_owner(k, 2, set())].step(window, wrong[k], layout, k, None)
        got = [parts[0], *(shards[lane_owner(k, 2, set())].step(window, parts[k], layout, k, None)
                           for k in range(1, 5))]
        for a, b in zip(layout.join(got).tensors, want.tensors, strict=True):
            assert bytes(a.data) == bytes(b.data), window
    assert sum(s.lanes_held for s in shards) == 4  # each shard holds its own lanes' state only


@pytest.mark.parametrize("make", [SlowMo, DiLoCoNesterov])
def test_the_shards_lane_states_adopted_by_a_controller_are_its_own_state_dict_bit_for_bit(make):
    """Each shard's lane state after a round's step, sent as a state frame and read back
    (``lane_state_frame`` / ``read_lane_state``), adopted lane by lane into a controller's
    optimizer that counted the shards' windows: its state_dict is the one stepping the
    whole frame there gives, window after window."""
    from flodl_trio.fold.outer import ShardLanesOuter, lane_state_bytes, lane_state_frame, read_lane_state
    from flodl_trio.wire.lanes import LaneLayout, lane_owner
    from flodl_trio.wire.round_frame import decode_round_frame, encode_round_frame_chunks
    from flodl_trio.wire.salt import SessionSalt

    whole, controller, shards = make(), make(), [ShardLanesOuter(make()), ShardLanesOuter(make())]
    salt = SessionSalt(b"\x05" * 16)
    for window, values in enumerate(consensus_sequence(4, seed=5)):
        frame = make_frame(values)
        layout = LaneLayout.of(frame, 5, lane0_empty=True)
        whole.step(frame, None)
        parts = layout.split(frame)
        controller.count_sharded_window(None)
        for k in range(1, 5):
            shard = shards[lane_owner(k, 2, set())]
            stepped = shard.step(window, parts[k], layout, k, None)
            state = lane_state_frame(stepped, len(layout.lanes[k]), shard.lane_state(window, layout, k, None))
            wire = b"".join(bytes(memoryview(c).cast("B")) for c in encode_round_frame_chunks(state, salt).chunks)
            assert len(wire) == lane_state_bytes(layout, k)
            controller.adopt_lane(layout, k, None, read_lane_state(decode_round_frame(wire, salt), layout, k))
        got, want = controller.state_dict(), whole.state_dict()
        assert sorted(got) == sorted(want)
        for key in want:
            assert np.array_equal(got[key], want[key]), (window, key)


def test_a_lane_state_frame_that_is_not_what_the_layout_says_is_refused_naming_the_tensor():
    from flodl_trio.errors import SchemaError
    from flodl_trio.fold.outer import read_lane_state
    from flodl_trio.wire.lanes import LaneLayout

    frame = make_frame(consensus_sequence(1, seed=1)[0])
    layout = LaneLayout.of(frame, 3, lane0_empty=True)
    lane = layout.split(frame)[1]
    with pytest.raises(SchemaError, match="lane 1's outer state has .* tensors, its layout says"):
        read_lane_state(lane, layout, 1)  # the lane itself: no momentum
    pieces = len(layout.lanes[1])
    bf16 = [TensorPayload(DTYPE_BF16, t.shape, bytes(t.nbytes // 2)) for t in lane.tensors[:pieces]]
    doubled = RoundFrame([*lane.tensors[:pieces], *bf16, *lane.tensors[pieces:]], lane.kind, lane.weight)
    with pytest.raises(SchemaError, match=f"tensor {pieces} is dtype {DTYPE_BF16}"):
        read_lane_state(doubled, layout, 1)


@pytest.mark.parametrize(
    "windows", [np.array([], dtype=np.int64), np.array([1, 2]), np.array([-1]), np.array([1.5]), np.array([[3]])[:0]],
    ids=["empty", "two", "negative", "fractional", "empty-2d"],
)
@pytest.mark.parametrize("key", ["windows", "fragment.0.2.windows"])
def test_load_state_dict_refuses_a_window_count_that_is_not_one_count(windows, key):
    """A window count must be one integer >= 0 (a checkpoint's ``outer.windows`` is
    int64[1]): anything else is a ConfigError naming the key (an empty one was an
    IndexError), and the optimizer keeps its state."""
    opt = SlowMo()
    opt(make_frame([np.ones(2, dtype=np.float32)]))
    before = opt.state_dict()
    state = {"windows": np.array([1]), key: windows}
    with pytest.raises(ConfigError, match=f"'{key}' must hold one window count"):
        opt.load_state_dict(state)
    assert opt.state_dict().keys() == before.keys() and opt.windows == 1
