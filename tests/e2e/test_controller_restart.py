"""A controller that dies and is started again resumes the run: nobody restarts.

Real sockets, real relays and a real controller in one trio run; ranks train
windows with ``average_window`` and a DiLoCo outer optimizer. The controller
is stopped (its task cancelled: every connection it held closes, as a killed
process's do) at a chosen point of a round and started again on the same
port with the same resume directory; the relays hold their ranks, redial,
``Resume``, and the run goes on. Each run is compared with the same run
uninterrupted, in deterministic mode: every rank's params must be
bit-identical after every window. The same with lanes: a round's consensus
then goes out lane by lane, and a controller lost mid-round leaves relays
holding some lanes of it; with delta rounds (a codec), whose lineage - the
exact consensus and the base every rank holds - comes back from the record;
and with fragments, each window syncing one fragment of the model.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio

from flodl_trio import average_window, connect_reduce_client, open_controller, open_relay
from flodl_trio.controller import ControllerHandle
from flodl_trio.fold.outer import DiLoCoNesterov
from flodl_trio.relay import ChannelKind, RelayHandle
from flodl_trio.relay.lanes import LANES_AHEAD
from flodl_trio.shard import ShardHandle, open_shard, shard_server
from flodl_trio.testing import DropRecord, FaultProxy, hold_open
from flodl_trio.testing.local import LOOPBACK
from flodl_trio.client.tensors import fragment_pieces
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire.fragment import FragmentTag
from flodl_trio.wire.quant import DeltaCodec
from flodl_trio.wire.salt import SessionSalt
from tests.e2e.test_rejoin import fresh_model, steps_of, trained

SALT = SessionSalt(b"restart-test-slt")
WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 6
ROUNDS_PER_WINDOW = 3  # the step-count gather, the params, the float buffers
PAUSE_AT = 3  # the window the interrupted runs stop the controller in
DEADLINE_S = 60
BOUNDS = NetBounds(controller_outage=30.0, connect_interval=0.05)
LANES = 3
# Records a relay's connection carries before its first HostFrame: up, the Hello; down,
# Lanes, HelloAck and Outage. Then LANES records a round each way.
RECORDS_BEFORE_ROUNDS_UP = 1
RECORDS_BEFORE_ROUNDS_DOWN = 3


class Controller:
    """A controller a test can stop as a crash would (its connections close) and start
    again on the same port: a fresh outer optimizer and all, as a new process has."""

    def __init__(
        self, resume_dir: Path, lanes: int = 1, shards: list[tuple[str, int]] | None = None, bounds: NetBounds = BOUNDS,
        outer: bool = True,
    ) -> None:
        self.resume_dir = resume_dir
        self.outer = outer
        self.bounds = bounds
        self.lanes = lanes
        self.shards = shards
        self.port = 0
        self.next_outer: object | None = None  # the optimizer the next start is given (None: a fresh DiLoCo)
        self.handle: ControllerHandle | None = None
        self._scope: trio.CancelScope | None = None
        self.finished = trio.Event()

    async def start(self, nursery: trio.Nursery) -> ControllerHandle:
        self._nursery = nursery
        self._scope = trio.CancelScope()
        self.handle = await nursery.start(self._run, self._scope)
        self.port = self.handle.port
        return self.handle

    async def restart(self) -> ControllerHandle:
        """Stop it as a crash would, then start a new one in its place."""
        self.kill()
        return await self.start(self._nursery)

    async def _run(self, scope: trio.CancelScope, task_status: trio.TaskStatus[ControllerHandle]) -> None:
        with scope:
            async with open_controller(
                LOOPBACK, self.port, world_size=WORLD, salt=SALT,
                outer_optimizer=self._outer(),
                deterministic=True, bounds=self.bounds, resume_dir=self.resume_dir, lanes=self.lanes, lane_min_bytes=0,
                shards=self.shards, serve_shard=shard_server(salt=SALT, bounds=self.bounds),
            ) as handle:
                task_status.started(handle)
                await handle.wait_finished()
                self.finished.set()

    def _outer(self) -> object | None:
        outer, self.next_outer = self.next_outer, None
        if outer is not None:
            return outer
        return DiLoCoNesterov(lr=0.7, momentum=0.9) if self.outer else None

    def kill(self) -> None:
        assert self._scope is not None
        self._scope.cancel()


@attrs.define
class Run:
    """What every rank held after each window."""

    params: dict[tuple[int, int], list[np.ndarray]] = attrs.field(factory=dict)
    relays: list[RelayHandle] = attrs.field(factory=list)
    shards: list[ShardHandle] = attrs.field(factory=list)
    shard_scopes: list[trio.CancelScope] = attrs.field(factory=list)  # cancelling one stops that shard
    proxy: FaultProxy | None = None
    controller: ControllerHandle = attrs.field(default=None)  # the last one started


async def wait_until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (checked as the cluster's tasks run; the test's deadline bounds it)."""
    while not condition():
        await trio.sleep(0.005)


