"""Delta rounds (coded pseudo-gradients) through the reduction shards.

Each shard sums its lanes' coded pieces in f32 and divides once; the controller,
which holds the lineage (``x``, the base, the outer state), steps the means and
sends each coded consensus lane back to its shard to fan out (docs/wire.md,
"Delta rounds through the shards"). The oracle is the star's result: numpy
replaying every hop's code (tests/e2e/test_delta_rounds.py), or a controller
without shards given the same contributions in deterministic mode. Every rank
must hold its bits, window after window, also through a lost shard.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import trio

from flodl_trio import connect_reduce_client
from flodl_trio.fold.delta import is_delta_schema
from flodl_trio.fold.outer import DiLoCoNesterov
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.quant import DeltaCodec
from tests.e2e.test_delta_rounds import SALT, WINDOWS, assert_holds_the_oracles, model, oracle, train

THREE_HOSTS = [[0, 1], [2], [3]]
SHARDS = 8  # int8 deltas go through 8 shards (8 x 8 bits >= 64: docs/wire.md)


async def _run(hosts, codec: DeltaCodec, shards, *, meanwhile=None, **options):
    """Every rank's windows (tests/e2e/test_delta_rounds.py's ``train``) on a local
    cluster in deterministic mode; what each rank held after each window, and the cluster."""
    world = sum(len(h) for h in hosts)
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
            client.delta_codec = codec
            await train(client, rank, world, model(rank), range(WINDOWS), seen)

    with trio.fail_after(60):
        async with open_local_cluster(world_size=world, hosts=hosts, salt=SALT, lanes=3, lane_min_bytes=0,
                                      shards=shards, deterministic=True, **options) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
                if meanwhile is not None:
                    nursery.start_soon(meanwhile, cluster)
    return seen, cluster


@pytest.mark.parametrize(("shards", "codec", "through"), [
    (8, "int8:1024", True), (16, "fp4:256", True), (5, "int8:1024", False), (8, "int4:512", False),
    ("auto", "int8:256", False),
], ids=["8-int8", "16-fp4", "5-int8", "8-int4", "auto-int8"])
async def test_delta_rounds_go_through_the_shards_when_they_pay_and_every_rank_holds_the_oracles_params(
    shards, codec, through,
):
    """A round of b-bit deltas goes through S shards when S * b >= 64 (their f32 means into
    the controller weigh half the star's coded frames or less); the lineage's first round
    (f32) always does, and the others, through the shards or not, give every rank the
    star's bits. Through them, every params round's mean was summed by a shard (auto:
    the shards are fixed at window 0's Control round; with three relays, three shards)."""
    hosts = [[0, 1], [2, 3]] if shards == 2 else THREE_HOSTS
    codec = DeltaCodec.parse(codec)
    seen, cluster = await _run(hosts, codec, shards)
    assert_holds_the_oracles(seen, hosts, oracle(hosts, codec))
    assert cluster.controller.stats.delta_rounds_sharded == (WINDOWS if through else 1)
    assert cluster.controller.stats.shards_lost == 0


async def test_the_controllers_outer_step_on_delta_rounds_through_the_shards_is_the_stars():
    """DiLoCo's outer step on a delta run: the controller steps the shards' means, and
    every rank gets the bits a controller without shards gives; the relays' links to the
    controller carry lane 0s and marks, not the coded pieces."""
    codec = DeltaCodec.parse("int8:256")
    star, star_cluster = await _run(THREE_HOSTS, codec, 0, outer_optimizer=DiLoCoNesterov())
    sharded, cluster = await _run(THREE_HOSTS, codec, SHARDS, outer_optimizer=DiLoCoNesterov())
    assert cluster.controller.stats.delta_rounds_sharded == WINDOWS
    # The relays sent the controller lane 0s and marks only: the pieces went to the shards.
    assert cluster.controller.stats.bytes_in < star_cluster.controller.stats.bytes_in / 5
    assert sharded.keys() == star.keys()
    for key, tensors in star.items():
        assert all(np.array_equal(a, b) for a, b in zip(sharded[key], tensors)), key


def _stall_shard_1(monkeypatch, method: str, window: int) -> trio.Event:
    """Shard 1 does ``method`` (``_sum_lane``: a lane's mean to the controller;
    ``_fan_out``: a consensus lane to the relays) for one lane of ``window``'s delta
    round, then never again, as a shard that dies mid-round; the event is set then."""
    from flodl_trio.shard import core as shard_core

    original = getattr(shard_core._Shard, method)
    stalled = trio.Event()
    seen: dict[int, int] = {}  # delta decision -> its lanes shard 1 did

    async def stalling(self, msg, lane: int, *more) -> None:
        if self.index == 1 and is_delta_schema(msg.schema):
            seen.setdefault(msg.decision, 0)
            if len(seen) == window + 1 and seen[msg.decision] == 1:
                stalled.set()
                await trio.sleep_forever()
            seen[msg.decision] += 1
        await original(self, msg, lane, *more)

    monkeypatch.setattr(shard_core._Shard, method, stalling)
    return stalled


@pytest.mark.parametrize("method", ["_sum_lane", "_fan_out"], ids=["before-its-means", "after-its-means"])
async def test_a_shard_lost_mid_delta_round_leaves_every_window_exact(monkeypatch, method):
    """Shard 1 of 8 sends the controller one lane's mean of window 3's round and stalls
    (the controller still lacks means: it decides again, and the new owner sums them), or
    it stalls after fanning one consensus lane out (the controller has stepped the round:
    it decides again with the same hosts, and sends the new owner the same lanes, never
    stepping the round twice). It is closed; every window holds the oracle's bits."""
    codec = DeltaCodec.parse("int8:256")
    stalled = _stall_shard_1(monkeypatch, method, window=3)

    async def lose_shard_1(cluster) -> None:
        await stalled.wait()
        cluster.close_shard(1)

    seen, cluster = await _run(THREE_HOSTS, codec, SHARDS, meanwhile=lose_shard_1)
    assert_holds_the_oracles(seen, THREE_HOSTS, oracle(THREE_HOSTS, codec))
    stats = cluster.controller.stats
    assert (stats.shards_lost, stats.decisions_again, stats.delta_rounds_sharded) == (1, 1, WINDOWS)


def _consensus_lane(layout, index: int, numel_off: int = 0):
    """Lane ``index`` of a delta round's layout as the controller would send it (zero codes;
    ``numel_off`` elements more than the layout says)."""
    from flodl_trio.wire import RoundFrame, TensorPayload
    from flodl_trio.wire.round_frame import RoundKind

    tensors = []
    for p in layout.lanes[index]:
        dtype = layout.schema[p.tensor][0]
        codec = DeltaCodec.of_tag(dtype)
        numel = p.numel + numel_off
        tensors.append(TensorPayload(dtype, (numel,), bytearray(codec.payload_bytes(numel) if codec else 16)))
    return RoundFrame([*tensors, *layout.trailer(index)], RoundKind.MODEL, 1.0)


@pytest.mark.parametrize(("fault", "named"), [
    ("lane-0", "consensus lane LaneTag(index=0"),
    ("twice", "(or sent it twice)"),
    ("wrong-length", "the controller's consensus lane of decision 0: lane 1"),
    ("stepped", "steps a delta round: the controller steps those"),
    ("unasked", "sent a BROADCAST record where a control message was due"),
])
async def test_a_controller_that_sends_a_shard_a_consensus_lane_it_cannot_fan_out_ends_it_naming_why(
    salt, fault, named,
):
    """A delta decision's consensus lane that is lane 0, comes twice, is not the layout's,
    or comes with no delta decision; or a Decide that steps a delta round: the shard ends,
    naming what was wrong (a protocol error of its controller)."""
    from flodl_trio import FlodlError
    from flodl_trio.shard import open_shard
    from flodl_trio.testing import hold_open
    from flodl_trio.transport.hashing import encode_enveloped_frame
    from flodl_trio.wire.constants import CHANNEL_MAGIC_SHARD
    from flodl_trio.wire.lanes import LaneLayout
    from flodl_trio.wire.mux import Decide, MuxKind, ShardOuter, ShardSetup, encode_control_record
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST

    schema = [(DeltaCodec.parse("int8:256").tag, (2048,)), (DTYPE_BASE_DIGEST, (DIGEST_LEN,))]
    layout = LaneLayout.for_schema(schema, 3, lane0_empty=True)
    decide = Decide(0, 0, 3, schema, [0], [0], step=fault == "stepped")
    lanes = {"lane-0": [_consensus_lane(layout, 0)], "twice": [_consensus_lane(layout, 1)] * 2,
             "wrong-length": [_consensus_lane(layout, 1, numel_off=256)], "stepped": [], "unasked": []}[fault]
    records = [bytes(encode_control_record(m, salt)) for m in [ShardSetup(0, 1, 30_000), ShardOuter(2, 0.7, 0.9)]]
    if fault == "unasked":
        records.append(b"".join((await encode_enveloped_frame(MuxKind.BROADCAST, _consensus_lane(layout, 1),
                                                                salt)).chunks))
    else:
        records.append(bytes(encode_control_record(decide, salt)))
    for lane in lanes:
        records.append(b"".join(bytes(c) for c in (await encode_enveloped_frame(MuxKind.BROADCAST, lane, salt)).chunks))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard("127.0.0.1", 0, salt=salt))
            stream = await trio.open_tcp_stream("127.0.0.1", shard.port)
            await stream.send_all(CHANNEL_MAGIC_SHARD.to_bytes(4, "little") + b"".join(records))
            with pytest.raises(FlodlError, match=re.escape(named)):
                await shard.outcome.wait()
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_a_shard_that_sends_the_controller_a_mean_of_another_shape_costs_only_itself(monkeypatch):
    """Shard 1 sends the controller one lane's mean of window 2 one element short: the
    controller loses that shard (its lanes go to the next live one), decides the round
    again, and every rank still holds the oracle's bits."""
    from flodl_trio.shard import core as shard_core
    from flodl_trio.wire import RoundFrame, TensorPayload

    sum_lane, finish = shard_core._Shard._sum_lane, shard_core.finish_consensus
    rounds: set[int] = set()
    cutting = [False]

    async def cut_sum(self, msg, lane: int) -> None:
        if self.index == 1 and is_delta_schema(msg.schema):
            rounds.add(msg.round)
            cutting[0] = len(rounds) == 3  # window 2's round
        try:
            await sum_lane(self, msg, lane)
        finally:
            cutting[0] = False

    def short(acc):
        mean = finish(acc)
        if not cutting[0]:
            return mean
        first = mean.tensors[0]
        n = first.numel - 1
        data = np.frombuffer(first.data, np.float32)[:n].copy() if first.nbytes else b""
        return RoundFrame([TensorPayload(first.dtype, (n,), data), *mean.tensors[1:]], mean.kind, mean.weight)

    monkeypatch.setattr(shard_core._Shard, "_sum_lane", cut_sum)
    monkeypatch.setattr(shard_core, "finish_consensus", short)
    codec = DeltaCodec.parse("int8:256")
    seen, cluster = await _run(THREE_HOSTS, codec, SHARDS)
    assert_holds_the_oracles(seen, THREE_HOSTS, oracle(THREE_HOSTS, codec))
    assert (cluster.controller.stats.shards_lost, cluster.controller.stats.decisions_again) == (1, 1)
