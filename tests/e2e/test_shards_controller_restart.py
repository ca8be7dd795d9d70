"""A controller with reduction shards dies and is started again: the shards hold.

The cluster of tests/e2e/test_controller_restart.py (2 hosts x 2 ranks, DiLoCo,
deterministic), with two reduction shards that outlive the controller: they
keep their relays, the pieces of the round in progress and the outer state, and
take the new controller on (docs/wire.md, "Shards through a lost controller").
Each interrupted run must give every rank, after every window, the bytes of the
same run uninterrupted, with shards and without.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio

from flodl_trio import DiLoCoNesterov
from flodl_trio.controller.resume import RECORD_FILE
from flodl_trio.shard import open_shard
from flodl_trio.testing import DropRecord, hold_open
from flodl_trio.testing.local import LOOPBACK
from tests.e2e.test_controller_restart import (
    BOUNDS, FIRST_ROUND_OF_PAUSE, LANES, PAUSE_AT, ROUNDS_PER_WINDOW, SALT, Controller, Run, assert_same_run,
    fresh_model, restart_when, run_cluster, wait_until,
)

SHARDS = 2
DELTA_SHARDS = 8  # int8 deltas go through 8 shards (8 x 8 bits >= 64: docs/wire.md), not 2
# Up from a relay with shards: its Hello; then each round of a window (the step counts, the
# params, the buffers: with lane_min_bytes 0 each goes in lanes, so through the shards)
# sends the controller lane 0 and LanesIn (its pieces go to the shards).
RECORDS_UP_A_ROUND = 2
# Down to a relay with shards: Lanes, Shards, HelloAck, Outage; then one record a round
# (a round's commit is its lane 0).
RECORDS_BEFORE_ROUNDS_DOWN = 4


def lanes_in_of_the_params_round(rounds_a_window: int) -> DropRecord:
    """Host 1's LanesIn of window PAUSE_AT's params round (its second), swallowed."""
    rounds_before = rounds_a_window * PAUSE_AT + 1
    return DropRecord(index=1 + RECORDS_UP_A_ROUND * rounds_before + 1, direction="up", framing="mux", connection=0)


async def restart_once_swallowed(controller: Controller, run: Run, gate: trio.Event) -> None:
    """Every host goes on; once the proxy swallowed its record, the controller is restarted."""
    gate.set()
    assert run.proxy is not None
    await wait_until(lambda: bool(run.proxy.events))  # type: ignore[union-attr]
    dropped = int(re.search(r"\((\d+) bytes\)", run.proxy.events[0].detail)[1])  # type: ignore[index, union-attr]
    assert dropped < 40, run.proxy.events  # a control record (LanesIn), not a lane
    await controller.restart()


def assert_resumed_through_the_shards(run: Run) -> None:
    """The run was resumed by a second controller that took the same shards on."""
    assert run.controller.stats.resumed_runs == 1
    assert [shard.controllers_resumed for shard in run.shards] == [1] * len(run.shards)
    assert all(shard.rounds > 0 for shard in run.shards)


async def test_a_sharded_round_decided_and_not_committed_is_decided_again_by_the_new_controller(
    tmp_path: Path,
) -> None:
    """Host 1's LanesIn of window PAUSE_AT's params round never reaches the controller (the
    proxy swallows it): the round is decided, each shard summed and stepped its lanes,
    and nothing committed or recorded it. The new controller decides it again under a
    number above every shard's; the shards sum the pieces they kept and step from the
    state the round began with."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES)
    sharded = await run_cluster(tmp_path / "sharded", None, lanes=LANES, shards=SHARDS)
    lanes_in = lanes_in_of_the_params_round(ROUNDS_PER_WINDOW)
    got = await run_cluster(tmp_path, restart_once_swallowed, proxy_faults=[lanes_in], lanes=LANES, shards=SHARDS)
    assert_same_run(reference, sharded)
    assert_same_run(reference, got)
    assert_resumed_through_the_shards(got)
    assert [r.stats.resumed for r in got.relays] == [1, 1]


