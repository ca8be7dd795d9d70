"""Whole clusters on a memory network in virtual time: every bound at its real default.

The roles take listeners and a connect function, so these clusters run on a
:class:`~flodl_trio.testing.MemoryNetwork` under ``MockClock(autojump_threshold=0)``
(pytest-trio's ``autojump_clock``): a 30 s heartbeat timeout passes in
microseconds of wall time, so the tests use the defaults a user gets rather
than scaled-down bounds, and assert the virtual times exactly instead of
racing the machine's load. Frames stay small (hashing large ones runs in
worker threads, during which the mock clock would jump).
"""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import FlodlError, RankDeadError, SessionSalt, connect_reduce_client
from flodl_trio.client import CoordinatorLost, connect_control_client
from flodl_trio.controller import DeadRanks
from flodl_trio.testing import MemoryNetwork, open_local_cluster
from flodl_trio.transport import MessageStream
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire import (
    RoundFrame,
    TensorPayload,
    encode_data_handshake,
    encode_round_frame,
)
from flodl_trio.wire.constants import DTYPE_F32
from flodl_trio.wire.handshake import encode_control_handshake

SIG = b"\x11" * 32
DEFAULTS = NetBounds()  # what every role uses here: the unscaled defaults


def memory_cluster(salt: SessionSalt, **kwargs: object):
    return open_local_cluster(salt=salt, network=MemoryNetwork(), bounds=DEFAULTS, **kwargs)  # type: ignore[arg-type]


async def average_one(cluster, rank: int, value: float, salt: SessionSalt) -> float:
    async with connect_reduce_client(cluster.relay_address(rank), rank, cluster.world_size, salt, connect=cluster.connect) as c:
        return (await c.all_reduce_tensors([torch.tensor([value])]))[0].item()


async def average_each(cluster, ranks: list[int], salt: SessionSalt, out: dict[int, float]) -> None:
    """Every rank of ``ranks`` averages its own number once, at the same time, into ``out``."""

    async def rank(r: int) -> None:
        out[r] = await average_one(cluster, r, float(r), salt)

    async with trio.open_nursery() as nursery:
        for r in ranks:
            nursery.start_soon(rank, r)


async def test_a_memory_cluster_averages_exactly(autojump_clock, salt):
    out: dict[int, float] = {}
    async with memory_cluster(salt, world_size=4, hosts=[[0, 1], [2, 3]]) as cluster:
        await average_each(cluster, [0, 1, 2, 3], salt, out)
        await cluster.controller.wait_finished()
    assert out == {r: 1.5 for r in range(4)}
    assert cluster.network is not None and cluster.network.connections >= 6  # 2 uplinks + 4 ranks


@pytest.mark.deadline(300)
async def test_relay_handshake_deadline_refuses_silent_connection(autojump_clock, salt):
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]]) as cluster:
        silent = await cluster.connect(*cluster.relay_address(0))
        start = trio.current_time()
        await silent.send_all(b"\xc0\x17")  # half a header, then nothing
        assert await silent.receive_some(16) == b""  # the relay hung up on it
        assert trio.current_time() - start == pytest.approx(DEFAULTS.handshake)
        assert any("deadline" in r for r in cluster.relays[0].rejections)
        # ...and real ranks still get in and average.
        out: dict[int, float] = {}
        await average_each(cluster, [0, 1], salt, out)
    assert out == {0: 0.5, 1: 0.5}


@pytest.mark.deadline(300)
async def test_one_handshake_deadline_however_the_bytes_trickle_in(autojump_clock, salt):
    """The 4 magic bytes just before the deadline do not buy the rest another one."""
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]]) as cluster:
        slow = await cluster.connect(*cluster.relay_address(0))
        start = trio.current_time()
        handshake = encode_data_handshake(0, 2)
        await trio.sleep(DEFAULTS.handshake * 0.8)
        await slow.send_all(handshake[:4])
        await trio.sleep(DEFAULTS.handshake * 0.1)
        await slow.send_all(handshake[4:10])  # and then nothing
        assert await slow.receive_some(16) == b""
        assert trio.current_time() - start == pytest.approx(DEFAULTS.handshake)
        assert any("deadline" in r for r in cluster.relays[0].rejections)


