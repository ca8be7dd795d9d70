"""A controller stopped and started again at awkward moments, combined with the features
the docs say compose with it: coded deltas and fragments, a SlowMo outer optimizer,
windows of zero accepted mass, ranks returning while the controller is down or right
after it is back, and every rank dying while it is down. Each run is compared bit for
bit with the same run whose controller never stopped (deterministic mode), or with a
numpy oracle over each window's contributors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client, open_controller, open_relay
from flodl_trio.controller import ControllerHandle
from flodl_trio.fold.outer import SlowMo
from flodl_trio.relay import ChannelKind, RelayHandle
from flodl_trio.testing import hold_open, wait_until_primed
from flodl_trio.testing.local import LOOPBACK
from flodl_trio.wire.quant import DeltaCodec
from tests.e2e import test_controller_restart as restart
from tests.e2e.test_controller_restart import (
    BOUNDS,
    DEADLINE_S,
    FIRST_ROUND_OF_PAUSE,
    HOSTS,
    SALT,
    WORLD,
    wait_until,
    LANES,
    PAUSE_AT,
    ROUNDS_PER_WINDOW,
    Controller,
    assert_same_run,
    restart_when,
    run_cluster,
)
from tests.e2e.test_rejoin import fresh_model, steps_of, trained


@contextmanager
def variant(monkeypatch: pytest.MonkeyPatch, *, slowmo: bool, idle: int | None) -> Iterator[None]:
    """``run_cluster`` with a SlowMo outer optimizer and/or window ``idle`` carrying no
    work on any rank (every step count 0: its params round has accepted mass 0)."""
    if slowmo:
        monkeypatch.setattr(Controller, "_outer", lambda self: SlowMo(lr=0.9, momentum=0.6))
    if idle is not None:
        monkeypatch.setattr(restart, "steps_of", lambda rank, window: 0 if window == idle else steps_of(rank, window))
    yield


@pytest.mark.parametrize("lanes", [1, LANES])
@pytest.mark.parametrize("codec", [None, "int8:256", "fp4:256"])
@pytest.mark.parametrize("slowmo", [False, True], ids=["diloco", "slowmo"])
async def test_restart_mid_a_window_of_zero_mass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str | None, lanes: int, slowmo: bool
) -> None:
    """Window PAUSE_AT has no work anywhere; the controller is stopped once host 0 sent its
    step counts. The outer state (left alone by a zero-mass window) and a delta run's
    lineage come back from the record: the run is the uninterrupted one."""
    with variant(monkeypatch, slowmo=slowmo, idle=PAUSE_AT):
        options = {"codec": codec, "lanes": lanes}
        reference = await run_cluster(tmp_path / "reference", None, **options)  # type: ignore[arg-type]
        got = await run_cluster(
            tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 1),
            **options,  # type: ignore[arg-type]
        )
    assert_same_run(reference, got, fragmented=True)  # (after a zero-mass window each rank holds its own params)
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.resumptions_refused == 0


@pytest.mark.parametrize(("codec", "bf16"), [(None, False), (None, True), ("int8:256", False), ("fp4:256", False)])
@pytest.mark.parametrize("where", ["params-half-in", "after-zero-mass-params"])
async def test_restart_in_a_zero_mass_window_of_a_fragmented_slowmo_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str | None, bf16: bool, where: str
) -> None:
    """Fragments (2), SlowMo (outer state per fragment), f32, bf16 or coded deltas, and
    window PAUSE_AT with no work:
    stopped with that window's params round half in (host 1's swallowed), or, the idle
    window being PAUSE_AT - 1, once every rank has its consensus (between windows)."""
    from flodl_trio.testing import DropRecord
    from tests.e2e.test_controller_restart import RECORDS_BEFORE_ROUNDS_UP

    per_window = 2  # fragments: the step counts, the params (no buffers)
    params_round = PAUSE_AT * per_window + 1
    idle = PAUSE_AT if where == "params-half-in" else PAUSE_AT - 1
    with variant(monkeypatch, slowmo=True, idle=idle):
        options = {"codec": codec, "fragments": 2, "bf16": bf16}
        reference = await run_cluster(tmp_path / "reference", None, **options)  # type: ignore[arg-type]
        if where == "params-half-in":
            dropped = DropRecord(index=RECORDS_BEFORE_ROUNDS_UP + params_round, direction="up", framing="mux",
                                 connection=0)
            got = await run_cluster(
                tmp_path, restart_when(lambda run: all(r.stats.rounds == params_round + 1 for r in run.relays)),
                proxy_faults=[dropped], gated=(), **options,  # type: ignore[arg-type]
            )
        else:
            got = await run_cluster(
                tmp_path, restart_when(lambda run: run.params.keys() >= {(r, PAUSE_AT - 1) for r in range(4)}),
                gated=(0, 1), **options,  # type: ignore[arg-type]
            )
    assert_same_run(reference, got, fragmented=True)
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.resumptions_refused == 0


# -- ranks returning across a restart ------------------------------------------

REJOIN_WINDOWS = 7
HOLD = 2  # rank 3 dies after window HOLD - 1; the others hold before HOLD until it has its state back


class RejoinController(Controller):
    """:class:`Controller` letting dead ranks back (``rejoin_timeout``), as the daemon does."""

    async def _run(self, scope: trio.CancelScope, task_status: trio.TaskStatus[ControllerHandle]) -> None:
        with scope:
            async with open_controller(
                LOOPBACK, self.port, world_size=WORLD, salt=SALT, outer_optimizer=self._outer(), deterministic=True,
                bounds=self.bounds, resume_dir=self.resume_dir, rejoin_timeout=60, lanes=self.lanes, lane_min_bytes=0,
            ) as handle:
                task_status.started(handle)
                await handle.wait_finished()
                self.finished.set()


@attrs.define
class Cluster:
    """A restartable controller and one data relay per host; a relay that ends (every
    rank of its host gone while the controller was away) is started again on demand,
    as an operator starts a relay daemon again."""

    nursery: trio.Nursery
    controller: RejoinController
    codec: str | None
    relays: list[RelayHandle] = attrs.field(factory=list)
    params: dict[tuple[int, int], list[np.ndarray]] = attrs.field(factory=dict)
    starts: dict[tuple[int, int], int] = attrs.field(factory=dict)  # (rank, life) -> window join() returned
    progress: trio.Event = attrs.field(factory=trio.Event)

    async def open_relay(self, index: int) -> RelayHandle:
        relay: RelayHandle = await self.nursery.start(hold_open, open_relay(
            ChannelKind.DATA, listen=(LOOPBACK, 0), upstream=(LOOPBACK, self.controller.port),
            host_name=f"host{index}", ranks=HOSTS[index], world_size=WORLD, salt=SALT, bounds=BOUNDS,
            deterministic=True, lanes=self.controller.lanes,
        ))
        return relay

    def window_done(self, rank: int, window: int, params: list[torch.Tensor]) -> None:
        self.params[rank, window] = [p.numpy().copy() for p in params]
        self.progress.set()
        self.progress = trio.Event()

    async def wait_windows(self, ranks: Iterable[int], window: int) -> None:
        while not all((rank, window) in self.params for rank in ranks):
            await self.progress.wait()

    async def life(self, rank: int, life: int, first: int, last: int, *, gate: trio.Event | None = None,
                   died: trio.Event | None = None, asks: trio.Event | None = None,
                   crash_after: trio.Event | None = None) -> None:
        """One process of rank ``rank``: connect, join (once ``asks`` is set), train windows
        up to ``last`` (holding before HOLD until ``gate``), then crash (``died`` set once closed)."""
        params, buffers = fresh_model(rank + 10 * life)
        host = 0 if rank in HOSTS[0] else 1
        async with connect_reduce_client((LOOPBACK, self.relays[host].port), rank, WORLD, SALT, bounds=BOUNDS) as client:
            client.delta_codec = None if self.codec is None else DeltaCodec.parse(self.codec)
            if asks is not None:
                await asks.wait()
            start = self.starts[rank, life] = await client.join(params, buffers)
            for window in range(max(start, first), last):
                if window == HOLD and gate is not None:
                    await gate.wait()
                trained(params, rank, window)
                await average_window(client, params, buffers, steps_of(rank, window), rank=rank, world_size=WORLD,
                                     in_place=True)
                self.window_done(rank, window, params)
            if died is not None:
                if crash_after is not None:
                    await crash_after.wait()
                await client.aclose()  # a crash: it does not say it finished
                died.set()


def state_request_held(caplog: pytest.LogCaptureFixture) -> Callable[[], bool]:
    """Whether relay host1 has taken rank 3's state request while the controller is away
    (it says so as it waits; the request may also have ended early, which the rank's
    join then reports)."""
    return lambda: any("asks for its state while the controller is away" in r.getMessage()
                       or "state request from" in r.getMessage() for r in caplog.records)


async def run_returning(
    tmp_path: Path, when: str | None, codec: str | None, caplog: pytest.LogCaptureFixture | None = None,
    lanes: int = 1,
) -> Cluster:
    """Rank 3 dies after window HOLD - 1 and comes back while the survivors hold before
    window HOLD; ``when`` places a controller restart: ``join-while-down`` (it asks back in
    while the controller is down), ``connected-while-down`` (it connects while the
    controller is down, and asks once it is back), ``join-after-back`` (right after the new controller
    took both relays' Resume), ``died-while-down`` (it dies, and asks back in, while the
    controller is down), None (never)."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            controller = RejoinController(tmp_path / "ckpt", lanes)
            await controller.start(nursery)
            cluster = Cluster(nursery, controller, codec)
            cluster.relays = [await cluster.open_relay(i) for i in range(len(HOSTS))]
            gate, died = trio.Event(), trio.Event()
            survivors = (0, 1, 2)
            async with trio.open_nursery() as ranks:
                for rank in survivors:
                    ranks.start_soon(functools.partial(cluster.life, rank, 0, 0, REJOIN_WINDOWS, gate=gate))
                ranks.start_soon(functools.partial(cluster.life, 3, 0, 0, HOLD, died=died))
                if when == "died-while-down":  # the controller goes once every rank has window HOLD - 1
                    await cluster.wait_windows(range(WORLD), HOLD - 1)
                    controller.kill()
                await died.wait()
                await cluster.wait_windows(survivors, HOLD - 1)
                if when in ("join-while-down", "connected-while-down"):
                    controller.kill()
                elif when == "join-after-back":
                    await controller.restart()
                    await wait_until(lambda: all(r.stats.resumed == 1 for r in cluster.relays))
                asks = trio.Event() if when == "connected-while-down" else None
                ranks.start_soon(functools.partial(cluster.life, 3, 1, 0, REJOIN_WINDOWS, asks=asks))
                if asks is not None:  # it connects while the controller is down, asks once it is back
                    await wait_until(lambda: cluster.relays[1].stats.live_ranks == 2)
                    await controller.start(nursery)
                    await wait_until(lambda: all(r.stats.resumed == 1 for r in cluster.relays))
                    asks.set()
                if when in ("join-while-down", "died-while-down"):
                    assert caplog is not None
                    await wait_until(state_request_held(caplog))
                    await controller.start(nursery)
                await wait_until_primed((LOOPBACK, controller.port), [3])
                gate.set()
            await controller.finished.wait()
            nursery.cancel_scope.cancel()
    return cluster


