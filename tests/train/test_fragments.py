"""Streamed windows: the params synced in staggered fragments, through real roles.

Every inner step adds a fixed dyadic amount and every mass divides to a power
of two, so the averages are exact in f32 and the numpy reference below (the
schedule and the outer optimizers written out again, per fragment) must
match; the controller's consensus of each fragment is recorded by a
checkpoint sink and compared with the reference's, round by round.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import trio

from flodl_trio import ConfigError, FlodlError, connect_reduce_client
from flodl_trio.client.tensors import fragment_pieces
from flodl_trio.controller.checkpointer import ConsensusCheckpointer
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo, consensus_as_f32
from flodl_trio.testing import open_local_cluster
from flodl_trio.train.checkpoint import restore_module
from flodl_trio.train.schedule import WindowSchedule
from flodl_trio.train.trainer import open_window_trainer
from flodl_trio.wire import DTYPE_F32, RoundFrame, RoundKind, TensorPayload
from flodl_trio.wire.checkpoint import latest_checkpoint, load_checkpoint
from flodl_trio.wire.fragment import FragmentTag, fragment_of, piece_range
from flodl_trio.wire.round_frame import decode_round_frame, encode_round_frame

WORLD, SYNC_EVERY, WINDOWS, FRAGMENTS = 2, 4, 3, 2
SHAPES = [(3,), (5,), (2, 2), (4,)]  # fragment 0: elements [0:1], [0:2], [0:2], [0:2]; fragment 1 the rest
LR, MOMENTUM = 0.5, 0.5
OUTERS = {"none": None, "slowmo": lambda: SlowMo(lr=LR, momentum=MOMENTUM), "diloco": lambda: DiLoCoNesterov(LR, MOMENTUM)}


def start_params(rank: int) -> list[np.ndarray]:
    return [np.full(shape, rank + 0.5 * i, dtype=np.float32) for i, shape in enumerate(SHAPES)]


def step_size(rank: int) -> np.float32:
    return np.float32(0.25 * (rank + 1))


# -- the pieces ---------------------------------------------------------------


def test_a_fragment_is_a_run_of_every_tensors_elements_viewed_in_place():
    params = [torch.arange(float(np.prod(s))).reshape(s) for s in SHAPES]
    pieces = fragment_pieces(params, 2)
    assert [[tuple(t.shape) for t in run] for run in pieces] == [[(1,), (2,), (2,), (2,)], [(2,), (3,), (2,), (2,)]]
    assert [piece_range(5, 2, p) for p in range(2)] == [(0, 2), (2, 5)]
    pieces[1][2].fill_(-1.0)  # a view: the parameter itself changes
    assert params[2].tolist() == [[0.0, 1.0], [-1.0, -1.0]]
    assert [len(run) for run in fragment_pieces([torch.zeros(3)], 3)] == [1, 1, 1]
    with pytest.raises(ConfigError, match="fragments=4 needs at least that many parameter elements, the model has 3"):
        fragment_pieces([torch.zeros(3)], 4)
    with pytest.raises(ConfigError, match="parameter 0 .* is not"):
        fragment_pieces([torch.zeros(4, 3).t()], 2)


def test_the_schedule_staggers_the_fragments():
    schedule = WindowSchedule(sync_every=20, fragments=4)
    assert [schedule.first_sync(p) for p in range(4)] == [5, 10, 15, 20]
    assert schedule.sync_gap == 5
    with pytest.raises(ConfigError, match="fragments must be 1..sync_every=3"):
        WindowSchedule(sync_every=3, fragments=4)
    with pytest.raises(ConfigError, match="at most 256"):
        WindowSchedule(sync_every=1000, fragments=257)
    with pytest.raises(ConfigError, match="merge_after must be None .* or 1..5 steps"):
        WindowSchedule(sync_every=20, overlap=1, fragments=4, merge_after=6)


def test_the_fragment_tag_is_an_empty_tensor_whose_shape_names_the_fragment(salt):
    counts = TensorPayload(DTYPE_F32, (3,), np.array([4, 4, 0], dtype="<f4"))
    frame = RoundFrame([counts, FragmentTag(1, 4).payload()], RoundKind.CONTROL, 0.0)
    data = bytes(encode_round_frame(frame, salt))
    # dtype f32, 3 dims [0, 4, 1], 0 payload bytes: 1 + 1 + 12 + 8 bytes after the counts tensor
    tail = data[17 + 2 + 4 + 8 + 12:-8]
    assert tail == bytes([0, 3]) + (0).to_bytes(4, "little") + (4).to_bytes(4, "little") + (1).to_bytes(4, "little") \
        + (0).to_bytes(8, "little")
    decoded = decode_round_frame(data, salt)
    assert fragment_of(decoded) == FragmentTag(1, 4)
    assert fragment_of(RoundFrame([counts], RoundKind.CONTROL, 0.0)) is None  # an unfragmented window
    assert fragment_of(RoundFrame([counts, FragmentTag(1, 4).payload()], RoundKind.MODEL, 1.0)) is None
    bogus = TensorPayload(DTYPE_F32, (0, 4, 4), np.zeros(0, dtype="<f4"))  # index out of range
    assert fragment_of(RoundFrame([counts, bogus], RoundKind.CONTROL, 0.0)) is None
    with pytest.raises(ConfigError, match="fragment tag"):
        FragmentTag(2, 2)


# -- the reference ------------------------------------------------------------


def reference(outer: str, windows: int = WINDOWS) -> tuple[dict[int, list[np.ndarray]], list[tuple[int, list[np.ndarray]]]]:
    """Every rank's final params, and each sync's (fragment, consensus) in order."""
    runs = [[piece_range(int(np.prod(s)), FRAGMENTS, f) for s in SHAPES] for f in range(FRAGMENTS)]
    schedule = WindowSchedule(SYNC_EVERY, fragments=FRAGMENTS)
    theta = {r: start_params(r) for r in range(WORLD)}
    state: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    since = [0] * FRAGMENTS
    syncs: list[tuple[int, list[np.ndarray]]] = []
    for _step in range(SYNC_EVERY * windows):
        for r in theta:
            theta[r] = [t + step_size(r) for t in theta[r]]
        since = [s + 1 for s in since]
        for f, run in enumerate(runs):
            due = schedule.first_sync(f) if len([s for s in syncs if s[0] == f]) == 0 else SYNC_EVERY
            if since[f] < due:
                continue
            mass = np.float32(since[f])
            since[f] = 0
            avg = [sum(mass * theta[r][i].reshape(-1)[a:b] for r in theta) / (mass * WORLD)
                   for i, (a, b) in enumerate(run)]
            if outer == "none" or f not in state:
                new = avg
                if outer != "none":
                    state[f] = ([a.copy() for a in avg], [np.zeros_like(a) for a in avg])
            else:
                x, m = state[f]
                new = []
                for j, c in enumerate(avg):
                    if outer == "slowmo":
                        m[j] = np.float32(MOMENTUM) * m[j] + (x[j] - c)
                        x[j] = x[j] - np.float32(LR) * m[j]
                    else:
                        g = x[j] - c
                        m[j] = np.float32(MOMENTUM) * m[j] + g
                        x[j] = x[j] - np.float32(LR) * (g + np.float32(MOMENTUM) * m[j])
                    new.append(x[j].copy())
            syncs.append((f, new))
            for r in theta:
                for i, (a, b) in enumerate(run):
                    theta[r][i].reshape(-1)[a:b] = new[i]
    return theta, syncs


def whole(newest: dict[int, list[np.ndarray]]) -> list[np.ndarray]:
    """The model's tensors from every fragment's pieces (fragment f holds run f of each)."""
    return [np.concatenate([newest[f][i] for f in range(FRAGMENTS)]).reshape(s) for i, s in enumerate(SHAPES)]


def second_half(tensors: list[np.ndarray]) -> list[np.ndarray]:
    """Fragment 1's elements of every tensor (the last fragment: synced at the final step)."""
    return [t.reshape(-1)[piece_range(t.size, FRAGMENTS, 1)[0]:] for t in tensors]