Interruption = Callable[[Controller, Run, trio.Event], Awaitable[None]]


async def run_cluster(
    tmp_path: Path, interrupt: Interruption | None, *, gated: tuple[int, ...] = (1,),
    proxy_faults: list[DropRecord] | None = None, bf16: bool = False, lanes: int = 1, codec: str | None = None,
    fragments: int = 1, shards: int = 0, bounds: NetBounds = BOUNDS, outer: bool = True,
) -> Run:
    """Train WINDOWS windows on 2 hosts x 2 ranks; the ranks of the ``gated`` hosts wait
    before window PAUSE_AT while ``interrupt`` (if any) stops and restarts the controller.
    ``proxy_faults``: host 1's data relay reaches the controller through a proxy with them.
    ``lanes``: every round in that many lanes (however small its frame). ``codec``: the
    params go as coded deltas. ``fragments``: window ``w`` syncs fragment ``w % fragments``
    of the params (and no buffers). ``shards``: that many reduction shards reduce lanes 1..
    (they outlive the controller)."""
    run = Run()
    gate = trio.Event()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for _ in range(shards):
                run.shard_scopes.append(scope := trio.CancelScope())
                run.shards.append(await nursery.start(_shard_in, scope, bounds))
            controller = Controller(tmp_path / "ckpt", lanes, [(LOOPBACK, s.port) for s in run.shards] or None, bounds,
                                    outer)
            await controller.start(nursery)
            upstreams = [(LOOPBACK, controller.port)] * len(HOSTS)
            if proxy_faults is not None:
                proxy = FaultProxy((LOOPBACK, controller.port), proxy_faults)
                await nursery.start(proxy.serve)
                upstreams[1] = proxy.address
                run.proxy = proxy
            for index, ranks in enumerate(HOSTS):
                relay = await nursery.start(hold_open, open_relay(
                    ChannelKind.DATA, listen=(LOOPBACK, 0), upstream=upstreams[index], host_name=f"host{index}",
                    ranks=ranks, world_size=WORLD, salt=SALT, bounds=bounds, deterministic=True, lanes=lanes,
                ))
                run.relays.append(relay)

            async def rank_main(rank: int) -> None:
                params, buffers = fresh_model(rank)
                relay = run.relays[0 if rank in HOSTS[0] else 1]
                pieces = fragment_pieces(params, fragments) if fragments > 1 else [params]
                shapes = tuple(tuple(p.shape) for p in params)
                async with connect_reduce_client((LOOPBACK, relay.port), rank, WORLD, SALT, bounds=bounds) as client:
                    client.bf16_wire = bf16
                    client.delta_codec = None if codec is None else DeltaCodec.parse(codec)
                    for window in range(WINDOWS):
                        if window == PAUSE_AT and any(rank in HOSTS[h] for h in gated):
                            await gate.wait()
                        trained(params, rank, window)
                        tag = FragmentTag(window % fragments, fragments, shapes) if fragments > 1 else None
                        await average_window(
                            client, pieces[window % fragments], buffers if tag is None else [], steps_of(rank, window),
                            rank=rank, world_size=WORLD, in_place=True, fragment=tag,
                        )
                        run.params[rank, window] = [p.numpy().copy() for p in params]

            async with trio.open_nursery() as ranks:
                for rank in range(WORLD):
                    ranks.start_soon(rank_main, rank)
                if interrupt is not None:
                    await interrupt(controller, run, gate)
                gate.set()
            await controller.finished.wait()
            run.controller = controller.handle
            nursery.cancel_scope.cancel()
    return run


