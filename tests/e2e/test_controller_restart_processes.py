"""The controller daemon SIGKILLed (or SIGSTOPped, then killed) and started again with
the same command line: no rank or relay restarts, every window completes exact.

Real daemons and rank processes (``rank_worker --windows``), real signals. Relays and
ranks hold through the outage (``FLODL_CONTROLLER_OUTAGE``); the controller keeps its
resume record in its ``--checkpoint-dir``. Each window's consensus is checked against
the float64 reference over its contributors (as ``test_rejoin_processes`` does); with
DiLoCo in deterministic mode, the interrupted run must end bit-identical to the same
run uninterrupted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

from flodl_trio.testing import open_process_cluster
from flodl_trio.testing.matrix import diagnose
from flodl_trio.testing.processes import ProcessCluster
from flodl_trio.testing.windows import check_final_and_joins, check_windows, windows_of
from flodl_trio.wire.lanes import DEFAULT_LANE_MIN_BYTES
from tests.e2e.machines import TwoMachines

SALT = b"restart-process1"
WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 10
NUMEL = 256
HOLD = 5  # host 1's ranks hold before this window while the controller is stopped
OUTAGE = {"FLODL_CONTROLLER_OUTAGE": "60"}


def worker_args() -> dict[int, list[str]]:
    held = ["--pause-before", f"{HOLD}:inf"]
    return {r: ["--windows", str(WINDOWS), *(held if r in HOSTS[1] else [])] for r in range(WORLD)}


async def cluster_run(
    tmp_path: Path, controller_args: list[str], fault: Any, relay_args: list[str] | None = None,
    env: dict[str, str] = OUTAGE, numel: int = NUMEL, **where: Any,
) -> ProcessCluster:
    """2 hosts x 2 ranks training WINDOWS windows under daemons; ``fault(cluster)`` runs
    once host 0's HostFrame of window HOLD's first round is in and host 1's ranks hold.
    ``where``: the controller's ``controller_host`` and ``controller_wrap``."""
    async with open_process_cluster(
        world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
        numel=numel, pause=0.05, worker_args=worker_args(), worker_env={r: env for r in range(WORLD)},
        relay_env={h: env for h in range(len(HOSTS))}, relay_args={h: relay_args or [] for h in range(len(HOSTS))},
        controller_args=["--checkpoint-dir", str(tmp_path / "ckpt"), *controller_args], **where,
    ) as cluster:
        with diagnose(cluster):
            for rank in HOSTS[1]:
                await cluster.wait_event(rank, "paused", round=HOLD)
            await until_host0_delivered(cluster)
            await fault(cluster)
            for rank in HOSTS[1]:
                await cluster.resume(rank)
            for rank in range(WORLD):
                outcome = await cluster.wait_outcome(rank)
                assert outcome["event"] == "done", outcome
            for proc in cluster.processes():
                if proc not in cluster.past_controllers:
                    with trio.fail_after(20):
                        assert await proc.wait() == 0, (proc.name, proc.text[-3000:])
    return cluster


async def until_host0_delivered(cluster: ProcessCluster) -> None:
    """Until the controller's status page shows host 0's HostFrame in the open round."""
    while True:
        relays = (await cluster.status())["relays"]
        if any(r["host"] == "host0" and r["delivered"] for r in relays):
            return
        await trio.sleep(0.02)


async def kill_and_restart(cluster: ProcessCluster) -> None:
    cluster.kill_controller()
    await cluster.controller.wait()
    await cluster.restart_controller()


async def freeze_kill_and_restart(cluster: ProcessCluster) -> None:
    """Frozen past every rank's beacon timeout (they hold), then killed and started again."""
    cluster.freeze_controller()
    for rank in range(WORLD):
        await cluster.ranks[rank].wait_log("holding up to")
    cluster.kill_controller()
    await cluster.controller.wait()
    await cluster.restart_controller()


def assert_resumed(cluster: ProcessCluster) -> None:
    assert len(cluster.past_controllers) == 1
    assert "resuming the run from" in cluster.controller.text
    for host in cluster.relays:
        for relay in host:
            assert relay.text.count("resumed with the controller") == 2, relay.text[-2000:]  # data and control


