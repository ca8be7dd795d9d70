"""Lanes through real roles: each round reduced in L lanes on the relays' connections.

The seed-ported end-to-end tests and the random-mass numpy comparison are run
again with L = 2, 4 and 7 (their modules' cluster opener given the lane
count); a host lost between two lanes of a round; settings that cannot work.
"""

from __future__ import annotations

import functools
import logging
import inspect

import numpy as np
import pytest
import torch
import trio

from flodl_trio import ConfigError, FlodlError, RoundKind, connect_reduce_client
from flodl_trio.controller import open_controller
from flodl_trio.fold.outer import SlowMo
from flodl_trio.relay import ChannelKind, open_relay
from flodl_trio.testing import CutAt, hold_open, open_local_cluster
from flodl_trio.wire import DTYPE_F32, EXTENSIONS_MARK, Hello, RoundFrame, TensorPayload
from flodl_trio.wire.constants import MUX_HEADER_LEN
from flodl_trio.wire.lanes import LaneLayout
from flodl_trio.wire.mux import encode_control_msg
from flodl_trio.wire.round_frame import round_frame_len
from tests.e2e import test_data_plane, test_rejoin
from tests.e2e import test_seed as test_seed_e2e

LANES = [2, 4, 7]


def _reruns(module, names):
    return [pytest.param(getattr(module, name), id=name) for name in names]


SEED_TESTS = _reruns(test_seed_e2e, [
    "test_two_rank_client_average", "test_client_multi_round_persistence",
    "test_three_rank_broadcast_from_root_delivers_root_values", "test_broadcast_from_root_multi_tensor_distinct_shapes",
    "test_two_rank_tensor_average", "test_two_rank_tensor_average_bf16_wire",
    "test_two_rank_scaled_weighted_average_bf16_wire", "test_realized_work_all_alive_scattered_frame_is_consensus",
    "test_realized_work_after_death",
])


# Elastic membership with lanes: the controller keeps each window joined from its lanes.
REJOIN_TESTS = [
    pytest.param(test_rejoin.test_a_rank_that_left_rejoins_with_the_consensus_and_every_round_is_exact, {"control": True},
                 id="rejoins-with-the-consensus"),
    pytest.param(test_rejoin.test_two_ranks_coming_back_together_enter_the_same_window, {}, id="two-come-back-together"),
    pytest.param(test_rejoin.test_a_rank_that_dies_while_it_waits_or_mid_transfer_costs_the_cluster_nothing, {},
                 id="dies-while-it-waits"),
    pytest.param(test_rejoin.test_when_every_rank_died_the_first_to_return_restarts_the_run_from_the_last_window, {},
                 id="everyone-died-then-returned"),
    pytest.param(test_rejoin.test_a_cluster_forms_without_a_missing_rank_which_joins_later, {"control": False},
                 id="forms-without-one"),
]


@pytest.mark.parametrize(("test", "kwargs"), REJOIN_TESTS)
async def test_rejoin_tests_pass_with_lanes(test, kwargs, monkeypatch):
    monkeypatch.setattr(test_rejoin, "open_local_cluster", functools.partial(open_local_cluster, lanes=3, lane_min_bytes=0))
    await test(**kwargs)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("test", SEED_TESTS)
async def test_seed_end_to_end_tests_pass_with_lanes(test, lanes, salt, monkeypatch):
    monkeypatch.setattr(test_seed_e2e, "open_local_cluster", functools.partial(open_local_cluster, lanes=lanes, lane_min_bytes=0))
    await test(salt)


@pytest.mark.parametrize("local_leg", [True, False], ids=["local-leg", "tcp"])
@pytest.mark.parametrize("lanes", LANES)
async def test_random_masses_against_numpy_with_lanes(lanes, local_leg, salt, monkeypatch):
    """Over the local leg the relay answers with the joined consensus unsigned; over TCP signed (the rank checks it)."""
    cluster = functools.partial(open_local_cluster, lanes=lanes, lane_min_bytes=0, local_leg=local_leg)
    monkeypatch.setattr(test_data_plane, "open_local_cluster", cluster)
    test = test_data_plane.test_fifty_rounds_random_masses_against_numpy
    kwargs = {"in_place": True} if "in_place" in inspect.signature(test).parameters else {}
    await test(salt, **kwargs)


