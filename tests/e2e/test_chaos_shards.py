"""Seeded chaos on whole clusters in virtual time: ranks exit, crash (between windows
or inside one) and come back with ``join()``, hosts' relays close, shards are lost
mid-round; every window is the mass-weighted mean of exactly its contributors (bit
for bit in deterministic mode), every rank holds the same bytes, nothing hangs.

The plans and the oracle are in ``tests/e2e/chaos_shards.py``. The seeds cover
explicit and offered shards and none, default and explicit lanes, whole frames,
deterministic mode on and off, ranks' frames cut mid-round, rounds decided again
after a lost shard, returns copied from the shards, masses of 0. To replay one with
its log: ``make_plan(seed)``, then ``run_plan`` and ``check_run`` under a
``MockClock(autojump_threshold=0)``.
"""

from __future__ import annotations

import pytest

from tests.e2e.chaos_shards import check_run, make_plan, run_plan

SEEDS = [0, 7, 8, 9, 11, 12, 13, 14, 15, 16, 19, 21, 22, 24, 29, 31, 32, 33, 34, 38, 42, 45, 52, 55, 59, 66, 67, 71,
         73, 79]


@pytest.mark.deadline(5000)  # virtual seconds: ranks that never come back are waited for their rejoin_timeout
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_seeded_fault_schedule_leaves_every_window_exact(autojump_clock, seed):
    plan = make_plan(seed)
    try:
        check_run(await run_plan(plan))
    except BaseException as exc:
        exc.add_note(plan.describe())
        raise


# Seeds in which every rank may die (returning ranks then start again from the state
# the controller kept): in 31 every rank dies inside a window the controller finished.
ALL_DIE_SEEDS = [15, 31, 40]


@pytest.mark.deadline(5000)
@pytest.mark.parametrize("seed", ALL_DIE_SEEDS)
async def test_a_fault_schedule_that_may_kill_every_rank_leaves_every_window_exact(autojump_clock, seed):
    plan = make_plan(seed, keeper=False)
    try:
        check_run(await run_plan(plan))
    except BaseException as exc:
        exc.add_note(plan.describe())
        raise


@pytest.mark.deadline(5000)
async def test_a_restart_quicker_than_its_relays_goodbye_is_not_refused_as_live(autojump_clock, monkeypatch):
    """Seed 72 with every rank allowed to die: rank 6, the last live rank, crashes inside a
    window while its relay's writer is busy, and its restart asks to come back at once.
    Its state request overtook the relay's RankExit, and the controller, finding rank 6
    live, refused it ("is another process running as rank 6?"). The relay now passes a
    rank's state request on only once that rank's goodbye is written upstream. (What
    the run then answers is another matter: every rank died through the shards, which
    wire.md says such a controller cannot restart from.)"""
    import tests.e2e.chaos_shards as chaos

    monkeypatch.setattr(chaos, "KEEPER", False)
    monkeypatch.setattr(chaos, "MID_P", 0.5)
    run = await run_plan(make_plan(72))
    refused_live = {rank: str(exc) for rank, exc in run.errors.items() if "is live on the cluster" in str(exc)}
    assert not refused_live, refused_live
