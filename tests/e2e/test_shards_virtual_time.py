"""Clusters with reduction shards on a memory network, in virtual time.

The shards take listeners and the controller and relays a connect function, so
a whole sharded cluster runs on a :class:`~flodl_trio.testing.MemoryNetwork`
under pytest-trio's ``autojump_clock``: the bounds are the defaults a user
gets, and the time a lost shard costs is asserted exactly. Frames stay small
(cut in lanes anyway: ``lane_min_bytes=0``), so nothing hashes in a thread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, connect_reduce_client
from flodl_trio.testing import MemoryNetwork, open_local_cluster
from flodl_trio.transport.settings import NetBounds

DEFAULTS = NetBounds()


def sharded(salt, shards: int, **kwargs):
    return open_local_cluster(salt=salt, network=MemoryNetwork(), bounds=DEFAULTS, shards=shards, lanes=5,
                              lane_min_bytes=0, **kwargs)


async def weighted_rounds(cluster, values, weights, rounds: int) -> dict:
    got: dict = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, cluster.world_size, cluster.salt,
                                         connect=cluster.connect) as client:
            for r in range(rounds):
                t = torch.from_numpy(values[rank] * weights[rank] * (r + 1))
                got[rank, r] = await client.all_reduce_weighted([t], RoundKind.MODEL, weights[rank])

    async with trio.open_nursery() as nursery:
        for rank in range(cluster.world_size):
            nursery.start_soon(rank_main, rank)
    return got


def check_weighted(got, values, weights, rounds: int) -> None:
    world = len(values)
    mass = sum(weights.values())
    for r in range(rounds):
        want = sum(weights[k] * values[k] * (r + 1) for k in range(world)) / mass
        for rank in range(world):
            tensors, got_mass = got[rank, r]
            assert got_mass == mass
            np.testing.assert_allclose(tensors[0].numpy(), want, rtol=1e-5, atol=1e-6)
        assert all(np.array_equal(got[k, r][0][0].numpy(), got[0, r][0][0].numpy()) for k in range(world))


@pytest.mark.parametrize("shards", [1, 2, 3])
async def test_a_sharded_memory_cluster_gives_the_weighted_mean(autojump_clock, salt, shards):
    rng = np.random.default_rng(shards)
    world, rounds = 5, 3
    values = {r: rng.standard_normal(2_000).astype(np.float32) for r in range(world)}
    weights = {r: float(rng.integers(1, 9)) for r in range(world)}
    async with sharded(salt, shards, world_size=world, hosts=[[0, 1], [2], [3, 4]]) as cluster:
        got = await weighted_rounds(cluster, values, weights, rounds)
    check_weighted(got, values, weights, rounds)
    assert all(shard.rounds == rounds for shard in cluster.shards)


@pytest.mark.deadline(300)  # virtual seconds
async def test_a_shard_silent_to_the_controller_is_lost_after_exactly_the_heartbeat_timeout(
    autojump_clock, salt, monkeypatch
):
    """Shard 1 stops its heartbeats (as a frozen process would) and sums nothing: the
    round waits for it exactly the heartbeat timeout, then its lanes move to shard 0
    and the round is exact."""
    from flodl_trio.shard import core as shard_core

    frozen = trio.Event()
    original_writer = shard_core._Shard._controller_writer
    original_sum = shard_core._Shard._sum_lane

    async def writer(self, conn, outbox) -> None:
        if self.index == 1:
            await conn.send_chunks(self._control(shard_core.ShardAlive()).chunks)
            await frozen.wait()
            await trio.sleep_forever()
        await original_writer(self, conn, outbox)

    async def summing(self, msg, lane: int) -> None:
        if self.index == 1 and frozen.is_set():
            await trio.sleep_forever()
        await original_sum(self, msg, lane)

    monkeypatch.setattr(shard_core._Shard, "_controller_writer", writer)
    monkeypatch.setattr(shard_core._Shard, "_sum_lane", summing)
    world = 3
    done_first = {rank: trio.Event() for rank in range(world)}
    go, got, ended = trio.Event(), {}, {}

    async def rank_main(cluster, rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, cluster.salt,
                                         connect=cluster.connect) as client:
            for r in range(2):
                got[rank, r] = (await client.all_reduce_tensors([torch.full((2_000,), float(rank + 10 * r))]))[0]
                ended[rank, r] = trio.current_time()
                if r == 0:
                    done_first[rank].set()
                    await go.wait()

    async with sharded(salt, 2, world_size=world, hosts=[[0], [1], [2]]) as cluster:
        async with trio.open_nursery() as nursery:
            for rank in range(world):
                nursery.start_soon(rank_main, cluster, rank)
            for rank in range(world):
                await done_first[rank].wait()
            frozen.set()  # between rounds 0 and 1
            start = trio.current_time()
            go.set()
        assert cluster.controller.stats.shards_lost == 1
    for rank in range(world):
        for r in range(2):
            assert bool((got[rank, r] == 1.0 + 10 * r).all())
    took = max(ended[rank, 1] for rank in range(world)) - start
    assert took == pytest.approx(DEFAULTS.heartbeat_timeout, abs=1.0)


class _Partitioned(MemoryNetwork):
    """A memory network on which the ports in ``refused`` take no new connection (a
    firewall between the relays and one shard; connections already up stay up)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[int] = set()

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        if int(port) in self.refused:
            await trio.lowlevel.checkpoint()
            raise ConnectionRefusedError(f"memory port {port} is firewalled")
        return await super().connect(host, port)


@pytest.mark.deadline(600)  # virtual seconds
async def test_a_shard_the_relays_cannot_reach_at_their_first_round_costs_only_that_shard(autojump_clock, salt):
    """The controller set shard 1 up, but no relay can reach it when it dials the
    shards before its first round: each says so (``ShardLost``), the controller loses
    shard 1 for everyone, its lanes go to shard 0 and every round is exact. (The
    relays stopped instead, each after its 30 s of connect retries, and took every
    rank with them: the first dial was the one dial that did not report.)"""
    network = _Partitioned()
    world, rounds = 3, 2
    rng = np.random.default_rng(7)
    values = {r: rng.standard_normal(2_000).astype(np.float32) for r in range(world)}
    weights = {r: float(r + 1) for r in range(world)}
    async with open_local_cluster(salt=salt, network=network, bounds=DEFAULTS, shards=2, lanes=5, lane_min_bytes=0,
                                  world_size=world, hosts=[[0], [1], [2]]) as cluster:
        network.refused.add(cluster.shards[1].port)
        got = await weighted_rounds(cluster, values, weights, rounds)
        assert cluster.controller.stats.shards_lost == 1
    check_weighted(got, values, weights, rounds)