def assert_resumed_and_exact(cluster: ProcessCluster) -> None:
    """It resumed, every window is the exact mean over all four ranks, all end identical."""
    assert_resumed(cluster)
    contributors = check_windows(cluster, WINDOWS, NUMEL)
    check_final_and_joins(cluster, WINDOWS, contributors)
    assert all(contributors[w] == set(range(WORLD)) for w in range(WINDOWS))


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_a_controller_killed_mid_round_and_restarted_resumes_and_every_window_is_exact(tmp_path: Path) -> None:
    with trio.fail_after(110):
        cluster = await cluster_run(tmp_path, [], kill_and_restart)
    assert_resumed_and_exact(cluster)


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_a_controller_frozen_then_killed_and_restarted_resumes_and_every_window_is_exact(tmp_path: Path) -> None:
    with trio.fail_after(110):
        cluster = await cluster_run(tmp_path, ["--heartbeat-timeout", "2"], freeze_kill_and_restart)
    assert_resumed_and_exact(cluster)


@pytest.mark.trio
@pytest.mark.deadline(150)
async def test_diloco_resumed_after_a_kill_ends_bit_identical_to_the_run_never_interrupted(tmp_path: Path) -> None:
    diloco = ["--outer", "diloco", "--deterministic"]

    async def nothing(cluster: ProcessCluster) -> None:
        pass

    with trio.fail_after(140):
        reference = await cluster_run(tmp_path / "reference", diloco, nothing, ["--deterministic"])
        resumed = await cluster_run(tmp_path / "resumed", diloco, kill_and_restart, ["--deterministic"])
    assert_resumed(resumed)
    for rank in range(WORLD):
        want, got = windows_of(reference, rank), windows_of(resumed, rank)
        assert [got[w]["digest"] for w in range(WINDOWS)] == [want[w]["digest"] for w in range(WINDOWS)], rank


@pytest.mark.trio
@pytest.mark.deadline(150)
async def test_diloco_in_lanes_resumed_after_a_kill_ends_bit_identical_to_the_run_never_interrupted(
    tmp_path: Path,
) -> None:
    """The same with ``--lanes 4`` on the controller and relays, and a model of four lanes'
    worth (1 MiB): host 0's lanes of the interrupted round are sent again whole."""
    lanes = ["--lanes", "4"]
    diloco = ["--outer", "diloco", "--deterministic", *lanes]
    relay = ["--deterministic", *lanes]
    numel = 4 * DEFAULT_LANE_MIN_BYTES // 4  # f32: one lane per DEFAULT_LANE_MIN_BYTES of payload

    async def nothing(cluster: ProcessCluster) -> None:
        pass

    with trio.fail_after(140):
        reference = await cluster_run(tmp_path / "reference", diloco, nothing, relay, numel=numel)
        resumed = await cluster_run(tmp_path / "resumed", diloco, kill_and_restart, relay, numel=numel)
    assert_resumed(resumed)
    for rank in range(WORLD):
        want, got = windows_of(reference, rank), windows_of(resumed, rank)
        assert [got[w]["digest"] for w in range(WINDOWS)] == [want[w]["digest"] for w in range(WINDOWS)], rank
    # Each Model round went in 4 lanes (the controller counts a round per lane): 3 rounds a window otherwise.
    finished = re.search(r"controller finished: (\d+) rounds", reference.controller.text)
    assert finished is not None and int(finished[1]) > 3 * WINDOWS, reference.controller.text[-2000:]


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_relays_and_ranks_hold_as_long_as_a_controller_with_a_record_says_without_being_told(
    tmp_path: Path,
) -> None:
    """Nothing set on the hosts: the controller (it has --checkpoint-dir) tells relays
    (Outage) and ranks (its beacons) to hold for it, and a restart resumes the run."""
    with trio.fail_after(110):
        cluster = await cluster_run(tmp_path, [], kill_and_restart, env={"FLODL_CONTROLLER_OUTAGE": ""})
    assert_resumed(cluster)
    for host in cluster.relays:
        for relay in host:
            assert "redialing for up to 300 s" in relay.text, relay.text[-2000:]
    contributors = check_windows(cluster, WINDOWS, NUMEL)
    assert all(contributors[w] == set(range(WORLD)) for w in range(WINDOWS))


