"""Lanes, I/O-free: a frame cut into byte-balanced lanes of flat pieces and put back."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.errors import ConfigError, SchemaError
from flodl_trio.wire import DTYPE_BF16, DTYPE_F32, RoundFrame, RoundKind, TensorPayload
from flodl_trio.wire.bf16 import f32_to_bf16, itemsize
from flodl_trio.wire.lanes import LaneLayout
from flodl_trio.wire.round_frame import decode_round_frame, encode_round_frame


def frame_of(shapes, dtype=DTYPE_F32, *, elide=(), seed=0, weight=3.0, kind=RoundKind.MODEL) -> RoundFrame:
    rng = np.random.default_rng(seed)
    tensors = []
    for i, shape in enumerate(shapes):
        if i in elide:
            tensors.append(TensorPayload(dtype, shape))
            continue
        values = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
        tensors.append(TensorPayload(dtype, shape, values if dtype == DTYPE_F32 else f32_to_bf16(values)))
    return RoundFrame(tensors, kind, weight)


SCHEMAS = {
    "one big tensor": [(1000,)],
    "uneven": [(3, 5), (1,), (400,), (2, 2, 2), (17,)],
    "many small": [(1,)] * 9,
    "with a zero-size tensor": [(10,), (0, 4), (7,)],
}


@pytest.mark.parametrize("lanes", [1, 2, 4, 7])
@pytest.mark.parametrize("dtype", [DTYPE_F32, DTYPE_BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_split_then_join_gives_the_frame_back(name, dtype, lanes, salt):
    frame = frame_of(SCHEMAS[name], dtype, seed=lanes)
    layout = LaneLayout.of(frame, lanes)
    parts = layout.split(frame)
    assert len(parts) == lanes
    # Each lane is an ordinary RoundFrame: it survives the wire.
    encoded = [encode_round_frame(p, salt) for p in parts]
    # Nothing elided: each lane's frame is as long as the layout says a lane can be.
    assert [len(e) for e in encoded] == [layout.frame_bytes(k) for k in range(lanes)]
    parts = [decode_round_frame(e, salt) for e in encoded]
    assert all(p.kind == frame.kind and p.weight == frame.weight for p in parts)
    assert layout.join(parts) == frame
    # Byte-balanced: every lane within one element (of the widest dtype) of an equal share.
    total = sum(t.nbytes for t in frame.tensors)
    sizes = [sum(t.nbytes for t in p.tensors) for p in parts]
    assert sum(sizes) == total
    assert all(abs(s - total / lanes) <= itemsize(dtype) for s in sizes), sizes


def test_a_tensor_is_split_across_lanes_as_runs_of_its_elements():
    frame = frame_of([(10,), (6,)])  # 64 bytes: lanes of 32, 32
    layout = LaneLayout.of(frame, 2)
    assert [[(p.tensor, p.start, p.stop) for p in lane] for lane in layout.lanes] == [[(0, 0, 8)], [(0, 8, 10), (1, 0, 6)]]
    lane0, lane1 = layout.split(frame)
    # Lane 0: its piece, the frame's schema ([0, *shape] per tensor), its tag (2 schema tensors before it).
    assert [t.shape for t in lane0.tensors] == [(8,), (0, 10), (0, 6), (0, 0, 2, 0, 2)]
    assert [t.shape for t in lane1.tensors] == [(2,), (6,), (0, 0, 2, 1, 0)]  # the pieces, then the lane tag
    assert bytes(lane1.tensors[0].data) == bytes(frame.tensors[0].data[32:40])


def test_more_lanes_than_bytes_gives_empty_pieces_and_still_joins(salt):
    frame = frame_of([(2,)])
    layout = LaneLayout.of(frame, 7)
    parts = layout.split(frame)
    assert sum(t.numel for p in parts for t in p.tensors) == 2
    assert all(len(p.tensors) >= 1 for p in parts)
    assert layout.join([decode_round_frame(encode_round_frame(p, salt), salt) for p in parts]) == frame


def test_elided_tensors_stay_elided_and_a_partly_elided_join_is_zero_filled():
    frame = frame_of([(8,), (8,)], elide={1})
    layout = LaneLayout.of(frame, 3)
    parts = layout.split(frame)
    joined = layout.join(parts)
    assert joined.tensors[1].elided and joined == frame
    # A consensus lane may elide a piece the others carry: zeros there.
    pieces = [TensorPayload(t.dtype, t.shape) if i == 0 else t for i, t in enumerate(parts[0].tensors)]
    first = RoundFrame(pieces, parts[0].kind, parts[0].weight)
    values = np.frombuffer(layout.join([first, *parts[1:]]).tensors[0].data, dtype="<f4")
    cut = layout.lanes[0][0].stop
    assert not values[:cut].any()
    assert np.array_equal(values[cut:], np.frombuffer(frame.tensors[0].data, dtype="<f4")[cut:])


def test_the_joined_weight_is_the_smallest_lanes():
    frame = frame_of([(12,)], weight=5.0)
    layout = LaneLayout.of(frame, 3)
    parts = layout.split(frame)
    parts[1] = RoundFrame(parts[1].tensors, parts[1].kind, 3.0)  # a host died between lanes 0 and 1
    assert layout.join(parts).weight == 3.0


def test_the_layout_depends_on_the_schema_only():
    a, b = frame_of([(5, 3), (9,)], seed=1), frame_of([(5, 3), (9,)], seed=2, elide={0})
    assert LaneLayout.of(a, 4) == LaneLayout.of(b, 4)


def test_what_does_not_fit_is_refused():
    frame = frame_of([(6,)])
    layout = LaneLayout.of(frame, 2)
    with pytest.raises(SchemaError, match="the lane layout"):
        layout.split(frame_of([(7,)]))
    parts = layout.split(frame)
    with pytest.raises(SchemaError, match="1 lane frames for a layout of 2"):
        layout.join(parts[:1])
    with pytest.raises(SchemaError, match="lane 1: tag None"):
        layout.join([parts[0], frame_of([(2,)])])
    with pytest.raises(SchemaError, match="lane 1: tensors"):
        wrong = TensorPayload(DTYPE_F32, (2,), np.zeros(2, "<f4"))
        layout.join([parts[0], RoundFrame([wrong, parts[1].tensors[-1]], parts[1].kind, 1.0)])
    with pytest.raises(SchemaError, match="different kinds"):
        layout.join([parts[0], RoundFrame(parts[1].tensors, RoundKind.CONTROL, 0.0)])
    with pytest.raises(ConfigError, match="lanes must be 1..64"):
        LaneLayout.of(frame, 0)


@pytest.mark.parametrize("lanes", [1, 3, 7])
def test_the_assembler_joins_lanes_into_one_signed_frame(lanes, salt):
    """The bytes it signs decode (MAC checked) to what join() gives, elided tensors as
    zeros; the smallest lane's weight; a second round in a lent buffer full of an
    earlier frame's bytes (as a reused receive buffer is), larger than the frame."""
    from flodl_trio.wire.lanes import LaneAssembler

    layout = LaneLayout.of(frame_of(SCHEMAS["uneven"]), lanes)
    assembler = LaneAssembler(layout)
    dirty = np.full(assembler.nbytes + 100, 0xAB, dtype=np.uint8)
    for seed, lent in ((1, None), (2, dirty)):
        frame = frame_of(SCHEMAS["uneven"], seed=seed, elide={1}, weight=float(seed))
        parts = layout.split(frame)
        parts[-1] = RoundFrame(parts[-1].tensors, parts[-1].kind, 0.5)
        assert not assembler.begun
        assembler.begin(lent)
        for part in parts:
            assembler.add(decode_round_frame(encode_round_frame(part, salt), salt))
        got = decode_round_frame(assembler.finish(salt), salt)
        assert got.weight == 0.5 and got.kind == frame.kind
        want = layout.join(parts)
        for g, w in zip(got.tensors, want.tensors):
            assert g.shape == w.shape
            assert np.array_equal(np.frombuffer(g.data, "<f4"), np.frombuffer(w.data, "<f4")) or (
                w.elided and not np.frombuffer(g.data, "<f4").any())
    with pytest.raises(SchemaError, match="0 of"):
        assembler.finish(salt)
    with pytest.raises(SchemaError, match="before the round's frame was begun"):
        assembler.add(layout.split(frame)[0])
    with pytest.raises(ValueError, match=f"needs {assembler.nbytes} bytes"):
        assembler.begin(np.zeros(assembler.nbytes - 1, np.uint8))


