"""What docs/api.md promises about bad arguments to the window helpers: a tensor the
wire cannot carry is refused before the window's first round, so the rank stays in
step with its cluster (no round of the window went out) and nobody else pays."""

from __future__ import annotations

import pytest
import torch

from flodl_trio import SchemaError, average_window, connect_reduce_client, open_window_trainer
from flodl_trio.client import ReduceClient
from flodl_trio.testing import open_local_cluster


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copy"])
@pytest.mark.parametrize("where", ["params", "buffers"])
async def test_average_window_refuses_a_non_f32_tensor_before_the_step_count_gather(salt, in_place, where):
    """Rank 0 first passes a Float64 tensor: refused, and no round went out, so both
    ranks' next window is their first (before, the count gather had gone: the next
    window's Control frame met the other host's params frame, which dropped that host)."""

    async def rank_main(rank: int, client: ReduceClient) -> None:
        params, buffers = [torch.full((3,), float(rank))], [torch.full((2,), float(rank))]
        if rank == 0:
            wrong = [t.double() for t in (params if where == "params" else buffers)]
            bad = (wrong, buffers) if where == "params" else (params, wrong)
            with pytest.raises(SchemaError, match="tensor 0.*Float64"):
                await average_window(client, *bad, 2, rank=rank, world_size=2, in_place=in_place)
        result = await average_window(client, params, buffers, 2, rank=rank, world_size=2, in_place=in_place)
        assert result.counts == [2.0, 2.0]
        assert result.params[0].tolist() == [0.5] * 3 and result.buffers[0].tolist() == [0.5] * 2

    async with open_local_cluster(world_size=2, hosts=[[0], [1]], salt=salt) as cluster:
        await cluster.run_ranks(rank_main)


async def test_a_window_trainer_refuses_a_non_f32_model_when_it_opens(salt):
    """The trainer writes each consensus into the model in place: a Float64 model is
    refused at the open, before any inner step runs or any frame goes out."""
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            steps: list[int] = []
            with pytest.raises(SchemaError, match="tensor 0.*Float64"):
                async with open_window_trainer(
                    client, [torch.zeros(3, dtype=torch.float64)], rank=0, world_size=1, sync_every=1,
                ) as trainer:
                    await trainer.run_steps(1, lambda: steps.append(1))
            assert steps == [] and client.rounds == 0

