"""The local leg: a rank and its data relay on one machine talk over a Unix socket.

Both ends find the socket at the same path without being told: a 0700
directory of the user's (``FLODL_UNIX_DIR``, default ``/tmp/flodl_trio-<uid>``)
holding ``data-<netns>-<port>.sock``, named by the network namespace and the
relay's data port - exactly what identifies the loopback listener the rank
would otherwise dial, so two network-namespace "hosts" on one machine, which
share the file system and may share port numbers, never meet. Each end checks
the other's uid with SO_PEERCRED: only the same user, or root. Frames on this
leg are not signed; docs/wire.md ("The local leg") says why that costs nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

import attrs
import trio

from ..errors import ConfigError
from .settings import switch_value

log = logging.getLogger("flodl_trio.net")

UNIX_DIR_ENV = "FLODL_UNIX_DIR"
NO_UNIX_ENV = "FLODL_NO_UNIX"
# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
# Unix sockets default to ~200 KiB of buffer; model-sized frames move in far
# fewer wake-ups with more (the kernel caps it at net.core.[rw]mem_max).
LOCAL_SOCKET_BUFFER = 4 << 20
_UCRED = struct.Struct("3i")  # pid, uid, gid


def local_leg_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """False when ``FLODL_NO_UNIX`` is on (1, true, yes, on); True when it is off (0,
    false, no, off) or empty; any other value is a ConfigError naming it."""
    raw = environ.get(NO_UNIX_ENV, "")
    if not raw.strip():
        return True
    try:
        return not switch_value(raw)
    except ValueError as exc:
        raise ConfigError(f"{NO_UNIX_ENV}: {exc}") from None


def local_leg_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this user's relays put their sockets: ``FLODL_UNIX_DIR`` or ``/tmp/flodl_trio-<uid>``."""
    configured = environ.get(UNIX_DIR_ENV, "").strip()
    return Path(configured) if configured else Path(f"/tmp/flodl_trio-{os.getuid()}")


def _network_namespace() -> int:
    """This process's network namespace (its inode), or 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def local_leg_path(port: int, directory: Path | None = None) -> Path:
    """The socket of the data relay listening on loopback ``port`` in this network namespace."""
    base = directory if directory is not None else local_leg_dir()
    return base / f"data-{_network_namespace()}-{port}.sock"


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` (mode 0700) or check an existing one is this user's and
    closed to everyone else: nobody else may plant or reach a socket there."""
    try:
        _make_private_dirs(directory)
        info = directory.lstat()
    except OSError as exc:
        raise ConfigError(f"local leg: cannot create directory {directory}: {exc}") from exc
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this process's uid {os.getuid()}"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}; it must be 0700"
    if problem is not None:
        raise ConfigError(
            f"local leg: {directory} {problem} (set {UNIX_DIR_ENV} to another directory, "
            f"or run without the local leg: --no-unix / {NO_UNIX_ENV}=1)"
        )


def _make_private_dirs(directory: Path) -> None:
    """``directory`` and the parents it lacks, each created 0700 (``mkdir(parents=True)``
    would make the parents by the umask: a world-writable one would let another user move
    our private directory aside and plant theirs)."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for each in reversed(missing):
        each.mkdir(mode=0o700, exist_ok=True)


def trusted_uid(uid: int) -> bool:
    """The local leg's peers: this process's own user, or root."""
    return uid in (os.getuid(), 0)


@attrs.frozen
class PeerCredentials:
    """Who is at the other end of a Unix socket, as the kernel recorded it at connect."""

    pid: int
    uid: int
    gid: int


def peer_credentials(stream: trio.abc.Stream) -> PeerCredentials | None:
    """SO_PEERCRED of a Unix socket stream; None for any other stream."""
    if not isinstance(stream, trio.SocketStream) or stream.socket.family != socket.AF_UNIX:
        return None
    raw = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


def _widen_buffers(sock: trio.socket.SocketType) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, LOCAL_SOCKET_BUFFER)


def tune_local_stream(stream: trio.abc.Stream) -> None:
    """Bigger kernel buffers on a local-leg socket (see LOCAL_SOCKET_BUFFER)."""
    if isinstance(stream, trio.SocketStream):
        _widen_buffers(stream.socket)


class LocalLegListener(trio.abc.Listener[trio.SocketStream]):
    """A data relay's Unix-socket listener (trio's SocketListener, which is final,
    inside); its file goes away when it closes."""

    def __init__(self, sock: trio.socket.SocketType, path: Path) -> None:
        self._inner = trio.SocketListener(sock)
        self.path = path

    async def accept(self) -> trio.SocketStream:
        return await self._inner.accept()

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self.path.unlink(missing_ok=True)


async def _served(path: Path) -> bool:
    """Whether a live process accepts connections on the Unix socket at ``path``."""
    with trio.move_on_after(1.0):
        try:
            stream = await trio.open_unix_socket(str(path))
        except OSError:
            return False
        await stream.aclose()
        return True
    return True  # it neither accepted nor refused: someone holds it


async def open_local_leg_listener(port: int, directory: Path | None = None) -> LocalLegListener | None:
    """Listen on the local-leg socket for the data relay bound to loopback ``port``.

    A socket file already there is usually a relay that died without cleaning
    up: it is replaced. If a live process still serves it (another relay on the
    same port number, bound to another address of this network namespace), it
    is left alone and None returned: this relay serves TCP only.
    """
    base = directory if directory is not None else local_leg_dir()
    ensure_private_dir(base)
    path = local_leg_path(port, base)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"local leg: socket path {path} is longer than {MAX_SOCKET_PATH} bytes; set {UNIX_DIR_ENV} to a shorter directory"
        )
    if path.is_symlink() or (path.exists() and not stat.S_ISSOCK(path.lstat().st_mode)):
        raise ConfigError(f"local leg: {path} exists and is not a socket; remove it or set {UNIX_DIR_ENV}")
    if path.exists() and await _served(path):
        log.warning("local leg: %s is served by a live process; this relay serves its ranks over TCP only", path)
        return None
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        path.unlink(missing_ok=True)
        raise
    _widen_buffers(sock)
    return LocalLegListener(sock, path)


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address: the relay there is on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


async def dial_local_leg(host: str, port: int, who: str) -> trio.SocketStream | None:
    """The local leg to the data relay at loopback ``host:port``, when it offers one
    and is run by this user or root; None otherwise (the caller dials TCP)."""
    if not is_loopback(host):
        return None
    path = local_leg_path(port)
    try:
        stream = await trio.open_unix_socket(str(path))
    except OSError:
        return None  # no relay here with a local leg (or a stale file): TCP it is
    peer = peer_credentials(stream)
    if peer is None or not trusted_uid(peer.uid):
        log.warning("%s: %s is served by uid %s, not this user or root; using TCP", who, path, peer and peer.uid)
        await stream.aclose()
        return None
    tune_local_stream(stream)
    return stream


__all__ = [
    "NO_UNIX_ENV",
    "UNIX_DIR_ENV",
    "LocalLegListener",
    "PeerCredentials",
    "dial_local_leg",
    "ensure_private_dir",
    "is_loopback",
    "local_leg_dir",
    "local_leg_enabled",
    "local_leg_path",
    "open_local_leg_listener",
    "peer_credentials",
    "trusted_uid",
]
