"""The window loop with the round overlapped: the merge rule, by hand and through real roles.

The inner steps here add fixed dyadic amounts and the masses make every
average a division by a power of two, so every value is exact in f32: the
final params do not depend on when, during the next window, a consensus
landed, and the numpy reference below (the outer optimizers' formulas
written out again) must match to the bit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import trio

from flodl_trio import ConfigError, connect_reduce_client
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo
from flodl_trio.testing import open_local_cluster
from flodl_trio.train.schedule import WindowSchedule, merge_late_consensus
from flodl_trio.train.trainer import open_window_trainer

WORLD, SYNC_EVERY, WINDOWS = 2, 2, 4  # 2 ranks x mass 2: every average divides by 4
LR, MOMENTUM = 0.5, 0.5


def start_params(rank: int) -> np.ndarray:
    return np.array([rank, 2 * rank, -rank, 0.5], dtype=np.float32)


def step_size(rank: int) -> np.float32:
    return np.float32(0.25 * (rank + 1))


def test_merge_rule_by_hand():
    live = [torch.tensor([1.5, -2.0, 8.0])]  # boundary + two local steps of +0.25
    boundary = [torch.tensor([1.0, -2.5, 7.5])]
    consensus = [torch.tensor([3.0, 0.0, 2.0])]
    merge_late_consensus(live, boundary, consensus)
    # live + (consensus - boundary): the local progress since the boundary, on top of the consensus
    assert live[0].tolist() == [3.5, 0.5, 2.5]
    assert boundary[0].tolist() == [2.0, 2.5, -5.5]  # the correction, computed in place
    # Not moved since the boundary: exactly the consensus (x + (c - x) can round away from c).
    x, c = torch.tensor([0.1, 1e8]), torch.tensor([0.3, 3.0])
    assert (x + (c - x)).tolist() != c.tolist()
    merge_late_consensus([x], [x.clone()], [c], moved=False)
    assert torch.equal(x, c)


@pytest.mark.parametrize("make", [lambda: SlowMo(lr=0.8, momentum=0.5), lambda: DiLoCoNesterov(0.7, 0.9)],
                         ids=["slowmo", "diloco"])
def test_the_mirror_recovers_the_controllers_outer_state(make):
    """Fed only the controller's outputs, the mirror predicts its next output: its stand-in
    for the true average is the controller's step, window after window."""
    from flodl_trio.fold.outer import consensus_as_f32
    from flodl_trio.train.mirror import OuterMirror
    from flodl_trio.wire import DTYPE_F32, RoundFrame, TensorPayload

    controller, mirror = make(), OuterMirror.of(make())
    assert mirror is not None
    rng = np.random.default_rng(7)
    point = rng.standard_normal(64).astype(np.float32)
    for window in range(8):
        average = point - 0.05 * rng.standard_normal(64).astype(np.float32)  # the ranks' progress
        frame = RoundFrame([TensorPayload(DTYPE_F32, (64,), average.copy())], weight=4.0)
        out = consensus_as_f32(controller(frame), copy=True)[0]
        predicted = [torch.zeros(64)]
        if mirror.stand_in([torch.from_numpy(average)], predicted):
            np.testing.assert_allclose(predicted[0].numpy(), out, rtol=2e-5, atol=2e-6, err_msg=f"window {window}")
        else:
            assert window == 0  # before the first consensus the mirror knows nothing
        mirror.follow([torch.from_numpy(out)])
        point = out


