"""Delta rounds end to end (docs/wire.md, "Delta rounds"): ranks send coded deltas
against their base, relays fold and re-encode with error feedback (or forward a
single rank's bytes), the controller adds the mean delta to its exact consensus
and sends the result back as a delta against the base every rank holds.

The oracle is numpy and the codec primitives alone (wire.quant's encode and
decode, tested on their own): it replays every hop's arithmetic, so every
rank's params must equal it bit for bit, window after window. Real sockets and
a real controller and relays in one trio run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.errors import FlodlError
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.quant import F32, DeltaCodec, base_digest, decode, encode
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"delta-rounds-slt")
SHAPES = [(3001,), (7, 5)]  # a tensor that ends in a part block, and a small one
WINDOWS = 6
DEADLINE_S = 60


def steps_of(rank: int, window: int) -> int:
    return 1 + (rank + window) % 3


def initial(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng([7, rank])
    return [rng.standard_normal(int(np.prod(s))).astype(F32) for s in SHAPES]


def change(rank: int, window: int) -> list[np.ndarray]:
    """What rank's inner steps add to its params in ``window`` (heavy-tailed, like real deltas)."""
    rng = np.random.default_rng([rank, window])
    return [(rng.standard_t(3, int(np.prod(s))) * 1e-2).astype(F32) for s in SHAPES]


class Coder:
    """One hop's error-feedback encoder, as the oracle replays it."""

    def __init__(self, codec: DeltaCodec, feedback: bool = True) -> None:
        self.codec = codec
        self.feedback = feedback
        self.residual = [np.zeros(int(np.prod(s)), F32) for s in SHAPES]

    def encode(self, values: list[np.ndarray]) -> list[bytearray]:
        out = []
        for value, residual in zip(values, self.residual):
            payload = bytearray(self.codec.payload_bytes(value.size))
            if self.feedback:
                encode(np.add(value, residual, dtype=F32), payload, self.codec.code, self.codec.block, residual=residual)
            else:
                encode(value, payload, self.codec.code, self.codec.block)
            out.append(payload)
        return out


def decoded_sum(payloads: list[list[bytearray]], codec: DeltaCodec) -> list[np.ndarray]:
    sums = [np.empty(int(np.prod(s)), F32) for s in SHAPES]
    for k, payload in enumerate(payloads):
        for total, data in zip(sums, payload):
            decode(data, codec.code, codec.block, total.size, total, add=k > 0)
    return sums


def oracle(hosts: list[list[int]], codec: DeltaCodec, rank_feedback: bool = True) -> list[list[np.ndarray]]:
    """Every window's params, as every rank must hold them after it (``rank_feedback``:
    whether the ranks' uplinks keep what their code dropped; the relays always do)."""
    ranks = [r for host in hosts for r in host]
    uplinks = {r: Coder(codec, rank_feedback) for r in ranks}
    relays = [Coder(codec) for _ in hosts]
    # Window 0 starts the lineage in f32: the weighted mean of the ranks' first params.
    params = {r: [p + c for p, c in zip(initial(r), change(r, 0))] for r in ranks}
    weights = {r: np.float32(steps_of(r, 0)) for r in ranks}
    host_sums = []
    for host in hosts:
        scaled = [[np.multiply(p, weights[r], dtype=F32) for p in params[r]] for r in host]
        host_sums.append([scaled[0][i] if len(host) == 1 else np.add(scaled[0][i], scaled[1][i]) for i in range(len(SHAPES))])
    mass = float(sum(steps_of(r, 0) for r in ranks))
    totals = [host_sums[0][i] for i in range(len(SHAPES))]
    for more in host_sums[1:]:  # in host order
        totals = [np.add(t, m) for t, m in zip(totals, more)]
    x = [np.multiply(t, np.float32(1.0 / mass)) for t in totals]
    base = [a.copy() for a in x]
    history = [[b.copy() for b in base]]
    for window in range(1, WINDOWS):
        host_payloads = []
        for h, host in enumerate(hosts):
            coded = []
            for r in host:
                w = np.float32(steps_of(r, window))
                mine = [np.add(b, c) for b, c in zip(base, change(r, window))]
                coded.append(uplinks[r].encode([np.multiply(np.subtract(m, b), w) for m, b in zip(mine, base)]))
            host_payloads.append(coded[0] if len(host) == 1 else relays[h].encode(decoded_sum(coded, codec)))
        mass = float(sum(steps_of(r, window) for r in ranks))
        mean = [np.multiply(s, np.float32(1.0 / mass)) for s in decoded_sum(host_payloads, codec)]
        x = [np.add(a, m, dtype=F32) for a, m in zip(x, mean)]
        for a, b in zip(x, base):
            payload = bytearray(codec.payload_bytes(a.size))
            encode(np.subtract(a, b), payload, codec.code, codec.block)
            decode(payload, codec.code, codec.block, b.size, b, add=True)
        history.append([b.copy() for b in base])
    return history


