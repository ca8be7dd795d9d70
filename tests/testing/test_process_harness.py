"""The process-cluster harness itself: daemons as processes, proxies on every leg,
rank_worker holds, external ranks, and reaping every process on the way out."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest
import trio

from flodl_trio import (
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    TensorPayload,
    connect_reduce_client,
)
from flodl_trio.testing import memory_of, open_process_cluster
from flodl_trio.testing.processes import worker_command
from flodl_trio.testing.rank_worker import contribution, parse_pause


def mean_of(ranks, k: int) -> float:
    return sum((r + 1) * (k + 1) for r in ranks) / len(ranks)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.deadline(40)
async def test_daemon_cluster_runs_and_reaps_every_process_even_frozen_ones(salt):
    async with open_process_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], salt=salt, rounds=200, pause=0.05, daemons=True, backend="numpy",
        heartbeat_timeout=5.0,
    ) as cluster:
        await cluster.wait_round(3, 1)
        assert cluster.daemons and cluster.local is None
        assert cluster.controller is not None and cluster.controller.returncode is None
        assert [len(h) for h in cluster.relays] == [1, 1]
        assert len({cluster.controller_port, *cluster.data_ports, *cluster.control_ports}) == 5
        for rank in range(4):
            event = cluster.ranks[rank].rounds[0]
            assert event["value"] == event["min"] == event["max"] == pytest.approx(mean_of(range(4), 0))
            assert event["mass"] == 4.0
        status = await cluster.status()
        assert status["world_size"] == 4 and status["stats"]["relays"] == 2
        assert "relay host0 started" in cluster.relays[0][0].text
        children = cluster.processes()
        assert len(children) == 7
        cluster.freeze(1)
        cluster.freeze_relay(1)
        cluster.freeze_controller()
    for child in children:
        assert child.returncode is not None, child.name
        assert gone(child.pid), child.name


@pytest.mark.deadline(30)
async def test_pause_before_holds_a_rank_until_resumed(salt):
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=3, daemons=True, backend="numpy", control=False,
        worker_args={1: ["--pause-before", "1:60"]},
    ) as cluster:
        await cluster.wait_event(1, "paused", round=1)
        await trio.sleep(0.3)
        assert [e["round"] for e in cluster.ranks[0].rounds] == [0]  # round 1 waits for rank 1
        await cluster.resume(1)
        for rank in (0, 1):
            assert (await cluster.wait_outcome(rank))["event"] == "done"
            assert [e["value"] for e in cluster.ranks[rank].rounds] == [mean_of([0, 1], k) for k in range(3)]
        resumed = await cluster.wait_event(1, "resumed", round=1)
        assert resumed["time"] - (await cluster.wait_event(1, "paused", round=1))["time"] < 30


@pytest.mark.deadline(40)
@pytest.mark.parametrize("daemons", [False, True], ids=["in-process", "daemons"])
async def test_proxies_on_the_data_control_and_uplink_legs(salt, daemons):
    async with open_process_cluster(
        world_size=3, hosts=[[0, 1], [2]], salt=salt, rounds=2, daemons=daemons, backend="numpy",
        heartbeat_timeout=5.0, proxy_faults={0: []}, control_proxy_faults={1: []}, upstream_faults={1: []},
    ) as cluster:
        for rank in range(3):
            assert (await cluster.wait_outcome(rank))["event"] == "done"
            assert [e["value"] for e in cluster.ranks[rank].rounds] == [mean_of(range(3), k) for k in range(2)]
        for proxy in (cluster.proxies[0], cluster.control_proxies[1], cluster.upstream_proxies[1]):
            assert proxy.connections and proxy.connections[0].up.bytes_out > 0
            assert proxy.connections[0].down.bytes_out > 0
        assert cluster.proxies[0].target == cluster.relay_address(0)
        assert cluster.control_proxies[1].target == cluster.control_address(1)
        assert cluster.upstream_proxies[1].target == cluster.controller_address
        if daemons:  # a proxied uplink splits that host's relay: data via the proxy, control direct
            assert [p.name for p in cluster.relay_processes(1)] == ["relay host1 (data)", "relay host1 (control)"]
        else:
            assert cluster.local is not None and cluster.local.upstream_proxies[1] is cluster.upstream_proxies[1]


@pytest.mark.deadline(30)
async def test_external_rank_is_played_by_the_test(salt):
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=1, daemons=True, backend="numpy", control=False,
        external_ranks={1},
    ) as cluster:
        assert sorted(cluster.ranks) == [0]
        async with connect_reduce_client(cluster.relay_address(1), 1, 2, salt) as client:
            local = np.full(4, contribution(1, 0), dtype="<f4")
            reply = await client.all_reduce(RoundFrame([TensorPayload(DTYPE_F32, (4,), local)], RoundKind.MODEL, 1.0))
        assert np.frombuffer(reply.tensors[0].data, "<f4").tolist() == [mean_of([0, 1], 0)] * 4
        assert (await cluster.wait_outcome(0))["event"] == "done"


@pytest.mark.deadline(40)
async def test_a_launched_external_rank_is_followed_logged_and_restarted(salt, tmp_path):
    """An external rank started with launch_rank (the demo's way): its events are followed
    in order to its exit, every process logs to log_dir, and a restart gets a file of its own
    (the restarted rank has no one left to average with: leaving the block reaps it)."""
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=2, daemons=True, backend="numpy", control=False,
        external_ranks={1}, log_dir=tmp_path,
    ) as cluster:
        assert sorted(cluster.ranks) == [0]
        cmd = worker_command(cluster, 1, rounds=2, pause=0.0, heartbeat_timeout=None, extra=["--backend", "numpy"])
        first = await cluster.launch_rank(1, cmd)
        with pytest.raises(RuntimeError, match="already has a process"):
            await cluster.launch_rank(1, cmd)
        followed = [event["event"] async for event in first.follow()]
        assert followed == [e["event"] for e in first.events] and followed[-1] == "done", followed
        assert [e["value"] for e in first.rounds] == [mean_of([0, 1], k) for k in range(2)]
        assert await cluster.wait_exit(1) == 0
        second = await cluster.restart(1)
        assert second.log_path == tmp_path / "rank-1-2.log" and first.log_path == tmp_path / "rank-1.log"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "controller.log", "rank-0.log", "rank-1-2.log", "rank-1.log", "relay-host0.log", "relay-host1.log",
    ]
    assert "controller started" in (tmp_path / "controller.log").read_text()
    assert (tmp_path / "relay-host1.log").read_text() == cluster.relays[1][0].text


@pytest.mark.deadline(30)
async def test_worker_reports_a_refusal_as_an_error_event(salt):
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=2, daemons=True, backend="numpy", control=False,
        worker_args={1: ["--data-salt", "24" * 16, "--tcp"]},
    ) as cluster:
        error = await cluster.wait_outcome(1)
        assert error["event"] == "error" and error["type"] == "RankDeadError", error
        assert await cluster.wait_exit(1) == 3
        # Rank 0's rounds complete only once the relay dropped rank 1: wait for them.
        assert (await cluster.wait_outcome(0))["event"] == "done"
        assert [e["value"] for e in cluster.ranks[0].rounds] == [mean_of([0], k) for k in range(2)]
        await cluster.relays[1][0].wait_log("MAC mismatch")


@pytest.mark.deadline(30)
async def test_a_rank_of_another_run_is_refused_at_the_local_legs_handshake(salt):
    """Frames on the local leg carry no MAC, so the salt is proven once, at the handshake.
    (Refused there, rank 1 never joins the barrier: its control connection closing is
    what tells the cluster it is gone.)"""
    async with open_process_cluster(
        world_size=2, hosts=[[0, 1]], salt=salt, rounds=2, daemons=True, backend="numpy",
        worker_args={1: ["--data-salt", "24" * 16, "--connect-attempts", "1"]},
    ) as cluster:
        error = await cluster.wait_outcome(1)
        assert error["event"] == "error" and error["type"] == "FramingError", error
        assert "another session salt (local leg)" in error["message"]
        assert (await cluster.wait_outcome(0))["event"] == "done"
        assert [e["value"] for e in cluster.ranks[0].rounds] == [mean_of([0], k) for k in range(2)]
        await cluster.relays[0][0].wait_log("local-leg handshake of rank 1: MAC mismatch")


def test_memory_of_reads_proc_status():
    mine = memory_of(os.getpid())
    assert mine is not None and mine["VmPeak"] >= mine["VmSize"] > 0 and mine["VmHWM"] >= mine["VmRSS"] > 0
    assert memory_of(2**22 + 12345) is None


def test_pause_before_argument():
    assert parse_pause("2:1.5") == (2, 1.5)
    assert parse_pause("0:inf") == (0, float("inf"))
    for bad in ("2", "x:1", "-1:1", "1:-2", "1:nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_pause(bad)


@pytest.mark.deadline(90)
async def test_the_demo_stops_its_daemons_when_a_killed_rank_never_comes_back(salt, tmp_path):
    """The demo with ``--rejoin-at 0`` (its victim is never started again): the victim's
    relay stays up for the rank that may come back, and would hold for its controller
    once that is stopped (the demo keeps checkpoints). Stopping the demo's daemons must
    still end every one of them within its bound, not fail with a traceback."""
    from flodl_trio.demo.cluster import DAEMON_EXIT_TIMEOUT_S, controller_args, stop_daemons

    demo = argparse.Namespace(outer="none")
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, daemons=True, control=False, external_ranks={1},
        controller_args=controller_args(demo, tmp_path), worker_args={0: ["--windows", "3", "--pause", "0.3"]},
    ) as cluster:
        victim = await cluster.launch_rank(1, worker_command(cluster, 1, rounds=1, pause=0.0, heartbeat_timeout=None,
                                                             extra=["--windows", "1000"]))
        await victim.wait_event(lambda event: event["event"] == "window")  # in the run, elastic (it joined)
        cluster.kill(1)
        assert (await cluster.wait_outcome(0))["event"] == "done"
        relay = cluster.relays[1][0]
        await relay.wait_log("staying up for ranks")
        with trio.fail_after(DAEMON_EXIT_TIMEOUT_S + 5):
            await stop_daemons(cluster)
        assert relay.returncode == 0 and cluster.controller is not None and cluster.controller.returncode == 0


@pytest.mark.parametrize("victim", ["0", "4", "-1"])
def test_the_demo_refuses_a_victim_that_is_not_one_of_ranks_1_to_3(victim):
    """Rank 0's windows pace the demo (the kill, the restart): with rank 0 as the victim
    the restart never came and the run ended in a traceback minutes later; a rank outside
    the cluster was never killed at all. Refused at once, as any bad option."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "flodl_trio.demo", "--victim", victim], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "--victim must be a rank 1..3" in result.stderr, result.stderr


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if _running(p)}


