"""A rank process SIGKILLed mid-training and started again with the same command
line rejoins from the consensus; every window stays exact; all end identical.

Real rank processes (``rank_worker --windows``: ``join`` then ``average_window``
per window), real SIGKILL. Each window's contributors are read from its gathered
step counts; the consensus is checked against a float64 reference built from
the same made-up training every worker does (:func:`window_delta`).
"""

from __future__ import annotations

import pytest
import trio

from flodl_trio.testing import FlipBit, open_process_cluster
from flodl_trio.testing.matrix import diagnose
from flodl_trio.testing.windows import (
    check_final_and_joins,
    check_windows,
    first_counted,
    joined_event,
    windows_of,
)

SALT = b"rejoin-processes"
WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 16
NUMEL = 256
DEADLINE_S = 90
HOLD = 10  # survivors hold before this window until the restarted ranks have asked back in


@pytest.mark.trio
async def test_a_killed_rank_restarted_with_the_same_command_rejoins_and_every_window_is_exact():
    with trio.fail_after(DEADLINE_S):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, rejoin_timeout=60.0,
            numel=NUMEL, pause=0.3, worker_args=held_until(HOLD, survivors=(0, 1, 2)),
        ) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(3, "window", window=4)
                cluster.kill(3)  # during window 5's "training"
                await cluster.wait_exit(3)
                await cluster.wait_event(0, "window", window=7)
                await cluster.restart(3)
                await release_once_back(cluster, [3], survivors=(0, 1, 2))
                joined = await cluster.wait_event(3, "joined")
                for rank in range(WORLD):
                    outcome = await cluster.wait_outcome(rank)
                    assert outcome["event"] == "done", outcome
                stats = cluster.local.controller.stats
                assert stats.rejoins == 1 and stats.states_served == 1
    start, counted = joined["start"], first_counted(cluster, 3)
    # Asked after window 7, in before the survivors' hold at HOLD ended: window 9 at the earliest, HOLD + 1 at the latest.
    assert 9 <= start <= HOLD + 1, f"rank 3 restarted after window 7 and entered window {start}"
    contributors = check_windows(cluster, WINDOWS, NUMEL, {5: {3}})
    check_final_and_joins(cluster, WINDOWS, contributors)
    for window in range(WINDOWS):
        want = {0, 1, 2, 3} if window < 5 or window >= counted else {0, 1, 2}
        assert contributors[window] == want, f"window {window}: {contributors[window]}"


def held_until(window: int, survivors: tuple[int, ...]) -> dict[int, list[str]]:
    """Worker arguments: every rank runs WINDOWS windows; the survivors hold before
    ``window`` until the test releases them (:func:`release_once_back`)."""
    held = ["--pause-before", f"{window}:inf"]
    return {r: ["--windows", str(WINDOWS), *(held if r in survivors else [])] for r in range(WORLD)}


async def release_once_back(cluster, ranks: list[int], survivors: tuple[int, ...]) -> None:
    """Let the survivors go on once the restarted ranks have asked to come back in full.

    A restarted process takes seconds to start (torch's import) and the survivors run
    a window every few tenths of one meanwhile: without the hold, whether the ranks
    come back before the run ends would depend on the machine's speed. With it, they
    enter at the boundary of window HOLD at the latest."""
    await cluster.wait_returns_primed(ranks)
    for rank in survivors:
        await cluster.resume(rank)


async def restart_host_1_and_finish(cluster) -> None:
    """Host 1 comes back as an operator brings it back - its relay, then its ranks with
    their first command lines - and every rank runs to the last window."""
    await cluster.restart_relay(1)
    for rank in (2, 3):
        await cluster.restart(rank)
    await release_once_back(cluster, [2, 3], survivors=(0, 1))
    for rank in range(WORLD):
        outcome = await cluster.wait_outcome(rank)
        assert outcome["event"] == "done", outcome


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_a_host_that_crashed_relay_and_ranks_comes_back_while_the_other_host_trains():
    with trio.fail_after(110):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
            controller_args=["--rejoin-timeout", "60"], numel=NUMEL, pause=0.3,
            worker_args=held_until(HOLD, survivors=(0, 1)),
        ) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(2, "window", window=3)
                for rank in (2, 3):
                    cluster.kill(rank)  # the machine goes down: its ranks and its relay
                cluster.kill_relay(1)
                for rank in (2, 3):
                    await cluster.wait_exit(rank)
                await cluster.wait_event(0, "window", window=6)
                await restart_host_1_and_finish(cluster)
                for proc in cluster.processes():
                    if proc not in [*cluster.past_lives.get(2, []), *cluster.past_lives.get(3, [])]:
                        if proc not in cluster.past_relays.get(1, []):
                            with trio.fail_after(20):
                                assert await proc.wait() == 0, (proc.name, proc.text[-3000:])
    contributors = check_windows(cluster, WINDOWS, NUMEL, {4: {2, 3}})
    check_final_and_joins(cluster, WINDOWS, contributors)
    starts = {rank: joined_event(cluster, rank)["start"] for rank in (2, 3)}
    assert all(8 <= s <= HOLD + 1 for s in starts.values()), starts  # asked after window 6, in by HOLD's end
    assert "rejoins" in cluster.controller.text


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_a_relay_dropped_for_a_flipped_bit_costs_only_its_host_which_then_comes_back():
    """A bit flipped on host 1's uplink (first connection only): the controller drops
    that relay, host 0's windows go on exact; host 1's relay and ranks restart and rejoin."""
    with trio.fail_after(110):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
            controller_args=["--rejoin-timeout", "60"], numel=NUMEL, pause=0.3,
            worker_args=held_until(HOLD, survivors=(0, 1)),
            upstream_faults={1: [FlipBit(at_byte=6000, bit=3, connection=0)]},
        ) as cluster:
            with diagnose(cluster):
                for rank in (2, 3):  # the dropped relay's ranks lose their connection
                    outcome = await cluster.wait_outcome(rank)
                    assert outcome["event"] == "error", outcome
                    await cluster.wait_exit(rank)
                for relay in cluster.relay_processes(1):
                    await relay.wait()
                await restart_host_1_and_finish(cluster)
    assert "dropped for breaking the protocol" in cluster.controller.text
    assert "MAC" in cluster.controller.text
    dropped_in = {w for w in range(WINDOWS) if all(w in windows_of(cluster, r) for r in (0, 1))}
    contributors = check_windows(cluster, WINDOWS, NUMEL, {w: {2, 3} for w in dropped_in})
    check_final_and_joins(cluster, WINDOWS, contributors)
    assert any(contributors[w] == {0, 1} for w in range(WINDOWS)), "host 1 was out for some windows"
