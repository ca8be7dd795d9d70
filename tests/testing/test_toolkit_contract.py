"""What docs/fault-injection.md promises of the toolkit itself: FaultProxy as an async
context manager, run_ranks' signature, ``log_dir`` created on demand, the uplink offset
helpers on both kinds of cluster, the "ordering a restart" recipe as the page writes it,
and wait_returns_* raising instead of hanging when a restarted rank is refused."""

from __future__ import annotations

import ast
import inspect
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from flodl_trio import SessionSalt
from flodl_trio.testing import (
    DuplicateRecord,
    FaultProxy,
    FlipBit,
    LocalCluster,
    open_local_cluster,
    open_process_cluster,
)
from flodl_trio.testing.matrix.offsets import (
    host_frame_record_len,
    uplink_first_record,
    uplink_host_frame_record,
    uplink_host_frame_start,
)
from flodl_trio.testing.windows import check_final_and_joins, check_windows, first_counted

LOOP = "127.0.0.1"


async def echo(stream: trio.SocketStream) -> None:
    """Echo everything back until the client's EOF (or a reset)."""
    try:
        while chunk := await stream.receive_some(1 << 16):
            await stream.send_all(chunk)
    except trio.BrokenResourceError:
        pass


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = await stream.receive_some(n - len(out))
        assert chunk, f"EOF after {bytes(out)!r}"
        out += chunk
    return bytes(out)


# ---------------------------------------------------------------------------
# FaultProxy: `async with FaultProxy(target, faults) as proxy:`
# ---------------------------------------------------------------------------


@pytest.mark.deadline(20)
async def test_fault_proxy_is_an_async_context_manager_that_serves_for_the_block():
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host=LOOP))
        target = (LOOP, listeners[0].socket.getsockname()[1])
        proxy = FaultProxy(target, [FlipBit(2, bit=0)])
        with pytest.raises(RuntimeError, match="not listening yet"):
            _ = proxy.address
        async with proxy as entered:
            assert entered is proxy
            port = proxy.port  # bound on entry
            assert proxy.address == (LOOP, port) and port != target[1]
            client = await trio.open_tcp_stream(*proxy.address)
            await client.send_all(b"abcd")
            assert await receive_exactly(client, 4) == b"abbd"  # 'c' (0x63) with bit 0 flipped, echoed back
            [event] = await proxy.wait_fired(FlipBit)
            assert (event.connection, event.direction, event.offset) == (0, "up", 2)
            with pytest.raises(RuntimeError, match="already serving"):
                async with proxy:
                    pass
        # Leaving the block closed the proxied connection and the listener.
        assert proxy.connections[0].closed_at is not None
        assert proxy.connections[0].outcome == "cancelled"
        with pytest.raises(OSError):
            await trio.open_tcp_stream(LOOP, port)
        await client.aclose()
        # The block's own exception comes out as itself, and the proxy can serve again.
        with pytest.raises(KeyError):
            async with proxy:
                raise KeyError("from the body")
        async with proxy:
            again = await trio.open_tcp_stream(*proxy.address)
            await again.send_all(b"xy")
            assert await receive_exactly(again, 2) == b"xy"  # FlipBit(2) is past these 2 bytes
            await again.aclose()
        nursery.cancel_scope.cancel()


