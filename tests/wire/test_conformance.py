"""The project's bytes against an independent codec written from the docs alone.

``doc_codec`` knows PROTOCOL.md and docs/wire.md and nothing of
``flodl_trio``. Each test here builds a message both ways and checks the
bytes are equal, and feeds the docs' bytes to the project's decoder (so a
mistake the project's encoder and decoder share cannot hide behind a round
trip).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from flodl_trio.wire import (
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    decode_control_msg,
    decode_mux_record,
    decode_round_frame,
    encode_control_msg,
    encode_round_frame,
)
from flodl_trio.wire import mux as pmux
from flodl_trio.wire import quant as pquant
from flodl_trio.wire import state as pstate
from flodl_trio.wire.control_frame import ControlFrame, decode_control_frame, encode_control_frame
from flodl_trio.wire.fragment import FragmentTag, fragment_of, piece_range
from flodl_trio.wire.handshake import (
    decode_local_ack,
    decode_local_handshake,
    encode_local_ack,
    encode_local_handshake,
)
from flodl_trio.wire.lanes import LaneLayout, lanes_for, read_lane_tag, sharded_lane_count
from flodl_trio.wire.liveness import Beacon, Heartbeat, beacon_frame, decode_liveness, heartbeat_frame
from flodl_trio.wire.round_frame import frame_body_chunks

from . import doc_codec as doc

RAW_SALT = b"\x42" * 16
SALT = SessionSalt(RAW_SALT)


def to_project(frame: doc.Frame) -> RoundFrame:
    return RoundFrame(
        [TensorPayload(t.dtype, t.shape, t.data) for t in frame.tensors], RoundKind(frame.kind), frame.weight
    )


def body_of(frame: RoundFrame) -> bytes:
    return b"".join(bytes(c) for c in frame_body_chunks(frame).chunks)


# -- PROTOCOL.md section 7 from the docs' own encoder --------------------------


def test_golden_round_frames_from_the_docs_encoder() -> None:
    f32 = lambda *v: struct.pack(f"<{len(v)}f", *v)  # noqa: E731
    rf1 = doc.Frame([doc.Tensor(doc.F32, (2,), f32(1.0, 2.0))], doc.MODEL, 1.0)
    rf2 = doc.Frame(
        [
            doc.Tensor(doc.F32, (2, 3), f32(1, 2, 3, 4, 5, 6)),
            doc.Tensor(doc.BF16, (2,), struct.pack("<HH", 0x3F80, 0xC000)),
        ],
        doc.MODEL,
        2.5,
    )
    rf3 = doc.Frame([doc.Tensor(doc.F32, (64, 128)), doc.Tensor(doc.F32, (512,))], doc.CONTROL, 0.0)
    want = {
        "rf1": "f1170df10100000000000000000000f03f00010200000008000000000000000000803f000000401960f1ead97d18ae",
        "rf2": "f1170df1020000000000000000000004400002020000000300000018000000000000000000803f00000040000040400000"
        "80400000a0400000c0400101020000000400000000000000803f00c06a6c0d3eb1639ceb",
        "rf3": "f1170df10200000001000000000000000000024000000080000000000000000000000000010002000000000000000000"
        "008aad9459f132096f",
    }
    for name, frame in (("rf1", rf1), ("rf2", rf2), ("rf3", rf3)):
        mine = doc.encode_frame(frame, RAW_SALT)
        assert mine.hex() == want[name]
        assert encode_round_frame(to_project(frame), SALT) == mine
        decoded = decode_round_frame(mine, SALT)
        assert [(t.dtype, t.shape, bytes(t.data)) for t in decoded.tensors] == [
            (t.dtype, t.shape, t.data) for t in frame.tensors
        ]
    hs = struct.pack("<IIII", 0xF10D17C2, 4, 1, 2) + bytes(32)
    assert (hs + doc.mac8(RAW_SALT, hs)).hex().endswith("dc0f92bfb9b6850b")
    ack = struct.pack("<II", 0xF10D17C3, 4)
    assert (ack + doc.mac8(RAW_SALT, ack)).hex() == "c3170df1040000003056df5c614030be"
    rec = doc.encode_record(doc.MUX_CONTROL, doc.encode_msg("DeclareDead", rank=300), RAW_SALT)
    assert rec.hex() == "d0170df10100000002000000000400000068fe247cc29c7b1303fb2c01"
    rec = doc.encode_record(doc.MUX_DATA, bytes.fromhex("deadbeef"), RAW_SALT, rank=7)
    assert rec.hex() == "d0170df10100000001070000000400000097b08af1e1a4db5ddeadbeef"


# -- RelayControlMsg: every variant the docs list -------------------------------

SCHEMA = ((0, (64, 128)), (1, (3,)), (0x8A, (5000,)), (0x7F, (0, 16)))

MESSAGES = [
    ("Hello", dict(host="h0", ranks=[0, 1, 300], model_sigs=[]), pmux.Hello("h0", (0, 1, 300))),
    (
        "Hello",
        dict(host="hôst", ranks=[4], model_sigs=[doc.EXTENSIONS_MARK]),
        pmux.Hello("hôst", (4,), (pmux.EXTENSIONS_MARK,)),
    ),
    ("HelloAck", {}, pmux.HelloAck()),
    ("RankExit", dict(rank=70000), pmux.RankExit(70000)),
    ("DeclareDead", dict(rank=300), pmux.DeclareDead(300)),
    ("RankJoin", dict(rank=5), pmux.RankJoin(5)),
    ("RankFinished", dict(rank=251), pmux.RankFinished(251)),
    ("RankAway", dict(rank=2), pmux.RankAway(2)),
    ("Lanes", dict(count=8, min_bytes=256 << 10), pmux.Lanes(8, 256 << 10)),
    ("Lanes", dict(count=2, min_bytes=0), pmux.Lanes(2, 0)),
    ("Resume", dict(last_broadcast=bytes(range(8)), awaiting=1, resends=1), pmux.Resume(bytes(range(8)), True, True)),
    ("Resume", dict(last_broadcast=bytes(8), awaiting=1, resends=0), pmux.Resume(bytes(8), True, False)),
    ("Outage", dict(millis=90_000), pmux.Outage(90_000)),
    ("Outage", dict(millis=0), pmux.Outage(0)),
    (
        "Shards",
        dict(addresses=[("10.0.0.1", 1341), ("::1", 65535)]),
        pmux.Shards((("10.0.0.1", 1341), ("::1", 65535))),
    ),
    ("ShardSetup", dict(index=1, count=3, heartbeat_ms=30_000), pmux.ShardSetup(1, 3, 30_000)),
    (
        "Decide",
        dict(decision=7, round=3, lanes=17, schema=SCHEMA, hosts=[0, 2], targets=[0, 2, 4], copy=0, step=None),
        pmux.Decide(7, 3, 17, SCHEMA, (0, 2), (0, 2, 4)),
    ),
    (
        "Decide",
        dict(decision=300, round=2, lanes=5, schema=SCHEMA[:2], hosts=[0], targets=[0], copy=2, step="whole"),
        pmux.Decide(300, 2, 5, SCHEMA[:2], (0,), (0,), copy=2, step=True),
    ),
    (
        "Decide",
        dict(decision=1, round=1, lanes=3, schema=SCHEMA[:1], hosts=[], targets=[1], copy=1, step=(2, 4)),
        pmux.Decide(1, 1, 3, SCHEMA[:1], (), (1,), copy=1, step=True, fragment=(2, 4)),
    ),
    ("ShardAck", dict(lane=3), pmux.ShardAck(3)),
    ("ShardLost", dict(shard=1), pmux.ShardLost(1)),
    ("Decided", dict(decision=1 << 20), pmux.Decided(1 << 20)),
    ("LanesIn", dict(decision=9), pmux.LanesIn(9)),
    ("Pieces", dict(round=12), pmux.Pieces(12)),
    ("ShardAlive", {}, pmux.ShardAlive()),
    ("PieceRefused", dict(host=4, reason="lane 3: 12 bytes, expected 16"), pmux.PieceRefused(4, "lane 3: 12 bytes, expected 16")),
    ("ShardOffer", dict(host="192.168.1.9", port=40123), pmux.ShardOffer("192.168.1.9", 40123)),
    ("ShardOuter", dict(kind=1, lr=0.7, momentum=0.9), pmux.ShardOuter(1, 0.7, 0.9)),
    ("ShardOuter", dict(kind=2, lr=1.0, momentum=0.0), pmux.ShardOuter(2, 1.0, 0.0)),
    ("ShardBack", dict(shard=2, host="h", port=1), pmux.ShardBack(2, "h", 1)),
    ("ShardMoved", dict(shard=0, host="127.0.0.1", port=5000), pmux.ShardMoved(0, "127.0.0.1", 5000)),
    ("Mirror", dict(shard=1, decision=4, start=2), pmux.Mirror(1, 4, 2)),
    ("Mirrored", dict(decision=4), pmux.Mirrored(4)),
    ("Handoff", dict(shard=3, fragment=None), pmux.Handoff(3)),
    ("Handoff", dict(shard=3, fragment=(1, 4)), pmux.Handoff(3, (1, 4))),
    ("HandedBack", dict(shard=3, lanes=6), pmux.HandedBack(3, 6)),
    ("Seed", dict(decision=2, lanes=4), pmux.Seed(2, 4)),
    ("Seed", dict(decision=2, lanes=0), pmux.Seed(2, 0)),
]


@pytest.mark.parametrize(("name", "fields", "msg"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_control_messages_are_the_docs_bytes(name: str, fields: dict, msg: object) -> None:
    mine = doc.encode_msg(name, **fields)
    assert encode_control_msg(msg) == mine
    assert decode_control_msg(mine) == msg
    record = doc.encode_record(doc.MUX_CONTROL, mine, RAW_SALT)
    assert decode_mux_record(record, SALT).control() == msg


def test_doc_one_byte_indices() -> None:
    """wire.md: Resume is one byte ``cc``, Outage ``cd``, ShardMoved ``db``."""
    assert doc.encode_msg("Resume", last_broadcast=bytes(8), awaiting=0, resends=0)[:1] == b"\xcc"
    assert doc.encode_msg("Outage", millis=1)[:1] == b"\xcd"
    assert doc.encode_msg("ShardMoved", shard=0, host="h", port=1)[:1] == b"\xdb"


# -- lanes ------------------------------------------------------------------------


def _random_frame(rng: np.random.Generator, shapes: list[tuple[int, tuple[int, ...]]], elide: set[int]) -> doc.Frame:
    tensors = []
    for i, (dtype, shape) in enumerate(shapes):
        n = math.prod(shape)
        if i in elide:
            data = b""
        elif dtype == doc.F32:
            data = rng.standard_normal(n).astype("<f4").tobytes()
        else:
            data = rng.integers(0, 1 << 16, n).astype("<u2").tobytes()
        tensors.append(doc.Tensor(dtype, shape, data))
    return doc.Frame(tensors, doc.MODEL, 3.5)


LANE_CASES = [
    ([(0, (10, 7)), (1, (33,)), (0, (5,))], set(), 4),
    ([(0, (10, 7)), (1, (33,)), (0, (5,))], {1}, 3),
    ([(1, (3,)), (0, (1000,))], set(), 7),
    ([(0, (2,))], set(), 5),  # more lanes than elements: empty lanes
    ([(0, (64, 128)), (0, (512,))], {0, 1}, 8),
    ([(1, (17,)), (1, (1,)), (0, (9,))], set(), 64),  # empty lanes inside a bf16 tensor
    ([(0, (0,)), (0, (6,)), (1, (0, 3)), (1, (4,)), (0, (0,))], set(), 3),  # tensors of no elements
    ([(0, (5,)), (1, (0,)), (0, (5,))], set(), 2),  # one where a lane starts
    ([(0, (3,)), (1, (2,))], {1}, 12),
]


@pytest.mark.parametrize(("shapes", "elide", "n"), LANE_CASES)
@pytest.mark.parametrize("lane0_empty", [False, True])
def test_lane_frames_are_the_docs_cut(shapes: list, elide: set[int], n: int, lane0_empty: bool) -> None:
    rng = np.random.default_rng(n)
    frame = _random_frame(rng, shapes, elide)
    want = doc.cut_lanes(frame, n, lane0_empty=lane0_empty)
    project = to_project(frame)
    layout = LaneLayout.of(project, n, lane0_empty=lane0_empty)
    got = layout.split(project)
    assert len(got) == n
    for k, (lane, mine) in enumerate(zip(got, want, strict=True)):
        assert body_of(lane) == doc.frame_body(mine), f"lane {k} of {n}"
        tag = read_lane_tag(lane)
        assert tag is not None and (tag.index, tag.count) == (k, n)
    # the docs' lanes are what the project's checks take, and join back whole
    decoded = [decode_round_frame(doc.encode_frame(lane, RAW_SALT), SALT) for lane in want]
    declared = LaneLayout.of_lane0(decoded[0], lane0_empty=lane0_empty)
    for k, lane in enumerate(decoded):
        declared.check_lane(k, lane)
    joined = declared.join(decoded)
    full = [bytes(t.data) or bytes(doc._tensor_bytes(t)) for t in frame.tensors]
    assert [bytes(t.data) or bytes(math.prod(t.shape) * doc.ITEMSIZE[t.dtype]) for t in joined.tensors] == full


def test_lane_counts_follow_the_docs_formulas() -> None:
    for payload in (0, 1, 4096, 256 << 10, (1 << 20), 16 << 20, 8 << 20, (1 << 30)):
        for count in (2, 3, 8, 64):
            for min_bytes in (0, 1, 4096, 256 << 10):
                assert lanes_for(payload, count, min_bytes) == doc.lanes_for(payload, count, min_bytes)
                for shards in (1, 2, 3, 4, 8, 16, 63):
                    k = doc.sharded_lanes_per_shard(count, shards, payload, min_bytes)
                    assert sharded_lane_count(count, shards, payload, min_bytes) == 1 + shards * k, (
                        payload, count, min_bytes, shards
                    )
    assert lanes_for(16 << 20, 8, 256 << 10) == 8 and lanes_for(1 << 20, 8, 256 << 10) == 4
    assert sharded_lane_count(8, 4, 8 << 20, 256 << 10) == 17


# -- the fragment tag --------------------------------------------------------------


@pytest.mark.parametrize(("count", "index"), [(2, 0), (2, 1), (256, 255), (7, 3)])
def test_fragment_tag_is_22_bytes_of_the_docs(count: int, index: int) -> None:
    tag = FragmentTag(index, count, shapes=((3, 4), (5,)))
    frame = RoundFrame([TensorPayload(0, (4,), np.arange(4, dtype="<f4")), *tag.payloads()], RoundKind.CONTROL, 0.0)
    body = body_of(frame)
    counts_end = 17 + 2 + 4 + 8 + 16
    assert body[counts_end : counts_end + 22] == doc.fragment_tag(count, index)
    mine = doc.Frame(
        [
            doc.Tensor(0, (4,), np.arange(4, dtype="<f4").tobytes()),
            doc.Tensor(0, (0, count, index)),
            doc.Tensor(0, (0, 3, 4)),
            doc.Tensor(0, (0, 5)),
        ],
        doc.CONTROL,
        0.0,
    )
    found = fragment_of(decode_round_frame(doc.encode_frame(mine, RAW_SALT), SALT))
    assert found is not None and (found.index, found.count) == (index, count)
    for n in (0, 1, 7, 1000):
        assert piece_range(n, count, index) == doc.fragment_range(n, count, index)


# -- delta codes --------------------------------------------------------------------

CODES = {doc.INT8: pquant.Code.INT8, doc.INT4: pquant.Code.INT4, doc.FP4: pquant.Code.FP4}


@pytest.mark.parametrize("code", [doc.INT8, doc.INT4, doc.FP4])
@pytest.mark.parametrize("block", [256, 1024, 4096])
@pytest.mark.parametrize("n", [1, 255, 257, 1023, 5001])
def test_delta_codes_are_the_docs_codes(code: int, block: int, n: int) -> None:
    rng = np.random.default_rng(n * 31 + block + code)
    values = (rng.standard_normal(n) * rng.uniform(0.01, 100)).astype(np.float32)
    values[rng.integers(0, n)] = 0.0
    codec = pquant.DeltaCodec(CODES[code], block)
    assert codec.tag == doc.delta_tag(code, block)
    assert pquant.DeltaCodec.of_tag(doc.delta_tag(code, block)) == codec
    size = doc.code_payload_bytes(code, n, block)
    assert codec.payload_bytes(n) == size
    payload = bytearray(size)
    pquant.encode(values, payload, CODES[code], block)
    # the project's payload read with the docs' rules: scales are block max / top level,
    # and every element's level is a nearest one
    decoded = doc.decode_code(bytes(payload), code, block, n)
    blocks = math.ceil(n / block)
    scales = np.frombuffer(bytes(payload[: 4 * blocks]), "<f4")
    for b in range(blocks):
        chunk = values[b * block : (b + 1) * block]
        want = np.float32(np.max(np.abs(chunk))) / np.float32(doc.MAX_LEVEL[code])
        assert scales[b] == pytest.approx(want, rel=1e-6), f"block {b}"
        step = np.float32(want) * (np.float32(1.0) if code != doc.FP4 else np.float32(2.0))
        err = np.abs(decoded[b * block : (b + 1) * block] - chunk)
        assert float(err.max()) <= float(step) / 2 * (1 + 1e-5) + 1e-30
    # the docs' payload read by the project
    mine = doc.encode_code(values, code, block)
    out = np.empty(n, dtype=np.float32)
    pquant.decode(bytearray(mine), CODES[code], block, n, out)
    np.testing.assert_array_equal(out, doc.decode_code(mine, code, block, n))
    if n % 2 and code != doc.INT8:
        pad = payload[-1] >> 4
        assert pad == (8 if code == doc.INT4 else 0)


def test_base_digest_is_blake2b_128_of_the_f32_bytes() -> None:
    rng = np.random.default_rng(0)
    base = [rng.standard_normal(s).astype(np.float32) for s in (7, 1, 300)]
    assert pquant.base_digest(base) == doc.base_digest(base)


# -- the join exchange --------------------------------------------------------------

NR, NC = bytes(range(16)), bytes(range(16, 32))


def test_join_messages_are_the_docs_bytes() -> None:
    nonces = pstate.JoinNonces(NR, NC)
    assert pstate.encode_state_request(3, 8, NR, SALT) == doc.state_request(3, 8, NR, RAW_SALT)
    request = pstate.decode_state_request(doc.state_request(3, 8, NR, RAW_SALT), 8, SALT)
    assert (request.rank, request.world_size, request.nonce) == (3, 8, NR)
    assert pstate.encode_state_challenge(nonces, SALT) == doc.state_challenge(NC, NR, RAW_SALT)
    assert pstate.decode_state_challenge(doc.state_challenge(NC, NR, RAW_SALT), NR, SALT) == nonces
    assert pstate.encode_state_answer(3, nonces, SALT) == doc.state_answer(3, NR, NC, RAW_SALT)
    pstate.check_state_answer(doc.state_answer(3, NR, NC, RAW_SALT), 3, nonces, SALT)
    assert pstate.encode_state_receipt(nonces, SALT) == doc.state_receipt(NR, NC, RAW_SALT)
    pstate.check_state_receipt(doc.state_receipt(NR, NC, RAW_SALT), 3, nonces, SALT)
    for status, window in ((0, 12), (1, -1), (2, 40)):
        entry = pstate.StateEntry(pstate.EntryStatus(status), window)
        assert pstate.encode_state_entry(entry, nonces, SALT) == doc.state_entry(status, window, NR, NC, RAW_SALT)
        assert pstate.decode_state_entry(doc.state_entry(status, window, NR, NC, RAW_SALT), nonces, SALT) == entry
    for status, window, reason, lengths in ((0, 5, "", (47, 85)), (1, -1, "late: window 3 ≠ 0", ()), (0, -1, "", ())):
        reply = pstate.StateReply(pstate.StateStatus(status), window, len(lengths), reason, lengths)
        mine = doc.state_reply(status, window, reason, lengths, NR, NC, RAW_SALT)
        assert pstate.encode_state_reply(reply, nonces, SALT) == mine
        head = mine[: pstate.STATE_REPLY_HEADER_LEN]
        assert pstate.decode_state_reply(head, mine[len(head) :], nonces, SALT) == reply


# -- the local leg and the control channel -------------------------------------


def test_local_leg_handshake_is_the_docs_bytes() -> None:
    mine = doc.local_handshake(2, 4, RAW_SALT)
    assert encode_local_handshake(2, 4, SALT) == mine
    hello = decode_local_handshake(mine, 4, SALT)
    assert (hello.rank, hello.world_size) == (2, 4)
    ack = doc.local_ack(mine[:16], RAW_SALT)
    assert encode_local_ack(mine[:16], SALT) == ack
    decode_local_ack(ack, mine[:16], SALT)


def test_control_frames_and_liveness_payloads_are_the_docs_bytes() -> None:
    hb = doc.control_frame(5, doc.heartbeat(3, 77), RAW_SALT)
    assert encode_control_frame(heartbeat_frame(3, 77), SALT) == hb
    assert decode_liveness(decode_control_frame(hb, SALT)) == Heartbeat(3, 77)
    bc = doc.control_frame(5, doc.beacon(9, 4, 1, 30_000), RAW_SALT)
    assert encode_control_frame(beacon_frame(9, 4, 1, 30_000), SALT) == bc
    assert decode_liveness(decode_control_frame(bc, SALT)) == Beacon(9, 4, 1, 30_000)
    bc2 = doc.control_frame(5, doc.beacon(9, 4, 1, 30_000, 60_000), RAW_SALT)
    assert encode_control_frame(beacon_frame(9, 4, 1, 30_000, 60_000), SALT) == bc2
    assert decode_liveness(decode_control_frame(bc2, SALT)) == Beacon(9, 4, 1, 30_000, 60_000)
    other = doc.control_frame(3, b"metrics", RAW_SALT)
    assert decode_control_frame(other, SALT) == ControlFrame(3, b"metrics")


# -- delta rounds in lanes ------------------------------------------------------------


def _delta_frame(rng: np.random.Generator, tensors: list[tuple[int, int, int]], elide: set[int] = frozenset()) -> doc.Frame:
    """A delta round's frame: ``(code, block, numel)`` per tensor, then the digest."""
    out = []
    for i, (code, block, n) in enumerate(tensors):
        data = b"" if i in elide else doc.encode_code(rng.standard_normal(n).astype(np.float32), code, block)
        out.append(doc.Tensor(doc.delta_tag(code, block), (n,), data))
    out.append(doc.Tensor(doc.DIGEST, (16,), bytes(range(100, 116))))
    return doc.Frame(out, doc.MODEL, 2.0)


