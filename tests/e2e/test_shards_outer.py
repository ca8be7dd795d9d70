"""The outer step on the shards: each shard steps the lanes it reduces, with their state.

The oracle is a controller without shards (the star) given the same contributions in
deterministic mode: the ranks must get its bytes, window after window, f32 and bf16,
whole model and fragments, and through a lost shard, whose backup steps its lanes on
from the state it mirrored (docs/wire.md, "The outer state through a lost shard").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import pytest
import torch
import trio
import trio.testing

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
    lose_shard_after: int | None = None, meanwhile: Callable[..., Awaitable[None]] | None = None,
    losses: Sequence[tuple[int, int]] = (), before_loss: Callable[..., None] | None = None,
) -> tuple[dict[tuple[int, int], list[bytes]], object, object]:
    """``windows`` windows of every rank (a Control round, then a weighted params round);
    per (rank, window) the params consensus's tensors as bytes. ``losses``: (window,
    shard), the shard closed once every rank holds that window's consensus, the ranks
    waiting for it (``before_loss(cluster, window)`` first); ``lose_shard_after`` w is
    ``losses=[(w, 1)]``; ``meanwhile`` runs beside the ranks, given the cluster and what
    the ranks got so far."""
    got: dict[tuple[int, int], list[bytes]] = {}
    outer = make_outer()
    losses = dict(losses if lose_shard_after is None else [(lose_shard_after, 1)])
    with trio.fail_after(60):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=salt, lanes=LANES, lane_min_bytes=0,
                                      deterministic=True, shards=shards, outer_optimizer=outer) as cluster:
            done = {w: [trio.Event() for _ in range(WORLD)] for w in losses}
            lost = {w: trio.Event() for w in losses}

            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, cluster.salt) as client:
                    client.bf16_wire = bf16
                    for window in range(windows):
                        await client.all_reduce_weighted(_control(window, fragments), RoundKind.CONTROL, 1.0)
                        out = await client.all_reduce_weighted(_params(rank, window, fragments), RoundKind.MODEL,
                                                               float(rank + 1))
                        got[rank, window] = [t.numpy().tobytes() for t in out[0]]
                        if window in losses:
                            done[window][rank].set()
                            await lost[window].wait()

            async def lose_shard(window: int) -> None:
                for event in done[window]:
                    await event.wait()
                if before_loss is not None:
                    before_loss(cluster, window)
                cluster.close_shard(losses[window])
                lost[window].set()

            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(rank_main, rank)
                for window in losses:
                    nursery.start_soon(lose_shard, window)
                if meanwhile is not None:
                    nursery.start_soon(meanwhile, cluster, got)
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


@pytest.mark.parametrize("shards", [3, 4])
async def test_a_lost_shards_lanes_step_on_from_its_backups_mirror(salt, shards):
    """Shard 1 closes after window 2: its backup (the next live shard) takes its lanes
    over with the outer state it mirrored, so every window - the one after the loss
    included - is the bytes a deterministic controller without shards sends. (With two
    shards the controller serves a standby instead: the test below.)"""
    lost_after, windows = 2, 5
    sharded, cluster, _ = await _windows(salt, shards, DiLoCoNesterov, windows, lose_shard_after=lost_after)
    star, _, _ = await _windows(salt, 0, DiLoCoNesterov, windows)
    assert cluster.controller.stats.shards_lost == 1
    assert sharded == star
    frame = RoundFrame([TensorPayload(DTYPE_F32, (n,)) for n in SIZES.values()], RoundKind.MODEL)
    layout = LaneLayout.through_shards(frame, LANES, shards)  # (the cluster's lane_min_bytes is 0)
    moved = [lane for lane in range(1, layout.count) if lane_owner(lane, shards, set()) == 1]
    backup = cluster.shards[2 % shards]
    assert backup.lanes_taken_over == len(moved)  # each of shard 1's lanes, once, from the mirror
    assert backup.lanes_mirrored >= len(moved) * (lost_after + 1)
    # The run really stepped those lanes after the loss (not the plain average).
    mass = sum(rank + 1 for rank in range(WORLD))
    window = lost_after + 1
    for lane in moved:
        for piece in layout.lanes[lane]:
            got = np.frombuffer(sharded[0, window][piece.tensor], dtype=np.float32)[piece.start:piece.stop]
            average = (sum(_params(rank, window, False)[piece.tensor].numpy() for rank in range(WORLD)) / mass)
            assert not np.allclose(got, average[piece.start:piece.stop], rtol=1e-3)


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


async def _seed_state_record(salt, lane: int, lanes: int, numel: int) -> bytes:
    """A lane state record as a controller seeds one: f32 x_prev and momentum, ``numel`` each."""
    from flodl_trio.fold.outer import state_frame
    from flodl_trio.transport.hashing import encode_enveloped_frame
    from flodl_trio.wire.mux import MuxKind

    frame = state_frame(lane, lanes, ([np.ones(numel, np.float32)], [np.zeros(numel, np.float32)]))
    record = await encode_enveloped_frame(MuxKind.BROADCAST, frame, salt, frame_mac=False)
    return b"".join(bytes(chunk) for chunk in record.chunks)


@pytest.mark.parametrize(("case", "named"), [
    ("too-many", "promises 100000 lane states"),
    ("other-decision", "Seed for decision 0 before Decide 1"),
    ("steps-nothing", "which steps nothing"),
    ("wrong-shape", "outer state: tensor 0 is dtype"),
    ("not-a-state", "promised 1 lane states; record 0 after it is Decided"),
    ("lane-0", "seeded lane tag"),
    ("seed-twice", "Seed for decision 0 was followed by Seed, not its Decide"),
])
async def test_a_controller_that_seeds_a_shard_wrongly_ends_that_shard_naming_why(salt, case, named):
    """A Seed is the controller's word on lanes' state: one that promises more states than
    a round has lanes, comes before a Decide of another number or one that steps nothing
    (or before anything but its Decide), or brings a state that is not its lane's shapes
    (or a lane 0, which no shard steps), ends the shard, naming what was wrong; nothing of
    it is stepped."""
    from flodl_trio import FlodlError
    from flodl_trio.shard import open_shard
    from flodl_trio.testing import hold_open
    from flodl_trio.wire.constants import CHANNEL_MAGIC_SHARD
    from flodl_trio.wire.mux import Decide, Decided, Seed, ShardOuter, ShardSetup, encode_control_record

    def control(*msgs: object) -> bytes:
        return b"".join(bytes(encode_control_record(m, salt)) for m in msgs)

    lanes, numel = 3, 5  # a round of [10] f32 in 3 lanes: lanes 1 and 2 carry 5 elements each
    decide = Decide(0, 0, lanes, [(DTYPE_F32, (10,))], [0], [0], step=True)
    good = await _seed_state_record(salt, 1, lanes, numel)
    sent = {
        "too-many": control(Seed(0, 100_000)),
        "other-decision": control(Seed(0, 1)) + good + control(Decide(1, 0, lanes, decide.schema, [0], [0], step=True)),
        "steps-nothing": control(Seed(0, 1)) + good + control(Decide(0, 0, lanes, decide.schema, [0], [0])),
        "wrong-shape": control(Seed(0, 1)) + await _seed_state_record(salt, 1, lanes, numel + 1) + control(decide),
        "not-a-state": control(Seed(0, 1), Decided(0)),
        "lane-0": control(Seed(0, 1)) + await _seed_state_record(salt, 0, lanes, numel) + control(decide),
        "seed-twice": control(Seed(0, 1)) + good + control(Seed(0, 1)) + good + control(decide),
    }[case]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shard = await nursery.start(hold_open, open_shard("127.0.0.1", 0, salt=salt))
            stream = await trio.open_tcp_stream("127.0.0.1", shard.port)
            await stream.send_all(CHANNEL_MAGIC_SHARD.to_bytes(4, "little")
                                  + control(ShardSetup(0, 1, 30_000), ShardOuter(2, 0.7, 0.9)) + sent)
            with pytest.raises(FlodlError, match=named):
                await shard.outcome.wait()
            assert shard.lanes_seeded == 0
            await stream.aclose()
            nursery.cancel_scope.cancel()


def _stall_shard_1_mid_window(monkeypatch, window: int) -> tuple[trio.Event, trio.Event]:
    """Shard 1 steps (and mirrors) its first lane of ``window``'s params round, then never
    sums another, as a shard that dies mid-round: the first event is set once it stalls,
    the second once its backup stepped the mirror of that lane."""
    from flodl_trio.shard import core as shard_core

    sum_lane, step_mirror = shard_core._Shard._sum_lane, shard_core._Shard._step_mirror
    stalled, mirrored = trio.Event(), trio.Event()
    seen: dict[int, int] = {}  # stepping decision -> lanes shard 1 summed of it

    async def stalling(self, msg, lane: int) -> None:
        if self.index == 1 and msg.step:
            if msg.decision not in seen:
                seen[msg.decision] = 0
            if len(seen) == window + 1 and seen[msg.decision] == 1:
                stalled.set()
                await trio.sleep_forever()
            seen[msg.decision] += 1
        await sum_lane(self, msg, lane)

    def stepping(self, sender: int, lane) -> None:
        step_mirror(self, sender, lane)
        if sender == 1 and len(seen) == window + 1 and lane.decision == max(seen):
            mirrored.set()

    monkeypatch.setattr(shard_core._Shard, "_sum_lane", stalling)
    monkeypatch.setattr(shard_core._Shard, "_step_mirror", stepping)
    return stalled, mirrored


@pytest.mark.parametrize(("make_outer", "bf16", "fragments"), [
    (DiLoCoNesterov, False, False), (DiLoCoNesterov, True, False), (DiLoCoNesterov, False, True),
    (lambda: SlowMo(lr=0.8, momentum=0.6), False, False),
], ids=["diloco-f32", "diloco-bf16", "diloco-fragments", "slowmo"])
async def test_a_shard_lost_mid_round_after_stepping_some_lanes_leaves_every_window_exact(
    salt, monkeypatch, make_outer, bf16, fragments,
):
    """Shard 1 of 3 steps one lane of window 3's params round - its backup mirrors that
    step - and stalls; it is then closed. The round is decided again: its backup steps
    shard 1's lanes from the state the round started with (not the mirrored step of the
    round decided again), and every window is the bytes of a controller without shards."""
    windows = 5
    star, _, _ = await _windows(salt, 0, make_outer, windows, bf16=bf16, fragments=fragments)
    stalled, mirrored = _stall_shard_1_mid_window(monkeypatch, window=3)

    async def lose_shard_1(cluster, _got) -> None:
        await stalled.wait()
        await mirrored.wait()
        cluster.close_shard(1)

    sharded, cluster, _ = await _windows(salt, 3, make_outer, windows, bf16=bf16, fragments=fragments,
                                         meanwhile=lose_shard_1)
    assert (cluster.controller.stats.shards_lost, cluster.controller.stats.decisions_again) == (1, 1)
    assert sharded == star
    assert cluster.shards[2].lanes_taken_over > 0


@pytest.mark.parametrize(("shards", "losses"), [(2, [(2, 1), (4, 0)]), (3, [(1, 1), (2, 0), (4, 2)])],
                         ids=["2-shards", "3-shards"])
async def test_with_one_shard_left_the_controller_serves_a_standby_so_its_loss_keeps_the_outer_state_exact(
    salt, shards, losses,
):
    """Shards close until one is left: the controller then serves the lowest lost one again
    itself, beside it, between rounds (the shard left hands it that shard's lanes' state).
    That standby is the last live shard's backup: when it closes too (after window 4), its
    lanes step on at the standby from the mirror, and every window is the bytes of a
    controller without shards."""
    windows = 7

    def standby_in_place(cluster, window: int) -> None:
        stats = cluster.controller.stats
        if window == 4:  # (served at the first commit after the loss before, in window 3)
            assert (stats.shards_lost, stats.shards_served_here) == (shards - 1, 1), stats

    star, _, _ = await _windows(salt, 0, DiLoCoNesterov, windows)
    sharded, cluster, _ = await _windows(salt, shards, DiLoCoNesterov, windows, losses=losses,
                                         before_loss=standby_in_place)
    assert sharded == star
    # (no standby beside the controller's own shard: it would back nothing up)
    assert (cluster.controller.stats.shards_lost, cluster.controller.stats.shards_served_here) == (shards, 1)


async def test_a_round_commits_only_once_its_backup_mirrored_it_and_a_backup_that_did_not_is_lost(salt, monkeypatch):
    """Shard 2 drops the mirror of shard 1's lanes of window 3's params round, as a backup
    that never got it: the round does not commit though every relay holds its lanes (a
    later loss of shard 1 would lose that step). Shard 2 is then closed: shard 1 mirrors
    to shard 0 from the state the round started with, and every window is exact."""
    from flodl_trio.controller import shards as controller_shards
    from flodl_trio.shard import mirror

    windows = 5
    star, _, _ = await _windows(salt, 0, DiLoCoNesterov, windows)
    step, lanes_in = mirror.MirrorBook.step, controller_shards.ShardSet.lanes_in
    dropped, all_in = trio.Event(), trio.Event()
    stepping: dict[int, int] = {}  # stepping decision -> (first seen)

    def dropping(self, lane, me, count, lost) -> None:
        stepping.setdefault(lane.decision, len(stepping))
        if me == 2 and lane.shard == 1 and stepping[lane.decision] == 3 and not all_in.is_set():
            dropped.set()
            return
        step(self, lane, me, count, lost)

    def counting(self, seat_id: int, decision: int) -> None:
        lanes_in(self, seat_id, decision)
        if dropped.is_set() and decision == self._pending and len(self._lanes_in) == len(HOSTS):
            all_in.set()

    monkeypatch.setattr(mirror.MirrorBook, "step", dropping)
    monkeypatch.setattr(controller_shards.ShardSet, "lanes_in", counting)

    async def lose_shard_2_once_held(cluster, got) -> None:
        await all_in.wait()
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert not any(window == 3 for (_, window) in got)  # held: no rank has window 3
        cluster.close_shard(2)

    sharded, cluster, _ = await _windows(salt, 3, DiLoCoNesterov, windows, meanwhile=lose_shard_2_once_held)
    assert cluster.controller.stats.shards_lost == 1
    assert sharded == star


async def _until_window(got, window: int) -> None:
    """Until every rank holds ``window``'s consensus."""
    while not all((rank, window) in got for rank in range(WORLD)):
        await trio.sleep(0.01)


