"""Elastic membership with no I/O: the controller's life cycle of a rank
(:class:`Membership`), where windows end (:class:`WindowStore`), how a relay's
fold lets a returning rank in (:class:`HostFold`), and the two wire additions
(``RankJoin``, the state request and reply)."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import pytest

from flodl_trio import (
    DTYPE_F32,
    DesyncError,
    RoundFrame,
    RoundKind,
    SchemaError,
    TensorPayload,
)
from flodl_trio.controller.membership import Membership
from flodl_trio.controller.round import WindowPart, WindowStore
from flodl_trio.errors import FramingError, HandshakeError, MacError
from flodl_trio.relay import HostFold
from flodl_trio.relay.host_fold import FoldedHostFrame
from flodl_trio.wire import EncodedFrame, SessionSalt
from flodl_trio.wire.constants import ROUND_FRAME_MAGIC
from flodl_trio.wire.fragment import FragmentTag
from flodl_trio.wire.mux import (
    DeclareDead,
    RankJoin,
    decode_control_msg,
    encode_control_msg,
)
from flodl_trio.wire.state import (
    MAX_REASON_LEN,
    STATE_ANSWER_LEN,
    STATE_REPLY_HEADER_LEN,
    STATE_REQUEST_LEN,
    JoinNonces,
    StateReply,
    StateStatus,
    decode_state_reply,
    decode_state_request,
    encode_state_challenge,
    encode_state_reply,
    encode_state_request,
    new_nonce,
)

SALT = SessionSalt(b"\x42" * 16)
OTHER = SessionSalt(b"\x17" * 16)


def frame(values: list[float], kind: RoundKind = RoundKind.MODEL, weight: float = 1.0) -> RoundFrame:
    arr = np.asarray(values, dtype="<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, arr.shape, arr)], kind, weight)


def values(f: RoundFrame) -> list[float]:
    return np.frombuffer(f.tensors[0].data, dtype="<f4").tolist()


# -- Membership -------------------------------------------------------------------------------


def test_membership_life_cycle_live_dead_joining_live():
    m = Membership(4, rejoin_timeout=10)
    assert m.phase(3, dead=False) == "live"
    m.died(3, now=100.0)
    assert m.phase(3, dead=True) == "dead"
    assert m.refusal(3, 105.0, dead=True) is None
    m.ask(3, seat=7)
    assert m.phase(3, dead=True) == "dead"  # one half of the return: not joining yet
    assert m.ready() == []
    m.wait_for_state(3)
    assert m.phase(3, dead=True) == "joining"
    assert m.ready() == [(3, 7)] and m.entering() == []  # its state is on its way
    m.prime(3)
    assert m.phase(3, dead=True) == "primed" and m.entering() == [(3, 7)]
    m.rejoined(3)
    assert m.ready() == [] and m.rejoins == 1 and 3 not in m.died_at


def test_membership_halves_may_come_in_either_order_and_either_withdraws_the_return():
    m = Membership(4, rejoin_timeout=10)
    m.wait_for_state(1)
    m.ask(1, seat=2)
    assert m.ready() == [(1, 2)]
    m.prime(1)
    m.withdraw(1)
    assert m.ready() == [] and m.entering() == [] and m.phase(1, dead=True) == "dead"
    m.prime(1)  # a receipt for a return that was called off primes nothing
    assert m.primed == set()


def test_membership_refusals_say_why():
    m = Membership(4, rejoin_timeout=10)
    assert "is live" in m.refusal(0, 0.0, dead=False)
    assert "switched off" in Membership(4).refusal(0, 0.0, dead=True)
    m.died(2, now=0.0)
    assert m.refusal(2, 10.0, dead=True) is None
    assert "longer than rejoin_timeout 10 s" in m.refusal(2, 10.5, dead=True)


def test_membership_a_relay_leaving_calls_off_the_returns_it_asked_for():
    m = Membership(4, rejoin_timeout=10)
    m.ask(1, seat=5)
    m.ask(2, seat=6)
    m.wait_for_state(1)
    m.wait_for_state(2)
    assert m.seat_gone(5) == [1]
    assert m.ready() == [(2, 6)]


def test_membership_finish_deadline_waits_for_the_last_rejoin_window():
    m = Membership(2, rejoin_timeout=10)
    m.joined(0)
    m.joined(1)
    assert m.finish_deadline([0]) is None  # a rank is live
    m.died(0, now=1.0)
    m.died(1, now=4.0)
    assert m.finish_deadline([0, 1]) == 14.0
    assert Membership(2).finish_deadline([0, 1]) == -math.inf  # rejoining off: done at once


def test_membership_only_a_rank_that_joined_and_did_not_say_it_finished_may_hold_the_run_open():
    m = Membership(3, rejoin_timeout=10)
    assert not m.final(0)  # still forming: a rank killed while starting may come back
    m.formed = True
    assert m.final(0)  # a round ran and nobody called join(): deaths are final, as in flodl
    m.joined(0)
    m.joined(1)
    assert not m.final(2)  # rank 2 was not seen leaving: it may have been killed starting
    m.left_plainly(2)  # rank 2 closed its connection without calling join(): final
    for rank in range(3):
        m.died(rank, now=0.0)
    assert m.finish_deadline([0, 1, 2]) == 10.0
    m.said_finished(0)
    assert m.final(0) and m.final(2) and not m.final(1)
    assert "finished its training" in m.refusal(0, 1.0, dead=True)
    m.said_finished(1)
    assert m.finish_deadline([0, 1, 2]) == -math.inf  # nobody can come back: done now


def test_membership_death_time_is_the_first_one():
    m = Membership(2, rejoin_timeout=10)
    m.died(0, now=1.0)
    m.died(0, now=9.0)
    assert m.died_at[0] == 1.0


# -- WindowStore ------------------------------------------------------------------------------


def encoded(tag: bytes, weight: float = 1.0) -> EncodedFrame:
    """A stand-in consensus frame: a RoundFrame header (the store reads its weight), then ``tag``."""
    header = struct.pack("<IIBd", ROUND_FRAME_MAGIC, 1, 0, weight)
    return EncodedFrame([header, tag], len(header) + len(tag))


def kept_tags(frames: Sequence[EncodedFrame]) -> list[bytes]:
    return [frame.chunks[-1] for frame in frames]


def feed(store: WindowStore, window: int, model_rounds: int) -> list[bool]:
    ends = [store.keep(WindowPart(window, 0), encoded(b"c%d" % window))]
    for index in range(1, model_rounds + 1):
        ends.append(store.keep(WindowPart(window, index), encoded(b"w%dr%d" % (window, index))))
    return ends


def test_window_store_learns_the_window_shape_then_names_each_windows_last_round():
    store = WindowStore()
    assert feed(store, 0, 2) == [False, False, False]  # shape unknown during the first window
    assert store.latest is None
    assert feed(store, 1, 2) == [False, False, True]  # window 1's buffers round ends it
    assert store.latest is not None and store.latest.window == 1
    assert kept_tags(store.latest.params) == [b"w1r1"] and kept_tags([store.latest.buffers]) == [b"w1r2"]


def test_window_store_without_buffers_a_window_is_one_model_round():
    store = WindowStore()
    feed(store, 0, 1)
    store.keep(WindowPart(1, 0), encoded(b"c1"))  # window 0 completes at window 1's Control round
    assert store.latest.window == 0 and store.model_rounds_per_window == 1
    assert store.keep(WindowPart(1, 1), encoded(b"w1r1"))
    assert store.latest.window == 1 and store.latest.buffers is None


def test_window_store_a_window_of_another_shape_still_completes_at_the_next_control_round():
    store = WindowStore()
    feed(store, 0, 2)
    feed(store, 1, 2)
    assert feed(store, 2, 1) == [False, False]  # one model round where two were expected
    store.keep(WindowPart(3, 0), encoded(b"c3"))
    assert store.latest.window == 2 and store.latest.buffers is None
    assert store.model_rounds_per_window == 1


def feed_fragment(store: WindowStore, window: int, fragment: FragmentTag, model_rounds: int) -> list[bool]:
    ends = [store.keep(WindowPart(window, 0, fragment), encoded(b"c%d" % window))]
    for index in range(1, model_rounds + 1):
        ends.append(store.keep(WindowPart(window, index, fragment), encoded(b"w%dr%d" % (window, index))))
    return ends


def test_window_store_with_fragments_keeps_each_fragments_newest_and_the_buffers():
    """Three fragments, the buffers with the last: each fragment's window shape is learned
    on its own; the state is complete (a boundary for joiners) once every fragment had one."""
    store = WindowStore()
    tags = [FragmentTag(i, 3) for i in range(3)]
    ends = [feed_fragment(store, w, tags[w % 3], 2 if w % 3 == 2 else 1) for w in range(6)]
    # Shapes unknown in the first cycle; in the second each window's last round is named.
    assert ends[:3] == [[False, False], [False, False], [False, False, False]]
    assert ends[3:5] == [[False, True], [False, True]]  # fragment 2 had no complete state before window 5
    assert ends[5] == [False, False, True]
    state = store.latest
    assert state is not None and state.window == 5
    assert kept_tags(state.params) == [b"w3r1", b"w4r1", b"w5r1"]
    assert kept_tags([state.buffers]) == [b"w5r2"]
    assert kept_tags(state.frames) == [b"w3r1", b"w4r1", b"w5r1", b"w5r2"]
    # The next fragment-0 window replaces only fragment 0's frame; the buffers stay the newest.
    assert feed_fragment(store, 6, tags[0], 1) == [False, True]
    assert kept_tags(store.latest.frames) == [b"w6r1", b"w4r1", b"w5r1", b"w5r2"]


def test_window_store_keeps_the_frames_before_a_window_with_no_work_under_its_index():
    """A window whose accepted mass is 0 left every rank with what it had: the store keeps
    the window before's params and buffers (what a joiner must load) as its state."""
    store = WindowStore()
    feed(store, 0, 2)
    feed(store, 1, 2)
    store.keep(WindowPart(2, 0), encoded(b"c2"))
    store.keep(WindowPart(2, 1), encoded(b"w2r1", weight=0.0))
    assert store.keep(WindowPart(2, 2), encoded(b"w2r2", weight=0.0))
    assert store.latest.window == 2
    assert kept_tags(store.latest.frames) == [b"w1r1", b"w1r2"]
    feed(store, 3, 2)
    assert kept_tags(store.latest.frames) == [b"w3r1", b"w3r2"]


