"""A run resumed from a checkpoint, at three hosts (where ``shards="auto"`` takes the
relays' shards): the outer optimizer whose state was loaded before the controller opened
seeds the shards with it (Seed, before the first resumed params round's Decide), so the
resumed windows go through the shards and are the ones the run had uninterrupted, bit
for bit in deterministic mode; a custom optimizer is refused with explicit shards,
naming it (docs/outer-and-checkpoints.md, "Shards" and "Resuming"; docs/wire.md,
"Seeding the shards' outer state").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from flodl_trio import (
    ConfigError,
    ConsensusCheckpointer,
    DiLoCoNesterov,
    average_window,
    connect_reduce_client,
    latest_checkpoint,
    load_checkpoint,
    restore_module,
)
from flodl_trio.shard import ShardHandle
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.round_frame import RoundFrame

HOSTS, WORLD = [[0, 1], [2], [3]], 4
WINDOWS, CUT = 7, 5  # the run's windows; the checkpointed run stops after CUT of them

Got = dict[tuple[int, int], list[np.ndarray]]


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(60, 50), torch.nn.BatchNorm1d(50))


def _train(model: torch.nn.Module, rank: int, window: int) -> None:
    """A window's inner steps, as a fixed move of every param and float buffer."""
    rng = np.random.default_rng(100 * window + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.from_numpy((rng.standard_normal(tuple(p.shape)) * 0.1).astype(np.float32)))
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(float(rank + window))


async def _run(salt, outer: DiLoCoNesterov, windows: range, got: Got, *, checkpoint: object = None,
               restore_from: Path | None = None, shards: object = "auto") -> list[ShardHandle]:
    """``windows`` of every rank through a 3-host cluster with ``shards`` ("auto": the
    relays'); each rank's params after each window into ``got``. ``restore_from``: every
    rank loads that checkpoint first (the rank side of "Resuming"). The shards' handles."""
    with trio.fail_after(60):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt, deterministic=True, shards=shards,
                                      lane_min_bytes=0, outer_optimizer=outer, checkpoint=checkpoint) as cluster:

            async def rank_main(rank: int) -> None:
                model = _model(rank)
                if restore_from is not None:
                    restore_module(model, load_checkpoint(restore_from))
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, cluster.salt) as client:
                    for window in windows:
                        _train(model, rank, window)
                        params = list(model.parameters())
                        buffers = [b for b in model.buffers() if b.is_floating_point()]
                        await average_window(client, params, buffers, rank + 1 + window % 3, rank=rank,
                                             world_size=WORLD, in_place=True)
                        got[rank, window] = [p.detach().numpy().copy() for p in params]

            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(rank_main, rank)
            return cluster.shards


async def _checkpointed_reference(salt, tmp_path) -> tuple[Got, Path]:
    """WINDOWS windows uninterrupted (through the relays' shards), and a run of CUT of them
    with a checkpointer: the reference, and the newest checkpoint's path."""
    reference: Got = {}
    sharded = DiLoCoNesterov(0.7, 0.9)
    await _run(salt, sharded, range(WINDOWS), reference)
    # The shards stepped every lane: the controller's optimizer holds no state, but counts the windows.
    assert sorted(sharded.state_dict()) == ["windows"] and sharded.windows == WINDOWS
    assert sharded.state_dict()["windows"].tolist() == [WINDOWS]

    first: Got = {}
    outer = DiLoCoNesterov(0.7, 0.9)
    async with ConsensusCheckpointer(tmp_path, every=1, keep=3, outer=outer) as sink:
        await _run(salt, outer, range(CUT), first, checkpoint=sink)
    for key in first:
        assert all(np.array_equal(a, b) for a, b in zip(first[key], reference[key])), key
    path = latest_checkpoint(tmp_path)
    assert path is not None and path.name == f"window-{CUT - 1:06d}.safetensors"
    return reference, path


def _assert_resumed_exactly(resumed: Got, reference: Got) -> None:
    for rank in range(WORLD):
        for window in range(CUT, WINDOWS):
            for index, (a, b) in enumerate(zip(resumed[rank, window], reference[rank, window])):
                assert np.array_equal(a, b), f"rank {rank} window {window} tensor {index}"


@pytest.mark.parametrize("shards", ["auto", 3])
async def test_a_resumed_optimizer_seeds_the_shards_and_the_run_resumes_exactly(salt, tmp_path, shards):
    """A new controller whose DiLoCo was given the newest checkpoint's state before it
    opened, the ranks restored from that file, reduces through the shards (auto, or
    explicit ones), which start every lane from that state: its windows are the
    reference's, bit for bit."""
    reference, path = await _checkpointed_reference(salt, tmp_path)
    resumed_outer = DiLoCoNesterov(0.7, 0.9)
    resumed_outer.load_state_dict(load_checkpoint(path).outer)  # before the controller opens
    assert resumed_outer.holds_state and resumed_outer.windows == CUT
    resumed: Got = {}
    handles = await _run(salt, resumed_outer, range(CUT, WINDOWS), resumed, restore_from=path, shards=shards)
    _assert_resumed_exactly(resumed, reference)
    # The shards stepped the resumed windows, every lane of the first from the seeded state.
    assert sum(h.lanes_summed for h in handles) > 0
    assert sum(h.lanes_seeded for h in handles) >= 2
    assert resumed_outer.windows == WINDOWS


async def test_without_the_seed_the_first_resumed_window_is_a_plain_average(salt, tmp_path):
    """The guard on the test above: the same resume with an optimizer given no state
    differs from the reference from its first window (momentum restarted), so the seed
    is what makes it exact."""
    reference, path = await _checkpointed_reference(salt, tmp_path)
    resumed: Got = {}
    handles = await _run(salt, DiLoCoNesterov(0.7, 0.9), range(CUT, WINDOWS), resumed, restore_from=path)
    assert sum(h.lanes_seeded for h in handles) == 0
    assert not all(np.array_equal(a, b) for a, b in zip(resumed[0, CUT], reference[0, CUT]))


class HalfStep:
    """A custom outer optimizer: only the controller knows its math."""

    def __call__(self, consensus: RoundFrame) -> RoundFrame:
        return consensus


async def test_explicit_shards_refuse_a_custom_optimizer_naming_it(salt):
    with trio.fail_after(30), pytest.raises(ConfigError, match="HalfStep"):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt, shards=3, outer_optimizer=HalfStep()):
            pass  # pragma: no cover - refused before it opens