async def test_a_host_lost_between_two_lanes_counts_in_the_first_and_not_the_second(salt):
    """Host 1's connection is cut right after its lane-0 frame: lane 0's consensus still
    holds rank 2's contribution (realized work), lane 1's does not; every survivor
    gets the same values, and the round's mass is the smaller lane's."""
    shapes, weights = [(1000,), (37,)], [1.0, 2.0, 4.0]
    values = [[np.full(s, 10.0 * (r + 1) + i, dtype=np.float32) for i, s in enumerate(shapes)] for r in range(3)]
    schema = RoundFrame([TensorPayload(DTYPE_F32, s, np.zeros(s, "<f4").reshape(-1)) for s in shapes])
    layout = LaneLayout.of(schema, 2)
    hello = MUX_HEADER_LEN + len(encode_control_msg(Hello("host1", [2], [EXTENSIONS_MARK])))
    lane0 = MUX_HEADER_LEN + round_frame_len(layout.split(schema)[0].tensors)  # its tag included
    got: dict[int, object] = {}
    cut = CutAt(at_byte=4 + hello + lane0)
    async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt, lanes=2, lane_min_bytes=0,
                                  upstream_faults={1: [cut]}) as cluster:

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                tensors = [torch.from_numpy(v * weights[rank]) for v in values[rank]]
                try:
                    got[rank] = await client.all_reduce_weighted(tensors, RoundKind.MODEL, weights[rank])
                except FlodlError as exc:
                    got[rank] = exc

        async with trio.open_nursery() as nursery:
            for rank in range(3):
                nursery.start_soon(rank_main, rank)
        assert cluster.upstream_proxies[1].fired(cut)
        with pytest.raises(FlodlError, match="relay host1: connection to the controller failed"):
            await cluster.relays[1].wait_finished()
    assert isinstance(got[2], FlodlError), got[2]
    cut = layout.lanes[0][0].stop  # lane 0: tensor 0's elements [0, cut)
    with_2 = sum(weights[r] * values[r][0][:cut] for r in range(3)) / sum(weights)
    without_2 = [sum(weights[r] * values[r][i] for r in (0, 1)) / (weights[0] + weights[1]) for i in range(2)]
    for rank in (0, 1):
        tensors, mass = got[rank]
        assert mass == weights[0] + weights[1]
        np.testing.assert_allclose(tensors[0].numpy()[:cut], with_2, rtol=1e-6)
        np.testing.assert_allclose(tensors[0].numpy()[cut:], without_2[0][cut:], rtol=1e-6)
        np.testing.assert_allclose(tensors[1].numpy(), without_2[1], rtol=1e-6)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got[0][0], got[1][0]))


async def relay_stops_on_a_lane_mismatch(salt, controller_lanes: int, relay_lanes: int, match: str, **relay_options):
    """A controller and a one-rank relay with these lane counts: the rank's round fails
    (nothing hangs), the relay stops with a ConfigError matching ``match``, and the
    controller finished no round."""
    async with open_controller("127.0.0.1", 0, world_size=1, salt=salt, lanes=controller_lanes) as controller:
        async with open_relay(ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", controller.port),
                              host_name="h", ranks=[0], world_size=1, salt=salt, lanes=relay_lanes,
                              **relay_options) as relay:
            with trio.fail_after(10):
                with pytest.raises(FlodlError):
                    async with connect_reduce_client(("127.0.0.1", relay.port), 0, 1, salt) as client:
                        await client.all_reduce_tensors([torch.ones(4)])
                with pytest.raises(ConfigError, match=match):
                    await relay.wait_finished()
        assert controller.stats.rounds == 0


async def test_a_relay_with_another_lane_count_fails_naming_both(salt):
    """The controller says it reduces in 2 lanes; a relay started with 1 stops, saying so."""
    await relay_stops_on_a_lane_mismatch(
        salt, 2, 1, r"reduces each round in 2 lane\(s\), this relay was started with lanes=1"
    )


async def test_an_outer_optimizer_that_cannot_step_a_lane_is_refused_up_front(salt):
    class WholeFramesOnly:
        def __call__(self, consensus: RoundFrame) -> RoundFrame:
            return consensus

    with pytest.raises(ConfigError, match="outer optimizer WholeFramesOnly needs a step_lane"):
        async with open_controller("127.0.0.1", 0, world_size=1, salt=salt, lanes=2, outer_optimizer=WholeFramesOnly()):
            pass
    async with open_controller("127.0.0.1", 0, world_size=1, salt=salt, lanes=2, outer_optimizer=SlowMo(),
                               rejoin_timeout=5.0):
        pass  # the built-in ones step lanes; rejoining keeps windows joined from lanes
    with pytest.raises(ConfigError, match="lanes must be 1..64"):
        async with open_controller("127.0.0.1", 0, world_size=1, salt=salt, lanes=0):
            pass


