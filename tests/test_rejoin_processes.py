"""A rank process SIGKILLed mid-training and started again with the same command
line rejoins from the consensus; every window stays exact; all end identical.

Real rank processes (``rank_worker --windows``: ``join`` then ``average_window``
per window), real SIGKILL. Each window's contributors are read from its gathered
step counts; the consensus is checked against a float64 reference built from
the same made-up training every worker does (:func:`window_delta`).
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from flodl_trio.testing import open_process_cluster
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


def check_windows(cluster, killed: int, killed_in: set[int]) -> dict[int, set[int]]:
    """Every window's consensus against the reference over its contributors.

    A rank killed mid-window was counted by the Control round and may or may not
    have made it into the params round: for the windows in ``killed_in`` either
    contributor set is accepted, and the one that matches is the one used after.
    """
    events = {rank: windows_of(cluster, rank) for rank in range(WORLD)}
    consensus = np.zeros(NUMEL)  # the params every contributor holds before window 0
    contributors_by_window = {}
    for window in range(WINDOWS):
        seen = {rank: e[window] for rank, e in events.items() if window in e}
        assert seen, f"window {window}: nobody finished it"
        counts = next(iter(seen.values()))["counts"]
        for rank, event in seen.items():
            assert event["counts"] == counts, f"window {window}: rank {rank} gathered other counts"
            assert event["digest"] == next(iter(seen.values()))["digest"], f"window {window}: rank {rank} differs"
        counted = {rank for rank in range(WORLD) if counts[rank] > 0}
        assert counted >= set(seen), f"window {window}: finished by {set(seen)}, counted {counted}"
        assert counts == [float(window_steps(r)) if r in counted else 0.0 for r in range(WORLD)]
        candidates = [counted] + ([counted - {killed}] if window in killed_in and killed in counted else [])
        got = np.asarray(next(iter(seen.values()))["head"])
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
    contributors = check_windows(cluster, killed=3, killed_in={5})
    # The state it loaded is the consensus of the window before the one it entered.
    assert joined["digest"] == windows_of(cluster, 0)[start - 1]["digest"]
    for window in range(WINDOWS):
        want = {0, 1, 2, 3} if window < 5 or window >= start else {0, 1, 2}
        assert contributors[window] == want, f"window {window}: {contributors[window]}"
    finals = {windows_of(cluster, rank)[WINDOWS - 1]["digest"] for rank in range(WORLD)}
    assert len(finals) == 1, "every rank ends with bit-identical params and buffers"