@pytest.mark.deadline(300)
async def test_controller_refuses_a_connection_without_channel_magic_after_its_bound(autojump_clock, salt):
    async with memory_cluster(salt, world_size=1, hosts=[[0]]) as cluster:
        idle = await cluster.connect(*cluster.controller_address)
        start = trio.current_time()
        assert await idle.receive_some(16) == b""
        assert trio.current_time() - start == pytest.approx(DEFAULTS.channel_magic)
        assert any("no channel magic (timed out)" in r for r in cluster.controller.rejections)
        assert await average_one(cluster, 0, 3.0, salt) == 3.0


@pytest.mark.deadline(300)
async def test_a_rank_silent_on_the_control_channel_is_dead_after_the_heartbeat_timeout(autojump_clock, salt):
    """Rank 1 completes both handshakes and its first round, then neither heartbeats
    nor sends (a frozen process): after exactly the heartbeat timeout the
    coordinator declares it dead, its relay closes its data connection, and rank 0's
    next round completes without it."""
    dead = DeadRanks(2)
    frame = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (1,), torch.ones(1).numpy())]), salt)
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]], control=True, dead_ranks=dead) as cluster:
        frozen_control = MessageStream(await cluster.connect(*cluster.control_address(1)), "frozen control")
        await frozen_control.send_chunks([encode_control_handshake(1, 2, SIG, salt)])
        frozen_data = MessageStream(await cluster.connect(*cluster.relay_address(1)), "frozen data")
        await frozen_data.send_chunks([encode_data_handshake(1, 2)])
        await frozen_data.receive_exactly(8, "data ack")
        results: list[float] = []
        async with connect_control_client(cluster.control_address(0), 0, 2, salt, SIG, connect=cluster.connect):
            async with connect_reduce_client(cluster.relay_address(0), 0, 2, salt, connect=cluster.connect) as client:
                await frozen_data.send_len_framed([frame], len(frame))  # rank 1's first round, then silence
                results.append((await client.all_reduce_tensors([torch.tensor([3.0])]))[0].item())
                frozen_at = trio.current_time()
                results.append((await client.all_reduce_tensors([torch.tensor([3.0])]))[0].item())
                waited = trio.current_time() - frozen_at
        assert dead.is_dead(1) and not dead.is_dead(0)
        assert results == [2.0, 3.0]  # first round with rank 1, then rank 0 alone
        # Dead after the timeout, within one watchdog period (timeout / 8) of it.
        assert DEFAULTS.heartbeat_timeout <= waited <= DEFAULTS.heartbeat_timeout * (1 + 1 / 8) + 0.1
        reasons = cluster.controller.coordinator.death_reasons
        assert "no heartbeat" in reasons[1], reasons


