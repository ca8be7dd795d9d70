"""Making and tuning connections: dialing with retries, socket options, and
the warning for peers outside private address space.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

import trio

from ..errors import ConnectFailed
from .settings import NetBounds

log = logging.getLogger("flodl_trio.net")

# How a role dials a peer: ``trio.open_tcp_stream`` in production; tests may hand
# in one that connects in memory. It raises OSError when nobody listens there.
Connector = Callable[[str, int], Awaitable[trio.abc.Stream]]
Listeners = Sequence[trio.abc.Listener[trio.abc.Stream]]

_warned_peers: set[str] = set()

_QUIET_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
        "169.254.0.0/16", "100.64.0.0/10", "::1/128", "fe80::/10", "fc00::/7",
    )
)


def is_private_address(host: str) -> bool:
    """True for loopback, RFC 1918, link-local, CGNAT and IPv6 ULA/link-local."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr.version == net.version and addr in net for net in _QUIET_NETWORKS)


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def warn_if_public_peer(role: str, host: str) -> bool:
    """Warn once per peer address that this link is authenticated but not encrypted.

    Returns True when a warning was printed (for tests).
    """
    if is_private_address(host) or not _is_ip_address(host) or host in _warned_peers:
        return False  # private, or not a network peer at all (an in-memory stream)
    _warned_peers.add(host)
    log.warning(
        "%s: peer %s is outside private address space; flodl traffic is "
        "authenticated (HMAC) but NOT encrypted - tunnel it (WireGuard, SSH) "
        "across untrusted networks",
        role, host,
    )
    return True


def tune_socket(stream: trio.abc.Stream) -> None:
    """TCP_NODELAY (ping-pong latency) and keepalive (find partitioned peers)."""
    if isinstance(stream, trio.SocketStream):
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, True)


def listener_port(listener: trio.abc.Listener[trio.abc.Stream]) -> int:
    """The port a listener is bound to (a socket listener's, or a test listener's ``port``)."""
    sock = getattr(listener, "socket", None)
    if sock is not None:
        return int(sock.getsockname()[1])
    return int(getattr(listener, "port", 0))


def peer_host(stream: trio.abc.Stream) -> str:
    if isinstance(stream, trio.SocketStream):
        try:
            return str(stream.socket.getpeername()[0])
        except OSError:
            return "?"
    return "in-memory"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_host(stream: trio.abc.Stream) -> str | None:
    """The address this end of a TCP connection has (None: not a socket): what a peer
    on the other side's network reaches this machine at."""
    if isinstance(stream, trio.SocketStream):
        try:
            return str(stream.socket.getsockname()[0])
        except OSError:
            return None
    return None


async def connect_with_retry(
    host: str, port: int, what: str, bounds: NetBounds, connect: Connector = trio.open_tcp_stream
) -> trio.abc.Stream:
    """Dial ``host:port`` with ``connect``, retrying while the peer is not up yet
    (``bounds.connect_attempts`` tries, ``bounds.connect_interval`` apart);
    ConnectFailed after the budget."""
    attempts, delay = bounds.connect_attempts, bounds.connect_interval
    last: OSError | None = None
    for attempt in range(attempts):
        try:
            stream = await connect(host, port)
        except OSError as exc:
            last = exc
            if attempt + 1 < attempts:
                await trio.sleep(delay)
            continue
        tune_socket(stream)
        warn_if_public_peer(what, peer_host(stream))
        return stream
    raise ConnectFailed(
        f"{what}: connect to {host}:{port} failed after {attempts} attempts "
        f"{delay:.2f} s apart: {last}"
    )