async def _mirror_connection(cluster, shard: int, records: list[bytes]) -> bytes:
    """A raw connection to ``shard``'s mirror channel: ``records`` sent, then whatever it
    answers until it closes."""
    from flodl_trio.wire.constants import CHANNEL_MAGIC_MIRROR

    stream = await trio.open_tcp_stream("127.0.0.1", cluster.shards[shard].port)
    async with stream:
        await stream.send_all(CHANNEL_MAGIC_MIRROR.to_bytes(4, "little") + b"".join(records))
        answer = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                answer += chunk
    return answer


async def test_a_mirror_connection_without_the_salt_is_closed_and_costs_nothing(salt, caplog):
    """A peer that opens a shard's mirror channel and signs with another salt, or claims a
    500 MiB record, is closed unanswered; no shard is lost and every window is still the
    star's bytes."""
    from flodl_trio.wire.mux import Mirror, encode_control_record
    from flodl_trio.wire.salt import SessionSalt

    async def intrude(cluster, got) -> None:
        await _until_window(got, 1)
        forged = encode_control_record(Mirror(1, 3, 0), SessionSalt.coerce(b"not the salt 123"))
        assert await _mirror_connection(cluster, 2, [forged]) == b""
        # A header that claims a huge record is refused before anything is buffered.
        huge = bytearray(forged[:25])  # (the header: magic, version, kind, rank, length, its MAC)
        huge[13:17] = (500 << 20).to_bytes(4, "little")
        assert await _mirror_connection(cluster, 2, [bytes(huge)]) == b""

    sharded, cluster, _ = await _windows(salt, 3, DiLoCoNesterov, 4, meanwhile=intrude)
    star, _, _ = await _windows(salt, 0, DiLoCoNesterov, 4)
    assert "payload length 524288000 exceeds the frame ceiling" in caplog.text
    assert cluster.controller.stats.shards_lost == 0
    assert sharded == star