def test_a_frame_goes_in_one_lane_per_min_bytes_and_every_lane_is_tagged(salt):
    from flodl_trio.wire.lanes import lanes_for, read_lane_tag

    assert lanes_for(4096, 8, 256 << 10) == 1  # a small round: one record each way
    assert lanes_for(1 << 20, 8, 256 << 10) == 4
    assert lanes_for(64 << 20, 8, 256 << 10) == 8
    assert lanes_for(10, 8, 0) == 8  # 0: always the cluster's count
    small = frame_of([(1024,)])
    assert LaneLayout.of(small, 8, 256 << 10).count == 1
    big = frame_of([(300_000,)])  # 1.2 MB: 4 lanes of 256 KiB or more
    parts = LaneLayout.of(big, 8, 256 << 10).split(big)
    assert [(t.index, t.count, t.schema) for t in map(read_lane_tag, parts)] == [(0, 4, 1)] + [(k, 4, 0) for k in (1, 2, 3)]
    assert read_lane_tag(decode_round_frame(encode_round_frame(parts[2], salt), salt)) == read_lane_tag(parts[2])
    assert read_lane_tag(big) is None


@pytest.mark.parametrize("lanes", [1, 3, 7])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_lane_0_carries_the_schema_and_the_layout_comes_back_from_it(name, lanes, salt):
    """The controller sees whole tensors: the layout it rebuilds from a lane-0 frame
    (after the wire) is the relay's, and every lane checks against it."""
    frame = frame_of(SCHEMAS[name], DTYPE_BF16, seed=lanes, elide={0})
    layout = LaneLayout.of(frame, lanes)
    parts = [decode_round_frame(encode_round_frame(p, salt), salt) for p in layout.split(frame)]
    assert LaneLayout.of_lane0(parts[0]) == layout
    for index, part in enumerate(parts):
        layout.check_lane(index, part)


