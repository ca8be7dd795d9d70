"""A rank process SIGKILLed mid-training and started again with the same command
line rejoins from the consensus; every window stays exact; all end identical.

Real rank processes (``rank_worker --windows``: ``join`` then ``average_window``
per window), real SIGKILL. Each window's contributors are read from its gathered
step counts; the consensus is checked against a float64 reference built from
the same made-up training every worker does (:func:`window_delta`).
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest
import trio

from flodl_trio.testing import FlipBit, open_process_cluster
from flodl_trio.testing.matrix import diagnose
from flodl_trio.testing.rank_worker import window_delta, window_steps

SALT = b"rejoin-processes"
WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 16
NUMEL = 256
HEAD = 8
DEADLINE_S = 90


def windows_of(cluster, rank: int) -> dict[int, dict]:
    """Every ``window`` event of every life of ``rank``, by window."""
    out: dict[int, dict] = {}
    for proc in [*cluster.past_lives.get(rank, []), cluster.ranks[rank]]:
        for event in proc.events:
            if event["event"] == "window":
                out[event["window"]] = event
    return out


def check_windows(cluster, maybe_in: dict[int, set[int]]) -> dict[int, set[int]]:
    """Every window's consensus against the reference over its contributors.

    A rank killed mid-window was counted by the Control round and may or may not
    have made it into the params round: for window ``w`` any subset of
    ``maybe_in[w]`` may be missing from the counted set; the one that matches is
    the one the reference follows from then on.
    """
    events = {rank: windows_of(cluster, rank) for rank in range(WORLD)}
    consensus = np.zeros(NUMEL)  # the params every contributor holds before window 0
    contributors_by_window = {}
    for window in range(WINDOWS):
        seen = {rank: e[window] for rank, e in events.items() if window in e}
        assert seen, f"window {window}: nobody finished it"
        first = next(iter(seen.values()))
        counts = first["counts"]
        for rank, event in seen.items():
            assert event["counts"] == counts, f"window {window}: rank {rank} gathered other counts"
            assert event["digest"] == first["digest"], f"window {window}: rank {rank} holds other bytes"
        counted = {rank for rank in range(WORLD) if counts[rank] > 0}
        assert counted >= set(seen), f"window {window}: finished by {set(seen)}, counted {counted}"
        assert counts == [float(window_steps(r)) if r in counted else 0.0 for r in range(WORLD)]
        doubtful = sorted(maybe_in.get(window, set()) & counted)
        candidates = [counted - set(gone) for n in range(len(doubtful) + 1) for gone in combinations(doubtful, n)]
        got = np.asarray(first["head"])
        for contributors in candidates:
            mass = {r: float(window_steps(r)) for r in contributors}
            step = sum(mass[r] * window_delta(r, window, NUMEL).astype(np.float64) for r in contributors)
            want = consensus + step / sum(mass.values())
            if np.allclose(got, want[:HEAD], rtol=1e-5, atol=1e-5):
                break
        else:
            raise AssertionError(f"window {window}: consensus {got} matches no contributor set of {candidates}")
        consensus = want  # the f64 reference follows the ranks' f32 state closely enough for the check
        contributors_by_window[window] = contributors
    return contributors_by_window


def check_final_and_joins(cluster, contributors: dict[int, set[int]]) -> None:
    """Every rank ends with the same bytes; a rank that came back loaded exactly the
    consensus of the window before the one it entered, and counts from that one."""
    finals = {windows_of(cluster, rank)[WINDOWS - 1]["digest"] for rank in range(WORLD)}
    assert len(finals) == 1, "every rank ends with bit-identical params and buffers"
    for rank, lives in cluster.past_lives.items():
        joined = next(e for e in cluster.ranks[rank].events if e["event"] == "joined")
        start = joined["start"]
        assert joined["digest"] == windows_of(cluster, 0)[start - 1]["digest"]
        assert all(rank in contributors[w] for w in range(start, WINDOWS)), (rank, start)


@pytest.mark.trio
async def test_a_killed_rank_restarted_with_the_same_command_rejoins_and_every_window_is_exact():
    with trio.fail_after(DEADLINE_S):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, rejoin_timeout=60.0,
            numel=NUMEL, pause=0.3, worker_args={r: ["--windows", str(WINDOWS)] for r in range(WORLD)},
        ) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(3, "window", window=4)
                cluster.kill(3)  # during window 5's "training"
                await cluster.wait_exit(3)
                await cluster.wait_event(0, "window", window=7)
                await cluster.restart(3)
                joined = await cluster.wait_event(3, "joined")
                for rank in range(WORLD):
                    outcome = await cluster.wait_outcome(rank)
                    assert outcome["event"] == "done", outcome
                stats = cluster.local.controller.stats
                assert stats.rejoins == 1 and stats.states_served == 1
    start = joined["start"]
    assert 9 <= start <= WINDOWS - 2, f"rank 3 restarted after window 7 and entered window {start}"
    contributors = check_windows(cluster, {5: {3}})
    check_final_and_joins(cluster, contributors)
    for window in range(WINDOWS):
        want = {0, 1, 2, 3} if window < 5 or window >= start else {0, 1, 2}
        assert contributors[window] == want, f"window {window}: {contributors[window]}"


async def restart_host_1_and_finish(cluster) -> None:
    """Host 1 comes back as an operator brings it back - its relay, then its ranks with
    their first command lines - and every rank runs to the last window."""
    await cluster.restart_relay(1)
    for rank in (2, 3):
        await cluster.restart(rank)
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
            worker_args={r: ["--windows", str(WINDOWS)] for r in range(WORLD)},
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
    contributors = check_windows(cluster, {4: {2, 3}})
    check_final_and_joins(cluster, contributors)
    starts = {rank: next(e for e in cluster.ranks[rank].events if e["event"] == "joined")["start"] for rank in (2, 3)}
    assert all(8 <= s <= WINDOWS - 2 for s in starts.values()), starts
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
            worker_args={r: ["--windows", str(WINDOWS)] for r in range(WORLD)},
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
    contributors = check_windows(cluster, {w: {2, 3} for w in dropped_in})
    check_final_and_joins(cluster, contributors)
    assert any(contributors[w] == {0, 1} for w in range(WINDOWS)), "host 1 was out for some windows"