def model(rank: int) -> list[torch.Tensor]:
    return [torch.from_numpy(p.copy()).view(s) for p, s in zip(initial(rank), SHAPES)]


async def train(
    client, rank: int, world: int, params: list[torch.Tensor], windows: range,
    seen: dict[tuple[int, int], list[np.ndarray]],
) -> None:
    """Each window: the rank's change, then ``average_window``; what the rank then holds."""
    for window in windows:
        with torch.no_grad():
            for p, c in zip(params, change(rank, window)):
                p.view(-1).add_(torch.from_numpy(c))
        await average_window(client, params, [], steps_of(rank, window), rank=rank, world_size=world, in_place=True)
        seen[rank, window] = [p.detach().reshape(-1).numpy().copy() for p in params]


async def run_cluster(
    hosts: list[list[int]], codec: DeltaCodec, local_leg: bool, error_feedback: bool = True, lanes: int = 1,
    **options: object,
) -> dict[tuple[int, int], list[np.ndarray]]:
    world = sum(len(h) for h in hosts)
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
            client.delta_codec = codec
            client.delta_error_feedback = error_feedback
            await train(client, rank, world, model(rank), range(WINDOWS), seen)

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=world, hosts=hosts, salt=SALT, local_leg=local_leg, lanes=lanes, lane_min_bytes=0, **options,
        ) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
    return seen


def assert_holds_the_oracles(
    seen: dict[tuple[int, int], list[np.ndarray]], hosts: list[list[int]], want: list[list[np.ndarray]],
) -> None:
    for window in range(WINDOWS):
        for rank in (r for host in hosts for r in host):
            for index, (got, expected) in enumerate(zip(seen[rank, window], want[window])):
                assert np.array_equal(got, expected), f"window {window} rank {rank} tensor {index}"


@pytest.mark.parametrize("codec", ["int8:1024", "fp4:256", "int4:512"])
@pytest.mark.parametrize(
    ("hosts", "local_leg"), [([[0, 1], [2, 3]], True), ([[0], [1, 2]], False)], ids=["2x2-local-leg", "1+2-tcp"]
)
@pytest.mark.trio
async def test_every_rank_holds_the_oracles_params_bit_for_bit(hosts, local_leg, codec):
    codec = DeltaCodec.parse(codec)
    assert_holds_the_oracles(await run_cluster(hosts, codec, local_leg), hosts, oracle(hosts, codec))


@pytest.mark.parametrize("lanes", [2, 5])
@pytest.mark.parametrize("codec", ["int8:1024", "fp4:256"])
@pytest.mark.parametrize(
    ("hosts", "local_leg"), [([[0, 1], [2, 3]], True), ([[0], [1, 2]], False)], ids=["2x2-local-leg", "1+2-tcp"]
)
@pytest.mark.trio
async def test_in_lanes_every_rank_holds_the_same_oracles_params_bit_for_bit(hosts, local_leg, codec, lanes):
    """Cut into lanes (coded tensors on block boundaries, some lanes empty at 5), a
    delta round gives every rank the bits it gives without lanes: each piece is
    coded as the whole tensor's coding codes those blocks."""
    codec = DeltaCodec.parse(codec)
    assert_holds_the_oracles(await run_cluster(hosts, codec, local_leg, lanes=lanes), hosts, oracle(hosts, codec))


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.trio
async def test_deterministic_mode_sums_three_hosts_in_host_order_bit_for_bit(lanes):
    """With three contributors f32 addition order matters: deterministic mode folds the
    hosts in host order, so every rank holds the oracle's ((h0 + h1) + h2), with or
    without lanes."""
    hosts, codec = [[0], [1], [2]], DeltaCodec.parse("int8:256")
    seen = await run_cluster(hosts, codec, False, lanes=lanes, deterministic=True)
    assert_holds_the_oracles(seen, hosts, oracle(hosts, codec))


