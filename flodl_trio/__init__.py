"""flodl_trio: fault-tolerant parameter averaging for Local SGD / DiLoCo on trio.

It speaks the wire protocol of the Rust framework flodl: rank clients talk to
their host's relay over loopback, relays fold their ranks' frames into one
per host, and the controller divides once by the realized-work mass.

The package's folders are its layers (docs/architecture.md): ``wire`` ->
``transport`` -> ``fold`` -> the roles (``client``, ``relay``, ``controller``)
-> ``train`` -> ``daemon`` / ``demo`` / ``testing``. The names a user needs
are exported here; those from the upper layers (the trainer, checkpoints, the
tensor bridge) are imported on first use, so ``import flodl_trio`` - and a
daemon's start - never imports torch.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__ as __version__
from .client import ReduceClient, connect_reduce_client
from .client.reduce import DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS
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
from .relay import ChannelKind, RelayHandle, open_relay
from .train.realized_work import (
    WindowResult,
    average_window,
    gamma_mass,
    mover_mass,
    sumcount_reduce,
)
from .wire import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
)

# The rest of the user API, imported on first use: the tensor bridge and the
# trainer import torch, and importing flodl_trio must not (the daemons run
# without it); the others keep a daemon's start light.
_LAZY = {
    "tensors_to_round_frame": "client.tensors",
    "round_frame_to_tensors": "client.tensors",
    "pinned_decode_affordable": "client.tensors",
    "model_signature": "client.tensors",
    "connect_control_client": "client.control",
    "CoordinatorLost": "client.control",
    "NetBounds": "transport.settings",
    "load_salt": "transport.settings",
    "DiLoCoNesterov": "fold.outer",
    "SlowMo": "fold.outer",
    "PlainAverage": "fold.outer",
    "ConsensusCheckpointer": "controller.checkpointer",
    "load_checkpoint": "wire.checkpoint",
    "latest_checkpoint": "wire.checkpoint",
    "Checkpoint": "wire.checkpoint",
    "CheckpointError": "wire.checkpoint",
    "restore_module": "train.checkpoint",
    "open_window_trainer": "train.trainer",
    "WindowTrainer": "train.trainer",
    "BlockingReduceClient": "train.blocking",
    "BlockingWindowTrainer": "train.blocking",
    "rank_from_env": "daemon.launch",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl_trio' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "BlockingReduceClient",
    "BlockingWindowTrainer",
    "ChannelKind",
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ConnectFailed",
    "ConsensusCheckpointer",
    "ControllerHandle",
    "CoordinatorLost",
    "DECODE_SLOT_BUFFERS",
    "DECODE_SLOT_PARAMS",
    "DTYPE_BF16",
    "DTYPE_F32",
    "DeadRanks",
    "DesyncError",
    "DiLoCoNesterov",
    "FlodlError",
    "FramingError",
    "HandshakeError",
    "JoinRefused",
    "MacError",
    "NetBounds",
    "PeerClosedMidFrame",
    "PeerTimeout",
    "PlainAverage",
    "ProtocolError",
    "RankDeadError",
    "ReduceClient",
    "RelayHandle",
    "RoundFrame",
    "RoundKind",
    "SchemaError",
    "SessionSalt",
    "SlowMo",
    "TensorPayload",
    "WindowResult",
    "WindowTrainer",
    "average_window",
    "connect_control_client",
    "connect_reduce_client",
    "gamma_mass",
    "latest_checkpoint",
    "load_checkpoint",
    "load_salt",
    "model_signature",
    "mover_mass",
    "open_controller",
    "open_relay",
    "open_window_trainer",
    "pinned_decode_affordable",
    "rank_from_env",
    "restore_module",
    "round_frame_to_tensors",
    "sumcount_reduce",
    "tensors_to_round_frame",
]