async def test_a_relay_with_lanes_facing_a_controller_without_them_stops_before_sending(salt):
    """The controller said no lanes before its HelloAck: the relay knows at once."""
    await relay_stops_on_a_lane_mismatch(
        salt, 1, 3, r"reduces each round in 1 lane\(s\), this relay was started with lanes=3"
    )


async def test_a_relay_started_without_lanes_takes_the_controllers(salt):
    """Lanes are set in one place: a relay given no count reduces in the controller's, which
    it is told before HelloAck (docs/wire.md, "Lanes")."""
    with trio.fail_after(20):
        async with open_controller("127.0.0.1", 0, world_size=2, salt=salt, lanes=4, lane_min_bytes=0) as controller:
            relays = []
            async with trio.open_nursery() as nursery:
                for rank in range(2):
                    relays.append(await nursery.start(hold_open, open_relay(
                        ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", controller.port),
                        host_name=f"h{rank}", ranks=[rank], world_size=2, salt=salt,
                    )))

                async def rank_main(rank: int) -> None:
                    async with connect_reduce_client(("127.0.0.1", relays[rank].port), rank, 2, salt) as client:
                        out = await client.all_reduce_tensors([torch.full((1000,), float(rank))])
                        assert bool((out[0] == 0.5).all())

                async with trio.open_nursery() as ranks:
                    for rank in range(2):
                        ranks.start_soon(rank_main, rank)
                nursery.cancel_scope.cancel()
    assert [relay.stats.lanes_up for relay in relays] == [4, 4]
    assert [relay.stats.consensus_lanes for relay in relays] == [4, 4]


async def test_small_rounds_go_in_one_lane_and_large_ones_in_all(salt):
    """With the default of a lane per 256 KiB, a 4 KiB round is one record each way and
    a 4 MiB one goes in all 4 lanes: the controller finishes one round per lane used."""
    async with open_local_cluster(world_size=2, hosts=[[0], [1]], salt=salt, lanes=4) as cluster:
        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 2, salt) as client:
                for numel in (1024, 1 << 20):
                    out = await client.all_reduce_tensors([torch.full((numel,), float(rank))])
                    assert out[0].numel() == numel and bool((out[0] == 0.5).all())

        async with trio.open_nursery() as nursery:
            for rank in range(2):
                nursery.start_soon(rank_main, rank)
        assert cluster.controller.stats.rounds == 1 + 4


@pytest.mark.parametrize("lie", ["lane-0-schema", "lane-1-piece"])
async def test_a_relay_whose_lanes_do_not_match_the_schema_it_sent_is_dropped_alone(salt, lie):
    """The controller checks every lane against the schema the relay's lane 0 carried,
    before folding it: a relay whose schema lies about its pieces (or whose lane 1 is
    not the layout's) breaks the protocol and is dropped; rank 0's round completes
    without it (with its lane 0 where that was sound), and the controller serves on."""
    from tests.e2e.test_data_plane import _expect_ack, _fake_relay

    from flodl_trio.wire.mux import MuxKind, encode_mux_record
    from flodl_trio.wire.round_frame import encode_round_frame

    frame = RoundFrame([TensorPayload(DTYPE_F32, (10,), np.full(10, 3.0, "<f4"))], RoundKind.MODEL, 1.0)
    lane0, lane1 = LaneLayout.of(frame, 2).split(frame)
    if lie == "lane-0-schema":  # says the tensor has 9 elements: its lane 0 would be 4 of them, not 5
        lane0 = RoundFrame([lane0.tensors[0], TensorPayload(DTYPE_F32, (0, 9)), lane0.tensors[-1]], lane0.kind, 1.0)
    else:  # lane 1 carries 4 elements where the layout says 5
        lane1 = RoundFrame([TensorPayload(DTYPE_F32, (4,), np.full(4, 3.0, "<f4")), lane1.tensors[-1]], lane1.kind, 1.0)
    async with open_controller("127.0.0.1", 0, world_size=2, salt=salt, lanes=2, lane_min_bytes=0) as controller:
        async with open_relay(ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", controller.port),
                              host_name="h0", ranks=[0], world_size=2, salt=salt, lanes=2) as relay:
            liar = await _fake_relay(controller.port, salt, "liar", [1], extensions=True)
            await _expect_ack(liar, salt)  # Lanes
            await _expect_ack(liar, salt)  # HelloAck
            for lane in (lane0, lane1):
                await liar.send_chunks(encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame(lane, salt), salt).chunks)
            async with connect_reduce_client(("127.0.0.1", relay.port), 0, 2, salt) as client:
                tensors, mass = await client.all_reduce_weighted([torch.ones(10)], RoundKind.MODEL, 1.0)
            assert controller.stats.relays_dropped == 1 and controller.dead_ranks.is_dead(1)
            assert mass == 1.0  # the smallest lane's: rank 0's alone
            want = [2.0] * 5 + [1.0] * 5 if lie == "lane-1-piece" else [1.0] * 10
            assert tensors[0].tolist() == want
            await liar.aclose()