def test_run_ranks_takes_addresses_by_keyword_only():
    """fault-injection.md: ``run_ranks(rank_main, ranks=None, *, addresses=None)``."""
    parameters = inspect.signature(LocalCluster.run_ranks).parameters
    assert list(parameters) == ["self", "rank_main", "ranks", "addresses"]
    assert parameters["ranks"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and parameters["ranks"].default is None
    assert parameters["addresses"].kind is inspect.Parameter.KEYWORD_ONLY and parameters["addresses"].default is None


# ---------------------------------------------------------------------------
# open_process_cluster(log_dir=...) creates the folder
# ---------------------------------------------------------------------------


@pytest.mark.deadline(40)
@pytest.mark.parametrize("daemons", [False, True])
async def test_log_dir_is_created_with_its_parents(salt, tmp_path, daemons):
    log_dir = tmp_path / "not" / "there" / "yet"
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=1, backend="numpy", control=False, daemons=daemons,
        log_dir=log_dir,
    ) as cluster:
        for rank in (0, 1):
            assert (await cluster.wait_outcome(rank))["event"] == "done"
    names = {path.name for path in log_dir.iterdir()}
    expected = {"rank-0.log", "rank-1.log"} | ({"controller.log", "relay-host0.log", "relay-host1.log"} if daemons else set())
    assert names == expected
    assert (log_dir / "rank-0.log").read_bytes() == cluster.ranks[0].output


# ---------------------------------------------------------------------------
# The uplink helpers: Hello, (ShardOffer on daemons), then the HostFrames
# ---------------------------------------------------------------------------


def test_uplink_offsets_arithmetic():
    numel = 4
    plain = uplink_first_record("host1", [1])
    offering = uplink_first_record("host1", [1], offers_shard=True)
    assert offering > plain  # the ShardOffer record sits between the Hello and the first HostFrame
    for k in range(3):
        step = k * host_frame_record_len(numel)
        assert uplink_host_frame_start("host1", [1], k, numel) == plain + step
        assert uplink_host_frame_start("host1", [1], k, numel, offers_shard=True) == offering + step
        assert uplink_host_frame_record(k) == 1 + k
        assert uplink_host_frame_record(k, offers_shard=True) == 2 + k


@pytest.mark.deadline(40)
@pytest.mark.parametrize("daemons", [False, True])
async def test_uplink_helpers_aim_at_round_1s_host_frame_on_both_kinds_of_cluster(salt, daemons):
    """A relay daemon offers its shard right after its Hello; an in-process relay does not.
    Record ``uplink_host_frame_record(1, offers_shard=daemons)`` is round 1's HostFrame:
    it starts at ``uplink_host_frame_start(..., 1, offers_shard=daemons)`` and is one
    HostFrame long."""
    numel = 4
    index = uplink_host_frame_record(1, offers_shard=daemons)
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=3, backend="numpy", numel=numel, control=False,
        daemons=daemons, upstream_faults={1: [DuplicateRecord(index, framing="mux")]},
    ) as cluster:
        [event] = await cluster.upstream_proxies[1].wait_fired(DuplicateRecord)
    assert event.offset == uplink_host_frame_start("host1", [1], 1, numel, offers_shard=daemons)
    assert event.detail == f"record {index} ({host_frame_record_len(numel)} bytes) sent twice"