def test_window_store_with_fragments_keeps_a_fragments_frame_before_a_window_with_no_work():
    store = WindowStore()
    fragment = [FragmentTag(i, 2) for i in range(2)]
    for window in range(4):
        feed_fragment(store, window, fragment[window % 2], 1)
    store.keep(WindowPart(4, 0, fragment[0]), encoded(b"c4"))
    assert store.keep(WindowPart(4, 1, fragment[0]), encoded(b"w4r1", weight=0.0))
    assert store.latest.window == 4 and kept_tags(store.latest.frames) == [b"w2r1", b"w3r1"]



def test_window_store_ends_a_first_window_whose_shape_it_never_learned_once_every_rank_died():
    """The first window's end cannot be named at its last round (its shape is learned at
    the next Control round); with every rank dead none comes, and the window ends then."""
    store = WindowStore()
    assert not store.end_unnamed_window()  # no window yet
    store.keep(WindowPart(0, 0), encoded(b"c0"))
    assert not store.end_unnamed_window()  # no Model round went out: nothing to end
    assert not store.keep(WindowPart(0, 1), encoded(b"w0r1"))
    assert not store.keep(WindowPart(0, 2), encoded(b"w0r2"))
    assert store.latest is None
    assert store.end_unnamed_window()
    assert store.latest.window == 0 and kept_tags(store.latest.frames) == [b"w0r1", b"w0r2"]
    assert not store.end_unnamed_window()  # once
    assert store.model_rounds_per_window is None  # (not learned from a window that may have been cut short)


