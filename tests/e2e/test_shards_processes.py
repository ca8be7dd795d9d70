"""Reduction shards as real processes, lost the way processes are: SIGKILL and SIGSTOP.

Every rank, relay, controller and shard here is a daemon or worker process
(``open_process_cluster(..., daemons=True, shards=N)``). A shard lost at any
point of a round gives its lanes to the next live shard; the round completes
for everyone with the exact mean, and no rank waits past the bounds.
"""

from __future__ import annotations

import re

import pytest
import trio

from flodl_trio.testing.processes import open_process_cluster
from flodl_trio.testing.rank_worker import contribution
from flodl_trio.testing.windows import windows_of

NUMEL = 300_000  # 1.2 MB frames: 4 lanes of at least 256 KiB, so rounds go through the shards


def mean_of(ranks, k: int) -> float:
    return sum(contribution(r, k) for r in ranks) / len(ranks)


async def _all_hold_before(cluster, ranks, round_index: int) -> None:
    for rank in ranks:
        await cluster.wait_event(rank, "paused", round=round_index)


def _three_hosts(salt, **options):
    """Default daemons (each relay serving a shard), one rank on each of three hosts."""
    return open_process_cluster(world_size=3, hosts=[[0], [1], [2]], salt=salt, control=True, heartbeat_timeout=10.0,
                                daemons=True, numel=NUMEL, **options)


async def _sigkill_host_2(cluster) -> None:
    """The machine goes down: its rank, and its relay daemon with the shard it serves."""
    cluster.kill(2)
    cluster.kill_relay(2)
    await cluster.wait_exit(2)


async def _every_rank_done(cluster) -> None:
    for rank in range(3):
        outcome = await cluster.wait_outcome(rank)
        assert outcome["event"] == "done", outcome


def _assert_same_windows(reference, got, windows: int) -> None:
    """Every rank's params after every window, as a digest, are the reference run's."""
    for rank in range(3):
        want, have = windows_of(reference, rank), windows_of(got, rank)
        assert [have[w]["digest"] for w in range(windows)] == [want[w]["digest"] for w in range(windows)], rank


async def _expect_exact_rounds(cluster, ranks, rounds: int) -> None:
    for rank in ranks:
        outcome = await cluster.wait_outcome(rank)
        assert outcome["event"] == "done", cluster.logs()
        got = [(e["value"], e["min"], e["max"]) for e in cluster.ranks[rank].rounds]
        assert got == [(mean_of(ranks, k),) * 3 for k in range(rounds)], cluster.logs()


@pytest.mark.deadline(90)
async def test_a_shard_killed_mid_round_hands_its_lanes_on_and_every_round_is_exact(salt):
    """Shard 1 of 3 is frozen as round 2 begins (it takes the relays' pieces and answers
    nothing), then SIGKILLed: the controller sees its connection end, the relays send
    its lanes to shard 2, and round 2 and the rest are exact for every rank."""
    ranks, rounds = [0, 1, 2], 4
    async with open_process_cluster(
        world_size=3, hosts=[[0, 1], [2]], salt=salt, rounds=rounds, daemons=True, backend="numpy", numel=NUMEL,
        shards=3, worker_args={rank: ["--pause-before", "2:60"] for rank in ranks},
    ) as cluster:
        await _all_hold_before(cluster, ranks, 2)
        cluster.freeze_shard(1)
        for rank in ranks:
            await cluster.resume(rank)
        cluster.kill_shard(1)
        await _expect_exact_rounds(cluster, ranks, rounds)
        with trio.fail_after(10):  # the run may be over already: the controller's log says it
            await cluster.controller.wait_log("controller: shard 1 lost (")
        assert "shard 0 lost" not in cluster.controller.text and "shard 2 lost" not in cluster.controller.text


