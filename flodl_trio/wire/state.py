"""flodl_trio extension: the state request a joining rank sends, and its reply.

A rank that (re)joins starts from the consensus of the last completed window,
which the controller keeps. The rank opens a connection to its relay's data
port and sends a request; the relay pipes that connection to the
controller's port as is. The controller answers at once for a fresh start
(no window completed yet) or a refusal, and otherwise at the next window
boundary, when it also lets the rank into its host's barrier. Both
directions are authenticated with the session salt, and the reply is bound
to the request's fresh nonce, so an old reply replayed later does not
verify::

    request (40 bytes): u32 magic 0xF10D17E8 | u32 version 1 | u32 rank | u32 world_size
                        | 16-byte nonce | MAC8(the 32 bytes before)
    reply header (28):  u32 magic 0xF10D17E9 | u32 version 1 | u32 status (0 ok, 1 refused)
                        | u32 frame count n | i64 window (-1: none completed) | u32 reason length
    then:               reason (UTF-8, <= 1024 bytes) | n x u32 frame length
                        | MAC8(header || reason || lengths || request nonce)
    then per frame:     u32 length | a RoundFrame, its own MAC8 last (params first, then buffers)

With fragments (docs/wire.md, "Fragment tag") the params are one frame per
fragment, in fragment order, so a reply carries up to MAX_FRAGMENTS + 1
frames; the joiner splits them by its own model's tensor counts.

The frame lengths sit under the reply's MAC, so a joiner can take each frame
into memory of the right size at once (it still checks every frame's MAC).

See docs/wire.md ("State for joiners").
"""

from __future__ import annotations

import enum
import secrets
import struct

import attrs

from ..errors import HandshakeError
from .constants import CHANNEL_MAGIC_STATE, MAC_LEN, STATE_REPLY_MAGIC, STATE_VERSION
from .fragment import MAX_FRAGMENTS
from .handshake import check_magic_version, check_world, exact_bytes
from .salt import Buffer, SessionSalt, verify_mac

_REQUEST = struct.Struct("<IIII16s")
_REPLY = struct.Struct("<IIIIqI")
NONCE_LEN = 16
STATE_REQUEST_LEN = _REQUEST.size + MAC_LEN  # 40
STATE_REPLY_HEADER_LEN = _REPLY.size  # 28
MAX_REASON_LEN = 1024
MAX_STATE_FRAMES = MAX_FRAGMENTS + 1  # each fragment's params, then the buffers


class StateStatus(enum.IntEnum):
    OK = 0
    REFUSED = 1


@attrs.frozen
class StateRequest:
    rank: int
    world_size: int
    nonce: bytes


@attrs.frozen
class StateReply:
    """``window``: index of the window the frames are the consensus of (-1: none yet);
    ``frames``: how many follow; ``reason``: why a refused request was refused."""

    status: StateStatus
    window: int = -1
    frames: int = 0
    reason: str = ""
    lengths: tuple[int, ...] = ()  # each frame's byte count, announced under the MAC

    @classmethod
    def refused(cls, reason: str) -> StateReply:
        return cls(StateStatus.REFUSED, reason=reason)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_LEN)


def encode_state_request(rank: int, world_size: int, nonce: bytes, salt: SessionSalt) -> bytes:
    body = _REQUEST.pack(CHANNEL_MAGIC_STATE, STATE_VERSION, rank, world_size, nonce)
    return body + salt.mac8(body)


def decode_state_request(data: Buffer, world_size: int, salt: SessionSalt) -> StateRequest:
    """Check a state request: layout, version, world size and rank, then its MAC."""
    raw = exact_bytes(data, STATE_REQUEST_LEN, "state request")
    magic, version, rank, world, nonce = _REQUEST.unpack_from(raw)
    check_magic_version(magic, version, CHANNEL_MAGIC_STATE, STATE_VERSION, "state request")
    check_world(world, world_size, rank, "state request")
    if not 0 <= rank < world_size:
        raise HandshakeError(f"state request from rank {rank}, outside world_size {world_size}")
    verify_mac(salt.mac8(raw[:_REQUEST.size]), raw[_REQUEST.size:], f"state request from rank {rank}")
    return StateRequest(rank, world, nonce)


def encode_state_reply(reply: StateReply, nonce: bytes, salt: SessionSalt) -> bytes:
    """The reply's header, reason, frame lengths and MAC (the frames follow, each signed on its own)."""
    if len(reply.lengths) != reply.frames:
        raise ValueError(f"state reply announces {reply.frames} frames with {len(reply.lengths)} lengths")
    reason = reply.reason.encode()[:MAX_REASON_LEN]
    header = _REPLY.pack(STATE_REPLY_MAGIC, STATE_VERSION, reply.status, reply.frames, reply.window, len(reason))
    lengths = b"".join(n.to_bytes(4, "little") for n in reply.lengths)
    return header + reason + lengths + salt.mac8(header, reason, lengths, nonce)


def state_reply_tail_len(frames: int, reason_len: int) -> int:
    """Bytes after the reply's header: reason, frame lengths, MAC."""
    return reason_len + 4 * frames + MAC_LEN


def decode_state_reply_header(data: Buffer) -> tuple[StateStatus, int, int, int]:
    """Check the fixed header (nothing trusted yet): ``(status, frames, window, reason_len)``."""
    raw = exact_bytes(data, STATE_REPLY_HEADER_LEN, "state reply header")
    magic, version, status, frames, window, reason_len = _REPLY.unpack_from(raw)
    check_magic_version(magic, version, STATE_REPLY_MAGIC, STATE_VERSION, "state reply")
    if status not in StateStatus.__members__.values():
        raise HandshakeError(f"state reply: unknown status {status}")
    if reason_len > MAX_REASON_LEN:
        raise HandshakeError(f"state reply: reason of {reason_len} bytes (at most {MAX_REASON_LEN})")
    if not 0 <= frames <= MAX_STATE_FRAMES or (window < 0) != (frames == 0) or window < -1:
        raise HandshakeError(f"state reply: window {window} with {frames} frames")
    return StateStatus(status), frames, window, reason_len


def decode_state_reply(header: Buffer, tail: Buffer, nonce: bytes, salt: SessionSalt) -> StateReply:
    """The whole reply (``tail``: reason, lengths, MAC), checked against the nonce this rank sent."""
    status, frames, window, reason_len = decode_state_reply_header(header)
    tail = bytes(tail)
    want = state_reply_tail_len(frames, reason_len)
    if len(tail) != want:
        raise HandshakeError(f"state reply: {len(tail)} bytes after the header, want {want}")
    reason, lengths = tail[:reason_len], tail[reason_len:want - MAC_LEN]
    verify_mac(salt.mac8(bytes(header), reason, lengths, nonce), tail[want - MAC_LEN:], "state reply")
    sizes = tuple(int.from_bytes(lengths[i:i + 4], "little") for i in range(0, len(lengths), 4))
    return StateReply(status, window, frames, reason.decode(errors="replace"), sizes)


__all__ = [
    "MAX_REASON_LEN",
    "NONCE_LEN",
    "STATE_REPLY_HEADER_LEN",
    "STATE_REQUEST_LEN",
    "StateReply",
    "StateRequest",
    "StateStatus",
    "decode_state_reply",
    "decode_state_reply_header",
    "decode_state_request",
    "encode_state_reply",
    "encode_state_request",
    "new_nonce",
    "state_reply_tail_len",
]
