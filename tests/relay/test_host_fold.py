"""The relay's round object, with no I/O: plain function calls, no trio, no sockets.

:class:`HostFold` is the relay's round (who must deposit, who is owed the
consensus). Every decision the relay's tasks act on is made here, so it is
tested here directly.
"""

from __future__ import annotations

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
from flodl_trio.fold import FoldAccumulator
from flodl_trio.relay import HostFold
from flodl_trio.wire import (
    SessionSalt,
)

SALT = SessionSalt(b"\x42" * 16)


def frame(values: list[float], weight: float = 1.0, kind: RoundKind = RoundKind.MODEL) -> RoundFrame:
    arr = np.asarray(values, dtype="<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, arr.shape, arr)], kind, weight)


def values(f: RoundFrame) -> list[float]:
    return np.frombuffer(f.tensors[0].data, dtype="<f4").tolist()


# -- HostFold ---------------------------------------------------------------------------------


def test_host_fold_ships_once_every_live_rank_deposited():
    fold = HostFold("h0", [0, 1, 2])
    assert fold.deposit(0, frame([1, 2])) is None
    assert fold.deposit(1, frame([3, 4])) is None
    folded = fold.deposit(2, frame([5, 6], weight=2.0))
    assert folded is not None
    assert values(folded.frame) == [9, 12] and folded.frame.weight == 4.0  # summed, never divided
    assert fold.deposited == set()  # the next round starts empty


def test_host_fold_a_death_shrinks_the_barrier_and_can_complete_the_round():
    fold = HostFold("h0", [0, 1, 2])
    fold.deposit(0, frame([1]))
    fold.deposit(2, frame([3]))
    folded = fold.mark_dead(1)
    assert folded is not None and values(folded.frame) == [4]
    assert fold.live == {0, 2}


def test_host_fold_a_frame_folded_before_its_rank_died_stays_in_the_round():
    fold = HostFold("h0", [0, 1])
    fold.deposit(0, frame([7]))
    assert fold.mark_dead(0) is None  # rank 1 is still owed a frame
    folded = fold.deposit(1, frame([1]))
    assert folded is not None and values(folded.frame) == [8] and folded.frame.weight == 2.0


def test_host_fold_second_frame_before_the_consensus_is_a_desync_naming_the_rank():
    fold = HostFold("h7", [0, 1])
    fold.deposit(0, frame([1]))
    with pytest.raises(DesyncError, match=r"relay h7: rank 0 deposited twice"):
        fold.deposit(0, frame([1]))


def test_host_fold_owes_the_consensus_to_exactly_the_depositors_in_rank_order():
    fold = HostFold("h0", [3, 1, 2])
    fold.deposit(2, frame([1]))
    fold.deposit(3, frame([1]))
    fold.mark_dead(1)
    fold.host_frame_sent()
    assert fold.host_frame_up
    assert fold.consensus_arrived() == [2, 3]
    assert not fold.host_frame_up
    fold.deposit(2, frame([1]))  # owed nothing now: a new round's frame is fine


def test_host_fold_a_broadcast_nobody_asked_for_is_a_desync():
    fold = HostFold("h0", [0])
    with pytest.raises(DesyncError, match="did not ask for"):
        fold.consensus_arrived()


def test_host_fold_dead_ranks_are_not_owed_the_consensus():
    fold = HostFold("h0", [0, 1])
    fold.deposit(0, frame([1]))
    fold.deposit(1, frame([1]))
    fold.mark_dead(0)
    fold.host_frame_sent()
    assert fold.consensus_arrived() == [1]


def test_host_fold_single_rank_forward_keeps_the_ping_pong():
    fold = HostFold("h0", [5])
    fold.forward(5)
    with pytest.raises(DesyncError):
        fold.forward(5)
    fold.host_frame_sent()
    assert fold.consensus_arrived() == [5]
    fold.forward(5)


def test_host_fold_only_missing_and_complete_ahead():
    fold = HostFold("h0", [0, 1, 2])
    assert not fold.only_missing(2)  # nothing folded yet: the size is unknown
    fold.deposit(0, frame([1]))
    assert not fold.only_missing(2)
    fold.deposit(1, frame([1]))
    assert fold.only_missing(2)
    acc = fold.acc
    assert not fold.complete_ahead(2, FoldAccumulator())  # computed over another round's fold
    assert fold.complete_ahead(2, acc)
    assert fold.deposited == set() and fold.awaiting_reply == {0, 1, 2}


def test_host_fold_complete_ahead_refuses_when_the_round_changed():
    fold = HostFold("h0", [0, 1, 2])
    fold.deposit(0, frame([1]))
    fold.deposit(1, frame([1]))
    acc = fold.acc
    fold.mark_dead(2)  # the death completed the round without rank 2's frame
    assert not fold.complete_ahead(2, acc)


def test_host_fold_tells_its_watcher_each_time_the_barrier_moves():
    changes: list[int] = []
    fold = HostFold("h0", [0, 1], on_change=lambda: changes.append(len(fold.deposited)))
    fold.deposit(0, frame([1]))
    fold.mark_dead(1)
    assert len(changes) >= 3  # deposit, death, and the round that the death completed


def test_host_fold_schema_error_names_the_rank():
    fold = HostFold("h0", [0, 1])
    fold.deposit(0, frame([1, 2]))
    with pytest.raises(SchemaError, match="rank 1 tensor 0 has shape"):
        fold.deposit(1, frame([1, 2, 3]))


def _complete_round(fold: HostFold, f: RoundFrame) -> None:
    """Every live rank deposits ``f``; the HostFrame goes up and its consensus comes back."""
    for rank in sorted(fold.live):
        folded = fold.deposit(rank, f)
    assert folded is not None
    fold.host_frame_sent()
    fold.consensus_arrived()


def test_host_fold_a_first_frame_with_a_schema_no_round_completed_with_costs_its_sender_not_the_others():
    fold = HostFold("h0", [0, 1, 2])
    _complete_round(fold, frame([0, 0]))  # the cluster completed a round of 2-element frames
    assert fold.deposit(0, frame([1, 2, 3])) is None  # rank 0 is wrong, and first
    assert fold.deposit(1, frame([10, 20])) is None  # rank 1 is right: rank 0's part is taken out
    expelled = fold.take_expelled()
    assert list(expelled) == [0] and fold.take_expelled() == {}
    assert "rank 0's frame has tensor 0 of shape [3], not [2]" in expelled[0]
    assert "rank 1 sent it" in expelled[0]
    assert fold.deposited == {1} and 0 not in fold.awaiting_reply
    assert fold.deposit(2, frame([30, 40])) is None  # rank 0 is still live until the channel drops it
    folded = fold.mark_dead(0)
    assert folded is not None and values(folded.frame) == [40, 60] and folded.frame.weight == 2.0
    fold.host_frame_sent()
    assert fold.consensus_arrived() == [1, 2]


def test_host_fold_several_wrong_first_frames_are_all_taken_out_and_a_wrong_later_one_is_refused():
    fold = HostFold("h0", [0, 1, 2, 3])
    _complete_round(fold, frame([0, 0]))
    fold.deposit(0, frame([1, 2, 3]))
    fold.deposit(2, frame([4, 5, 6]))  # agrees with rank 0, and is as wrong
    fold.deposit(3, frame([7, 8]))
    assert sorted(fold.take_expelled()) == [0, 2]
    with pytest.raises(SchemaError, match="rank 1 tensor 0 has shape \\[1\\], rank 3 sent \\[2\\]"):
        fold.deposit(1, frame([9]))  # the round's schema is the agreed one now: a later wrong frame is its own error


def test_host_fold_before_any_round_completed_the_first_frame_still_decides():
    fold = HostFold("h0", [0, 1])
    fold.deposit(0, frame([1, 2, 3]))
    with pytest.raises(SchemaError, match="rank 1"):
        fold.deposit(1, frame([1, 2]))
    assert fold.take_expelled() == {}


def test_host_fold_a_schema_change_every_rank_makes_is_no_error():
    fold = HostFold("h0", [0, 1])
    _complete_round(fold, frame([0, 0]))
    fold.deposit(0, frame([1, 2, 3]))
    folded = fold.deposit(1, frame([1, 2, 3]))
    assert folded is not None and values(folded.frame) == [2, 4, 6] and fold.take_expelled() == {}


def test_host_fold_learns_a_schema_only_when_its_consensus_comes_back():
    fold = HostFold("h0", [0, 1])
    fold.deposit(0, frame([0, 0]))
    assert fold.deposit(1, frame([0, 0])) is not None
    fold.host_frame_sent()  # up, but no consensus yet (the controller could still drop this host)
    assert len(fold.agreed) == 0
    fold.consensus_arrived()
    assert len(fold.agreed) == 1
    _complete_round(fold, frame([0, 0], kind=RoundKind.CONTROL))
    assert len(fold.agreed) == 2  # another kind is another schema


# -- delta rounds -----------------------------------------------------------------------------


def _delta_frame(digest: bytes, value: float, weight: float = 1.0) -> RoundFrame:
    from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec, encode

    codec = DeltaCodec.parse("int8:256")
    payload = bytearray(codec.payload_bytes(300))
    encode(np.full(300, value, dtype="<f4"), payload, codec.code, codec.block)
    return RoundFrame(
        [TensorPayload(codec.tag, (300,), payload), TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), digest)],
        RoundKind.MODEL, weight,
    )


