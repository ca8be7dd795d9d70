"""Fault-injection toolkit: whole clusters in one process or many, for tests.

- :func:`open_local_cluster`: controller + one relay per host in one trio nursery.
- :func:`open_process_cluster`: the same, with every rank a real OS process
  you can ``kill``, ``freeze`` (SIGSTOP) and ``thaw`` (SIGCONT).
"""

from .local import LOOPBACK, LocalCluster, open_local_cluster
from .processes import ProcessCluster, RankProcess, open_process_cluster

__all__ = [
    "LOOPBACK",
    "LocalCluster",
    "ProcessCluster",
    "RankProcess",
    "open_local_cluster",
    "open_process_cluster",
]
