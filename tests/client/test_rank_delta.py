"""A rank's delta state (flodl_trio.client.delta), I/O-free: the digest check of each
consensus runs in a thread while the rank trains on, and ends before the base is
used again - a base that differs raises before any delta goes out against it."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.client.delta import RankDelta
from flodl_trio.errors import FlodlError
from flodl_trio.fold.delta import DeltaLineage
from flodl_trio.wire.quant import F32, DeltaCodec

SHAPES = [(3000,), (7, 5)]


def lineage_round(lineage: DeltaLineage, params: list[np.ndarray], codec: DeltaCodec | None):
    """The controller's consensus for one rank's frame (mass 1, no outer step)."""
    from flodl_trio.wire import RoundFrame, RoundKind, TensorPayload

    frame = RoundFrame([TensorPayload(0, s, p.reshape(s)) for s, p in zip(SHAPES, params)], RoundKind.MODEL, 1.0)
    return lineage.downlink_frame(frame, codec)


def test_a_base_that_stays_the_controllers_passes_every_check():
    codec, rng = DeltaCodec.parse("int8:256"), np.random.default_rng(0)
    rank, lineage = RankDelta(codec), DeltaLineage()
    params = [rng.standard_normal(int(np.prod(s))).astype(F32) for s in SHAPES]
    base = rank.take(lineage_round(lineage, params, None), 0)
    for _ in range(3):
        params = [b + rng.standard_normal(b.size).astype(F32) * 0.01 for b in base]
        rank.frame(params, SHAPES, 1.0)
        base = rank.take(lineage_round(lineage, params, codec), 0)
    rank.verify()
    assert all(np.array_equal(a, b) for a, b in zip(base, lineage.base))


def test_a_base_that_differs_raises_before_the_next_delta_goes_out_and_again_never():
    codec, rng = DeltaCodec.parse("fp4"), np.random.default_rng(1)
    rank, lineage = RankDelta(codec), DeltaLineage()
    params = [rng.standard_normal(int(np.prod(s))).astype(F32) for s in SHAPES]
    rank.take(lineage_round(lineage, params, None), 3)
    lineage.downlink.base[0][7] += 1.0  # the controller's base moves without the rank's
    consensus = lineage_round(lineage, params, codec)
    rank.take(consensus, 3)  # returns at once: the check runs meanwhile
    with pytest.raises(FlodlError, match=r"rank 3: after the consensus this rank's base is [0-9a-f]{32}, the controller's"):
        rank.frame(params, SHAPES, 1.0)
    rank.frame(params, SHAPES, 1.0)  # reported once; the rank decides what to do next