@pytest.mark.trio
async def test_diloco_and_the_checkpoint_sink_see_the_same_rounds_in_lanes_as_without(tmp_path):
    """With DiLoCo on the controller and a checkpoint sink, 1 lane and 3 lanes give every
    rank the same bits and the sink the same exact consensus (f32 params, no codes,
    no digest), window after window."""
    from flodl_trio import DiLoCoNesterov

    codec = DeltaCodec.parse("int8:256")
    runs = []
    for lanes in (1, 3):
        sunk: list[tuple[int, list[np.ndarray]]] = []

        def sink(index: int, frame, sunk=sunk) -> None:
            if frame.kind.name == "MODEL":
                sunk.append((index, [np.frombuffer(t.data, F32).copy() for t in frame.tensors]))

        seen = await run_cluster([[0, 1], [2, 3]], codec, True, lanes=lanes,
                                 outer_optimizer=DiLoCoNesterov(0.7, 0.9), checkpoint=sink)
        runs.append((seen, sunk))
    (seen1, sunk1), (seen3, sunk3) = runs
    assert seen1.keys() == seen3.keys()
    for key in seen1:
        for a, b in zip(seen1[key], seen3[key]):
            assert np.array_equal(a, b), key
    assert [i for i, _ in sunk1] == [i for i, _ in sunk3] and len(sunk1) == WINDOWS
    for (_, a), (_, b) in zip(sunk1, sunk3):
        assert [t.shape for t in a] == [(int(np.prod(s)),) for s in SHAPES]
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.trio
async def test_ranks_without_error_feedback_drop_what_their_code_cannot_carry():
    """``delta_error_feedback = False``: each rank's window is coded on its own (what the
    code drops is gone); the relays keep theirs. Bit for bit the no-feedback oracle,
    and not the feedback one (the flag changes the run)."""
    hosts, codec = [[0, 1], [2, 3]], DeltaCodec.parse("fp4:256")
    seen = await run_cluster(hosts, codec, True, error_feedback=False)
    assert_holds_the_oracles(seen, hosts, oracle(hosts, codec, rank_feedback=False))
    with_feedback = oracle(hosts, codec)
    assert not np.array_equal(seen[0, WINDOWS - 1][0], with_feedback[WINDOWS - 1][0])