def reference(outer: str) -> np.ndarray:
    """What every rank holds at the end: windows of local steps, the realized-work
    average at each boundary, the controller's outer step, and the merge
    ``params += consensus - boundary`` (here after the window's steps, which is
    the same bits: everything is exact)."""
    theta = {r: start_params(r) for r in range(WORLD)}
    x = m = None
    for _window in range(WINDOWS):
        for r in theta:
            for _ in range(SYNC_EVERY):
                theta[r] = theta[r] + step_size(r)
        boundary = {r: theta[r].copy() for r in theta}
        avg = sum(np.float32(SYNC_EVERY) * boundary[r] for r in theta) * np.float32(1 / (SYNC_EVERY * WORLD))
        if outer == "none" or x is None:
            new = avg
            if outer != "none":
                x, m = avg.copy(), np.zeros_like(avg)
        elif outer == "slowmo":  # m = b m + (x - c); x -= lr m
            m = np.float32(MOMENTUM) * m + (x - avg)
            x = x - np.float32(LR) * m
            new = x.copy()
        else:  # diloco: g = x - c; m = b m + g; x -= lr (g + b m)
            g = x - avg
            m = np.float32(MOMENTUM) * m + g
            x = x - np.float32(LR) * (g + np.float32(MOMENTUM) * m)
            new = x.copy()
        for r in theta:
            theta[r] = theta[r] + (new - boundary[r])
    assert np.array_equal(theta[0], theta[1])
    return theta[0]


OUTERS = {"none": None, "slowmo": lambda: SlowMo(lr=LR, momentum=MOMENTUM), "diloco": lambda: DiLoCoNesterov(LR, MOMENTUM)}


@pytest.mark.parametrize("overlap", [0, 1])
@pytest.mark.parametrize("outer", sorted(OUTERS))
async def test_overlapped_windows_match_the_hand_computation(salt, outer, overlap):
    options = {} if OUTERS[outer] is None else {"outer_optimizer": OUTERS[outer]()}
    final: dict[int, np.ndarray] = {}
    merged_late: dict[int, bool] = {}
    async with open_local_cluster(world_size=WORLD, hosts=[[0], [1]], salt=salt, **options) as cluster:

        async def rank_main(rank: int) -> None:
            # A model's parameter (requires grad), written in place as an optimizer would.
            params = [torch.nn.Parameter(torch.from_numpy(start_params(rank).copy()))]
            async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, salt) as client:
                async with open_window_trainer(
                    client, params, rank=rank, world_size=WORLD, sync_every=SYNC_EVERY, overlap=overlap,
                    outer=None if OUTERS[outer] is None else OUTERS[outer](),  # the rank's mirror of it
                ) as trainer:

                    def inner_step() -> None:
                        time.sleep(0.005)  # accelerator time: a round in flight moves meanwhile
                        with torch.no_grad():
                            params[0].add_(float(step_size(rank)))

                    await trainer.run_steps(SYNC_EVERY * WINDOWS, inner_step)
                    # With overlap, the last window's round is still out: finish() brings it in.
                    merged_late[rank] = trainer.stats.windows < WINDOWS
                assert trainer.stats.windows == WINDOWS and trainer.stats.steps == SYNC_EVERY * WINDOWS
                assert trainer.stats.last_counts == [float(SYNC_EVERY)] * WORLD
            final[rank] = params[0].detach().numpy().copy()

        async with trio.open_nursery() as nursery:
            for rank in range(WORLD):
                nursery.start_soon(rank_main, rank)
    want = reference(outer)
    for rank in range(WORLD):
        if outer == "diloco" and overlap:  # the stand-in's recovered momentum divides by 1.5: rounding
            np.testing.assert_allclose(final[rank], want, rtol=1e-6, atol=1e-6)
        else:
            assert np.array_equal(final[rank], want), (rank, final[rank], want)
    assert all(merged_late.values()) == (overlap == 1)


async def test_a_consensus_that_lands_mid_window_keeps_the_steps_taken_meanwhile(salt):
    """Rank 0 takes a step of the next window while window 0's round is still out
    (rank 1 holds it up): the merge keeps that step (plain replacement would lose it)."""
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        late = trio.Event()
        got: dict[int, list[float]] = {}

        async def rank_main(rank: int) -> None:
            params = [torch.zeros(3)]
            async with connect_reduce_client(cluster.relay_address(rank), rank, 2, salt) as client:
                async with open_window_trainer(client, params, rank=rank, world_size=2, sync_every=2, overlap=1) as trainer:
                    for _ in range(2):  # window 0: rank 0 ends at 2, rank 1 at 4 -> consensus 3
                        params[0].add_(1.0 * (rank + 1))
                        await trainer.after_step()
                    if rank == 0:
                        params[0].add_(10.0)  # a step of window 1 while window 0 is in flight
                        await trainer.after_step()
                        assert trainer.stats.windows == 0  # not landed: this task has not let it
                        late.set()
                    else:
                        await late.wait()
                    await trainer.finish()
                    got[rank] = params[0].tolist()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank_main, 0)
            nursery.start_soon(rank_main, 1)
    assert got == {0: [13.0] * 3, 1: [3.0] * 3}


