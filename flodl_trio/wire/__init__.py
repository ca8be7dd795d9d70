"""The wire layer: flodl's protocol as codecs (sans-IO) plus trio stream helpers.

Everything a relay, controller or rank client puts on a socket is defined
here; the roles share this package and nothing else.
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
from .fold import (
    FoldAccumulator,
    ImageCache,
    check_payload,
    finish_consensus,
    shares_sums,
    sum_frames,
)
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
    MuxKind,
    MuxRecord,
    RankExit,
    RelayControlMsg,
    decode_control_msg,
    decode_mux_record,
    encode_control_msg,
    encode_control_record,
    encode_mux_record,
)
from .netenv import timeout_scale, warn_if_public_peer
from .round_frame import (
    EncodedFrame,
    RoundFrame,
    RoundKind,
    TensorPayload,
    decode_round_frame,
    encode_round_frame,
    encode_round_frame_chunks,
)
from .salt import SessionSalt

__all__ = [
    "CHANNEL_MAGIC_CONTROL",
    "CHANNEL_MAGIC_DATA",
    "DEFAULT_FRAME_CEILING",
    "DTYPE_BF16",
    "DTYPE_F32",
    "ControlFrame",
    "ControlKind",
    "DeclareDead",
    "EncodedFrame",
    "FoldAccumulator",
    "Hello",
    "HelloAck",
    "ImageCache",
    "MuxKind",
    "MuxRecord",
    "RankExit",
    "RankHello",
    "RelayControlMsg",
    "RoundFrame",
    "RoundKind",
    "SessionSalt",
    "TensorPayload",
    "bf16_to_f32",
    "check_payload",
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
    "finish_consensus",
    "payload_as_f32",
    "scale_payload",
    "shares_sums",
    "sum_frames",
    "timeout_scale",
    "warn_if_public_peer",
]
