"""LaneWindows, I/O-free: a controller's windows over rounds that finish lane by lane."""

from __future__ import annotations

import numpy as np

from flodl_trio.controller.lane_windows import LaneWindows
from flodl_trio.controller.round import Consensus
from flodl_trio.fold.outer import SlowMo, consensus_as_f32
from flodl_trio.wire import DTYPE_F32, RoundFrame, RoundKind, TensorPayload
from flodl_trio.wire.lanes import LaneLayout
from flodl_trio.wire.round_frame import decode_round_frame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"\x09" * 16)
SHAPES = [(4, 3), (5,)]


def frame(kind: RoundKind, value: float, shapes=SHAPES) -> RoundFrame:
    return RoundFrame(
        [TensorPayload(DTYPE_F32, s, np.full(s, value + i, "<f4").reshape(-1)) for i, s in enumerate(shapes)], kind, 2.0
    )


def lanes_of(whole: RoundFrame, count: int) -> list[Consensus]:
    return [Consensus(part) for part in LaneLayout.of(whole, count).split(whole)]


def test_windows_outer_steps_and_joins_come_out_as_for_whole_frames():
    """A Control round in one lane, then params rounds in three: each round is placed
    once (at its last lane), each params lane is stepped as the whole frame would be,
    and the sink and the joiners get each round joined in the model's shapes."""
    seen: list[tuple[int, RoundFrame]] = []
    windows = LaneWindows(SALT, SlowMo(lr=0.5, momentum=0.5), lambda index, consensus: seen.append((index, consensus)))
    windows.keep_window_state = True
    whole = SlowMo(lr=0.5, momentum=0.5)
    for window, value in enumerate((1.0, 3.0)):
        counts = frame(RoundKind.CONTROL, 1.0, [(2,)])
        (out,) = [windows.take(0, c) for c in lanes_of(counts, 1)]
        assert out.part is not None and (out.part.window, out.part.index) == (window, 0) and out.kept is None
        params = frame(RoundKind.MODEL, value)
        outs = [windows.take(k, c) for k, c in enumerate(lanes_of(params, 3))]
        assert [o.part for o in outs[:-1]] == [None, None]
        assert (outs[-1].part.window, outs[-1].part.index) == (window, 1)
        want = consensus_as_f32(whole(params), copy=True)
        joined = LaneLayout.of(params, 3).join([o.consensus.outgoing for o in outs])
        assert all(np.array_equal(a, b) for a, b in zip(consensus_as_f32(joined, copy=True), want))
        kept = decode_round_frame(outs[-1].kept, SALT, authenticated=True)
        assert [tuple(t.shape) for t in kept.tensors] == SHAPES
        assert all(np.array_equal(a, b) for a, b in zip(consensus_as_f32(kept, copy=True), want))
    assert [index for index, _ in seen] == [1, 2, 3, 4] and windows.windows == 2
    assert [c.kind for _, c in seen] == [RoundKind.CONTROL, RoundKind.MODEL] * 2


def test_a_lane_of_a_round_abandoned_at_a_restart_goes_out_untouched():
    windows = LaneWindows(SALT, SlowMo(), None)
    parts = lanes_of(frame(RoundKind.MODEL, 1.0), 3)
    windows.take(0, parts[0])
    windows.restart_windows_at(5)
    out = windows.take(1, parts[1])
    assert out.consensus.outgoing is parts[1].outgoing and out.part is None
    (opened,) = [windows.take(0, c) for c in lanes_of(frame(RoundKind.CONTROL, 1.0, [(2,)]), 1)]
    assert opened.part is not None and opened.part.window == 5
