"""Validation order and messages of the decoders (RoundFrame, MuxRecord, ControlFrame,
RelayControlMsg, handshakes), plus netenv (timeout scale, cleartext warning) and
SessionSalt parsing.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import math
import os
import struct

import numpy as np
import pytest

from flodl_trio.errors import (
    ConfigError,
    FlodlError,
    FramingError,
    HandshakeError,
    MacError,
    ProtocolError,
    SchemaError,
)
from flodl_trio.transport import connect as peers
from flodl_trio.transport import settings as netenv
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire import (
    DTYPE_F32,
    ControlFrame,
    ControlKind,
    DeclareDead,
    Hello,
    HelloAck,
    MuxKind,
    Outage,
    RankExit,
    Resume,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    check_payload,
    decode_control_ack,
    decode_control_frame,
    decode_control_handshake,
    decode_control_msg,
    decode_data_ack,
    decode_data_handshake,
    decode_mux_record,
    decode_round_frame,
    encode_control_ack,
    encode_control_frame,
    encode_control_handshake,
    encode_control_msg,
    encode_data_ack,
    encode_data_handshake,
    encode_mux_record,
    encode_round_frame,
)
from flodl_trio.wire.liveness import Beacon, beacon_frame, decode_liveness
from flodl_trio.wire.mux import NO_BROADCAST

SALT = SessionSalt(b"\x42" * 16)
OTHER_SALT = SessionSalt(b"\x24" * 16)
KEY = b"\x42" * 16


def mac8(data: bytes, key: bytes = KEY) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:8]


# -- RoundFrame: hand-built frames ------------------------------------------------------


def raw_frame(
    *,
    magic: int = 0xF10D17F1,
    count: int | None = None,
    kind: int = 0,
    weight: float = 1.0,
    tensors: list[tuple[int, tuple[int, ...], bytes, int | None]] | None = None,
    mac_key: bytes | None = KEY,
) -> bytes:
    """A RoundFrame built byte by byte; tensors = (dtype, shape, data, nbytes override)."""
    tensors = [(0, (2,), np.array([1.0, 2.0], "<f4").tobytes(), None)] if tensors is None else tensors
    parts = [struct.pack("<IIBd", magic, len(tensors) if count is None else count, kind, weight)]
    for dtype, shape, data, nbytes in tensors:
        parts.append(struct.pack("<BB", dtype, len(shape)) + struct.pack(f"<{len(shape)}I", *shape))
        parts.append(struct.pack("<Q", len(data) if nbytes is None else nbytes) + data)
    out = b"".join(parts)
    return out + (mac8(out, mac_key) if mac_key is not None else b"\0" * 8)


def test_raw_frame_helper_matches_encoder():
    frame = RoundFrame([TensorPayload(DTYPE_F32, (2,), np.array([1.0, 2.0], "<f4"))], RoundKind.MODEL, 1.0)
    assert raw_frame() == encode_round_frame(frame, SALT)
    assert decode_round_frame(raw_frame(), SALT) == frame


def test_round_frame_bad_magic():
    with pytest.raises(FramingError, match=r"bad magic 0xF10D17F2") as info:
        decode_round_frame(raw_frame(magic=0xF10D17F2), SALT, source="rank 3")
    assert "rank 3" in str(info.value)


def test_round_frame_count_limit():
    with pytest.raises(FramingError, match=r"tensor count 65537 exceeds 65536"):
        decode_round_frame(raw_frame(count=65537), SALT)
    with pytest.raises(FramingError, match=r"tensor count 4294967295 exceeds"):
        decode_round_frame(raw_frame(count=0xFFFFFFFF), SALT)


def test_round_frame_count_at_limit_is_accepted():
    tensors = [(0, (), b"", None)] * 65536
    frame = decode_round_frame(raw_frame(tensors=tensors), SALT)
    assert len(frame.tensors) == 65536
    assert all(t.shape == () and t.nbytes == 0 for t in frame.tensors[:5])


@pytest.mark.parametrize("kind", [2, 3, 255])
def test_round_frame_unknown_kind_byte(kind):
    with pytest.raises(FramingError, match=rf"unknown kind byte {kind}"):
        decode_round_frame(raw_frame(kind=kind), SALT)


@pytest.mark.parametrize("weight", [math.nan, math.inf, -math.inf, -1.0, -1e-300])
def test_round_frame_bad_weight(weight):
    with pytest.raises(FramingError, match=r"weight .* not finite and >= 0"):
        decode_round_frame(raw_frame(weight=weight), SALT)


@pytest.mark.parametrize("weight", [0.0, -0.0, 5e-324, 1.7976931348623157e308])
def test_round_frame_extreme_valid_weights(weight):
    frame = decode_round_frame(raw_frame(weight=weight), SALT)
    assert frame.weight == weight


def test_round_frame_payload_total_over_ceiling():
    tensors = [(0, (4,), bytes(16), None), (0, (4,), bytes(16), None)]
    body = raw_frame(tensors=tensors)
    assert len(decode_round_frame(body, SALT, ceiling=32).tensors) == 2
    with pytest.raises(FramingError, match=r"tensor 1 brings the payload total to 32 bytes, over the frame ceiling of 31"):
        decode_round_frame(body, SALT, ceiling=31)


def test_round_frame_mac_mismatch():
    body = bytearray(raw_frame())
    body[-1] ^= 0x01
    with pytest.raises(MacError, match="MAC mismatch"):
        decode_round_frame(bytes(body), SALT, source="rank 2")
    # a payload byte changed, MAC left alone
    body = bytearray(raw_frame())
    body[-9] ^= 0x80
    with pytest.raises(MacError, match="rank 2"):
        decode_round_frame(bytes(body), SALT, source="rank 2")


def test_round_frame_wrong_salt_is_mac_error():
    with pytest.raises(MacError, match="wrong session salt"):
        decode_round_frame(raw_frame(), OTHER_SALT)
    with pytest.raises(MacError):
        decode_round_frame(raw_frame(mac_key=b"\x24" * 16), SALT)


def test_round_frame_validation_order():
    """magic, count, kind, weight, payload ceiling, MAC: the first failing check is reported."""
    faults = ["magic", "count", "kind", "weight", "ceiling", "mac"]
    messages = ["bad magic", "tensor count", "unknown kind byte", "weight", "frame ceiling", "MAC mismatch"]
    for i, message in enumerate(messages):
        present = set(faults[i:])  # this fault and every later one
        body = raw_frame(
            magic=0x12345678 if "magic" in present else 0xF10D17F1,
            count=70000 if "count" in present else None,
            kind=9 if "kind" in present else 0,
            weight=math.nan if "weight" in present else 1.0,
            tensors=[(0, (4,), bytes(16), None)],
            mac_key=None if "mac" in present else KEY,
        )
        ceiling = 8 if "ceiling" in present else 1 << 30
        with pytest.raises(FlodlError) as info:
            decode_round_frame(body, SALT, ceiling=ceiling)
        assert message in str(info.value), (faults[i], str(info.value))


def test_round_frame_messages_are_distinct():
    cases = [
        raw_frame(magic=1),
        raw_frame(count=70000),
        raw_frame(kind=2),
        raw_frame(weight=math.nan),
        raw_frame(tensors=[(0, (4,), bytes(16), None)]),  # ceiling 8 below
        raw_frame(mac_key=None),
    ]
    messages = []
    for body in cases:
        with pytest.raises(ProtocolError) as info:
            decode_round_frame(body, SALT, ceiling=8)
        messages.append(str(info.value))
    assert len(set(messages)) == len(messages)


def test_round_frame_does_not_check_dtype_or_shape_but_fold_does():
    """Decode leaves dtype and shape-vs-bytes to the consumer, which names the tensor."""
    body = raw_frame(tensors=[(0, (2,), b"\0" * 4, None), (7, (1,), b"\0" * 4, None)])
    frame = decode_round_frame(body, SALT)
    with pytest.raises(SchemaError, match=r"tensor 0: 4 payload bytes, expected 8") as info:
        check_payload(frame.tensors[0], 0, "rank 4")
    assert "numel" in str(info.value) and "rank 4" in str(info.value)
    with pytest.raises(SchemaError, match=r"tensor 1: unknown dtype tag 7"):
        check_payload(frame.tensors[1], 1, "rank 4")


def test_zero_elision_two_tensors_is_57_bytes():
    frame = RoundFrame([TensorPayload(DTYPE_F32, (64, 128)), TensorPayload(DTYPE_F32, (512,))], RoundKind.CONTROL, 0.0)
    raw = encode_round_frame(frame, SALT)
    assert len(raw) == 57 == frame.encoded_len
    back = decode_round_frame(raw, SALT)
    assert [t.elided for t in back.tensors] == [True, True]
    assert [t.numel for t in back.tensors] == [64 * 128, 512]


def test_empty_shape_with_no_bytes_is_not_elided():
    t = TensorPayload(DTYPE_F32, (0, 5))
    assert t.numel == 0 and not t.elided
    assert TensorPayload(DTYPE_F32, (3,)).elided


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (RoundFrame([], RoundKind.MODEL, math.nan), "weight"),
        (RoundFrame([], RoundKind.MODEL, -1.0), "weight"),
        (RoundFrame([], RoundKind.MODEL, math.inf), "weight"),
        (RoundFrame([TensorPayload(DTYPE_F32, (1,) * 256)], RoundKind.MODEL, 1.0), "255"),
        (RoundFrame([TensorPayload(DTYPE_F32, (2**32,))], RoundKind.MODEL, 1.0), "u32"),
    ],
)
def test_encoder_refuses_invalid_frames(frame, match):
    with pytest.raises(SchemaError, match=match):
        encode_round_frame(frame, SALT)


def test_encoder_refuses_too_many_tensors():
    frame = RoundFrame([TensorPayload(DTYPE_F32, ())] * 65537, RoundKind.MODEL, 1.0)
    with pytest.raises(SchemaError, match="65536"):
        encode_round_frame(frame, SALT)


# -- MuxRecord ----------------------------------------------------------------------------


def raw_mux(*, magic=0xF10D17D0, version=1, kind=3, rank=0, length=None, payload=b"abc", key=KEY) -> bytes:
    signed = struct.pack("<IIBII", magic, version, kind, rank, len(payload) if length is None else length)
    tag = mac8(signed + payload, key) if key is not None else b"\0" * 8
    return signed + tag + payload


def test_mux_raw_helper_matches_encoder():
    assert raw_mux() == encode_mux_record(MuxKind.HOST_FRAME, b"abc", SALT).tobytes()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(magic=0xF10D17D1), FramingError, "bad magic 0xF10D17D1"),
        (dict(version=2), FramingError, "unsupported version 2"),
        (dict(length=1 << 20), FramingError, "exceeds the frame ceiling"),
        (dict(length=4), FramingError, "declares a 4-byte payload but 3 bytes follow"),
        (dict(key=b"\x24" * 16), MacError, "MAC mismatch"),
        (dict(kind=9), FramingError, "unknown kind 0x09"),
        (dict(kind=0), FramingError, "unknown kind 0x00"),
    ],
)
def test_mux_record_failures(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        decode_mux_record(raw_mux(**kwargs), SALT, ceiling=1000)


def test_mux_record_too_short():
    with pytest.raises(FramingError, match="shorter than its 25-byte header"):
        decode_mux_record(raw_mux()[:24], SALT)


def test_mux_check_order():
    """magic, version, length vs ceiling, payload, MAC, then kind (only after the MAC passed)."""
    with pytest.raises(FramingError, match="bad magic"):
        decode_mux_record(raw_mux(magic=1, version=9, length=1 << 30, key=None, kind=77), SALT, ceiling=10)
    with pytest.raises(FramingError, match="version"):
        decode_mux_record(raw_mux(version=9, length=1 << 30, key=None, kind=77), SALT, ceiling=10)
    with pytest.raises(FramingError, match="ceiling"):
        decode_mux_record(raw_mux(length=1 << 30, key=None, kind=77), SALT, ceiling=10)
    # an unknown kind with a bad MAC reports the MAC, not the kind
    with pytest.raises(MacError):
        decode_mux_record(raw_mux(key=None, kind=77), SALT)
    with pytest.raises(FramingError, match="unknown kind"):
        decode_mux_record(raw_mux(kind=77), SALT)


def test_mux_kind_and_rank_are_authenticated():
    good = bytearray(raw_mux(kind=1, rank=7))
    for offset in (8, 9, 10, 11, 12):  # kind byte and rank bytes
        flipped = bytearray(good)
        flipped[offset] ^= 0x02
        with pytest.raises(MacError):
            decode_mux_record(bytes(flipped), SALT)


# -- RelayControlMsg -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (250, "fa"),
        (251, "fbfb00"),
        (300, "fb2c01"),
        (65535, "fbffff"),
        (65536, "fc00000100"),
        (2**32 - 1, "fcffffffff"),
    ],
)
def test_control_msg_varint_boundaries(value, encoded):
    assert encode_control_msg(RankExit(value)) == b"\x02" + bytes.fromhex(encoded)
    assert decode_control_msg(b"\x02" + bytes.fromhex(encoded)) == RankExit(value)
    assert decode_control_msg(b"\x03" + bytes.fromhex(encoded)) == DeclareDead(value)


def test_control_msg_hello_with_signatures_round_trip():
    msg = Hello("höst-ü", [0, 3, 70000], [bytes(range(32)), b"\xff" * 32])
    raw = encode_control_msg(msg)
    assert decode_control_msg(raw) == msg
    assert decode_control_msg(encode_control_msg(HelloAck())) == HelloAck()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "ended inside variant index"),
        (b"\x04", "unknown variant index 4"),
        (b"\xfe", "invalid varint tag 254"),
        (b"\xff", "invalid varint tag 255"),
        (b"\x01\x00", "1 trailing bytes"),
        (b"\x02", "ended inside RankExit rank"),
        (b"\x02\xfb\x01", "ended inside RankExit rank"),
        (b"\x02\xfd" + (2**32).to_bytes(8, "little"), "exceeds 4294967295"),
        (b"\x00\x02\xff\xfe\x00\x00", "not UTF-8"),
        (b"\x00\x05ab", "host length claims 5 items but only 2 bytes remain"),
        (b"\x00\x00\x03\x01", "rank count claims 3 items"),
        (b"\x00\x00\x00\x01" + b"\0" * 31, "model signature count claims 1 items"),
    ],
)
def test_control_msg_decode_errors(payload, match):
    with pytest.raises(FramingError, match=match):
        decode_control_msg(payload)


# -- ControlFrame -----------------------------------------------------------------------------


def raw_cf(*, magic=0xF10D17C4, version=4, kind=5, payload=b"beat", length=None, key=KEY) -> bytes:
    n = len(payload) if length is None else length
    tag = mac8(struct.pack("<II", kind, n) + payload, key)
    return struct.pack("<II8sII", magic, version, tag, kind, n) + payload


def test_control_frame_helper_matches_encoder():
    assert raw_cf() == encode_control_frame(ControlFrame(ControlKind.HEARTBEAT, b"beat"), SALT)
    assert decode_control_frame(raw_cf(), SALT) == ControlFrame(5, b"beat")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(magic=0xF10D17C5), FramingError, "bad magic"),
        (dict(version=3), FramingError, "version 3, want 4"),
        (dict(length=(16 << 20) + 1), FramingError, "exceeds 16777216"),
        (dict(length=5), FramingError, "declares 5 payload bytes but carries 4"),
        (dict(key=b"\x24" * 16), MacError, "MAC mismatch"),
    ],
)
def test_control_frame_failures(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        decode_control_frame(raw_cf(**kwargs), SALT, source="rank 9")


def test_control_frame_short_and_oversize_encode():
    with pytest.raises(FramingError, match="shorter than its 24-byte header"):
        decode_control_frame(raw_cf()[:23], SALT)
    with pytest.raises(FramingError, match="exceeds"):
        encode_control_frame(ControlFrame(5, b"\0" * ((16 << 20) + 1)), SALT)


# -- handshakes ----------------------------------------------------------------------------


def _data_hs(magic=0xF10D17C0, version=3, rank=1, world=2) -> bytes:
    return struct.pack("<IIII", magic, version, rank, world)


def _control_hs(magic=0xF10D17C2, version=4, rank=1, world=2, sig=bytes(32), key=KEY) -> bytes:
    body = struct.pack("<IIII", magic, version, rank, world) + sig
    return body + mac8(body, key)


def _control_ack(magic=0xF10D17C3, version=4, key=KEY) -> bytes:
    head = struct.pack("<II", magic, version)
    return head + mac8(head, key)


def _message(fn, *args) -> tuple[type, str]:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    return type(info.value), str(info.value)


def test_data_handshake_failures_are_distinct_and_named():
    magic = _message(decode_data_handshake, _data_hs(magic=0xF10D17C2), 2)
    version = _message(decode_data_handshake, _data_hs(version=2), 2)
    world = _message(decode_data_handshake, _data_hs(world=3), 2)
    short = _message(decode_data_handshake, _data_hs()[:15], 2)
    assert all(t is HandshakeError for t, _ in (magic, version, world, short))
    assert "bad magic 0xF10D17C2" in magic[1]
    assert "version 2" in version[1] and "3" in version[1] and "skew" in version[1]
    assert "world_size 3" in world[1] and "rank 1" in world[1] and "2" in world[1]
    assert "15 bytes, want exactly 16" in short[1]
    assert len({m for _, m in (magic, version, world, short)}) == 4


def test_data_ack_failures():
    assert _message(decode_data_ack, struct.pack("<II", 0xF10D17C0, 3))[0] is HandshakeError
    t, m = _message(decode_data_ack, struct.pack("<II", 0xF10D17C1, 4))
    assert t is HandshakeError and "version 4" in m and "ack" in m
    t, m = _message(decode_data_ack, encode_data_ack() + b"\0")
    assert "9 bytes, want exactly 8" in m


def test_control_handshake_failures_are_distinct_and_named():
    cases = {
        "magic": _message(decode_control_handshake, _control_hs(magic=0xF10D17C0), 2, SALT),
        "version": _message(decode_control_handshake, _control_hs(version=3), 2, SALT),
        "world": _message(decode_control_handshake, _control_hs(world=5), 2, SALT),
        "mac": _message(decode_control_handshake, _control_hs(key=b"\x24" * 16), 2, SALT),
        "length": _message(decode_control_handshake, _control_hs()[:-1], 2, SALT),
    }
    assert cases["magic"][0] is HandshakeError and "bad magic" in cases["magic"][1]
    assert cases["version"][0] is HandshakeError and "version 3" in cases["version"][1]
    assert cases["world"][0] is HandshakeError and "world_size 5" in cases["world"][1]
    assert cases["mac"][0] is MacError and "MAC mismatch" in cases["mac"][1]
    assert "rank 1" in cases["mac"][1] and "control handshake" in cases["mac"][1]
    assert cases["length"][0] is HandshakeError and "55 bytes" in cases["length"][1]
    assert len({m for _, m in cases.values()}) == len(cases)
    for _, m in cases.values():
        assert "control handshake" in m


def test_control_handshake_world_checked_before_mac():
    t, m = _message(decode_control_handshake, _control_hs(world=5, key=b"\x24" * 16), 2, SALT)
    assert t is HandshakeError and "world_size" in m


def test_control_handshake_wrong_salt_and_signature():
    sig = bytes(range(32))
    raw = encode_control_handshake(3, 8, sig, SALT)
    assert decode_control_handshake(raw, 8, SALT).model_signature == sig
    with pytest.raises(MacError):
        decode_control_handshake(raw, 8, OTHER_SALT)
    with pytest.raises(HandshakeError, match="32 bytes"):
        encode_control_handshake(3, 8, sig[:31], SALT)


def test_control_ack_failures_are_distinct_and_named():
    cases = {
        "magic": _message(decode_control_ack, _control_ack(magic=0xF10D17C1), SALT),
        "version": _message(decode_control_ack, _control_ack(version=3), SALT),
        "mac": _message(decode_control_ack, _control_ack(key=b"\x24" * 16), SALT),
        "length": _message(decode_control_ack, _control_ack()[:8], SALT),
    }
    assert cases["magic"][0] is HandshakeError and "bad magic" in cases["magic"][1]
    assert cases["version"][0] is HandshakeError and "version 3" in cases["version"][1]
    assert cases["mac"][0] is MacError and "control handshake ack" in cases["mac"][1]
    assert "MAC mismatch" in cases["mac"][1]
    assert cases["length"][0] is HandshakeError
    assert len({m for _, m in cases.values()}) == len(cases)
    with pytest.raises(MacError):
        decode_control_ack(encode_control_ack(SALT), OTHER_SALT)


def test_data_and_control_handshakes_are_not_interchangeable():
    with pytest.raises(HandshakeError, match="bad magic"):
        decode_data_handshake(encode_control_handshake(1, 2, bytes(32), SALT)[:16], 2)
    with pytest.raises(HandshakeError):
        decode_control_handshake(encode_data_handshake(1, 2) + bytes(40), 2, SALT)


# -- netenv: FLODL_NET_TIMEOUT_SCALE ------------------------------------------------------------


@pytest.fixture
def fresh_netenv(monkeypatch, caplog):
    monkeypatch.delenv(netenv.TIMEOUT_SCALE_ENV, raising=False)
    monkeypatch.setattr(netenv, "_warned_scale_values", set())
    monkeypatch.setattr(peers, "_warned_peers", set())
    caplog.set_level(logging.WARNING, logger="flodl_trio.net")
    return caplog


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "flodl_trio.net" and r.levelno == logging.WARNING]


def _bounds() -> NetBounds:
    """What a role builds at its API boundary: the defaults scaled by the environment."""
    return NetBounds.from_env()


def test_timeout_scale_default(fresh_netenv):
    bounds = _bounds()
    assert netenv.timeout_scale(os.environ) == 1.0
    assert bounds.handshake == 10.0
    assert bounds.write_stall == 30.0
    assert bounds.channel_magic == 5.0
    assert bounds.connect_interval == 0.5
    assert bounds == NetBounds()
    assert _warnings(fresh_netenv) == []


def test_timeout_scale_empty_is_default(fresh_netenv, monkeypatch):
    monkeypatch.setenv(netenv.TIMEOUT_SCALE_ENV, "")
    assert netenv.timeout_scale(os.environ) == 1.0
    assert _warnings(fresh_netenv) == []


@pytest.mark.parametrize(("raw", "value"), [("2.5", 2.5), ("0.1", 0.1), ("1", 1.0), (" 3 ", 3.0), ("1e2", 100.0)])
def test_timeout_scale_valid(fresh_netenv, monkeypatch, raw, value):
    monkeypatch.setenv(netenv.TIMEOUT_SCALE_ENV, raw)
    assert netenv.timeout_scale(os.environ) == value
    assert _bounds().handshake == pytest.approx(10.0 * value)
    assert _bounds().write_stall == pytest.approx(30.0 * value)
    assert _warnings(fresh_netenv) == []


def test_timeout_scale_scales_bounds(fresh_netenv, monkeypatch):
    monkeypatch.setenv(netenv.TIMEOUT_SCALE_ENV, "2.5")
    assert _bounds().handshake == 25.0
    assert _bounds().write_stall == 75.0
    assert _bounds().heartbeat_timeout == 75.0
    assert _bounds().mid_frame_starvation == 60.0  # deliberately not scaled
    assert _bounds() == NetBounds.scaled(2.5)


def test_bounds_come_from_the_given_environment_not_the_process(fresh_netenv):
    assert NetBounds.from_env({netenv.TIMEOUT_SCALE_ENV: "3"}).handshake == 30.0
    assert NetBounds.from_env({}).handshake == 10.0


@pytest.mark.parametrize("field", ["handshake", "write_stall", "channel_magic", "heartbeat_timeout", "connect_interval"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_bounds_refuse_non_positive_values(field, value):
    with pytest.raises(ConfigError, match=field):
        NetBounds(**{field: value})


@pytest.mark.parametrize("raw", ["0.05", "nan", "inf", "abc", "-1", "-inf", "0"])
def test_timeout_scale_bad_value_warns_once(fresh_netenv, monkeypatch, raw):
    monkeypatch.setenv(netenv.TIMEOUT_SCALE_ENV, raw)
    for _ in range(3):
        assert netenv.timeout_scale(os.environ) == 1.0
    assert _bounds().handshake == 10.0
    assert _bounds().write_stall == 30.0
    records = _warnings(fresh_netenv)
    assert len(records) == 1
    assert netenv.TIMEOUT_SCALE_ENV in records[0].getMessage()
    assert repr(raw) in records[0].getMessage()


def test_timeout_scale_each_bad_value_warns_once(fresh_netenv, monkeypatch):
    bad = ["0.05", "nan", "inf", "abc", "-1"]
    for raw in bad * 2:
        monkeypatch.setenv(netenv.TIMEOUT_SCALE_ENV, raw)
        assert netenv.timeout_scale(os.environ) == 1.0
    assert len(_warnings(fresh_netenv)) == len(bad)


# -- netenv: cleartext warning -------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1", "127.8.9.10", "10.0.0.1", "10.255.255.255", "172.16.0.1", "172.31.255.254",
        "192.168.1.1", "169.254.10.10", "100.64.0.1", "100.127.255.255", "::1", "fe80::1",
        "fe80::1%eth0", "fd00::1", "fc00::5", "::ffff:10.1.2.3", "::ffff:127.0.0.1",
    ],
)
def test_no_warning_for_private_peers(fresh_netenv, host):
    assert peers.warn_if_public_peer("relay", host) is False
    assert _warnings(fresh_netenv) == []


@pytest.mark.parametrize("host", ["8.8.8.8", "172.32.0.1", "100.128.0.1", "2001:4860:4860::8888", "::ffff:8.8.8.8"])
def test_one_warning_per_public_peer(fresh_netenv, host):
    assert peers.warn_if_public_peer("relay", host) is True
    assert peers.warn_if_public_peer("relay", host) is False
    records = _warnings(fresh_netenv)
    assert len(records) == 1
    message = records[0].getMessage()
    assert host in message and "NOT encrypted" in message and "relay" in message


def test_public_peer_warning_is_per_address(fresh_netenv):
    assert peers.warn_if_public_peer("controller", "8.8.8.8") is True
    assert peers.warn_if_public_peer("controller", "1.1.1.1") is True
    assert peers.warn_if_public_peer("relay", "8.8.8.8") is False
    assert len(_warnings(fresh_netenv)) == 2


# -- SessionSalt ------------------------------------------------------------------------------------


def test_salt_from_hex_ok():
    text = "42" * 16
    salt = SessionSalt.from_hex(text)
    assert salt.raw == b"\x42" * 16
    assert salt.hex() == text
    assert salt == SALT
    assert SessionSalt.from_hex("00112233445566778899aabbccddeeff").raw == bytes.fromhex(
        "00112233445566778899aabbccddeeff"
    )


@pytest.mark.parametrize("n", [0, 2, 30, 31, 33, 34, 64])
def test_salt_from_hex_wrong_length(n):
    with pytest.raises(ConfigError, match=rf"exactly 32 characters, got {n}"):
        SessionSalt.from_hex("a" * n)


@pytest.mark.parametrize("text", ["zz" * 16, "0g" + "00" * 15, "0x" + "00" * 15, "é" * 32, "AB" * 16, "aB" * 16])
def test_salt_from_hex_non_hex(text):
    """Exactly lowercase hex (PROTOCOL.md): uppercase is refused too, without echoing the secret."""
    with pytest.raises(ConfigError, match="lowercase hex") as refused:
        SessionSalt.from_hex(text)
    assert text not in str(refused.value)


def test_salt_from_hex_ignores_a_files_last_newline():
    assert SessionSalt.from_hex("ab" * 16 + "\n").raw == b"\xab" * 16


def test_salt_errors_are_value_errors_too():
    with pytest.raises(ValueError):
        SessionSalt.from_hex("abc")
    assert issubclass(ConfigError, FlodlError)


def test_salt_raw_length_checked():
    for bad in (b"", b"\0" * 15, b"\0" * 17):
        with pytest.raises(ConfigError, match="16 raw bytes"):
            SessionSalt(bad)
    with pytest.raises(ConfigError):
        SessionSalt.coerce("42" * 16)
    assert SessionSalt.coerce(b"\x42" * 16) == SALT
    assert SessionSalt.coerce(bytearray(b"\x42" * 16)) == SALT
    assert SessionSalt.coerce(SALT) is SALT


def test_salt_repr_never_shows_key():
    key = bytes.fromhex("0123456789abcdeffedcba9876543210")
    salt = SessionSalt(key)
    for text in (repr(salt), str(salt), f"{salt}", repr([salt]), repr({"s": salt})):
        assert "0123456789abcdef" not in text.lower()
        assert key.hex() not in text
        assert repr(key) not in text
        assert "redacted" in text


def test_salt_generate_is_random_and_macs_match_hmac():
    a, b = SessionSalt.generate(), SessionSalt.generate()
    assert a != b and len(a.raw) == 16
    data = b"some bytes"
    assert a.mac8(data) == hmac.new(a.raw, data, hashlib.sha256).digest()[:8]
    assert a.mac8(b"some ", b"bytes") == a.mac8(data)
    assert a.mac8_of(iter([b"so", b"me bytes"])) == a.mac8(data)
    assert a.mac8(memoryview(data), bytearray()) == a.mac8(data)


def test_all_protocol_errors_share_the_root():
    for exc in (HandshakeError, FramingError, MacError, SchemaError):
        assert issubclass(exc, ProtocolError) and issubclass(exc, FlodlError)
    pairs = itertools.combinations((HandshakeError, FramingError, MacError, SchemaError), 2)
    for a, b in pairs:
        assert not issubclass(a, b) and not issubclass(b, a)


def test_the_run_over_payload_is_exactly_its_tag():
    from flodl_trio.wire.control_frame import (
        ControlFrame,
        ControlKind,
        decode_control_frame,
        encode_control_frame,
    )
    from flodl_trio.wire.liveness import (
        Notice,
        RunOver,
        decode_liveness,
        notice_frame,
        run_over_frame,
    )
    from flodl_trio.wire.salt import SessionSalt

    salt = SessionSalt(b"\x05" * 16)
    frame = decode_control_frame(encode_control_frame(run_over_frame(), salt), salt)
    assert decode_liveness(frame) == RunOver()
    assert decode_liveness(ControlFrame(ControlKind.CONTROL, b"FN01 and more")) is None
    assert decode_liveness(ControlFrame(ControlKind.HEARTBEAT, b"FN01")) is None
    assert decode_liveness(notice_frame("gone")) == Notice("gone")


@pytest.mark.parametrize(
    ("msg", "raw"),
    [
        (Resume(NO_BROADCAST), "cc" + "00" * 8 + "0000"),
        (Resume(bytes(range(1, 9)), awaiting=True), "cc0102030405060708" + "0100"),
        (Resume(b"\xff" * 8, awaiting=True, resends=True), "cc" + "ff" * 8 + "0101"),
    ],
)
def test_resume_round_trips_as_docs_wire_md_lays_it_out(msg, raw):
    assert encode_control_msg(msg).hex() == raw
    assert decode_control_msg(bytes.fromhex(raw)) == msg


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xcc" + b"\0" * 7, "ended inside Resume last_broadcast"),
        (b"\xcc" + b"\0" * 8, "ended inside Resume awaiting"),
        (b"\xcc" + b"\0" * 8 + b"\x02\x00", "Resume awaiting = 2 exceeds 1"),
        (b"\xcc" + b"\0" * 8 + b"\x00\x01", "resends a HostFrame it does not await"),
        (b"\xcc" + b"\0" * 8 + b"\x01\x01\x00", "1 trailing bytes"),
    ],
)
def test_resume_decode_errors(payload, match):
    with pytest.raises(FramingError, match=match):
        decode_control_msg(payload)


def test_resume_refuses_a_tag_of_the_wrong_length():
    with pytest.raises(ConfigError, match="8 bytes, got 7"):
        Resume(b"\0" * 7)


def test_outage_round_trips_as_docs_wire_md_lays_it_out():
    assert encode_control_msg(Outage(300_000)).hex() == "cd" + "fc" + (300_000).to_bytes(4, "little").hex()
    assert decode_control_msg(bytes.fromhex("cd00")) == Outage(0)
    with pytest.raises(FramingError, match="ended inside Outage millis"):
        decode_control_msg(b"\xcd")


def test_a_beacon_says_how_long_to_hold_only_when_it_has_something_to_say():
    plain = beacon_frame(7, 4, 1, 30_000)
    assert plain.payload[:4] == b"BC01" and decode_liveness(plain) == Beacon(7, 4, 1, 30_000, 0)
    holding = beacon_frame(7, 4, 1, 30_000, outage_ms=300_000)
    assert holding.payload[:4] == b"BC02" and len(holding.payload) == len(plain.payload) + 4
    assert decode_liveness(holding) == Beacon(7, 4, 1, 30_000, 300_000)
    with pytest.raises(FramingError, match="not its fixed size"):
        decode_liveness(ControlFrame(holding.msg_kind, holding.payload[:-1]))


def test_the_shard_messages_round_trip_as_docs_wire_md_lays_them_out():
    from flodl_trio.wire.mux import (
        Decide, Decided, LanesIn, PieceRefused, Pieces, ShardAck, ShardAlive, ShardLost, ShardOffer, ShardSetup,
    )

    decide = Decide(300, 7, 9, [(0, [3, 2])], [0, 2], [0, 2, 4])
    assert encode_control_msg(decide).hex() == (
        "d0" + "fb2c01" + "07" + "09" + "01" + "00020302" + "020002" + "03000204" + "00" + "00"
    )
    assert decode_control_msg(encode_control_msg(decide)) == decide
    copy = Decide(300, 7, 9, [(0, [3, 2])], [0, 2], [0, 2, 4], copy=True)
    assert encode_control_msg(copy)[-2:] == b"\x01\x00" and decode_control_msg(encode_control_msg(copy)) == copy
    # copy 2: the lanes and each stepped lane's outer state (a checkpoint); 3 is no copy at all
    with_state = Decide(300, 7, 9, [(0, [3, 2])], [0, 2], [0, 2, 4], copy=2, step=True)
    assert encode_control_msg(with_state)[-2:] == b"\x02\x01"
    assert decode_control_msg(encode_control_msg(with_state)) == with_state
    with pytest.raises(FramingError, match="Decide copy"):
        decode_control_msg(encode_control_msg(decide)[:-2] + b"\x03\x00")
    with pytest.raises(FramingError, match="Decide copy must be 0, 1 or 2, got 3"):
        Decide(300, 7, 9, [(0, [3, 2])], [0, 2], [0, 2, 4], copy=3)
    # The outer step: 1 steps the whole model's state, 2 a fragment's (index, count).
    step = Decide(300, 7, 9, [(0, [3, 2])], [0, 2], [0, 2, 4], step=True)
    assert encode_control_msg(step)[-2:] == b"\x00\x01" and decode_control_msg(encode_control_msg(step)) == step
    fragment = Decide(300, 7, 9, [(0, [3, 2])], [0, 2], [0, 2, 4], step=True, fragment=(1, 4))
    assert encode_control_msg(fragment)[-4:] == b"\x00\x02\x01\x04"
    assert decode_control_msg(encode_control_msg(fragment)) == fragment
    with pytest.raises(FramingError, match="Decide step"):
        decode_control_msg(encode_control_msg(decide)[:-1] + b"\x03")
    with pytest.raises(FramingError, match="fragment 4 of 4"):
        decode_control_msg(encode_control_msg(decide)[:-1] + b"\x02\x04\x04")
    from flodl_trio.wire.mux import ShardBack
    back = ShardBack(2, "10.0.0.3", 4242)
    assert encode_control_msg(back) == b"\xda\x02" + b"\x08" + b"10.0.0.3" + b"\xfb\x92\x10"  # shard, host, port
    assert decode_control_msg(encode_control_msg(back)) == back
    from flodl_trio.wire.mux import ShardMoved
    moved = ShardMoved(1, "10.0.0.1", 4242)
    assert encode_control_msg(moved) == b"\xdb" + b"\x01" + b"\x08" + b"10.0.0.1" + b"\xfb\x92\x10"
    assert decode_control_msg(encode_control_msg(moved)) == moved
    from flodl_trio.wire.mux import Mirror, Mirrored
    mirror = Mirror(2, 300, 1)  # shard 2's lane of decision 300 follows, its state before it
    assert encode_control_msg(mirror) == b"\xdc" + b"\x02" + b"\xfb\x2c\x01" + b"\x01"
    assert decode_control_msg(encode_control_msg(mirror)) == mirror
    with pytest.raises(FramingError, match="Mirror start"):
        decode_control_msg(b"\xdc\x02\x07\x03")  # start is 0, 1 or 2
    assert encode_control_msg(Mirrored(7)) == b"\xdd\x07" and decode_control_msg(b"\xdd\x07") == Mirrored(7)
    from flodl_trio.wire.mux import HandedBack, Handoff
    whole, fragment = Handoff(2), Handoff(2, (1, 4))  # a lane state of the whole model's, of fragment 1 of 4
    assert encode_control_msg(whole) == b"\xde\x02\x00" and encode_control_msg(fragment) == b"\xde\x02\x01\x01\x04"
    assert [decode_control_msg(encode_control_msg(m)) for m in (whole, fragment)] == [whole, fragment]
    with pytest.raises(FramingError, match="Handoff: fragment 4 of 4"):
        decode_control_msg(b"\xde\x02\x01\x04\x04")
    with pytest.raises(FramingError, match="Handoff fragment"):
        decode_control_msg(b"\xde\x02\x02")
    assert encode_control_msg(HandedBack(2, 5)) == b"\xdf\x02\x05"
    assert decode_control_msg(b"\xdf\x02\x05") == HandedBack(2, 5)
    from flodl_trio.wire.mux import Seed
    assert encode_control_msg(Seed(300, 3)) == b"\xe0\xfb\x2c\x01\x03"  # 3 lane states for decision 300
    assert decode_control_msg(b"\xe0\xfb\x2c\x01\x03") == Seed(300, 3)
    with pytest.raises(FramingError, match="Seed lanes"):
        decode_control_msg(b"\xe0\x01")
    from flodl_trio.wire.mux import ShardOuter
    outer = ShardOuter(2, 0.7, 0.9)
    assert encode_control_msg(outer) == b"\xd9\x02" + struct.pack("<dd", 0.7, 0.9)
    assert decode_control_msg(encode_control_msg(outer)) == outer
    for bad, named in ((b"\xd9\x00", "kind 0"), (b"\xd9\x03", "ShardOuter kind"), (b"\xd9\x01\x00", "ended inside")):
        with pytest.raises(FramingError, match=named):
            decode_control_msg(bad + (b"" if named == "ended inside" else bytes(16)))
    assert decode_control_msg(encode_control_msg(PieceRefused(4, "lane 2: é"))) == PieceRefused(4, "lane 2: é")
    assert encode_control_msg(ShardSetup(1, 3, 30_000)).hex() == "cf" + "01" + "03" + "fb3075"
    for msg, head in [(PieceRefused(1, "bad"), "d7"), (ShardSetup(0, 2, 3000), "cf"), (ShardLost(1), "d2"), (Decided(7), "d3"), (LanesIn(7), "d4"), (Pieces(3), "d5"), (ShardAck(4), "d1")]:
        raw = encode_control_msg(msg)
        assert raw.hex()[:2] == head and decode_control_msg(raw) == msg
    assert encode_control_msg(ShardAlive()) == b"\xd6" and decode_control_msg(b"\xd6") == ShardAlive()
    offer = ShardOffer("10.0.0.2", 4242)
    assert encode_control_msg(offer).hex() == "d8" + "08" + b"10.0.0.2".hex() + "fb9210"
    assert decode_control_msg(encode_control_msg(offer)) == offer
    with pytest.raises(FramingError, match="ShardOffer port"):
        decode_control_msg(b"\xd8\x01a\xfc" + (70_000).to_bytes(4, "little"))
    with pytest.raises(FramingError, match="ended inside Decide lanes"):
        decode_control_msg(b"\xd0\x01\x02")
    with pytest.raises(FramingError, match="1 trailing bytes"):
        decode_control_msg(b"\xd6\x00")
