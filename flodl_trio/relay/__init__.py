"""The per-host relay: K local ranks in, one upstream connection out, per channel.

See :mod:`flodl_trio.relay.core` for the task structure and
:mod:`flodl_trio.relay.cli` for the daemon (``python -m flodl_trio.relay``).
"""

from .core import (
    ChannelKind,
    ControlChannel,
    DataChannel,
    HostFold,
    RelayHandle,
    RelayStats,
    open_relay,
)

__all__ = ["ChannelKind", "ControlChannel", "DataChannel", "HostFold", "RelayHandle", "RelayStats", "open_relay"]