@pytest.mark.parametrize(("options", "rounds_a_window"), [
    ({"bf16": True}, ROUNDS_PER_WINDOW),
    ({"fragments": 2}, ROUNDS_PER_WINDOW - 1),  # (no buffers round)
    ({"codec": "int8:256"}, ROUNDS_PER_WINDOW),
    ({"codec": "int8:256", "fragments": 2}, ROUNDS_PER_WINDOW - 1),
], ids=["bf16", "fragments", "delta", "delta-fragments"])
async def test_a_sharded_round_decided_again_after_a_restart_is_exact_on_bf16_and_in_fragments(
    tmp_path: Path, options: dict[str, object], rounds_a_window: int,
) -> None:
    """The same on a bf16 wire (the shards step f32 state, the ranks get bf16), with
    each window syncing one of two fragments (each with its own outer state on the shards),
    and with coded delta rounds (the shards sent the lost controller their means; the new
    one steps the lineage from its record and sends the same consensus lanes)."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES, **options)  # type: ignore[arg-type]
    lanes_in = lanes_in_of_the_params_round(rounds_a_window)
    shards = DELTA_SHARDS if "codec" in options else SHARDS
    got = await run_cluster(tmp_path, restart_once_swallowed, proxy_faults=[lanes_in], lanes=LANES, shards=shards,
                            **options)  # type: ignore[arg-type]
    assert_same_run(reference, got, fragmented="fragments" in options)
    assert_resumed_through_the_shards(got)
    if "codec" in options:  # the round decided again was a delta round, through the shards
        assert got.controller.stats.delta_rounds_sharded > 0


def _older_state() -> DiLoCoNesterov:
    """A DiLoCo holding state of the model's shapes that this run never had (as a checkpoint
    loaded at every start of a controller, older than the shards' state, would)."""
    outer = DiLoCoNesterov(lr=0.7, momentum=0.9)
    state: dict[str, np.ndarray] = {"windows": np.array([1], np.int64)}
    for i, p in enumerate(fresh_model(0)[0]):
        state[f"x_prev.{i}"] = p.numpy() + 5
        state[f"momentum.{i}"] = np.ones(tuple(p.shape), np.float32)
    outer.load_state_dict(state)
    return outer


async def test_a_controller_started_again_holding_older_state_leaves_the_shards_state_alone(tmp_path: Path) -> None:
    """The controller started again is given an optimizer holding state (older than the
    run's, as a checkpoint loaded at every start would be): the record's outer state
    replaces it (with shards it holds none: the state is on the shards), so nothing is
    seeded, the shards step on from their own state, and the run is the uninterrupted
    one, bit for bit."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES)

    async def restart_holding_state(controller: Controller, run: Run, gate: trio.Event) -> None:
        controller.next_outer = _older_state()
        await restart_once_swallowed(controller, run, gate)

    lanes_in = lanes_in_of_the_params_round(ROUNDS_PER_WINDOW)
    got = await run_cluster(tmp_path, restart_holding_state, proxy_faults=[lanes_in], lanes=LANES, shards=SHARDS)
    assert_same_run(reference, got)
    assert_resumed_through_the_shards(got)
    assert got.controller.stats.lanes_seeded == 0
    assert [shard.lanes_seeded for shard in got.shards] == [0] * SHARDS


async def test_a_delta_run_through_the_shards_resumes_exact(tmp_path: Path) -> None:
    """Coded delta rounds through the shards: a restart while host 0's step counts of
    window PAUSE_AT are up (host 1 waits) resumes the run (the lineage from the record,
    the shards holding)."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES, codec="int8:256")
    got = await run_cluster(
        tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE), lanes=LANES,
        shards=DELTA_SHARDS, codec="int8:256",
    )
    assert_same_run(reference, got)
    assert_resumed_through_the_shards(got)
    assert got.controller.stats.delta_rounds_sharded > 0


async def test_a_host_that_missed_a_sharded_commit_is_sent_its_lane_0_again(tmp_path: Path) -> None:
    """The commit (lane 0) of window PAUSE_AT's params round never reaches host 1: the
    record has it, host 1 resumes one consensus behind, is sent that lane 0 again (its
    other lanes, from the shards, it kept), and the lane 0 it sends again is stale."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES)
    commit = DropRecord(index=RECORDS_BEFORE_ROUNDS_DOWN + FIRST_ROUND_OF_PAUSE + 1, direction="down", framing="mux",
                        connection=0)

    def host0_has_the_commit(run: Run) -> bool:
        return bool(run.proxy and run.proxy.events) and run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 2

    got = await run_cluster(tmp_path, restart_when(host0_has_the_commit), proxy_faults=[commit], gated=(),
                            lanes=LANES, shards=SHARDS)
    assert_same_run(reference, got)
    assert_resumed_through_the_shards(got)
    assert got.controller.stats.stale_host_frames == 1
    assert got.controller.stats.relays_resumed == 2


async def test_a_restart_while_a_host_waits_for_the_other_keeps_the_shards(tmp_path: Path) -> None:
    """Host 1's ranks wait before window PAUSE_AT while host 0's round is up: the new
    controller takes the shards on, and every later round goes through them."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES)
    got = await run_cluster(
        tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE), lanes=LANES,
        shards=SHARDS,
    )
    assert_same_run(reference, got)
    assert_resumed_through_the_shards(got)
    assert not (tmp_path / "ckpt" / RECORD_FILE).exists()  # the run is over: nothing to resume