def test_window_store_leaves_a_window_of_known_shape_cut_short_to_be_abandoned():
    store = WindowStore()
    feed(store, 0, 2)
    feed(store, 1, 2)
    store.keep(WindowPart(2, 0), encoded(b"c2"))
    store.keep(WindowPart(2, 1), encoded(b"w2r1"))  # every rank dies before the buffers round
    assert not store.end_unnamed_window()
    assert store.latest.window == 1

# -- HostFold: a rank coming back -------------------------------------------------------------


def returning_rank_1() -> HostFold:
    """A two-rank host whose rank 1 left and has just reconnected."""
    fold = HostFold("h0", [0, 1])
    fold.mark_dead(1)
    fold.rejoin(1)
    return fold


def end_window_letting_rank_1_in(fold: HostFold) -> FoldedHostFrame | None:
    """Rank 0 alone closes the window's last round; the controller's RankJoin for rank 1
    comes just before that round's consensus. Returns what entering folded."""
    assert fold.deposit(0, frame([1.0])) is not None
    fold.host_frame_sent()
    assert fold.approve(1)
    assert fold.consensus_arrived() == [0]  # the joiner is not owed that consensus
    return fold.enter_approved()


def test_host_fold_a_returning_rank_enters_with_the_round_after_the_windows_last_consensus():
    fold = returning_rank_1()
    assert fold.live == {0}
    assert end_window_letting_rank_1_in(fold) is None
    assert fold.live == {0, 1}
    # The next window's Control round needs both.
    assert fold.deposit(0, frame([1.0], RoundKind.CONTROL)) is None
    folded = fold.deposit(1, frame([2.0], RoundKind.CONTROL))
    assert folded is not None and values(folded.frame) == [3.0]