@pytest.mark.deadline(90)
async def test_a_frozen_shard_is_lost_after_the_heartbeat_timeout_and_rounds_go_on(salt):
    """Shard 0 of 2 is SIGSTOPped mid-run: its connections stay open, so only its silence
    tells. After the heartbeat timeout the controller says it is lost, its lanes go to
    shard 1, and every round is exact; thawed, it finds its controller gone and exits 0."""
    ranks, rounds = [0, 1], 4
    async with open_process_cluster(
        world_size=2, hosts=[[0], [1]], salt=salt, rounds=rounds, daemons=True, backend="numpy", numel=NUMEL,
        shards=2, heartbeat_timeout=3.0, worker_args={rank: ["--pause-before", "1:60"] for rank in ranks},
    ) as cluster:
        await _all_hold_before(cluster, ranks, 1)
        cluster.freeze_shard(0)
        for rank in ranks:
            await cluster.resume(rank)
        await _expect_exact_rounds(cluster, ranks, rounds)
        assert "shard 0 lost (nothing from it for the heartbeat timeout" in cluster.controller.text
        cluster.thaw_shard(0)
        with trio.fail_after(20):
            assert await cluster.shards[0].process.wait() == 0, cluster.shards[0].text


@pytest.mark.deadline(150)
async def test_a_rank_sigkilled_and_started_again_rejoins_through_shards_and_every_window_is_exact():
    """Rank 3's process is SIGKILLed mid-run and started again with the same command
    line, in a cluster whose every round goes through 2 shard daemons (the controller
    daemon's default --rejoin-timeout). The survivors hold before window 10 until its
    return is asked in full (with shards its state is a window that ends after that),
    and before window 12 until it has its state: it enters window 12 or 13, and every
    window is exact against the reference."""
    from tests.e2e.test_rejoin_processes import SALT, WINDOWS, held_until
    from flodl_trio.testing.windows import check_final_and_joins, check_windows, first_counted

    world, hosts, numel, hold = 4, [[0, 1], [2, 3]], NUMEL, 10
    survivors = (0, 1, 2)
    args = held_until(hold, survivors=survivors)
    for rank in survivors:
        args[rank] += ["--pause-before", f"{hold + 2}:inf"]
    with trio.fail_after(140):
        async with open_process_cluster(
            world_size=world, hosts=hosts, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
            numel=numel, pause=0.3, shards=2, worker_args=args,
        ) as cluster:
            await cluster.wait_event(3, "window", window=4)
            cluster.kill(3)  # during window 5's "training"
            await cluster.wait_exit(3)
            await cluster.wait_event(0, "window", window=7)
            await cluster.restart(3)
            await cluster.wait_returns_joining([3])
            for rank in survivors:
                await cluster.resume(rank)  # the hold before window 10
            await cluster.wait_returns_primed([3])
            for rank in survivors:
                await cluster.resume(rank)  # the hold before window 12
            for rank in range(world):
                outcome = await cluster.wait_outcome(rank)
                assert outcome["event"] == "done", cluster.logs()
            joined = await cluster.wait_event(3, "joined")
            assert "rejoins" in cluster.controller.text
    assert joined["state_window"] >= hold, joined  # a window that ended after it asked
    assert hold + 2 <= joined["start"] <= hold + 3, joined
    contributors = check_windows(cluster, WINDOWS, numel, {5: {3}})
    check_final_and_joins(cluster, WINDOWS, contributors)
    counted = first_counted(cluster, 3)
    for window in range(WINDOWS):
        want = {0, 1, 2, 3} if window < 5 or window >= counted else {0, 1, 2}
        assert contributors[window] == want, f"window {window}: {contributors[window]}"


@pytest.mark.deadline(90)
async def test_daemons_with_default_flags_reduce_through_the_shards_their_relays_offer(salt):
    """No shard flag anywhere: each relay daemon serves a shard and offers it, the
    controller daemon fixes them after the first round, and every round is exact."""
    ranks, rounds = [0, 1, 2, 3], 4
    async with open_process_cluster(
        world_size=4, hosts=[[0, 1], [2], [3]], salt=salt, rounds=rounds, daemons=True, backend="numpy", numel=NUMEL,
    ) as cluster:
        await _expect_exact_rounds(cluster, ranks, rounds)
        assert "reducing with the 3 shards the relays offered" in cluster.controller.text, cluster.logs()