class Recorder:
    """A checkpoint sink that keeps each fragment window's params consensus (as f32)."""

    def __init__(self) -> None:
        self.syncs: list[tuple[int, list[np.ndarray]]] = []
        self._fragment: FragmentTag | None = None
        self._awaiting_params = False
        self.rounds = 0

    def __call__(self, round_index: int, consensus: RoundFrame) -> None:
        self.rounds += 1
        if consensus.kind == RoundKind.CONTROL:
            self._fragment, self._awaiting_params = fragment_of(consensus), True
        elif self._awaiting_params:
            assert self._fragment is not None
            self.syncs.append((self._fragment.index, consensus_as_f32(consensus, copy=True)))
            self._awaiting_params = False


async def train(cluster, salt, *, overlap: int, outer, windows: int = WINDOWS) -> dict[int, list[np.ndarray]]:
    final: dict[int, list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in start_params(rank)]
        async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, salt) as client:
            async with open_window_trainer(
                client, params, rank=rank, world_size=WORLD, sync_every=SYNC_EVERY, overlap=overlap,
                fragments=FRAGMENTS, outer=None if outer is None else outer(),
            ) as trainer:

                def inner_step() -> None:
                    time.sleep(0.003)  # accelerator time: a round in flight moves meanwhile
                    with torch.no_grad():
                        for p in params:
                            p.add_(float(step_size(rank)))

                await trainer.run_steps(SYNC_EVERY * windows, inner_step)
            # Each fragment synced once per sync_every steps, staggered: windows each.
            assert trainer.stats.fragment_windows == [windows] * FRAGMENTS
            assert trainer.stats.windows == windows * FRAGMENTS
            assert trainer.stats.steps == SYNC_EVERY * windows
        final[rank] = [p.detach().numpy().copy() for p in params]

    async with trio.open_nursery() as nursery:
        for rank in range(WORLD):
            nursery.start_soon(rank_main, rank)
    return final


def assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str, *, exact: bool) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if exact:
            assert np.array_equal(g, w), f"{what} tensor {i}: {g} != {w}"
        else:  # the eager stand-in's recovered momentum divides by 1 + momentum: rounding
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"{what} tensor {i}")


# -- through real roles -------------------------------------------------------


# With lanes (every round cut into 3, however small) the controller steps and records
# each window from lane slices: the same numbers must come out.
LANES = [pytest.param({}, id="no-lanes"), pytest.param({"lanes": 3, "lane_min_bytes": 0}, id="lanes-3")]


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("overlap", [0, 1])
@pytest.mark.parametrize("outer", sorted(OUTERS))
async def test_fragmented_windows_match_the_reference(salt, outer, overlap, lanes):
    recorder = Recorder()
    options = {} if OUTERS[outer] is None else {"outer_optimizer": OUTERS[outer]()}
    async with open_local_cluster(world_size=WORLD, hosts=[[0], [1]], salt=salt, checkpoint=recorder, **options,
                                  **lanes) as cluster:
        final = await train(cluster, salt, overlap=overlap, outer=OUTERS[outer])
        # The sink saw each round once, whole; the lanes' rounds finished three times as many.
        assert cluster.controller.stats.rounds == recorder.rounds * lanes.get("lanes", 1)
    want_final, want_syncs = reference(outer)
    exact = not (outer == "diloco" and overlap)
    # The controller's consensus of each fragment, sync by sync (fragment 0 at steps 2, 6, 10; 1 at 4, 8, 12).
    assert [f for f, _ in recorder.syncs] == [f for f, _ in want_syncs] == [0, 1] * WINDOWS
    for k, ((f, got), (_, want)) in enumerate(zip(recorder.syncs, want_syncs, strict=True)):
        assert_close(got, want, f"sync {k} (fragment {f})", exact=True)  # the controller's math is exact either way
    for rank in range(WORLD):
        assert_close(final[rank], want_final[rank], f"rank {rank}", exact=exact)
    # Fragment 1 synced last, at the final step: identical on every rank; fragment 0 has local steps since.
    assert all(np.array_equal(a, b) for a, b in zip(second_half(final[0]), second_half(final[1])))


