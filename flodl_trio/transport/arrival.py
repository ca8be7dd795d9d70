"""Following a message while it arrives: how far it has landed, and running
helpers beside the receive that must never act on bytes that fail to verify.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .tasks import ChangeSignal, one_error

T = TypeVar("T")


class ArrivalWatch:
    """How much of a message being received has landed, for tasks that work on it
    while it arrives (forwarding it, signing it, computing from it) and must not
    let anything out before it is verified.

    The receiving task calls :meth:`advance` as bytes land, then exactly one of
    :meth:`verified` or :meth:`abort`; watchers step through the arrival with
    :meth:`next_stretch` and end with :meth:`wait_done`.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.filled = 0
        self.done = False
        self.ok = False
        self._changed = ChangeSignal()

    def advance(self, filled: int) -> None:
        self.filled = filled
        self._changed.notify()

    def verified(self) -> None:
        self.done, self.ok = True, True
        self._changed.notify()

    def abort(self) -> None:
        self.done = True
        self._changed.notify()

    async def wait_past(self, n: int) -> None:
        """Until more than ``n`` bytes have landed, or the message ended either way."""
        while self.filled <= n and not self.done:
            await self._changed.wait()

    async def next_stretch(self, pos: int, *, step: int | None = None, stop: int | None = None) -> int | None:
        """Once more than ``pos`` bytes have landed, how far a watcher may now work: at
        most ``step`` bytes past ``pos`` and never past ``stop`` (default: the whole
        message). None when there is no more: ``stop`` reached, or the receive
        failed (``ok`` tells which). Yields to the event loop at least once, so a
        burst of landed bytes is worked through a step at a time."""
        stop = self.length if stop is None else stop
        if pos >= stop:
            return None
        if self.filled > pos or self.done:
            await trio.lowlevel.checkpoint()
        else:
            await self.wait_past(pos)
        if (self.done and not self.ok) or self.filled <= pos:
            return None
        return min(self.filled, stop, pos + step if step is not None else stop)

    async def wait_done(self) -> None:
        while not self.done:
            await self._changed.wait()


async def receive_with_followers(
    watch: ArrivalWatch, receive: Callable[[], Awaitable[T]], *followers: Callable[[], Awaitable[Any]]
) -> tuple[T, list[Any]]:
    """Run ``receive`` (which advances ``watch``) with ``followers`` working beside it;
    return the receive's result and each follower's, in order.

    The watch is marked verified when ``receive`` returns (it verifies before
    returning) and aborted if it raises, so a follower never acts on bytes that
    failed; the receive's own error comes out unwrapped.
    """
    results: list[Any] = [None] * len(followers)

    async def run_follower(index: int) -> None:
        results[index] = await followers[index]()

    with one_error():
        async with trio.open_nursery() as nursery:
            for index in range(len(followers)):
                nursery.start_soon(run_follower, index)
            try:
                received = await receive()
            except BaseException:
                watch.abort()
                raise
            watch.verified()
    return received, results