async def _shard_in(
    scope: trio.CancelScope, bounds: NetBounds, *, task_status: trio.TaskStatus[ShardHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A reduction shard that runs until ``scope`` is cancelled (its connections then close)."""
    with scope:
        async with open_shard(LOOPBACK, 0, salt=SALT, bounds=bounds) as handle:
            task_status.started(handle)
            await trio.sleep_forever()


def assert_same_run(expected: Run, got: Run, *, fragmented: bool = False) -> None:
    """Every rank's params after every window are the expected run's, bit for bit, and
    (unless ``fragmented``: then only the window's fragment is synced) the same on every rank."""
    assert set(got.params) == set(expected.params)
    for key, arrays in expected.params.items():
        for index, (a, b) in enumerate(zip(arrays, got.params[key])):
            np.testing.assert_array_equal(b, a, err_msg=f"rank {key[0]} window {key[1]} tensor {index}")
    if fragmented:
        return
    for window in range(WINDOWS):  # and one consensus for everyone
        for rank in range(1, WORLD):
            for a, b in zip(got.params[0, window], got.params[rank, window]):
                np.testing.assert_array_equal(a, b)


def assert_same_until_then_one_consensus(expected: Run, got: Run, until: int) -> None:
    """Every rank's params are the expected run's, bit for bit, for the windows before
    ``until`` (after it the two runs part: an outer state started again); and every window
    is one consensus, the same on every rank."""
    for window in range(until):
        for rank in range(WORLD):
            for a, b in zip(expected.params[rank, window], got.params[rank, window]):
                np.testing.assert_array_equal(b, a)
    for window in range(WINDOWS):
        for rank in range(1, WORLD):
            for a, b in zip(got.params[0, window], got.params[rank, window]):
                np.testing.assert_array_equal(b, a)


@pytest.fixture
async def reference(tmp_path: Path) -> Run:
    return await run_cluster(tmp_path / "reference", None)


def restart_when(condition: Callable[[Run], bool]) -> Interruption:
    async def interrupt(controller: Controller, run: Run, gate: trio.Event) -> None:
        await wait_until(lambda: condition(run))
        await controller.restart()

    return interrupt


FIRST_ROUND_OF_PAUSE = PAUSE_AT * ROUNDS_PER_WINDOW  # rounds finished before window PAUSE_AT


@pytest.mark.parametrize("lanes", [1, LANES])
async def test_restart_mid_round_with_a_host_frame_in_flight(tmp_path: Path, lanes: int) -> None:
    """Host 0's HostFrame of window PAUSE_AT's first round went up (in lanes: every lane of
    it, sent again whole to the new controller); host 1's is not sent yet."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=lanes)
    got = await run_cluster(
        tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 1), lanes=lanes
    )
    assert_same_run(reference, got)
    assert [r.stats.resumed for r in got.relays] == [1, 1]
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.stale_host_frames == 0


@pytest.mark.parametrize("lanes", [1, LANES])
async def test_restart_between_rounds(tmp_path: Path, lanes: int) -> None:
    """Both hosts have every consensus so far; host 1's ranks have not started the next window."""
    reference = await run_cluster(tmp_path / "reference", None, lanes=lanes)
    got = await run_cluster(tmp_path, restart_when(
        lambda run: run.params.keys() >= {(rank, PAUSE_AT - 1) for rank in range(WORLD)}
    ), gated=(0, 1), lanes=lanes)
    assert_same_run(reference, got)
    assert [r.stats.resumed for r in got.relays] == [1, 1]
    assert got.controller.stats.resumed_runs == 1


async def test_restart_after_one_host_missed_the_last_consensus(tmp_path: Path, reference: Run) -> None:
    """The controller sent window PAUSE_AT's first consensus, host 1 never got it (the proxy
    swallowed it) and host 0 went on to the next round: host 1 resumes one consensus behind,
    is sent it again, and the HostFrame it sends again is dropped as stale."""
    # Records down to host 1: HelloAck, Outage (this controller keeps a record), then one Broadcast per round.
    swallowed = DropRecord(index=2 + FIRST_ROUND_OF_PAUSE, direction="down", framing="mux", connection=0)

    def host0_went_on(run: Run) -> bool:
        return run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 2

    got = await run_cluster(tmp_path, restart_when(host0_went_on), proxy_faults=[swallowed], gated=())
    assert_same_run(reference, got)
    assert got.controller.stats.stale_host_frames == 1
    assert got.controller.stats.relays_resumed == 2
    assert got.controller.stats.resumed_runs == 1


async def test_restart_mid_round_on_a_bf16_wire(tmp_path: Path) -> None:
    """The same on a bf16 wire: the consensus the ranks get is bf16, the controller's
    DiLoCo state f32 - both come back from the record exactly."""
    reference = await run_cluster(tmp_path / "reference", None, bf16=True)
    got = await run_cluster(
        tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 1), bf16=True
    )
    assert_same_run(reference, got)
    assert got.controller.stats.resumed_runs == 1


# -- in lanes ------------------------------------------------------------------



@pytest.fixture
async def reference_in_lanes(tmp_path: Path) -> Run:
    return await run_cluster(tmp_path / "reference", None, lanes=LANES)


async def test_a_run_in_lanes_is_the_same_run_as_without(tmp_path: Path, reference: Run, reference_in_lanes: Run) -> None:
    """What the lane tests below compare with is itself exact: lanes change no byte."""
    assert_same_run(reference, reference_in_lanes)


async def test_restart_while_a_relay_holds_its_next_lanes_back(tmp_path: Path) -> None:
    """In more lanes than a relay sends ahead of the consensus, host 0 sent LANES_AHEAD lanes
    of window PAUSE_AT's first round and waits for consensus lanes that cannot come (host 1
    holds). The controller is restarted: the waiting writer lets the lost connection go,
    and every lane goes up to the new controller."""
    lanes = LANES_AHEAD + 2
    reference = await run_cluster(tmp_path / "reference", None, lanes=lanes)

    def host0_holds_back(run: Run) -> bool:
        return run.relays[0].stats.lanes_up >= lanes * FIRST_ROUND_OF_PAUSE + LANES_AHEAD

    got = await run_cluster(tmp_path, restart_when(host0_holds_back), lanes=lanes)
    assert_same_run(reference, got)
    assert [r.stats.resumed for r in got.relays] == [1, 1]


async def test_restart_with_some_lanes_of_an_unrecorded_consensus_down(tmp_path: Path, reference_in_lanes: Run) -> None:
    """Host 1's last lane of window PAUSE_AT's first round never reaches the controller (the
    proxy swallows it), so that round's first lanes go down to both hosts and the round
    is never finished nor recorded. The new controller runs the round again: both relays
    let go of the lanes they had and send every lane of their HostFrame again."""
    last_lane_up = DropRecord(
        index=RECORDS_BEFORE_ROUNDS_UP + LANES * FIRST_ROUND_OF_PAUSE + LANES - 1, direction="up", framing="mux",
        connection=0,
    )
    lanes_before = LANES * FIRST_ROUND_OF_PAUSE

    def early_lanes_are_down(run: Run) -> bool:
        return all(r.stats.consensus_lanes == lanes_before + LANES - 1 for r in run.relays)

    got = await run_cluster(tmp_path, restart_when(early_lanes_are_down), proxy_faults=[last_lane_up], gated=(),
                            lanes=LANES)
    assert_same_run(reference_in_lanes, got)
    assert [r.stats.consensus_lanes_abandoned for r in got.relays] == [LANES - 1, LANES - 1]
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.stale_host_frames == 0


async def test_restart_after_one_host_missed_the_last_lane_of_a_recorded_consensus(
    tmp_path: Path, reference_in_lanes: Run
) -> None:
    """The proxy swallows the last lane of window PAUSE_AT's first consensus on its way to
    host 1, while host 0 gets it and goes on: the round was recorded, host 1 resumes one
    consensus behind with its first lanes in. It lets them go, is sent every lane again
    from the record, and every lane of the HostFrame it sends again is dropped as stale."""
    swallowed = DropRecord(
        index=RECORDS_BEFORE_ROUNDS_DOWN + LANES * FIRST_ROUND_OF_PAUSE + LANES - 1, direction="down",
        framing="mux", connection=0,
    )

    def host0_went_on(run: Run) -> bool:
        return run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 2

    got = await run_cluster(tmp_path, restart_when(host0_went_on), proxy_faults=[swallowed], gated=(), lanes=LANES)
    assert_same_run(reference_in_lanes, got)
    assert got.relays[1].stats.consensus_lanes_abandoned == LANES - 1
    assert got.controller.stats.stale_host_frames == LANES
    assert got.controller.stats.relays_resumed == 2 and got.controller.stats.resumed_runs == 1


# -- delta rounds and fragments -------------------------------------------------

@pytest.mark.parametrize("lanes", [1, LANES])
@pytest.mark.parametrize("codec", ["int8:256", "fp4:256"])
async def test_restart_mid_round_of_a_delta_run(tmp_path: Path, codec: str, lanes: int) -> None:
    """A delta run's lineage (the exact consensus, the base every rank holds) comes back from
    the record: the interrupted run's coded rounds are the same bytes as the uninterrupted one's."""
    reference = await run_cluster(tmp_path / "reference", None, codec=codec, lanes=lanes)
    got = await run_cluster(
        tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 1), codec=codec,
        lanes=lanes,
    )
    assert_same_run(reference, got)
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.resumptions_refused == 0


async def test_restart_after_one_host_missed_a_delta_consensus(tmp_path: Path) -> None:
    """Host 1 misses the coded consensus of window PAUSE_AT's first round and is sent it again
    from the record: its base moves as everyone's did."""
    codec = "int8:256"
    reference = await run_cluster(tmp_path / "reference", None, codec=codec)
    swallowed = DropRecord(index=2 + FIRST_ROUND_OF_PAUSE, direction="down", framing="mux", connection=0)
    got = await run_cluster(
        tmp_path, restart_when(lambda run: run.relays[0].stats.rounds == FIRST_ROUND_OF_PAUSE + 2),
        proxy_faults=[swallowed], gated=(), codec=codec,
    )
    assert_same_run(reference, got)
    assert got.controller.stats.stale_host_frames == 1 and got.controller.stats.resumed_runs == 1


@pytest.mark.parametrize("lanes", [1, LANES])
@pytest.mark.parametrize("codec", [None, "int8:256"])
@pytest.mark.parametrize("fragments", [1, 2])
async def test_restart_with_the_params_round_of_a_window_half_in(
    tmp_path: Path, fragments: int, codec: str | None, lanes: int
) -> None:
    """Window PAUSE_AT's step counts are in (a Control round: it says which fragment the
    window syncs) and both hosts sent their params, but host 1's never reach the controller
    (the proxy swallows it, its last lane with lanes): the controller is restarted with the
    params round open. The window's place and fragment, the outer state and, in a delta run,
    the lineage come back from the record, and host 1 sends its params again."""
    per_window = 2 if fragments > 1 else ROUNDS_PER_WINDOW
    params_round = PAUSE_AT * per_window + 1  # rounds before it
    dropped = DropRecord(
        index=RECORDS_BEFORE_ROUNDS_UP + lanes * params_round + lanes - 1, direction="up", framing="mux", connection=0,
    )
    options = {"codec": codec, "lanes": lanes, "fragments": fragments}
    reference = await run_cluster(tmp_path / "reference", None, **options)  # type: ignore[arg-type]

    def both_params_went_up(run: Run) -> bool:
        return all(r.stats.rounds == params_round + 1 for r in run.relays)

    got = await run_cluster(
        tmp_path, restart_when(both_params_went_up), proxy_faults=[dropped], gated=(), **options,  # type: ignore[arg-type]
    )
    assert_same_run(reference, got, fragmented=fragments > 1)
    assert got.controller.stats.resumed_runs == 1 and got.controller.stats.resumptions_refused == 0
    assert got.controller.stats.stale_host_frames == 0
