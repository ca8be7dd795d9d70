"""DeadRanks: the cluster's shared, monotonic record of which ranks are out.

The controller, the coordinator and tests (or an operator) all declare deaths
here; the controller subscribes and turns each new death into one
DeclareDead to the relay carrying that rank. Safe to call from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import trio

from ..errors import ConfigError
from ..transport.tasks import ChangeSignal

Subscriber = Callable[[int], None]


class DeadRanks:
    """A set of dead global ranks that only grows."""

    def __init__(self, world_size: int) -> None:
        if world_size <= 0:
            raise ConfigError(f"world_size must be > 0, got {world_size}")
        self._world_size = world_size
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        self._subscribers: list[tuple[trio.lowlevel.TrioToken, Subscriber]] = []

    @property
    def world_size(self) -> int:
        return self._world_size

    def declare_dead(self, rank: int) -> bool:
        """Mark ``rank`` dead; True if it was alive. Subscribers hear about each death once."""
        if not 0 <= rank < self._world_size:
            raise ConfigError(f"rank {rank} is outside world_size {self._world_size}")
        with self._lock:
            if rank in self._dead:
                return False
            self._dead.add(rank)
            subscribers = list(self._subscribers)
        for token, callback in subscribers:
            try:
                token.run_sync_soon(callback, rank)
            except trio.RunFinishedError:
                pass
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

    async def watch(self, handle_deaths: Callable[[], None]) -> None:
        """Call ``handle_deaths()`` now and after each new death, until cancelled.

        ``handle_deaths`` compares the ledger with what it has handled and acts
        on the difference. It must not await: then no death can be declared
        between it and the wait, and none is missed.
        """
        changed = ChangeSignal()
        unsubscribe = self.subscribe(lambda _rank: changed.notify())
        try:
            while True:
                handle_deaths()
                await changed.wait()
        finally:
            unsubscribe()

    def __repr__(self) -> str:
        return f"DeadRanks(world_size={self._world_size}, dead={sorted(self.snapshot())})"