@pytest.mark.deadline(40)
async def test_in_process_relays_offering_their_shard_are_aimed_at_with_offers_shard():
    """``open_local_cluster(shards="auto")``: each data relay offers its shard after its
    Hello, as a relay daemon does."""
    import torch

    numel = 4
    index = uplink_host_frame_record(1, offers_shard=True)
    async with open_local_cluster(
        world_size=3, hosts=[[0], [1], [2]], salt=SessionSalt.generate(), shards="auto",
        upstream_faults={1: [DuplicateRecord(index, framing="mux")]},
    ) as cluster:

        async def rank_main(rank, client):
            for _ in range(2):
                await client.all_reduce_tensors([torch.ones(numel)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cluster.run_ranks, rank_main)  # the replay ends host 1's run: not awaited
            [event] = await cluster.upstream_proxies[1].wait_fired(DuplicateRecord)
            nursery.cancel_scope.cancel()
    assert event.offset == uplink_host_frame_start("host1", [1], 1, numel, offers_shard=True)
    assert event.detail == f"record {index} ({host_frame_record_len(numel)} bytes) sent twice"


# ---------------------------------------------------------------------------
# "Ordering a restart", as fault-injection.md writes it
# ---------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "fault-injection.md"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def restart_recipe() -> str:
    """The page's "Ordering a restart" block, byte for byte."""
    [block] = [b for b in FENCE.findall(DOC.read_text()) if "await cluster.wait_returns_primed(" in b]
    return block


@pytest.mark.deadline(120)
async def test_the_ordering_a_restart_recipe_runs_as_written(salt):
    """The recipe's own asserts hold (rank 1 enters by window W + 1, everyone finishes),
    and every window of the run is the exact mean of the ranks that were in it."""
    scope: dict[str, Any] = {"open_process_cluster": open_process_cluster, "salt": salt}
    code = compile(restart_recipe(), str(DOC), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, scope)
    if inspect.iscoroutine(result):
        await result
    cluster, joined, w = scope["cluster"], scope["joined"], scope["W"]
    assert 2 <= joined["start"] <= w + 1  # rank 1 was killed after window 1
    paused = next(e for e in cluster.ranks[0].events if e["event"] == "paused")
    ready = next(e for e in cluster.ranks[1].events if e["event"] == "ready")
    if paused["time"] < ready["time"]:  # primed while the survivor held (its join follows "ready")
        assert (joined["start"], joined["state_window"]) == (w + 1, w - 1)  # as the page says...
        assert first_counted(cluster, 1) == w + 2  # ...entered behind: it counts from the window after
    # Killed once it reported window 1, rank 1 may have been counted in window 2 (or 3)
    # by the Control round and not have made it into the params round.
    contributors = check_windows(cluster, 6, 4, maybe_in={2: {1}, 3: {1}})
    check_final_and_joins(cluster, 6, contributors)
    assert all(1 in contributors[window] for window in range(joined["start"] + 1, 6))
    survivor = [e["event"] for e in cluster.ranks[0].events]
    assert survivor.count("paused") == 1 and "resumed" not in survivor  # --windows: no `resumed`
    assert survivor[:2] == ["ready", "joined"] and survivor[-1] == "done"
    assert not any(e["event"] in ("round", "resumed") for life in cluster.past_lives[1] for e in life.events)


@pytest.mark.deadline(90)
async def test_wait_returns_primed_raises_when_the_restarted_rank_is_refused(salt):
    """In-process the controller lets no dead rank back (rejoin_timeout 0): the
    restarted rank's join is refused, and the wait says so instead of hanging."""
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, backend="torch",
        worker_args={0: ["--windows", "4", "--pause-before", "2:inf"], 1: ["--windows", "4"]},
    ) as cluster:
        await cluster.wait_event(1, "window", window=0)
        cluster.kill(1)
        await cluster.wait_exit(1)
        await cluster.restart(1)
        with pytest.raises(RuntimeError, match="rank 1 ended before it came back.*JoinRefused"):
            await cluster.wait_returns_primed([1])
        with pytest.raises(RuntimeError, match="rank 1 ended before it came back"):
            await cluster.wait_returns_joining([1])
        await cluster.resume(0)
        assert (await cluster.wait_outcome(0))["event"] == "done"


# ---------------------------------------------------------------------------
# Daemon-only options on an in-process cluster are an error, not ignored
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [
        {"controller_args": ["--rejoin-timeout", "60"]},
        {"controller_env": {"FLODL_NET_TIMEOUT_SCALE": "0.1"}},
        {"relay_args": {0: ["--deterministic"]}},
        {"relay_env": {0: {"FLODL_NET_TIMEOUT_SCALE": "0.1"}}},
        {"controller_wrap": ["env"]},
        {"controller_host": "127.0.0.2"},
        {"beside_controller": 0},
    ],
    ids=lambda option: next(iter(option)),
)
async def test_daemon_options_without_daemons_are_refused_not_ignored(salt, option):
    """fault-injection.md lists them as the daemons' flags and environment: without
    ``daemons=True`` there is no daemon to give them to, and a test that relies on one
    (``controller_args=["--rejoin-timeout", "60"]`` for a restart, say) must hear so."""
    [name] = option
    with pytest.raises(TypeError, match=f"{name}.*daemons=True"):
        async with open_process_cluster(world_size=1, hosts=[[0]], salt=salt, backend="numpy", **option):
            pytest.fail("the cluster started")


