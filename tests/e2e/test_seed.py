"""The seed's end-to-end tests (flodl agent_tests), ported to pytest-trio.

Every test runs the real three-tier path: rank client -> relay -> controller,
over loopback TCP, under the autouse trio deadline from conftest.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch
import trio

from flodl_trio import (
    DECODE_SLOT_BUFFERS,
    DECODE_SLOT_PARAMS,
    DTYPE_F32,
    ConfigError,
    ConnectFailed,
    DeadRanks,
    FlodlError,
    ReduceClient,
    RoundFrame,
    RoundKind,
    TensorPayload,
    connect_reduce_client,
    gamma_mass,
    sumcount_reduce,
)
from flodl_trio.testing import open_local_cluster


def frame_with(values: list[float]) -> RoundFrame:
    """Equal-mass contribution: the realized-work reduce returns the plain mean."""
    return RoundFrame([TensorPayload(DTYPE_F32, (len(values),), np.array(values, "<f4"))], RoundKind.MODEL, 1.0)


def as_f32(frame: RoundFrame, index: int = 0) -> list[float]:
    return np.frombuffer(frame.tensors[index].data, "<f4").tolist()


RankBody = Callable[[ReduceClient, int], Awaitable[Any]]


async def run_ranks(
    salt, world: int, hosts: list[list[int]], bodies: dict[int, RankBody], *, dead: DeadRanks | None = None,
    before: Callable[..., Awaitable[None]] | None = None,
) -> dict[int, Any]:
    """Start a cluster, run one body per rank concurrently, return each body's result."""
    results: dict[int, Any] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, dead_ranks=dead) as cluster:
        async def one(rank: int, body: RankBody) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                results[rank] = await body(client, rank)

        async with trio.open_nursery() as nursery:
            if before is not None:
                await before(cluster, nursery)
            for rank, body in bodies.items():
                nursery.start_soon(one, rank, body)
    return results


async def test_two_rank_client_average(salt):
    inputs = {0: [2.0, 4.0, 6.0], 1: [4.0, 8.0, 12.0]}
    out = await run_ranks(salt, 2, [[0, 1]], {r: (lambda c, r: c.all_reduce(frame_with(inputs[r]))) for r in inputs})
    assert as_f32(out[0]) == [3.0, 6.0, 9.0]
    assert out[0] == out[1]


async def test_client_multi_round_persistence(salt):
    inputs = {0: [1.0, 5.0, 9.0], 1: [3.0, 7.0, 11.0]}

    async def body(client: ReduceClient, rank: int) -> list[RoundFrame]:
        return [await client.all_reduce(frame_with([v])) for v in inputs[rank]]

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for i, want in enumerate([2.0, 6.0, 10.0]):
        assert as_f32(out[0][i]) == [want], f"rank 0 round {i}"
        assert as_f32(out[1][i]) == [want], f"rank 1 round {i}"


async def test_rejects_world_size_disagreement(salt):
    async with open_local_cluster(world_size=2, hosts=[[0]], salt=salt) as cluster:
        with pytest.raises(FlodlError) as info:
            await connect_reduce_client(cluster.relay_address(0), 0, 3, salt)
        msg = str(info.value)
        assert "ack" in msg or "handshake" in msg or "read" in msg, msg
        # The relay logged its own, distinct reason.
        assert any("world_size 3" in r and "started with 2" in r for r in cluster.relays[0].rejections)


def test_rejects_rank_id_out_of_bounds_locally(salt):
    with pytest.raises(ConfigError, match="rank_id 5 must be < world_size 3"):
        connect_reduce_client(("127.0.0.1", 12345), 5, 3, salt)


def test_rejects_zero_world_size_locally(salt):
    with pytest.raises(ConfigError, match="world_size"):
        connect_reduce_client(("127.0.0.1", 12345), 0, 0, salt)


async def test_three_rank_broadcast_from_root_delivers_root_values(salt):
    values = {0: [1.5, 2.5, 3.5], 1: [10.0, 20.0, 30.0], 2: [100.0, 200.0, 300.0]}

    async def body(client: ReduceClient, rank: int) -> list[torch.Tensor]:
        return await client.broadcast_from_root([torch.tensor(values[rank])], 0)

    out = await run_ranks(salt, 3, [[0, 1, 2]], {r: body for r in range(3)})
    for rank in range(3):
        assert len(out[rank]) == 1
        assert out[rank][0].tolist() == values[0], f"rank {rank}"


async def test_broadcast_from_root_multi_tensor_distinct_shapes(salt):
    root_w = torch.arange(1.0, 7.0).reshape(2, 3)
    root_b = torch.tensor([-1.0, -2.0, -3.0, -4.0])

    async def body(client: ReduceClient, rank: int) -> list[torch.Tensor]:
        if rank == 0:
            return await client.broadcast_from_root([root_w, root_b], 0)
        return await client.broadcast_from_root([torch.full((2, 3), 9.0), torch.full((4,), 9.0)], 0)

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        w, b = out[rank]
        assert list(w.shape) == [2, 3] and list(b.shape) == [4]
        assert torch.equal(w, root_w) and torch.equal(b, root_b), f"rank {rank}"