DELTA_CASES = [
    ([(doc.INT8, 256, 5000), (doc.INT4, 256, 777)], set(), 4),
    ([(doc.FP4, 1024, 9001), (doc.INT8, 256, 300), (doc.INT4, 4096, 5)], {1}, 5),
    ([(doc.INT4, 256, 3000)], set(), 3),
    ([(doc.INT8, 256, 2000)], set(), 9),  # more lanes than blocks: empty lanes
]


@pytest.mark.parametrize(("tensors", "elide", "n"), DELTA_CASES)
@pytest.mark.parametrize("through_shards", [False, True])
def test_delta_lane_frames_are_the_docs_cut(tensors: list, elide: set[int], n: int, through_shards: bool) -> None:
    frame = _delta_frame(np.random.default_rng(n), tensors, elide)
    want = doc.cut_delta_lanes(frame, n, through_shards=through_shards)
    project = to_project(frame)
    layout = LaneLayout.of(project, n, lane0_empty=through_shards)
    got = layout.split(project)
    assert len(got) == n
    for k, (lane, mine) in enumerate(zip(got, want, strict=True)):
        assert body_of(lane) == doc.frame_body(mine), f"lane {k} of {n}: {[(t.dtype, t.shape) for t in lane.tensors]}"
    decoded = [decode_round_frame(doc.encode_frame(lane, RAW_SALT), SALT) for lane in want]
    declared = LaneLayout.of_lane0(decoded[0], lane0_empty=through_shards)
    for k, lane in enumerate(decoded):
        declared.check_lane(k, lane)
    joined = declared.join(decoded)
    assert [bytes(t.data) for t in joined.tensors if t.dtype != doc.DIGEST] == [
        t.data or bytes(doc.payload_size(t)) for t in frame.tensors[:-1]
    ] or elide