async def test_a_shard_that_mirrors_bytes_breaking_the_protocol_costs_only_itself(salt, caplog):
    """A member (it holds the salt) says it is shard 1 on shard 2's mirror channel and
    follows ``Mirror`` with a HostFrame record: shard 2 closes it and tells the controller
    shard 1 is lost. Shard 1's lanes go on at shard 2 from the mirror shard 1 really
    sent, so every window is still the star's bytes; no other shard is lost."""
    from flodl_trio.wire.mux import Mirror, MuxKind, encode_control_record, encode_mux_record
    from flodl_trio.wire.salt import SessionSalt

    async def misbehave(cluster, got) -> None:
        await _until_window(got, 1)
        session = SessionSalt.coerce(salt)
        bad = [encode_control_record(Mirror(1, 3, 0), session),
               encode_mux_record(MuxKind.HOST_FRAME, b"\x00" * 32, session).tobytes()]
        assert await _mirror_connection(cluster, 2, bad) == b""

    sharded, cluster, _ = await _windows(salt, 3, DiLoCoNesterov, 4, meanwhile=misbehave)
    star, _, _ = await _windows(salt, 0, DiLoCoNesterov, 4)
    assert cluster.controller.stats.shards_lost == 1
    assert "controller: shard 1 lost (shard 2 says the mirror connection between them failed)" in caplog.text
    assert "controller: shard 0 lost" not in caplog.text and "controller: shard 2 lost" not in caplog.text
    assert sharded == star