@pytest.mark.deadline(90)
async def test_a_host_sigkilled_with_the_shard_its_relay_offered_costs_only_its_ranks(salt):
    """Default daemons, three hosts: host 2's relay daemon - with the shard it serves - and
    its rank are SIGKILLed while the others hold before round 2. The shard's lanes move to
    the next live one, host 2's rank is declared dead, and the survivors' rounds are exact
    means of the survivors."""
    survivors, rounds = [0, 1], 4
    async with open_process_cluster(
        world_size=3, hosts=[[0], [1], [2]], salt=salt, rounds=rounds, daemons=True, backend="numpy", numel=NUMEL,
        worker_args={rank: ["--pause-before", "2:60"] for rank in (0, 1, 2)},
    ) as cluster:
        await _all_hold_before(cluster, [0, 1, 2], 2)
        assert "reducing with the 3 shards the relays offered" in cluster.controller.text, cluster.logs()
        cluster.kill(2)
        cluster.kill_relay(2)
        await cluster.wait_exit(2)
        for rank in survivors:
            await cluster.resume(rank)
        for rank in survivors:
            outcome = await cluster.wait_outcome(rank)
            assert outcome["event"] == "done", cluster.logs()
            got = [(e["value"], e["min"], e["max"]) for e in cluster.ranks[rank].rounds]
            want = [(mean_of([0, 1, 2], k),) * 3 for k in range(2)] + [(mean_of(survivors, k),) * 3 for k in (2, 3)]
            assert got == want, cluster.logs()
        with trio.fail_after(10):
            await cluster.controller.wait_log("controller: shard 2 lost (")


@pytest.mark.deadline(120)
async def test_diloco_trainers_step_on_the_relays_shards_and_finish_together_after_a_shard_host_is_sigkilled(salt):
    """Default daemons with ``--outer diloco``, three hosts of window trainers: the controller
    takes the relays' shards, which step the outer optimizer on their lanes. Host 2 - its
    relay daemon with the shard it serves, and its rank - is SIGKILLed once rank 0 finished
    window 3: the survivors train every window and end on the same bytes."""
    from flodl_trio.testing.matrix import diagnose

    windows = 8
    args = ["--train-windows", str(windows), "--sync-every", "3", "--step-time", "0.01"]
    with trio.fail_after(110):
        async with _three_hosts(salt, worker_args={r: args for r in range(3)},
                                controller_args=["--outer", "diloco"]) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(0, "window", window=3)
                await _sigkill_host_2(cluster)
                outcomes = [await cluster.wait_outcome(rank) for rank in (0, 1)]
            assert all(o["event"] == "done" for o in outcomes), cluster.logs()
            trained = [next(e for e in cluster.ranks[r].events if e["event"] == "trained") for r in (0, 1)]
            assert all(t["windows"] == windows for t in trained), trained
            assert len({t["digest"] for t in trained}) == 1, trained
            assert "reducing with the 3 shards the relays offered" in cluster.controller.text, cluster.logs()
            assert "shard 2 lost" in cluster.controller.text, cluster.logs()
            for host in (0, 1):  # each survivor's shard was told the optimizer (its log is its relay's)
                assert any("steps its lanes with DiLoCoNesterov" in relay.text
                           for relay in cluster.relay_processes(host)), cluster.logs()


