"""The outer step on the shards: each shard steps the lanes it reduces, with their state.

The oracle is a controller without shards (the star) given the same contributions in
deterministic mode: the ranks must get its bytes, window after window, f32 and bf16,
whole model and fragments. A lost shard's lanes start their state again at the new
owner: that window they are the plain average (docs/wire.md, "The outer step on the
shards").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, connect_reduce_client
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire import RoundFrame, TensorPayload
from flodl_trio.wire.constants import DTYPE_F32
from flodl_trio.wire.lanes import LaneLayout, lane_owner

HOSTS, WORLD, LANES = [[0, 1], [2], [3]], 4, 5
SIZES = {0: 20_000, 1: 15_001}  # a fragment's tensor (fragment p of 2 syncs tensor p)


def _control(window: int, fragments: bool) -> list[torch.Tensor]:
    """A window's Control round: a step count and, fragmented, the tag and the model's shapes."""
    tensors = [torch.tensor([float(window)])]
    if fragments:
        tensors += [torch.empty((0, 2, window % 2)), *(torch.empty((0, n)) for n in SIZES.values())]
    return tensors


def _params(rank: int, window: int, fragments: bool) -> list[torch.Tensor]:
    rng = np.random.default_rng(1000 * window + rank)
    numels = [SIZES[window % 2]] if fragments else list(SIZES.values())
    return [torch.from_numpy((rng.standard_normal(n) + window).astype(np.float32)) for n in numels]


async def _windows(
    salt, shards: int, make_outer: Callable[[], object], windows: int, *, bf16: bool = False, fragments: bool = False,
    lose_shard_after: int | None = None,
) -> tuple[dict[tuple[int, int], list[bytes]], object, object]:
    """``windows`` windows of every rank (a Control round, then a weighted params round);
    per (rank, window) the params consensus's tensors as bytes. ``lose_shard_after``:
    shard 1 is closed once every rank has that window's consensus."""
    got: dict[tuple[int, int], list[bytes]] = {}
    outer = make_outer()
    with trio.fail_after(60):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt, lanes=LANES, lane_min_bytes=0,
                                      deterministic=True, shards=shards, outer_optimizer=outer) as cluster:
            done = [trio.Event() for _ in range(WORLD)]
            lost = trio.Event()

            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, cluster.salt) as client:
                    client.bf16_wire = bf16
                    for window in range(windows):
                        await client.all_reduce_weighted(_control(window, fragments), RoundKind.CONTROL, 1.0)
                        out = await client.all_reduce_weighted(_params(rank, window, fragments), RoundKind.MODEL,
                                                               float(rank + 1))
                        got[rank, window] = [t.numpy().tobytes() for t in out[0]]
                        if window == lose_shard_after:
                            done[rank].set()
                            await lost.wait()

            async def lose_shard_1() -> None:
                for event in done:
                    await event.wait()
                cluster.close_shard(1)
                lost.set()

            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(rank_main, rank)
                if lose_shard_after is not None:
                    nursery.start_soon(lose_shard_1)
    return got, cluster, outer


@pytest.mark.parametrize("make_outer", [DiLoCoNesterov, lambda: SlowMo(lr=0.8, momentum=0.6)],
                         ids=["diloco", "slowmo"])
@pytest.mark.parametrize(("bf16", "fragments"), [(False, False), (True, False), (False, True)],
                         ids=["f32", "bf16", "fragments"])
async def test_shards_step_their_lanes_to_the_bytes_of_a_controller_without_shards(salt, make_outer, bf16, fragments):
    """Five windows through 3 shards: every rank gets, every window, the bytes a
    deterministic controller without shards sends (its own outer step on every lane),
    and the shards did the stepping (the controller holds no outer state)."""
    sharded, cluster, outer = await _windows(salt, 3, make_outer, 5, bf16=bf16, fragments=fragments)
    star, _, _ = await _windows(salt, 0, make_outer, 5, bf16=bf16, fragments=fragments)
    assert sharded == star
    assert all(sharded[rank, w] == sharded[0, w] for rank in range(WORLD) for w in range(5))
    # The steps moved the params away from the plain average (a real outer step ran).
    assert sharded[0, 4] != (await _windows(salt, 3, lambda: SlowMo(lr=1.0, momentum=0.0), 5, bf16=bf16,
                                            fragments=fragments))[0][0, 4]
    assert [h.rounds for h in cluster.shards] == [10, 10, 10]
    assert sorted(outer.state_dict()) == ["windows"]  # the controller's optimizer held no lane


