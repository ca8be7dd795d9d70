"""flodl_trio: fault-tolerant parameter averaging for Local SGD / DiLoCo on trio.

It speaks the wire protocol of the Rust framework flodl: rank clients talk to
their host's relay over loopback, relays fold their ranks' frames into one
per host, and the controller divides once by the realized-work mass.

The tensor helpers (``tensors_to_round_frame``, ``round_frame_to_tensors``)
import torch on first use, so the daemons start without it.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__ as __version__
from .client import ReduceClient, connect_reduce_client
from .controller import ControllerHandle, open_controller
from .controller.dead_ranks import DeadRanks
from .errors import (
    ConfigError,
    ConnectFailed,
    DesyncError,
    FlodlError,
    FramingError,
    HandshakeError,
    JoinRefused,
    MacError,
    PeerClosedMidFrame,
    PeerTimeout,
    ProtocolError,
    RankDeadError,
    SchemaError,
)
from .realized_work import (
    DECODE_SLOT_BUFFERS,
    DECODE_SLOT_PARAMS,
    WindowResult,
    average_window,
    gamma_mass,
    mover_mass,
    sumcount_reduce,
)
from .relay import ChannelKind, RelayHandle, open_relay
from .wire import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
)

_TENSOR_API = {"tensors_to_round_frame", "round_frame_to_tensors", "pinned_decode_affordable"}


def __getattr__(name: str) -> Any:
    # Lazy: importing flodl_trio must not import torch (the daemons run without it).
    if name in _TENSOR_API:
        from . import tensors

        return getattr(tensors, name)
    raise AttributeError(f"module 'flodl_trio' has no attribute {name!r}")


__all__ = [
    "DECODE_SLOT_BUFFERS",
    "DECODE_SLOT_PARAMS",
    "DTYPE_BF16",
    "DTYPE_F32",
    "ChannelKind",
    "ConfigError",
    "ConnectFailed",
    "ControllerHandle",
    "DeadRanks",
    "DesyncError",
    "FlodlError",
    "FramingError",
    "HandshakeError",
    "JoinRefused",
    "MacError",
    "PeerClosedMidFrame",
    "PeerTimeout",
    "ProtocolError",
    "RankDeadError",
    "ReduceClient",
    "RelayHandle",
    "RoundFrame",
    "RoundKind",
    "SchemaError",
    "SessionSalt",
    "TensorPayload",
    "WindowResult",
    "average_window",
    "connect_reduce_client",
    "gamma_mass",
    "mover_mass",
    "open_controller",
    "open_relay",
    "pinned_decode_affordable",
    "round_frame_to_tensors",
    "sumcount_reduce",
    "tensors_to_round_frame",
]