def test_a_lane_that_does_not_match_its_layout_is_refused_naming_it():
    from flodl_trio.wire.lanes import lane_tag

    frame = frame_of([(10,), (6,)])
    layout = LaneLayout.of(frame, 2)
    lane0, lane1 = layout.split(frame)
    with pytest.raises(SchemaError, match="expected a round's lane 0"):
        LaneLayout.of_lane0(lane1)
    # A schema that does not describe the pieces sent with it.
    lied = RoundFrame([lane0.tensors[0], TensorPayload(DTYPE_F32, (0, 9)), *lane0.tensors[2:]], lane0.kind, lane0.weight)
    with pytest.raises(SchemaError, match="lane 0: tensors"):
        LaneLayout.of_lane0(lied)
    # A schema tensor with bytes in it.
    full = RoundFrame([lane0.tensors[0], TensorPayload(DTYPE_F32, (1, 10), np.zeros(10, "<f4")), *lane0.tensors[2:]],
                      lane0.kind, lane0.weight)
    with pytest.raises(SchemaError, match="schema tensor 0 has shape \\[1, 10\\]"):
        LaneLayout.of_lane0(full)
    with pytest.raises(SchemaError, match="lane 1: tensors"):
        layout.check_lane(1, RoundFrame([TensorPayload(DTYPE_F32, (3,), np.zeros(3, "<f4")), lane1.tensors[-1]]))
    with pytest.raises(SchemaError, match="lane 1: tag"):
        layout.check_lane(1, RoundFrame([*lane1.tensors[:-1], lane_tag(1, 3)]))


