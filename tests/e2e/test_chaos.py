"""Chaos: ranks SIGKILLed and restarted at random, and one host's relay too, while
a 60-window Local SGD run goes on. No hang, no wrong value, every rank ends with
the same bytes.

Seeded: ``FLODL_CHAOS_SEED=N pytest tests/e2e/test_chaos.py`` replays a run; a
failure names its seed.
"""

from __future__ import annotations

import os
import random

import pytest
import trio

from flodl_trio.testing import open_process_cluster
from flodl_trio.testing.matrix import diagnose
from flodl_trio.testing.windows import check_final_and_joins, check_windows, windows_of

WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 60
NUMEL = 64
QUIET_AFTER = 30  # no new fault once the run is past this window
HOLD = 40  # every rank holds before this window until each restarted one has asked back in


async def chaos(cluster, rng: random.Random, log: list[str]) -> None:
    """Kill a random rank (now and then a whole host: its relay and ranks), restart it
    after a random while; stop once the run is far enough along."""
    relay_step = rng.randrange(1, 4)  # exactly one host goes down, at the 2nd to 4th fault
    step = 0
    while max((w for r in range(WORLD) for w in windows_of(cluster, r)), default=-1) < QUIET_AFTER:
        await trio.sleep(rng.uniform(0.5, 1.5))
        step += 1
        if step == relay_step + 1:
            host = rng.randrange(len(HOSTS))
            log.append(f"host {host}: relay and ranks killed")
            for rank in HOSTS[host]:
                cluster.kill(rank)
            cluster.kill_relay(host)
            for rank in HOSTS[host]:
                await cluster.wait_exit(rank)
            await trio.sleep(rng.uniform(0.2, 1.0))
            await cluster.restart_relay(host)
            for rank in HOSTS[host]:
                await cluster.restart(rank)
            continue
        rank = rng.randrange(WORLD)
        log.append(f"rank {rank} killed")
        cluster.kill(rank)
        await cluster.wait_exit(rank)
        await trio.sleep(rng.uniform(0.1, 1.0))
        await cluster.restart(rank)


@pytest.mark.deadline(170)
async def test_chaos_random_kills_and_restarts_never_hang_and_never_give_a_wrong_value():
    seed = int(os.environ.get("FLODL_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    log: list[str] = []
    try:
        with trio.fail_after(160):
            async with open_process_cluster(
                world_size=WORLD, hosts=HOSTS, salt=b"chaos-of-ranks!!", control=True, heartbeat_timeout=10.0,
                daemons=True, controller_args=["--rejoin-timeout", "120"], numel=NUMEL, pause=0.15,
                worker_args={r: ["--windows", str(WINDOWS), "--pause-before", f"{HOLD}:inf"] for r in range(WORLD)},
            ) as cluster:
                with diagnose(cluster):
                    await chaos(cluster, rng, log)
                    # Everyone is back, or has asked to be, before the run may go past HOLD:
                    # how long the last restart takes to start decides nothing.
                    await cluster.wait_returns_primed(range(WORLD))
                    for rank in range(WORLD):
                        await cluster.resume(rank)
                    for rank in range(WORLD):
                        outcome = await cluster.wait_outcome(rank)
                        assert outcome["event"] == "done", outcome
        contributors = check_windows(cluster, WINDOWS, NUMEL, {w: set(range(WORLD)) for w in range(WINDOWS)})
        check_final_and_joins(cluster, WINDOWS, contributors)
    except BaseException as exc:
        exc.add_note(f"chaos seed {seed} (replay: FLODL_CHAOS_SEED={seed}); faults: {log}")
        raise
    assert any("relay" in fault for fault in log), f"seed {seed}: no host went down: {log}"