@pytest.mark.deadline(300)
async def test_a_rank_stalled_mid_frame_is_dropped_after_the_starvation_bound(autojump_clock, salt):
    """Rank 1 sends the first half of a frame and stops: after the mid-frame
    starvation bound its relay drops it, and rank 0's round completes alone."""
    frame = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (64,), torch.ones(64).numpy())]), salt)
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]]) as cluster:
        stalled = MessageStream(await cluster.connect(*cluster.relay_address(1)), "stalled rank")
        await stalled.send_chunks([encode_data_handshake(1, 2)])
        await stalled.receive_exactly(8, "data ack")
        async with connect_reduce_client(cluster.relay_address(0), 0, 2, salt, connect=cluster.connect) as client:
            await stalled.send_chunks([len(frame).to_bytes(4, "little"), frame[: len(frame) // 2]])
            start = trio.current_time()
            [mean] = await client.all_reduce_tensors([torch.full((64,), 5.0)])
            assert trio.current_time() - start == pytest.approx(DEFAULTS.mid_frame_starvation)
        assert torch.equal(mean, torch.full((64,), 5.0))
        assert cluster.controller.dead_ranks.is_dead(1)


@pytest.mark.deadline(300)
async def test_model_signature_mismatch_refused_naming_ranks_and_hosts(autojump_clock, salt):
    dead = DeadRanks(4)
    async with memory_cluster(salt, world_size=4, hosts=[[0, 1], [2, 3]], control=True, dead_ranks=dead) as cluster:
        outcome: dict[int, object] = {}
        host0_in = trio.Event()

        async def member(rank: int, signature: bytes) -> None:
            try:
                async with connect_control_client(cluster.control_address(rank), rank, 4, salt, signature,
                                                  connect=cluster.connect):
                    if rank < 2:
                        host0_in.set()
                    await trio.sleep(1.0)
                outcome[rank] = "ok"
            except FlodlError as exc:
                outcome[rank] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0, SIG)
            nursery.start_soon(member, 1, SIG)
            await host0_in.wait()
            await trio.sleep(0.2)  # host0's control relay is in: its signature is the reference
            nursery.start_soon(member, 2, b"\x22" * 32)
            nursery.start_soon(member, 3, b"\x22" * 32)
        assert outcome[0] == outcome[1] == "ok"
        for rank in (2, 3):
            assert isinstance(outcome[rank], RankDeadError), outcome[rank]
            msg = str(outcome[rank])
            assert "model signature mismatch" in msg and "host host1" in msg and "host host0" in msg, msg
        assert any("model signature mismatch" in r for r in cluster.controller.coordinator.rejections)
        assert dead.is_dead(2) and dead.is_dead(3) and not dead.is_dead(0)


@pytest.mark.deadline(300)
async def test_coordinator_killed_every_rank_raises_within_beacon_timeout(autojump_clock, salt):
    """The controller (and its coordinator) vanish: no rank waits forever, and each
    raises within the beacon timeout (the default: the heartbeat timeout)."""
    beacon_timeout = DEFAULTS.heartbeat_timeout
    raised: dict[int, tuple[type, float]] = {}
    cancel_cluster = trio.CancelScope()
    ready = trio.Event()
    connected = 0

    async def rank_main(cluster, rank: int) -> None:
        nonlocal connected
        try:
            async with connect_control_client(cluster.control_address(rank), rank, 4, salt, SIG, connect=cluster.connect):
                async with connect_reduce_client(cluster.relay_address(rank), rank, 4, salt, connect=cluster.connect) as c:
                    await c.all_reduce_tensors([torch.ones(2)])
                    connected += 1
                    if connected == 4:
                        ready.set()
                    await c.all_reduce_tensors([torch.ones(2)]) if rank != 0 else await trio.sleep_forever()
        except FlodlError as exc:
            raised[rank] = (type(exc), trio.current_time())

    async with trio.open_nursery() as outer:
        with cancel_cluster:
            async with memory_cluster(salt, world_size=4, hosts=[[0, 1], [2, 3]], control=True) as cluster:
                for rank in range(4):
                    outer.start_soon(rank_main, cluster, rank)
                await ready.wait()
                await trio.sleep(0.2)
                killed_at = trio.current_time()
                cancel_cluster.cancel()  # controller, coordinator and relays stop, streams close
    assert sorted(raised) == [0, 1, 2, 3]
    for rank, (kind, when) in raised.items():
        assert issubclass(kind, (CoordinatorLost, RankDeadError)), (rank, kind)
        assert when - killed_at < beacon_timeout + 1.0


@pytest.mark.deadline(7200)
async def test_a_relay_that_never_connects_leaves_the_others_waiting_until_declared_dead(autojump_clock, salt):
    """Formation has no deadline: host 1's relay never comes up, so host 0's round
    waits (virtual hours pass); declaring host 1's ranks dead lets it complete."""
    dead = DeadRanks(4)
    network = MemoryNetwork()
    async with open_local_cluster(world_size=4, hosts=[[0, 1]], salt=salt, network=network, bounds=DEFAULTS,
                                  dead_ranks=dead) as cluster:
        out: dict[int, float] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(average_each, cluster, [0, 1], salt, out)
            await trio.sleep(3600)
            assert out == {}  # nobody waits on a timer; the round waits for every rank
            dead.declare_dead(2)
            dead.declare_dead(3)
    assert out == {0: 0.5, 1: 0.5}


@pytest.mark.deadline(300)
async def test_ranks_that_leave_cleanly_are_reported_as_exits_not_deaths(autojump_clock, salt, caplog):
    """The last rank leaving drains the relay's queue: the controller hears each rank's
    exit before the relay's connection closes, so nobody is logged as dead."""
    import logging

    caplog.set_level(logging.INFO, logger="flodl_trio.controller")
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]]) as cluster:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(average_one, cluster, 0, 1.0, salt)
            nursery.start_soon(average_one, cluster, 1, 1.0, salt)
        await cluster.controller.wait_finished()
        await cluster.relays[0].wait_finished()
    messages = [r.getMessage() for r in caplog.records]
    assert any("rank 0 exited" in m for m in messages) and any("rank 1 exited" in m for m in messages), messages
    assert not any(" dead: " in m for m in messages), messages


