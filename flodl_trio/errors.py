"""The exception family every flodl_trio component raises.

One root (:class:`FlodlError`) so a trainer can catch everything the library
raises, and one branch (:class:`ProtocolError`) for bytes that break the wire
contract, so a caller can tell "the peer sent garbage" from "the cluster lost
a rank". Messages always say what was wrong and where (rank, host, tensor
index, byte counts): they are read by someone debugging a 3 a.m. job.
"""

from __future__ import annotations


class FlodlError(Exception):
    """Root of every error flodl_trio raises on purpose."""


class ConfigError(FlodlError, ValueError):
    """A setting or argument is invalid (bad salt hex, world size 0, ...)."""


class ProtocolError(FlodlError):
    """Bytes from a peer violate the wire protocol."""


class HandshakeError(ProtocolError):
    """A rank <-> relay handshake failed (magic, version, world size, rank set)."""


class FramingError(ProtocolError):
    """A length prefix or frame boundary is wrong: oversize, truncated, drifted."""


class PeerClosedMidFrame(FramingError):
    """The peer closed the connection after the first byte of a message."""


class DesyncError(ProtocolError):
    """A peer broke the strict ping-pong (e.g. two frames in one round)."""


class MacError(ProtocolError):
    """An HMAC tag did not verify: wrong session salt, or corrupted bytes."""


class SchemaError(ProtocolError):
    """Frames of one round disagree (kind, tensor count, dtype, shape, bytes),
    or a payload does not match its declared shape."""


class PeerTimeout(FlodlError):
    """A bounded wait on a peer ran out (handshake, write stall, starvation)."""


class ConnectFailed(FlodlError, ConnectionError):
    """Could not reach a peer within the connect retry budget."""


class RankDeadError(FlodlError):
    """This rank was removed from the cluster (declared dead or evicted)."""


class JoinRefused(FlodlError):
    """The controller would not let this rank (re)join; the message says why
    (a rank still live, a rejoin window that closed, rejoining switched off)."""
