"""Rank <-> relay handshakes: data v3 (bare) and control v4 (MAC'd, with model signature),
and flodl_trio's local-leg handshake (data v3 with a tag each way).

Each check fails with its own message so an operator can tell a version skew
from a world-size typo from a rank pointed at the wrong host.
"""

from __future__ import annotations

import struct

import attrs

from ..errors import HandshakeError
from .constants import (
    CONTROL_ACK_MAGIC,
    CONTROL_HANDSHAKE_MAGIC,
    CONTROL_PROTOCOL_VERSION,
    DATA_ACK_MAGIC,
    DATA_HANDSHAKE_MAGIC,
    DATA_PROTOCOL_VERSION,
    MAC_LEN,
    MODEL_SIGNATURE_LEN,
)
from .salt import Buffer, SessionSalt, verify_mac

_HELLO = struct.Struct("<IIII")  # magic, version, rank, world_size
_ACK = struct.Struct("<II")  # magic, version

DATA_HANDSHAKE_LEN = _HELLO.size  # 16
DATA_ACK_LEN = _ACK.size  # 8
CONTROL_HANDSHAKE_LEN = _HELLO.size + MODEL_SIGNATURE_LEN + MAC_LEN  # 56
CONTROL_ACK_LEN = _ACK.size + MAC_LEN  # 16


@attrs.frozen
class RankHello:
    """What a rank announced in its handshake."""

    rank: int
    world_size: int
    model_signature: bytes = b""


def exact_bytes(data: Buffer, n: int, what: str) -> bytes:
    """A fixed-size message's bytes, refused unless exactly ``n`` (shared by every handshake-like message)."""
    raw = bytes(data)
    if len(raw) != n:
        raise HandshakeError(f"{what} is {len(raw)} bytes, want exactly {n}")
    return raw


def check_magic_version(magic: int, version: int, want_magic: int, want_version: int, what: str) -> None:
    if magic != want_magic:
        raise HandshakeError(f"{what}: bad magic 0x{magic:08X} (want 0x{want_magic:08X}); not a flodl peer?")
    if version != want_version:
        raise HandshakeError(
            f"{what}: protocol version {version}, this side speaks {want_version} (version skew)"
        )


def check_world(world_size: int, expected: int, rank: int, what: str) -> None:
    if world_size != expected:
        raise HandshakeError(
            f"{what}: rank {rank} announced world_size {world_size}, this side was started with {expected}"
        )


# -- data channel, v3 --------------------------------------------------------


def encode_data_handshake(rank: int, world_size: int) -> bytes:
    return _HELLO.pack(DATA_HANDSHAKE_MAGIC, DATA_PROTOCOL_VERSION, rank, world_size)


def decode_data_handshake(data: Buffer, expected_world_size: int) -> RankHello:
    magic, version, rank, world = _HELLO.unpack(exact_bytes(data, DATA_HANDSHAKE_LEN, "data handshake"))
    check_magic_version(magic, version, DATA_HANDSHAKE_MAGIC, DATA_PROTOCOL_VERSION, "data handshake")
    check_world(world, expected_world_size, rank, "data handshake")
    return RankHello(rank, world)


def encode_data_ack() -> bytes:
    return _ACK.pack(DATA_ACK_MAGIC, DATA_PROTOCOL_VERSION)


def decode_data_ack(data: Buffer) -> None:
    magic, version = _ACK.unpack(exact_bytes(data, DATA_ACK_LEN, "data handshake ack"))
    check_magic_version(magic, version, DATA_ACK_MAGIC, DATA_PROTOCOL_VERSION, "data handshake ack")


# -- the local leg (flodl_trio) -----------------------------------------------
# Frames there are not signed, so the handshake is: both ends prove once, per
# connection, that they hold the session salt (a rank of another run is refused).

LOCAL_HANDSHAKE_LEN = DATA_HANDSHAKE_LEN + MAC_LEN  # 24
LOCAL_ACK_LEN = DATA_ACK_LEN + MAC_LEN  # 16


def encode_local_handshake(rank: int, world_size: int, salt: SessionSalt) -> bytes:
    body = encode_data_handshake(rank, world_size)
    return body + salt.mac8(body)


def decode_local_handshake(data: Buffer, expected_world_size: int, salt: SessionSalt) -> RankHello:
    raw = exact_bytes(data, LOCAL_HANDSHAKE_LEN, "local-leg handshake")
    hello = decode_data_handshake(raw[:DATA_HANDSHAKE_LEN], expected_world_size)
    verify_mac(
        salt.mac8(raw[:DATA_HANDSHAKE_LEN]), raw[DATA_HANDSHAKE_LEN:],
        f"local-leg handshake of rank {hello.rank}",
    )
    return hello


def encode_local_ack(handshake: bytes, salt: SessionSalt) -> bytes:
    """The data ack and a tag over the rank's handshake and the ack (the reply is to this handshake)."""
    head = encode_data_ack()
    return head + salt.mac8(handshake[:DATA_HANDSHAKE_LEN] + head)


def decode_local_ack(data: Buffer, handshake: bytes, salt: SessionSalt) -> None:
    raw = exact_bytes(data, LOCAL_ACK_LEN, "local-leg handshake ack")
    decode_data_ack(raw[:DATA_ACK_LEN])
    verify_mac(
        salt.mac8(handshake[:DATA_HANDSHAKE_LEN] + raw[:DATA_ACK_LEN]), raw[DATA_ACK_LEN:],
        "local-leg handshake ack from the relay",
    )


# -- control channel, v4 -----------------------------------------------------


def encode_control_handshake(rank: int, world_size: int, model_signature: bytes, salt: SessionSalt) -> bytes:
    if len(model_signature) != MODEL_SIGNATURE_LEN:
        raise HandshakeError(
            f"model signature must be {MODEL_SIGNATURE_LEN} bytes, got {len(model_signature)}"
        )
    body = _HELLO.pack(CONTROL_HANDSHAKE_MAGIC, CONTROL_PROTOCOL_VERSION, rank, world_size) + model_signature
    return body + salt.mac8(body)


def decode_control_handshake(data: Buffer, expected_world_size: int, salt: SessionSalt) -> RankHello:
    raw = exact_bytes(data, CONTROL_HANDSHAKE_LEN, "control handshake")
    magic, version, rank, world = _HELLO.unpack_from(raw)
    check_magic_version(magic, version, CONTROL_HANDSHAKE_MAGIC, CONTROL_PROTOCOL_VERSION, "control handshake")
    check_world(world, expected_world_size, rank, "control handshake")
    signed_end = _HELLO.size + MODEL_SIGNATURE_LEN
    verify_mac(salt.mac8(raw[:signed_end]), raw[signed_end:], f"control handshake of rank {rank}")
    return RankHello(rank, world, raw[_HELLO.size:signed_end])


def encode_control_ack(salt: SessionSalt) -> bytes:
    head = _ACK.pack(CONTROL_ACK_MAGIC, CONTROL_PROTOCOL_VERSION)
    return head + salt.mac8(head)


def decode_control_ack(data: Buffer, salt: SessionSalt) -> None:
    raw = exact_bytes(data, CONTROL_ACK_LEN, "control handshake ack")
    magic, version = _ACK.unpack_from(raw)
    check_magic_version(magic, version, CONTROL_ACK_MAGIC, CONTROL_PROTOCOL_VERSION, "control handshake ack")
    verify_mac(salt.mac8(raw[:_ACK.size]), raw[_ACK.size:], "control handshake ack")