def test_host_fold_a_joiners_early_frame_is_held_and_folded_into_the_window_start():
    fold = returning_rank_1()
    assert fold.deposit(1, frame([5.0], RoundKind.CONTROL)) is None  # not let in yet: held
    assert end_window_letting_rank_1_in(fold) is None  # held frame folded; rank 0's is still missing
    folded = fold.deposit(0, frame([1.0], RoundKind.CONTROL))
    assert folded is not None and values(folded.frame) == [6.0]


def test_host_fold_a_joiners_first_frame_must_open_a_window():
    fold = returning_rank_1()
    with pytest.raises(SchemaError, match="rank 1 comes back with a MODEL frame"):
        fold.deposit(1, frame([5.0]))
    end_window_letting_rank_1_in(fold)
    with pytest.raises(SchemaError, match="rank 1 comes back"):
        fold.deposit(1, frame([5.0]))


def test_host_fold_a_joiner_sending_twice_before_it_is_let_in_is_a_desync():
    fold = returning_rank_1()
    fold.deposit(1, frame([5.0], RoundKind.CONTROL))
    with pytest.raises(DesyncError, match="rank 1 sent a second frame"):
        fold.deposit(1, frame([5.0], RoundKind.CONTROL))


def test_host_fold_a_joiner_that_leaves_again_is_forgotten():
    fold = returning_rank_1()
    fold.deposit(1, frame([5.0], RoundKind.CONTROL))
    fold.mark_dead(1)
    assert not fold.approve(1)  # an approval that arrives late changes nothing
    assert fold.held == {} and fold.live == {0}
    assert fold.deposit(0, frame([1.0])) is not None


# -- the wire additions -----------------------------------------------------------------------


def test_rank_join_round_trips_and_is_not_a_flodl_variant():
    payload = encode_control_msg(RankJoin(300))
    assert payload[0] == 200  # flodl's variants are 0..3
    assert decode_control_msg(payload) == RankJoin(300)
    assert encode_control_msg(DeclareDead(3)) == bytes([3, 3])  # flodl's bytes unchanged
    with pytest.raises(FramingError):
        decode_control_msg(payload + b"\x00")


def test_state_request_round_trip_and_refusals():
    nonce = new_nonce()
    raw = encode_state_request(3, 4, nonce, SALT)
    assert len(raw) == STATE_REQUEST_LEN
    request = decode_state_request(raw, 4, SALT)
    assert (request.rank, request.world_size, request.nonce) == (3, 4, nonce)
    with pytest.raises(MacError, match="state request from rank 3"):
        decode_state_request(raw, 4, OTHER)
    with pytest.raises(HandshakeError, match="announced world_size 4, this side was started with 8"):
        decode_state_request(raw, 8, SALT)
    with pytest.raises(HandshakeError, match="outside world_size"):
        decode_state_request(encode_state_request(9, 4, nonce, SALT), 4, SALT)
    with pytest.raises(HandshakeError, match="39 bytes, want exactly 40"):
        decode_state_request(raw[:-1], 4, SALT)


