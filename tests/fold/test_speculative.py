"""SpeculativeFrame: the outgoing frame computed while the last contribution arrives must be
byte-identical to folding, finishing and signing that contribution the ordinary way,
however its bytes are split; and anything off the fast path must be abandoned."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_trio import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
)
from flodl_trio.fold.accumulator import FoldAccumulator, finish_consensus
from flodl_trio.fold.speculative import SpeculativeFrame
from flodl_trio.transport import ArrivalWatch, ReceiveBuffer, encode_enveloped_frame
from flodl_trio.wire import encode_round_frame
from flodl_trio.wire.bf16 import f32_to_bf16
from flodl_trio.wire.mux import MuxKind

SALT = SessionSalt(b"\x42" * 16)


def payload(dtype: int, shape: tuple[int, ...], rng: np.random.Generator, elided: bool) -> TensorPayload:
    if elided:
        return TensorPayload(dtype, shape)
    values = (rng.standard_normal(int(np.prod(shape))) * 100).astype("<f4")
    data = values if dtype == DTYPE_F32 else f32_to_bf16(values)
    return TensorPayload(dtype, shape, data)


def make_frame(schema, seed: int, kind: RoundKind, weight: float, elide: set[int] = frozenset()) -> RoundFrame:
    rng = np.random.default_rng(seed)
    return RoundFrame([payload(d, s, rng, i in elide) for i, (d, s) in enumerate(schema)], kind, weight)


def ordinary(folded: list[RoundFrame], last: RoundFrame, divide: bool) -> bytes:
    acc = FoldAccumulator()
    for i, f in enumerate([*folded, last]):
        acc.add(f, f"host {i}")
    out = finish_consensus(acc) if divide else acc.result()
    return encode_round_frame(out, SALT)


def ahead_over(folded: list[RoundFrame], last: RoundFrame, divide: bool, cuts: list[int]) -> SpeculativeFrame:
    acc = FoldAccumulator()
    for i, f in enumerate(folded):
        acc.add(f, f"host {i}")
    incoming = encode_round_frame(last, SALT)
    ahead = SpeculativeFrame(acc, divide=divide, in_length=len(incoming))
    produced = bytearray()
    for end in [*sorted(c % (len(incoming) + 1) for c in cuts), len(incoming)]:
        for piece, offset in ahead.consume(memoryview(incoming)[:end]):
            assert offset == len(produced)
            produced += piece
    if ahead.complete:
        assert bytes(produced) == bytes(ahead.output()[: len(produced)])
    return ahead


SCHEMAS = st.lists(
    st.tuples(st.sampled_from([DTYPE_F32, DTYPE_BF16]),
              st.lists(st.integers(1, 70), min_size=1, max_size=3).map(tuple)),
    min_size=1, max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(
    schema=SCHEMAS,
    n_folded=st.integers(1, 3),
    kind=st.sampled_from([RoundKind.MODEL, RoundKind.CONTROL]),
    weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.25]), min_size=4, max_size=4),
    divide=st.booleans(),
    elide_last=st.sets(st.integers(0, 3)),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=8),
)
def test_output_matches_the_ordinary_path_whatever_the_chunking(schema, n_folded, kind, weights, divide, elide_last, cuts):
    folded = [make_frame(schema, seed, kind, weights[seed]) for seed in range(n_folded)]
    last = make_frame(schema, 99, kind, weights[3], elide=elide_last)
    ahead = ahead_over(folded, last, divide, cuts)
    assert ahead.abandoned is None and ahead.complete
    want = ordinary(folded, last, divide)
    assert ahead.out_len == len(want)
    assert bytes(ahead.output()[:-8]) == want[:-8]


def test_a_round_s_only_contribution_is_not_this_path():
    """Its output size would come from unverified bytes: nothing is allocated for it."""
    assert not SpeculativeFrame(FoldAccumulator(), divide=True, in_length=1 << 30).supported


def test_an_elided_folded_tensor_is_not_this_path():
    schema = [(DTYPE_F32, (4,)), (DTYPE_F32, (3,))]
    acc = FoldAccumulator()
    acc.add(make_frame(schema, 1, RoundKind.CONTROL, 0.0, elide={1}), "host 0")
    assert not SpeculativeFrame(acc, divide=True, in_length=100).supported


@pytest.mark.parametrize(
    ("last_schema", "kind", "why"),
    [
        ([(DTYPE_F32, (4,)), (DTYPE_F32, (4,))], RoundKind.MODEL, "schema differs"),
        ([(DTYPE_BF16, (4,))], RoundKind.MODEL, "schema differs"),
        ([(DTYPE_F32, (2, 2))], RoundKind.MODEL, "schema differs"),
        ([(DTYPE_F32, (4,))], RoundKind.CONTROL, "schema differs"),
    ],
)
def test_a_frame_that_would_not_fold_is_abandoned(last_schema, kind, why):
    folded = [make_frame([(DTYPE_F32, (4,))], 1, RoundKind.MODEL, 1.0)]
    ahead = ahead_over(folded, make_frame(last_schema, 2, kind, 1.0), True, [3, 30])
    assert ahead.abandoned is not None and why in ahead.abandoned
    assert not ahead.complete


def test_a_length_that_disagrees_with_the_frame_is_abandoned():
    schema = [(DTYPE_F32, (4,))]
    acc = FoldAccumulator()
    acc.add(make_frame(schema, 1, RoundKind.MODEL, 1.0), "host 0")
    incoming = encode_round_frame(make_frame(schema, 2, RoundKind.MODEL, 1.0), SALT) + b"\0\0\0\0"
    ahead = SpeculativeFrame(acc, divide=True, in_length=len(incoming))
    ahead.consume(memoryview(incoming))
    assert ahead.abandoned is not None and "ends at" in ahead.abandoned


def test_the_folded_accumulator_is_only_read():
    schema = [(DTYPE_F32, (300,)), (DTYPE_BF16, (7, 9))]
    acc = FoldAccumulator()
    acc.add(make_frame(schema, 1, RoundKind.MODEL, 1.0), "host 0")
    before = [s.copy() for s in acc.sums()]
    incoming = encode_round_frame(make_frame(schema, 2, RoundKind.MODEL, 2.0), SALT)
    ahead = SpeculativeFrame(acc, divide=True, in_length=len(incoming))
    ahead.consume(memoryview(incoming))
    assert ahead.complete and acc.count == 1 and acc.weight == 1.0
    for a, b in zip(before, acc.sums()):
        np.testing.assert_array_equal(a, b)


async def arrive(incoming: bytes, buf: ReceiveBuffer, watch: ArrivalWatch, verified: bool) -> None:
    """Play a receive: bytes land in ``buf`` in pieces, then the MAC verdict."""
    step = 1 << 16
    for end in range(step, len(incoming) + step, step):
        end = min(end, len(incoming))
        view = buf.writable(watch.filled, len(incoming))
        n = min(len(view), end - watch.filled)
        view[:n] = incoming[watch.filled:watch.filled + n]
        watch.advance(watch.filled + n)
        await trio.sleep(0)
    while watch.filled < len(incoming):  # the buffer grew in steps smaller than ours
        view = buf.writable(watch.filled, len(incoming))
        view[:] = incoming[watch.filled:watch.filled + len(view)]
        watch.advance(watch.filled + len(view))
    if verified:
        watch.verified()
    else:
        watch.abort()


@pytest.mark.parametrize("dtype", [DTYPE_F32, DTYPE_BF16])
async def test_follow_seals_the_same_record_as_encode_enveloped_frame(dtype):
    """Beside a (played) receive of a > 4 MiB frame: the sealed Broadcast record is
    byte-identical to signing the ordinary consensus, and the frame view decodes to it."""
    schema = [(dtype, (1200, 1100)), (DTYPE_F32, (33,))]
    folded = [make_frame(schema, s, RoundKind.MODEL, 1.5) for s in range(2)]
    last = make_frame(schema, 7, RoundKind.MODEL, 0.5)
    acc = FoldAccumulator()
    for i, f in enumerate(folded):
        acc.add(f, f"host {i}")
    incoming = encode_round_frame(last, SALT)
    ahead = SpeculativeFrame(acc, divide=True, in_length=len(incoming))
    buf, watch = ReceiveBuffer(), ArrivalWatch(len(incoming))
    result = None

    async def run() -> None:
        nonlocal result
        result = await ahead.follow(buf, watch, MuxKind.BROADCAST, SALT)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        nursery.start_soon(arrive, incoming, buf, watch, True)
    ref = FoldAccumulator()
    for i, f in enumerate([*folded, last]):
        ref.add(f, f"host {i}")
    consensus = finish_consensus(ref)
    want = (await encode_enveloped_frame(MuxKind.BROADCAST, consensus, SALT)).tobytes()
    assert result is not None and result.tobytes() == want
    assert ahead.frame() == consensus


async def test_follow_gives_nothing_when_the_incoming_bytes_fail_verification():
    schema = [(DTYPE_F32, (1500, 1000))]
    acc = FoldAccumulator()
    acc.add(make_frame(schema, 1, RoundKind.MODEL, 1.0), "host 0")
    incoming = encode_round_frame(make_frame(schema, 2, RoundKind.MODEL, 1.0), SALT)
    ahead = SpeculativeFrame(acc, divide=True, in_length=len(incoming))
    buf, watch = ReceiveBuffer(), ArrivalWatch(len(incoming))
    results = []

    async def run() -> None:
        results.append(await ahead.follow(buf, watch, MuxKind.BROADCAST, SALT))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        nursery.start_soon(arrive, incoming, buf, watch, False)
    assert results == [None]
