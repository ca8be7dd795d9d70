"""Shards: lanes 1.. of a round reduced by shards the controller names, lane 0 by it."""

from __future__ import annotations

from collections.abc import AsyncIterator
import contextlib
from contextlib import asynccontextmanager
import functools

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, connect_reduce_client
from flodl_trio.controller import open_controller
from flodl_trio.relay import ChannelKind, open_relay
from flodl_trio.shard import open_shard
from flodl_trio.testing import hold_open, open_local_cluster
from tests.e2e import test_lanes, test_rejoin

LOOP = "127.0.0.1"


@asynccontextmanager
async def one_host_with_a_shard(nursery: trio.Nursery, salt, shard) -> AsyncIterator[tuple[object, object]]:
    """A controller in 3 lanes whose lanes 1.. go to ``shard``, and one relay carrying rank 0."""
    async with open_controller(LOOP, 0, world_size=1, salt=salt, lanes=3, lane_min_bytes=0,
                               shards=[(LOOP, shard.port)]) as ctl:
        relay = await nursery.start(hold_open, open_relay(
            ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name="h", ranks=[0],
            world_size=1, salt=salt,
        ))
        yield ctl, relay


@asynccontextmanager
async def two_hosts_on(shards, nursery: trio.Nursery, salt) -> AsyncIterator[tuple[object, list]]:
    """A controller in 5 lanes whose lanes 1.. go to ``shards``, and two relays of one rank each."""
    async with open_controller(LOOP, 0, world_size=2, salt=salt, lanes=5, lane_min_bytes=0,
                               shards=[(LOOP, s.port) for s in shards]) as ctl:
        relays = [await nursery.start(hold_open, open_relay(
            ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{rank}",
            ranks=[rank], world_size=2, salt=salt,
        )) for rank in range(2)]
        yield ctl, relays


@pytest.mark.parametrize("shards", [1, 2, 3])
async def test_a_round_through_shards_is_the_weighted_mean(salt, shards):
    hosts = [[0, 1], [2], [3]]
    world = 4
    rng = np.random.default_rng(shards)
    values = {r: rng.standard_normal(50_000).astype(np.float32) for r in range(world)}
    weights = {r: float(r + 1) for r in range(world)}
    got: dict[int, tuple] = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handles = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(shards)]
            async with open_controller(LOOP, 0, world_size=world, salt=salt, lanes=5, lane_min_bytes=0,
                                       shards=[(LOOP, h.port) for h in handles]) as ctl:
                relays = []
                for index, ranks in enumerate(hosts):
                    relays.append(await nursery.start(hold_open, open_relay(
                        ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{index}",
                        ranks=ranks, world_size=world, salt=salt,
                    )))

                async def rank_main(rank: int) -> None:
                    host = next(i for i, ranks in enumerate(hosts) if rank in ranks)
                    async with connect_reduce_client((LOOP, relays[host].port), rank, world, salt) as client:
                        for round_ in range(3):
                            t = torch.from_numpy(values[rank] * weights[rank] * (round_ + 1))
                            got[rank, round_] = await client.all_reduce_weighted([t], RoundKind.MODEL, weights[rank])

                async with trio.open_nursery() as ranks:
                    for rank in range(world):
                        ranks.start_soon(rank_main, rank)
            nursery.cancel_scope.cancel()
    mass = sum(weights.values())
    for round_ in range(3):
        want = sum(weights[r] * values[r] * (round_ + 1) for r in range(world)) / mass
        for rank in range(world):
            tensors, got_mass = got[rank, round_]
            assert got_mass == mass
            np.testing.assert_allclose(tensors[0].numpy(), want, rtol=1e-5, atol=1e-6)
        assert all(np.array_equal(got[r, round_][0][0].numpy(), got[0, round_][0][0].numpy()) for r in range(world))
    assert all(h.rounds == 3 for h in handles)
    # lanes=5 and lane_min_bytes=0: each shard gets SHARD_PIPELINE_LANES (4) lanes a round
    assert [h.lanes_summed for h in handles] == [3 * 4] * shards


async def two_ranks_rounds(relays, numel: int, rounds: int, salt) -> dict[int, list[np.ndarray]]:
    """``rounds`` rounds of ranks 0 and 1, one on each relay; round r's values: rank + 10 r
    (so every round's mean is 0.5 + 10 r)."""
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client((LOOP, relays[rank].port), rank, 2, salt) as client:
            for r in range(rounds):
                data = torch.full((numel,), float(rank + 10 * r))
                got[rank].append((await client.all_reduce_tensors([data]))[0].numpy().copy())

    async with trio.open_nursery() as ranks:
        for rank in range(2):
            ranks.start_soon(rank_main, rank)
    return got


def assert_means(got: dict[int, list[np.ndarray]], numel: int) -> None:
    for rank, rounds in got.items():
        for r, values in enumerate(rounds):
            assert np.array_equal(values, np.full(numel, 0.5 + 10 * r, np.float32)), (rank, r)


