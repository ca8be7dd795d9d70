"""Checkpoints with shards: the controller asks the shards for a copy of the rounds its
checkpointer records (and, for a params round, each lane's outer state), so the files are
the ones a controller without shards writes, bit for bit, and the other rounds cost its
link nothing (docs/wire.md, "Checkpoints with shards").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, connect_reduce_client
from flodl_trio.controller.checkpointer import ConsensusCheckpointer
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.checkpoint import list_checkpoints, load_checkpoint
from flodl_trio.wire.fragment import piece_range

HOSTS, WORLD, LANES = [[0, 1], [2], [3]], 4, 5
SIZES = [20_000, 15_001]
BUFFERS = 3_001


def _control(window: int, fragments: bool) -> list[torch.Tensor]:
    tensors = [torch.tensor([float(window)])]
    if fragments:
        tensors += [torch.empty((0, 2, window % 2)), *(torch.empty((0, n)) for n in SIZES)]
    return tensors


def _fragment_numels(fragment: int) -> list[int]:
    """Fragment ``fragment`` of 2 syncs that run of every tensor's elements."""
    return [stop - start for start, stop in (piece_range(n, 2, fragment) for n in SIZES)]


def _tensors(rank: int, window: int, numels: list[int], salt_: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(1000 * window + 10 * rank + salt_)
    return [torch.from_numpy((rng.standard_normal(n) + window).astype(np.float32)) for n in numels]


async def _run(
    salt, directory: Path, shards: int, make_outer: Callable[[], object], windows: int, *, every: int,
    bf16: bool = False, fragments: bool = False, custom_sink: bool = False,
) -> tuple[list[Path], object]:
    """``windows`` windows (Control, params, buffers rounds) of every rank through a
    cluster whose controller checkpoints every ``every`` windows into ``directory``."""
    outer = make_outer()
    with trio.fail_after(60):
        async with ConsensusCheckpointer(directory, every=every, keep=windows, outer=outer) as checkpointer:
            sink = (lambda index, frame: checkpointer(index, frame)) if custom_sink else checkpointer
            async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt, lanes=LANES, lane_min_bytes=0,
                                          deterministic=True, shards=shards, outer_optimizer=outer,
                                          checkpoint=sink) as cluster:

                async def rank_main(rank: int) -> None:
                    async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, cluster.salt) as client:
                        client.bf16_wire = bf16
                        for window in range(windows):
                            numels = _fragment_numels(window % 2) if fragments else SIZES
                            await client.all_reduce_weighted(_control(window, fragments), RoundKind.CONTROL, 1.0)
                            await client.all_reduce_weighted(_tensors(rank, window, numels, 0), RoundKind.MODEL,
                                                             float(rank + 1))
                            await client.all_reduce_weighted(_tensors(rank, window, [BUFFERS], 7), RoundKind.MODEL,
                                                             1.0)

                async with trio.open_nursery() as nursery:
                    for rank in range(WORLD):
                        nursery.start_soon(rank_main, rank)
            await checkpointer.wait_idle()
    return [path for _, path in list_checkpoints(directory)], cluster


def _same_files(sharded: list[Path], star: list[Path]) -> None:
    assert [p.name for p in sharded] == [p.name for p in star] and sharded
    for a, b in zip(sharded, star):
        got, want = load_checkpoint(a), load_checkpoint(b)
        for name in ("params", "buffers"):
            assert len(getattr(got, name)) == len(getattr(want, name))
            for x, y in zip(getattr(got, name), getattr(want, name)):
                np.testing.assert_array_equal(x, y)
        assert sorted(got.outer) == sorted(want.outer)
        for key in want.outer:
            np.testing.assert_array_equal(got.outer[key], want.outer[key], err_msg=f"{a.name}: outer {key}")
        same = ("window", "mass", "buffers_mass", "buffers", "wire_dtype", "outer", "fragments", "fragment")
        assert {k: got.metadata[k] for k in same} == {k: want.metadata[k] for k in same}