def test_a_lane_whose_payload_bytes_are_not_its_shapes_is_refused_before_a_byte_is_placed():
    """The shapes right and the bytes not (a piece of 8 f32 carrying 7): refused with a
    SchemaError naming the tensor and the byte counts, by the layout's check and by the
    assembler, which never writes a byte of it (before, numpy's ValueError escaped)."""
    from flodl_trio.wire.lanes import LaneAssembler

    frame = frame_of([(16,)])
    layout = LaneLayout.of(frame, 2)
    _lane0, lane1 = layout.split(frame)
    piece = lane1.tensors[0]
    short = RoundFrame([TensorPayload(piece.dtype, piece.shape, bytes(piece.data)[:-4]), *lane1.tensors[1:]],
                       lane1.kind, lane1.weight)
    with pytest.raises(SchemaError, match="lane 1 tensor 0: 28 payload bytes, expected 32"):
        layout.check_lane(1, short)
    assembler = LaneAssembler(layout)
    assembler.begin()
    with pytest.raises(SchemaError, match="28 payload bytes"):
        assembler.add(short, 1)
    assert not assembler.has(1)
    elided = RoundFrame([TensorPayload(piece.dtype, piece.shape), *lane1.tensors[1:]], lane1.kind, lane1.weight)
    layout.check_lane(1, elided)  # (an elided piece is no error)


def test_tags_that_cannot_be_are_not_tags():
    from flodl_trio.wire.lanes import lane_tag, read_lane_tag

    piece = TensorPayload(DTYPE_F32, (2,), np.zeros(2, "<f4"))
    assert read_lane_tag(RoundFrame([piece, piece, lane_tag(0, 2, 1)])).schema == 1
    assert read_lane_tag(RoundFrame([piece, lane_tag(1, 2, 1)])) is None  # a schema on lane 1
    assert read_lane_tag(RoundFrame([piece, lane_tag(0, 2, 0)])) is None  # lane 0 without one
    assert read_lane_tag(RoundFrame([piece, lane_tag(0, 2, 5)])) is None  # more schema than tensors
    assert read_lane_tag(RoundFrame([piece, lane_tag(2, 2)])) is None  # index past the count
    assert read_lane_tag(RoundFrame([piece, TensorPayload(DTYPE_F32, (0, 0, 2, 1), np.zeros(0, "<f4"))])) is None


