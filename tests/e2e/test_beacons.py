"""Beacons reach every rank whose control block may still be open (docs/liveness.md).

A returning rank waits for a window boundary with its control block open, and a
rank that said it finished may keep its block open (saving its model) until the
run ends: neither may take the coordinator's quiet for its loss. Clusters on a
memory network in virtual time, every bound at its default; each wait is on an
event or on the cluster's own progress, never on the machine's speed.
"""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import ConfigError, FlodlError, RankDeadError, SessionSalt, average_window, connect_reduce_client, open_controller
from flodl_trio.client import connect_control_client
from flodl_trio.testing import LocalCluster, MemoryNetwork, open_local_cluster
from flodl_trio.transport.settings import NetBounds

SIG = b"\x11" * 32
DEFAULTS = NetBounds()
WINDOW_S = 4 * DEFAULTS.heartbeat_timeout  # a window's inner steps: longer than any beacon timeout
SHORT_HEARTBEAT_S = 10.0
SHORT_WINDOW_S = 4 * SHORT_HEARTBEAT_S
SHORT = NetBounds(heartbeat_timeout=SHORT_HEARTBEAT_S)


def memory_cluster(salt: SessionSalt, **kwargs: object):
    return open_local_cluster(salt=salt, network=MemoryNetwork(), bounds=DEFAULTS, control=True, **kwargs)  # type: ignore[arg-type]


class HostOfTwo:
    """Ranks 0 and 1 of a one-host cluster with a short heartbeat timeout: rank 0 survives,
    training in windows longer than a beacon timeout, while rank 1 crashes and comes back."""

    def __init__(self, cluster: LocalCluster, salt: SessionSalt) -> None:
        self.cluster, self.salt = cluster, salt
        self.back_in = trio.Event()  # rank 1 is back (or gave up)
        self.two_windows = trio.Event()  # the survivor finished window 1: rank 1's death is old news

    def control(self, rank: int):
        return connect_control_client(self.cluster.control_address(rank), rank, 2, self.salt, SIG,
                                      connect=self.cluster.connect, bounds=SHORT)

    def data(self, rank: int):
        return connect_reduce_client(self.cluster.relay_address(rank), rank, 2, self.salt,
                                     connect=self.cluster.connect, bounds=SHORT)

    async def survivor(self) -> None:
        """Rank 0's windows, until rank 1 is back in and four windows have passed."""
        params = [torch.zeros(3)]
        async with self.control(0), self.data(0) as client:
            await client.join(params, [])
            window = 0
            while not self.back_in.is_set() or window < 4:
                await trio.sleep(SHORT_WINDOW_S)
                await average_window(client, params, [], 1, rank=0, world_size=2, in_place=True)
                window += 1
                if window == 2:
                    self.two_windows.set()
            await client.finish()

    async def first_life(self, params: list[torch.Tensor]) -> None:
        """Rank 1 joins, averages one window, and crashes (gone without saying it finished)."""
        async with self.control(1), self.data(1) as client:
            await client.join(params, [])
            await average_window(client, params, [], 1, rank=1, world_size=2, in_place=True)
            await client.aclose()


def host_of_two(salt: SessionSalt):
    return open_local_cluster(salt=salt, network=MemoryNetwork(), bounds=SHORT, control=True, world_size=2,
                              hosts=[[0, 1]], rejoin_timeout=100_000)


@pytest.mark.deadline(5000)
async def test_a_returning_rank_waiting_for_its_boundary_is_beaconed(autojump_clock, salt):
    """Rank 1 crashes and comes back right after a boundary while rank 0's windows take
    four heartbeat timeouts each: its join waits a whole window for the next boundary,
    far longer than its beacon timeout, and its control block must not raise
    CoordinatorLost meanwhile."""
    outcome: dict[str, object] = {}
    async with host_of_two(salt) as cluster:
        host = HostOfTwo(cluster, salt)

        async def returner() -> None:
            params = [torch.ones(3)]
            await host.first_life(params)
            await host.two_windows.wait()  # restarted after two of the survivor's windows (at once: below)
            try:
                async with host.control(1) as returned, host.data(1) as client:
                    asked = trio.current_time()
                    start = await client.join(params, [])
                    outcome["waited"] = trio.current_time() - asked
                    host.back_in.set()
                    await average_window(client, params, [], 1, rank=1, world_size=2, in_place=True)
                    await client.finish()
                    outcome["beacons"] = returned.last_beacon is not None
                outcome["start"] = start
            except FlodlError as exc:
                outcome["error"] = exc
                host.back_in.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(host.survivor)
            nursery.start_soon(returner)
        assert "error" not in outcome, outcome["error"]
        await cluster.controller.wait_finished()
    assert outcome["waited"] > 2 * SHORT_HEARTBEAT_S  # the wait outlasted a beacon timeout, twice
    assert outcome["beacons"] and outcome["start"] >= 1
    assert cluster.controller.stats.rejoins == 1


