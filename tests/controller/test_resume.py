"""The resume record and the controller's answers to relays that resume, I/O-free but the file's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flodl_trio.controller.coordinator import Coordinator
from flodl_trio.controller.dead_ranks import DeadRanks
from flodl_trio.controller.membership import Membership
from flodl_trio.controller.resume import RECORD_FILE, ResumeLog, RunRecord, broadcast_tag
from flodl_trio.controller.resumption import Resumption
from flodl_trio.controller.round import ControllerRound, WindowPart, WindowState, WindowStore
from flodl_trio.controller.seats import Seats
from flodl_trio.controller.stats import ControllerStats
from flodl_trio.controller.lane_windows import LaneWindows
from flodl_trio.controller.windows import WholeFrameWindows
from flodl_trio.errors import DesyncError
from flodl_trio.fold.outer import DiLoCoNesterov
from flodl_trio.transport.settings import NetBounds, controller_outage
from flodl_trio.wire.mux import NO_BROADCAST, MuxKind, Resume, encode_mux_record
from flodl_trio.wire.constants import DTYPE_F32
from flodl_trio.wire.round_frame import EncodedFrame, RoundFrame, RoundKind, TensorPayload
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"resume-unit-salt")
WORLD = 4


def broadcast(payload: bytes) -> EncodedFrame:
    return encode_mux_record(MuxKind.BROADCAST, payload, SALT)


def run_record(rounds: int, tag: bytes, previous: bytes | None, **fields: object) -> RunRecord:
    return RunRecord(rounds=rounds, windows=rounds // 3, model_rounds=rounds % 3, previous_kind=0, fragment=None,
                     last_tag=tag, previous_tag=previous, **fields)


def test_broadcast_tag_is_the_records_mac() -> None:
    record = broadcast(b"consensus bytes")
    assert broadcast_tag(record) == record.tobytes()[17:25]
    assert broadcast_tag(broadcast(b"other bytes")) != broadcast_tag(record)


def test_a_record_reads_back_as_written_with_its_outer_state(tmp_path: Path) -> None:
    log = ResumeLog(tmp_path, SALT, WORLD)
    record = broadcast(b"x" * 1000)
    outer = {"windows": np.array([3]), "x_prev.0": np.arange(6, dtype=np.float32)}
    written = log.write(run_record(7, broadcast_tag(record), b"\1" * 8, dead=(2,), elastic=(0, 1)), record, outer)
    assert written.outer_file == "resume-outer-7.safetensors"
    back = log.load()
    assert back is not None
    assert back.run == written and log.last_broadcast().tobytes() == record.tobytes()
    np.testing.assert_array_equal(back.outer["x_prev.0"], outer["x_prev.0"])
    # A round that did not step the outer optimizer keeps naming the last state file.
    log.write(run_record(8, b"\2" * 8, broadcast_tag(record), outer_file=written.outer_file), broadcast(b"y"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([RECORD_FILE, "resume-outer-7.safetensors"])
    log.write(run_record(9, b"\3" * 8, b"\2" * 8), broadcast(b"z"), {"windows": np.array([4])})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([RECORD_FILE, "resume-outer-9.safetensors"])
    assert log.last_broadcast().tobytes() == broadcast(b"z").tobytes()
    log.clear()
    assert list(tmp_path.iterdir()) == [] and log.load() is None


def test_a_record_of_a_sharded_run_keeps_where_the_shards_are(tmp_path: Path) -> None:
    """Their addresses, the lost ones, the rounds decided and the decision numbers given."""
    log = ResumeLog(tmp_path, SALT, WORLD)
    record = broadcast(b"lane 0")
    written = log.write(run_record(12, broadcast_tag(record), None, shards=(("10.0.0.1", 7001), ("10.0.0.2", 7002)),
                                   shards_lost=(1,), sharded_rounds=11, decisions=14), record)
    back = log.load()
    assert back is not None and back.run == written
    assert back.run.shards == (("10.0.0.1", 7001), ("10.0.0.2", 7002)) and back.run.shards_lost == (1,)
    assert (back.run.sharded_rounds, back.run.decisions) == (11, 14)


def test_another_sessions_or_worlds_record_is_not_resumed(tmp_path: Path) -> None:
    ResumeLog(tmp_path, SALT, WORLD).write(run_record(3, b"\1" * 8, None), broadcast(b"a"))
    assert ResumeLog(tmp_path, SessionSalt(b"another-salt-16b"), WORLD).load() is None
    assert ResumeLog(tmp_path, SALT, WORLD + 1).load() is None
    assert ResumeLog(tmp_path, SALT, WORLD).load() is not None


def resumption(tmp_path: Path | None, outer: DiLoCoNesterov | None = None) -> Resumption:
    dead = DeadRanks(WORLD)
    stats = ControllerStats()
    whole = ControllerRound(Seats(WORLD, dead), stats, outer_optimizer=outer)
    return Resumption(tmp_path, salt=SALT, windows=WholeFrameWindows(whole), window_store=WindowStore(), checkpoint=None,
                      membership=Membership(WORLD, 60.0), dead=dead, coordinator=Coordinator(WORLD, SALT, dead),
                      stats=stats)


async def test_each_round_is_recorded_before_it_goes_out_and_a_new_controller_takes_it_on(tmp_path: Path) -> None:
    first = resumption(tmp_path)
    records = [broadcast(bytes([i]) * 64) for i in range(3)]
    for i, record in enumerate(records):
        first.stats.rounds = i + 1
        await first.record(record, None)
    first.dead.declare_dead(3)
    first.membership.said_finished(3)
    await first.record(last := broadcast(b"last" * 16), None)

    second = resumption(tmp_path)
    second.restore()
    assert second.stats.rounds == 3 and second.stats.resumed_runs == 1
    assert second.dead.snapshot() == {3} and 3 in second.membership.finished
    assert second.tags.latest == broadcast_tag(last) and second.tags.previous == broadcast_tag(records[-1])
    assert set(second.coordinator.last_seen) == {0, 1, 2}  # their heartbeat clocks run from now

    # Current: nothing owed. One behind: the last Broadcast again, and its resent HostFrame is stale.
    assert second.answer(1, "relay a", Resume(broadcast_tag(last), awaiting=True, resends=True)) is None
    assert not second.stale_host_frame(1)
    again = second.answer(2, "relay b", Resume(broadcast_tag(records[-1]), awaiting=True, resends=True))
    assert again is not None and again.tobytes() == last.tobytes()
    assert second.stale_host_frame(2) and not second.stale_host_frame(2)
    with pytest.raises(DesyncError, match="not one of this controller's last two"):
        second.answer(3, "relay c", Resume(broadcast_tag(records[0]), awaiting=True))
    with pytest.raises(DesyncError, match="began to receive"):
        second.answer(3, "relay c", Resume(broadcast_tag(last), awaiting=True, resends=False))


async def test_the_outer_state_comes_back_exactly(tmp_path: Path) -> None:
    outer = DiLoCoNesterov(lr=0.7, momentum=0.9)
    for k in range(3):
        values = np.arange(5, dtype=np.float32) * (k + 1)
        outer(RoundFrame([TensorPayload(DTYPE_F32, values.shape, values.tobytes())], RoundKind.MODEL, 1.0))
    first = resumption(tmp_path, outer)
    first.stats.rounds = 5
    await first.record(broadcast(b"params"), WindowPart(1, 1))
    fresh = DiLoCoNesterov(lr=0.7, momentum=0.9)
    second = resumption(tmp_path, fresh)
    second.restore()
    for key, value in outer.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[key], value)


async def test_a_controller_without_a_record_refuses_a_relay_from_a_run_it_never_saw() -> None:
    fresh = resumption(None)
    assert fresh.answer(0, "relay a", Resume(NO_BROADCAST)) is None  # before any round: nothing to resume
    with pytest.raises(DesyncError, match="started without the record"):
        fresh.answer(0, "relay a", Resume(b"\7" * 8, awaiting=True, resends=True))


async def test_a_run_that_cannot_be_resumed_says_why(tmp_path: Path) -> None:
    ResumeLog(tmp_path, SALT, WORLD).write(
        run_record(4, b"\1" * 8, b"\2" * 8, not_resumable="it runs delta rounds"), broadcast(b"a")
    )
    second = resumption(tmp_path)
    second.restore()
    assert second.stats.rounds == 0
    with pytest.raises(DesyncError, match="cannot take on: it runs delta rounds"):
        second.answer(0, "relay a", Resume(b"\1" * 8, awaiting=False))


def test_the_outage_bound_comes_from_the_environment() -> None:
    assert controller_outage({}) is None  # as long as the controller says
    assert NetBounds().controller_outage is None
    assert controller_outage({"FLODL_CONTROLLER_OUTAGE": "120"}) == 120.0
    assert NetBounds.from_env({"FLODL_CONTROLLER_OUTAGE": "7.5", "FLODL_NET_TIMEOUT_SCALE": "2"}).controller_outage == 7.5
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(Exception, match="FLODL_CONTROLLER_OUTAGE"):
            controller_outage({"FLODL_CONTROLLER_OUTAGE": bad})



async def test_a_finished_windows_state_for_joiners_comes_back_into_the_window_store(tmp_path: Path) -> None:
    first = resumption(tmp_path)
    params, buffers = broadcast(b"p" * 300), broadcast(b"b" * 20)
    state = WindowState(6, (params,), buffers)
    first.window_store.restore(state, {None: 2})  # as if windows of 2 Model rounds had been learned
    first.stats.rounds = 21
    await first.record(buffers, WindowPart(6, 2), state)
    first.stats.rounds = 22
    await first.record(broadcast(b"c"), WindowPart(7, 0))  # the next window's first round keeps naming it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([RECORD_FILE, "resume-window-21.safetensors"])

    second = resumption(tmp_path)
    second.restore()
    latest = second.window_store.latest
    assert latest is not None and latest.window == 6
    assert [f.tobytes() for f in latest.frames] == [params.tobytes(), buffers.tobytes()]
    assert second.window_store.model_rounds_per_window == 2


async def test_only_a_controller_that_keeps_a_record_tells_relays_and_ranks_to_hold(tmp_path: Path) -> None:
    assert resumption(None).announced_outage_ms(NetBounds()) == 0
    assert resumption(tmp_path).announced_outage_ms(NetBounds()) == 300_000
    assert resumption(tmp_path).announced_outage_ms(NetBounds(controller_outage=12.5)) == 12_500
    assert resumption(tmp_path).announced_outage_ms(NetBounds(controller_outage=0)) == 0


def test_a_window_whose_start_the_store_did_not_see_is_not_kept() -> None:
    """A controller started again mid-window knows the last window's state, not the
    open one's first rounds: the rest of that window must not pass for a window
    (it would be window -1, and a joiner would enter window 0)."""
    store = WindowStore()
    frame = broadcast(b"f")
    store.restore(WindowState(6, (frame,), frame), {None: 2})
    assert not store.keep(WindowPart(7, 1), frame) and not store.keep(WindowPart(7, 2), frame)
    assert store.latest is not None and store.latest.window == 6
    assert not store.keep(WindowPart(8, 0), frame) and not store.keep(WindowPart(8, 1), frame)
    assert store.keep(WindowPart(8, 2), frame) and store.latest.window == 8


async def test_a_controller_that_kept_joiners_state_keeps_it_again_from_the_start(tmp_path: Path) -> None:
    first = resumption(tmp_path)
    state = WindowState(3, (broadcast(b"p"),), broadcast(b"b"))
    first.window_store.restore(state, {None: 2})
    first.stats.rounds = 12
    await first.record(broadcast(b"b"), WindowPart(3, 2), state)
    second = resumption(tmp_path)
    assert not second.windows.keep_window_state
    second.restore()
    assert second.windows.keep_window_state


async def test_a_round_in_lanes_is_recorded_whole_as_its_last_lane_goes(tmp_path: Path) -> None:
    """The lanes before the last are kept, not written; the last lane writes the record with
    every lane in it, the round's place is its last lane's MAC, and a relay one round behind
    is sent all the lanes again and has each lane of its resent HostFrame dropped."""
    first = resumption(tmp_path)
    before = broadcast(b"earlier round")
    await first.record(before, None)
    lanes = [broadcast(bytes([i]) * 100) for i in range(3)]
    await first.record(lanes[0], None, opens_round=True, ends_round=False)
    await first.record(lanes[1], None, opens_round=False, ends_round=False)
    assert first.tags.latest == broadcast_tag(before)  # a round half out is not a place to resume from
    assert first.log is not None and first.log.last_broadcast().tobytes() == before.tobytes()
    await first.record(lanes[2], None, opens_round=False, ends_round=True)
    assert first.tags.latest == broadcast_tag(lanes[2]) and first.tags.previous == broadcast_tag(before)
    assert first.log.last_broadcast().tobytes() == b"".join(lane.tobytes() for lane in lanes)

    second = resumption(tmp_path)
    second.restore()
    again = second.answer(1, "relay b", Resume(broadcast_tag(before), awaiting=True, resends=True))
    assert again is not None and again.tobytes() == b"".join(lane.tobytes() for lane in lanes)
    assert second.stale_host_frame(1, last_lane=False) and second.stale_host_frame(1, last_lane=False)
    assert second.stale_host_frame(1, last_lane=True) and not second.stale_host_frame(1)


async def test_a_lane_round_cut_short_leaves_nothing_in_the_next_rounds_record(tmp_path: Path) -> None:
    first = resumption(tmp_path)
    await first.record(broadcast(b"lane 0 of a round abandoned"), None, opens_round=True, ends_round=False)
    lanes = [broadcast(b"a" * 10), broadcast(b"b" * 10)]
    await first.record(lanes[0], None, opens_round=True, ends_round=False)
    await first.record(lanes[1], None, opens_round=False, ends_round=True)
    assert first.log is not None
    assert first.log.last_broadcast().tobytes() == lanes[0].tobytes() + lanes[1].tobytes()


async def test_with_lanes_the_windows_whole_rounds_come_back_beside_the_lane_rounds(tmp_path: Path) -> None:
    """The stats count a round per lane; the windows (checkpoints are numbered by them) count
    whole rounds: both come back as they were."""
    def in_lanes() -> Resumption:
        dead = DeadRanks(WORLD)
        stats = ControllerStats()
        windows = LaneWindows(SALT, None, None)
        return Resumption(tmp_path, salt=SALT, windows=windows, window_store=WindowStore(), checkpoint=None, membership=Membership(WORLD, 60.0), dead=dead,
                          coordinator=Coordinator(WORLD, SALT, dead), stats=stats)

    first = in_lanes()
    first.stats.rounds, first.windows.rounds = 12, 4
    first.windows.counter.restore(1, 2, RoundKind.MODEL)
    await first.record(broadcast(b"last lane"), WindowPart(0, 2))
    second = in_lanes()
    second.restore()
    assert (second.stats.rounds, second.windows.rounds) == (12, 4)
    assert (second.windows.counter.windows, second.windows.counter.model_rounds) == (1, 2)


def test_a_delta_lineage_comes_back_from_its_state_bit_for_bit() -> None:
    """x, the base (which trails x by what the downlink's code dropped), the code and the digest."""
    from flodl_trio.fold.delta import DeltaLineage, DeltaLineages
    from flodl_trio.wire.quant import DTYPE_BASE_DIGEST, DeltaCodec

    rng = np.random.default_rng(5)
    codec = DeltaCodec.parse("int8:256")
    lineages = DeltaLineages()
    lineages.window_fragment = 1
    lineage = lineages.current
    shapes = [(40, 13), (7,)]

    def params(scale: float) -> RoundFrame:
        return RoundFrame([TensorPayload(DTYPE_F32, s, (scale * rng.standard_normal(s)).astype(np.float32)) for s in shapes],
                          RoundKind.MODEL, 1.0)

    lineage.downlink_frame(params(1.0), None)  # the lineage's first round: f32
    lineage.downlink_frame(params(1.1), codec)  # a coded one: the base now trails x
    assert lineages.rounds == 2
    back = DeltaLineages()
    back.load_state_dict(lineages.state_dict(), "test")
    back.window_fragment = 1
    again = back.current
    assert again.digest == lineage.digest and again.downlink is not None and lineage.downlink is not None
    for a, b in zip(again.x, lineage.x):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(again.downlink.base, lineage.downlink.base):
        np.testing.assert_array_equal(a, b)
    # The next round codes the same bytes from either.
    step = params(1.2)
    out_a, out_b = lineage.downlink_frame(step, codec), again.downlink_frame(step, codec)
    assert [bytes(t.data) for t in out_a.tensors] == [bytes(t.data) for t in out_b.tensors]
    assert out_a.tensors[-1].dtype == DTYPE_BASE_DIGEST
    with pytest.raises(Exception, match="not a delta lineage's state"):
        DeltaLineage.from_state({"shape.0": np.array([3])}, "a bad record")


async def test_a_fragmented_window_comes_back_with_its_fragment_and_each_fragments_window_shape(tmp_path: Path) -> None:
    from flodl_trio.wire.fragment import FragmentTag

    first = resumption(tmp_path)
    tag = FragmentTag(1, 2, ((4, 3), (5,)))
    first.windows.counter.restore(9, 0, RoundKind.CONTROL, tag)
    frames = (broadcast(b"fragment 0"), broadcast(b"fragment 1"))
    state = WindowState(8, frames, broadcast(b"buffers"))
    first.window_store.restore(state, {FragmentTag(0, 2): 1, FragmentTag(1, 2): 2}, 2)
    first.stats.rounds = 30
    await first.record(broadcast(b"window 9's step counts"), WindowPart(8, 0, tag), state)

    second = resumption(tmp_path)
    second.restore()
    fragment = second.windows.counter.fragment
    assert fragment == tag and fragment is not None and fragment.shapes == tag.shapes
    assert second.window_store.window_shapes == {FragmentTag(0, 2): 1, FragmentTag(1, 2): 2}
    latest = second.window_store.latest
    assert latest is not None and [f.tobytes() for f in latest.params] == [f.tobytes() for f in frames]
    assert latest.buffers is not None and latest.buffers.tobytes() == broadcast(b"buffers").tobytes()