class RawHost:
    """Rank 2's host, played by the test with raw records: its connections to the
    controller and to each shard, and the lanes of its frame (every value 100.0)."""

    def __init__(self, salt, name: str, numel: int, lanes: int, shards: int) -> None:
        from flodl_trio.wire import DTYPE_F32, RoundFrame, TensorPayload
        from flodl_trio.wire.lanes import LaneLayout

        self.salt, self.name = salt, name
        frame = RoundFrame([TensorPayload(DTYPE_F32, (numel,), np.full(numel, 100.0, "<f4"))])
        self.parts = LaneLayout.through_shards(frame, lanes, shards).split(frame)  # (lane_min_bytes=0)
        self.to_shards: list = []
        self.to_controller = None

    async def _dial(self, port: int):
        from flodl_trio.transport.stream import MessageStream
        from flodl_trio.wire import EXTENSIONS_MARK, Hello
        from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA
        from flodl_trio.wire.mux import encode_control_record

        conn = MessageStream(await trio.open_tcp_stream(LOOP, port), f"port {port}")
        hello = encode_control_record(Hello(self.name, [2], [EXTENSIONS_MARK]), self.salt)
        await conn.send_chunks([CHANNEL_MAGIC_DATA.to_bytes(4, "little"), hello])
        return conn

    async def control(self, conn) -> object:
        from flodl_trio.transport.buffers import ReceiveBuffer
        from flodl_trio.wire.mux import decode_control_msg

        header = await conn.receive_mux_header()
        return decode_control_msg((await conn.receive_mux_payload(header, ReceiveBuffer(), self.salt))[1])

    async def join(self, controller_port: int, shards) -> list:
        """Hello to the controller (what it said before and with HelloAck) and to every shard."""
        self.to_controller = await self._dial(controller_port)
        said = [await self.control(self.to_controller) for _ in range(3)]  # Lanes, Shards, HelloAck
        self.to_shards = [await self._dial(shard.port) for shard in shards]
        return said

    def _record(self, part) -> list:
        from flodl_trio.wire.mux import MuxKind, encode_mux_record
        from flodl_trio.wire.round_frame import encode_round_frame

        return encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame(part, self.salt), self.salt).chunks

    async def send_pieces(self) -> None:
        """Round 1's pieces, each to its owner of two shards."""
        from flodl_trio.wire.lanes import lane_owner
        from flodl_trio.wire.mux import Pieces, encode_control_record

        for conn in self.to_shards:
            await conn.send_chunks([encode_control_record(Pieces(1), self.salt)])
        for lane in range(1, len(self.parts)):
            await self.to_shards[lane_owner(lane, 2)].send_chunks(self._record(self.parts[lane]))

    async def acks(self) -> list:
        from flodl_trio.wire.lanes import lane_owner

        return [await self.control(self.to_shards[lane_owner(lane, 2)]) for lane in range(1, len(self.parts))]

    async def send_lane_0(self) -> None:
        await self.to_controller.send_chunks(self._record(self.parts[0]))

    async def aclose(self) -> None:
        for conn in (self.to_controller, *self.to_shards):
            await conn.aclose()


@asynccontextmanager
async def host_beside_a_raw_one(nursery: trio.Nursery, salt, shards, lanes: int) -> AsyncIterator[tuple[object, object]]:
    """A controller (world 3, ``lanes`` lanes on ``shards``) and relay h0 of ranks 0 and 1;
    rank 2's host is the test's (:class:`RawHost`)."""
    async with open_controller(LOOP, 0, world_size=3, salt=salt, lanes=lanes, lane_min_bytes=0,
                               shards=[(LOOP, s.port) for s in shards]) as ctl:
        relay = await nursery.start(hold_open, open_relay(
            ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name="h0",
            ranks=[0, 1], world_size=3, salt=salt,
        ))
        yield ctl, relay


async def survivors_round(relay, numel: int, salt) -> dict[int, np.ndarray]:
    """One round of ranks 0 and 1 (values 0 and 1) through relay h0."""
    got: dict[int, np.ndarray] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client((LOOP, relay.port), rank, 3, salt) as client:
            got[rank] = (await client.all_reduce_tensors([torch.full((numel,), float(rank))]))[0].numpy()

    async with trio.open_nursery() as ranks:
        for rank in (0, 1):
            ranks.start_soon(rank_main, rank)
    return got


