"""Which data relays the controller accepted, and which ranks each carries.

One :class:`Seats` registry serves the whole controller: every lane's round
reads it (a relay is seated once, whatever the number of lanes), the
broadcaster asks it where a consensus goes, and death forwarding asks it which
relay carries a rank. What belongs to one round (who delivered, who waits for
a consensus) stays in that round. No I/O: plain calls, tested without trio.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import attrs

from ..errors import HandshakeError
from ..transport.hello import check_ranks_listed
from ..wire.mux import Hello
from .dead_ranks import DeadRanks


@attrs.define(eq=False)
class Seat:
    """One accepted data relay: its name in logs, its ranks, whether its connection is up."""

    name: str
    ranks: tuple[int, ...]
    connected: bool = True


class Seats:
    """The seated relays (seat id -> :class:`Seat`) and who carries each rank.

    Deaths come from the shared :class:`DeadRanks` ledger, read directly.
    """

    def __init__(self, world_size: int, dead: DeadRanks) -> None:
        self.world_size = world_size
        self.dead = dead
        self.seats: dict[int, Seat] = {}
        self._owner: dict[int, int] = {}  # rank -> seat id (the newest relay that carried it)

    def check_hello(self, hello: Hello) -> None:
        """Ranks must be non-empty, sorted, unique, inside the world, and not carried already
        (a relay whose connection is gone carries nothing: a restarted relay may take its ranks)."""
        carried = {rank: self.seats[sid].name for rank, sid in self._owner.items() if self.seats[sid].connected}
        check_hello_ranks(hello, self.world_size, carried)

    def seat(self, seat_id: int, hello: Hello, name: str) -> None:
        """An accepted relay (its Hello passed :meth:`check_hello`) now carries its ranks."""
        self.seats[seat_id] = Seat(name, tuple(hello.ranks))
        for rank in hello.ranks:
            self._owner[rank] = seat_id

    def unseat(self, seat_id: int) -> None:
        """A relay's connection is gone (its ranks are declared dead by the caller)."""
        self.seats[seat_id].connected = False

    def ranks_of(self, seat_id: int) -> tuple[int, ...]:
        return self.seats[seat_id].ranks

    def is_connected(self, seat_id: int) -> bool:
        """Whether the relay's connection is still up."""
        return self.seats[seat_id].connected

    def name(self, seat_id: int) -> str:
        return self.seats[seat_id].name

    def owner(self, rank: int) -> int | None:
        """The relay that carries or last carried ``rank`` (connected or not)."""
        return self._owner.get(rank)

    def seat_of(self, rank: int) -> int | None:
        """The connected relay carrying ``rank``, if any."""
        seat_id = self._owner.get(rank)
        return seat_id if seat_id is not None and self.seats[seat_id].connected else None

    def has_live_rank(self, seat_id: int) -> bool:
        return any(not self.dead.is_dead(rank) for rank in self.seats[seat_id].ranks)

    def connected(self) -> list[tuple[int, Seat]]:
        """The relays whose connection is up, in the order they were seated."""
        return [(sid, seat) for sid, seat in self.seats.items() if seat.connected]

    def broadcast_targets(self, delivered_by: Collection[int] = ()) -> list[int]:
        """The relays a consensus goes to: connected, and with a live rank or among
        ``delivered_by`` (a relay that sent the round its HostFrame waits for the
        answer even if its ranks all died since: without it, a rank let back in on
        that host would wait for a window start that never comes down)."""
        return [sid for sid, _seat in self.connected() if sid in delivered_by or self.has_live_rank(sid)]

    def lowest_rank(self, seat_id: int) -> int:
        """A relay's lowest rank: its place in host order, and its name to the shards."""
        return min(self.seats[seat_id].ranks)

    def first_in_host_order(self, seat_ids: Iterable[int]) -> int | None:
        """Of ``seat_ids``, the relay with the lowest rank (deterministic mode's fold order)."""
        return min(seat_ids, key=lambda sid: min(self.seats[sid].ranks), default=None)


def check_hello_ranks(hello: Hello, world_size: int, carried_by: dict[int, str]) -> None:
    """Ranks must be non-empty, sorted, unique, inside the world, and not carried
    already (``carried_by``: rank -> the name of the relay that does)."""
    check_ranks_listed(hello)
    for rank in hello.ranks:
        if rank >= world_size:
            raise HandshakeError(f"Hello from host {hello.host!r} announces rank {rank} >= world_size {world_size}")
        if rank in carried_by:
            raise HandshakeError(f"Hello from host {hello.host!r} announces rank {rank}, already carried by {carried_by[rank]}")


__all__ = ["Seat", "Seats", "check_hello_ranks"]
