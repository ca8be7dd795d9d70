"""Who is in the cluster and who may come back, free of I/O.

A rank's life as the controller sees it::

    absent --connects--> live --exits, crashes, is dropped or declared dead--> dead
    absent --formation_timeout passes with min_ranks present--> dead (may come)
    dead --its relay asks, and it asks for its state--> joining  (its state is sent)
    joining --it says it has its state--> primed
    primed --a window boundary--> live        (it enters the next window)
    joining, primed --a connection closes, or its state write stalls--> dead
    dead --rejoin_timeout passes--> gone for good
    live --says it finished, and leaves--> gone for good

A rank whose trainer calls ``join`` (it asked for its state: it is
*elastic*) may come back. So may a rank that died before anyone saw whether
its trainer calls it (killed while starting, or with its relay), unless the
cluster has run a round with nobody calling it. A rank that left without
calling it, or in a cluster where nobody does, is final, as in flodl.

``DeadRanks`` says who is dead right now. :class:`Membership` remembers when
each rank died, decides whether a returning rank is let back in, pairs the
two halves of a return (its relay's ``RankJoin`` and its own state request,
which arrive in either order on different connections), and says when the
cluster is finished: every rank dead and none may come back. With
``rejoin_timeout`` 0 (the in-process default) dead is final, as in flodl.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class Membership:
    """The controller's rejoin policy and its record of deaths and returns."""

    def __init__(
        self,
        world_size: int,
        rejoin_timeout: float = 0.0,
        *,
        min_ranks: int | None = None,
        formation_timeout: float | None = None,
    ) -> None:
        self.world_size = world_size
        self.rejoin_timeout = rejoin_timeout
        self.min_ranks = world_size if min_ranks is None else min_ranks
        self.formation_timeout = formation_timeout
        self.absent: set[int] = set()  # ranks the cluster formed without: they join later
        self.died_at: dict[int, float] = {}
        self.asked: dict[int, int] = {}  # rank -> the seat whose relay asked to let it back in
        self.waiting: set[int] = set()  # ranks whose verified state request is in
        self.primed: set[int] = set()  # returns whose state was delivered: they enter at the next boundary
        self.elastic: set[int] = set()  # ranks that called join(): they may come back after a death
        self.finished: set[int] = set()  # elastic ranks that said they finished: they will not
        self.plain: set[int] = set()  # ranks that left without ever calling join(): they will not
        self.formed = False  # a round has completed: who calls join() is known by now
        self.rejoins = 0
        self.late_joins = 0

    def phase(self, rank: int, *, dead: bool) -> str:
        """``"live"``, ``"joining"`` (both halves of its return are in: its state is on its
        way), ``"primed"`` (it has its state: it enters at the next boundary) or ``"dead"``."""
        if not dead:
            return "live"
        if rank not in self.asked or rank not in self.waiting:
            return "dead"
        return "primed" if rank in self.primed else "joining"

    def died(self, rank: int, now: float) -> None:
        """``rank`` is dead as of ``now`` (its rejoin window opens)."""
        self.died_at.setdefault(rank, now)

    def refusal(self, rank: int, now: float, *, dead: bool) -> str | None:
        """Why ``rank`` may not rejoin now, in words; None if it may."""
        if not dead:
            return f"rank {rank} is live on the cluster (is another process running as rank {rank}?)"
        if rank in self.finished:
            return f"rank {rank} finished its training (it said so when it left)"
        if self.rejoin_timeout <= 0:
            return "rejoining is switched off (rejoin_timeout is 0)"
        died = self.died_at.get(rank)
        if died is not None and now - died > self.rejoin_timeout:
            return f"it died {now - died:.1f} s ago, longer than rejoin_timeout {self.rejoin_timeout:g} s"
        return None

    def ask(self, rank: int, seat: int) -> None:
        """Its relay asks to let ``rank`` back in (it reconnected there)."""
        self.asked[rank] = seat

    def wait_for_state(self, rank: int) -> None:
        """``rank`` asked for its state (its answer verified); it gets it once its relay asked too."""
        self.waiting.add(rank)

    def prime(self, rank: int) -> None:
        """``rank`` has its state (its receipt came): it may enter at a boundary."""
        if rank in self.asked and rank in self.waiting:
            self.primed.add(rank)

    def withdraw(self, rank: int) -> None:
        """A half of ``rank``'s return went away (a connection closed): it is dead again."""
        self.asked.pop(rank, None)
        self.waiting.discard(rank)
        self.primed.discard(rank)

    def seat_gone(self, seat: int) -> list[int]:
        """A relay left: the returns it asked for are off; returns those ranks."""
        ranks = sorted(rank for rank, asker in self.asked.items() if asker == seat)
        for rank in ranks:
            self.withdraw(rank)
        return ranks

    def ready(self) -> list[tuple[int, int]]:
        """``(rank, seat)`` of each return whose both halves are in, in rank order."""
        return [(rank, self.asked[rank]) for rank in sorted(self.asked) if rank in self.waiting]

    def entering(self) -> list[tuple[int, int]]:
        """``(rank, seat)`` of each return that has its state: the next boundary lets it in."""
        return [(rank, seat) for rank, seat in self.ready() if rank in self.primed]

    def rejoined(self, rank: int) -> None:
        """``rank`` is live (again) - let in at a boundary: a rejoin, or the first join
        of a rank the cluster formed without (a late join)."""
        self.withdraw(rank)
        self.died_at.pop(rank, None)
        if rank in self.absent:
            self.absent.discard(rank)
            self.late_joins += 1
        else:
            self.rejoins += 1

    def absent_at_formation(self, elapsed: float) -> list[int] | None:
        """The ranks to start without: once ``formation_timeout`` has passed and at
        least ``min_ranks`` ranks are present (a rank is present once it asked for
        its state: its trainer called join()). None: wait on."""
        if self.formation_timeout is None or elapsed < self.formation_timeout:
            return None
        if len(self.elastic) < self.min_ranks:
            return None
        return sorted(set(range(self.world_size)) - self.elastic)

    def formed_without(self, rank: int, now: float) -> None:
        """The cluster starts without ``rank``; it may join later, like a rank that died now."""
        self.absent.add(rank)
        self.elastic.add(rank)
        self.died(rank, now)

    def joined(self, rank: int) -> None:
        """``rank`` asked for its state: it takes part in elastic membership."""
        self.elastic.add(rank)
        self.plain.discard(rank)

    def said_finished(self, rank: int) -> None:
        self.finished.add(rank)

    def may_return(self, rank: int, now: float) -> bool:
        """Whether dead ``rank`` may still come back (its relay keeps serving for it)."""
        died = self.died_at.get(rank)
        return not self.final(rank) and (died is None or now - died <= self.rejoin_timeout)

    def left_plainly(self, rank: int) -> None:
        """``rank`` closed its connection without ever calling join(): a trainer that
        does not come back (its death is final, as in flodl)."""
        if rank not in self.elastic:
            self.plain.add(rank)

    def final(self, rank: int) -> bool:
        """Whether ``rank``'s death is for good whatever the clock says: rejoining is
        off, it said it finished, it left without ever calling join(), or the cluster
        has run a round and no rank of it called join() (nobody trains elastically).
        A rank that died while the cluster was still forming may come back."""
        return (
            self.rejoin_timeout <= 0 or rank in self.finished or rank in self.plain
            or (self.formed and not self.elastic)
        )

    def finish_deadline(self, dead: Iterable[int]) -> float | None:
        """When the cluster is finished unless someone rejoins first: None while a
        rank is live; -inf when every rank is dead and none may come back."""
        dead = set(dead)
        if len(dead) < self.world_size:
            return None
        return max(
            (-math.inf if self.final(rank) else self.died_at.get(rank, -math.inf) + self.rejoin_timeout
             for rank in dead),
            default=-math.inf,
        )


__all__ = ["Membership"]