def test_the_oracles_delta_run_tracks_the_f32_run():
    """Not a tautology: the coded run's consensus stays near the f32 Local SGD one's, a
    small fraction of how far the run moves, and the gap does not grow (error
    feedback on every hop). Measured: int8 at most 1.3% of the move, fp4 8%."""
    for name, fraction in (("int8:1024", 0.02), ("fp4:256", 0.12)):
        history = oracle([[0, 1], [2, 3]], DeltaCodec.parse(name))
        consensus: list[np.ndarray] | None = None
        gaps = []
        for window in range(WINDOWS):
            mass = sum(steps_of(r, window) for r in range(4))
            start = {r: initial(r) if consensus is None else consensus for r in range(4)}
            consensus = [
                sum(np.float64(steps_of(r, window)) * (start[r][i] + change(r, window)[i]) for r in range(4)) / mass
                for i in range(len(SHAPES))
            ]
            gaps.append(max(float(np.max(np.abs(h - c))) for h, c in zip(history[window], consensus)))
        moved = max(float(np.max(np.abs(last - first))) for last, first in zip(history[-1], history[0]))
        assert max(gaps) < fraction * moved, (name, gaps, moved)
        assert max(gaps[WINDOWS // 2:]) <= 1.5 * max(gaps[: WINDOWS // 2]), (name, gaps)


@pytest.mark.trio
async def test_a_rank_whose_base_differs_is_dropped_alone_with_a_clear_error(caplog):
    """Rank 1's base is knocked off by one ulp before window 3: its delta is against a
    base the relay never handed out. Rank 1 alone is dropped; the others train on."""
    codec = DeltaCodec.parse("int8")
    hosts, world = [[0, 1], [2, 3]], 4
    errors: dict[int, BaseException] = {}
    finished: set[int] = set()
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        params = model(rank)
        try:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
                client.delta_codec = codec
                await train(client, rank, world, params, range(3), seen)
                if rank == 1:
                    state = client.delta_state()  # as if it had started from other params
                    # First its own check of the last consensus (hashed in a thread) ends, on the
                    # base as it was: the base changed under it, the rank itself would raise first.
                    state.verify()
                    state.base[0][0] = np.nextafter(state.base[0][0], np.float32(np.inf))
                    state.digest = base_digest(state.base)
                await train(client, rank, world, params, range(3, WINDOWS), seen)
                finished.add(rank)
        except FlodlError as exc:
            errors[rank] = exc

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=world, hosts=hosts, salt=SALT) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
    assert finished == {0, 2, 3}, (finished, errors)
    assert set(errors) == {1}
    assert "rank 1's delta is against base" in caplog.text and "missed a consensus" in caplog.text


async def run_with_a_return(hosts: list[list[int]], lanes: int, survivor, comes_back, **options: object) -> None:
    """Ranks 0 and 2 survive, rank 1 crashes and comes back (the roles get the cluster);
    the controller must count exactly one rejoin."""
    world = sum(len(h) for h in hosts)
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=world, hosts=hosts, salt=SALT, rejoin_timeout=60, local_leg=False, lanes=lanes,
            lane_min_bytes=0, **options,
        ) as cluster:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor, cluster, 0)
                nursery.start_soon(survivor, cluster, 2)
                nursery.start_soon(comes_back, cluster)
            assert cluster.controller.stats.rejoins == 1
            if options.get("shards"):  # (the delta rounds went through them, not only the f32 first)
                assert cluster.controller.stats.delta_rounds_sharded > 2


@pytest.mark.parametrize(("outer", "lanes", "shards"), [(None, 1, 0), ("diloco", 1, 0), ("diloco", 3, 0), ("diloco", 3, 16)],
                         ids=["average", "diloco", "diloco-lanes", "diloco-shards"])
@pytest.mark.trio
async def test_a_rank_that_comes_back_starts_from_the_base_and_trains_on_in_step(outer, lanes, shards):
    """Rank 1 crashes after window 2 and comes back (its codec set before join()): it is
    given the base every rank holds, in f32, so its next delta is against that base
    and the consensus it then takes matches the controller's digest. Every rank
    holds the same bits after every window, with and without DiLoCo's outer step
    on the controller, and with the rounds through shards (the controller holds the
    base and the catch-up frames as without them)."""
    from flodl_trio import DiLoCoNesterov
    from flodl_trio.testing import fetch_status

    codec = DeltaCodec.parse("fp4")
    hosts, world, total = [[0, 1], [2]], 3, 9
    seen: dict[tuple[int, int], list[np.ndarray]] = {}
    options: dict[str, object] = {} if outer is None else {"outer_optimizer": DiLoCoNesterov(0.7, 0.9)}
    if shards:
        options["shards"] = shards

    async def survivor(cluster, rank: int) -> None:
        params = model(rank)
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
            client.delta_codec = codec
            await client.join(params)
            await train(client, rank, world, params, range(0, 5), seen)
            # Rank 1 has its state (it enters at the next boundary) or entered already.
            while not back.is_set() and 1 not in (await fetch_status(cluster.controller_address))["primed"]:
                await trio.sleep(0.02)
            await train(client, rank, world, params, range(5, total), seen)

    async def comes_back(cluster) -> None:
        params = model(1)
        async with connect_reduce_client(cluster.relay_address(1), 1, world, SALT) as client:
            client.delta_codec = codec
            await client.join(params)
            await train(client, 1, world, params, range(0, 3), seen)
            await client.aclose()  # a crash: it may come back
        params = model(1)  # restarted: its own params are gone
        async with connect_reduce_client(cluster.relay_address(1), 1, world, SALT) as client:
            client.delta_codec = codec
            start = await client.join(params)
            back.set()
            joined[0] = start
            state = client.last_state
            assert len(state.catch_up) == start - 1 - state.window and not state.behind  # windows since its state
            seen[1, start - 1] = [p.detach().reshape(-1).numpy().copy() for p in params]  # what join() loaded
            await train(client, 1, world, params, range(start, total), seen)

    joined, back = [-1], trio.Event()
    await run_with_a_return(hosts, lanes, survivor, comes_back, **options)
    assert 3 <= joined[0] < total  # after its crash; how soon depends on how fast its state went out
    for window in range(total):
        holders = [r for r in range(world) if (r, window) in seen]
        for rank in holders:
            for got, want in zip(seen[rank, window], seen[0, window]):
                assert np.array_equal(got, want), (window, rank)


