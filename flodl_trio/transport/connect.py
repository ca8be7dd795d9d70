"""Making and tuning connections: dialing with retries, socket options, and
the warning for peers outside private address space.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

import trio

from ..errors import ConnectFailed
from ..settings import CONNECT_RETRY_ATTEMPTS, connect_retry_interval

log = logging.getLogger("flodl_trio.net")

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


def warn_if_public_peer(role: str, host: str) -> bool:
    """Warn once per peer address that this link is authenticated but not encrypted.

    Returns True when a warning was printed (for tests).
    """
    if is_private_address(host) or host in _warned_peers:
        return False
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


def peer_host(stream: trio.abc.Stream) -> str:
    if isinstance(stream, trio.SocketStream):
        try:
            return str(stream.socket.getpeername()[0])
        except OSError:
            return "?"
    return "in-memory"


async def connect_with_retry(
    host: str,
    port: int,
    what: str,
    *,
    attempts: int = CONNECT_RETRY_ATTEMPTS,
    interval: float | None = None,
) -> trio.SocketStream:
    """Dial ``host:port``, retrying while the peer is not up yet; ConnectFailed after the budget."""
    delay = connect_retry_interval() if interval is None else interval
    last: OSError | None = None
    for attempt in range(max(attempts, 1)):
        try:
            stream = await trio.open_tcp_stream(host, port)
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