async def test_a_memory_port_nobody_listens_on_refuses(autojump_clock):
    network = MemoryNetwork()
    with pytest.raises(ConnectionRefusedError):
        await network.connect("memory", 12345)
    listener = network.listen()
    await listener.aclose()
    with pytest.raises(OSError):
        await network.connect("memory", listener.port)


async def test_each_channel_logs_one_summary_and_only_the_data_channel_a_fold_ratio(autojump_clock, salt, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="flodl_trio.relay")
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]], control=True) as cluster:

        async def member(rank: int) -> None:
            async with connect_control_client(cluster.control_address(rank), rank, 2, salt, SIG, connect=cluster.connect):
                await average_one(cluster, rank, 1.0, salt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0)
            nursery.start_soon(member, 1)
        await cluster.relays[0].wait_finished()
        await cluster.control_relays[0].wait_finished()
    summaries = {m.split()[2]: m for m in (r.getMessage() for r in caplog.records) if "summary:" in m}
    assert set(summaries) == {"data", "control"}, summaries
    assert "fold-ratio=" in summaries["data"] and "fold-ratio" not in summaries["control"], summaries


@pytest.mark.deadline(300)
async def test_reply_timeout_raises_peer_timeout_naming_the_relay(autojump_clock, salt):
    """Without a control channel, ``reply_timeout`` bounds the round wait: a FlodlError
    (PeerTimeout), not trio's TooSlowError, after exactly that long."""
    from flodl_trio import PeerTimeout

    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]]) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 2, salt, connect=cluster.connect,
                                         reply_timeout=5.0) as client:
            start = trio.current_time()
            with pytest.raises(PeerTimeout, match=r"rank 0: no consensus from data relay .* within reply_timeout 5 s"):
                await client.all_reduce_tensors([torch.ones(2)])  # rank 1 never comes
            assert trio.current_time() - start == pytest.approx(5.0)
            with pytest.raises(FlodlError, match="unusable"):
                await client.all_reduce_tensors([torch.ones(2)])


@pytest.mark.deadline(3000)  # virtual seconds
@pytest.mark.parametrize("left_after", [1, 2], ids=["reply-waits", "entry-waits"])
async def test_a_rank_returning_while_windows_take_minutes_joins_at_the_next_boundary(autojump_clock, salt, left_after):
    """Windows of 200 s (longer than the 60 s a read in progress may stall): a returning
    rank's join() waits for its state reply and its entry as long as the window takes
    (a round's wait, no deadline), not for the stall bound, and enters at a boundary."""
    from flodl_trio import average_window

    pace = 200.0
    joined: dict[str, float] = {}
    async with memory_cluster(salt, world_size=2, hosts=[[0, 1]], rejoin_timeout=100_000) as cluster:
        def client(rank: int):
            return connect_reduce_client(cluster.relay_address(rank), rank, 2, salt, connect=cluster.connect)

        async def survivor() -> None:
            params = [torch.zeros(3)]
            async with client(0) as c:
                await c.join(params, [])
                for _ in range(6):
                    await trio.sleep(pace)  # a long window of inner steps
                    await average_window(c, params, [], 1, rank=0, world_size=2, in_place=True)

        async def returner() -> None:
            params = [torch.ones(3)]
            async with client(1) as c:
                await c.join(params, [])
                for _ in range(left_after):
                    await trio.sleep(pace)
                    await average_window(c, params, [], 1, rank=1, world_size=2, in_place=True)
                await c.aclose()  # its connection closes as a crash's does (not a finish)
            await trio.sleep(10)  # (back 10 s later, mid-window)
            async with client(1) as c:
                asked = trio.current_time()
                joined["window"] = await c.join([torch.ones(3)], [])
                joined["waited"] = trio.current_time() - asked

        async with trio.open_nursery() as nursery:
            nursery.start_soon(survivor)
            nursery.start_soon(returner)
        assert cluster.controller.stats.rejoins == 1
    assert joined["waited"] > 60  # it waited past the stall bound, for the boundary
    assert joined["window"] > left_after
