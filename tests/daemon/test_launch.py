"""Launch conventions: identity and relay addresses from torchrun / SLURM variables."""

from __future__ import annotations

import pytest

from flodl_trio.daemon.launch import (
    controller_address,
    host_ranks_from_env,
    rank_from_env,
)
from flodl_trio.errors import ConfigError

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4(x2)",
         "SLURM_NODEID": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "1400"}


def test_torchrun_variables():
    launch = rank_from_env(TORCHRUN)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert launch.controller == ("10.0.0.7", 29500)
    assert launch.data_relay == ("127.0.0.1", 29504)
    assert launch.control_relay == ("127.0.0.1", 29505)
    assert host_ranks_from_env(TORCHRUN) == [4, 5, 6, 7]


def test_slurm_variables():
    launch = rank_from_env(SLURM)
    assert (launch.rank, launch.world_size, launch.local_rank) == (6, 8, 2)
    assert launch.controller == ("node01", 1400)
    assert host_ranks_from_env(SLURM) == [4, 5, 6, 7]


def test_flodl_overrides_win():
    env = {**TORCHRUN, "FLODL_RANK": "0", "FLODL_WORLD_SIZE": "2", "FLODL_CONTROLLER": "[::1]:7000"}
    launch = rank_from_env(env)
    assert (launch.rank, launch.world_size) == (0, 2)
    assert controller_address(env) == ("::1", 7000)


def test_defaults_and_errors():
    assert controller_address({}) == ("127.0.0.1", 1337)
    assert host_ranks_from_env({"RANK": "0"}) is None
    with pytest.raises(ConfigError, match="set RANK and WORLD_SIZE"):
        rank_from_env({})
    with pytest.raises(ConfigError, match="rank 9 must be < world size 8"):
        rank_from_env({**TORCHRUN, "RANK": "9"})
    with pytest.raises(ConfigError, match="not an integer"):
        rank_from_env({**TORCHRUN, "WORLD_SIZE": "eight"})
    with pytest.raises(ConfigError, match="host:port"):
        controller_address({"FLODL_CONTROLLER": "nohost"})


def test_shards_flag_takes_auto_off_one_or_addresses():
    """``--shards 1`` is one reducer, the controller (flodl's bytes), like ``off``; another
    bare count names no shard and is refused naming the flag."""
    from flodl_trio.daemon.controller import parse_shards

    assert parse_shards("auto") == "auto"
    for star in ("off", "1", "", "none", " 1 "):
        assert parse_shards(star) == ()
    assert parse_shards("10.0.0.1:7001,10.0.0.2:7002") == (("10.0.0.1", 7001), ("10.0.0.2", 7002))
    for bad in ("2", "0", "8"):
        with pytest.raises(ConfigError, match=f"--shards {bad}: a count other than 1 names no shard"):
            parse_shards(bad)