@pytest.mark.parametrize(("codec", "lanes"), [(None, 1), ("int8:256", 1), ("fp4:256", LANES)])
@pytest.mark.parametrize("when", ["join-while-down", "connected-while-down", "join-after-back", "died-while-down"])
async def test_a_rank_returning_across_a_restart_enters_as_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str, codec: str | None, lanes: int
) -> None:
    """Rank 3's return - asked while the controller is down (its death told the old
    controller, or only the new one), or right after it is back - lets it in at the
    same window with the same state: every rank's params after every window are the
    uninterrupted run's, bit for bit. A state request taken while the controller is away
    waits for it, however long its return takes within the outage bound (it was dialed
    at once, and given up after the connect budget: the join failed)."""
    caplog.set_level(logging.INFO, logger="flodl_trio.relay")
    reference = await run_returning(tmp_path / "reference", None, codec, lanes=lanes)
    got = await run_returning(tmp_path, when, codec, caplog, lanes)
    assert got.starts == reference.starts
    assert set(got.params) == set(reference.params)
    for key, arrays in reference.params.items():
        for index, (a, b) in enumerate(zip(arrays, got.params[key])):
            np.testing.assert_array_equal(b, a, err_msg=f"rank {key[0]} window {key[1]} tensor {index}")


# -- every rank dying while the controller is down ------------------------------

