"""Receive buffers that grow only as bytes arrive, and a pool that bounds how many exist.

A length prefix from a peer is untrusted: these buffers never reserve memory
for bytes that have not landed, so a lying prefix costs nothing, and a pool of
them caps a daemon's model-sized memory whatever the number of peers.
"""

from __future__ import annotations

import numpy as np
import trio

# First allocation of an empty receive buffer; it doubles from here as bytes arrive.
INITIAL_RECEIVE = 64 << 10
# Messages up to this size are read into a connection's own small buffer; larger
# ones take a model-sized buffer from a pool, which bounds how many exist.
SMALL_MESSAGE = 64 << 10


class ReceiveBuffer:
    """A reusable receive buffer that grows as bytes arrive, never ahead of them.

    Capacity is kept between messages, so steady-state rounds allocate nothing.
    Growth is geometric from a small start (the filled part is copied at most
    about once overall) and never reserves more than ``max(filled, 64 KiB)``
    bytes beyond what the peer has actually sent: a lying length prefix costs
    nothing until the bytes really arrive.
    """

    def __init__(self, capacity: int = 0) -> None:
        """``capacity``: bytes to reserve now, only for a size already proven (a verified frame)."""
        self._array = np.empty(capacity, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        return self._array.size

    def writable(self, filled: int, total: int) -> memoryview:
        """A view of ``[filled, cap)`` where ``cap <= total``, growing if full."""
        if filled >= self._array.size:
            new_cap = min(total, max(INITIAL_RECEIVE, 2 * filled, self._array.size + 1))
            grown = np.empty(new_cap, dtype=np.uint8)
            grown[:filled] = self._array[:filled]
            self._array = grown
        end = min(total, self._array.size)
        return self._array.data[filled:end]

    def view(self, n: int) -> memoryview:
        return self._array.data[:n]

    def array(self, n: int) -> np.ndarray:
        """The first ``n`` bytes as a writable uint8 array (a view, no copy)."""
        return self._array[:n]

    def reserve(self, n: int) -> None:
        """At least ``n`` bytes of capacity, contents discarded: only for a size
        already proven (computed from verified frames)."""
        if self._array.size < n:
            self._array = np.empty(n, dtype=np.uint8)


class BufferPool:
    """A small set of receive buffers shared by many readers.

    Taking a buffer before receiving a payload bounds memory by the pool size,
    whatever the number of peers; peers beyond it wait in TCP backpressure.
    The pool starts with ``size`` buffers and may be given more with
    :meth:`add`, up to ``limit``.
    """

    def __init__(self, size: int, *, limit: int | None = None) -> None:
        self.size = size
        self.limit = max(size, limit or 0)
        self._send, self._receive = trio.open_memory_channel[ReceiveBuffer](self.limit)
        for _ in range(size):
            self._send.send_nowait(ReceiveBuffer())

    def add(self, buf: ReceiveBuffer) -> None:
        """One more buffer for the pool; a pool already at its limit refuses it."""
        if self.size >= self.limit:
            raise RuntimeError(f"buffer pool already holds its limit of {self.limit} buffers")
        self.size += 1
        self._send.send_nowait(buf)

    async def acquire(self) -> ReceiveBuffer:
        return await self._receive.receive()

    def try_acquire(self) -> ReceiveBuffer | None:
        """A free buffer now, or None."""
        try:
            return self._receive.receive_nowait()
        except trio.WouldBlock:
            return None

    def release(self, buf: ReceiveBuffer) -> None:
        self._send.send_nowait(buf)
