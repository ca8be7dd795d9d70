"""flodl_trio extension: how a joining rank gets the state to start from.

A rank that (re)joins starts from the consensus the cluster finished last,
which the controller keeps. The rank opens a connection to its relay's data
port and sends a request; the relay pipes that connection to the controller's
port as is. Every message is authenticated with the session salt and bound to
two fresh nonces, the rank's (in its request) and the controller's (in its
challenge), so bytes recorded from an earlier join and replayed - by a peer
that does not know the salt - verify at no step::

    rank:       request (40)   u32 magic 0xF10D17E8 | u32 version 2 | u32 rank | u32 world_size
                               | 16-byte rank nonce | MAC8(the 32 bytes before)
    controller: challenge (32) u32 magic 0xF10D17EA | u32 version 2 | 16-byte controller nonce
                               | MAC8(the 24 bytes before || rank nonce)
    rank:       answer (16)    u32 magic 0xF10D17EB | u32 version 2
                               | MAC8(the 8 bytes before || controller nonce || rank nonce || u32 rank)
    controller: reply header (28) u32 magic 0xF10D17E9 | u32 version 2 | u32 status (0 ok, 1 refused)
                               | u32 frame count n | i64 window (-1: none completed) | u32 reason length
                then           reason (UTF-8, <= 1024 bytes) | n x u32 frame length
                               | MAC8(header || reason || lengths || rank nonce || controller nonce)
                then per frame u32 length | a RoundFrame, its own MAC8 last (params first, then buffers)
    rank:       receipt (16)   u32 magic 0xF10D17EC | u32 version 2
                               | MAC8(the 8 bytes before || rank nonce || controller nonce)
    controller: entry (28)     u32 magic 0xF10D17ED | u32 version 2 | u32 status (0 entered, 1 called off,
                               2 entered, catch-up frames follow) | i64 window
                               | MAC8(the 20 bytes before || rank nonce || controller nonce)
                then (status 2) per window from the state's + 1 to the entry's - 1:
                               u32 length | that window's params consensus RoundFrame, its own MAC8 last

The receipt and the entry only follow a reply that carried frames: the
controller lets a rank into its host's barrier only after the rank said it
has its state, so a joiner that stalls on its state costs nobody else.

With fragments (docs/wire.md, "Fragment tag") the params are one frame per
fragment, in fragment order, so a reply carries up to MAX_FRAGMENTS + 1
frames; the joiner splits them by its own model's tensor counts.

The frame lengths sit under the reply's MAC, so a joiner can take each frame
into memory of the right size at once (it still checks every frame's MAC).

See docs/wire.md ("The join exchange").
"""

from __future__ import annotations

import enum
import secrets
import struct

import attrs

from ..errors import HandshakeError
from .constants import (
    CHANNEL_MAGIC_STATE,
    MAC_LEN,
    STATE_ANSWER_MAGIC,
    STATE_CHALLENGE_MAGIC,
    STATE_ENTRY_MAGIC,
    STATE_RECEIPT_MAGIC,
    STATE_REPLY_MAGIC,
    STATE_VERSION,
)
from .fragment import MAX_FRAGMENTS
from .handshake import check_magic_version, check_world, exact_bytes
from .salt import Buffer, SessionSalt, verify_mac

_REQUEST = struct.Struct("<IIII16s")
_CHALLENGE = struct.Struct("<II16s")
_TAG_ONLY = struct.Struct("<II")  # the answer and the receipt: magic, version, then the MAC
_REPLY = struct.Struct("<IIIIqI")
_ENTRY = struct.Struct("<IIIq")
NONCE_LEN = 16
STATE_REQUEST_LEN = _REQUEST.size + MAC_LEN  # 40
STATE_CHALLENGE_LEN = _CHALLENGE.size + MAC_LEN  # 32
STATE_ANSWER_LEN = _TAG_ONLY.size + MAC_LEN  # 16
STATE_REPLY_HEADER_LEN = _REPLY.size  # 28
STATE_RECEIPT_LEN = _TAG_ONLY.size + MAC_LEN  # 16
STATE_ENTRY_LEN = _ENTRY.size + MAC_LEN  # 28
MAX_REASON_LEN = 1024
MAX_STATE_FRAMES = MAX_FRAGMENTS + 1  # each fragment's params, then the buffers


