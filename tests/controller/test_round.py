"""The controller's round object, with no I/O: plain function calls, no trio, no sockets.

:class:`ControllerRound` is the controller's round (who must deliver, who
delivered, the accepted mass, what goes to whom). Every decision the
controller's tasks act on is made here, so it is tested here directly.
"""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio import (
    DTYPE_BF16,
    DTYPE_F32,
    DesyncError,
    HandshakeError,
    RoundFrame,
    RoundKind,
    SchemaError,
    TensorPayload,
)
from flodl_trio.controller import ControllerRound, ControllerStats, DeadRanks
from flodl_trio.controller.round import Consensus, OuterSchemaRefused
from flodl_trio.controller.seats import Seats
from flodl_trio.wire import (
    EncodedFrame,
    Hello,
    MuxKind,
    SessionSalt,
    encode_round_frame,
)

SALT = SessionSalt(b"\x42" * 16)


def frame(values: list[float], weight: float = 1.0, kind: RoundKind = RoundKind.MODEL) -> RoundFrame:
    arr = np.asarray(values, dtype="<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, arr.shape, arr)], kind, weight)


def values(f: RoundFrame) -> list[float]:
    return np.frombuffer(f.tensors[0].data, dtype="<f4").tolist()


# -- ControllerRound -----------------------------------------------------------------------------


def controller_round(world: int = 4, **hooks) -> tuple[ControllerRound, DeadRanks, ControllerStats]:
    dead, stats = DeadRanks(world), ControllerStats()
    return ControllerRound(Seats(world, dead), stats, **hooks), dead, stats


def seat(round_: ControllerRound, seat_id: int, host: str, ranks: tuple[int, ...]) -> None:
    hello = Hello(host, ranks)
    round_.seats.check_hello(hello)
    round_.seats.seat(seat_id, hello, f"relay {host}")


def test_controller_round_completes_when_every_live_rank_is_delivered_and_divides_once():
    r, _dead, stats = controller_round()
    seat(r, 1, "a", (0, 1))
    seat(r, 2, "b", (2, 3))
    assert r.accepts_host_frame(1)
    assert r.deposit(1, frame([2, 4], weight=2.0), now=10.0) is None
    assert not r.completes(None) and r.completes(2)
    consensus = r.deposit(2, frame([6, 8], weight=2.0), now=10.5)
    assert isinstance(consensus, Consensus) and isinstance(consensus.outgoing, RoundFrame)
    assert values(consensus.outgoing) == [2, 3] and consensus.outgoing.weight == 4.0
    assert stats.rounds == 1 and stats.last_mass == 4.0
    assert stats.round_seconds.total == pytest.approx(0.5)


def test_controller_round_a_host_frame_with_a_schema_no_round_completed_with_costs_its_relay_alone():
    r, dead, stats = controller_round(world=6)
    seat(r, 1, "a", (0, 1))
    seat(r, 2, "b", (2, 3))
    seat(r, 3, "c", (4, 5))
    for sid in (1, 2, 3):  # a completed round of 2-element frames
        consensus = r.deposit(sid, frame([1, 1], weight=2.0), now=0.0)
    assert consensus is not None
    for sid in (1, 2, 3):
        r.broadcast_going_out(sid)
    assert r.deposit(1, frame([1, 2, 3], weight=2.0), now=1.0) is None  # relay a is wrong, and first
    assert r.deposit(2, frame([4, 8], weight=2.0), now=1.1) is None  # relay b is right
    expelled = r.take_expelled()
    assert list(expelled) == [1] and "tensor 0 of shape [3], not [2]" in expelled[1] and "relay b sent it" in expelled[1]
    assert r.deposit(3, frame([8, 4], weight=2.0), now=1.2) is None  # a's ranks still live: the round waits
    dead.declare_dead(0)
    dead.declare_dead(1)
    consensus = r.rank_died(now=1.5)
    assert consensus is not None and values(consensus.outgoing) == [3, 3] and consensus.outgoing.weight == 4.0
    assert stats.rounds == 2


def test_controller_round_before_any_round_completed_the_first_host_frame_still_decides():
    r, _dead, _stats = controller_round()
    seat(r, 1, "a", (0, 1))
    seat(r, 2, "b", (2, 3))
    r.deposit(1, frame([1, 2, 3]), now=0.0)
    with pytest.raises(SchemaError, match="relay b"):
        r.deposit(2, frame([1, 2]), now=0.0)
    assert r.take_expelled() == {}


def test_agreed_schemas_keep_the_most_recent_and_name_the_first_difference():
    from flodl_trio.fold.schemas import AgreedSchemas, describe_difference, schema_of

    agreed = AgreedSchemas(limit=2)
    a, b, c = (schema_of(frame([0.0] * n)) for n in (1, 2, 3))
    for s in (a, b, a, c):  # a was seen again after b: b is the oldest when c comes
        agreed.agree(s)
    assert a in agreed and c in agreed and b not in agreed and len(agreed) == 2
    assert agreed.folded_frames_at_fault(b, a) and not agreed.folded_frames_at_fault(a, b)
    assert not agreed.folded_frames_at_fault(None, a) and not agreed.folded_frames_at_fault(a, a)
    assert describe_difference(schema_of(frame([0.0], kind=RoundKind.CONTROL)), a) == "a CONTROL frame, not MODEL"
    two = RoundFrame([frame([0.0]).tensors[0]] * 2, RoundKind.MODEL, 1.0)
    assert describe_difference(schema_of(two), a) == "2 tensors, not 1"
    bf16 = RoundFrame([TensorPayload(DTYPE_BF16, (1,), b"\0\0")], RoundKind.MODEL, 1.0)
    assert describe_difference(schema_of(bf16), a) == "tensor 0 in bf16, not f32"


def test_controller_round_a_death_completes_the_round_without_that_host():
    r, dead, _stats = controller_round()
    seat(r, 1, "a", (0, 1))
    seat(r, 2, "b", (2, 3))
    assert r.deposit(1, frame([4], weight=2.0), now=0.0) is None
    dead.declare_dead(2)
    assert r.rank_died(now=1.0) is None  # rank 3 is still owed
    dead.declare_dead(3)
    consensus = r.rank_died(now=2.0)
    assert consensus is not None and values(consensus.outgoing) == [2]  # divided by the accepted mass 2


def test_controller_round_a_rank_no_relay_carries_holds_the_round_until_declared_dead():
    r, dead, _stats = controller_round(world=3)
    seat(r, 1, "a", (0, 1))
    assert r.deposit(1, frame([3]), now=0.0) is None
    assert not r.completes(None)
    dead.declare_dead(2)
    consensus = r.rank_died(now=1.0)
    assert consensus is not None and values(consensus.outgoing) == [3]


def test_controller_round_desync_and_late_frames():
    r, dead, _stats = controller_round(world=2)
    seat(r, 1, "a", (0,))
    seat(r, 2, "b", (1,))
    r.deposit(1, frame([1]), now=0.0)
    with pytest.raises(DesyncError, match="before the consensus of its previous one"):
        r.accepts_host_frame(1)
    dead.declare_dead(1)
    assert not r.accepts_host_frame(2)  # all its ranks are dead: a late frame, dropped


def test_controller_round_a_broadcast_going_out_lets_the_next_frame_in():
    r, _dead, _stats = controller_round(world=1)
    seat(r, 1, "a", (0,))
    consensus = r.deposit(1, frame([5]), now=0.0)
    assert consensus is not None
    with pytest.raises(DesyncError):
        r.accepts_host_frame(1)
    assert r.seats.broadcast_targets() == [1]
    r.broadcast_going_out(1)
    assert r.accepts_host_frame(1)


def test_controller_round_broadcast_targets_skip_gone_relays_and_relays_with_only_dead_ranks():
    r, dead, _stats = controller_round()
    seat(r, 1, "a", (0, 1))
    seat(r, 2, "b", (2,))
    seat(r, 3, "c", (3,))
    dead.declare_dead(2)
    r.seats.unseat(3)
    assert r.seats.broadcast_targets() == [1]
    assert r.seats.seat_of(3) is None and r.seats.seat_of(0) == 1


def test_controller_round_refuses_a_hello_for_ranks_already_carried():
    r, _dead, _stats = controller_round()
    seat(r, 1, "a", (0, 1))
    with pytest.raises(HandshakeError, match=r"rank 1, already carried by relay a"):
        r.seats.check_hello(Hello("b", (1, 2)))
    with pytest.raises(HandshakeError, match=r"rank 4 >= world_size 4"):
        r.seats.check_hello(Hello("b", (4,)))
    with pytest.raises(HandshakeError, match="not sorted and unique"):
        r.seats.check_hello(Hello("b", (3, 2)))


def test_controller_round_outer_optimizer_sees_only_the_params_round_of_each_window():
    seen: list[RoundKind] = []

    def outer(consensus: RoundFrame) -> RoundFrame:
        seen.append(consensus.kind)
        return frame([v * 10 for v in values(consensus)], consensus.weight)

    checkpoints: list[tuple[int, RoundKind]] = []
    r, _dead, _stats = controller_round(world=1, outer_optimizer=outer,
                                        checkpoint=lambda i, c: checkpoints.append((i, c.kind)))
    seat(r, 1, "a", (0,))
    kinds = [RoundKind.CONTROL, RoundKind.MODEL, RoundKind.MODEL]
    outgoing = []
    for kind in kinds:
        consensus = r.deposit(1, frame([1], kind=kind), now=0.0)
        assert consensus is not None and consensus.after_write is None  # a hook may keep it
        outgoing.append(values(consensus.outgoing))
        r.broadcast_going_out(1)
    assert seen == [RoundKind.MODEL]  # the params round only
    assert outgoing == [[1], [10], [1]]
    assert checkpoints == [(1, RoundKind.CONTROL), (2, RoundKind.MODEL), (3, RoundKind.MODEL)]


def test_controller_round_never_speculates_on_a_params_round_the_outer_optimizer_transforms():
    r, _dead, _stats = controller_round(world=1, outer_optimizer=lambda consensus: consensus)
    seat(r, 1, "a", (0,))
    assert r.may_speculate(1, MuxKind.HOST_FRAME)  # no window open yet
    r.deposit(1, frame([1], kind=RoundKind.CONTROL), now=0.0)
    r.broadcast_going_out(1)
    assert not r.may_speculate(1, MuxKind.HOST_FRAME)  # the next round is the params round
    assert not r.may_speculate(1, MuxKind.CONTROL)


def test_controller_round_without_hooks_gives_the_consensus_memory_back_after_writing():
    r, _dead, stats = controller_round(world=1)
    seat(r, 1, "a", (0,))
    first = r.deposit(1, frame([1, 2]), now=0.0)
    assert first is not None and first.after_write is not None
    first.after_write()  # every relay was written it: its images may be reused
    r.broadcast_going_out(1)
    r.deposit(1, frame([3, 4]), now=1.0)
    assert stats.fold_images_reused == 1


def test_controller_round_speculation_commits_only_over_the_same_round():
    r, dead, stats = controller_round(world=2)
    seat(r, 1, "a", (0,))
    seat(r, 2, "b", (1,))
    r.deposit(1, frame([1, 2]), now=0.0)
    assert r.is_last(2) and not r.is_last(1)
    incoming = encode_round_frame(frame([3, 4]), SALT)
    speculative = r.begin_speculation(in_length=len(incoming))
    assert speculative is not None
    speculative.consume(memoryview(incoming))
    assert speculative.complete
    record = EncodedFrame([b"signed-ahead"], 12)
    dead.declare_dead(0)  # rank 0's frame, folded before it died, still counts ...
    consensus = r.commit_speculation(2, speculative, record, now=1.0)
    assert consensus is not None and consensus.outgoing is record  # ... and the fold is the same one
    assert values(speculative.frame()) == [2, 3] and stats.last_mass == 2.0
    assert stats.rounds_finished_ahead == 1
    again = r.begin_speculation(in_length=39)
    assert again is None  # nothing folded in the new round: the size is unknown


def test_controller_round_speculation_over_an_older_fold_is_refused():
    r, _dead, _stats = controller_round(world=2)
    seat(r, 1, "a", (0,))
    seat(r, 2, "b", (1,))
    r.deposit(1, frame([1]), now=0.0)
    speculative = r.begin_speculation(in_length=35)
    assert speculative is not None
    r.deposit(2, frame([1]), now=0.5)  # the ordinary path closed the round first
    assert r.commit_speculation(2, speculative, EncodedFrame([b"x"], 1), now=1.0) is None
    r.give_back(speculative)


def test_an_outer_optimizer_that_refuses_the_consensus_is_the_controllers_error_not_the_relays():
    """A schema the outer optimizer cannot take is no relay's fault: the error is the
    controller's own OuterSchemaRefused (it stops the controller, and is the SchemaError
    the docs promise), which the relay's reader lets through rather than dropping the
    relay whose frame happened to close the round."""

    def outer(consensus: RoundFrame) -> RoundFrame:
        raise SchemaError("params changed shape between windows")

    r, _dead, _stats = controller_round(world=1, outer_optimizer=outer)
    seat(r, 1, "a", (0,))
    r.deposit(1, frame([1], kind=RoundKind.CONTROL), now=0.0)
    r.broadcast_going_out(1)
    with pytest.raises(OuterSchemaRefused, match="outer optimizer refused") as info:
        r.deposit(1, frame([1]), now=1.0)
    assert isinstance(info.value, SchemaError)


def test_controller_round_in_host_order_waits_for_the_first_relay_the_round_needs():
    r, dead, _stats = controller_round(6)
    seat(r, 9, "c", (4, 5))  # seat ids and connection order do not set the order: lowest ranks do
    seat(r, 7, "b", (2, 3))
    seat(r, 8, "a", (0, 1))
    assert r.may_fold_now(8) and not r.may_fold_now(7) and not r.may_fold_now(9)
    r.deposit(8, frame([1.0]), now=0.0)
    assert r.may_fold_now(7) and not r.may_fold_now(9)
    assert r.may_fold_now(8)  # already in: a second frame must reach the desync check
    dead.declare_dead(2)
    dead.declare_dead(3)
    r.rank_died(now=1.0)
    assert r.may_fold_now(9)  # a relay whose ranks are all dead is not waited for


def test_every_lanes_round_reads_one_seats_registry():
    dead = DeadRanks(4)
    seats = Seats(4, dead)
    lanes = [ControllerRound(seats, ControllerStats(), computes_ahead=False) for _ in range(3)]
    hello = Hello("a", (0, 1))
    seats.check_hello(hello)
    seats.seat(1, hello, "relay a")
    seats.seat(2, Hello("b", (2, 3)), "relay b")
    for lane in lanes:  # seated once, waited for by every lane
        assert lane.deposit(1, frame([1.0]), now=0.0) is None
    seats.unseat(2)
    dead.declare_dead(2)
    dead.declare_dead(3)
    assert all(lane.rank_died(now=1.0) is not None for lane in lanes)  # one unseat ends every lane's round
    with pytest.raises(HandshakeError, match="already carried by relay a"):
        seats.check_hello(Hello("c", (1,)))
    assert seats.check_hello(Hello("b2", (2, 3))) is None  # relay b's connection is gone: its ranks are free


def test_one_lane_of_several_never_computes_its_consensus_ahead():
    dead = DeadRanks(1)
    seats = Seats(1, dead)
    seats.seat(1, Hello("a", (0,)), "relay a")
    assert ControllerRound(seats, ControllerStats()).may_speculate(1, MuxKind.HOST_FRAME)
    assert not ControllerRound(seats, ControllerStats(), computes_ahead=False).may_speculate(1, MuxKind.HOST_FRAME)


def test_a_relay_that_delivered_gets_the_consensus_even_if_its_ranks_died_since():
    """The chaos run that hung (seed 785966779): host b's rank 2 sent its frame and exited, its
    rank 3 was being let back in; the consensus skipped b (no live rank), so b never saw the
    window start its returning rank waited for, and the cluster's next window never ended."""
    r, dead, _stats = controller_round()
    seat(r, 1, "a", (0, 1))
    seat(r, 2, "b", (2, 3))
    dead.declare_dead(1)
    dead.declare_dead(3)  # away: coming back
    assert r.deposit(2, frame([1.0]), now=0.0) is None
    dead.declare_dead(2)  # exits after its relay delivered
    consensus = r.deposit(1, frame([3.0]), now=0.1)
    assert consensus is not None and consensus.delivered_by == {1, 2}
    assert r.seats.broadcast_targets(consensus.delivered_by) == [1, 2]
    assert r.seats.broadcast_targets() == [1]  # without the delivery, b would be skipped
    r.seats.unseat(2)
    assert r.seats.broadcast_targets(consensus.delivered_by) == [1]  # a gone relay gets nothing


def test_window_store_catch_up_frames_between_a_joiners_state_and_its_entry():
    from flodl_trio.controller.round import WindowStore
    from flodl_trio.wire.round_frame import EncodedFrame

    store = WindowStore()
    assert store.catch_up_between(2, 6) == []  # not a delta run: nothing to send
    frames = {w: EncodedFrame([bytes([w])], 1) for w in range(20)}
    for window in range(12):
        store.keep_catch_up(window, frames[window])
    assert store.catch_up_between(10, 11) == []  # entered right after its state
    assert store.catch_up_between(7, 11) == [frames[8], frames[9], frames[10]]
    assert store.catch_up_between(2, 11) is None  # window 3 is no longer kept (the newest 8 are)


def test_in_lanes_a_relay_against_another_base_is_refused_on_the_lane_that_carries_the_digest():
    """A delta round's digest rides whole in its last lane: the lanes before it fold, and
    the last one names the relay and both digests (docs/wire.md, "In lanes")."""
    from flodl_trio.errors import SchemaError
    from flodl_trio.fold.delta import lane_digest_of
    from flodl_trio.wire.lanes import LaneLayout
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec, encode

    codec = DeltaCodec.parse("int8:256")
    values = np.linspace(-1, 1, 2048, dtype="<f4")
    payload = bytearray(codec.payload_bytes(values.size))
    encode(values, payload, codec.code, codec.block)
    theirs = bytes(range(DIGEST_LEN))
    whole = RoundFrame([TensorPayload(codec.tag, (2048,), payload), TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), theirs)],
                       RoundKind.MODEL, 1.0)
    lanes = LaneLayout.of(whole, 3).split(whole)
    assert [lane_digest_of(lane) for lane in lanes] == [None, None, theirs]
    dead = DeadRanks(2)
    seats = Seats(2, dead)
    seats.seat(1, Hello("a", (0, 1)), "relay a")
    rounds = [ControllerRound(seats, ControllerStats(), computes_ahead=False) for _ in lanes]
    for r in rounds[1:]:
        r.lineages = rounds[0].lineages  # one set of lineages, as rounds_and_windows shares it
    rounds[0].lineages.current.digest = b"\x01" * DIGEST_LEN  # the controller's base is another
    for r, lane in zip(rounds[:-1], lanes[:-1]):
        assert r.deposit(1, lane, now=0.0) is not None
    with pytest.raises(SchemaError, match=f"relay a's delta is against base {theirs.hex()}, the controller's is 0101"):
        rounds[-1].deposit(1, lanes[-1], now=0.0)


