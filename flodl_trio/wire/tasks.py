"""Small trio idioms every role uses: running a service nursery inside an async
context manager without turning the caller's own exception into an ExceptionGroup."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


def sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The single leaf of a (nested) exception group, or the group itself."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


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
