"""Magic numbers, versions and limits of flodl's wire protocol (PROTOCOL.md)."""

from __future__ import annotations

from typing import Final

# Rank <-> relay handshakes (section 2).
DATA_HANDSHAKE_MAGIC: Final = 0xF10D17C0
DATA_ACK_MAGIC: Final = 0xF10D17C1
DATA_PROTOCOL_VERSION: Final = 3
CONTROL_HANDSHAKE_MAGIC: Final = 0xF10D17C2
CONTROL_ACK_MAGIC: Final = 0xF10D17C3
CONTROL_PROTOCOL_VERSION: Final = 4

# Relay -> controller channel-select magic (section 3.1).
CHANNEL_MAGIC_RENDEZVOUS: Final = 0xF10D17E0
CHANNEL_MAGIC_DATA: Final = 0xF10D17E1
CHANNEL_MAGIC_CONTROL: Final = 0xF10D17E2
CHANNEL_MAGIC_JOIN: Final = 0xF10D17E3
# flodl_trio extension (docs/wire.md): a joiner asks for the last window's consensus.
# The rank sends it to its relay, which pipes the connection to the controller as is.
CHANNEL_MAGIC_STATE: Final = 0xF10D17E8
STATE_REPLY_MAGIC: Final = 0xF10D17E9
STATE_CHALLENGE_MAGIC: Final = 0xF10D17EA
# flodl_trio extension (docs/wire.md, "Shards"): the controller's connection to a reduction shard.
CHANNEL_MAGIC_SHARD: Final = 0xF10D17EE
# ... and a shard's connection to its backup, the next live shard ("The outer state through a lost shard").
CHANNEL_MAGIC_MIRROR: Final = 0xF10D17EF
STATE_ANSWER_MAGIC: Final = 0xF10D17EB
STATE_RECEIPT_MAGIC: Final = 0xF10D17EC
STATE_ENTRY_MAGIC: Final = 0xF10D17ED
STATE_VERSION: Final = 2
# flodl_trio extension: a rank that called join() ends with a length prefix of 0
# on its data connection to say it finished (no RoundFrame is 0 bytes long).
FINISHED_LENGTH: Final = 0

# MuxRecord (section 3.2).
MUX_MAGIC: Final = 0xF10D17D0
MUX_VERSION: Final = 1
MUX_HEADER_LEN: Final = 25

# RoundFrame (section 4).
ROUND_FRAME_MAGIC: Final = 0xF10D17F1
MAX_TENSORS: Final = 65_536
DTYPE_F32: Final = 0
DTYPE_BF16: Final = 1

# ControlFrame (section 5).
CONTROL_FRAME_MAGIC: Final = 0xF10D17C4
CONTROL_FRAME_VERSION: Final = 4
CONTROL_FRAME_HEADER_LEN: Final = 24
CONTROL_FRAME_MAX_PAYLOAD: Final = 16 << 20

MAC_LEN: Final = 8
# What stands in a frame's own MAC field where nobody checks it: on the local leg,
# and in a lane frame, whose record's MAC covers every byte (docs/wire.md, "One MAC a lane").
UNSIGNED_TAG: Final = bytes(MAC_LEN)
SALT_LEN: Final = 16
MODEL_SIGNATURE_LEN: Final = 32

# Default ceiling for one length-framed message or MuxRecord payload.
DEFAULT_FRAME_CEILING: Final = 1 << 30
