"""The controller: one port, one connection per host relay, one consensus per round.

See :mod:`flodl_trio.controller.core` for the task structure and
:mod:`flodl_trio.controller.cli` for the daemon (``python -m flodl_trio.controller``).
"""

from .core import (
    CheckpointSink,
    ControllerHandle,
    ControllerStats,
    LatencyHistogram,
    OuterOptimizer,
    open_controller,
)

__all__ = [
    "CheckpointSink",
    "ControllerHandle",
    "ControllerStats",
    "LatencyHistogram",
    "OuterOptimizer",
    "open_controller",
]