@pytest.mark.deadline(120)
async def test_diloco_windows_checkpointed_through_the_relays_shards_are_the_consensus_every_rank_got(salt, tmp_path):
    """Default daemons, the controller with ``--outer diloco --checkpoint-dir`` and no resume
    record (``--controller-outage 0``): it still takes the relays' shards, and each checkpoint
    it writes (every 2nd window) holds the params and buffers every rank got that window,
    byte for byte, with the outer state the shards stepped (DiLoCo's ``x_prev`` is the
    consensus it sent)."""
    import hashlib

    import numpy as np

    from flodl_trio.testing.matrix import diagnose
    from flodl_trio.wire.checkpoint import list_checkpoints, load_checkpoint

    windows = 6
    with trio.fail_after(110):
        async with _three_hosts(
            salt, worker_args={r: ["--windows", str(windows)] for r in range(3)},
            controller_args=["--outer", "diloco", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2",
                             "--controller-outage", "0"],
        ) as cluster:
            with diagnose(cluster):
                outcomes = [await cluster.wait_outcome(rank) for rank in range(3)]
            assert all(o["event"] == "done" for o in outcomes), cluster.logs()
            got = [{e["window"]: e["digest"] for e in cluster.ranks[r].events if e["event"] == "window"}
                   for r in range(3)]
            assert got[0] == got[1] == got[2] and len(got[0]) == windows, got
            assert "reducing with the 3 shards the relays offered" in cluster.controller.text, cluster.logs()
    checkpoints = list_checkpoints(tmp_path)
    assert [w for w, _ in checkpoints] == [0, 2, 4], checkpoints
    for window, path in checkpoints:
        saved = load_checkpoint(path)
        digest = hashlib.sha256(saved.params[0].tobytes() + saved.buffers[0].tobytes()).hexdigest()[:32]
        assert digest == got[0][window], (window, path)
        np.testing.assert_array_equal(saved.outer["x_prev.0"], saved.params[0])
        assert int(saved.outer["windows"][0]) == window + 1
    assert np.abs(load_checkpoint(checkpoints[-1][1]).outer["momentum.0"]).max() > 0  # the shards' momentum


def _shard_processes_under(pid: int) -> list[int]:
    """The ``flodl_trio.shard`` processes descended from ``pid`` (from /proc)."""
    import glob

    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for path in glob.glob(f"/proc/{parent}/task/*/children"):
            with open(path) as f:
                for child in map(int, f.read().split()):
                    todo.append(child)
                    with open(f"/proc/{child}/cmdline", "rb") as cmd:
                        if b"flodl_trio.shard" in cmd.read():
                            found.append(child)
    return found


@pytest.mark.deadline(120)
async def test_a_relays_shard_process_sigkilled_is_started_again_and_serves_its_shard_again(salt):
    """Host 1's shard process (its relay daemon's child) is SIGKILLed mid-run: the
    controller loses shard 1 and its lanes move; the relay daemon starts its shard
    again on a free port and offers it, and the controller serves shard 1 with it from
    a later round. Every window is exact and all end on the same bytes; no rank and
    no relay restarted."""
    import os
    import signal

    from flodl_trio.testing.matrix import diagnose
    from flodl_trio.testing.windows import check_final_and_joins, check_windows

    windows, hold = 12, 8
    args = {r: ["--windows", str(windows), "--pause-before", f"{hold}:inf"] for r in range(3)}
    with trio.fail_after(110):
        async with _three_hosts(salt, pause=0.3, worker_args=args) as cluster:
            with diagnose(cluster):
                await cluster.controller.wait_log("reducing with the 3 shards the relays offered")
                await cluster.wait_event(0, "window", window=3)
                [relay] = cluster.relay_processes(1)
                [shard] = _shard_processes_under(relay.pid)
                os.kill(shard, signal.SIGKILL)
                await cluster.controller.wait_log("controller: shard 1 lost (")
                await relay.wait_log("its shard listens again on port")
                for rank in range(3):  # the next rounds come once it is offered (before host 1's next HostFrame)
                    await cluster.wait_event(rank, "paused", round=hold)
                    await cluster.resume(rank)
                outcomes = [await cluster.wait_outcome(rank) for rank in range(3)]
                assert all(o["event"] == "done" for o in outcomes), cluster.logs()
                await cluster.controller.wait_log("controller: shard 1 is served again, at ")
                assert relay.returncode is None or relay.returncode == 0, relay.text[-3000:]
    contributors = check_windows(cluster, windows, NUMEL)
    assert all(contributors[w] == {0, 1, 2} for w in range(windows)), contributors
    check_final_and_joins(cluster, windows, contributors)


