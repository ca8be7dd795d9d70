"""In-place all-reduce (``in_place=True``) and the client's reused reply buffer.

An in-place round writes the consensus into the caller's own tensors, as
``torch.distributed.all_reduce`` does; replies decoded by copy land in one
client-owned buffer. Together with the daemons' reused fold memory, a steady
stream of in-place rounds allocates nothing model-sized anywhere.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import trio

from flodl_trio import RoundKind
from flodl_trio.client import ReduceClient
from flodl_trio.errors import MacError, SchemaError
from flodl_trio.testing import FlipBit, open_fault_proxy, open_local_cluster
from flodl_trio.testing.matrix.offsets import FRAME_PAYLOAD, consensus_frame_start

NUMEL = 100_000  # large enough for every streaming path (cut-through, finishing ahead)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("hosts", [[[0, 1]], [[0, 1], [2, 3]]], ids=["one-host", "two-hosts"])
async def test_in_place_writes_the_mean_into_the_callers_tensors(salt, hosts, bf16):
    """Plain, parameter (requires grad) and non-contiguous destinations all receive
    the exact mean, and the very same tensor objects come back."""
    world = sum(len(h) for h in hosts)

    async def rank_main(rank: int, client: ReduceClient) -> None:
        client.bf16_wire = bf16
        plain = torch.full((NUMEL,), float(rank))
        param = torch.nn.Parameter(torch.full((NUMEL // 100, 100), float(2 * rank)))
        strided = torch.full((100, NUMEL // 100), float(3 * rank)).t()  # a transposed view
        for k in range(3):
            mine = [plain, param, strided]
            out = await client.all_reduce_tensors(mine, in_place=True)
            assert all(a is b for a, b in zip(out, mine))
            mean = (world - 1) / 2
            for t, scale in zip(mine, (1, 2, 3)):
                want = scale * (mean + 10 * k)
                assert torch.equal(t.detach(), torch.full_like(t.detach(), want)), (rank, k, scale)
            for t, scale in zip(mine, (1, 2, 3)):  # next round's contribution
                t.detach().fill_(scale * (rank + 10 * (k + 1)))
        assert param.requires_grad and not strided.is_contiguous()

    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        await cluster.run_ranks(rank_main)


async def test_in_place_round_with_no_mass_keeps_local_values(salt):
    """Nobody realized work: the consensus is not divided and the rank keeps its own values."""

    async def rank_main(rank: int, client: ReduceClient) -> None:
        t = torch.full((NUMEL,), float(rank + 1))
        out, mass = await client.all_reduce_scaled([t], 0.0, RoundKind.MODEL, 0.0, in_place=True)
        assert mass == 0.0 and out[0] is t
        assert torch.equal(t, torch.full((NUMEL,), float(rank + 1)))

    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        await cluster.run_ranks(rank_main)


async def test_in_place_refuses_a_non_f32_destination_before_the_round(salt):
    async def rank_main(rank: int, client: ReduceClient) -> None:
        if rank == 0:
            with pytest.raises(SchemaError, match="tensor 1: in-place destination is Float64"):
                await client.all_reduce_tensors([torch.zeros(4), torch.zeros(4, dtype=torch.float64)], in_place=True)
        # Nothing was sent: both ranks' next round is their first.
        t = torch.full((4,), float(rank))
        await client.all_reduce_tensors([t], in_place=True)
        assert t.tolist() == [0.5] * 4

    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        await cluster.run_ranks(rank_main)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
async def test_a_corrupted_consensus_never_touches_the_destination(salt, bf16):
    """A bit flipped in rank 0's copy of the consensus (between relay and rank) fails
    its MAC: the round raises and rank 0's tensor keeps every one of its values."""
    flip = FlipBit(at_byte=consensus_frame_start(0, NUMEL) + FRAME_PAYLOAD + 994, direction="down")  # payload byte 994
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        async with open_fault_proxy(cluster.relay_address(0), [flip]) as proxy:

            async def rank_main(rank: int, client: ReduceClient) -> None:
                client.bf16_wire = bf16
                t = torch.full((NUMEL,), float(rank + 1))
                if rank == 0:
                    with pytest.raises(MacError):
                        await client.all_reduce_tensors([t], in_place=True)
                    assert torch.equal(t, torch.full((NUMEL,), 1.0))
                else:
                    await client.all_reduce_tensors([t], in_place=True)
                    assert torch.equal(t, torch.full((NUMEL,), 1.5))

            await cluster.run_ranks(rank_main, addresses={0: ("127.0.0.1", proxy.port)})
            assert proxy.fired(flip)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
async def test_results_of_earlier_rounds_stay_intact(salt, bf16):
    """bf16 replies land in the client's one reply buffer and are widened into new
    tensors; f32 replies become the returned tensors, so they get a buffer each.
    Either way an earlier round's result survives the next round."""

    async def rank_main(rank: int, client: ReduceClient) -> None:
        client.bf16_wire = bf16
        first = await client.all_reduce_tensors([torch.full((NUMEL,), float(rank))])
        second = await client.all_reduce_tensors([torch.full((NUMEL,), float(rank + 100))])
        assert torch.equal(first[0], torch.full((NUMEL,), 0.5))
        assert torch.equal(second[0], torch.full((NUMEL,), 100.5))

    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        await cluster.run_ranks(rank_main)


@pytest.mark.parametrize(("bf16", "numel"), [(False, 1 << 20), (True, 1 << 22)], ids=["f32", "bf16"])
@pytest.mark.parametrize("hosts", [[[0, 1]], [[0, 1], [2, 3]]], ids=["one-host", "two-hosts"])
async def test_steady_in_place_rounds_allocate_nothing_model_sized(salt, hosts, bf16, numel):
    """Ranks, relays and controller run in this process: after two warm-up rounds,
    three more in-place rounds raise its traced peak by far less than the model's
    wire size (4 MiB f32, 8 MiB bf16; what remains is small per-call scratch).
    Host 1's ranks lag, so each round ends on host 1's frame (finished ahead)."""
    world = sum(len(h) for h in hosts)
    wire_bytes = numel * (2 if bf16 else 4)
    growth: list[int] = []

    async def rank_main(rank: int, client: ReduceClient) -> None:
        client.bf16_wire = bf16
        t = torch.full((numel,), float(rank))
        for k in range(5):
            if rank == 0 and k == 2:
                tracemalloc.reset_peak()
                start = tracemalloc.get_traced_memory()[0]
            if len(hosts) > 1 and rank in hosts[-1]:
                await trio.sleep(0.05)
            await client.all_reduce_tensors([t], in_place=True)
        if rank == 0:
            growth.append(tracemalloc.get_traced_memory()[1] - start)

    tracemalloc.start()
    try:
        async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
            await cluster.run_ranks(rank_main)
    finally:
        tracemalloc.stop()
    assert growth and growth[0] < wire_bytes // 4, f"{growth[0]} bytes allocated beyond the steady state"