async def train_fragments(
    client, rank: int, world: int, params: list[torch.Tensor], fragments: int, windows: range,
    seen: dict[tuple[int, int], list[np.ndarray]],
) -> None:
    """Each window: the rank's change, then ``average_window`` of fragment ``window %
    fragments``; what the rank then holds of that fragment (the others are each
    rank's own until they sync)."""
    from flodl_trio.client.tensors import fragment_pieces
    from flodl_trio.wire.fragment import FragmentTag

    pieces = fragment_pieces(params, fragments)
    shapes = tuple(tuple(p.shape) for p in params)
    for window in windows:
        with torch.no_grad():
            for p, c in zip(params, change(rank, window)):
                p.view(-1).add_(torch.from_numpy(c))
        tag = FragmentTag(window % fragments, fragments, shapes)
        await average_window(client, pieces[window % fragments], [], steps_of(rank, window), rank=rank,
                             world_size=world, in_place=True, fragment=tag)
        seen[rank, window] = [p.detach().numpy().copy() for p in pieces[window % fragments]]


async def run_fragments(
    codec: DeltaCodec | None, fragments: int, lanes: int, **options: object,
) -> dict[tuple[int, int], list[np.ndarray]]:
    """2 hosts x 2 ranks; window ``w`` syncs fragment ``w % fragments`` (run ``w % fragments``
    of every tensor's elements), each fragment its own delta lineage. What each rank
    holds of the fragment each window synced, after it."""
    hosts, world = [[0, 1], [2, 3]], 4
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
            client.delta_codec = codec
            await train_fragments(client, rank, world, model(rank), fragments, range(2 * WINDOWS), seen)

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=world, hosts=hosts, salt=SALT, lanes=lanes, lane_min_bytes=0,
                                      **options) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
    return seen


@pytest.mark.parametrize("fragments", [2, 3])
@pytest.mark.trio
async def test_fragments_each_carry_a_lineage_of_their_own_in_lanes_or_not(fragments):
    """Streamed windows with coded deltas: every rank holds the same bits after every
    window, 3 lanes give the bits 1 lane gives, and the run tracks the same run in
    f32 (a fraction of how far the params move), fragment lineages interleaved."""
    codec = DeltaCodec.parse("int8:256")
    whole = await run_fragments(codec, fragments, 1)
    laned = await run_fragments(codec, fragments, 3)
    plain = await run_fragments(None, fragments, 1)
    for (rank, window), params in whole.items():
        for index, (a, b, c) in enumerate(zip(params, laned[rank, window], whole[0, window])):
            assert np.array_equal(a, b) and np.array_equal(a, c), (rank, window, index)
    for window in range(fragments, 2 * WINDOWS):  # each fragment's lineage past its f32 start
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[0, window], plain[0, window % fragments]))
        gap = max(float(np.max(np.abs(a - b))) for a, b in zip(whole[0, window], plain[0, window]))
        assert gap < 0.05 * moved, (window, gap, moved)