# A rank of the test's own that starts a child process, as torchrun starts its workers.
LAUNCHER = (
    "import json, subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(json.dumps({'event': 'ready', 'time': 0.0, 'child': child.pid}), flush=True)\n"
    "child.wait()\n"
)


@pytest.mark.deadline(40)
async def test_leaving_the_block_reaps_the_processes_children_too_even_when_the_test_fails(salt):
    """A relay daemon runs its reduction shard as a child process, and a launched rank
    (torchrun, say) may start workers of its own: a test that fails must leave none of
    them running - not a moment later, when the block has been left."""
    descendants: set[int] = set()
    with pytest.raises(KeyError, match="the test failed"):
        async with open_process_cluster(
            world_size=3, hosts=[[0], [1, 2]], salt=salt, rounds=2, daemons=True, backend="numpy",
            control=False, external_ranks={2},
        ) as cluster:
            launcher = await cluster.launch_rank(2, [sys.executable, "-c", LAUNCHER])
            ready = await cluster.wait_event(2, "ready")
            for rank in (0, 1):
                await cluster.wait_event(rank, "ready")  # their rounds wait for rank 2, which never comes
            cluster.freeze_relay(1)
            descendants = {g for child in cluster.processes() for g in _descendants(child.pid)}
            assert ready["child"] in descendants and len(descendants) >= 3  # two shards and the launcher's child
            raise KeyError("the test failed")
    assert launcher.returncode is not None
    assert not [pid for pid in descendants if _running(pid)]