@pytest.mark.deadline(150)
async def test_diloco_through_the_relays_shards_resumed_after_a_controller_sigkill_ends_bit_identical(salt, tmp_path):
    """Default daemons and a controller with ``--checkpoint-dir`` (a resume record) and
    DiLoCo, deterministic: the controller takes the relays' shards, is SIGKILLed while host
    0's round is up and host 2's rank holds, and is started again with the same command
    line. The shards hold their relays, pieces and outer state for it, the new controller
    takes them on from its record, and the run ends bit-identical, window by window, to
    the same run uninterrupted. No rank, relay or shard restarted."""
    from flodl_trio.testing.matrix import diagnose
    from tests.e2e.test_controller_restart_processes import kill_and_restart, until_host0_delivered

    windows, hold = 8, 4
    args = {r: ["--windows", str(windows), *(["--pause-before", f"{hold}:inf"] if r == 2 else [])] for r in range(3)}

    async def run(directory, fault):
        async with _three_hosts(
            salt, pause=0.05, worker_args=args, relay_args={h: ["--deterministic"] for h in range(3)},
            controller_args=["--outer", "diloco", "--deterministic", "--checkpoint-dir", str(directory)],
        ) as cluster:
            with diagnose(cluster):
                await cluster.controller.wait_log("reducing with the 3 shards the relays offered")
                await cluster.wait_event(2, "paused", round=hold)
                await until_host0_delivered(cluster)
                if fault is not None:
                    await fault(cluster)
                    shards = (await cluster.status())["shards"]  # the new controller's
                    assert len(shards["addresses"]) == 3 and shards["lost"] == {} and shards["served_here"] == []
                await cluster.resume(2)
                await _every_rank_done(cluster)
            return cluster

    with trio.fail_after(140):
        reference = await run(tmp_path / "reference", None)
        resumed = await run(tmp_path / "resumed", kill_and_restart)
    assert "resuming with the record's 3 shards" in resumed.controller.text, resumed.logs()
    assert " lost (" not in resumed.controller.text and "dropped" not in resumed.controller.text, resumed.logs()
    assert sum("a controller took it on again" in relay.text for h in range(3)
               for relay in resumed.relay_processes(h)) == 3, resumed.logs()
    _assert_same_windows(reference, resumed, windows)


@pytest.mark.deadline(150)
@pytest.mark.parametrize(("fault", "codec"), [("sigkill", None), ("sigstop", None), ("sigkill", "int8:256")],
                         ids=["sigkill", "sigstop", "sigkill-int8-deltas"])
async def test_diloco_through_shard_daemons_one_lost_mid_round_ends_bit_identical(salt, fault, codec):
    """Three shard daemons, DiLoCo, deterministic: shard 1 is SIGKILLed (or SIGSTOPped until
    the controller's heartbeat timeout loses it) while host 0's round is up. Shard 2, its
    backup, steps shard 1's lanes on from the outer state it mirrored, and the run ends
    bit-identical, window by window, to the same run with no shard lost. With int8
    deltas (through eight shards) the shards sum the coded rounds and the controller steps
    them: the same."""
    from flodl_trio.testing.matrix import diagnose
    from tests.e2e.test_controller_restart_processes import until_host0_delivered

    windows, hold = 8, 4
    coded = ["--codec", codec] if codec else []
    args = {r: ["--windows", str(windows), *coded, *(["--pause-before", f"{hold}:inf"] if r == 2 else [])]
            for r in range(3)}

    async def run(lose):
        async with open_process_cluster(
            world_size=3, hosts=[[0], [1], [2]], salt=salt, control=True, heartbeat_timeout=3.0, daemons=True,
            numel=NUMEL * (4 if codec else 1),  # (coded, a quarter of the bytes: the same lanes)
            shards=8 if codec else 3,  # (int8 deltas go through 8 shards: 8 x 8 bits >= 64, docs/wire.md)
            pause=0.05, worker_args=args, relay_args={h: ["--deterministic"] for h in range(3)},
            controller_args=["--outer", "diloco", "--deterministic"],
        ) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(2, "paused", round=hold)
                await until_host0_delivered(cluster)
                if lose:
                    (cluster.kill_shard if fault == "sigkill" else cluster.freeze_shard)(1)
                    await cluster.controller.wait_log("controller: shard 1 lost (")
                await cluster.resume(2)
                await _every_rank_done(cluster)
            return cluster

    with trio.fail_after(140):
        reference = await run(False)
        lost = await run(True)
    assert "shard 1 lost" not in reference.controller.text, reference.logs()
    if codec:  # the delta rounds went through the shards
        assert "sums delta rounds" in lost.shards[2].text, lost.logs()
    else:
        assert "goes on from its mirrored outer state" in lost.shards[2].text, lost.logs()
    _assert_same_windows(reference, lost, windows)