@pytest.mark.parametrize("lanes", LANES)
async def test_the_outer_state_per_fragment_survives_a_checkpoint_and_restore(salt, tmp_path, lanes):
    outer = DiLoCoNesterov(LR, MOMENTUM)
    async with ConsensusCheckpointer(tmp_path, keep=10, outer=outer) as sink:
        async with open_local_cluster(world_size=WORLD, hosts=[[0, 1]], salt=salt, outer_optimizer=outer,
                                      checkpoint=sink, **lanes) as cluster:
            await train(cluster, salt, overlap=1, outer=lambda: DiLoCoNesterov(LR, MOMENTUM))
    assert outer.fragments == [FragmentTag(0, 2), FragmentTag(1, 2)]
    path = latest_checkpoint(tmp_path)
    assert path is not None
    ckpt = load_checkpoint(path)
    # The newest file: the last fragment's last window, holding every fragment's newest consensus.
    assert ckpt.metadata["fragments"] == "2" and ckpt.metadata["fragment"] == "1"
    _, want_syncs = reference("diloco")
    newest = {f: arrays for f, arrays in want_syncs}
    assert_close(ckpt.params, whole(newest), "checkpoint params", exact=True)
    assert {"outer.fragment.0.2.x_prev.0", "outer.fragment.1.2.momentum.1", "outer.fragment.0.2.windows"} <= {
        f"outer.{k}" for k in ckpt.outer
    }
    # A restarted controller's optimizer takes the state back, fragment by fragment...
    restored = DiLoCoNesterov(LR, MOMENTUM)
    restored.load_state_dict(ckpt.outer)
    assert restored.fragments == outer.fragments and restored.windows == outer.windows == 2 * WINDOWS
    original = outer.state_dict()
    assert sorted(restored.state_dict()) == sorted(original)
    for key, value in restored.state_dict().items():
        assert np.array_equal(value, original[key]), key
    # ...and steps each fragment's next consensus exactly as the original would have.
    for tag in (FragmentTag(0, 2), FragmentTag(1, 2)):
        sizes = [b - a for a, b in (piece_range(int(np.prod(s)), 2, tag.index) for s in SHAPES)]
        nxt = RoundFrame([TensorPayload(DTYPE_F32, (n,), np.full(n, 7.0, "<f4")) for n in sizes], RoundKind.MODEL, 4.0)
        a = consensus_as_f32(outer.step(nxt, tag), copy=True)
        b = consensus_as_f32(restored.step(nxt, tag), copy=True)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), tag
    # A rank restores the whole model from it.
    module = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])
    restore_module(module, ckpt)
    assert_close([p.detach().numpy() for p in module], whole(newest), "restored module", exact=True)


async def test_a_rank_that_disagrees_on_the_fragment_is_refused_alone(salt):
    """Rank 2 opens fragment 1's window while ranks 0 and 1 open fragment 0's: its relay
    refuses its frame (the tag's shape differs from the round's, which the first frame
    folded sets: deterministic mode folds in rank order), the others' round completes
    without it."""
    async with open_local_cluster(world_size=3, hosts=[[0, 1, 2]], salt=salt, deterministic=True) as cluster:
        got: dict[int, object] = {}

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                counts = [0.0, 0.0, 0.0]
                counts[rank] = 4.0
                tag = FragmentTag(1 if rank == 2 else 0, 2)
                try:
                    got[rank] = await client.all_reduce_per_rank_f64(counts, fragment=tag)
                except FlodlError as exc:
                    got[rank] = exc

        async with trio.open_nursery() as nursery:
            for rank in range(3):
                nursery.start_soon(rank_main, rank)
    assert got[0] == got[1] == [4.0, 4.0, 0.0]
    assert isinstance(got[2], FlodlError)


async def test_the_blocking_facade_syncs_fragments(salt):
    from tests.train.test_blocking import run_rank_threads

    from flodl_trio.train.blocking import BlockingReduceClient

    final: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []
    async with open_local_cluster(world_size=WORLD, hosts=[[0], [1]], salt=salt) as cluster:

        def rank_thread(rank: int) -> None:
            try:
                params = [torch.from_numpy(a.copy()) for a in start_params(rank)]
                with BlockingReduceClient(cluster.relay_address(rank), rank, WORLD, salt) as client:
                    trainer = client.window_trainer(params, sync_every=SYNC_EVERY, overlap=1, fragments=FRAGMENTS)
                    for _ in range(SYNC_EVERY * WINDOWS):
                        time.sleep(0.003)
                        for p in params:
                            p.add_(float(step_size(rank)))
                        trainer.step()
                    trainer.finish()
                    assert trainer.stats.fragment_windows == [WINDOWS] * FRAGMENTS
                final[rank] = [p.numpy().copy() for p in params]
            except BaseException as exc:
                errors.append(exc)

        await run_rank_threads(rank_thread, range(WORLD), 20)
    assert not errors, errors
    want, _ = reference("none")
    for rank in range(WORLD):
        assert_close(final[rank], want[rank], f"rank {rank}", exact=True)


