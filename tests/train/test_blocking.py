"""The blocking facade: synchronous threads as ranks, against a real cluster."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import trio

from flodl_trio import FlodlError, RankDeadError
from flodl_trio.client import CoordinatorLost
from flodl_trio.testing import open_local_cluster
from flodl_trio.train.blocking import BlockingReduceClient

SIG = b"\x33" * 32


async def run_rank_threads(target, ranks, seconds: float) -> None:
    """One synchronous thread per rank, as a non-trio trainer runs; wait for them all."""
    threads = [threading.Thread(target=target, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    await trio.to_thread.run_sync(lambda: [t.join(seconds) for t in threads])


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

        await run_rank_threads(rank_thread, (0, 1), 20)
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


async def test_facade_a_rank_closed_mid_run_rejoins_with_join_and_finish_ends_the_run(salt):
    """Thread ranks through the facade: rank 1 leaves after 3 windows (close: may come back),
    a new client joins from the consensus, and leaving ``with`` normally says "finished"."""
    windows = 10
    held: dict[tuple[int, int], list[float]] = {}
    errors: list[BaseException] = []
    back = {}
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt, rejoin_timeout=60) as cluster:

        def window(client: BlockingReduceClient, rank: int, w: int, params: torch.Tensor) -> None:
            time.sleep(0.05)  # "training"
            params.add_(float(rank + 1) * (w + 1))
            client.all_reduce_per_rank_f64([1.0 if r == rank else 0.0 for r in range(2)])  # a window starts
            client.all_reduce_tensors([params], in_place=True)
            held[rank, w] = params.tolist()

        def rank_thread(rank: int) -> None:
            try:
                params = torch.zeros(4)
                with BlockingReduceClient(cluster.relay_address(rank), rank, 2, salt) as client:
                    assert client.join([params]) == 0
                    for w in range(3 if rank == 1 else windows):
                        window(client, rank, w, params)
                    if rank == 1:
                        client.close()  # gone without saying it finished
                if rank == 1:
                    fresh = torch.zeros(4)
                    with BlockingReduceClient(cluster.relay_address(rank), rank, 2, salt) as client:
                        back["start"] = start = client.join([fresh])
                        back["loaded"] = fresh.tolist()
                        back["window"] = client.last_state.window
                        for w in range(start, windows):
                            window(client, rank, w, fresh)
            except BaseException as exc:
                errors.append(exc)

        await run_rank_threads(rank_thread, (0, 1), 30)
        assert not errors, errors
        with trio.fail_after(5):  # both said they finished: nobody is waited for
            await cluster.controller.wait_finished()
        assert cluster.controller.stats.rejoins == 1
    start = back["start"]
    assert 3 < start < windows
    assert back["window"] < start
    assert back["loaded"] == held[0, back["window"]]  # it started from the consensus
    assert held[0, windows - 1] == held[1, windows - 1]


async def test_a_call_that_fails_on_its_arguments_leaves_the_facade_usable(salt):
    """The trio client refuses a bad argument and stays usable; so does its blocking
    facade: the error goes back to the caller, whatever its type (before, anything
    but a FlodlError ended the helper thread, and every later call raised it again)."""
    got: list[object] = []
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        def rank_thread() -> None:
            with BlockingReduceClient(cluster.relay_address(0), 0, 1, salt) as client:
                with pytest.raises(AttributeError):
                    client.all_reduce_tensors([1.0])  # type: ignore[list-item]  # not a tensor
                with pytest.raises(TypeError):
                    client.all_reduce_per_rank_f64(None)  # type: ignore[arg-type]
                got.append(client.all_reduce_tensors([torch.full((2,), 3.0)])[0].tolist())

        await trio.to_thread.run_sync(rank_thread)
    assert got == [[3.0, 3.0]]


async def test_an_error_of_finishing_itself_reaches_the_caller(salt, monkeypatch):
    """``ReduceClient.finish`` may fail after the last round (a delta run's last digest
    check: this rank's base differs): through the facade that error is raised by
    ``finish()`` (and a normal ``with`` exit), not lost in the helper thread."""
    from flodl_trio.client import ReduceClient

    original = ReduceClient.finish

    async def finish_then_fail(self: ReduceClient) -> None:
        await original(self)
        raise FlodlError(f"rank {self.rank}: the last consensus's base digest differs from this rank's base")

    monkeypatch.setattr(ReduceClient, "finish", finish_then_fail)
    raised: list[BaseException] = []
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        def rank_thread() -> None:
            try:
                with BlockingReduceClient(cluster.relay_address(0), 0, 1, salt) as client:
                    client.all_reduce_tensors([torch.ones(2)])
            except FlodlError as exc:
                raised.append(exc)

        await trio.to_thread.run_sync(rank_thread)
    assert [str(e) for e in raised] == ["rank 0: the last consensus's base digest differs from this rank's base"]