async def test_a_host_lost_after_its_shard_lanes_and_before_lane_0_counts_nowhere(salt):
    """A relay sends every shard its pieces (each acknowledged) and is lost before its lane 0
    reaches the controller: the controller decides the round without it, every shard drops
    its pieces, and the survivors get the mean of their own frames, exactly."""
    from flodl_trio.wire.mux import HelloAck, ShardAck, Shards

    numel, lanes = 40_000, 5
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handles = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(2)]
            async with host_beside_a_raw_one(nursery, salt, handles, lanes) as (ctl, relay):
                lost = RawHost(salt, "lost", numel, lanes, len(handles))
                said = await lost.join(ctl.port, handles)
                assert isinstance(said[1], Shards) and said[2] == HelloAck()
                await lost.send_pieces()
                acks = await lost.acks()
                assert sorted(a.lane for a in acks if isinstance(a, ShardAck)) == list(range(1, len(lost.parts)))
                await lost.aclose()  # lost before its lane 0
                got = await survivors_round(relay, numel, salt)
                assert ctl.dead_ranks.is_dead(2)
            nursery.cancel_scope.cancel()
    for rank in (0, 1):
        assert np.array_equal(got[rank], np.full(numel, 0.5, np.float32))
    assert sum(h.pieces_dropped for h in handles) == len(lost.parts) - 1


async def _one_round(salt, shards: int, *, deterministic: bool, bf16: bool = False) -> dict[int, bytes]:
    hosts, world = [[0, 1], [2], [3, 4]], 5
    rng = np.random.default_rng(7)
    values = {r: rng.standard_normal(30_000).astype(np.float32) for r in range(world)}
    got: dict[int, bytes] = {}
    async with trio.open_nursery() as nursery:
        handles = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(shards)]
        async with open_controller(LOOP, 0, world_size=world, salt=salt, lanes=7, lane_min_bytes=0,
                                   deterministic=deterministic, shards=[(LOOP, h.port) for h in handles]) as ctl:
            relays = [await nursery.start(hold_open, open_relay(
                ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{i}", ranks=ranks,
                world_size=world, salt=salt, deterministic=deterministic,
            )) for i, ranks in enumerate(hosts)]

            async def rank_main(rank: int) -> None:
                await trio.sleep(0.01 * ((rank * 3) % world))  # another arrival order than host order
                host = next(i for i, ranks in enumerate(hosts) if rank in ranks)
                async with connect_reduce_client((LOOP, relays[host].port), rank, world, salt) as client:
                    client.bf16_wire = bf16
                    out = await client.all_reduce_weighted([torch.from_numpy(values[rank] * (rank + 1))],
                                                           RoundKind.MODEL, float(rank + 1))
                    got[rank] = out[0][0].numpy().tobytes()

            async with trio.open_nursery() as ranks:
                for rank in range(world):
                    ranks.start_soon(rank_main, rank)
        nursery.cancel_scope.cancel()
    return got


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
async def test_shards_give_the_bytes_of_a_deterministic_controller(salt, bf16):
    """Every shard adds the decided hosts in host order: the consensus is bit for bit what a
    controller in deterministic mode computes from the same frames, lanes and all, on the
    f32 wire and on bf16's."""
    with trio.fail_after(30):
        sharded = await _one_round(salt, 3, deterministic=True, bf16=bf16)
        single = await _one_round(salt, 0, deterministic=True, bf16=bf16)
    assert len(set(sharded.values())) == 1
    assert set(sharded.values()) == set(single.values())


class CustomOuter:
    """An outer optimizer whose math only the controller knows (no shard can step for it)."""

    def __call__(self, consensus):
        return consensus

    def step_lane(self, consensus, layout, lane, fragment):
        return consensus


async def test_what_shards_cannot_do_yet_is_refused_up_front_naming_it(salt, tmp_path):
    from flodl_trio import ConfigError

    for options, named in (({"lanes": 1}, "lanes >= 2"),
                           ({"outer_optimizer": CustomOuter()}, "the outer optimizer CustomOuter")):
        with pytest.raises(ConfigError, match=named):
            async with open_controller(LOOP, 0, world_size=1, salt=salt, shards=[(LOOP, 1)], **options):
                pass


async def test_a_shard_refuses_connections_without_the_salt_and_serves_on(salt):
    """On a shard's port, a 'controller' or a 'relay' that cannot sign its first record (the
    wrong salt), or says nothing, or a relay whose Hello names no ranks, is refused and
    logged; the shard then serves a round."""
    from flodl_trio import SessionSalt
    from flodl_trio.wire import EXTENSIONS_MARK, Hello
    from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA, CHANNEL_MAGIC_SHARD
    from flodl_trio.wire.mux import ShardSetup, encode_control_record

    wrong = SessionSalt(b"\x09" * 16)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt))
            for magic, msg in ((CHANNEL_MAGIC_SHARD, ShardSetup(0, 1, 30_000)), (CHANNEL_MAGIC_DATA, Hello("x", [0], [EXTENSIONS_MARK]))):
                stream = await trio.open_tcp_stream(LOOP, shard.port)
                await stream.send_all(magic.to_bytes(4, "little") + bytes(encode_control_record(msg, wrong)))
                assert await stream.receive_some(16) == b""  # closed on us
            # Signed, but a relay Hello that names no ranks, or ranks out of order: refused too.
            for ranks in ([], [1, 0]):
                stream = await trio.open_tcp_stream(LOOP, shard.port)
                hello = Hello("x", ranks, [EXTENSIONS_MARK])
                await stream.send_all(CHANNEL_MAGIC_DATA.to_bytes(4, "little") + bytes(encode_control_record(hello, salt)))
                assert await stream.receive_some(16) == b""
            assert shard.refused == 4
            async with one_host_with_a_shard(nursery, salt, shard) as (_ctl, relay):
                async with connect_reduce_client((LOOP, relay.port), 0, 1, salt) as client:
                    out = await client.all_reduce_tensors([torch.full((1000,), 3.0)])
                assert bool((out[0] == 3.0).all()) and shard.rounds == 1
            nursery.cancel_scope.cancel()


