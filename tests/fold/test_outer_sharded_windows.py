"""The controller's optimizer when the shards step its lanes: its window count moves with
every window they stepped (copied or not), survives ``state_dict``/``load_state_dict``,
and the schema of the rounds they step is checked here before they step them
(docs/outer-and-checkpoints.md, "Shards", "State", "Guards"; docs/wire.md,
"Checkpoints with shards")."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.errors import SchemaError
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo
from flodl_trio.wire.constants import DTYPE_F32
from flodl_trio.wire.fragment import FragmentTag
from flodl_trio.wire.lanes import LaneLayout
from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload


def _frame(values: list[np.ndarray]) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, v.shape, v) for v in values], RoundKind.MODEL, 2.0)


@pytest.mark.parametrize("make", [SlowMo, DiLoCoNesterov])
def test_windows_the_shards_stepped_move_the_count_without_state(make):
    opt = make()
    for expected in range(1, 4):
        opt.count_sharded_window(None)
        assert opt.windows == expected
        assert sorted(opt.state_dict()) == ["windows"]
        assert opt.state_dict()["windows"].tolist() == [expected]
    assert not opt.holds_state


def test_a_fragmented_runs_sharded_windows_count_in_the_total():
    opt = DiLoCoNesterov()
    for window in range(5):
        opt.count_sharded_window(FragmentTag(window % 2, 2))
    assert opt.windows == 5
    assert sorted(opt.state_dict()) == ["windows"] and opt.state_dict()["windows"].tolist() == [5]


def test_the_count_survives_a_state_dict_round_trip_and_goes_on():
    opt = DiLoCoNesterov()
    for _ in range(3):
        opt.count_sharded_window(None)
    again = DiLoCoNesterov()
    again.load_state_dict(opt.state_dict())
    assert again.windows == 3 and not again.holds_state
    again.count_sharded_window(None)
    assert again.windows == 4


def test_a_copy_of_the_shards_state_takes_the_count_over():
    """A checkpoint's copy arrives at window 3: the state made for it counts the three
    windows, and the next ones move it as a step here would."""
    opt = DiLoCoNesterov()
    values = [np.arange(6, dtype=np.float32), np.ones(3, dtype=np.float32)]
    layout = LaneLayout.of(_frame(values), 3, lane0_empty=True)
    for _ in range(3):
        opt.count_sharded_window(None)
    for lane in range(1, layout.count):
        pieces = layout.lanes[lane]
        opt.adopt_lane(layout, lane, None, ([np.zeros(p.numel, np.float32) for p in pieces],
                                            [np.zeros(p.numel, np.float32) for p in pieces]))
    assert opt.windows == 3 and opt.state_dict()["windows"].tolist() == [3]
    opt.count_sharded_window(None)
    assert opt.windows == 4


def test_a_count_loaded_without_state_goes_on_when_the_controller_steps():
    opt = DiLoCoNesterov()
    opt.load_state_dict({"windows": np.array([4], np.int64)})
    assert opt.windows == 4
    frame = _frame([np.ones(5, np.float32)])
    assert opt(frame) is frame  # its first state: only initialized
    assert opt.windows == 5
    opt(_frame([np.zeros(5, np.float32)]))
    assert opt.windows == 6


def test_a_schema_change_in_the_rounds_the_shards_step_is_refused_before_they_step():
    opt = DiLoCoNesterov()
    schema = [(DTYPE_F32, (10,)), (DTYPE_F32, (5,))]
    opt.check_sharded_schema(schema, None)  # the first round the shards step: its schema is the reference
    opt.count_sharded_window(None)
    opt.check_sharded_schema(schema, None)
    with pytest.raises(SchemaError, match=r"tensor 1 has shape \[6\] this window, the outer state holds shape \[5\]"):
        opt.check_sharded_schema([(DTYPE_F32, (10,)), (DTYPE_F32, (6,))], None)
    with pytest.raises(SchemaError, match="has 1 tensors, the outer state holds 2"):
        opt.check_sharded_schema([(DTYPE_F32, (10,))], None)
    opt.check_sharded_schema([(DTYPE_F32, (3,))], FragmentTag(0, 2))  # another fragment: its own schema


def test_a_schema_change_is_checked_against_the_state_held_here():
    opt = DiLoCoNesterov()
    opt(_frame([np.ones(5, np.float32)]))  # stepped here before the shards took over
    with pytest.raises(SchemaError, match=r"tensor 0 has shape \[6\]"):
        opt.check_sharded_schema([(DTYPE_F32, (6,))], None)


def test_seed_state_cuts_each_lanes_part_of_the_whole_state_and_adopting_it_gives_the_same_state():
    """What a controller seeds a shard with is its whole-tensor state cut by the layout:
    adopted lane by lane into an empty optimizer, it is that state again; none for a set
    with no state, or one whose lanes are not all filled yet."""
    values = [np.arange(6, dtype=np.float32), np.ones(3, dtype=np.float32) * 7]
    layout = LaneLayout.of(_frame(values), 3, lane0_empty=True)
    opt = DiLoCoNesterov()
    assert opt.seed_state(layout, 1, None) is None
    opt.step(_frame(values), None)  # starts the state
    opt.step(_frame([v + 1 for v in values]), None)  # and steps it: momentum not zero
    again = DiLoCoNesterov()
    for lane in range(1, layout.count):
        seed = opt.seed_state(layout, lane, None)
        assert seed is not None
        assert [x.size for x in seed[0]] == [p.numel for p in layout.lanes[lane]]
        again.adopt_lane(layout, lane, None, seed)
    for key, value in opt.state_dict().items():
        if key != "windows":
            np.testing.assert_array_equal(again.state_dict()[key], value, err_msg=key)
    assert opt.seed_state(layout, 1, FragmentTag(0, 2)) is None  # another set: no state
    partial = DiLoCoNesterov()
    partial.step_lane(list(layout.split(_frame(values)))[1], layout, 1, None)  # one lane filled, the others not
    assert partial.seed_state(layout, 1, None) is None
