"""A hostile or broken relay on the resume and delta-round paths costs only itself
(docs/wire.md, "resuming after a lost controller" and "delta rounds"; docs/liveness.md,
"Who pays for an error"): real controller, relays and sockets, one trio run each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.errors import FlodlError
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.quant import F32, DeltaCodec
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"hostile-resume-s")
SHAPES = [(3001,), (7, 5)]
DEADLINE_S = 60


def _model(rank: int) -> list[torch.Tensor]:
    rng = np.random.default_rng([11, rank])
    return [torch.from_numpy(rng.standard_normal(int(np.prod(s))).astype(F32)).view(s) for s in SHAPES]


def _step(params: list[torch.Tensor], rank: int, window: int) -> None:
    """What rank's inner steps add to its params in ``window``."""
    rng = np.random.default_rng([rank, window])
    with torch.no_grad():
        for p in params:
            p.view(-1).add_(torch.from_numpy((rng.standard_normal(p.numel()) * 1e-2).astype(F32)))


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.trio
async def test_a_host_restarting_the_lineage_mid_run_costs_only_itself(caplog, lanes):
    """Host 0's rank drops its base after window 0 and sends window 1's params as a
    lineage's first round (f32, the zero digest): a base that is not the controller's.
    Folded first (deterministic mode: lowest rank first), it must cost host 0 alone,
    not the honest hosts whose coded deltas are against the controller's base; in
    lanes, refused at its lane 0 (whose schema says so) before any of its lanes folds."""
    codec = DeltaCodec.parse("int8")
    world, windows = 3, 4
    errors: dict[int, BaseException] = {}
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        params = _model(rank)
        try:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
                client.delta_codec = codec
                for window in range(windows):
                    if rank == 0 and window == 1:
                        state = client.delta_state()
                        state.verify()
                        state.base = None  # as a lineage's first round: f32 params, the zero digest
                    _step(params, rank, window)
                    await average_window(client, params, [], 1 + rank, rank=rank, world_size=world, in_place=True)
                    seen[rank, window] = [p.detach().reshape(-1).numpy().copy() for p in params]
        except FlodlError as exc:
            errors[rank] = exc

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=world, hosts=[[0], [1], [2]], salt=SALT, deterministic=True, local_leg=False,
            lanes=lanes, lane_min_bytes=0,
        ) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
            dead = cluster.controller.dead_ranks.snapshot()
    assert set(errors) == {0}, errors
    assert dead == {0}
    for window in range(windows):
        for a, b in zip(seen[1, window], seen[2, window]):
            assert np.array_equal(a, b), window
    assert "is against base 00000000000000000000000000000000" in caplog.text, caplog.text[-3000:]