@pytest.mark.parametrize("lanes", LANES)
async def test_a_rank_coming_back_gets_every_fragments_consensus_and_takes_up_the_schedule(salt, lanes):
    """Rank 2 trains two cycles, crashes, and comes back with a fresh model: join() gives
    it every fragment's newest consensus and the newest buffers (as the controller sent
    them), and the trainer, told the window it enters, syncs each fragment at the
    cluster's step; the run ends with the last fragment identical on every rank. With
    lanes the controller keeps each window joined from its lanes."""
    world, sync_every, windows = 3, 4, 6
    buffer = (2,)
    recorder = Recorder()
    buffers_seen: list[np.ndarray] = []
    record_buffers = recorder.__call__

    def sink(round_index: int, consensus: RoundFrame) -> None:
        awaiting_buffers = consensus.kind == RoundKind.MODEL and not recorder._awaiting_params
        record_buffers(round_index, consensus)
        if awaiting_buffers and recorder._fragment == FragmentTag(1, 2):
            buffers_seen.append(consensus_as_f32(consensus, copy=True)[0])

    final: dict[int, list[np.ndarray]] = {}
    joined: dict[str, object] = {}

    def model(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.from_numpy(a.copy()) for a in start_params(rank)], [torch.full(buffer, float(rank))]

    def stepper(rank: int, params: list[torch.Tensor], buffers: list[torch.Tensor]):
        def inner_step() -> None:
            time.sleep(0.01)
            for p in params:
                p.add_(float(step_size(rank)))
            buffers[0].add_(1.0)
        return inner_step

    async with open_local_cluster(world_size=world, hosts=[[0, 1], [2]], salt=salt, rejoin_timeout=60,
                                  checkpoint=sink, **lanes) as cluster:

        async def survivor(rank: int) -> None:
            params, buffers = model(rank)
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                assert await client.join(params, buffers) == 0
                async with open_window_trainer(client, params, buffers, rank=rank, world_size=world,
                                               sync_every=sync_every, overlap=1, fragments=2) as trainer:
                    await trainer.run_steps(sync_every * windows, stepper(rank, params, buffers))
            final[rank] = [p.numpy().copy() for p in params]

        async def crashes_and_returns() -> None:
            rank = 2
            params, buffers = model(rank)
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                await client.join(params, buffers)
                async with open_window_trainer(client, params, buffers, rank=rank, world_size=world,
                                               sync_every=sync_every, overlap=1, fragments=2) as trainer:
                    await trainer.run_steps(sync_every * 2, stepper(rank, params, buffers))
                await client.aclose()  # gone without saying it finished
            await trio.sleep(0.05)
            params, buffers = model(rank + 10)  # a restarted process
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                start = await client.join(params, buffers)
                joined["start"] = start
                # What it loaded: each fragment's consensus as of the newest finished window.
                loaded = client.last_state.window
                assert loaded < start
                newest = {f: arrays for f, arrays in recorder.syncs[:loaded + 1]}
                joined["ok"] = all(np.array_equal(p.numpy(), w) for p, w in zip(params, whole(newest)))
                # The buffers travel with fragment 1 (the odd windows): those of the newest odd
                # window up to the loaded one (later windows may have finished since).
                buffers_window = loaded if loaded % 2 == 1 else loaded - 1
                joined["buffers_ok"] = np.array_equal(buffers[0].numpy(), buffers_seen[(buffers_window - 1) // 2])
                schedule = WindowSchedule(sync_every, overlap=1, fragments=2)
                with pytest.raises(ConfigError, match=f"joined the cluster at window {start}.*pass start_window={start}"):
                    async with open_window_trainer(client, params, buffers, rank=rank, world_size=world,
                                                   sync_every=sync_every, fragments=2):
                        pass  # refused before any frame: a trainer that forgot where it entered
                async with open_window_trainer(client, params, buffers, rank=rank, world_size=world,
                                               sync_every=sync_every, overlap=1, fragments=2,
                                               start_window=start) as trainer:
                    await trainer.run_steps(sync_every * windows - schedule.boundary_step(start - 1),
                                            stepper(rank, params, buffers))
                joined["windows"] = list(trainer.stats.fragment_windows)
            final[rank] = [p.numpy().copy() for p in params]

        async with trio.open_nursery() as nursery:
            for rank in (0, 1):
                nursery.start_soon(survivor, rank)
            nursery.start_soon(crashes_and_returns)
        assert cluster.controller.stats.rejoins == 1
    start = joined["start"]
    assert 5 <= start < 2 * windows - 1, start  # it came back after its fourth window, before the end
    assert joined["ok"] and joined["buffers_ok"], joined
    # It synced exactly the windows from `start` on: fragment k % 2 for window k.
    assert joined["windows"] == [sum(1 for w in range(start, 2 * windows) if w % 2 == f) for f in (0, 1)]
    assert [f for f, _ in recorder.syncs] == [0, 1] * windows
    for rank in (0, 1):  # fragment 1 synced at the final step
        assert all(np.array_equal(a, b) for a, b in zip(second_half(final[rank]), second_half(final[2])))


async def test_fragments_with_a_fixed_merge_point_and_a_bf16_wire_are_reproducible(salt):
    """P = 4 fragments, overlapped, merged after exactly 2 steps, params on a bf16 wire,
    DiLoCo at the controller, the cluster's deterministic mode: two runs end bit-identical
    and every fragment synced once per sync_every steps (the updates are not exact in
    f32 or bf16, and the ranks start at staggered times). A third run in 3 lanes, the
    outer step taken lane by lane, ends bit-identical too."""
    sync_every, windows, fragments = 8, 4, 4

    async def run(**lanes: int) -> dict[int, list[bytes]]:
        final: dict[int, list[bytes]] = {}
        async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt, deterministic=True,
                                      outer_optimizer=DiLoCoNesterov(0.7, 0.9), **lanes) as cluster:

            async def rank_main(rank: int) -> None:
                await trio.sleep(0.01 * ((rank * 7) % 3))
                gen = torch.Generator().manual_seed(rank)
                params = [torch.nn.Parameter(torch.zeros(n)) for n in (97, 64, 64, 33, 40)]
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                    async with open_window_trainer(
                        client, params, rank=rank, world_size=3, sync_every=sync_every, overlap=1,
                        merge_after=2, fragments=fragments, bf16_wire=True, outer=DiLoCoNesterov(0.7, 0.9),
                    ) as trainer:

                        def inner_step() -> None:
                            time.sleep(0.002)
                            with torch.no_grad():
                                for p in params:
                                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)

                        await trainer.run_steps(sync_every * windows, inner_step)
                    assert trainer.stats.fragment_windows == [windows] * fragments
                    assert set(trainer.stats.late_steps[:-1]) == {2}  # the last merges at finish()
                final[rank] = [p.detach().numpy().tobytes() for p in params]

            async with trio.open_nursery() as nursery:
                for rank in range(3):
                    nursery.start_soon(rank_main, rank)
        return final

    first, second = await run(), await run()
    assert first == second
    assert await run(lanes=3, lane_min_bytes=0) == first


