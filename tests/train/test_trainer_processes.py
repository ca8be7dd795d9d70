"""Overlapped windows on the real process cluster: a rank SIGKILLed while a round is in
flight costs the survivors nothing but that rank - no hang, and they end identical
(with fragments too: there a round is in flight every sync_every / fragments steps)."""

from __future__ import annotations

import pytest
import trio

from flodl_trio.testing import open_process_cluster
from flodl_trio.testing.matrix import diagnose

SALT = b"trainer-overlap!"
WORLD, HOSTS, WINDOWS, SYNC_EVERY = 4, [[0, 1], [2, 3]], 10, 4
DEADLINE_S = 60


@pytest.mark.trio
@pytest.mark.parametrize(("overlap", "fragments"), [(1, 1), (0, 1), (1, 2)])
async def test_a_rank_killed_mid_round_leaves_the_survivors_training_and_identical(overlap, fragments):
    args = ["--train-windows", str(WINDOWS), "--sync-every", str(SYNC_EVERY), "--overlap", str(overlap),
            "--step-time", "0.02", "--fragments", str(fragments)]
    with trio.fail_after(DEADLINE_S):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, numel=4096,
            worker_args={r: args for r in range(WORLD)},
        ) as cluster:
            with diagnose(cluster):
                await cluster.wait_event(3, "window", window=3)
                cluster.kill(3)  # window 4's steps are running; with overlap, window 3's round is in flight
                await cluster.wait_exit(3)
                outcomes = [await cluster.wait_outcome(rank) for rank in range(3)]
    assert all(o["event"] == "done" for o in outcomes), outcomes
    trained = [next(e for e in cluster.ranks[r].events if e["event"] == "trained") for r in range(3)]
    assert all(t["windows"] == WINDOWS * fragments for t in trained), trained  # each fragment every window
    # Every survivor holds the same params: all of them, or with fragments the last fragment
    # (synced at the final step; the others have taken local steps since their last sync).
    assert len({t["digest" if fragments == 1 else "last_fragment"] for t in trained}) == 1, trained
    last = [e for e in cluster.ranks[0].events if e["event"] == "window"][-1]
    assert last["counts"][3] == 0 and all(c == SYNC_EVERY for c in last["counts"][:3]), last
