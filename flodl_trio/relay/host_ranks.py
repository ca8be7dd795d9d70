"""What a host's relay channels share about its ranks, free of I/O.

A host runs a data channel and a control channel, each its own connection to
the controller. Only the data channel hears the controller's ``DeclareDead``
for a rank that never connected; the control channel must not wait for that
rank before it sends its ``Hello`` (which carries every rank's model
signature), or the host's other ranks would never reach the coordinator. Nor
for a rank that left the data channel for good (ranks that never open a control
connection): once every rank has left, the control channel has nobody to carry.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..transport.tasks import ChangeSignal


class HostRanks:
    """The host's rank set, and which of its ranks the cluster declared dead."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = frozenset(ranks)
        self.dead: set[int] = set()
        self.elastic: set[int] = set()  # ranks that called join(): they may come back after a crash
        self.finished: set[int] = set()  # elastic ranks that said they finished: they will not
        self.left_data: set[int] = set()  # ranks whose data connection ended (exit, crash, drop)
        self.lives: dict[int, int] = {}  # times the controller let each rank back in (its life, counted from 0)
        self.changed = ChangeSignal()  # a rank declared dead, or a rank's handshake done

    def declare_dead(self, rank: int) -> None:
        if rank in self.ranks and rank not in self.dead:
            self.dead.add(rank)
            self.changed.notify()

    def declare_away(self, rank: int) -> None:
        """Dead for now, but it may come back (the controller said ``RankAway``)."""
        if rank in self.ranks:
            self.elastic.add(rank)
            self.finished.discard(rank)
            self.declare_dead(rank)
            self.changed.notify()

    def leave_data(self, rank: int) -> None:
        """``rank``'s data connection ended: unless it may come back (it called join()), the
        control channel's formation waits for it no more."""
        if rank in self.ranks and rank not in self.left_data:
            self.left_data.add(rank)
            self.changed.notify()

    def revive(self, rank: int) -> None:
        """The controller let ``rank`` back in: a new life of it begins."""
        self.dead.discard(rank)
        self.lives[rank] = self.lives.get(rank, 0) + 1
        self.changed.notify()

    def life(self, rank: int) -> int:
        """Which life of ``rank`` the controller has let in: 0, then one more per return."""
        return self.lives.get(rank, 0)

    def may_return(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` that may still come back: they called join() and did not
        say they finished (the controller decides whether it lets them)."""
        return sorted(rank for rank in ranks if rank in self.elastic and rank not in self.finished)


__all__ = ["HostRanks"]