async def test_a_round_of_one_lane_goes_whole_and_a_larger_whole_frame_from_a_trio_relay_is_dropped(salt, caplog):
    """A round under two lanes' worth goes as flodl sends it: one untagged HostFrame up
    (a single rank's forwarded byte for byte), one whole Broadcast down. A relay with the
    extensions mark that sends a frame of several lanes whole breaks the protocol and is
    dropped alone; the other relay's round completes without it."""
    from tests.e2e.test_data_plane import _expect_ack, _fake_relay

    from flodl_trio.wire.mux import MuxKind, encode_mux_record
    from flodl_trio.wire.round_frame import encode_round_frame, schema_frame_len

    caplog.set_level(logging.WARNING, logger="flodl_trio.controller")
    min_bytes = 64 << 10
    big = RoundFrame([TensorPayload(DTYPE_F32, (4 * min_bytes // 4,), np.full(min_bytes, 3.0, "<f4"))])
    with trio.fail_after(20):
        async with open_controller("127.0.0.1", 0, world_size=2, salt=salt, lanes=4, lane_min_bytes=min_bytes) as ctl:
            async with open_relay(ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", ctl.port),
                                  host_name="h0", ranks=[0], world_size=2, salt=salt) as relay:
                liar = await _fake_relay(ctl.port, salt, "liar", [1], extensions=True)
                await _expect_ack(liar, salt)  # Lanes
                await _expect_ack(liar, salt)  # HelloAck
                await liar.send_chunks(encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame(big, salt), salt).chunks)
                async with connect_reduce_client(("127.0.0.1", relay.port), 0, 2, salt) as client:
                    small = await client.all_reduce_tensors([torch.full((100,), 5.0)])
                    assert small[0].tolist() == [5.0] * 100  # rank 1's relay was dropped: rank 0 alone
                    whole_up = relay.stats.bytes_up
                    large = await client.all_reduce_tensors([torch.full((min_bytes,), 2.0)])  # 4 lanes
                    assert bool((large[0] == 2.0).all())
                await liar.aclose()
    assert ctl.stats.relays_dropped == 1 and ctl.dead_ranks.is_dead(1)
    assert any("liar" in r.getMessage() and "goes in 4 lanes" in r.getMessage() for r in caplog.records)
    # The small round: flodl's bytes, the rank's own frame forwarded; the large one in lanes.
    assert whole_up == MUX_HEADER_LEN + schema_frame_len([(DTYPE_F32, (100,))])
    assert relay.stats.lanes_up == 4 and relay.stats.consensus_lanes == 4


@pytest.mark.parametrize("lane_min_bytes", [0, None], ids=["always-lanes", "default"])
async def test_a_round_of_no_tensors_completes_in_a_cluster_with_lanes(salt, lane_min_bytes):
    """flodl allows a frame of no tensors; with lanes (the default) such a round still completes."""
    options = {} if lane_min_bytes is None else {"lane_min_bytes": lane_min_bytes}
    got: dict[int, object] = {}
    with trio.fail_after(20):
        async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt, **options) as cluster:

            async def rank_main(rank: int, client) -> None:
                got[rank] = await client.all_reduce_tensors([])
                got[rank, "after"] = (await client.all_reduce_tensors([torch.full((3,), float(rank))]))[0].tolist()

            await cluster.run_ranks(rank_main)
    assert [got[r] for r in range(3)] == [[], [], []]
    assert all(got[r, "after"] == [1.0, 1.0, 1.0] for r in range(3))