def test_a_host_of_delta_ranks_ships_its_sum_coded_again_and_learns_the_base_from_the_consensus():
    from flodl_trio.fold.delta import PendingHostDelta, codec_of, digest_of
    from flodl_trio.wire import encode_round_frame

    base = bytes(range(16))
    fold = HostFold("h", [0, 1])
    assert fold.deposit(0, _delta_frame(base, 0.5)) is None
    up = fold.deposit(1, _delta_frame(base, 0.25))
    assert up is not None and isinstance(up.frame, PendingHostDelta)  # coded as it goes up
    coded = up.frame.whole()
    assert codec_of(coded) is not None and digest_of(coded) == base
    fold.host_frame_sent()
    new_base = bytes(16 * [7])
    consensus = encode_round_frame(_delta_frame(new_base, 0.1), SALT)
    assert fold.consensus_arrived() == [0, 1]
    fold.learn_base(memoryview(consensus))
    assert fold.base_digest == new_base
    # A rank still against the old base is refused alone; one against the new one folds.
    with pytest.raises(SchemaError, match="rank 1's delta is against base .* missed a consensus"):
        fold.deposit(1, _delta_frame(base, 0.1))
    assert fold.deposit(0, _delta_frame(new_base, 0.1)) is None


def test_a_consensus_that_answers_no_delta_round_teaches_no_base():
    from flodl_trio.wire import encode_round_frame

    fold = HostFold("h", [0])
    fold.deposit(0, frame([1.0, 2.0]))
    fold.host_frame_sent()
    fold.consensus_arrived()
    fold.learn_base(memoryview(encode_round_frame(_delta_frame(bytes(16 * [9]), 0.1), SALT)))
    assert fold.base_digest is None
