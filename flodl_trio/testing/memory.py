"""A network in memory: listeners and a connect function that join trio memory streams.

Every role takes ``listeners=`` and a ``connect`` function, so a whole cluster
can run on a :class:`MemoryNetwork` instead of TCP: no ports, no kernel, and,
with ``trio.testing.MockClock(autojump_threshold=0)``, no real waiting either -
a 30 s heartbeat timeout passes in microseconds of wall time, and a test of it
is exact instead of racing the machine's load::

    network = MemoryNetwork()
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt, network=network) as cluster:
        await cluster.run_ranks(rank_main)   # clients connect through network.connect

Streams are ``trio.testing.memory_stream_pair`` ends: in-order and reliable,
with no back-pressure, so a write never stalls. Keep frames under 1 MiB in
virtual-time tests: larger ones are hashed in worker threads, and the mock
clock jumps ahead while every task waits for a thread.
"""

from __future__ import annotations

import errno
import itertools

import trio
import trio.testing

MEMORY_HOST = "memory"


class MemoryListener(trio.abc.Listener[trio.abc.Stream]):
    """The server end of connections made with :meth:`MemoryNetwork.connect` to its port."""

    def __init__(self, network: MemoryNetwork, port: int) -> None:
        self.network = network
        self.port = port
        self._send, self._incoming = trio.open_memory_channel[trio.abc.Stream](64)
        self._closed = False

    def _offer(self, stream: trio.abc.Stream) -> None:
        try:
            self._send.send_nowait(stream)
        except trio.WouldBlock:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"memory port {self.port}: backlog full") from None

    async def accept(self) -> trio.abc.Stream:
        try:
            return await self._incoming.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError(f"memory listener on port {self.port} is closed") from None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.network._listeners.pop(self.port, None)
            self._send.close()
            self._incoming.close()
        await trio.lowlevel.checkpoint()


class MemoryNetwork:
    """Ports in memory: :meth:`listen` binds one, :meth:`connect` dials one."""

    def __init__(self) -> None:
        self._listeners: dict[int, MemoryListener] = {}
        self._ports = itertools.count(20000)
        self.connections = 0

    def listen(self, port: int = 0) -> MemoryListener:
        """A listener on ``port`` (0: the next free one)."""
        if port == 0:
            port = next(p for p in self._ports if p not in self._listeners)
        if port in self._listeners:
            raise OSError(errno.EADDRINUSE, f"memory port {port} is in use")
        listener = self._listeners[port] = MemoryListener(self, port)
        return listener

    def address(self, listener: MemoryListener) -> tuple[str, int]:
        return (MEMORY_HOST, listener.port)

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """A stream to whoever listens on ``port``; ConnectionRefusedError when nobody does."""
        await trio.lowlevel.checkpoint()
        listener = self._listeners.get(int(port))
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"nothing listens on {host}:{port}")
        client, server = trio.testing.memory_stream_pair()
        listener._offer(server)
        self.connections += 1
        return client


__all__ = ["MEMORY_HOST", "MemoryListener", "MemoryNetwork"]
