"""The per-host relay: K local ranks in, one upstream connection out, per channel.

- :mod:`.core`: :func:`open_relay`, formation (accepting the host's ranks,
  dialing the controller) and the handle;
- :mod:`.channels`: the channel's tasks (rank readers, the outbound writer,
  the upstream reader);
- :mod:`.host_fold`: :class:`HostFold`, the host's round state, with no I/O;
- :mod:`.host_ranks`: :class:`HostRanks`, what a host's two channels share about its ranks;
- :mod:`.cli`: the daemon (``python -m flodl_trio.relay``).
"""

from .channels import ControlChannel, DataChannel
from .config import ChannelKind, RelayStats
from .core import RelayHandle, open_relay
from .host_fold import HostFold
from .host_ranks import HostRanks

__all__ = [
    "ChannelKind",
    "ControlChannel",
    "DataChannel",
    "HostFold",
    "HostRanks",
    "RelayHandle",
    "RelayStats",
    "open_relay",
]