async def _shard_until_cancelled(scope: trio.CancelScope, salt, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        async with open_shard(LOOP, 0, salt=salt) as shard:
            task_status.started(shard)
            await trio.sleep_forever()


async def test_a_lost_shard_gives_its_lanes_to_the_next_and_rounds_stay_exact(salt):
    """Shard 1 of 2 is gone between two rounds: the controller says so, its lanes go to
    shard 0, and every later round is still the exact mean."""
    numel, rounds = 50_000, 4
    scopes = [trio.CancelScope() for _ in range(2)]
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(_shard_until_cancelled, scope, salt) for scope in scopes]
            async with two_hosts_on(shards, nursery, salt) as (ctl, relays):
                done_first = {rank: trio.Event() for rank in range(2)}

                async def rank_main(rank: int) -> None:
                    async with connect_reduce_client((LOOP, relays[rank].port), rank, 2, salt) as client:
                        for r in range(rounds):
                            data = torch.arange(numel, dtype=torch.float32) * (rank + 1) + r
                            got[rank].append((await client.all_reduce_tensors([data]))[0].numpy().copy())
                            if r == 0:
                                done_first[rank].set()
                                if rank == 0:
                                    await done_first[1].wait()
                                    scopes[1].cancel()  # shard 1 is gone between rounds 0 and 1

                async with trio.open_nursery() as ranks:
                    for rank in range(2):
                        ranks.start_soon(rank_main, rank)
            nursery.cancel_scope.cancel()
    for r in range(rounds):
        want = (np.arange(numel, dtype=np.float32) * 1 + r + np.arange(numel, dtype=np.float32) * 2 + r) / 2
        for rank in range(2):
            np.testing.assert_allclose(got[rank][r], want, rtol=1e-6)
    assert shards[0].rounds == rounds  # every round's decision, once each


def _stall_shard_1(monkeypatch, at_decision: int) -> trio.Event:
    """Shard 1 takes the controller's decision number ``at_decision`` and never sums a
    lane of it, as a shard that dies after the round was decided: set once it has it."""
    from flodl_trio.shard import core as shard_core

    original = shard_core._Shard._sum_lane
    stalled = trio.Event()

    async def stalling(self, msg, lane: int) -> None:
        if self.index == 1 and msg.decision == at_decision:
            stalled.set()
            await trio.sleep_forever()
        await original(self, msg, lane)

    monkeypatch.setattr(shard_core._Shard, "_sum_lane", stalling)
    return stalled


async def test_a_shard_lost_after_the_decision_before_the_commit_has_the_round_decided_again(salt, monkeypatch):
    """Shard 1 is lost after the controller decided round 1 and shard 0 sent its lanes:
    the controller decides the round again (the same hosts), the relays drop the first
    decision's lanes, and every rank gets one exact consensus."""
    numel, rounds = 50_000, 3
    stalled = _stall_shard_1(monkeypatch, at_decision=1)
    scopes = [trio.CancelScope() for _ in range(2)]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(_shard_until_cancelled, scope, salt) for scope in scopes]
            async with two_hosts_on(shards, nursery, salt) as (ctl, relays):

                async def lose_shard_1_once_stalled() -> None:
                    await stalled.wait()
                    scopes[1].cancel()

                nursery.start_soon(lose_shard_1_once_stalled)
                got = await two_ranks_rounds(relays, numel, rounds, salt)
                assert (ctl.stats.shards_lost, ctl.stats.decisions_again) == (1, 1)
            nursery.cancel_scope.cancel()
    assert_means(got, numel)


