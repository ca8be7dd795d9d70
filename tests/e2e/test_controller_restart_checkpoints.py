"""A controller with a checkpointer (every > 1) and a resume record in the same directory,
as the daemon runs it, stopped as a crash would stop it and started again with a new
checkpointer on that directory: the new checkpointer numbers the windows from the run's
window count, so the files - names and contents - are the ones the run writes
uninterrupted, however many windows were not due before the restart
(docs/outer-and-checkpoints.md, "Numbering").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors
import trio

from flodl_trio import ConsensusCheckpointer, average_window, connect_reduce_client, open_controller, open_relay
from flodl_trio.controller import ControllerHandle
from flodl_trio.fold.outer import DiLoCoNesterov
from flodl_trio.relay import ChannelKind, RelayHandle
from flodl_trio.testing import DropRecord, FaultProxy, hold_open
from flodl_trio.testing.local import LOOPBACK
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire.salt import SessionSalt
from tests.e2e.test_controller_restart import RECORDS_BEFORE_ROUNDS_UP, wait_until
from tests.e2e.test_rejoin import fresh_model, steps_of, trained

SALT = SessionSalt(b"restart-ckpt-slt")
WORLD, HOSTS, WINDOWS = 4, [[0, 1], [2, 3]], 8
ROUNDS_PER_WINDOW = 3  # the step counts, the params, the float buffers
BOUNDS = NetBounds(controller_outage=30.0, connect_interval=0.05)


class Controller:
    """A controller with a ConsensusCheckpointer(every) on ``directory``, also its resume
    directory; stopped as a crash would (its connections close, the checkpointer's block
    is left) and started again on the same port with a new optimizer and checkpointer."""

    def __init__(self, directory: Path, every: int, lanes: int) -> None:
        self.directory, self.every, self.lanes = directory, every, lanes
        self.port = 0
        self.finished = trio.Event()
        self.sinks: list[ConsensusCheckpointer] = []

    async def start(self, nursery: trio.Nursery) -> ControllerHandle:
        self._nursery, self._scope = nursery, trio.CancelScope()
        handle: ControllerHandle = await nursery.start(self._run, self._scope)
        self.port = handle.port
        return handle

    async def restart(self) -> ControllerHandle:
        self._scope.cancel()
        return await self.start(self._nursery)

    async def _run(self, scope: trio.CancelScope, task_status: trio.TaskStatus[ControllerHandle]) -> None:
        with scope:
            outer = DiLoCoNesterov(lr=0.7, momentum=0.9)
            async with ConsensusCheckpointer(self.directory, every=self.every, keep=100, outer=outer) as sink:
                self.sinks.append(sink)
                async with open_controller(
                    LOOPBACK, self.port, world_size=WORLD, salt=SALT, outer_optimizer=outer, checkpoint=sink,
                    deterministic=True, bounds=BOUNDS, resume_dir=self.directory, lanes=self.lanes, lane_min_bytes=0,
                ) as handle:
                    task_status.started(handle)
                    await handle.wait_finished()
                    self.finished.set()


async def run(
    directory: Path, every: int, lanes: int, *, pause: int | None = None, params_half_in: bool = False,
) -> tuple[dict[tuple[int, int], list[np.ndarray]], Controller]:
    """WINDOWS windows of 2 hosts x 2 ranks; with ``pause``, the controller is restarted in
    window ``pause``: at its first round (host 1's ranks wait before the window), or with
    ``params_half_in`` once both hosts sent their params and host 1's were swallowed (the
    window's step counts are in the record, its params round is not)."""
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    gate = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            controller = Controller(directory, every, lanes)
            await controller.start(nursery)
            upstreams = [(LOOPBACK, controller.port)] * len(HOSTS)
            if pause is not None and params_half_in:
                params_round = pause * ROUNDS_PER_WINDOW + 1  # rounds before it
                dropped = DropRecord(index=RECORDS_BEFORE_ROUNDS_UP + lanes * params_round + lanes - 1,
                                     direction="up", framing="mux", connection=0)
                proxy = FaultProxy((LOOPBACK, controller.port), [dropped])
                await nursery.start(proxy.serve)
                upstreams[1] = proxy.address
            relays: list[RelayHandle] = []
            for index, ranks in enumerate(HOSTS):
                relays.append(await nursery.start(hold_open, open_relay(
                    ChannelKind.DATA, listen=(LOOPBACK, 0), upstream=upstreams[index], host_name=f"host{index}",
                    ranks=ranks, world_size=WORLD, salt=SALT, bounds=BOUNDS, deterministic=True, lanes=lanes,
                )))
            gated = pause is not None and not params_half_in

            async def rank_main(rank: int) -> None:
                params, buffers = fresh_model(rank)
                relay = relays[0 if rank in HOSTS[0] else 1]
                async with connect_reduce_client((LOOPBACK, relay.port), rank, WORLD, SALT, bounds=BOUNDS) as client:
                    for window in range(WINDOWS):
                        if gated and window == pause and rank in HOSTS[1]:
                            await gate.wait()
                        trained(params, rank, window)
                        await average_window(client, params, buffers, steps_of(rank, window), rank=rank,
                                             world_size=WORLD, in_place=True)
                        got[rank, window] = [p.numpy().copy() for p in params]

            async with trio.open_nursery() as ranks:
                for rank in range(WORLD):
                    ranks.start_soon(rank_main, rank)
                if pause is not None:
                    if params_half_in:
                        await wait_until(lambda: all(r.stats.rounds == params_round + 1 for r in relays))
                    else:
                        await wait_until(lambda: relays[0].stats.rounds == pause * ROUNDS_PER_WINDOW + 1)
                    await controller.restart()
                gate.set()
            await controller.finished.wait()
            nursery.cancel_scope.cancel()
    return got, controller


def _read(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    with safetensors.safe_open(str(path), framework="np") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != "created_unix"}
        return metadata, {k: f.get_tensor(k) for k in f.keys()}


def assert_same_params(expected: dict[tuple[int, int], list[np.ndarray]],
                       got: dict[tuple[int, int], list[np.ndarray]]) -> None:
    """The restarted run is the run: every rank's params after every window, bit for bit."""
    assert set(got) == set(expected)
    for key, arrays in expected.items():
        for a, b in zip(arrays, got[key]):
            np.testing.assert_array_equal(b, a, err_msg=str(key))


def assert_same_files(expected: Path, got: Path) -> None:
    names = sorted(p.name for p in expected.glob("window-*.safetensors"))
    assert sorted(p.name for p in got.glob("window-*.safetensors")) == names and names
    for name in names:
        want_meta, want = _read(expected / name)
        got_meta, have = _read(got / name)
        assert got_meta == want_meta, name
        assert sorted(have) == sorted(want), name
        for key in want:
            assert np.array_equal(have[key], want[key]), (name, key)


@pytest.mark.parametrize(("every", "pause", "lanes"), [(2, 4, 1), (2, 4, 3), (3, 5, 3)])
async def test_a_restart_between_windows_numbers_on_from_the_runs_window_count(
    tmp_path: Path, every: int, pause: int, lanes: int,
) -> None:
    reference, _ = await run(tmp_path / "reference", every, lanes)
    got, controller = await run(tmp_path / "restarted", every, lanes, pause=pause)
    assert_same_params(reference, got)
    assert len(controller.sinks) == 2 and controller.sinks[1].failures == 0
    assert sorted(p.name for p in (tmp_path / "reference").glob("window-*.safetensors")) == [
        f"window-{w:06d}.safetensors" for w in range(0, WINDOWS, every)]
    assert_same_files(tmp_path / "reference", tmp_path / "restarted")


@pytest.mark.parametrize("lanes", [1, 3])
async def test_a_restart_with_a_due_windows_params_round_open_writes_that_window_as_uninterrupted(
    tmp_path: Path, lanes: int,
) -> None:
    """Window 4 (due, every 2) had its step counts recorded, not its params: the new
    checkpointer numbers it 4, not one past the newest file (3 would not even be due)."""
    reference, _ = await run(tmp_path / "reference", 2, lanes)
    got, controller = await run(tmp_path / "restarted", 2, lanes, pause=4, params_half_in=True)
    assert_same_params(reference, got)
    assert controller.sinks[1].next_window == WINDOWS
    assert_same_files(tmp_path / "reference", tmp_path / "restarted")