async def test_a_shard_lost_while_the_controller_is_down_is_lost_to_the_new_one_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """The controller dies, and shard 1 with it (as on a machine that ran both), while host
    1's ranks wait. The relays notice shard 1's end with no controller to tell, and wait
    for one past their handshake bound (the controller's outage is what bounds it); the
    controller started again cannot reach shard 1, loses it from the start, and the run
    goes on through shard 0, which steps shard 1's lanes on from the outer state it
    mirrored (or hands that state to the standby the controller serves beside it, shard
    0 being the last live one: "When every shard is lost"): every window is the
    uninterrupted run's."""
    bounds = attrs.evolve(BOUNDS, handshake=2.0)
    reference = await run_cluster(tmp_path / "reference", None, lanes=LANES, shards=SHARDS, bounds=bounds)

    async def controller_and_shard_1_die(controller: Controller, run: Run, gate: trio.Event) -> None:
        await wait_until(lambda: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE)
        controller.kill()
        run.shard_scopes[1].cancel()
        await trio.sleep(1.5 * bounds.handshake)  # past the bound a relay waits for a controller that is up
        await controller.start(controller._nursery)

    got = await run_cluster(tmp_path, controller_and_shard_1_die, lanes=LANES, shards=SHARDS, bounds=bounds)
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.shards_lost == 1
    assert got.shards[0].controllers_resumed == 1
    assert got.shards[0].lanes_taken_over > 0 or got.controller.stats.shards_served_here == 1
    assert_same_run(reference, got)


async def test_a_shard_whose_controller_does_not_come_back_within_its_outage_ends_naming_it() -> None:
    """A shard told to hold for a lost controller (``Outage``) ends once that long passed
    with none back, saying so; one told ``Outage 0`` (the run is over) ends at once, cleanly."""
    from flodl_trio.controller.shards import ShardSet
    from flodl_trio.controller.config import ControllerConfig
    from flodl_trio.controller.stats import ControllerStats

    config = ControllerConfig(2, SALT, 1 << 30, BOUNDS, True, LANES, 0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            held = await nursery.start(hold_open, open_shard(LOOPBACK, 0, salt=SALT, bounds=BOUNDS))
            ended = await nursery.start(hold_open, open_shard(LOOPBACK, 0, salt=SALT, bounds=BOUNDS))
            for handle, outage_ms in ((held, 300), (ended, 60_000)):
                shards = ShardSet([(LOOPBACK, handle.port)], config, lambda seat: True, lambda msg: None,
                                  ControllerStats(), lambda rank, why: None, outage_ms=outage_ms)
                await shards.dial()
                await handle.set_up.wait()
                if handle is held:
                    await shards.aclose()  # as a crash would: no word
                else:
                    await shards.close_cleanly()
            started = trio.current_time()
            try:
                await held.outcome.wait()
            except Exception as exc:  # noqa: BLE001 - the error is the point
                error: Exception | None = exc
            else:
                error = None
            assert error is not None and "did not come back within its outage bound (0.3 s)" in str(error)
            assert trio.current_time() - started < 10
            await ended.outcome.wait()  # no error: the run was over
            nursery.cancel_scope.cancel()


async def test_a_shard_refuses_a_setup_as_another_shard_and_keeps_its_controller() -> None:
    """Once set up as shard 0 of 1, a connection that would make it shard 1 of 2 is refused
    (closed, counted); its controller's session goes on."""
    from flodl_trio.controller.config import ControllerConfig
    from flodl_trio.controller.shards import ShardSet
    from flodl_trio.controller.stats import ControllerStats
    from flodl_trio.wire.constants import CHANNEL_MAGIC_SHARD
    from flodl_trio.wire.mux import ShardSetup, encode_control_record

    config = ControllerConfig(2, SALT, 1 << 30, BOUNDS, True, LANES, 0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard(LOOPBACK, 0, salt=SALT, bounds=BOUNDS))
            shards = ShardSet([(LOOPBACK, shard.port)], config, lambda seat: True, lambda msg: None,
                              ControllerStats(), lambda rank, why: None, outage_ms=60_000)
            await shards.dial()
            stream = await trio.open_tcp_stream(LOOPBACK, shard.port)
            await stream.send_all(CHANNEL_MAGIC_SHARD.to_bytes(4, "little")
                                  + encode_control_record(ShardSetup(1, 2, 1000), SALT))
            assert await stream.receive_some(1) == b""  # closed on us
            assert shard.refused == 1 and shard.index == 0 and shard.controllers_resumed == 0
            assert not shard.outcome.ended
            await shards.close_cleanly()
            await shard.outcome.wait()  # told the run is over: it ends, cleanly
            nursery.cancel_scope.cancel()