async def test_a_host_lost_after_lane_0_whose_pieces_died_with_a_shard_leaves_the_round(salt, monkeypatch):
    """A relay gives both shards its pieces, its lane 0 reaches the controller (so round 0
    is decided with it), and it is lost; so is shard 1, which holds some of its pieces,
    before it summed them. Those pieces are nowhere now: the round is decided again
    without that host, every shard drops its pieces, and the survivors get the mean of
    their own frames, exactly (never a mix of two decisions)."""
    from flodl_trio.wire.mux import ShardAck

    numel, lanes = 40_000, 5
    stalled = _stall_shard_1(monkeypatch, at_decision=0)
    scopes = [trio.CancelScope() for _ in range(2)]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(_shard_until_cancelled, scope, salt) for scope in scopes]
            async with host_beside_a_raw_one(nursery, salt, shards, lanes) as (ctl, relay):

                async def lost_host() -> None:
                    lost = RawHost(salt, "lost", numel, lanes, len(shards))
                    await lost.join(ctl.port, shards)
                    await lost.send_pieces()
                    assert all(isinstance(ack, ShardAck) for ack in await lost.acks())
                    await lost.send_lane_0()
                    await stalled.wait()  # round 0 was decided with this host in
                    await lost.aclose()  # lost after its lane 0 ...
                    scopes[1].cancel()  # ... and so is shard 1, before it summed the round

                nursery.start_soon(lost_host)
                got = await survivors_round(relay, numel, salt)
                # Decided again once or twice: the host's loss and the shard's may be seen apart.
                assert ctl.stats.shards_lost == 1 and ctl.stats.decisions_again in (1, 2)
            nursery.cancel_scope.cancel()
    for rank in (0, 1):
        assert np.array_equal(got[rank], np.full(numel, 0.5, np.float32))
    from flodl_trio.wire.lanes import sharded_lane_count

    # The lost host's pieces shard 0 held: half of its lanes 1.. (two shards own as many).
    assert shards[0].pieces_dropped == (sharded_lane_count(lanes, 2) - 1) // 2


async def test_a_shard_sending_a_forged_lane_costs_only_that_shard(salt, monkeypatch):
    """Shard 1 sends round 1's lanes with a flipped byte (their MAC fails at the relays):
    the relays tell the controller, which loses shard 1 for everyone; its lanes go to
    shard 0, the round is decided again, and no rank or relay pays for it."""
    from flodl_trio.shard import core as shard_core
    from flodl_trio.wire.round_frame import EncodedFrame

    numel, rounds = 50_000, 3
    original = shard_core._Shard._queue_lane

    def forging(self, target, record) -> None:
        if self.index == 1 and self._summing is not None and self._summing.round == 1:
            raw = bytearray(b"".join(bytes(chunk) for chunk in record.chunks))
            raw[len(raw) // 2] ^= 0x10
            record = EncodedFrame([bytes(raw)], len(raw))
        original(self, target, record)

    monkeypatch.setattr(shard_core._Shard, "_queue_lane", forging)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(2)]
            async with two_hosts_on(shards, nursery, salt) as (ctl, relays):

                got = await two_ranks_rounds(relays, numel, rounds, salt)
                assert ctl.stats.shards_lost == 1 and ctl.stats.decisions_again == 1
                assert not ctl.dead_ranks.snapshot()
            nursery.cancel_scope.cancel()
    assert_means(got, numel)


async def test_a_relay_sending_a_shard_a_misshapen_piece_costs_only_that_relay(salt):
    """A seated relay sends a valid lane 0 but a lane-1 piece one element short: the shard
    checks it against the schema the decision carries, names that relay to the controller,
    which drops it; the round is decided again without it, and no shard is lost."""
    from flodl_trio.wire import DTYPE_F32, RoundFrame, TensorPayload

    numel, lanes = 40_000, 5
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(2)]
            async with host_beside_a_raw_one(nursery, salt, shards, lanes) as (ctl, relay):

                async def bad_host() -> None:
                    bad = RawHost(salt, "bad", numel, lanes, len(shards))
                    short = bad.parts[1].tensors[0]
                    bad.parts[1] = RoundFrame([TensorPayload(DTYPE_F32, (short.shape[0] - 1,), short.data[:-1]),
                                               *bad.parts[1].tensors[1:]])
                    await bad.join(ctl.port, shards)
                    await bad.send_lane_0()
                    await bad.send_pieces()
                    await trio.sleep_forever()  # connected until the controller drops it

                nursery.start_soon(bad_host)
                got = await survivors_round(relay, numel, salt)
                assert ctl.dead_ranks.is_dead(2) and ctl.stats.shards_lost == 0
                assert ctl.stats.decisions_again >= 1
            nursery.cancel_scope.cancel()
    for rank in (0, 1):
        assert np.array_equal(got[rank], np.full(numel, 0.5, np.float32))
    assert shards[0].refused_pieces == 1 and shards[1].refused_pieces == 0


async def test_a_relay_that_connects_after_a_shard_was_lost_is_told_and_rounds_stay_exact(salt):
    """Shard 1 is lost before any relay connects: each relay is told right after its
    HelloAck, never dials it, and sends its lanes to shard 0 from the first round."""
    numel, rounds = 50_000, 2
    scopes = [trio.CancelScope() for _ in range(2)]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(_shard_until_cancelled, scope, salt) for scope in scopes]
            async with open_controller(LOOP, 0, world_size=2, salt=salt, lanes=5, lane_min_bytes=0,
                                       shards=[(LOOP, s.port) for s in shards]) as ctl:
                while shards[1].index is None:  # set up by the controller
                    await trio.sleep(0.01)
                scopes[1].cancel()
                while ctl.stats.shards_lost == 0:  # the controller's watcher sees the connection end
                    await trio.sleep(0.01)
                relays = [await nursery.start(hold_open, open_relay(
                    ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{rank}",
                    ranks=[rank], world_size=2, salt=salt,
                )) for rank in range(2)]

                got = await two_ranks_rounds(relays, numel, rounds, salt)
                assert ctl.stats.shards_lost == 1 and ctl.stats.decisions_again == 0
            nursery.cancel_scope.cancel()
    assert_means(got, numel)
    assert shards[0].rounds == rounds


