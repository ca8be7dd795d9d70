"""Server-side relay links, shared by the controller (data) and the coordinator (control).

A link is one accepted relay connection: the ranks it carries, and an outbox
drained by exactly one writer task, so records queued from anywhere (round
completion, a death callback) reach the socket whole and in order.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from ..fold.schemas import Schema
from ..transport.buffers import ReceiveBuffer
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..wire.mux import (
    Hello,
    MuxKind,
    RelayControlMsg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.round_frame import EncodedFrame
from ..wire.salt import SessionSalt
from .dead_ranks import DeadRanks

_ids = itertools.count()
# What an outbox holds: the record, what to call just before writing it (a
# consensus: the relay may answer it at once), and what to call once it has
# been written whole (None: nothing).
Outgoing = tuple[EncodedFrame, Callable[[], None] | None, Callable[[], None] | None]


class AfterAllWrites:
    """Runs ``then`` once ``count`` link writers have each written the same record
    (give :meth:`one` as every link's ``on_written``)."""

    def __init__(self, count: int, then: Callable[[], None]) -> None:
        self.count = count
        self.then = then

    def one(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.then()


@attrs.define(eq=False)
class RelayLink:
    """One accepted relay connection and the ranks it carries."""

    host: str
    ranks: tuple[int, ...]
    conn: MessageStream
    outbox: trio.MemorySendChannel[Outgoing]
    inbox: trio.MemoryReceiveChannel[Outgoing]
    model_sigs: tuple[bytes, ...] = ()
    id: int = attrs.field(factory=lambda: next(_ids))
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    closed: bool = False
    small: ReceiveBuffer = attrs.field(factory=ReceiveBuffer)
    dropped_for: str | None = None  # why another task's round cut this relay off (see ``expel``)
    # Whether its Hello said it takes flodl_trio's control messages (a flodl relay closes
    # on one it does not know: it is sent flodl's alone).
    takes_extensions: bool = False
    # Whether it sends each HostFrame whole and is sent each consensus whole, while the
    # controller reduces in lanes (a relay that does not take extensions: flodl's bytes).
    whole: bool = False
    # Whether its HostFrame of the round in progress came whole (a flodl relay's always; a
    # flodl_trio relay's when the round goes in one lane): its consensus goes back whole.
    sent_whole: bool = False
    # Shards: where the relay serves one (its ShardOffer), whether its rounds go through
    # the cluster's shards (from its next lane 0 when ``sharded_next``: they were fixed
    # while its round was in progress), and whether the round in progress does (a delta
    # round does not).
    shard_offer: tuple[str, int] | None = None
    sharded: bool = False
    sharded_next: bool = False
    round_sharded: bool = False
    # The schema of its lane 0 of the round in progress (lanes): until the cluster agreed on
    # it, its later lanes wait for that lane 0 to be folded for good (``_Controller._lane_0_holds``).
    lane0_schema: Schema | None = None
    # Whether it sent a record other than a ShardOffer: a Resume must come before any
    # (docs/wire.md, "Resuming"); one later would be answered mid-round.
    spoke: bool = False
    # A whole relay's own receive buffer, in deterministic mode only: its frame waits in
    # it lane by lane for its turn, leaving the shared pool to the relays before it.
    own: ReceiveBuffer | None = None

    @classmethod
    def accept(cls, hello: Hello, conn: MessageStream, depth: int) -> RelayLink:
        outbox, inbox = trio.open_memory_channel[Outgoing](depth)
        link = cls(hello.host, hello.ranks, conn, outbox, inbox, hello.model_sigs,
                   takes_extensions=hello.takes_extensions)
        conn.peer = link.name
        return link

    def expel(self, why: str) -> None:
        """Drop this relay from another task: its session ends, and logs ``why``."""
        if self.dropped_for is None:
            self.dropped_for = why
        self.scope.cancel()

    @property
    def name(self) -> str:
        return f"relay {self.host} (ranks {list(self.ranks)})"

    def queue(
        self,
        record: EncodedFrame,
        *,
        before_write: Callable[[], None] | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> None:
        """Queue a record without waiting; a relay too far behind to take it is cut off.

        ``before_write`` runs just before the record's first byte goes out;
        ``on_written`` once it has been written whole (never if the link fails
        first). A link already closed takes nothing: its relay is gone.
        """
        try:
            self.outbox.send_nowait((record, before_write, on_written))
        except trio.WouldBlock:
            self.scope.cancel()  # its ranks are declared dead as the session ends
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def queue_control(self, msg: RelayControlMsg, salt: SessionSalt) -> None:
        self.queue(encode_mux_record(MuxKind.CONTROL, encode_control_msg(msg), salt))

    async def close_and_declare_dead(self, dead: DeadRanks, why: str, log: logging.Logger) -> list[int]:
        """Close this link and declare its ranks dead (idempotent); returns the ranks newly dead."""
        if self.closed:
            return []
        self.closed = True
        self.scope.cancel()
        await self.conn.aclose()
        newly = [rank for rank in self.ranks if dead.declare_dead(rank)]
        for rank in newly:
            log.info("rank %d dead: %s %s", rank, self.name, why)
        return newly

    async def drain_outbox(
        self, on_write_failure: Callable[[str], Awaitable[None]], on_written_bytes: Callable[[int], None] = lambda n: None
    ) -> None:
        """Be this link's sole writer until cancelled; report each record's size as it goes out."""
        async with self.inbox:
            async for record, before_write, on_written in self.inbox:
                if before_write is not None:
                    before_write()
                try:
                    await self.conn.send_chunks(record.chunks)
                except CONNECTION_LOST as exc:
                    await on_write_failure(f"write failed: {exc}")
                    return
                on_written_bytes(record.nbytes)
                del record  # a written consensus must not stay alive while we wait for the next
                if on_written is not None:
                    on_written()
