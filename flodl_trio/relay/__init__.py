"""The per-host relay: K local ranks in, one upstream connection out, per channel.

- :mod:`.core`: :func:`open_relay`, formation (accepting the host's ranks,
  dialing the controller) and the handle;
- :mod:`.channels`: :class:`Channel`, a channel's tasks (rank readers, the
  outbound writer, the upstream reader), its ranks joining and leaving, and
  how it ends; what its bytes mean is its role's:
- :mod:`.data_plane`: :class:`DataPlane`, the data channel's role (fold, send, fan out);
- :mod:`.router`: :class:`ControlRouter`, the control channel's role (route blobs);
- :mod:`.lanes`: whole records each way, or the lanes extension;
  :mod:`.cut_through`: a large consensus fanned out while it arrives;
- :mod:`.outbound`: what the tasks queue for the sole upstream writer;
- :mod:`.host_fold`: :class:`HostFold`, the host's round state, with no I/O;
- :mod:`.host_ranks`: :class:`HostRanks`, what a host's two channels share about its ranks;
- :mod:`.cli`: the daemon (``python -m flodl_trio.relay``).
"""

from .channels import Channel, ChannelRole
from .config import ChannelKind, RelayStats
from .core import RelayHandle, open_relay
from .data_plane import DataPlane
from .host_fold import HostFold
from .host_ranks import HostRanks
from .router import ControlRouter

__all__ = [
    "Channel",
    "ChannelKind",
    "ChannelRole",
    "ControlRouter",
    "DataPlane",
    "HostFold",
    "HostRanks",
    "RelayHandle",
    "RelayStats",
    "open_relay",
]
