"""DeadRanks: the cluster's shared record of which ranks are out.

The controller, the coordinator and tests (or an operator) all declare deaths
here; the controller subscribes and turns each new death into one
DeclareDead to the relay carrying that rank. A rank that rejoins is revived
by the controller, and nobody else: until then, dead is dead. Safe to call
from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import trio

from ..errors import ConfigError
from ..transport.tasks import ChangeSignal

Subscriber = Callable[[int], None]


class DeadRanks:
    """The set of dead global ranks; a rank leaves it only by rejoining (:meth:`revive`)."""

    def __init__(self, world_size: int) -> None:
        if world_size <= 0:
            raise ConfigError(f"world_size must be > 0, got {world_size}")
        self._world_size = world_size
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        self._subscribers: list[tuple[trio.lowlevel.TrioToken, Subscriber]] = []
        self._watchers: list[tuple[trio.lowlevel.TrioToken, Callable[[], None]]] = []

    @property
    def world_size(self) -> int:
        return self._world_size

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self._world_size:
            raise ConfigError(f"rank {rank} is outside world_size {self._world_size}")

    def declare_dead(self, rank: int) -> bool:
        """Mark ``rank`` dead; True if it was alive. Subscribers hear about each death once."""
        self._check(rank)
        with self._lock:
            if rank in self._dead:
                return False
            self._dead.add(rank)
            subscribers = list(self._subscribers)
        for token, callback in subscribers:
            _call_soon(token, callback, rank)
        self._changed()
        return True

    def revive(self, rank: int) -> bool:
        """A dead rank rejoined the cluster (the controller admitted it); True if it was dead."""
        self._check(rank)
        with self._lock:
            if rank not in self._dead:
                return False
            self._dead.discard(rank)
        self._changed()
        return True

    def is_dead(self, rank: int) -> bool:
        with self._lock:
            return rank in self._dead

    def dead_count(self) -> int:
        with self._lock:
            return len(self._dead)

    def snapshot(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._dead)

    def all_dead(self) -> bool:
        return self.dead_count() == self._world_size

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(rank)`` in the current trio run for every future death.

        Returns the unsubscribe function.
        """
        entry = (trio.lowlevel.current_trio_token(), callback)
        with self._lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._lock:
                if entry in self._subscribers:
                    self._subscribers.remove(entry)

        return unsubscribe

    async def watch(self, handle_changes: Callable[[], None]) -> None:
        """Call ``handle_changes()`` now and after each death or revival, until cancelled.

        ``handle_changes`` compares the ledger with what it has handled and acts
        on the difference. It must not await: then no change can land between
        it and the wait, and none is missed.
        """
        changed = ChangeSignal()
        entry = (trio.lowlevel.current_trio_token(), changed.notify)
        with self._lock:
            self._watchers.append(entry)
        try:
            while True:
                handle_changes()
                await changed.wait()
        finally:
            with self._lock:
                self._watchers.remove(entry)

    def _changed(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for token, notify in watchers:
            _call_soon(token, notify)

    def __repr__(self) -> str:
        return f"DeadRanks(world_size={self._world_size}, dead={sorted(self.snapshot())})"


def _call_soon(token: trio.lowlevel.TrioToken, callback: Callable[..., None], *args: object) -> None:
    try:
        token.run_sync_soon(callback, *args)
    except trio.RunFinishedError:
        pass


__all__ = ["DeadRanks"]