def test_a_frame_with_too_many_tensors_for_lane_0_is_refused_up_front():
    from flodl_trio.wire.constants import MAX_TENSORS

    with pytest.raises(SchemaError, match=f"a frame of {MAX_TENSORS // 2} tensors cannot be cut into lanes"):
        LaneLayout.for_schema([(DTYPE_F32, (1,))] * (MAX_TENSORS // 2), 2)


def test_a_frame_of_no_tensors_goes_in_one_lane_carrying_its_tag_alone(salt):
    """flodl's RoundFrame may hold no tensors: its one lane is its tag (schema 0), which
    reads back, checks, and joins to a frame of no tensors."""
    from flodl_trio.wire.lanes import LaneAssembler, lane_tag, read_lane_tag

    frame = RoundFrame([], RoundKind.CONTROL, 2.5)
    layout = LaneLayout.of(frame, 8, 0)
    assert layout.count == 1 and layout.lanes == ((),)
    [lane] = layout.split(frame)
    assert read_lane_tag(lane).schema == 0 and len(lane.tensors) == 1
    assert LaneLayout.of_lane0(lane) == layout
    assert layout.join([lane]) == RoundFrame([], RoundKind.CONTROL, 2.5)
    assembler = LaneAssembler(layout)
    assembler.begin()
    assembler.add(lane)
    joined = decode_round_frame(assembler.finish(salt), salt)
    assert joined.tensors == [] and joined.kind == RoundKind.CONTROL and joined.weight == 2.5
    piece = TensorPayload(DTYPE_F32, (2,), np.zeros(2, "<f4"))
    assert read_lane_tag(RoundFrame([piece, lane_tag(0, 1, 0)])) is None  # pieces but no schema: not a tag


def test_with_lane_0_empty_the_payload_goes_over_the_other_lanes(salt):
    """Shards' layout: lane 0 carries the schema and the tag alone (the controller's, which
    decides), lanes 1.. share the payload; it splits, reads back from lane 0, and joins."""
    frame = RoundFrame([TensorPayload(DTYPE_F32, (1000,), np.arange(1000, dtype="<f4")),
                        TensorPayload(DTYPE_F32, (3, 7), np.ones(21, "<f4"))], RoundKind.MODEL, 2.0)
    layout = LaneLayout.of(frame, 5, 0, lane0_empty=True)
    assert layout.count == 5 and sum(p.numel for p in layout.lanes[0]) == 0
    assert sum(p.numel for lane in layout.lanes for p in lane) == 1021
    lanes = layout.split(frame)
    assert LaneLayout.of_lane0(lanes[0], lane0_empty=True) == layout
    assert layout.join(lanes) == frame
    assert LaneLayout.of(frame, 5, 0) != layout  # the ordinary layout puts a fifth of the bytes in lane 0


def test_a_round_through_shards_goes_in_lanes_every_shard_gets_as_many_of():
    from flodl_trio.wire.lanes import MAX_LANES, SHARD_PIPELINE_LANES, lane_owner, sharded_lane_count

    for lanes in (2, 3, 5, 8, 9, 17, 64):
        for shards in range(1, 70):
            count = sharded_lane_count(lanes, shards)
            owned = [sum(lane_owner(k, shards) == s for k in range(1, count)) for s in range(shards)]
            if shards < MAX_LANES:
                assert len(set(owned)) == 1 and owned[0] >= 1  # even: no shard's link carries more
                assert count - 1 >= min(lanes - 1, MAX_LANES - 1 - (MAX_LANES - 1) % shards)
                assert owned[0] >= min(SHARD_PIPELINE_LANES, (MAX_LANES - 1) // shards)  # pipelined
            assert count <= MAX_LANES
    assert sharded_lane_count(8, 4) == 17 and sharded_lane_count(8, 3) == 13 and sharded_lane_count(8, 8) == 33
    assert sharded_lane_count(8, 16) == 49 and sharded_lane_count(64, 4) == 61  # 15 a shard: 63 lanes at most


def test_a_small_frame_through_shards_still_gives_every_shard_a_lane():
    """Lanes of at least min_bytes while the frame allows it; below that, one a shard."""
    from flodl_trio.wire.lanes import LaneLayout, lane_owner, sharded_lane_count

    KiB = 1024
    assert sharded_lane_count(8, 16, 2048 * KiB, 256 * KiB) == 17  # 8 lanes of 256 KiB would leave 9 shards idle
    assert sharded_lane_count(8, 4, 2048 * KiB, 256 * KiB) == 9  # two a shard, each 256 KiB
    assert sharded_lane_count(8, 4, 1024 * KiB, 256 * KiB) == 5  # one a shard
    assert sharded_lane_count(8, 4, 64 << 20, 256 * KiB) == 17  # four a shard: the pipeline's
    assert sharded_lane_count(24, 4, 64 << 20, 256 * KiB) == 25  # the cluster's count, when more
    frame = RoundFrame([TensorPayload(DTYPE_F32, (512 * 1024,), np.zeros(512 * 1024, np.float32))], RoundKind.MODEL)
    layout = LaneLayout.through_shards(frame, 8, 16, 256 * KiB)
    assert layout.count == 17 and not layout.lanes[0][0].numel
    assert {lane_owner(k, 16) for k in range(1, 17)} == set(range(16))
