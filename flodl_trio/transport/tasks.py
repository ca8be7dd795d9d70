"""Small trio idioms every role uses: a service nursery inside an async context
manager that does not turn the caller's own exception into an ExceptionGroup,
unwrapping a group at an API boundary, a signal for "something changed", and
turns that order writes on a shared link."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

import trio

from ..errors import FlodlError


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every error in ``exc``, exception groups flattened (a nursery's, nested)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


def unwrap_group(
    group: BaseExceptionGroup[BaseException], prefer: tuple[type[BaseException], ...] = ()
) -> BaseException:
    """The one error a caller should see for what a nursery raised, or the group itself.

    ``trio.Cancelled`` leaves are not counted: a task cancelled because its
    sibling failed is a consequence, not a second error. Several FlodlErrors
    at once (two tasks failing in the same instant) come out as one, with the
    others as notes: the first of the ``prefer`` types if there is one (a
    cause beside its consequences), else the first. Anything else that is not
    a single leaf (a bug beside an error) stays a group, so nothing is hidden.
    """
    real = [leaf for leaf in leaves(group) if not isinstance(leaf, trio.Cancelled)]
    if len(real) == 1:
        return real[0]
    if real and all(isinstance(leaf, FlodlError) for leaf in real):
        real.sort(key=lambda leaf: not isinstance(leaf, prefer))  # stable: preferred first
        first = real[0]
        for other in real[1:]:
            first.add_note(f"at the same time: {type(other).__name__}: {other}")
        return first
    return group


@contextmanager
def one_error(prefer: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Re-raise an exception group from the block as :func:`unwrap_group`'s one error.

    Used once, at an API boundary. The error keeps its own traceback, cause
    and context (the group it travelled in is not shown as its context).
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error = unwrap_group(group, prefer)
        if error is group:
            raise
        context = error.__context__
        try:
            raise error
        finally:
            error.__context__ = context


@asynccontextmanager
async def service_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for background service tasks that never raise themselves.

    The caller's body exception comes out as itself, not wrapped in a group;
    leaving the block cancels the services.
    """
    with one_error():
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            finally:
                nursery.cancel_scope.cancel()


def nothing() -> None:
    """A callback that does nothing: the default where a caller may pass one."""


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

    def next_change(self) -> trio.Event:
        """The event the next ``notify`` sets. Taken before a waiter does work that awaits,
        and waited on after it: a change made while it worked then wakes it at once,
        where ``wait`` would sleep through it until the one after."""
        return self._event


class Turns:
    """Writes on one link taken in a set order, as long as each ends in time.

    ``schedule[t]`` names the writer of ticket ``t`` (its peer, say); ``async
    with turns.turn(t)`` waits until every ticket below ``t`` has had its turn,
    then holds it for the write. A turn ends when its holder leaves the block
    (or gives the ticket up), or ``patience`` seconds after it began, whichever
    is first. A writer whose turn ended by patience (a peer that stopped
    reading) is passed over until that write ends: it holds the others back
    once, ``patience`` at most, and they go on beside it. A ticket never taken
    is given up with :meth:`give_up`.
    """

    def __init__(self, schedule: Sequence[Hashable], patience: float) -> None:
        self._writers = list(schedule)
        self._patience = patience
        self._current = 0  # the ticket whose turn it is (every one below has had its turn)
        self._since = trio.current_time()  # when its turn began
        self._ended: set[int] = set()
        self._behind: set[Hashable] = set()  # writers whose turn ended by patience, still writing
        self._changed = ChangeSignal()

    @asynccontextmanager
    async def turn(self, ticket: int) -> AsyncIterator[None]:
        try:
            while self._current < ticket:
                holder = self._current
                with trio.move_on_at(self._since + self._patience) as waited:
                    await self._changed.wait()
                if waited.cancelled_caught and self._current == holder:
                    self._behind.add(self._writers[holder])  # its write took too long
                    self._end(holder)
            yield
        finally:
            self._behind.discard(self._writers[ticket])
            self._end(ticket)

    def give_up(self, *tickets: int) -> None:
        """Tickets whose writes will not happen (their peer is gone): their turns are over."""
        for ticket in tickets:
            self._end(ticket)

    def _end(self, ticket: int) -> None:
        if ticket >= self._current:
            self._ended.add(ticket)
        start = self._current
        while self._current < len(self._writers) and (
            self._current in self._ended or self._writers[self._current] in self._behind
        ):
            self._ended.discard(self._current)
            self._current += 1
        if self._current != start:
            self._since = trio.current_time()
            self._changed.notify()


class RunOutcome:
    """How a service started by an ``open_*`` context manager ended.

    Recorded once, at the API boundary, by the task that ran the service (its
    tasks' errors travel there through their nurseries); read by the handle's
    ``wait_finished``. An error nobody awaited is raised when the block exits.
    """

    def __init__(self) -> None:
        self._ended = trio.Event()
        self._error: FlodlError | None = None
        self._reported = False

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def end(self, error: FlodlError | None = None) -> None:
        """The service finished, or ``error`` stopped it. The first error is kept even
        after a clean end (a failure that takes every rank down looks like a
        finish first); an awaiter that already returned sees it on block exit."""
        if error is not None and self._error is None:
            self._error = error
        self._ended.set()

    async def wait(self) -> None:
        """Until the service ended; raise the error that stopped it, if one did."""
        await self._ended.wait()
        if self._error is not None:
            self._reported = True
            raise self._error

    def unreported_error(self) -> FlodlError | None:
        return None if self._reported else self._error


async def run_service(
    run: Callable[[], Awaitable[None]], outcome: RunOutcome, log: logging.Logger, name: str,
    on_error: trio.CancelScope | None = None,
) -> None:
    """Run a role's service and record how it ended in ``outcome``.

    The one place its errors are caught: a FlodlError (a peer or the network
    broke something the role cannot carry on without) is logged, recorded,
    and cancels ``on_error`` (the caller's block); anything else is a bug and
    propagates, crashing the caller's block.
    """
    try:
        with one_error():
            await run()
    except FlodlError as exc:
        log.error("%s stopped: %s", name, exc)
        outcome.end(exc)
        if on_error is not None:
            on_error.cancel()
    else:
        outcome.end()


@asynccontextmanager
async def serving(run: Callable[[], Awaitable[None]], outcome: RunOutcome, log: logging.Logger, name: str) -> AsyncIterator[None]:
    """Run a role's service beside the caller's block: how every ``open_*`` of a role
    behaves, as ``connect_control_client`` does for a rank.

    A FlodlError that stops the service cancels the block (a wait on the role,
    ``wait_finished()`` included, ends) and leaves it as itself, never as a
    group; a clean end (every rank finished) leaves the block running; leaving
    the block stops the service.
    """
    async with service_nursery() as nursery:
        nursery.start_soon(run_service, run, outcome, log, name, nursery.cancel_scope)
        yield
    if (error := outcome.unreported_error()) is not None:
        raise error