async def test_bad_settings_are_refused_before_any_round(salt):
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            for bad, match in (({"sync_every": 0}, "sync_every must be >= 1"), ({"sync_every": 2, "overlap": 2}, "overlap must be 0")):
                with pytest.raises(ConfigError, match=match):
                    async with open_window_trainer(client, [torch.zeros(1)], rank=0, world_size=1, **bad):
                        pass


async def test_the_blocking_facade_drives_the_same_loop(salt):
    """A plain-Python trainer: inner steps in its own thread, the overlapped rounds on
    the client's helper thread; the result is the hand computation's."""
    from tests.train.test_blocking import run_rank_threads

    from flodl_trio.train.blocking import BlockingReduceClient

    final: dict[int, np.ndarray] = {}
    waited: dict[int, float] = {}
    errors: list[BaseException] = []
    async with open_local_cluster(world_size=WORLD, hosts=[[0], [1]], salt=salt) as cluster:

        def rank_thread(rank: int) -> None:
            try:
                params = [torch.from_numpy(start_params(rank).copy())]
                with BlockingReduceClient(cluster.relay_address(rank), rank, WORLD, salt) as client:
                    trainer = client.window_trainer(params, sync_every=SYNC_EVERY, overlap=1)
                    for _ in range(SYNC_EVERY * WINDOWS):
                        time.sleep(0.005)  # the inner step
                        params[0].add_(float(step_size(rank)))
                        trainer.step()
                    trainer.finish()
                    assert trainer.stats.windows == WINDOWS
                    waited[rank] = trainer.stats.waited_s
                final[rank] = params[0].numpy().copy()
            except BaseException as exc:
                errors.append(exc)

        await run_rank_threads(rank_thread, range(WORLD), 20)
    assert not errors, errors
    want = reference("none")
    assert all(np.array_equal(final[r], want) for r in range(WORLD)), (final, want)
    assert all(w >= 0 for w in waited.values())


async def test_a_fixed_merge_point_makes_overlapped_training_reproducible(salt):
    """merge_after=2: every consensus is merged after exactly 2 steps of the next window,
    whenever it landed; with the cluster's deterministic mode two runs end bit-identical
    (the updates are not exact in f32, and the ranks start at staggered times)."""

    async def run() -> tuple[dict[int, np.ndarray], dict[int, list[int]]]:
        final: dict[int, np.ndarray] = {}
        late: dict[int, list[int]] = {}
        async with open_local_cluster(
            world_size=3, hosts=[[0, 1], [2]], salt=salt, deterministic=True, outer_optimizer=DiLoCoNesterov(0.7, 0.9)
        ) as cluster:

            async def rank_main(rank: int) -> None:
                await trio.sleep(0.01 * ((rank * 7) % 3))
                gen = torch.Generator().manual_seed(rank)
                params = [torch.nn.Parameter(torch.zeros(257))]
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                    async with open_window_trainer(
                        client, params, rank=rank, world_size=3, sync_every=4, overlap=1, merge_after=2,
                        outer=DiLoCoNesterov(0.7, 0.9),
                    ) as trainer:

                        def inner_step() -> None:
                            time.sleep(0.002)
                            with torch.no_grad():
                                params[0].add_(torch.randn(257, generator=gen) * 0.1)

                        await trainer.run_steps(4 * 5, inner_step)
                final[rank] = params[0].detach().numpy().copy()
                late[rank] = trainer.stats.late_steps

            async with trio.open_nursery() as nursery:
                for rank in range(3):
                    nursery.start_soon(rank_main, rank)
        return final, late

    first, late = await run()
    second, _ = await run()
    assert all(steps == [2, 2, 2, 2, 0] for steps in late.values()), late  # the last one merges at finish()
    for rank in range(3):
        assert first[rank].tobytes() == second[rank].tobytes(), f"rank {rank} differs between the runs"
    assert first[0].tobytes() == first[1].tobytes() == first[2].tobytes()