@pytest.mark.trio
async def test_fragments_with_diloco_step_each_fragment_from_its_own_exact_consensus():
    """DiLoCo on the controller keeps its state per fragment; with coded deltas each
    fragment's outer step takes that fragment's exact consensus: identical bits on
    every rank, with 1 lane, with 3, and with 3 through sixteen shards."""
    from flodl_trio import DiLoCoNesterov

    codec = DeltaCodec.parse("fp4:256")
    runs = [await run_fragments(codec, 2, lanes, outer_optimizer=DiLoCoNesterov(0.7, 0.9)) for lanes in (1, 3)]
    runs.append(await run_fragments(codec, 2, 3, shards=16, outer_optimizer=DiLoCoNesterov(0.7, 0.9)))  # (16 x 4)
    for key, params in runs[0].items():
        for a, b, s, c in zip(params, runs[1][key], runs[2][key], runs[0][0, key[1]]):
            assert np.array_equal(a, b) and np.array_equal(a, s) and np.array_equal(a, c), key


@pytest.mark.parametrize(("lanes", "shards"), [(1, 0), (3, 0), (3, 8)], ids=["whole", "lanes", "shards"])
@pytest.mark.trio
async def test_a_rank_that_comes_back_to_a_fragmented_run_takes_each_fragments_base(lanes, shards):
    """With 2 fragments a returning rank is given each fragment's base (and the coded
    consensus frames since its state, each applied to the fragment its window synced):
    its next delta of either fragment is against the base the others hold, so every
    rank holds the same bits of each fragment after its sync."""
    from flodl_trio import DiLoCoNesterov
    from flodl_trio.testing import fetch_status

    codec, fragments = DeltaCodec.parse("int8:256"), 2
    hosts, world, total = [[0, 1], [2]], 3, 10
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def windows(client, rank: int, params: list[torch.Tensor], span: range) -> None:
        await train_fragments(client, rank, world, params, fragments, span, seen)

    async def survivor(cluster, rank: int) -> None:
        params = model(rank)
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
            client.delta_codec = codec
            await client.join(params)
            await windows(client, rank, params, range(0, 5))
            while not back.is_set() and 1 not in (await fetch_status(cluster.controller_address))["primed"]:
                await trio.sleep(0.02)
            await windows(client, rank, params, range(5, total))

    async def comes_back(cluster) -> None:
        params = model(1)
        async with connect_reduce_client(cluster.relay_address(1), 1, world, SALT) as client:
            client.delta_codec = codec
            await client.join(params)
            await windows(client, 1, params, range(0, 3))
            await client.aclose()  # a crash: it may come back
        params = model(1)
        async with connect_reduce_client(cluster.relay_address(1), 1, world, SALT) as client:
            client.delta_codec = codec
            start = await client.join(params)
            back.set()
            joined[0] = start
            await windows(client, 1, params, range(start, total))

    joined, back = [-1], trio.Event()
    await run_with_a_return(hosts, lanes, survivor, comes_back, outer_optimizer=DiLoCoNesterov(0.7, 0.9),
                            **({"shards": shards} if shards else {}))
    assert 3 <= joined[0] < total
    for window in range(joined[0], total):  # its windows after it came back: the same bits as rank 0's
        for got, want in zip(seen[1, window], seen[0, window]):
            assert np.array_equal(got, want), window


