"""With shards and no checkpoint sink the controller's optimizer holds no outer state, yet
its window count moves with every window the shards stepped: ``.windows`` and
``state_dict()["windows"]`` (docs/outer-and-checkpoints.md, "Shards"; docs/wire.md,
"Checkpoints with shards")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, connect_reduce_client
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo
from flodl_trio.testing import open_local_cluster

HOSTS, WORLD, WINDOWS = [[0, 1], [2], [3]], 4, 4


@pytest.mark.parametrize("shards", [3, "auto"])
@pytest.mark.parametrize("make_outer", [DiLoCoNesterov, SlowMo], ids=["diloco", "slowmo"])
async def test_the_window_count_moves_with_every_window_the_shards_stepped(salt, shards, make_outer):
    outer = make_outer()
    seen: list[tuple[int, list[int]]] = []
    with trio.fail_after(60):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt, lanes=5, lane_min_bytes=0,
                                      deterministic=True, shards=shards, outer_optimizer=outer) as cluster:

            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, cluster.salt) as client:
                    for window in range(WINDOWS):
                        rng = np.random.default_rng(100 * window + rank)
                        await client.all_reduce_weighted([torch.tensor([1.0])], RoundKind.CONTROL, 1.0)
                        params = [torch.from_numpy(rng.standard_normal(5_000).astype(np.float32))]
                        await client.all_reduce_weighted(params, RoundKind.MODEL, float(rank + 1))
                        if rank == 0:  # the next window's params round waits for this rank
                            seen.append((outer.windows, outer.state_dict()["windows"].tolist()))

            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(rank_main, rank)
    assert seen == [(w + 1, [w + 1]) for w in range(WINDOWS)]
    assert sorted(outer.state_dict()) == ["windows"]  # the shards held the state