async def test_two_rank_tensor_average(salt):
    inputs = {0: [2.0, 4.0, 6.0], 1: [4.0, 8.0, 12.0]}

    async def body(client: ReduceClient, rank: int) -> list[torch.Tensor]:
        return await client.all_reduce_tensors([torch.tensor(inputs[rank])])

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        assert len(out[rank]) == 1
        assert out[rank][0].tolist() == [3.0, 6.0, 9.0]


async def test_two_rank_tensor_average_bf16_wire(salt):
    inputs = {0: [2.0, 4.0, 6.0], 1: [4.0, 8.0, 12.0]}

    async def body(client: ReduceClient, rank: int) -> list[torch.Tensor]:
        client.bf16_wire = True
        return await client.all_reduce_tensors([torch.tensor(inputs[rank])])

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        assert out[rank][0].tolist() == [3.0, 6.0, 9.0]
        assert out[rank][0].dtype == torch.float32, "decode returns f32"


async def test_two_rank_scaled_weighted_average_bf16_wire(salt):
    """Unequal masses on the bf16 wire: (3*[2,8] + 1*[4,16]) / 4 = [2.5, 10]."""
    inputs = {0: ([2.0, 8.0], 3.0), 1: ([4.0, 16.0], 1.0)}

    async def body(client: ReduceClient, rank: int):
        client.bf16_wire = True
        values, w = inputs[rank]
        return await client.all_reduce_scaled([torch.tensor(values)], w, RoundKind.MODEL, w)

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        tensors, mass = out[rank]
        assert mass == 4.0, f"rank {rank} accepted mass"
        assert tensors[0].tolist() == [2.5, 10.0], f"rank {rank} consensus"


async def test_pinned_decode_reuses_staging_and_keeps_values(salt):
    inputs = {0: (2.0, 10.0), 1: (4.0, 14.0)}

    async def body(client: ReduceClient, rank: int):
        client.pinned_decode = True
        v1, v2 = inputs[rank]
        client.arm_pinned_decode(DECODE_SLOT_PARAMS)
        round1, _ = await client.all_reduce_scaled([torch.tensor([v1, v1])], 1.0, RoundKind.MODEL, 1.0)
        round1_values = round1[0].tolist()
        client.arm_pinned_decode(DECODE_SLOT_PARAMS)
        round2, _ = await client.all_reduce_scaled([torch.tensor([v2, v2])], 1.0, RoundKind.MODEL, 1.0)
        return round1_values, round1, round2

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        round1_values, round1, round2 = out[rank]
        assert round1_values == [3.0, 3.0], f"rank {rank} round-1 consensus"
        assert round2[0].tolist() == [12.0, 12.0], f"rank {rank} round-2 consensus"
        # Round 2 decoded into the same staging: round 1's handle now reads round 2.
        assert round1[0].tolist() == [12.0, 12.0], f"rank {rank} staging reuse"
        assert round1[0].data_ptr() == round2[0].data_ptr()


async def test_pinned_decode_slots_do_not_collide_on_identical_schemas(salt):
    inputs = {0: (2.0, 100.0), 1: (4.0, 200.0)}

    async def body(client: ReduceClient, rank: int):
        client.pinned_decode = True
        p, b = inputs[rank]
        client.arm_pinned_decode(DECODE_SLOT_PARAMS)
        params, _ = await client.all_reduce_scaled([torch.tensor([p])], 1.0, RoundKind.MODEL, 1.0)
        client.arm_pinned_decode(DECODE_SLOT_BUFFERS)
        buffers, _ = await client.all_reduce_scaled([torch.tensor([b])], 1.0, RoundKind.MODEL, 1.0)
        return params, buffers

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        params, buffers = out[rank]
        assert buffers[0].tolist() == [150.0], f"rank {rank} buffers consensus"
        # Would read 150.0 if both rounds shared one staging set.
        assert params[0].tolist() == [3.0], f"rank {rank} params survive the buffers decode"


async def test_pinned_decode_bf16_wire_upcasts_into_staging(salt):
    inputs = {0: [2.0, 8.0], 1: [4.0, 16.0]}

    async def body(client: ReduceClient, rank: int):
        client.bf16_wire = True
        client.pinned_decode = True
        client.arm_pinned_decode(DECODE_SLOT_PARAMS)
        tensors, _ = await client.all_reduce_scaled([torch.tensor(inputs[rank])], 1.0, RoundKind.MODEL, 1.0)
        return tensors

    out = await run_ranks(salt, 2, [[0, 1]], {0: body, 1: body})
    for rank in (0, 1):
        assert out[rank][0].dtype == torch.float32, f"rank {rank} staging decode returns f32"
        assert out[rank][0].tolist() == [3.0, 12.0], f"rank {rank} consensus"


