"""A rank that joins while the only other live rank is between its last window and
leaving: once that rank has left (finished or crashed) no window will end, so the
cluster is one in which every rank is dead, and the joiner enters at once with the
last finished window's consensus (docs/api.md, ``join``; docs/liveness.md).

Real sockets, a real controller and relays in one trio run.
"""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.testing import open_local_cluster, wait_until_primed
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"last-leaves-salt")
WORLD = 2
WINDOWS = 3


@pytest.mark.trio
@pytest.mark.parametrize("hosts", [[[0], [1]], [[0, 1]]], ids=["two-hosts", "one-host"])
@pytest.mark.parametrize("how", ["finish", "crash"])
@pytest.mark.parametrize("mode", ["late", "rejoin"])
async def test_a_join_while_the_last_live_rank_leaves_enters_once_it_has_left(mode, how, hosts):
    formation = {"min_ranks": 1, "formation_timeout": 0.2} if mode == "late" else {}
    entered: list[tuple[int, list[float]]] = []
    alone: list[list[float]] = []
    with trio.fail_after(20):
        async with open_local_cluster(
            world_size=WORLD, hosts=hosts, salt=SALT, rejoin_timeout=30.0, **formation
        ) as cluster:
            last_window_done = trio.Event()
            first_life_over = trio.Event()

            async def rank0() -> None:
                params = [torch.zeros(3)]
                client = await connect_reduce_client(cluster.relay_address(0), 0, WORLD, SALT)
                await client.join(params)
                if mode == "rejoin":
                    await first_life_over.wait()
                for _window in range(WINDOWS):
                    with torch.no_grad():
                        params[0].add_(1.0)
                    await average_window(client, params, [], 1, rank=0, world_size=WORLD, in_place=True)
                last_window_done.set()
                # Saving the model, say: rank 1's join has its state and waits for a boundary.
                await wait_until_primed(cluster.controller_address, [1])
                if how == "finish":
                    await client.finish()
                await client.aclose()

            async def rank1() -> None:
                params = [torch.zeros(3)]
                if mode == "rejoin":  # a first life that crashed
                    client = await connect_reduce_client(cluster.relay_address(1), 1, WORLD, SALT)
                    await client.join(params)
                    await client.aclose()
                    first_life_over.set()
                await last_window_done.wait()
                async with connect_reduce_client(cluster.relay_address(1), 1, WORLD, SALT) as client:
                    start = await client.join(params)
                    entered.append((start, params[0].tolist()))
                    with torch.no_grad():
                        params[0].add_(1.0)
                    await average_window(client, params, [], 1, rank=1, world_size=WORLD, in_place=True)
                    alone.append(params[0].tolist())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(rank0)
                nursery.start_soon(rank1)
            stats = cluster.controller.stats
            assert (stats.late_joins, stats.rejoins) == ((1, 0) if mode == "late" else (0, 1))
    # The consensus of rank 0's last window, and the window after it.
    assert entered == [(WINDOWS, [3.0, 3.0, 3.0])]
    assert alone == [[4.0, 4.0, 4.0]]
