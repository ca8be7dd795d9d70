"""The blocking facade: synchronous threads as ranks, against a real cluster."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from flodl_trio import FlodlError, RankDeadError
from flodl_trio.blocking import BlockingReduceClient
from flodl_trio.client import CoordinatorLost
from flodl_trio.testing import open_local_cluster

SIG = b"\x33" * 32


async def test_sync_threads_average_through_the_facade(salt):
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt, control=True, heartbeat_timeout=2.0) as cluster:
        def rank_thread(rank: int) -> None:
            try:
                with BlockingReduceClient(cluster.relay_address(rank), rank, 2, salt,
                                          control_address=cluster.control_address(rank), model_signature=SIG) as client:
                    out = client.all_reduce_tensors([torch.tensor([float(rank), 10.0 * rank])])
                    counts = client.all_reduce_per_rank_f64([5.0 if rank == 0 else 0.0, 7.0 if rank == 1 else 0.0])
                    root = client.broadcast_from_root([torch.tensor([42.0 + rank])], 1)
                    results[rank] = out[0].tolist() + counts + root[0].tolist()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank_thread, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        await trio.to_thread.run_sync(lambda: [t.join(20) for t in threads])
    assert not errors, errors
    assert results == {0: [0.5, 5.0, 5.0, 7.0, 43.0], 1: [0.5, 5.0, 5.0, 7.0, 43.0]}


async def test_facade_pending_call_raises_when_the_cluster_goes_away(salt):
    outcome: list[BaseException] = []
    connected = threading.Event()
    cancel = trio.CancelScope()

    async with trio.open_nursery() as nursery:
        with cancel:
            async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt, control=True, heartbeat_timeout=1.0) as cluster:
                def lonely_rank() -> None:
                    with BlockingReduceClient(cluster.relay_address(0), 0, 2, salt,
                                              control_address=cluster.control_address(0), model_signature=SIG) as client:
                        connected.set()
                        try:
                            client.all_reduce_tensors([torch.ones(1)])  # rank 1 never comes: this waits
                        except FlodlError as exc:
                            outcome.append(exc)

                nursery.start_soon(trio.to_thread.run_sync, lonely_rank)
                await trio.to_thread.run_sync(connected.wait, 10)
                await trio.sleep(0.3)
                cancel.cancel()  # controller, coordinator and relays disappear
    assert len(outcome) == 1 and isinstance(outcome[0], (CoordinatorLost, RankDeadError)), outcome


def test_facade_reports_connect_failure(salt):
    with pytest.raises(FlodlError, match="connect to 127.0.0.1:1 failed"):
        BlockingReduceClient(("127.0.0.1", 1), 0, 1, salt, connect_attempts=2, connect_interval=0.01)
