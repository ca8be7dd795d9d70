"""Delta rounds cut into lanes (docs/wire.md, "Delta rounds", "In lanes"): a coded
tensor is cut only at its block boundaries, each piece a coded payload of its own
(its blocks' scales, then their codes); the base digest goes whole, in the last
lane; split, join and the assembler give back the frame's exact bytes."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.fold.delta import NO_BASE
from flodl_trio.wire import RoundFrame, RoundKind, TensorPayload
from flodl_trio.wire.lanes import LaneAssembler, LaneLayout, TensorCut
from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, F32, DeltaCodec, decode, encode
from flodl_trio.wire.round_frame import decode_round_frame, encode_round_frame

SHAPES = [(3001,), (7, 5), (1,), (4096,), (0,), (2, 700)]  # part blocks, one element, an empty tensor


def coded_frame(codec: DeltaCodec, seed: int = 0) -> tuple[RoundFrame, list[np.ndarray]]:
    """A delta round's frame (every tensor coded, then the digest) and the values it decodes to."""
    rng = np.random.default_rng(seed)
    tensors, decoded = [], []
    for shape in SHAPES:
        values = rng.standard_t(3, int(np.prod(shape))).astype(F32)
        payload = bytearray(codec.payload_bytes(values.size))
        encode(values, payload, codec.code, codec.block)
        out = np.empty(values.size, F32)
        decode(payload, codec.code, codec.block, values.size, out)
        tensors.append(TensorPayload(codec.tag, shape, payload))
        decoded.append(out)
    tensors.append(TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), bytes(range(DIGEST_LEN))))
    return RoundFrame(tensors, RoundKind.MODEL, 6.0), decoded


CODECS = ["int8:256", "fp4:256", "int4:512", "int8:4096"]


@pytest.mark.parametrize("lanes", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("name", CODECS)
def test_coded_tensors_are_cut_on_block_boundaries_into_payloads_that_decode_alone(name, lanes, salt):
    codec = DeltaCodec.parse(name)
    frame, decoded = coded_frame(codec)
    layout = LaneLayout.of(frame, lanes)
    parts = layout.split(frame)
    for index, (pieces, part) in enumerate(zip(layout.lanes, parts)):
        layout.check_lane(index, decode_round_frame(encode_round_frame(part, salt), salt))
        for p, t in zip(pieces, part.tensors):
            if p.tensor == len(SHAPES):  # the digest: whole, in the last lane
                assert (p.start, p.stop, index) == (0, DIGEST_LEN, layout.count - 1)
                assert bytes(t.data) == bytes(range(DIGEST_LEN))
                continue
            assert p.start % codec.block == 0 and (p.stop % codec.block == 0 or p.stop == int(np.prod(SHAPES[p.tensor])))
            alone = np.empty(p.numel, F32)
            decode(t.data, codec.code, codec.block, p.numel, alone)
            assert np.array_equal(alone, decoded[p.tensor][p.start:p.stop]), (index, p)
    # Every element is in exactly one piece.
    for tensor, shape in enumerate(SHAPES):
        covered = sorted((p.start, p.stop) for lane in layout.lanes for p in lane if p.tensor == tensor)
        assert covered[0][0] == 0 and covered[-1][1] == int(np.prod(shape))
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


@pytest.mark.parametrize("lanes", [2, 5])
@pytest.mark.parametrize("name", CODECS)
def test_split_join_and_the_assembler_give_back_the_frames_bytes(name, lanes, salt):
    frame, _ = coded_frame(DeltaCodec.parse(name), seed=3)
    layout = LaneLayout.of(frame, lanes)
    parts = [decode_round_frame(encode_round_frame(p, salt), salt) for p in layout.split(frame)]
    want = encode_round_frame(frame, salt)
    assert encode_round_frame(layout.join(parts), salt) == want
    assembler = LaneAssembler(layout)
    assembler.begin(np.full(assembler.nbytes + 7, 0xCD, np.uint8))  # a dirty, larger lent buffer
    for part in parts:
        assembler.add(part)
    assert bytes(assembler.finish(salt)) == want


def test_the_lane_0_schema_names_the_codes_and_the_digest_and_gives_the_layout_back(salt):
    frame, _ = coded_frame(DeltaCodec.parse("fp4"))
    layout = LaneLayout.of(frame, 4)
    lane0 = decode_round_frame(encode_round_frame(layout.split(frame)[0], salt), salt)
    assert LaneLayout.of_lane0(lane0) == layout
    schema = lane0.tensors[-1 - len(frame.tensors):-1]
    assert [t.dtype for t in schema] == [t.dtype for t in frame.tensors]
    assert tuple(schema[-1].shape) == (0, DIGEST_LEN)


def test_a_lineages_first_round_f32_params_and_no_base_digest_are_cut_like_any_f32_frame(salt):
    rng = np.random.default_rng(1)
    tensors = [TensorPayload(0, s, rng.standard_normal(int(np.prod(s))).astype(F32)) for s in SHAPES]
    frame = RoundFrame([*tensors, TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), NO_BASE)], RoundKind.MODEL, 2.0)
    layout = LaneLayout.of(frame, 6)
    parts = [decode_round_frame(encode_round_frame(p, salt), salt) for p in layout.split(frame)]
    assert encode_round_frame(layout.join(parts), salt) == encode_round_frame(frame, salt)
    assert layout.lanes[-1][-1].tensor == len(SHAPES)  # the digest, last


def test_the_cut_follows_the_bytes_of_each_code():
    """Lanes balance bytes, so an int8 tensor is cut about where its bytes split evenly,
    moved down to a block boundary; a digest never splits."""
    cut = TensorCut.of(DeltaCodec.parse("int8:1024").tag, (1 << 20,))
    assert cut.element_at(cut.nbytes // 2) == 1 << 19
    assert cut.element_at(cut.nbytes // 3) % 1024 == 0
    assert TensorCut.of(DTYPE_BASE_DIGEST, (DIGEST_LEN,)).element_at(9) == 0
