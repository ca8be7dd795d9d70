"""Where things sit on the wire, derived from the wire package itself.

A fault aimed at a byte offset is only as right as its offset. Every number
here comes from the wire's constants, struct sizes and encoders - a Hello
record's length by encoding one, the weight's lowest byte by encoding two
frames whose weights differ in their last bit - never from counting bytes by
hand, so a change to a header moves every fault with it instead of silently
flipping some other byte.

The legs (PROTOCOL.md):

- rank <-> relay, TCP: the data handshake (ack going down), then each RoundFrame
  behind a u32 length prefix;
- relay -> controller: the u32 channel magic, the relay's Hello record, then
  MuxRecords (25-byte header, then a RoundFrame for a HostFrame). A data relay
  that serves a reduction shard - every relay daemon, whose ``--shard`` is
  ``auto`` by default, and ``open_local_cluster(shards="auto")``'s relays -
  sends a ``ShardOffer`` record right after its Hello, before its first
  HostFrame; the relays of ``open_local_cluster`` (by default) and of
  ``open_process_cluster`` without daemons offer none. Pass ``offers_shard=True``
  to the uplink helpers below for the former.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Final, Literal

import numpy as np

from ...wire.constants import DTYPE_F32, MUX_HEADER_LEN, SALT_LEN
from ...wire.handshake import DATA_ACK_LEN, DATA_HANDSHAKE_LEN
from ...wire.mux import (
    EXTENSIONS_MARK,
    MUX_SIGNED_HEADER_LEN,
    Hello,
    HelloAck,
    MuxKind,
    RelayControlMsg,
    ShardOffer,
    encode_control_record,
    mux_signed_header,
)
from ...wire.round_frame import RoundFrame, TensorPayload, frame_body_chunks, schema_frame_len
from ...wire.salt import SessionSalt

Direction = Literal["up", "down"]

# The u32 that stands before every message on a rank leg, and the channel magic.
U32: Final = struct.Struct("<I")
LENGTH_PREFIX: Final = U32.size
CHANNEL_MAGIC_LEN: Final = U32.size

# Lengths do not depend on the salt; this one only lets the encoders run.
_ANY_SALT: Final = SessionSalt(bytes(SALT_LEN))


def _first_difference(a: bytes, b: bytes) -> int:
    """The first offset at which two encodings differ (they must differ)."""
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def _f32_frame_body(numel: int, weight: float = 1.0) -> bytes:
    """A RoundFrame of one 1-d f32 tensor, as encoded, without its MAC."""
    frame = RoundFrame([TensorPayload(DTYPE_F32, (numel,), np.zeros(numel, dtype="<f4"))], weight=weight)
    return frame_body_chunks(frame).tobytes()


# Inside a RoundFrame of one 1-d f32 tensor: the f64 weight's lowest (mantissa)
# byte, and where the tensor's payload starts.
FRAME_WEIGHT_LOW_BYTE: Final = _first_difference(_f32_frame_body(1, 1.0), _f32_frame_body(1, math.nextafter(1.0, 2.0)))
FRAME_PAYLOAD: Final = len(_f32_frame_body(0))

# Inside a MuxRecord header: its u32 payload length, its MAC (after the signed part),
# and the whole header.
MUX_LENGTH_FIELD: Final = _first_difference(mux_signed_header(MuxKind.DATA, 0), mux_signed_header(MuxKind.DATA, 1))
MUX_MAC: Final = MUX_SIGNED_HEADER_LEN
MUX_HEADER: Final = MUX_HEADER_LEN


def frame_len(numel: int) -> int:
    """A rank's RoundFrame of one 1-d f32 tensor of ``numel`` elements, MAC included."""
    return schema_frame_len([(DTYPE_F32, (numel,))])


# ---------------------------------------------------------------------------
# Rank <-> relay (TCP data leg)
# ---------------------------------------------------------------------------


def rank_leg_bytes(rounds: int, numel: int = 4, *, direction: Direction = "up") -> int:
    """Bytes on a rank's data connection after ``rounds`` whole rounds: the handshake
    (``up``) or its ack (``down``), then one length-prefixed frame per round."""
    opening = DATA_HANDSHAKE_LEN if direction == "up" else DATA_ACK_LEN
    return opening + rounds * (LENGTH_PREFIX + frame_len(numel))