@pytest.mark.deadline(150)
async def test_diloco_through_a_relays_shard_sigkilled_and_served_again_ends_bit_identical(salt):
    """Default daemons, DiLoCo, deterministic: host 1's shard process is SIGKILLed mid-run.
    Shard 2 steps its lanes on from the outer state it mirrored; the relay daemon starts
    its shard again, the controller serves shard 1 with it, and shard 2 hands it back the
    state of those lanes. The run ends bit-identical, window by window, to the same run
    with no shard lost. No rank and no relay restarted."""
    import os
    import signal

    from flodl_trio.testing.matrix import diagnose

    windows, hold = 10, 6
    args = {r: ["--windows", str(windows), "--pause-before", f"{hold}:inf"] for r in range(3)}

    async def run(lose: bool):
        async with _three_hosts(
            salt, pause=0.05, worker_args=args, relay_args={h: ["--deterministic"] for h in range(3)},
            controller_args=["--outer", "diloco", "--deterministic"],
        ) as cluster:
            with diagnose(cluster):
                await cluster.controller.wait_log("reducing with the 3 shards the relays offered")
                await cluster.wait_event(0, "window", window=3)
                [relay] = cluster.relay_processes(1)
                if lose:
                    [shard] = _shard_processes_under(relay.pid)
                    os.kill(shard, signal.SIGKILL)
                    await cluster.controller.wait_log("controller: shard 1 lost (")
                    await relay.wait_log("its shard listens again on port")
                for rank in range(3):
                    await cluster.wait_event(rank, "paused", round=hold)
                    await cluster.resume(rank)
                await _every_rank_done(cluster)
                if lose:
                    await cluster.controller.wait_log("controller: shard 1 is served again, at ")
            return cluster

    with trio.fail_after(140):
        reference = await run(False)
        lost = await run(True)
    texts = "".join(relay.text for h in range(3) for relay in lost.relay_processes(h))
    assert "goes on from its mirrored outer state" in texts, lost.logs()
    assert "handed back the state of" in texts, lost.logs()
    _assert_same_windows(reference, lost, windows)


@pytest.mark.deadline(120)
async def test_a_relay_beside_the_controller_over_loopback_offers_a_shard_every_host_reaches(salt, two_machines):
    """Host 0 runs the controller too, and its relay reaches it over loopback, so the shard
    it serves is offered at a loopback address; hosts 1 and 2 are other machines. The
    controller names that shard to each relay and shard at the address their own
    connection has (its host): no shard is lost, DiLoCo's windows go through all 3 shards
    (each mirrored), and every rank ends on the same bytes."""
    from flodl_trio.testing.matrix import diagnose

    windows = 6
    with trio.fail_after(110):
        async with _three_hosts(
            salt, pause=0.05, worker_args={r: ["--windows", str(windows)] for r in range(3)},
            controller_args=["--outer", "diloco"], controller_host=two_machines.address,
            controller_wrap=two_machines.wrap(0), beside_controller=0,
        ) as cluster:
            with diagnose(cluster):
                match = await cluster.controller.wait_log(re.compile(r"reducing with the 3 shards the relays offered "
                                                                     r"\((\S+):\d+,"))
                assert match.group(1) == "127.0.0.1"  # host 0's offer: its relay reaches the controller over loopback
                outcomes = [await cluster.wait_outcome(rank) for rank in range(3)]
                assert all(o["event"] == "done" for o in outcomes), cluster.logs()
            assert " lost (" not in cluster.controller.text, cluster.logs()
    digests = {windows_of(cluster, rank)[windows - 1]["digest"] for rank in range(3)}
    assert len(digests) == 1, digests