@pytest.mark.deadline(20)
async def test_surfaces_connect_failure_clearly(salt):
    # Port 1 is reserved: connect is refused; a short retry budget keeps the test quick.
    with pytest.raises(ConnectFailed) as info:
        await connect_reduce_client(("127.0.0.1", 1), 0, 1, salt, connect_attempts=3, connect_interval=0.05)
    msg = str(info.value)
    assert "connect" in msg and ":1 failed" in msg, msg


# -- realized-work invariant --------------------------------------------------
#
# The consensus is sum(w_r T_r) / sum(w_r) over exactly the contributions the
# controller accepted, and the frame it scatters (what an outer optimizer or a
# checkpoint sees) IS that consensus.


async def window_round(
    client: ReduceClient, rank: int, world: int, steps: int, value: float, gamma: float
) -> tuple[list[float], float, float]:
    """Count gather -> gamma weights -> weighted reduce; also the raw scattered value."""
    counts = [0.0] * world
    counts[rank] = float(steps)
    gathered = await client.all_reduce_per_rank_f64(counts)
    w = gamma_mass(steps, gamma)
    t = torch.tensor([value])
    adopted = (await sumcount_reduce(client, [t], w, DECODE_SLOT_PARAMS))[0].item()
    raw_tensors, _mass = await client.all_reduce_weighted([t * w], RoundKind.MODEL, w)
    return gathered, adopted, raw_tensors[0].item()


async def test_realized_work_all_alive_scattered_frame_is_consensus(salt):
    """gamma=1, counts [3,5,2], values [1,2,3] -> (3 + 10 + 6) / 10 = 1.9."""
    setup = {0: (3, 1.0), 1: (5, 2.0), 2: (2, 3.0)}

    async def body(client: ReduceClient, rank: int):
        steps, value = setup[rank]
        return await window_round(client, rank, 3, steps, value, 1.0)

    out = await run_ranks(salt, 3, [[0, 1, 2]], {r: body for r in range(3)}, dead=DeadRanks(3))
    for rank in range(3):
        counts, adopted, raw = out[rank]
        assert counts == [3.0, 5.0, 2.0], f"rank {rank} gathered counts"
        assert abs(adopted - 1.9) < 1e-6, f"rank {rank} adopted {adopted}"
        assert abs(raw - 1.9) < 1e-6, f"rank {rank} scattered frame carries {raw}"


async def test_realized_work_after_death(salt):
    """Rank 2 declared dead before the window; ranks 0, 1 do counts [3, 5],
    values [1, 2], buffers [1, 2]: params 13/8 = 1.625 (gamma 1), buffers the
    mean of movers 1.5, gamma 0.5 -> (sqrt3 + 2 sqrt5)/(sqrt3 + sqrt5),
    and the gathered counts are the realized ones [3, 5, 0]."""
    dead = DeadRanks(3)
    setup = {0: (3, 1.0, 1.0), 1: (5, 2.0, 2.0)}
    rank2_connected = trio.Event()
    release_rank2 = trio.Event()

    async def before(cluster, nursery: trio.Nursery) -> None:
        async def idle_rank2() -> None:
            # Connects (formation needs every announced rank), then goes silent.
            async with connect_reduce_client(cluster.relay_address(2), 2, 3, salt):
                rank2_connected.set()
                await release_rank2.wait()

        nursery.start_soon(idle_rank2)
        await rank2_connected.wait()
        dead.declare_dead(2)

    async def body(client: ReduceClient, rank: int):
        steps, value, buf = setup[rank]
        g1 = await window_round(client, rank, 3, steps, value, 1.0)
        buffers = await sumcount_reduce(client, [torch.tensor([buf])], 1.0, DECODE_SLOT_BUFFERS)
        g_half = await window_round(client, rank, 3, steps, value, 0.5)
        if rank == 0:
            release_rank2.set()
        return g1, buffers[0].item(), g_half

    out = await run_ranks(salt, 3, [[0, 1, 2]], {0: body, 1: body}, dead=dead, before=before)
    want_half = (math.sqrt(3) + 2 * math.sqrt(5)) / (math.sqrt(3) + math.sqrt(5))
    for rank in (0, 1):
        (counts, adopted, raw), buf, (_, adopted_half, _) = out[rank]
        assert counts == [3.0, 5.0, 0.0], f"rank {rank}: gathered counts must be the realized counts"
        assert abs(adopted - 1.625) < 1e-6, f"rank {rank} adopted {adopted}"
        assert abs(raw - 1.625) < 1e-6, f"rank {rank} scattered {raw}"
        assert abs(buf - 1.5) < 1e-6, f"rank {rank} buffer consensus {buf}"
        assert abs(adopted_half - want_half) < 1e-5, f"rank {rank} gamma 0.5 adopted {adopted_half}"