# A rank of the test's own that prints more than events on stdout (a metrics line, say).
CHATTY = (
    "import json\n"
    "print(json.dumps({'loss': 0.5}))\n"
    "print('[1, 2]')\n"
    "print('42')\n"
    "print('not json')\n"
    "print(json.dumps({'event': 'ready', 'time': 1.0, 'rank': 1}))\n"
    "print(json.dumps({'event': 'done', 'time': 2.0, 'rank': 1}), flush=True)\n"
)


@pytest.mark.deadline(30)
async def test_a_launched_rank_may_print_lines_that_are_not_events(salt):
    """launch_rank's process reports JSON objects on stdout; any other line - plain text,
    or JSON that is not an object - is kept as a ``text`` event, and an object that names
    no ``event`` (a metrics line) is kept as it is: neither breaks the waits and views."""
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=1, backend="numpy", control=False, external_ranks={1},
    ) as cluster:
        proc = await cluster.launch_rank(1, [sys.executable, "-c", CHATTY])
        assert (await cluster.wait_event(1, "ready"))["time"] == 1.0
        assert (await cluster.wait_outcome(1))["event"] == "done"
        await cluster.wait_exit(1)
        followed = [event async for event in proc.follow()]
        assert followed[0] == {"loss": 0.5}
        assert [e["event"] for e in followed[1:]] == ["text"] * 3 + ["ready", "done"]
        assert [e["line"] for e in followed[1:4]] == ["[1, 2]", "42", "not json"]
        assert all(isinstance(e["time"], float) for e in followed[1:])
        assert proc.rounds == [] and proc.error is None
