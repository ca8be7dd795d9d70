"""trio I/O shared by every role: streams with the protocol's framing and bounds,
growable receive buffers, HMACs computed while bytes move, following a
message while it arrives, dialing peers, and the nursery helpers.

The codecs themselves are in :mod:`flodl_trio.wire` (no I/O); this package
moves their bytes. It knows no role.
"""

from .arrival import ArrivalWatch, receive_with_followers
from .buffers import BufferPool, ReceiveBuffer
from .connect import connect_with_retry, peer_host, tune_socket, warn_if_public_peer
from .hashing import RunningMac, encode_enveloped_frame, hash_as_it_lands
from .stream import MessageStream
from .tasks import ChangeSignal, service_nursery, unwrap_group

__all__ = [
    "ArrivalWatch",
    "BufferPool",
    "ChangeSignal",
    "MessageStream",
    "ReceiveBuffer",
    "RunningMac",
    "connect_with_retry",
    "encode_enveloped_frame",
    "hash_as_it_lands",
    "peer_host",
    "receive_with_followers",
    "service_nursery",
    "unwrap_group",
    "tune_socket",
    "warn_if_public_peer",
]
