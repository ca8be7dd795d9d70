"""The wire layer: flodl's protocol as codecs, with no I/O.

Everything a relay, controller or rank client puts on a socket is encoded and
decoded here, from bytes to values and back; nothing here imports trio.
:mod:`flodl_trio.transport` moves these bytes over streams.
"""

from .bf16 import bf16_to_f32, f32_to_bf16, payload_as_f32, scale_payload
from .constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    DEFAULT_FRAME_CEILING,
    DTYPE_BF16,
    DTYPE_F32,
)
from .control_frame import (
    ControlFrame,
    ControlKind,
    decode_control_frame,
    encode_control_frame,
)
from .fragment import FragmentTag, fragment_of
from .handshake import (
    RankHello,
    decode_control_ack,
    decode_control_handshake,
    decode_data_ack,
    decode_data_handshake,
    encode_control_ack,
    encode_control_handshake,
    encode_data_ack,
    encode_data_handshake,
)
from .mux import (
    DeclareDead,
    Hello,
    HelloAck,
    Lanes,
    MuxKind,
    MuxRecord,
    RankAway,
    RankExit,
    RankFinished,
    RankJoin,
    RelayControlMsg,
    Resume,
    decode_control_msg,
    decode_mux_record,
    encode_control_msg,
    encode_control_record,
    encode_mux_record,
)
from .round_frame import (
    EncodedFrame,
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_payload,
    check_payloads,
    decode_round_frame,
    encode_round_frame,
    encode_round_frame_chunks,
)
from .salt import SessionSalt

__all__ = [
    "FragmentTag",
    "fragment_of",
    "CHANNEL_MAGIC_CONTROL",
    "CHANNEL_MAGIC_DATA",
    "DEFAULT_FRAME_CEILING",
    "DTYPE_BF16",
    "DTYPE_F32",
    "ControlFrame",
    "ControlKind",
    "DeclareDead",
    "EncodedFrame",
    "Hello",
    "HelloAck",
    "MuxKind",
    "MuxRecord",
    "Lanes",
    "RankAway",
    "RankExit",
    "RankHello",
    "RankFinished",
    "RankJoin",
    "RelayControlMsg",
    "Resume",
    "RoundFrame",
    "RoundKind",
    "SessionSalt",
    "TensorPayload",
    "bf16_to_f32",
    "check_payload",
    "check_payloads",
    "decode_control_ack",
    "decode_control_frame",
    "decode_control_handshake",
    "decode_control_msg",
    "decode_data_ack",
    "decode_data_handshake",
    "decode_mux_record",
    "decode_round_frame",
    "encode_control_ack",
    "encode_control_frame",
    "encode_control_handshake",
    "encode_control_msg",
    "encode_control_record",
    "encode_data_ack",
    "encode_data_handshake",
    "encode_mux_record",
    "encode_round_frame",
    "encode_round_frame_chunks",
    "f32_to_bf16",
    "payload_as_f32",
    "scale_payload",
]
