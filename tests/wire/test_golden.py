"""Golden vectors of PROTOCOL.md section 7 (salt = 16 bytes of 0x42).

Every vector must encode to exactly the documented bytes and decode back to
equal values. The MACs are also recomputed here with plain ``hmac`` so a bug
shared by encoder and decoder cannot hide behind a round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest
import trio
import trio.testing

from flodl_trio.transport import MessageStream, ReceiveBuffer
from flodl_trio.wire import (
    DTYPE_BF16,
    DTYPE_F32,
    DeclareDead,
    Hello,
    HelloAck,
    MuxKind,
    RankExit,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    decode_control_ack,
    decode_control_handshake,
    decode_control_msg,
    decode_data_ack,
    decode_data_handshake,
    decode_mux_record,
    decode_round_frame,
    encode_control_ack,
    encode_control_handshake,
    encode_control_msg,
    encode_control_record,
    encode_data_ack,
    encode_data_handshake,
    encode_mux_record,
    encode_round_frame,
    encode_round_frame_chunks,
)

SALT = SessionSalt(b"\x42" * 16)

RF1 = bytes.fromhex(
    "f1170df10100000000000000000000f03f00010200000008000000000000000000803f000000401960f1ead97d18ae"
)
RF2 = bytes.fromhex(
    "f1170df1020000000000000000000004400002020000000300000018000000000000000000803f000000400000404000"
    "0080400000a0400000c0400101020000000400000000000000803f00c06a6c0d3eb1639ceb"
)
RF3 = bytes.fromhex(
    "f1170df10200000001000000000000000000024000000080000000000000000000000000010002000000000000000000"
    "008aad9459f132096f"
)
LF = bytes.fromhex(
    "2f000000f1170df10100000000000000000000f03f00010200000008000000000000000000803f000000401960f1ead97d18ae"
)
MX1 = bytes.fromhex(
    "d0170df10100000003000000002f00000018ee6fdd0f057eedf1170df10100000000000000000000f03f0001020000000800"
    "0000000000000000803f000000401960f1ead97d18ae"
)
MX2 = bytes.fromhex("d0170df101000000020000000001000000a5c1e1d2627c2a1d01")
MX3 = bytes.fromhex("d0170df101000000020000000008000000f7a76eb548a3b9cc0002683002000100")
MX4 = bytes.fromhex("d0170df101000000020000000002000000fdc27faa414f3fdd0201")
MX5 = bytes.fromhex("d0170df10100000002000000000400000068fe247cc29c7b1303fb2c01")
MX6 = bytes.fromhex("d0170df10100000001070000000400000097b08af1e1a4db5ddeadbeef")
HS1 = bytes.fromhex("c0170df1030000000100000002000000")
HS2 = bytes.fromhex("c1170df103000000")
HS3 = bytes.fromhex(
    "c2170df104000000010000000200000000000000000000000000000000000000000000000000000000000000000000"
    "00dc0f92bfb9b6850b"
)
HS4 = bytes.fromhex("c3170df1040000003056df5c614030be")


def mac8(data: bytes) -> bytes:
    return hmac.new(b"\x42" * 16, data, hashlib.sha256).digest()[:8]


def rf1_frame() -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, (2,), np.array([1.0, 2.0], "<f4"))], RoundKind.MODEL, 1.0)


def rf2_frame() -> RoundFrame:
    return RoundFrame(
        [
            TensorPayload(DTYPE_F32, (2, 3), np.arange(1, 7, dtype="<f4")),
            TensorPayload(DTYPE_BF16, (2,), np.array([0x3F80, 0xC000], "<u2")),
        ],
        RoundKind.MODEL,
        2.5,
    )


def rf3_frame() -> RoundFrame:
    return RoundFrame(
        [TensorPayload(DTYPE_F32, (64, 128)), TensorPayload(DTYPE_F32, (512,))],
        RoundKind.CONTROL,
        0.0,
    )


# -- lengths and independent MAC checks ---------------------------------------


@pytest.mark.parametrize(
    ("vector", "length"),
    [
        (RF1, 47), (RF2, 85), (RF3, 57), (LF, 51), (MX1, 72), (MX2, 26), (MX3, 33),
        (MX4, 27), (MX5, 29), (MX6, 29), (HS1, 16), (HS2, 8), (HS3, 56), (HS4, 16),
    ],
)
def test_vector_lengths(vector, length):
    assert len(vector) == length


@pytest.mark.parametrize("vector", [RF1, RF2, RF3])
def test_round_frame_vector_mac_is_hmac_of_preceding_bytes(vector):
    assert vector[-8:] == mac8(vector[:-8])


@pytest.mark.parametrize("vector", [MX1, MX2, MX3, MX4, MX5, MX6])
def test_mux_vector_mac_is_hmac_of_header_and_payload(vector):
    assert vector[17:25] == mac8(vector[:17] + vector[25:])
    assert struct.unpack_from("<I", vector, 13)[0] == len(vector) - 25


def test_handshake_vector_macs():
    assert HS3[48:] == mac8(HS3[:48])
    assert HS4[8:] == mac8(HS4[:8])


def test_lf_is_length_prefixed_rf1():
    assert LF == struct.pack("<I", len(RF1)) + RF1


def test_mx1_payload_is_rf1():
    assert MX1[25:] == RF1


# -- RoundFrames --------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "vector"), [(rf1_frame, RF1), (rf2_frame, RF2), (rf3_frame, RF3)], ids=["RF1", "RF2", "RF3"]
)
def test_round_frame_golden_encode(make, vector):
    frame = make()
    assert encode_round_frame(frame, SALT) == vector
    enc = encode_round_frame_chunks(frame, SALT)
    assert enc.nbytes == len(vector)
    assert enc.tobytes() == vector
    assert frame.encoded_len == len(vector)


@pytest.mark.parametrize(
    ("make", "vector"), [(rf1_frame, RF1), (rf2_frame, RF2), (rf3_frame, RF3)], ids=["RF1", "RF2", "RF3"]
)
def test_round_frame_golden_decode(make, vector):
    decoded = decode_round_frame(vector, SALT)
    assert decoded == make()
    # bytearray and memoryview bodies decode the same
    assert decode_round_frame(bytearray(vector), SALT) == make()
    assert decode_round_frame(memoryview(vector), SALT) == make()


def test_round_frame_golden_decoded_values():
    rf1 = decode_round_frame(RF1, SALT)
    assert rf1.kind == RoundKind.MODEL and rf1.weight == 1.0
    assert np.frombuffer(rf1.tensors[0].data, "<f4").tolist() == [1.0, 2.0]

    rf2 = decode_round_frame(RF2, SALT)
    assert rf2.kind == RoundKind.MODEL and rf2.weight == 2.5
    assert [t.dtype for t in rf2.tensors] == [DTYPE_F32, DTYPE_BF16]
    assert rf2.tensors[0].shape == (2, 3)
    assert np.frombuffer(rf2.tensors[0].data, "<f4").tolist() == [1, 2, 3, 4, 5, 6]
    assert np.frombuffer(rf2.tensors[1].data, "<u2").tolist() == [0x3F80, 0xC000]

    rf3 = decode_round_frame(RF3, SALT)
    assert rf3.kind == RoundKind.CONTROL and rf3.weight == 0.0
    assert [t.shape for t in rf3.tensors] == [(64, 128), (512,)]
    assert all(t.elided and t.nbytes == 0 for t in rf3.tensors)


# -- length framing through MessageStream --------------------------------------


async def test_lf_golden_through_message_stream_memory():
    a, b = trio.testing.memory_stream_pair()
    sender = MessageStream(a)
    enc = encode_round_frame_chunks(rf1_frame(), SALT)
    await sender.send_len_framed(enc.chunks, enc.nbytes)
    await a.send_stream.aclose()
    # The wire carries exactly the LF vector.
    wire = b""
    while True:
        chunk = await b.receive_stream.receive_some()
        if not chunk:
            break
        wire += chunk
    assert wire == LF


async def test_lf_golden_receive_returns_rf1_memory():
    a, b = trio.testing.memory_stream_pair()
    receiver = MessageStream(b)
    await a.send_all(LF)
    await a.send_stream.aclose()
    buf = ReceiveBuffer()
    body = await receiver.receive_len_framed(buf)
    assert bytes(body) == RF1
    assert decode_round_frame(body, SALT) == rf1_frame()
    assert await receiver.receive_len_framed(buf) is None


async def test_lf_golden_over_socketpair():
    s1, s2 = trio.socket.socketpair()
    left, right = trio.SocketStream(s1), trio.SocketStream(s2)
    sender, receiver = MessageStream(left), MessageStream(right)
    enc = encode_round_frame_chunks(rf1_frame(), SALT)
    await sender.send_len_framed(enc.chunks, enc.nbytes)
    await sender.send_len_framed([RF1], len(RF1))
    await left.send_eof()
    raw = await receiver.receive_exactly(len(LF), "LF")
    assert raw == LF
    buf = ReceiveBuffer()
    body = await receiver.receive_len_framed(buf)
    assert bytes(body) == RF1
    assert await receiver.receive_len_framed(buf) is None
    await left.aclose()
    await right.aclose()


async def test_lf_golden_lockstep():
    a, b = trio.testing.lockstep_stream_pair()
    sender, receiver = MessageStream(a), MessageStream(b)
    got = []

    async def read():
        buf = ReceiveBuffer()
        body = await receiver.receive_len_framed(buf)
        got.append(bytes(body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await sender.send_len_framed([RF1], len(RF1))
    assert got == [RF1]
    assert sender.bytes_sent == len(LF)
    assert receiver.bytes_received == len(LF)


# -- MuxRecords -----------------------------------------------------------------


def test_mx1_host_frame_encode_decode():
    enc = encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame_chunks(rf1_frame(), SALT), SALT)
    assert enc.tobytes() == MX1
    assert enc.nbytes == len(MX1)
    # Same bytes when the payload is given as plain bytes.
    assert encode_mux_record(MuxKind.HOST_FRAME, RF1, SALT).tobytes() == MX1
    rec = decode_mux_record(MX1, SALT)
    assert rec.kind == MuxKind.HOST_FRAME
    assert rec.rank == 0
    assert bytes(rec.payload) == RF1
    assert decode_round_frame(rec.payload, SALT) == rf1_frame()


@pytest.mark.parametrize(
    ("msg", "vector", "payload_hex"),
    [
        (HelloAck(), MX2, "01"),
        (Hello("h0", [0, 1], []), MX3, "0002683002000100"),
        (RankExit(1), MX4, "0201"),
        (DeclareDead(300), MX5, "03fb2c01"),
    ],
    ids=["MX2", "MX3", "MX4", "MX5"],
)
def test_mux_control_golden(msg, vector, payload_hex):
    assert encode_control_msg(msg) == bytes.fromhex(payload_hex)
    assert decode_control_msg(bytes.fromhex(payload_hex)) == msg
    assert encode_control_record(msg, SALT) == vector
    assert encode_mux_record(MuxKind.CONTROL, bytes.fromhex(payload_hex), SALT).tobytes() == vector
    rec = decode_mux_record(vector, SALT)
    assert rec.kind == MuxKind.CONTROL
    assert rec.rank == 0
    assert bytes(rec.payload) == bytes.fromhex(payload_hex)
    assert rec.control() == msg


def test_mx3_hello_fields():
    msg = decode_mux_record(MX3, SALT).control()
    assert isinstance(msg, Hello)
    assert msg.host == "h0"
    assert msg.ranks == (0, 1)
    assert msg.model_sigs == ()


def test_mx6_data_record():
    enc = encode_mux_record(MuxKind.DATA, bytes.fromhex("deadbeef"), SALT, rank=7)
    assert enc.tobytes() == MX6
    rec = decode_mux_record(MX6, SALT)
    assert rec.kind == MuxKind.DATA
    assert rec.rank == 7
    assert bytes(rec.payload) == bytes.fromhex("deadbeef")


async def test_mux_golden_through_stream_reader():
    a, b = trio.testing.memory_stream_pair()
    reader = MessageStream(b)
    await a.send_all(MX1 + MX2 + MX3 + MX4 + MX5 + MX6)
    await a.send_stream.aclose()
    buf = ReceiveBuffer()
    got = []
    while (header := await reader.receive_mux_header()) is not None:
        kind, payload = await reader.receive_mux_payload(header, buf, SALT)
        got.append((kind, header.rank, bytes(payload)))
    assert got == [
        (MuxKind.HOST_FRAME, 0, RF1),
        (MuxKind.CONTROL, 0, bytes.fromhex("01")),
        (MuxKind.CONTROL, 0, bytes.fromhex("0002683002000100")),
        (MuxKind.CONTROL, 0, bytes.fromhex("0201")),
        (MuxKind.CONTROL, 0, bytes.fromhex("03fb2c01")),
        (MuxKind.DATA, 7, bytes.fromhex("deadbeef")),
    ]


# -- handshakes -------------------------------------------------------------------


def test_hs1_data_handshake():
    assert encode_data_handshake(1, 2) == HS1
    hello = decode_data_handshake(HS1, 2)
    assert (hello.rank, hello.world_size) == (1, 2)


def test_hs2_data_ack():
    assert encode_data_ack() == HS2
    assert decode_data_ack(HS2) is None


def test_hs3_control_handshake():
    assert encode_control_handshake(1, 2, bytes(32), SALT) == HS3
    hello = decode_control_handshake(HS3, 2, SALT)
    assert (hello.rank, hello.world_size, hello.model_signature) == (1, 2, bytes(32))


def test_hs4_control_ack():
    assert encode_control_ack(SALT) == HS4
    assert decode_control_ack(HS4, SALT) is None