async def every_rank_trained(cluster: ProcessCluster) -> list[dict[str, Any]]:
    """Each window trainer's ``trained`` event, once every rank is done and every live
    process exited cleanly."""
    trained = []
    for rank in range(WORLD):
        outcome = await cluster.wait_outcome(rank)
        assert outcome["event"] == "done", outcome
        trained.append(next(e for e in cluster.ranks[rank].events if e["event"] == "trained"))
    for proc in cluster.processes():
        if proc not in cluster.past_controllers:
            with trio.fail_after(20):
                assert await proc.wait() == 0, (proc.name, proc.text[-3000:])
    return trained


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_overlapped_window_trainers_hold_through_a_kill_wherever_it_lands_and_finish_on_one_consensus(
    tmp_path: Path,
) -> None:
    """Window trainers overlapping each round with the next window's steps (DiLoCo): the
    controller is SIGKILLed wherever the run is once rank 0 finished window 2 (every point
    must resume) and started again; every rank merges every window and ends on the same
    bytes. (An overlapped run's masses depend on timing, so there is no bit-exact
    uninterrupted twin to compare with; the windows' exactness is the tests' above.)"""
    windows = 8
    args = ["--train-windows", str(windows), "--sync-every", "4", "--overlap", "1", "--step-time", "0.01"]
    with trio.fail_after(110):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
            numel=NUMEL, worker_args={r: args for r in range(WORLD)},
            controller_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--outer", "diloco"],
        ) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(0, "window", window=2)
                await kill_and_restart(cluster)
                trained = await every_rank_trained(cluster)
    assert_resumed(cluster)
    assert all(t["windows"] == windows for t in trained), trained
    assert len({t["digest"] for t in trained}) == 1, trained


@pytest.mark.trio
@pytest.mark.deadline(150)
async def test_a_delta_run_in_fragments_killed_anywhere_resumes_bit_identical_to_the_run_never_interrupted(
    tmp_path: Path,
) -> None:
    """Window trainers syncing 2 fragments as int8 deltas, DiLoCo, deterministic: the
    controller is SIGKILLed wherever the run is once rank 0 finished window 3 and started
    again; every rank ends on the bytes of the same run never interrupted (each
    fragment's lineage and outer state came back from the record)."""
    windows = 8
    args = ["--train-windows", str(windows), "--sync-every", "3", "--step-time", "0.005", "--fragments", "2",
            "--codec", "int8:256"]

    async def run(where: Path, interrupt: bool) -> list[dict[str, Any]]:
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
            numel=NUMEL, worker_args={r: args for r in range(WORLD)}, worker_env={r: OUTAGE for r in range(WORLD)},
            relay_env={h: OUTAGE for h in range(len(HOSTS))},
            relay_args={h: ["--deterministic"] for h in range(len(HOSTS))},
            controller_args=["--checkpoint-dir", str(where / "ckpt"), "--outer", "diloco", "--deterministic"],
        ) as cluster:
            with diagnose(cluster):
                if interrupt:
                    await cluster.wait_event(0, "window", window=3)
                    await kill_and_restart(cluster)
                trained = await every_rank_trained(cluster)
            if interrupt:
                assert_resumed(cluster)
        return trained

    with trio.fail_after(140):
        reference = await run(tmp_path / "reference", False)
        resumed = await run(tmp_path / "resumed", True)
    assert [t["windows"] for t in resumed] == [t["windows"] for t in reference], resumed
    assert [t["digest"] for t in resumed] == [t["digest"] for t in reference]
    assert len({t["last_fragment"] for t in resumed}) == 1



@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_a_controller_killed_and_started_again_on_another_machine_under_its_address_resumes_exact(
    tmp_path: Path, two_machines: TwoMachines,
) -> None:
    """The controller runs on one simulated machine (its own network namespace) at a
    service address. It is SIGKILLed mid-round; the address moves to a second machine,
    where the same command line (the same checkpoint directory: shared storage) starts
    it again. Relays and ranks redial the address, resume, and every window is exact."""

    machines_used = []

    async def kill_and_restart_elsewhere(cluster: ProcessCluster) -> None:
        machines_used.append(two_machines.machine_of(cluster.controller.process.pid))
        cluster.kill_controller()
        await cluster.controller.wait()
        two_machines.move_address()
        await cluster.restart_controller(wrap=two_machines.wrap(1))
        machines_used.append(two_machines.machine_of(cluster.controller.process.pid))

    with trio.fail_after(110):
        cluster = await cluster_run(
            tmp_path, [], kill_and_restart_elsewhere, controller_host=two_machines.address,
            controller_wrap=two_machines.wrap(0),
        )
    assert_resumed_and_exact(cluster)
    assert machines_used == list(two_machines.names)