def test_state_reply_is_bound_to_the_joins_nonces():
    nonces = JoinNonces(new_nonce(), new_nonce())
    reply = StateReply(StateStatus.OK, 7, 2, lengths=(1 << 20, 4096))
    raw = encode_state_reply(reply, nonces, SALT)
    header, tail = raw[:STATE_REPLY_HEADER_LEN], raw[STATE_REPLY_HEADER_LEN:]
    assert decode_state_reply(header, tail, nonces, SALT) == reply
    forged = tail[:-12] + (2 << 20).to_bytes(4, "little") + tail[-8:]  # a bigger announced frame
    with pytest.raises(MacError):
        decode_state_reply(header, forged, nonces, SALT)
    with pytest.raises(MacError):
        decode_state_reply(header, tail, JoinNonces(new_nonce(), nonces.controller), SALT)  # an old reply, replayed
    with pytest.raises(MacError):
        decode_state_reply(header, tail, nonces, OTHER)


def test_state_reply_carries_a_refusal_reason_under_its_mac():
    nonces = JoinNonces(new_nonce(), new_nonce())
    raw = encode_state_reply(StateReply.refused("rank 2 is live"), nonces, SALT)
    header, tail = raw[:STATE_REPLY_HEADER_LEN], raw[STATE_REPLY_HEADER_LEN:]
    reply = decode_state_reply(header, tail, nonces, SALT)
    assert reply.status is StateStatus.REFUSED and reply.reason == "rank 2 is live"
    forged = tail[:5] + b"X" + tail[6:]
    with pytest.raises(MacError):
        decode_state_reply(header, forged, nonces, SALT)
    long = encode_state_reply(StateReply.refused("x" * 5000), nonces, SALT)
    assert len(long) == STATE_REPLY_HEADER_LEN + MAX_REASON_LEN + 8


@pytest.mark.parametrize(
    ("window", "frames", "message"),
    [(-1, 1, "window -1 with 1 frames"), (3, 0, "window 3 with 0 frames"), (3, 258, "window 3 with 258 frames"),
     (-2, 0, "window -2")],
)
def test_state_reply_header_shapes_that_cannot_be(window, frames, message):
    nonces = JoinNonces(new_nonce(), new_nonce())
    raw = encode_state_reply(StateReply(StateStatus.OK, window, frames, lengths=(100,) * frames), nonces, SALT)
    with pytest.raises(HandshakeError, match=message):
        decode_state_reply(raw[:STATE_REPLY_HEADER_LEN], raw[STATE_REPLY_HEADER_LEN:], nonces, SALT)


async def test_a_state_frame_whose_length_differs_from_the_announced_one_is_refused_before_buffering():
    """A hostile reply announces a small frame under its MAC, then sends another length."""
    import trio
    import trio.testing

    from flodl_trio.client import fetch_cluster_state
    from flodl_trio.transport.settings import NetBounds

    client_end, server_end = trio.testing.memory_stream_pair()

    async def connect(host: str, port: int) -> trio.abc.Stream:
        return client_end

    async def hostile_controller() -> None:
        request = b""
        while len(request) < STATE_REQUEST_LEN:
            request += await server_end.receive_some(STATE_REQUEST_LEN - len(request))
        nonces = JoinNonces(decode_state_request(request, 4, SALT).nonce, new_nonce())
        await server_end.send_all(encode_state_challenge(nonces, SALT))
        answer = b""
        while len(answer) < STATE_ANSWER_LEN:
            answer += await server_end.receive_some(STATE_ANSWER_LEN - len(answer))
        await server_end.send_all(encode_state_reply(StateReply(StateStatus.OK, 3, 1, lengths=(64,)), nonces, SALT))
        await server_end.send_all((1 << 30).to_bytes(4, "little"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hostile_controller)
        with pytest.raises(FramingError, match="1073741824 bytes, the reply announced 64"):
            await fetch_cluster_state("relay", 1, 3, 4, SALT, bounds=NetBounds(), connect=connect)
