"""ControlFrame: the opaque rank <-> coordinator message a control-channel Data record carries.

Header (24 bytes): ``u32 magic | u32 version | tag[8] | u32 msg_kind | u32 payload_len``
then the payload (<= 16 MiB); ``tag = MAC8(msg_kind, payload_len, payload)``.
"""

from __future__ import annotations

import enum
import struct

import attrs

from ..errors import FramingError
from .constants import (
    CONTROL_FRAME_HEADER_LEN,
    CONTROL_FRAME_MAGIC,
    CONTROL_FRAME_MAX_PAYLOAD,
    CONTROL_FRAME_VERSION,
)
from .salt import Buffer, SessionSalt, verify_mac

_HEAD = struct.Struct("<II8sII")
_SIGNED = struct.Struct("<II")


class ControlKind(enum.IntEnum):
    CONTROL = 1
    TIMING = 2
    METRICS = 3
    HEARTBEAT = 5
    RENDEZVOUS = 6
    JOIN = 7


@attrs.frozen
class ControlFrame:
    msg_kind: int
    payload: bytes = b""


def encode_control_frame(frame: ControlFrame, salt: SessionSalt) -> bytes:
    if len(frame.payload) > CONTROL_FRAME_MAX_PAYLOAD:
        raise FramingError(
            f"ControlFrame payload of {len(frame.payload)} bytes exceeds {CONTROL_FRAME_MAX_PAYLOAD}"
        )
    signed = _SIGNED.pack(frame.msg_kind, len(frame.payload))
    tag = salt.mac8(signed, frame.payload)
    head = _HEAD.pack(CONTROL_FRAME_MAGIC, CONTROL_FRAME_VERSION, tag, frame.msg_kind, len(frame.payload))
    return head + frame.payload


def decode_control_frame(data: Buffer, salt: SessionSalt, *, source: str = "peer") -> ControlFrame:
    raw = bytes(data)
    if len(raw) < CONTROL_FRAME_HEADER_LEN:
        raise FramingError(
            f"ControlFrame from {source} is {len(raw)} bytes, shorter than its {CONTROL_FRAME_HEADER_LEN}-byte header"
        )
    magic, version, tag, kind, length = _HEAD.unpack_from(raw)
    if magic != CONTROL_FRAME_MAGIC:
        raise FramingError(f"ControlFrame from {source}: bad magic 0x{magic:08X}")
    if version != CONTROL_FRAME_VERSION:
        raise FramingError(f"ControlFrame from {source}: version {version}, want {CONTROL_FRAME_VERSION}")
    if length > CONTROL_FRAME_MAX_PAYLOAD:
        raise FramingError(f"ControlFrame from {source}: payload length {length} exceeds {CONTROL_FRAME_MAX_PAYLOAD}")
    payload = raw[CONTROL_FRAME_HEADER_LEN:]
    if len(payload) != length:
        raise FramingError(
            f"ControlFrame from {source} declares {length} payload bytes but carries {len(payload)}"
        )
    verify_mac(salt.mac8(raw[16:24], payload), tag, f"ControlFrame from {source}")
    return ControlFrame(kind, payload)