class StateStatus(enum.IntEnum):
    OK = 0
    REFUSED = 1


class EntryStatus(enum.IntEnum):
    ENTERED = 0
    CALLED_OFF = 1
    # Entered, and the windows finished since the state's follow as the delta round
    # consensus frames the ranks were sent (docs/wire.md, "Delta rounds").
    CATCH_UP = 2


@attrs.frozen
class JoinNonces:
    """The two fresh nonces one join is bound to: the rank's, from its request,
    and the controller's, from its challenge."""

    rank: bytes
    controller: bytes


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


def encode_state_challenge(nonces: JoinNonces, salt: SessionSalt) -> bytes:
    """The controller's answer to a verified request: its own nonce, bound to the rank's."""
    body = _CHALLENGE.pack(STATE_CHALLENGE_MAGIC, STATE_VERSION, nonces.controller)
    return body + salt.mac8(body, nonces.rank)


def decode_state_challenge(data: Buffer, rank_nonce: bytes, salt: SessionSalt) -> JoinNonces:
    """Check the controller's challenge against the nonce this rank sent; both nonces."""
    raw = exact_bytes(data, STATE_CHALLENGE_LEN, "state challenge")
    magic, version, controller_nonce = _CHALLENGE.unpack_from(raw)
    check_magic_version(magic, version, STATE_CHALLENGE_MAGIC, STATE_VERSION, "state challenge")
    verify_mac(salt.mac8(raw[:_CHALLENGE.size], rank_nonce), raw[_CHALLENGE.size:], "state challenge")
    return JoinNonces(rank_nonce, controller_nonce)


def encode_state_answer(rank: int, nonces: JoinNonces, salt: SessionSalt) -> bytes:
    """The rank's proof that it holds the salt now: a MAC over the controller's fresh nonce."""
    body = _TAG_ONLY.pack(STATE_ANSWER_MAGIC, STATE_VERSION)
    return body + salt.mac8(body, nonces.controller, nonces.rank, rank.to_bytes(4, "little"))


def check_state_answer(data: Buffer, rank: int, nonces: JoinNonces, salt: SessionSalt) -> None:
    raw = exact_bytes(data, STATE_ANSWER_LEN, f"state answer from rank {rank}")
    magic, version = _TAG_ONLY.unpack_from(raw)
    check_magic_version(magic, version, STATE_ANSWER_MAGIC, STATE_VERSION, f"state answer from rank {rank}")
    expected = salt.mac8(raw[:_TAG_ONLY.size], nonces.controller, nonces.rank, rank.to_bytes(4, "little"))
    verify_mac(expected, raw[_TAG_ONLY.size:], f"state answer from rank {rank} (a replayed join?)")


def encode_state_receipt(nonces: JoinNonces, salt: SessionSalt) -> bytes:
    """The rank has every frame of its state (sent after the last one)."""
    body = _TAG_ONLY.pack(STATE_RECEIPT_MAGIC, STATE_VERSION)
    return body + salt.mac8(body, nonces.rank, nonces.controller)


def check_state_receipt(data: Buffer, rank: int, nonces: JoinNonces, salt: SessionSalt) -> None:
    raw = exact_bytes(data, STATE_RECEIPT_LEN, f"state receipt from rank {rank}")
    magic, version = _TAG_ONLY.unpack_from(raw)
    check_magic_version(magic, version, STATE_RECEIPT_MAGIC, STATE_VERSION, f"state receipt from rank {rank}")
    verify_mac(salt.mac8(raw[:_TAG_ONLY.size], nonces.rank, nonces.controller), raw[_TAG_ONLY.size:],
               f"state receipt from rank {rank}")