async def train_after_idle_windows(
    client, rank: int, world: int, params: list[torch.Tensor], windows: range, idle: int,
    seen: dict[tuple[int, int], list[np.ndarray]],
) -> None:
    """Windows before ``idle`` carry no work (no change, step count 0); window ``idle + k``
    is the oracle's window ``k``."""
    for window in windows:
        if window >= idle:
            with torch.no_grad():
                for p, c in zip(params, change(rank, window - idle)):
                    p.view(-1).add_(torch.from_numpy(c))
        steps = steps_of(rank, window - idle) if window >= idle else 0
        await average_window(client, params, [], steps, rank=rank, world_size=world, in_place=True)
        seen[rank, window] = [p.detach().reshape(-1).numpy().copy() for p in params]


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.trio
async def test_a_first_window_with_no_work_leaves_every_rank_its_params_and_the_next_starts_the_lineage(lanes):
    """A lineage's first round carries ``weight x params`` in f32: with no work anywhere
    its sums are zeros, no one's params. The ranks keep their own (as after any
    zero-mass round), hold no base, and the first window with work starts the
    lineage: from there the run is a fresh run's, bit for bit."""
    hosts, idle = [[0, 1], [2]], 2
    codec = DeltaCodec.parse("int8")
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, 3, SALT) as client:
            client.delta_codec = codec
            await train_after_idle_windows(client, rank, 3, model(rank), range(idle + WINDOWS), idle, seen)

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=3, hosts=hosts, salt=SALT, lanes=lanes, lane_min_bytes=0) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(3):
                    nursery.start_soon(rank_main, rank)
    for window in range(idle):
        for rank in range(3):
            assert all(np.array_equal(got, want) for got, want in zip(seen[rank, window], initial(rank))), (rank, window)
    want = oracle(hosts, codec)
    for window in range(WINDOWS):
        for rank in range(3):
            for index, (got, expected) in enumerate(zip(seen[rank, idle + window], want[window])):
                assert np.array_equal(got, expected), f"window {idle + window} rank {rank} tensor {index}"


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.trio
async def test_ranks_returning_before_any_window_had_work_keep_their_params_and_start_the_lineage(lanes):
    """Every rank dies after two windows with no work: the state a returning rank is
    given is no one's params (the lineage never started), so join leaves its own, it
    holds no base, and the returned ranks start the lineage and train on in step (a
    base taken from its own params would be refused as another lineage's)."""
    codec = DeltaCodec.parse("int8")
    loaded: dict[int, bool] = {}
    finals: dict[int, list[bytes]] = {}
    seen: dict[tuple[int, int], list[np.ndarray]] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, lanes=lanes, lane_min_bytes=0,
                                      rejoin_timeout=60) as cluster:

            async def life(rank: int, first: bool) -> None:
                params = model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    client.delta_codec = codec
                    start = await client.join(params, [])
                    if first:
                        await train_after_idle_windows(client, rank, 2, params, range(2), 2, seen)
                        await client.aclose()  # every rank crashes before any window had work
                        return
                    if not client.last_state.catch_up:  # (one that entered later was sent the windows since)
                        loaded[rank] = all(np.array_equal(p.reshape(-1).numpy(), w) for p, w in zip(params, initial(rank)))
                    await train_after_idle_windows(client, rank, 2, params, range(start, 6), 2, seen)
                    finals[rank] = [p.numpy().tobytes() for p in params]

            for first in (True, False):
                async with trio.open_nursery() as nursery:
                    for rank in (0, 1):
                        nursery.start_soon(life, rank, first)
            assert cluster.controller.stats.rejoins == 2
    assert loaded and all(loaded.values())
    assert finals[0] == finals[1]


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("codec", ["int8", "fp4"])
@pytest.mark.trio
async def test_a_window_with_no_work_leaves_the_exact_consensus_where_it_was(codec, lanes):
    """A round with zero accepted mass is not divided. Ranks and relays that did no work
    send a zero delta and keep what their codes dropped for a window with work: had
    they sent it, the controller's exact consensus ``x`` would have moved by the
    undivided, mass-weighted residuals (with fp4 and 20 steps a window, by far more
    than a window of training moves it). Every rank still takes the consensus."""
    from flodl_trio.fold.outer import consensus_as_f32
    from flodl_trio.wire import RoundKind

    hosts, world, idle = [[0, 1], [2]], 3, 2
    xs: list[tuple[float, list[np.ndarray]]] = []
    finals: dict[int, list[bytes]] = {}

    def sink(_round: int, frame) -> None:  # a delta round's params: the controller's x
        if frame.kind == RoundKind.MODEL:
            xs.append((frame.weight, consensus_as_f32(frame, copy=True)))

    async def rank_main(rank: int) -> None:
        params = model(rank)
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
            client.delta_codec = DeltaCodec.parse(codec)
            for window in range(4):
                steps = 0 if window == idle else 20
                if steps:
                    with torch.no_grad():
                        for p, c in zip(params, change(rank, window)):
                            p.view(-1).add_(torch.from_numpy(c * 10))
                await average_window(client, params, [], steps, rank=rank, world_size=world, in_place=True)
        finals[rank] = [p.numpy().tobytes() for p in params]

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=world, hosts=hosts, salt=SALT, lanes=lanes, lane_min_bytes=0,
                                      checkpoint=sink) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
    assert [w for w, _ in xs] == [60.0, 60.0, 0.0, 60.0]
    (_, before), (_, after) = xs[idle - 1], xs[idle]
    assert all(np.array_equal(a, b) for a, b in zip(after, before))
    assert finals[0] == finals[1] == finals[2]