def test_a_cluster_state_is_split_as_whole_tensors_or_as_runs_per_fragment():
    """What join() loads: one frame of whole parameters, or one frame per fragment each
    holding run p of every parameter; then the buffers' frame. Anything else is a
    SchemaError naming the counts."""
    from flodl_trio.client.state import ClusterState
    from flodl_trio.errors import SchemaError

    def frame_of(shapes) -> RoundFrame:
        return RoundFrame([TensorPayload(DTYPE_F32, s, np.zeros(int(np.prod(s)), "<f4")) for s in shapes],
                          RoundKind.MODEL, 1.0)

    numels = [3, 5]  # two params; one float buffer of 2
    params, one_buffer = [(3,), (5,)], [(2,)]
    whole_model, buffers = frame_of(params), frame_of(one_buffer)
    runs = [frame_of([(b - a,) for a, b in (piece_range(n, 2, p) for n in numels)]) for p in range(2)]
    assert ClusterState(4, (whole_model, buffers)).split(params, one_buffer) == ([whole_model], buffers)
    assert ClusterState(4, (*runs, buffers)).split(params, one_buffer) == (runs, buffers)
    assert ClusterState(4, tuple(runs)).split(params, []) == (runs, None)
    assert ClusterState(4, (whole_model, buffers)).split(params, []) == ([whole_model], None)  # no buffers here
    with pytest.raises(SchemaError, match=r"frames of \[2, 1\] tensors; this model has 3 params and 1 float buffers"):
        ClusterState(4, (whole_model, buffers)).split([(3,), (5,), (1,)], one_buffer)
    with pytest.raises(SchemaError, match=r"parameter 1 of shape \[5\], this model's parameter 1 has shape \[1, 5\]"):
        ClusterState(4, (whole_model, buffers)).split([(3,), (1, 5)], one_buffer)  # same numel, other shape
    with pytest.raises(SchemaError, match=r"float buffer 0 of shape \[2\], this model's float buffer 0 has shape \[3\]"):
        ClusterState(4, (whole_model, buffers)).split(params, [(3,)])
    with pytest.raises(SchemaError, match="frames of"):
        ClusterState(4, (runs[1], runs[0], buffers)).split(params, one_buffer)  # runs out of order