async def test_a_shard_unreachable_at_the_start_is_lost_from_the_start(salt):
    """The controller cannot reach shard 1 within its connect bounds: that shard is lost
    from the start, every relay is told at its HelloAck, and shard 0 reduces every lane."""
    import socket

    from flodl_trio.transport.settings import NetBounds

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind((LOOP, 0))
        nobody = closed.getsockname()[1]
    numel = 50_000
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt))
            async with open_controller(LOOP, 0, world_size=2, salt=salt, lanes=5, lane_min_bytes=0,
                                       bounds=NetBounds(connect_attempts=2, connect_interval=0.05),
                                       shards=[(LOOP, shard.port), (LOOP, nobody)]) as ctl:
                relays = [await nursery.start(hold_open, open_relay(
                    ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{rank}",
                    ranks=[rank], world_size=2, salt=salt,
                )) for rank in range(2)]

                got = await two_ranks_rounds(relays, numel, 1, salt)
                assert ctl.stats.shards_lost == 1
            nursery.cancel_scope.cancel()
    assert_means(got, numel)
    assert shard.rounds == 1


async def test_a_shard_silent_to_the_relays_is_reported_and_its_lanes_move(salt, monkeypatch):
    """Shard 1 keeps its heartbeats to the controller but says nothing to the relays, as
    when only the link between them is cut: each relay takes that silence past its
    heartbeat timeout as the shard failing, tells the controller, and the lanes move."""
    from flodl_trio.shard import core as shard_core
    from flodl_trio.transport.settings import NetBounds

    original = shard_core._Shard._relay_writer

    async def silent_from_shard_1(self, relay) -> None:
        if self.index == 1:
            await trio.sleep_forever()
        await original(self, relay)

    monkeypatch.setattr(shard_core._Shard, "_relay_writer", silent_from_shard_1)
    numel = 50_000
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(2)]
            async with open_controller(LOOP, 0, world_size=2, salt=salt, lanes=5, lane_min_bytes=0,
                                       shards=[(LOOP, s.port) for s in shards]) as ctl:
                relays = [await nursery.start(hold_open, open_relay(
                    ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{rank}",
                    ranks=[rank], world_size=2, salt=salt, bounds=NetBounds(heartbeat_timeout=3.0),
                )) for rank in range(2)]

                got = await two_ranks_rounds(relays, numel, 1, salt)
                assert ctl.stats.shards_lost == 1 and not ctl.dead_ranks.snapshot()
            nursery.cancel_scope.cancel()
    assert_means(got, numel)


async def test_a_relay_saying_the_last_live_shard_is_lost_is_dropped_not_the_shard(salt):
    """One relay's word cannot stop the run: told by a relay that the only shard is lost
    while its own connection to it is fine, the controller drops that relay, and the
    others' round goes through the shard, exactly."""
    from flodl_trio.wire.mux import ShardLost, encode_control_record

    numel, lanes = 40_000, 5
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt))
            async with host_beside_a_raw_one(nursery, salt, [shard], lanes) as (ctl, relay):
                liar = RawHost(salt, "liar", numel, lanes, 1)
                await liar.join(ctl.port, [shard])
                await liar.to_controller.send_chunks([encode_control_record(ShardLost(0), salt)])
                got = await survivors_round(relay, numel, salt)
                assert ctl.dead_ranks.is_dead(2) and ctl.stats.shards_lost == 0
                assert any("the last live one" in r for r in ctl.rejections) or ctl.stats.relays_dropped == 1
            nursery.cancel_scope.cancel()
    for rank in (0, 1):
        assert np.array_equal(got[rank], np.full(numel, 0.5, np.float32))
    assert shard.rounds == 1


