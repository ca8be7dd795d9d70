"""The rank side: what a trainer awaits to average with the cluster.

- :mod:`.reduce`: :func:`connect_reduce_client` and :class:`ReduceClient`, one
  round per call over the rank's loopback connection to its host's relay;
- :mod:`.control`: :func:`connect_control_client`, heartbeats and beacons
  beside the trainer, so a lost cluster or a death ends a waiting round.

The blocking facade for non-trio trainers is :mod:`flodl_trio.train.blocking`.
"""

from .control import ControlClient, CoordinatorLost, connect_control_client
from .reduce import (
    Address,
    ClientBusy,
    ReduceClient,
    connect_reduce_client,
    max_reply_len,
    parse_address,
)
from .state import ClusterState, fetch_cluster_state

__all__ = [
    "Address",
    "ClientBusy",
    "ClusterState",
    "ControlClient",
    "CoordinatorLost",
    "ReduceClient",
    "connect_control_client",
    "connect_reduce_client",
    "fetch_cluster_state",
    "max_reply_len",
    "parse_address",
]