async def test_a_lost_shards_lanes_start_their_state_again_at_the_new_owner(salt):
    """Shard 1 of 2 closes after window 2: in window 3 the lanes it stepped are the plain
    weighted average (their new owner starts their state), the others still the
    controller's step; from window 4 on every lane is stepped again."""
    lost_after, windows = 2, 5
    sharded, cluster, _ = await _windows(salt, 2, DiLoCoNesterov, windows, lose_shard_after=lost_after)
    star, _, _ = await _windows(salt, 0, DiLoCoNesterov, windows)
    assert cluster.controller.stats.shards_lost == 1
    frame = RoundFrame([TensorPayload(DTYPE_F32, (n,)) for n in SIZES.values()], RoundKind.MODEL)
    layout = LaneLayout.through_shards(frame, LANES, 2)  # (the cluster's lane_min_bytes is 0)
    moved = [np.zeros(n, dtype=bool) for n in SIZES.values()]  # the elements shard 1 stepped
    for lane in range(1, layout.count):
        if lane_owner(lane, 2, set()) == 1:
            for piece in layout.lanes[lane]:
                moved[piece.tensor][piece.start:piece.stop] = True
    mass = sum(rank + 1 for rank in range(WORLD))  # (the consensus: the frames' sum over the accepted mass)
    for window in range(windows):
        for t, mask in enumerate(moved):
            got = np.frombuffer(sharded[0, window][t], dtype=np.float32)
            want = np.frombuffer(star[0, window][t], dtype=np.float32)
            np.testing.assert_array_equal(got[~mask], want[~mask])  # shard 0's own lanes: its state throughout
            if window <= lost_after:
                np.testing.assert_array_equal(got[mask], want[mask])
            elif window == lost_after + 1:
                average = sum(_params(rank, window, False)[t].numpy() for rank in range(WORLD)) / mass
                np.testing.assert_allclose(got[mask], average[mask], rtol=1e-5, atol=1e-5)
                assert not np.allclose(want[mask], average[mask], rtol=1e-3)  # the star stepped them
            else:  # stepped again, from the state window 3 started
                average = sum(_params(rank, window, False)[t].numpy() for rank in range(WORLD)) / mass
                assert not np.allclose(got[mask], average[mask], rtol=1e-3)


@pytest.mark.parametrize(("records", "named"), [
    ("decide", "steps its lanes, and no ShardOuter said how"),
    ("bad-lr", "ShardOuter: lr must be finite and > 0"),
    ("twice", "the controller sent a shard ShardOuter"),
], ids=["step-without-outer", "bad-lr", "outer-twice"])
async def test_a_controller_that_asks_a_shard_to_step_wrongly_ends_that_shard_naming_why(salt, records, named):
    """A stepping Decide with no ShardOuter before it, a ShardOuter with an lr no optimizer
    takes, or a second ShardOuter: the shard ends, naming what was wrong."""
    from flodl_trio import FlodlError
    from flodl_trio.shard import open_shard
    from flodl_trio.testing import hold_open
    from flodl_trio.wire.constants import CHANNEL_MAGIC_SHARD
    from flodl_trio.wire.mux import Decide, ShardOuter, ShardSetup, encode_control_record

    msgs = {"decide": [Decide(0, 0, 3, [(DTYPE_F32, (10,))], [0], [0], step=True)],
            "bad-lr": [ShardOuter(2, float("nan"), 0.9)],
            "twice": [ShardOuter(2, 0.7, 0.9), ShardOuter(1, 0.7, 0.9)]}[records]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard("127.0.0.1", 0, salt=salt))
            stream = await trio.open_tcp_stream("127.0.0.1", shard.port)
            await stream.send_all(CHANNEL_MAGIC_SHARD.to_bytes(4, "little") + b"".join(
                bytes(encode_control_record(m, salt)) for m in [ShardSetup(0, 1, 30_000), *msgs]))
            with pytest.raises(FlodlError, match=named):
                await shard.outcome.wait()
            await stream.aclose()
            nursery.cancel_scope.cancel()