@pytest.mark.deadline(5000)
async def test_a_rank_that_said_it_finished_keeps_its_control_block_until_the_run_ends(autojump_clock, salt):
    """Rank 0 finishes first and stays in its control block (saving its model, say)
    while rank 1 trains on for many heartbeat timeouts: no CoordinatorLost; the run's
    end is said to it (run_over) and its block ends normally."""
    outcome: dict[int, object] = {}
    async with memory_cluster(salt, world_size=2, hosts=[[0], [1]], rejoin_timeout=1000) as cluster:
        rank0_finished = trio.Event()

        async def rank0() -> None:
            params = [torch.zeros(3)]
            try:
                async with connect_control_client(cluster.control_address(0), 0, 2, salt, SIG,
                                                  connect=cluster.connect) as control:
                    async with connect_reduce_client(cluster.relay_address(0), 0, 2, salt, connect=cluster.connect) as c:
                        await c.join(params, [])
                        await average_window(c, params, [], 1, rank=0, world_size=2, in_place=True)
                    rank0_finished.set()  # left after join(): it said it finished
                    while not control.run_over:
                        await trio.sleep(1.0)  # "saving the model" until the run is over
                    outcome[0] = "run over"
            except FlodlError as exc:
                outcome[0] = exc

        async def rank1() -> None:
            params = [torch.ones(3)]
            async with connect_control_client(cluster.control_address(1), 1, 2, salt, SIG, connect=cluster.connect):
                async with connect_reduce_client(cluster.relay_address(1), 1, 2, salt, connect=cluster.connect) as c:
                    await c.join(params, [])
                    await average_window(c, params, [], 1, rank=1, world_size=2, in_place=True)
                    await rank0_finished.wait()
                    for _ in range(3):
                        await trio.sleep(WINDOW_S)
                        await average_window(c, params, [], 1, rank=1, world_size=2, in_place=True)
            outcome[1] = "done"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank0)
            nursery.start_soon(rank1)
        await cluster.controller.wait_finished()
    assert outcome == {0: "run over", 1: "done"}, outcome


@pytest.mark.deadline(300)
async def test_a_heartbeat_timeout_beyond_a_u32_of_ms_is_capped_in_the_beacon(autojump_clock, salt):
    """NetBounds takes any finite heartbeat timeout > 0; the beacon's field is a u32 of
    milliseconds: the coordinator caps it (49 days) instead of failing to encode it."""
    huge = NetBounds(heartbeat_timeout=5e6)
    async with open_local_cluster(salt=salt, network=MemoryNetwork(), bounds=huge, control=True, world_size=1,
                                  hosts=[[0]], beacon_interval=1.0) as cluster:
        async with connect_control_client(cluster.control_address(0), 0, 1, salt, SIG, connect=cluster.connect,
                                          bounds=huge) as control:
            while control.last_beacon is None:
                await trio.sleep(1.0)
            assert control.last_beacon.heartbeat_timeout_ms == 0xFFFFFFFF


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf"), True])
async def test_a_beacon_interval_that_cannot_work_is_a_config_error(salt, interval):
    network = MemoryNetwork()
    with pytest.raises(ConfigError, match="beacon_interval"):
        async with open_controller(world_size=1, salt=salt, beacon_interval=interval, listeners=[network.listen()],
                                   bounds=DEFAULTS):
            pass  # pragma: no cover


@pytest.mark.deadline(5000)
@pytest.mark.parametrize(("rank_timeout", "coordinator_timeout"), [(None, 300.0), (1.0, 30.0), (120.0, 30.0), (30.0, 1.0)],
                         ids=["coordinator-longer", "rank-much-shorter", "rank-longer", "coordinator-shorter"])
