"""Every reduction shard lost: the controller serves the last one itself, and the run goes on.

The cluster of tests/e2e/test_controller_restart.py (2 hosts x 2 ranks, deterministic,
real sockets) with two shards, both of which stop mid-run (their tasks cancelled: every
connection they held closes, as a killed process's do). The controller serves the last
one lost itself (docs/wire.md, "When every shard is lost"): the round in progress is
decided again, every relay sends it its lanes, and every later round goes through it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from flodl_trio.controller.shards import ShardSet
from flodl_trio.transport.stream import MessageStream

from tests.e2e.test_controller_restart import (
    FIRST_ROUND_OF_PAUSE, LANES, PAUSE_AT, Controller, Run, assert_same_run, assert_same_until_then_one_consensus,
    run_cluster, wait_until,
)


async def every_shard_stops(controller: Controller, run: Run, gate: trio.Event) -> None:
    """Both shards stop at the pause's first round; the hosts' ranks go on once the
    controller serves one itself."""
    await wait_until(lambda: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE)
    for scope in run.shard_scopes:
        scope.cancel()
    assert controller.handle is not None
    await wait_until(lambda: controller.handle.stats.shards_served_here >= 1)  # type: ignore[union-attr]
    gate.set()


async def test_every_shard_lost_mid_run_leaves_the_controller_serving_one_and_every_window_exact(
    tmp_path: Path,
) -> None:
    """A plain average: every window after the loss is the same bytes as a run without
    shards, on every rank."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES, outer=False)

    got = await run_cluster(tmp_path, every_shard_stops, lanes=LANES, shards=2, outer=False)
    assert_same_run(reference, got)
    assert got.controller.stats.shards_served_here == 1 and got.controller.stats.shards_lost == 2
    assert got.controller.stats.resumed_runs == 0


async def test_a_relays_word_that_lands_as_the_last_shard_moves_here_does_not_move_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interleaving the fault matrix's ``shard-all-killed`` hit about once in seven runs,
    made certain: a relay's word that the last live shard is lost lands just before the
    controller's own shard takes its place (its task then runs against the new
    connection). The word is of the connection it had then, so the shard moves here
    once and the run stays exact (it moved twice, and the run stopped, before)."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES, outer=False)
    serve_here, install = ShardSet._serve_here, ShardSet._install
    moving: list[int] = []
    words: list[int] = []

    async def serving_here(self: ShardSet, index: int, why: str) -> None:
        moving.append(index)
        await serve_here(self, index, why)

    def installed_after_a_word(self: ShardSet, index: int, address: tuple[str, int], conn: MessageStream) -> None:
        if moving and not words:  # the move's install: a relay's word comes in first
            words.append(index)
            self.reported_lost(index, "the relay of ranks 2-3", "its connection to the shard ended")
        install(self, index, address, conn)

    monkeypatch.setattr(ShardSet, "_serve_here", serving_here)
    monkeypatch.setattr(ShardSet, "_install", installed_after_a_word)

    got = await run_cluster(tmp_path, every_shard_stops, lanes=LANES, shards=2, outer=False)
    assert words, "the move to the controller never installed a shard"
    assert_same_run(reference, got)
    assert got.controller.stats.shards_served_here == 1 and got.controller.stats.shards_lost == 2


async def test_every_shard_lost_mid_round_with_diloco_goes_on_with_one_consensus(tmp_path: Path) -> None:
    """DiLoCo: the shards' outer state goes with them (the controller's shard starts each
    lane's state again, as for any lost shard), so the windows after the loss differ from a
    run without shards; every window before is the same, and every rank gets one consensus."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES)

    async def interrupt(controller: Controller, run: Run, gate: trio.Event) -> None:
        gate.set()
        await wait_until(lambda: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 1)  # mid-window
        for scope in run.shard_scopes:
            scope.cancel()

    got = await run_cluster(tmp_path, interrupt, lanes=LANES, shards=2)
    assert got.controller.stats.shards_served_here == 1
    assert_same_until_then_one_consensus(reference, got, PAUSE_AT)


async def test_a_controller_started_again_with_every_shard_gone_serves_one_itself(tmp_path: Path) -> None:
    """The controller and both shards die while host 1's ranks wait; the controller started
    again reaches no shard, serves shard 0 itself (relays resuming are told ShardMoved at
    their HelloAck and send it their pieces again), and the run goes on; a plain average,
    so every window is the same bytes as a run without shards."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES, outer=False)

    async def everything_but_the_hosts_dies(controller: Controller, run: Run, gate: trio.Event) -> None:
        await wait_until(lambda: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE)
        controller.kill()
        for scope in run.shard_scopes:
            scope.cancel()
        await controller.start(controller._nursery)

    got = await run_cluster(tmp_path, everything_but_the_hosts_dies, lanes=LANES, shards=2, outer=False)
    assert_same_run(reference, got)
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.shards_served_here == 1