def test_through_shards_a_relay_against_another_base_is_refused_on_lane_0_before_the_round_is_decided():
    """Through the shards a delta round's lane 0 carries the digest (its one piece): the
    controller checks it there, before any shard is told to sum the relay's pieces
    (docs/wire.md, "Delta rounds through the shards"); a relay on the controller's base
    is taken."""
    from flodl_trio.errors import SchemaError
    from flodl_trio.fold.delta import lane_digest_of
    from flodl_trio.wire.lanes import LaneLayout, goes_through_shards
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec

    codec = DeltaCodec.parse("int8:256")
    theirs, ours = bytes(range(DIGEST_LEN)), b"\x01" * DIGEST_LEN
    schema = ((codec.tag, (4096,)), (DTYPE_BASE_DIGEST, (DIGEST_LEN,)))
    assert goes_through_shards(schema, 8) and not goes_through_shards(schema, 7)  # 8 x 8 >= 64
    layout = LaneLayout.for_schema(schema, 6, lane0_empty=True)
    assert layout.lanes[0] == (layout.lanes[0][0],) and layout.lanes[0][0].tensor == 1  # the digest alone
    assert all(p.tensor == 0 for lane in layout.lanes[1:] for p in lane)  # the codes over the others

    def lane0(digest: bytes) -> RoundFrame:
        return RoundFrame([TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), digest), *layout.trailer(0)],
                          RoundKind.MODEL, 1.0)

    assert lane_digest_of(lane0(theirs)) == theirs
    dead = DeadRanks(4)
    seats = Seats(4, dead)
    seats.seat(1, Hello("a", (0, 1)), "relay a")
    seats.seat(2, Hello("b", (2, 3)), "relay b")
    round_ = ControllerRound(seats, ControllerStats(), computes_ahead=False)
    round_.lineages.current.digest = ours
    assert round_.deposit(2, lane0(ours), now=0.0) is None  # taken: relay a is still due
    with pytest.raises(SchemaError, match=f"relay a's delta is against base {theirs.hex()}, the controller's is 0101"):
        round_.deposit(1, lane0(theirs), now=0.0)