@pytest.mark.deadline(30)
async def test_a_rank_without_a_process_is_named_in_the_error(salt):
    """kill/freeze/thaw/resume/wait_* on a rank that has no process (one of
    external_ranks, not launched) or is not in the world say which and why, not a
    bare ``KeyError: 1``."""
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=1, backend="numpy", control=False, external_ranks={1},
    ) as cluster:
        for call in (cluster.kill, cluster.freeze, cluster.thaw):
            with pytest.raises(KeyError, match="rank 1 has no process: it is one of external_ranks"):
                call(1)
        with pytest.raises(KeyError, match="rank 7 is not a rank of this cluster \\(world_size 2\\)"):
            cluster.kill(7)
        for wait in (cluster.wait_outcome(1), cluster.wait_exit(1), cluster.resume(1), cluster.wait_round(1, 0),
                     cluster.restart(1), cluster.wait_returns_primed([1])):
            with pytest.raises(KeyError, match="rank 1 has no process"):
                await wait


@pytest.mark.deadline(40)
async def test_wait_returns_outlasts_a_controller_that_is_down_or_frozen(salt):
    """wait_returns_* return once the ranks are listed, or raise RuntimeError once a rank's
    process ends first. A controller that is down for a while (restarting, say) is not
    an answer (the wait goes on), and a frozen one does not keep the wait from seeing
    the rank's process end."""
    import sys

    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=1, daemons=True, backend="numpy", control=False,
        external_ranks={1},
    ) as cluster:
        await cluster.launch_rank(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        cluster.kill_controller()
        assert cluster.controller is not None
        await cluster.controller.wait()
        with trio.move_on_after(1) as waited:  # nothing to list it: the wait goes on
            await cluster.wait_returns_joining([1])
        assert waited.cancelled_caught
        await cluster.restart_controller()
        cluster.freeze_controller()
        async with trio.open_nursery() as nursery:

            async def wait_for_return() -> None:
                with pytest.raises(RuntimeError, match="rank 1 ended before it came back"):
                    await cluster.wait_returns_primed([1])

            nursery.start_soon(wait_for_return)
            await trio.testing.wait_all_tasks_blocked(0.2)  # it is waiting on the frozen controller's page
            cluster.kill(1)


async def test_close_relay_loses_that_host_alone(autojump_clock, salt):
    """fault-injection.md: ``close_relay(i)`` stops host i's relays; its ranks raise
    ``RankDeadError`` and the other hosts average on without them."""
    import torch

    from flodl_trio import RankDeadError, connect_reduce_client
    from flodl_trio.testing import MemoryNetwork

    means: dict[int, list[float]] = {}
    errors: dict[int, BaseException] = {}
    async with open_local_cluster(world_size=3, hosts=[[0], [1, 2]], salt=salt, network=MemoryNetwork()) as cluster:
        first_done = {rank: trio.Event() for rank in range(3)}
        closed = trio.Event()

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt,
                                             connect=cluster.connect) as client:
                await client.all_reduce_tensors([torch.full((4,), float(rank))])
                first_done[rank].set()
                await closed.wait()
                try:
                    means[rank] = (await client.all_reduce_tensors([torch.full((4,), float(rank))]))[0].tolist()
                except RankDeadError as exc:
                    errors[rank] = exc

        async with trio.open_nursery() as nursery:
            for rank in range(3):
                nursery.start_soon(rank_main, rank)
            for event in first_done.values():
                await event.wait()
            cluster.close_relay(1)
            closed.set()
    assert means == {0: [0.0] * 4}
    assert set(errors) == {1, 2} and all(f"rank {rank}" in str(errors[rank]) for rank in errors)
