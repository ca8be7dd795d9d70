"""Window schedules, outer optimizers and checkpoints refuse values of the wrong type
with a ConfigError (or CheckpointError) naming what was wrong, not a TypeError,
ValueError or KeyError from deep inside (docs/api.md, "Errors")."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio import Checkpoint, CheckpointError, ConfigError, DiLoCoNesterov, SlowMo, latest_checkpoint
from flodl_trio.train.schedule import WindowSchedule


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"sync_every": 2.5}, "sync_every"), ({"sync_every": "4"}, "sync_every"), ({"sync_every": True}, "sync_every"),
    ({"sync_every": 4, "overlap": 1.0}, "overlap"), ({"sync_every": 4, "fragments": 2.0}, "fragments"),
    ({"sync_every": 4, "merge_by": 1.5}, "merge_by"), ({"sync_every": 4, "merge_after": "2"}, "merge_after"),
    ({"sync_every": 4, "gamma": "x"}, "gamma"), ({"sync_every": 4, "gamma": float("nan")}, "gamma"),
])
def test_a_schedule_value_of_the_wrong_type_is_a_config_error_naming_it(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        WindowSchedule(**kwargs)


def test_numpy_integers_are_whole_numbers_of_steps():
    assert WindowSchedule(np.int64(4), fragments=np.int32(2), gamma=np.float32(0.5)).sync_gap == 2


@pytest.mark.parametrize("optimizer", [SlowMo, DiLoCoNesterov])
@pytest.mark.parametrize("value", ["0.5", None, True, [0.5]])
def test_an_outer_hyperparameter_that_is_not_a_number_is_a_config_error(optimizer, value):
    with pytest.raises(ConfigError, match="lr must be a number"):
        optimizer(lr=value)
    with pytest.raises(ConfigError, match="momentum must be a number"):
        optimizer(momentum=value)


def test_a_checkpoint_without_its_metadata_is_a_checkpoint_error_naming_the_key(tmp_path):
    bare = Checkpoint([], [], {}, {"format": "flodl_trio.checkpoint.v1", "window": "3", "mass": "x"}, tmp_path / "f")
    assert bare.window == 3
    with pytest.raises(CheckpointError, match="has no 'round'"):
        bare.round_index
    with pytest.raises(CheckpointError, match="mass is 'x', not a number"):
        bare.mass
    with pytest.raises(CheckpointError, match="has no 'wire_dtype'"):
        bare.wire_dtype


def test_latest_checkpoint_of_a_file_is_a_checkpoint_error(tmp_path):
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="cannot list checkpoints"):
        latest_checkpoint(a_file)
    assert latest_checkpoint(tmp_path / "missing") is None