def rank_frame_start(round_index: int, numel: int = 4, *, direction: Direction = "up") -> int:
    """Offset of round ``round_index``'s RoundFrame on a rank's data connection (after its
    length prefix): the rank's frame going ``up``, the consensus coming ``down``."""
    return rank_leg_bytes(round_index, numel, direction=direction) + LENGTH_PREFIX


def consensus_frame_start(round_index: int, numel: int = 4) -> int:
    """Offset of round ``round_index``'s consensus on a rank's data connection (relay -> rank)."""
    return rank_frame_start(round_index, numel, direction="down")


# ---------------------------------------------------------------------------
# Relay <-> controller
# ---------------------------------------------------------------------------


def control_record_len(msg: RelayControlMsg) -> int:
    """A relay control message as a MuxRecord, measured by encoding it."""
    return len(encode_control_record(msg, _ANY_SALT))


def hello_record_len(host: str, ranks: Sequence[int], model_sigs: Sequence[bytes] = ()) -> int:
    """A relay's Hello record (header, bincode body), measured by encoding one."""
    return control_record_len(Hello(host, tuple(ranks), tuple(model_sigs)))


HELLO_ACK_RECORD_LEN: Final = control_record_len(HelloAck())


# A relay daemon serving its shard (the default) offers it right after HelloAck, at the
# address it reaches the controller from: on loopback, "127.0.0.1" and a port above 250.
SHARD_OFFER_RECORD_LEN: Final = len(encode_control_record(ShardOffer("127.0.0.1", 40_000), _ANY_SALT))


def uplink_first_record(host: str, ranks: Sequence[int], *, offers_shard: bool = False) -> int:
    """Offset of the first record after the Hello on a data relay's uplink (a flodl_trio
    relay's Hello carries the extensions mark), or - ``offers_shard``: a relay daemon
    with its default ``--shard auto``, on loopback - after its ``ShardOffer``."""
    offer = SHARD_OFFER_RECORD_LEN if offers_shard else 0
    return CHANNEL_MAGIC_LEN + hello_record_len(host, ranks, (EXTENSIONS_MARK,)) + offer


def host_frame_record_len(numel: int) -> int:
    """A HostFrame record carrying a RoundFrame of one 1-d f32 tensor."""
    return MUX_HEADER_LEN + frame_len(numel)


def uplink_host_frame_start(
    host: str, ranks: Sequence[int], round_index: int, numel: int = 4, *, offers_shard: bool = False
) -> int:
    """Offset of round ``round_index``'s HostFrame record (its header) on a data relay's
    uplink, when nothing but HostFrames follows the Hello - or, ``offers_shard`` (a relay
    daemon with its default ``--shard auto``, on loopback), the Hello and its ShardOffer."""
    return uplink_first_record(host, ranks, offers_shard=offers_shard) + round_index * host_frame_record_len(numel)


def uplink_host_frame_record(round_index: int = 0, *, offers_shard: bool = False) -> int:
    """The index of round ``round_index``'s HostFrame among the records of a data relay's
    uplink (what ``DropRecord``/``DuplicateRecord(framing="mux")`` count, from 0): after
    the Hello (record 0) and - ``offers_shard`` - the ShardOffer (record 1)."""
    return 1 + int(offers_shard) + round_index


__all__ = [
    "CHANNEL_MAGIC_LEN",
    "FRAME_PAYLOAD",
    "FRAME_WEIGHT_LOW_BYTE",
    "HELLO_ACK_RECORD_LEN",
    "LENGTH_PREFIX",
    "MUX_HEADER",
    "MUX_LENGTH_FIELD",
    "MUX_MAC",
    "SHARD_OFFER_RECORD_LEN",
    "U32",
    "consensus_frame_start",
    "control_record_len",
    "frame_len",
    "hello_record_len",
    "host_frame_record_len",
    "rank_frame_start",
    "rank_leg_bytes",
    "uplink_first_record",
    "uplink_host_frame_record",
    "uplink_host_frame_start",
]
