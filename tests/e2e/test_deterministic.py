"""Deterministic mode: the same contributions give the same consensus bytes whatever
order they arrive in, and those bytes are a numpy sum taken in the canonical order
(ranks in rank order within a host, hosts by their lowest rank, one division).

Real sockets; arrival orders are permuted with per-rank start delays.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, average_window
from flodl_trio.relay import HostFold
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire import DTYPE_BF16, RoundFrame, SessionSalt, TensorPayload
from flodl_trio.wire.bf16 import bf16_to_f32, encode_f32_as

SALT = SessionSalt(b"deterministic-16")
HOSTS = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
WORLD = 9
NUMEL = 4099
ORDERS = 4
ahead: list[int] = []  # per round run: HostFrames and consensus computed while the last frame arrived


def contribution(rank: int, numel: int = NUMEL) -> np.ndarray:
    """Values spanning many orders of magnitude: f32 addition order shows in the bits."""
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal(numel) * 10.0 ** rng.integers(-6, 7, numel)).astype(np.float32)


def weight_of(rank: int) -> float:
    return 0.1 * (rank + 1)


def on_wire(values: np.ndarray, bf16: bool) -> np.ndarray:
    """What a frame carries, back as f32 (bf16 rounds to nearest even, as the codec does)."""
    return bf16_to_f32(encode_f32_as(values, DTYPE_BF16)) if bf16 else values


def reference(ranks: list[int], kind: RoundKind, bf16: bool, numel: int = NUMEL) -> tuple[bytes, float]:
    """The consensus in the canonical order, computed with numpy alone."""
    host_sums, host_weights = [], []
    for host in HOSTS:
        members = [r for r in host if r in ranks]
        if not members:
            continue
        acc, weight = on_wire(contribution(members[0], numel), bf16).copy(), 0.0
        for r in members:
            if r != members[0]:
                acc = acc + on_wire(contribution(r, numel), bf16)
            weight += weight_of(r)
        host_sums.append(on_wire(acc, bf16))
        host_weights.append(weight)
    acc, weight = host_sums[0].copy(), 0.0
    for host_sum in host_sums[1:]:
        acc = acc + host_sum
    for w in host_weights:
        weight += w
    if kind == RoundKind.MODEL:
        acc = acc * np.float32(1.0 / weight)
    return on_wire(acc, bf16).tobytes(), weight


async def one_round(
    delays: dict[int, float], kind: RoundKind, bf16: bool, dead: set[int], numel: int = NUMEL,
    lanes: int | None = None,
) -> tuple[set[bytes], float]:
    """Every live rank sends its contribution after its delay; the consensus bytes each received."""
    got: dict[int, tuple[bytes, float]] = {}
    async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, deterministic=True, lanes=lanes) as cluster:

        async def rank_main(rank: int, client) -> None:
            if rank in dead:
                await client.aclose()  # gone before the round
                return
            client.bf16_wire = bf16
            await trio.sleep(delays[rank])
            tensor = torch.from_numpy(contribution(rank, numel))
            out, mass = await client.all_reduce_weighted([tensor], kind, weight_of(rank))
            got[rank] = (out[0].numpy().tobytes(), mass)

        await cluster.run_ranks(rank_main)
        ahead.append(cluster.controller.stats.rounds_finished_ahead + sum(r.stats.rounds_finished_ahead for r in cluster.relays))
    masses = {mass for _, mass in got.values()}
    assert len(masses) == 1
    return {data for data, _ in got.values()}, masses.pop()


@pytest.mark.trio
@pytest.mark.deadline(120)
@pytest.mark.parametrize(
    ("kind", "bf16"),
    [(RoundKind.MODEL, False), (RoundKind.MODEL, True), (RoundKind.CONTROL, False)],  # bf16 is for Model rounds
    ids=["model-f32", "model-bf16", "control-f32"],
)
@pytest.mark.parametrize("dead", [set(), {4}], ids=["everyone", "rank-4-dead"])
async def test_every_arrival_order_gives_the_canonical_consensus_bytes(kind, bf16, dead):
    want, want_mass = reference([r for r in range(WORLD) if r not in dead], kind, bf16)
    seen = set()
    for order in range(ORDERS):
        rng = np.random.default_rng(order)
        delays = dict(zip(rng.permutation(WORLD).tolist(), np.linspace(0.0, 0.08, WORLD).tolist()))
        results, mass = await one_round(delays, kind, bf16, dead)
        assert results == {want}, f"arrival order {order}: another consensus than the canonical sum"
        assert mass == pytest.approx(want_mass, rel=0, abs=0)
        seen.add(hashlib.sha256(want).hexdigest()[:12])
    assert len(seen) == 1


@pytest.mark.trio
@pytest.mark.deadline(120)
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("lanes", [1, None], ids=["whole", "default-lanes"])
async def test_large_frames_folded_while_they_arrive_keep_the_canonical_order(bf16, lanes):
    """Frames above 64 KiB take the paths that finish a round while its last frame
    arrives (relay and controller, whole frames): the last one is still added last.
    In the default lanes (4 of them here) every lane keeps the canonical order too."""
    numel = 300_000  # 1.2 MB per rank
    want, _ = reference(list(range(WORLD)), RoundKind.MODEL, bf16, numel)
    for order in range(2):
        rng = np.random.default_rng(10 + order)
        delays = dict(zip(rng.permutation(WORLD).tolist(), np.linspace(0.0, 0.2, WORLD).tolist()))
        results, _mass = await one_round(delays, RoundKind.MODEL, bf16, set(), numel, lanes)
        assert results == {want}, f"arrival order {order}"
        if lanes == 1:
            assert ahead[-1] > 0, "the finishing-ahead paths were not taken: the test would not cover them"


@pytest.mark.trio
@pytest.mark.deadline(120)
async def test_two_runs_of_the_same_training_end_bit_identical():
    """2 hosts x 2 ranks, 20 Local SGD windows, the same data but other timings."""

    async def training(timing_seed: int) -> list[bytes]:
        timing = np.random.default_rng(timing_seed)
        delays = timing.uniform(0.0, 0.01, (20, 4))
        finals: dict[int, bytes] = {}
        async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=SALT, deterministic=True, lanes=1) as cluster:

            async def rank_main(rank: int, client) -> None:
                gen = torch.Generator().manual_seed(rank)
                params = [torch.zeros(257), torch.zeros(3, 5)]
                buffers = [torch.zeros(7)]
                for window in range(20):
                    await trio.sleep(float(delays[window, rank]))
                    with torch.no_grad():
                        for p in params:
                            p.add_(torch.randn(p.shape, generator=gen) * 10.0 ** (rank - 2))
                        buffers[0].add_(float(rank) / 3.0)
                    await average_window(client, params, buffers, 1 + (rank + window) % 3, rank=rank, world_size=4,
                                         in_place=True)
                finals[rank] = b"".join(t.numpy().tobytes() for t in params + buffers)

            await cluster.run_ranks(rank_main)
        assert len(set(finals.values())) == 1
        return [finals[0]]

    assert await training(1) == await training(2)


def test_host_fold_in_deterministic_order_waits_for_the_lowest_rank_the_round_needs():
    fold = HostFold("h0", [0, 1, 2])
    frame = RoundFrame([TensorPayload(0, (1,), np.ones(1, "<f4"))], RoundKind.MODEL, 1.0)
    assert fold.may_fold_now(0) and not fold.may_fold_now(1) and not fold.may_fold_now(2)
    fold.deposit(0, frame)
    assert fold.may_fold_now(1) and not fold.may_fold_now(2)
    assert fold.may_fold_now(0)  # already in: its second frame must reach deposit (a desync)
    fold.mark_dead(1)
    assert fold.may_fold_now(2)  # a dead rank is not waited for