@pytest.mark.trio
async def test_a_rank_back_with_another_fragment_count_than_its_delta_runs_is_told_which_rank_and_why():
    """Every rank of a delta run synced in 2 fragments dies; they come back syncing 4.
    Each fragment's base is the old layout's, so the first delta cannot be made:
    the SchemaError names the rank and the fragment, and says what differs."""
    from flodl_trio.errors import SchemaError
    from flodl_trio.train.trainer import open_window_trainer

    shapes = [(12,), (8, 4)]
    errors: dict[int, str] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:

            async def life(rank: int, fragments: int) -> None:
                params = [torch.full(s, 1.0 + rank) for s in shapes]
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    client.delta_codec = DeltaCodec.parse("int8")
                    start = await client.join(params, [])

                    def step() -> None:
                        for p in params:
                            p.add_(0.25 * (rank + 1))

                    try:
                        async with open_window_trainer(client, params, rank=rank, world_size=2, sync_every=4,
                                                       fragments=fragments, start_window=start) as trainer:
                            await trainer.run_steps(8, step)
                    except SchemaError as exc:
                        errors[rank] = str(exc)
                    await client.aclose()

            for fragments in (2, 4):
                async with trio.open_nursery() as nursery:
                    for rank in (0, 1):
                        nursery.start_soon(life, rank, fragments)
    assert sorted(errors) == [0, 1]
    for rank, message in errors.items():
        assert message.startswith(f"rank {rank}, fragment "), message
        assert "another fragment count" in message and "[3, 8]" in message, message


@pytest.mark.trio
async def test_a_fragmented_run_whose_every_rank_died_before_each_fragment_synced_starts_anew():
    """Two fragments: fragment 0 syncs in window 0 (its lineage gets a base), then every
    rank dies before fragment 1 ever synced. The controller holds no whole state, so the
    returns start the run again at window 0 from their own params: their first rounds
    (f32, the zero digest) start the lineages anew, at the controller and at the relay,
    rather than be refused as against the old base."""
    codec = DeltaCodec.parse("int8")
    seen: dict[bool, dict[tuple[int, int], list[np.ndarray]]] = {True: {}, False: {}}  # by life
    starts: dict[int, int] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:

            async def life(rank: int, first: bool) -> None:
                params = model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    client.delta_codec = codec
                    start = await client.join(params)
                    if not first:
                        starts[rank] = start
                    await train_fragments(client, rank, 2, params, 2, range(start, 1 if first else 4), seen[first])
                    if first:
                        await client.aclose()  # every rank crashes after window 0

            for first in (True, False):
                async with trio.open_nursery() as nursery:
                    for rank in (0, 1):
                        nursery.start_soon(life, rank, first)
            assert cluster.controller.stats.rejoins >= 1
    assert min(starts.values()) == 0  # the first back starts the run again
    for life in seen.values():
        for window in range(4):
            holders = [rank for rank in (0, 1) if (rank, window) in life]
            for rank in holders:
                for got, want in zip(life[rank, window], life[holders[0], window]):
                    assert np.array_equal(got, want), (window, rank)
