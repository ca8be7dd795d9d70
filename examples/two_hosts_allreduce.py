"""Two simulated hosts, four ranks, one process: the whole data plane on loopback.

    controller <- relay host0 (ranks 0, 1)
               <- relay host1 (ranks 2, 3)

Each rank holds a tensor filled with its rank id and does a few rounds of
all-reduce; then rank 3 leaves and the survivors keep averaging without it.
Run: python examples/two_hosts_allreduce.py
"""

from __future__ import annotations

import torch
import trio

from flodl_trio import SessionSalt, connect_reduce_client
from flodl_trio.testing import open_local_cluster

WORLD = 4
HOSTS = [[0, 1], [2, 3]]


async def rank_main(cluster, rank: int, salt: SessionSalt, rounds: int) -> None:
    async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, salt) as client:
        for round_index in range(rounds):
            local = torch.full((4,), float(rank + round_index))
            mean = await client.all_reduce_tensors([local])
            print(f"round {round_index} rank {rank}: local {local[0].item():.1f} -> mean {mean[0][0].item():.3f}")


async def main() -> None:
    salt = SessionSalt.generate()
    async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt) as cluster:
        async with trio.open_nursery() as nursery:
            for rank in range(WORLD):
                # rank 3 stops after 2 rounds; the others go on with a smaller barrier
                nursery.start_soon(rank_main, cluster, rank, salt, 2 if rank == 3 else 4)
        await cluster.controller.wait_finished()
        stats = cluster.controller.stats
        print(f"controller: {stats.rounds} rounds, last accepted mass {stats.last_mass}")
        for relay in cluster.relays:
            s = relay.stats
            print(f"relay {relay.host_name}: {s.rounds} rounds, fold ratio {s.fold_ratio:.2f}x")


if __name__ == "__main__":
    trio.run(main)
