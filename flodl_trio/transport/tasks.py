"""Small trio idioms every role uses: a service nursery inside an async context
manager that does not turn the caller's own exception into an ExceptionGroup,
unwrapping a group at an API boundary, and a signal for "something changed"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


def sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The single real leaf of a (nested) exception group, or the group itself.

    ``trio.Cancelled`` leaves are not counted: a task cancelled because its
    sibling failed is a consequence, not a second error (cancellation is
    level-triggered, so it still takes effect at the next checkpoint).
    """
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    real = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)]
    return real[0] if len(real) == 1 else group


@asynccontextmanager
async def service_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for background service tasks that never raise themselves.

    The caller's body exception comes out as itself, not wrapped in a group;
    leaving the block cancels the services.
    """
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise sole_exception(group) from None


class ChangeSignal:
    """Wakes every task waiting for the next change: an Event that is set, then renewed.

    A waiter re-checks its condition after each wake-up, so a change it slept
    through is never lost (it sees the new state), and ``notify`` never blocks.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()