async def test_the_last_shard_lost_stops_the_controller_naming_it_and_nothing_hangs(salt):
    """With no live shard left no lane can be reduced: the controller stops naming the
    shard, every relay's channel ends, and the ranks' next round fails at once."""
    from flodl_trio import FlodlError

    shard_scope = trio.CancelScope()
    errors: dict[int, FlodlError] = {}
    ended = {rank: trio.Event() for rank in range(2)}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(_shard_until_cancelled, shard_scope, salt)
            with pytest.raises(FlodlError, match="every one of the 1 shards is lost .shard 0"):
                async with open_controller(LOOP, 0, world_size=2, salt=salt, lanes=3, lane_min_bytes=0,
                                           shards=[(LOOP, shard.port)]) as ctl:
                    relays = [await nursery.start(hold_open, open_relay(
                        ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name=f"h{rank}",
                        ranks=[rank], world_size=2, salt=salt,
                    )) for rank in range(2)]
                    done_first = {rank: trio.Event() for rank in range(2)}

                    async def rank_main(rank: int) -> None:
                        async with connect_reduce_client((LOOP, relays[rank].port), rank, 2, salt) as client:
                            out = await client.all_reduce_tensors([torch.full((1000,), float(rank))])
                            assert bool((out[0] == 0.5).all())
                            done_first[rank].set()
                            if rank == 0:
                                await done_first[1].wait()
                                shard_scope.cancel()  # the shard is gone between two rounds
                            with pytest.raises(FlodlError) as caught:
                                for _ in range(3):
                                    await client.all_reduce_tensors([torch.full((1000,), float(rank))])
                            errors[rank] = caught.value
                            ended[rank].set()

                    for rank in range(2):  # outside the controller's block, which its error cancels
                        nursery.start_soon(rank_main, rank)
                    await ctl.wait_finished()
            for rank in range(2):
                await ended[rank].wait()
            for relay in relays:  # the controller closed their connections: they end (not hang)
                with contextlib.suppress(FlodlError):
                    await relay.wait_finished()
            nursery.cancel_scope.cancel()
    assert set(errors) == {0, 1}


async def test_a_controller_with_shards_refuses_a_flodl_relay_saying_why(salt):
    """A relay without the extensions mark cannot reach shards: it is refused at its Hello,
    at its own cost; a flodl_trio relay is seated."""
    from tests.e2e.test_data_plane import _expect_ack, _expect_closed, _fake_relay

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt))
            async with open_controller(LOOP, 0, world_size=2, salt=salt, shards=[(LOOP, shard.port)]) as ctl:
                await _expect_closed(await _fake_relay(ctl.port, salt, "h-flodl", [0]))
                conn = await _fake_relay(ctl.port, salt, "h-trio", [0], extensions=True)
                await _expect_ack(conn, salt)  # Lanes, then Shards and HelloAck
                await conn.aclose()
            nursery.cancel_scope.cancel()
    refused = [r for r in ctl.rejections if "h-flodl" in r]
    assert refused and "reduces with shards" in refused[0]


async def _weighted_rounds(cluster, world: int, rounds: int, numel: int) -> None:
    """``rounds`` weighted rounds of every rank, each checked against numpy on every rank."""
    rng = np.random.default_rng(world)
    values = {r: rng.standard_normal(numel).astype(np.float32) for r in range(world)}
    weights = {r: float(r + 1) for r in range(world)}
    got: dict[tuple[int, int], tuple] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, cluster.salt) as client:
            for round_ in range(rounds):
                t = torch.from_numpy(values[rank] * weights[rank] * (round_ + 1))
                got[rank, round_] = await client.all_reduce_weighted([t], RoundKind.MODEL, weights[rank])

    async with trio.open_nursery() as nursery:
        for rank in range(world):
            nursery.start_soon(rank_main, rank)
    mass = sum(weights.values())
    for round_ in range(rounds):
        want = sum(weights[r] * values[r] * (round_ + 1) for r in range(world)) / mass
        for rank in range(world):
            np.testing.assert_allclose(got[rank, round_][0][0].numpy(), want, rtol=1e-5, atol=1e-6)
            assert got[rank, round_][1] == mass
            assert got[rank, round_][0][0].numpy().tobytes() == got[0, round_][0][0].numpy().tobytes()


async def test_with_shards_auto_the_relays_offers_are_fixed_after_the_first_round_and_rounds_stay_exact(salt):
    """shards="auto" (the daemons' default): each host's relay offers its shard; the
    controller fixes them at the first round's consensus and every later round goes
    through them, exact against numpy."""
    with trio.fail_after(30):
        async with open_local_cluster(world_size=4, hosts=[[0, 1], [2], [3]], salt=salt, lanes=4, lane_min_bytes=0,
                                      shards="auto") as cluster:
            await _weighted_rounds(cluster, 4, 4, 30_000)
    assert [h.rounds for h in cluster.shards] == [3, 3, 3]  # round 0 was the controller's alone
    assert cluster.controller.stats.shards_lost == 0