async def test_merge_by_merges_a_round_when_it_lands_and_waits_for_one_at_the_deadline(salt):
    """merge_by=3: a consensus that lands early is merged at once (after fewer than 3
    steps); one that rank 1 holds up is waited for at exactly step 3 of the next
    window, never later. Both ranks end on the last consensus."""
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        at_deadline = trio.Event()
        late: dict[int, list[int]] = {}
        final: dict[int, list[float]] = {}
        waited: dict[int, float] = {}

        async def rank_main(rank: int) -> None:
            params = [torch.zeros(3)]
            async with connect_reduce_client(cluster.relay_address(rank), rank, 2, salt) as client:
                async with open_window_trainer(client, params, rank=rank, world_size=2, sync_every=4, overlap=1,
                                               merge_by=3) as trainer:
                    for step in range(1, 17):
                        await trio.sleep(0.03)  # the inner step
                        params[0].add_(float(rank + 1))
                        if rank == 1 and step == 8:
                            await at_deadline.wait()  # window 1's round cannot land before rank 0 is there
                        if rank == 0 and step == 11:
                            at_deadline.set()  # step 3 of window 2: rank 0 now waits for window 1's consensus
                        await trainer.after_step()
                late[rank], waited[rank] = trainer.stats.late_steps, trainer.stats.waited_s
                final[rank] = params[0].tolist()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank_main, 0)
            nursery.start_soon(rank_main, 1)
    assert late[0][1] == 3 and waited[0] > 0, late  # held up: merged at the deadline, waited for
    # Landed early (rank 1 sends last, so its rounds land right after its boundary): merged at once.
    assert late[0][0] < 3 and all(steps < 3 for steps in late[1][:3]), late
    assert all(steps <= 3 for steps in late[0]) and late[0][3] == 0 and late[1][3] == 0, late  # the last at finish()
    assert final[0] == final[1]


async def test_merge_after_and_merge_by_are_checked():
    with pytest.raises(ConfigError, match="merge_by must be None .* or 1..4 steps"):
        WindowSchedule(sync_every=4, overlap=1, merge_by=5)
    with pytest.raises(ConfigError, match="give merge_after .* or merge_by .*, not both"):
        WindowSchedule(sync_every=4, overlap=1, merge_after=2, merge_by=3)
    assert WindowSchedule(sync_every=4, overlap=1, merge_by=3).merge_deadline == 3
    assert WindowSchedule(sync_every=4, overlap=1, merge_after=2).merge_deadline == 2
    assert WindowSchedule(sync_every=4, overlap=1).merge_deadline is None


async def test_merge_after_is_checked(salt):
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            with pytest.raises(ConfigError, match="merge_after must be None"):
                async with open_window_trainer(client, [torch.zeros(1)], rank=0, world_size=1, sync_every=4,
                                               overlap=1, merge_after=5):
                    pass


@pytest.mark.parametrize("overlap", [0, 1])
async def test_an_outer_that_is_not_an_outer_optimizer_is_refused_whatever_the_overlap(salt, overlap):
    """``outer`` names the controller's optimizer; a string (say) is a ConfigError when the
    trainer opens, with overlap 0 too (it was accepted there, and ignored)."""
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            with pytest.raises(ConfigError, match="outer must be None, PlainAverage, SlowMo or DiLoCoNesterov"):
                async with open_window_trainer(
                    client, [torch.zeros(2)], rank=0, world_size=1, sync_every=2, overlap=overlap, outer="diloco",
                ):
                    pass
            assert client.rounds == 0
