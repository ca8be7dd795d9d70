"""Fault-injection toolkit: whole clusters in one process or many, for tests.

- :func:`open_local_cluster`: controller + one relay per host in one trio nursery.
- :func:`open_process_cluster`: the same, with every rank a real OS process
  you can ``kill``, ``freeze`` (SIGSTOP) and ``thaw`` (SIGCONT); with
  ``daemons=True`` the controller and relays are daemon processes too.
- :class:`FaultProxy`: a TCP proxy that breaks one leg on purpose.
- :class:`MemoryNetwork`: listeners and a connect function in memory, for
  whole clusters in virtual time (``trio.testing.MockClock``).
- :mod:`flodl_trio.testing.matrix`: the fault matrix the project passes.

See docs/fault-injection.md.
"""

from .local import LocalCluster, fetch_status, hold_open, open_local_cluster, wait_until_primed
from .memory import MemoryListener, MemoryNetwork
from .processes import (
    ChildProcess,
    DaemonProcess,
    ProcessCluster,
    RankProcess,
    memory_of,
    open_process_cluster,
)
from .proxy import (
    LOOPBACK,
    BandwidthCap,
    ConnectionRecord,
    CutAt,
    Delay,
    DropRecord,
    DuplicateRecord,
    Fault,
    FaultEvent,
    FaultProxy,
    FlipBit,
    FlowRecord,
    HalfClose,
    Stall,
    open_fault_proxy,
)

__all__ = [
    "LOOPBACK",
    "BandwidthCap",
    "ChildProcess",
    "ConnectionRecord",
    "CutAt",
    "DaemonProcess",
    "Delay",
    "DropRecord",
    "DuplicateRecord",
    "Fault",
    "FaultEvent",
    "FaultProxy",
    "FlipBit",
    "FlowRecord",
    "HalfClose",
    "LocalCluster",
    "MemoryListener",
    "MemoryNetwork",
    "ProcessCluster",
    "RankProcess",
    "Stall",
    "fetch_status",
    "hold_open",
    "memory_of",
    "open_fault_proxy",
    "open_local_cluster",
    "open_process_cluster",
    "wait_until_primed",
]