async def test_with_shards_auto_a_controller_that_cannot_have_shards_says_why_and_reduces_alone(salt, caplog):
    """A custom outer optimizer needs every lane at the controller: the offers are not used
    (its log says why) and every round is the controller's, exact. A built-in one does
    not stop the shards."""
    import logging

    from flodl_trio.fold.outer import DiLoCoNesterov, PlainAverage

    caplog.set_level(logging.INFO, logger="flodl_trio.controller")
    for outer, used in ((CustomOuter(), False), (PlainAverage(), True), (DiLoCoNesterov(), True)):
        with trio.fail_after(30):
            async with open_local_cluster(world_size=3, hosts=[[0], [1], [2]], salt=salt, lanes=3, lane_min_bytes=0,
                                          shards="auto", outer_optimizer=outer) as cluster:
                await _weighted_rounds(cluster, 3, 3, 20_000)  # (Model rounds only: no window to step)
        assert [h.rounds for h in cluster.shards] == ([2, 2, 2] if used else [0, 0, 0]), outer
    assert any("will not be used: shards do not work yet with the outer optimizer CustomOuter" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("hosts", [[[0, 1]], [[0], [1]]], ids=["one-host", "two-hosts"])
async def test_with_shards_auto_one_or_two_hosts_keep_the_star(salt, hosts):
    """One relay: nothing to spread over; two: a shard's link would carry what the
    controller's does (one frame each way). The offers are not taken."""
    with trio.fail_after(30):
        async with open_local_cluster(world_size=2, hosts=hosts, salt=salt, lanes=3, lane_min_bytes=0,
                                      shards="auto") as cluster:
            await _weighted_rounds(cluster, 2, 3, 20_000)
    assert [h.rounds for h in cluster.shards] == [0] * len(hosts)


# Elastic membership with shards: while a rank rejoins, the shards send the controller a
# copy of each round's lanes, so it keeps the window a joiner starts from. Two of the
# lanes' reruns bet on the last window being at hand (with shards it is one that ends
# after the return asked): their sharded versions are the two tests below.
REJOIN_TESTS = [param for param in test_lanes.REJOIN_TESTS
                if param.id not in ("two-come-back-together", "everyone-died-then-returned")]


@pytest.mark.parametrize(("test", "kwargs"), REJOIN_TESTS)
async def test_rejoin_tests_pass_with_shards(test, kwargs, monkeypatch):
    monkeypatch.setattr(test_rejoin, "open_local_cluster",
                        functools.partial(open_local_cluster, lanes=3, lane_min_bytes=0, shards=2))
    await test(**kwargs)


async def test_two_ranks_returning_with_shards_get_a_window_that_ended_after_they_asked(salt):
    """With shards the controller holds no window whole until a rank asks to rejoin: the
    returning ranks get the first window whose rounds the shards copied to it (one that
    ended after they asked), enter, and every window stays exact on every rank."""
    from flodl_trio import connect_reduce_client
    from tests.e2e.test_rejoin import (
        HOSTS, SALT, WORLD, Record, check_every_window, first_counted, fresh_model, run_until_gone, run_windows,
    )

    record = Record()
    asked_after: dict[int, int] = {}
    got: dict[int, int] = {}
    counted: dict[int, int] = {}
    with trio.fail_after(60):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, lanes=3,
                                      lane_min_bytes=0, shards=2) as cluster:

            async def survivor(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await run_windows(client, rank, 0, params, buffers, record, pace=0.1)

            async def leaves_and_returns(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await client.join(params, buffers)
                    await run_until_gone(client, rank, 2, params, buffers, record)
                await record.wait_for(0, 4)
                asked_after[rank] = record.windows_done[0]
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    start = await client.join(params, buffers)
                    assert client.last_state is not None
                    got[rank] = client.last_state.window
                    counted[rank] = first_counted(client, start)
                    await run_windows(client, rank, start, params, buffers, record, pace=0.1)

            async with trio.open_nursery() as nursery:
                for rank in (0, 2):
                    nursery.start_soon(survivor, rank)
                for rank in (1, 3):
                    nursery.start_soon(leaves_and_returns, rank)
            stats = cluster.controller.stats
            assert stats.rejoins == 2
            # Copies only while a return was in progress: its windows' params and buffers rounds.
            assert 2 <= stats.rounds_copied < stats.rounds // 2, (stats.rounds_copied, stats.rounds)
    for rank in (1, 3):
        assert got[rank] > asked_after[rank], (got, asked_after)  # a window that ended after it asked
    contributors = check_every_window(record, {0, 1, 2, 3})
    for rank in (1, 3):
        assert all(rank in contributors[w] for w in range(counted[rank], len(contributors)))


async def test_when_every_rank_died_a_controller_with_shards_refuses_returns_naming_why(salt):
    """Every rank dies after window 2. The controller holds that window only in part (its
    lanes are on the shards), so it cannot restart the run from it: each returning rank is
    refused, naming why - not started again from its own params, which would lose the run."""
    from flodl_trio import JoinRefused, average_window, connect_reduce_client
    from tests.e2e.test_rejoin import SALT, fresh_model, trained

    with trio.fail_after(30):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60, lanes=3,
                                      lane_min_bytes=0, shards=2) as cluster:

            async def life(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    for window in range(await client.join(params, buffers), 3):
                        trained(params, rank, window)
                        await average_window(client, params, buffers, 1 + rank, rank=rank, world_size=2, in_place=True)
                    await client.aclose()  # a crash: gone without saying it finished

            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(life, rank)
            params, buffers = fresh_model(0)
            async with connect_reduce_client(cluster.relay_address(0), 0, 2, SALT) as client:
                with pytest.raises(JoinRefused, match="every rank died.*shards.*window 2"):
                    await client.join(params, buffers)
            assert cluster.controller.stats.rejoins_refused >= 1