def _holding_state(make_outer: Callable[[], object], fragments: bool) -> object:
    """An optimizer that holds state before the run (as ``load_state_dict`` of a resumed
    run's checkpoint leaves it): x_prev and momentum away from anything the run sends."""
    outer = make_outer()
    rng = np.random.default_rng(7)
    sets = {f"fragment.{p}.2.": [n] for p, n in SIZES.items()} if fragments else {"": list(SIZES.values())}
    state: dict[str, np.ndarray] = {}
    for prefix, numels in sets.items():
        for i, n in enumerate(numels):
            state[f"{prefix}x_prev.{i}"] = (rng.standard_normal(n) + 3).astype(np.float32)
            state[f"{prefix}momentum.{i}"] = (rng.standard_normal(n) * 0.5).astype(np.float32)
        if prefix:
            state[f"{prefix}windows"] = np.array([2], np.int64)
    state["windows"] = np.array([4], np.int64)
    outer.load_state_dict(state)  # type: ignore[attr-defined]
    return outer


@pytest.mark.parametrize(("make_outer", "bf16", "fragments"), [
    (DiLoCoNesterov, False, False), (DiLoCoNesterov, True, False), (DiLoCoNesterov, False, True),
    (lambda: SlowMo(lr=0.8, momentum=0.6), False, False),
], ids=["diloco-f32", "diloco-bf16", "diloco-fragments", "slowmo"])
async def test_an_optimizer_holding_state_seeds_the_shards_to_the_bytes_of_a_controller_without_shards(
    salt, make_outer, bf16, fragments,
):
    """The controller's optimizer holds state when the run starts (a resumed run): each
    shard's lanes start from it (``Seed`` before the first params round's ``Decide``),
    so every window - the first included, which would otherwise be a plain average - is
    the bytes a deterministic controller without shards steps from the same state."""
    def holding() -> object:
        return _holding_state(make_outer, fragments)

    sharded, cluster, outer = await _windows(salt, 3, holding, 4, bf16=bf16, fragments=fragments)
    star, _, _ = await _windows(salt, 0, holding, 4, bf16=bf16, fragments=fragments)
    fresh, _, _ = await _windows(salt, 0, make_outer, 4, bf16=bf16, fragments=fragments)
    assert sharded == star
    assert sharded[0, 0] != fresh[0, 0]  # the state made a difference from the first window
    frame = RoundFrame([TensorPayload(DTYPE_F32, (n,)) for n in SIZES.values()], RoundKind.MODEL)
    lanes = LaneLayout.through_shards(frame, LANES, 3).count - 1
    # Every lane 1.. seeded once per params set (each fragment is a set of its own).
    assert sum(h.lanes_seeded for h in cluster.shards) >= (lanes if not fragments else 2)
    assert outer.windows == 4 + 4  # type: ignore[attr-defined]


async def test_a_shard_lost_mid_round_in_the_seeded_window_leaves_every_window_exact(salt, monkeypatch):
    """Shard 1 of 3 steps one lane of the seeded params round (window 0) and stalls, and is
    closed: the round decided again seeds the new owner too, and every window is the
    bytes of a controller without shards stepping from the same state."""
    def holding() -> object:
        return _holding_state(DiLoCoNesterov, False)

    star, _, _ = await _windows(salt, 0, holding, 3)
    stalled, mirrored = _stall_shard_1_mid_window(monkeypatch, window=0)

    async def lose_shard_1(cluster, _got) -> None:
        await stalled.wait()
        await mirrored.wait()
        cluster.close_shard(1)

    sharded, cluster, _ = await _windows(salt, 3, holding, 3, meanwhile=lose_shard_1)
    assert (cluster.controller.stats.shards_lost, cluster.controller.stats.decisions_again) == (1, 1)
    assert sharded == star
    # Seeded twice; the second time every live shard held the lanes' state already (its own
    # from the first decision, or shard 1's from its mirror) and took no seed.
    taken = sum(h.lanes_seeded for h in cluster.shards)
    assert 0 < taken < cluster.controller.stats.lanes_seeded