LAST_WINDOW_BEFORE = 2  # every rank crashes after this window


async def run_every_rank_dies(
    tmp_path: Path, restart: bool, codec: str | None, *, die_while_down: bool = False,
) -> Cluster:
    """Every rank trains windows 0..LAST_WINDOW_BEFORE, then crashes (the relays stay up
    for them: they called join()). With ``restart`` the controller is then stopped (no
    round since: its record has every rank live), every rank starts again and asks back
    in while it is down, and it is started again; with ``die_while_down`` it is stopped
    first, and the ranks crash once both relays hold for it. Every rank trains to
    REJOIN_WINDOWS."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            controller = RejoinController(tmp_path / "ckpt")
            await controller.start(nursery)
            cluster = Cluster(nursery, controller, codec)
            cluster.relays = [await cluster.open_relay(i) for i in range(len(HOSTS))]
            crash = trio.Event()
            async with trio.open_nursery() as ranks:
                for rank in range(WORLD):
                    ranks.start_soon(functools.partial(cluster.life, rank, 0, 0, LAST_WINDOW_BEFORE + 1,
                                                       died=trio.Event(), crash_after=crash))
                if die_while_down:
                    await cluster.wait_windows(range(WORLD), LAST_WINDOW_BEFORE)
                    controller.kill()
                    await wait_until(lambda: all(r.stats.outages == 1 for r in cluster.relays))
                crash.set()
            await wait_until(lambda: all(r.stats.live_ranks == 0 for r in cluster.relays))
            if restart and not die_while_down:
                controller.kill()
                await wait_until(lambda: all(r.stats.outages == 1 for r in cluster.relays))
            async with trio.open_nursery() as ranks:
                for rank in range(WORLD):
                    ranks.start_soon(functools.partial(cluster.life, rank, 1, 0, REJOIN_WINDOWS))
                if restart:
                    await wait_until(lambda: all(r.stats.live_ranks == 2 for r in cluster.relays))
                    await controller.start(nursery)
            await controller.finished.wait()
            nursery.cancel_scope.cancel()
    return cluster


@pytest.mark.parametrize("die_while_down", [False, True], ids=["dead-before", "died-while-down"])
@pytest.mark.parametrize("codec", [None, "int8:256"])
async def test_every_rank_dead_and_returning_while_the_controller_is_down_restarts_the_run_from_the_last_window(
    tmp_path: Path, codec: str | None, die_while_down: bool
) -> None:
    """The new controller resumes a record that has every rank live; the relays, which
    held through the outage with no rank (every rank died before it, or while it was
    down: a relay stays up for ranks that may come back), tell it every rank left, then
    ask them back in. As when the controller never stopped: the first back restarts the run at the window after the last one from
    its consensus, and all train on in step to the same params."""
    reference = await run_every_rank_dies(tmp_path / "reference", False, codec)
    got = await run_every_rank_dies(tmp_path, True, codec, die_while_down=die_while_down)
    for run in (reference, got):
        starts = [run.starts[rank, 1] for rank in range(WORLD)]
        assert min(starts) == LAST_WINDOW_BEFORE + 1, starts
        last = REJOIN_WINDOWS - 1
        for rank in range(1, WORLD):
            for a, b in zip(run.params[0, last], run.params[rank, last]):
                np.testing.assert_array_equal(b, a)
    for key in [(rank, w) for rank in range(WORLD) for w in range(LAST_WINDOW_BEFORE + 1)]:
        for a, b in zip(reference.params[key], got.params[key]):
            np.testing.assert_array_equal(b, a, err_msg=str(key))