@pytest.mark.parametrize("make_outer", [DiLoCoNesterov, lambda: SlowMo(lr=0.8, momentum=0.6)],
                         ids=["diloco", "slowmo"])
@pytest.mark.parametrize(("bf16", "fragments"), [(False, False), (True, False), (False, True)],
                         ids=["f32", "bf16", "fragments"])
async def test_checkpoints_through_shards_are_the_files_a_controller_without_shards_writes(
    salt, tmp_path, make_outer, bf16, fragments
):
    """Six windows through 3 shards, checkpointed every 2nd window: the same files as the
    star's - params, buffers, and the outer optimizer's state (x_prev, momentum, window
    count), which the shards hold and copy with the lanes - bit for bit; and the shards
    copied only what the checkpointer records (a due window's params and buffers rounds,
    every round with fragments, whose newest each fragment needs)."""
    windows = 6
    sharded, cluster = await _run(salt, tmp_path / "sharded", 3, make_outer, windows, every=2, bf16=bf16,
                                  fragments=fragments)
    star, _ = await _run(salt, tmp_path / "star", 0, make_outer, windows, every=2, bf16=bf16, fragments=fragments)
    _same_files(sharded, star)
    assert [load_checkpoint(p).window for p in sharded] == ([2, 4] if fragments else [0, 2, 4])[-len(sharded):]
    # (lane_min_bytes=0 sends even the Control rounds through the shards; each is copied,
    # as the checkpointer needs every one: it opens a window, and names its fragment)
    copied = windows + (2 * windows if fragments else 2 * len(range(0, windows, 2)))
    assert cluster.controller.stats.rounds_copied == copied
    assert [h.rounds for h in cluster.shards] == [3 * windows] * 3  # every round went through them


async def test_a_sink_that_cannot_say_which_rounds_it_records_is_sent_every_round(salt, tmp_path):
    """A checkpoint sink without ``wants_round`` gets every round whole: every one is copied,
    and what it writes is still the star's."""
    sharded, cluster = await _run(salt, tmp_path / "sharded", 3, DiLoCoNesterov, 4, every=2, custom_sink=True)
    star, _ = await _run(salt, tmp_path / "star", 0, DiLoCoNesterov, 4, every=2, custom_sink=True)
    _same_files(sharded, star)
    assert cluster.controller.stats.rounds_copied == 3 * 4


async def test_a_shard_whose_outer_state_is_not_its_lanes_is_lost_and_the_checkpoints_still_written(
    salt, tmp_path, monkeypatch, caplog
):
    """Shard 1 sends its lane again where the lane's outer state is due: the controller
    loses that shard (naming what was wrong), its lanes go to the next live shard, the
    round is decided again, and every due window is still written, loadable, with the
    outer state of every tensor."""
    from flodl_trio.shard import core
    from flodl_trio.transport.hashing import encode_enveloped_frame
    from flodl_trio.wire.mux import MuxKind

    real = core._Shard._copy_state

    async def lane_for_state(self, msg, stepped, layout, lane, fragment):
        if self.index != 1:
            return await real(self, msg, stepped, layout, lane, fragment)
        self._to_controller.send_nowait(await encode_enveloped_frame(MuxKind.BROADCAST, stepped, self.salt))

    monkeypatch.setattr(core._Shard, "_copy_state", lane_for_state)
    files, cluster = await _run(salt, tmp_path, 3, DiLoCoNesterov, 4, every=2)
    assert cluster.controller.stats.shards_lost == 1 and cluster.controller.stats.decisions_again >= 1
    assert "shard 1: lane" in caplog.text and "outer state has" in caplog.text
    assert [load_checkpoint(p).window for p in files] == [0, 2]
    outer = load_checkpoint(files[-1]).outer
    assert sorted(k for k in outer if k.startswith("x_prev")) == ["x_prev.0", "x_prev.1"]
    assert all(np.isfinite(outer[k]).all() for k in outer)