@attrs.frozen
class StateEntry:
    """Where a rank that has its state enters: ``window`` is the first window it runs
    in its host's barrier (ENTERED; CATCH_UP when the params frames of the windows
    between follow), or the join was called off (CALLED_OFF, window -1)."""

    status: EntryStatus
    window: int = -1

    @classmethod
    def called_off(cls) -> StateEntry:
        return cls(EntryStatus.CALLED_OFF)


def encode_state_entry(entry: StateEntry, nonces: JoinNonces, salt: SessionSalt) -> bytes:
    body = _ENTRY.pack(STATE_ENTRY_MAGIC, STATE_VERSION, entry.status, entry.window)
    return body + salt.mac8(body, nonces.rank, nonces.controller)


def decode_state_entry(data: Buffer, nonces: JoinNonces, salt: SessionSalt) -> StateEntry:
    raw = exact_bytes(data, STATE_ENTRY_LEN, "state entry")
    magic, version, status, window = _ENTRY.unpack_from(raw)
    check_magic_version(magic, version, STATE_ENTRY_MAGIC, STATE_VERSION, "state entry")
    verify_mac(salt.mac8(raw[:_ENTRY.size], nonces.rank, nonces.controller), raw[_ENTRY.size:], "state entry")
    if status not in EntryStatus.__members__.values():
        raise HandshakeError(f"state entry: unknown status {status}")
    if (status != EntryStatus.CALLED_OFF) != (window >= 0):
        raise HandshakeError(f"state entry: status {EntryStatus(status).name} with window {window}")
    return StateEntry(EntryStatus(status), window)


def encode_state_reply(reply: StateReply, nonces: JoinNonces, salt: SessionSalt) -> bytes:
    """The reply's header, reason, frame lengths and MAC (the frames follow, each signed on its own)."""
    if len(reply.lengths) != reply.frames:
        raise ValueError(f"state reply announces {reply.frames} frames with {len(reply.lengths)} lengths")
    reason = reply.reason.encode()[:MAX_REASON_LEN]
    header = _REPLY.pack(STATE_REPLY_MAGIC, STATE_VERSION, reply.status, reply.frames, reply.window, len(reason))
    lengths = b"".join(n.to_bytes(4, "little") for n in reply.lengths)
    return header + reason + lengths + salt.mac8(header, reason, lengths, nonces.rank, nonces.controller)


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


def decode_state_reply(header: Buffer, tail: Buffer, nonces: JoinNonces, salt: SessionSalt) -> StateReply:
    """The whole reply (``tail``: reason, lengths, MAC), checked against this join's nonces."""
    status, frames, window, reason_len = decode_state_reply_header(header)
    tail = bytes(tail)
    want = state_reply_tail_len(frames, reason_len)
    if len(tail) != want:
        raise HandshakeError(f"state reply: {len(tail)} bytes after the header, want {want}")
    reason, lengths = tail[:reason_len], tail[reason_len:want - MAC_LEN]
    verify_mac(salt.mac8(bytes(header), reason, lengths, nonces.rank, nonces.controller), tail[want - MAC_LEN:],
               "state reply")
    sizes = tuple(int.from_bytes(lengths[i:i + 4], "little") for i in range(0, len(lengths), 4))
    return StateReply(status, window, frames, reason.decode(errors="replace"), sizes)


__all__ = [
    "MAX_REASON_LEN",
    "NONCE_LEN",
    "STATE_ANSWER_LEN",
    "STATE_CHALLENGE_LEN",
    "STATE_ENTRY_LEN",
    "STATE_RECEIPT_LEN",
    "STATE_REPLY_HEADER_LEN",
    "STATE_REQUEST_LEN",
    "EntryStatus",
    "JoinNonces",
    "StateEntry",
    "StateReply",
    "StateRequest",
    "StateStatus",
    "check_state_answer",
    "check_state_receipt",
    "decode_state_challenge",
    "decode_state_entry",
    "decode_state_reply",
    "decode_state_reply_header",
    "decode_state_request",
    "encode_state_answer",
    "encode_state_challenge",
    "encode_state_entry",
    "encode_state_receipt",
    "encode_state_reply",
    "encode_state_request",
    "new_nonce",
    "state_reply_tail_len",
]