async def test_a_rank_and_a_coordinator_configured_differently_see_no_false_death(
    autojump_clock, salt, rank_timeout, coordinator_timeout,
):
    """The coordinator's heartbeat timeout rides on every beacon: the rank beats at least
    four times per it and waits for a beacon at least that long, so neither side takes
    the other's pace for a loss over ten minutes, whichever is configured longer."""
    async with memory_cluster(salt, world_size=1, hosts=[[0]], heartbeat_timeout=coordinator_timeout) as cluster:
        async with connect_control_client(cluster.control_address(0), 0, 1, salt, SIG, connect=cluster.connect,
                                          heartbeat_timeout=rank_timeout) as client:
            await trio.sleep(600)
            assert client.beacon_timeout >= coordinator_timeout
            assert client.heartbeat_interval <= coordinator_timeout / 4
        assert not cluster.controller.dead_ranks.is_dead(0)



@pytest.mark.deadline(5000)
@pytest.mark.parametrize(("rank_timeout", "relay_timeout"), [(None, 30.0), (1.0, 30.0), (30.0, 1.0)],
                         ids=["same-pace", "rank-much-shorter", "relay-shorter"])
async def test_a_rank_waiting_for_its_host_to_form_is_beaconed_by_its_relay(
    autojump_clock, salt, rank_timeout, relay_timeout,
):
    """Rank 1 starts ten minutes after rank 0 on the same host (it loads a checkpoint,
    say). The host's control relay joins the coordinator only once both are in, so
    rank 0 hears nothing from the coordinator meanwhile: its relay beacons it, at the
    moment it is in and then at the relay's own pace, whatever pace the rank was
    configured with. Host 1 formed at once and has the coordinator's beacons. Every
    rank then averages with every other (a rank lost or declared dead raises)."""
    relay_bounds = NetBounds(heartbeat_timeout=relay_timeout)
    means: dict[int, list[float]] = {}
    rank_1_may_start = trio.Event()
    async with open_local_cluster(salt=salt, network=MemoryNetwork(), bounds=relay_bounds, control=True, world_size=3,
                                  hosts=[[0, 1], [2]], heartbeat_timeout=30.0) as cluster:

        async def rank(r: int) -> None:
            if r == 1:
                await rank_1_may_start.wait()
            params = [torch.full((3,), float(r))]
            async with connect_control_client(cluster.control_address(r), r, 3, salt, SIG, connect=cluster.connect,
                                              heartbeat_timeout=rank_timeout) as control:
                if r == 0:
                    while control.last_beacon is None:
                        await trio.sleep(0.1)
                    await trio.sleep(600)  # twenty beacon timeouts of the slowest pace
                    assert control.last_beacon.heartbeat_timeout_ms == relay_timeout * 1000  # its relay's
                    rank_1_may_start.set()
                async with connect_reduce_client(cluster.relay_address(r), r, 3, salt, connect=cluster.connect) as c:
                    await c.join(params, [])
                    await average_window(c, params, [], 1, rank=r, world_size=3, in_place=True)
                    means[r] = params[0].tolist()
                    await c.finish()

        async with trio.open_nursery() as nursery:
            for r in range(3):
                nursery.start_soon(rank, r)
    assert means == {r: [1.0] * 3 for r in range(3)}


@pytest.mark.deadline(5000)
async def test_a_rank_restarted_at_once_is_not_told_of_its_predecessors_death(autojump_clock, salt):
    """Rank 1 crashes and its restart connects again at once, before the coordinator's
    death notice of the crashed process has come back through the relay. That notice
    (and its DeclareDead) is about the connection that ended: the new process must not
    raise RankDeadError for it, and comes back in at the next window boundary; a death
    of its new life then reaches it."""
    outcome: dict[str, object] = {}
    async with host_of_two(salt) as cluster:
        host = HostOfTwo(cluster, salt)

        async def restarted_at_once() -> None:
            params = [torch.ones(3)]
            await host.first_life(params)
            try:  # and at once again, in no time at all
                async with host.control(1), host.data(1) as client:
                    outcome["start"] = await client.join(params, [])
                    host.back_in.set()
                    await average_window(client, params, [], 1, rank=1, world_size=2, in_place=True)
                    outcome["back"] = True
                    cluster.controller.dead_ranks.declare_dead(1)  # news for this life: it is evicted now
                    await trio.sleep_forever()
            except RankDeadError as exc:
                outcome["evicted"] = exc
            except FlodlError as exc:
                outcome["error"] = exc
                host.back_in.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(host.survivor)
            nursery.start_soon(restarted_at_once)
        assert "error" not in outcome, outcome["error"]
    assert outcome["start"] >= 1 and outcome["back"]
    assert "rank 1 was declared dead" in str(outcome["evicted"])
    assert cluster.controller.stats.rejoins == 1
