"""The coordinator: liveness and membership over the control channel.

A rank that crashes closes its sockets and its relay reports it at once. A
rank that *freezes* (SIGSTOP, a deadlocked GIL, a stuck CUDA call) keeps them
open, and rounds have no deadline - so every rank heartbeats through its
host's control relay, and a rank silent for ``heartbeat_timeout`` is declared
dead in the shared :class:`DeadRanks`. The data plane turns that into a
DeclareDead, the rank's relay folds without it, and the round completes.

The coordinator also beacons every live rank, so a rank can tell a dead
coordinator from a quiet one, and checks at formation that every rank trains
the same model (32-byte model signatures in the control Hello).

It is served on the controller's port behind the control channel magic.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Awaitable, Callable

import trio

from ..errors import ConfigError, FlodlError, HandshakeError, ProtocolError
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.hello import receive_hello
from ..transport.refusals import Refusals
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..wire.constants import CONTROL_FRAME_HEADER_LEN, CONTROL_FRAME_MAX_PAYLOAD
from ..wire.control_frame import (
    ControlFrame,
    decode_control_frame,
    encode_control_frame,
)
from ..wire.liveness import (
    Heartbeat,
    beacon_frame,
    decode_liveness,
    notice_frame,
    run_over_frame,
    timeout_ms,
)
from ..wire.mux import (
    DeclareDead,
    Hello,
    HelloAck,
    MuxKind,
    Outage,
    RankExit,
    decode_control_msg,
    encode_mux_record,
)
from ..wire.salt import SessionSalt
from .dead_ranks import DeadRanks
from .links import AfterAllWrites, RelayLink
from .seats import check_hello_ranks

log = logging.getLogger("flodl_trio.coordinator")

# A control-channel Data record carries one ControlFrame: its header and up to 16 MiB.
CONTROL_RECORD_CEILING = CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD
RUN_OVER_WRITE_S = 2.0  # how long the end of the run waits for its notices to be written


def _seconds(name: str, value: float) -> float:
    """A coordinator period: a finite number of seconds > 0 (ConfigError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"coordinator {name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class Coordinator:
    """Tracks one heartbeat per rank; declares silent ranks dead; beacons the living."""

    def __init__(
        self,
        world_size: int,
        salt: SessionSalt,
        dead: DeadRanks,
        *,
        heartbeat_timeout: float | None = None,
        beacon_interval: float | None = None,
        bounds: NetBounds | None = None,
    ) -> None:
        self.world_size = world_size
        self.salt = salt
        self.dead = dead
        self.bounds = bounds if bounds is not None else NetBounds()
        self.heartbeat_timeout = _seconds(
            "heartbeat_timeout", heartbeat_timeout if heartbeat_timeout is not None else self.bounds.heartbeat_timeout
        )
        self.beacon_interval = _seconds(
            "beacon_interval", beacon_interval if beacon_interval is not None else self.heartbeat_timeout / 4
        )
        self.links: dict[int, RelayLink] = {}
        self.owner: dict[int, RelayLink] = {}
        self.last_seen: dict[int, float] = {}
        self.reference_sig: tuple[bytes, int, str] | None = None
        self.rejections = Refusals()
        # Also told of each refusal (the controller records it with its own: one
        # handle.rejections for every connection refused on its port).
        self.on_refuse: Callable[[str, BaseException | None], None] = lambda message, exc: None
        self.death_reasons: dict[int, str] = {}
        self._beacon_seq = 0
        self._noticed: set[int] = set()
        # The last heartbeat sequence number accepted per rank, this connection epoch:
        # a heartbeat must carry a higher one (a replayed copy keeps nobody alive).
        self.last_seq: dict[int, int] = {}
        # Control frames from ranks that were not a heartbeat the coordinator accepted,
        # by why: they are ignored (docs/liveness.md), counted, and logged once per rank.
        self.ignored: dict[str, int] = {}
        self._ignored_logged: set[tuple[int, str]] = set()
        # Whether a dead rank may still come back (the controller's membership says).
        self.may_return: Callable[[int], bool] = lambda rank: False
        # What this controller tells relays and ranks to hold for it if it is lost (ms; 0: nothing).
        self.outage_ms = 0
        # Hosts whose data relay takes flodl_trio's control messages: their control relay
        # is told the outage bound too (a control Hello's signatures are the ranks').
        self._extension_hosts: set[str] = set()
        self._told_outage: set[int] = set()  # control links sent Outage
        # Ranks that said they finished their training: dead to the rounds, but nobody
        # cut them off, so their control connection is left to them (or to the run's end).
        self.finished: set[int] = set()

    def host_takes_extensions(self, host: str) -> None:
        """The data relay of ``host`` said it takes flodl_trio's control messages: so does
        its control relay (the same daemon), now or when it connects."""
        self._extension_hosts.add(host)
        for link in self.links.values():
            if link.host == host and not link.closed:
                self._tell_outage(link)

    def _tell_outage(self, link: RelayLink) -> None:
        """How long to hold for this controller if it is lost, once per control link (only
        a controller that keeps a resume record says it)."""
        if self.outage_ms > 0 and link.id not in self._told_outage:
            self._told_outage.add(link.id)
            link.queue_control(Outage(self.outage_ms), self.salt)

    def expect(self, ranks: list[int], now: float) -> None:
        """Start the heartbeat clock of ``ranks`` now (a resumed run's live ranks): one
        that never beats again is declared dead a heartbeat timeout from now."""
        for rank in ranks:
            self.last_seen.setdefault(rank, now)

    # -- service tasks (run in the controller's nursery) ---------------------

    async def run(self) -> None:
        """Watchdog, beacons and death notices, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watchdog)
            nursery.start_soon(self._beacons)
            nursery.start_soon(self.dead.watch, self._notice_new_deaths)

    async def _watchdog(self) -> None:
        period = max(self.heartbeat_timeout / 8, 0.02)
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for rank, seen in list(self.last_seen.items()):
                silent = now - seen
                if silent > self.heartbeat_timeout and not self.dead.is_dead(rank):
                    self.death_reasons[rank] = f"no heartbeat for {silent:.1f} s (heartbeat_timeout {self.heartbeat_timeout:.1f} s)"
                    log.warning("coordinator: rank %d declared dead: %s", rank, self.death_reasons[rank])
                    self.dead.declare_dead(rank)

    async def _beacons(self) -> None:
        while True:
            frame = self._next_beacon()
            for rank, link in list(self.owner.items()):
                if not link.closed and self._beaconed(rank, link):
                    self._send_frame(link, rank, frame)
            await trio.sleep(self.beacon_interval)

    def _next_beacon(self) -> ControlFrame:
        self._beacon_seq += 1
        return beacon_frame(self._beacon_seq, self.world_size, self.dead.dead_count(), timeout_ms(self.heartbeat_timeout),
                            self.outage_ms)

    def _beaconed(self, rank: int, link: RelayLink) -> bool:
        """Whether ``rank`` gets beacons: every live rank; and, through a flodl_trio control
        relay, a rank whose control block may still be open while it is out of the rounds -
        one that said it finished (saving its model, say, until the run ends) and a dead
        rank that may come back (a returning rank waits for a window boundary, however long
        the window). Neither may take the coordinator's quiet for its loss. A relay drops
        a beacon for a rank it has no connection for."""
        if not self.dead.is_dead(rank):
            return True
        return link.host in self._extension_hosts and (rank in self.finished or self.may_return(rank))

    def _notice_new_deaths(self) -> None:
        """Tell each newly dead rank why, then have its control relay close it; take a
        rank that rejoined back (its heartbeat clock and sequence start again)."""
        dead = self.dead.snapshot()
        for rank in sorted(self._noticed - dead):
            self._noticed.discard(rank)
            self.death_reasons.pop(rank, None)
            if rank in self.owner:
                self.last_seen[rank] = trio.current_time()  # a new grace period
                self.last_seq[rank] = 0  # a new connection epoch
        for rank in sorted(dead - self._noticed):
            link = self.owner.get(rank)
            if link is None:
                continue  # noticed once its relay joins (see _accept)
            self._noticed.add(rank)
            self.last_seen.pop(rank, None)
            if link.closed or rank in self.finished:
                continue
            reason = self.death_reasons.get(rank, "declared dead by the cluster")
            self._send_frame(link, rank, notice_frame(f"rank {rank} was declared dead: {reason}"))
            link.queue_control(DeclareDead(rank), self.salt)

    async def say_run_over(self) -> None:
        """The run is over (every rank finished or exited): tell every rank whose control
        connection may still be open, so that the connections closing next end their
        blocks quietly instead of as a lost coordinator; wait (bounded) until it is written."""
        links = [link for link in self.links.values() if not link.closed]
        count = sum(len(link.ranks) for link in links)
        if count == 0:
            return
        written = trio.Event()
        done = AfterAllWrites(count, written.set)
        for link in links:
            for rank in link.ranks:
                self._send_frame(link, rank, run_over_frame(), on_written=done.one)
        with trio.move_on_after(RUN_OVER_WRITE_S):  # a relay that cannot take a few bytes by then is gone
            await written.wait()

    def _send_frame(
        self, link: RelayLink, rank: int, frame: ControlFrame, *, on_written: Callable[[], None] | None = None
    ) -> None:
        record = encode_mux_record(MuxKind.DATA, encode_control_frame(frame, self.salt), self.salt, rank=rank)
        link.queue(record, on_written=on_written)

    # -- control relay sessions ----------------------------------------------

    async def serve_connection(self, conn: MessageStream) -> None:
        """One control relay connection, from its Hello to its end (then its ranks are
        dead; not when the controller is stopping, which cancels this)."""
        link = await self._accept(conn)
        if link is None:
            return
        with link.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.drain_outbox, self._writer_failed(link))
                try:
                    await self._read_link(link)
                except CONNECTION_LOST:
                    pass
                except FlodlError as exc:
                    log.error("coordinator: %s: %s; its ranks are dead", link.name, exc)
                nursery.cancel_scope.cancel()
        await self._drop(link, "control connection closed")

    def _writer_failed(self, link: RelayLink) -> Callable[[str], Awaitable[None]]:
        async def failed(why: str) -> None:
            await self._drop(link, why)

        return failed

    async def _accept(self, conn: MessageStream) -> RelayLink | None:
        try:
            hello = await receive_hello(conn, self.salt, self.bounds)
            carried = {rank: link.name for rank, link in self.owner.items() if not link.closed}
            check_hello_ranks(hello, self.world_size, carried)
            if len(hello.model_sigs) != len(hello.ranks):
                raise HandshakeError(
                    f"control Hello from host {hello.host!r} carries {len(hello.model_sigs)} model signatures "
                    f"for {len(hello.ranks)} ranks"
                )
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            reason = "no Hello within the handshake deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"control relay {conn.peer} refused: {reason}", exc)
            await conn.aclose()
            return None
        link = RelayLink.accept(hello, conn, 4 * len(hello.ranks) + 16)
        link.queue_control(HelloAck(), self.salt)
        if hello.host in self._extension_hosts:
            self._tell_outage(link)
        mismatch = self._signature_mismatch(hello)
        if mismatch is not None:
            await self._refuse_ranks(link, mismatch)
            return None
        self.links[link.id] = link
        now = trio.current_time()
        for rank in link.ranks:
            self.owner[rank] = link
            self.last_seen[rank] = now  # the grace period starts at formation
            self.last_seq[rank] = 0  # a new connection epoch: sequence numbers start again
            if self.dead.is_dead(rank) and self.may_return(rank):
                self._noticed.add(rank)  # away, not evicted: it may connect here and come back
        self._notice_new_deaths()  # ranks of this relay dead already get their notice now
        beacon = self._next_beacon()  # at once: each rank learns the coordinator's pace before it waits on it
        for rank in link.ranks:
            if self._beaconed(rank, link):
                self._send_frame(link, rank, beacon)
        log.info("coordinator: accepted %s", link.name)
        return link

    def _signature_mismatch(self, hello: Hello) -> str | None:
        """Every rank must train the same model; the first accepted relay sets the reference."""
        reference = self.reference_sig or (hello.model_sigs[0], hello.ranks[0], hello.host)
        ref_sig, ref_rank, ref_host = reference
        for rank, sig in zip(hello.ranks, hello.model_sigs):
            if sig != ref_sig:
                return (
                    f"model signature mismatch: rank {rank} on host {hello.host} has {sig.hex()[:16]}..., "
                    f"rank {ref_rank} on host {ref_host} has {ref_sig.hex()[:16]}... (different models or dtypes)"
                )
        self.reference_sig = reference
        return None

    async def _refuse_ranks(self, link: RelayLink, reason: str) -> None:
        """Refuse a relay whose ranks cannot join: tell each rank why, then close.

        Its ranks are declared dead so the data plane does not wait for them.
        """
        self._refuse(f"{link.name} refused: {reason}")
        for rank in link.ranks:
            self._send_frame(link, rank, notice_frame(f"rank {rank} refused: {reason}"))
        link.outbox.close()
        with trio.move_on_after(self.beacon_interval + 1.0):
            await link.drain_outbox(self._writer_failed(link))
            await link.conn.finish_gracefully()
        await link.conn.aclose()
        for rank in link.ranks:
            self.dead.declare_dead(rank)

    def _refuse(self, message: str, exc: BaseException | None = None) -> None:
        log.warning("coordinator: %s", message)
        self.rejections.add(message)
        self.on_refuse(message, exc)

    async def _read_link(self, link: RelayLink) -> None:
        while True:
            header = await link.conn.receive_mux_header(CONTROL_RECORD_CEILING)
            if header is None:
                return
            # Small records reuse the link's buffer; a rare large one gets one of its own,
            # freed once read, so no link keeps megabytes between messages.
            buf = link.small if header.length <= SMALL_MESSAGE else ReceiveBuffer()
            kind, payload = await link.conn.receive_mux_payload(header, buf, self.salt)
            if kind is MuxKind.DATA:
                self._on_rank_frame(link, header.rank, payload)
            elif kind is MuxKind.CONTROL:
                msg = decode_control_msg(payload)
                if not isinstance(msg, RankExit) or msg.rank not in link.ranks:
                    raise ProtocolError(f"unexpected {msg} on the control channel")
                self.death_reasons.setdefault(msg.rank, "its control connection closed")
                self.dead.declare_dead(msg.rank)
            else:
                raise ProtocolError(f"unexpected {kind.name} record on the control channel")

    def _on_rank_frame(self, link: RelayLink, rank: int, payload: memoryview) -> None:
        """A rank's control frame. Only a valid, fresh heartbeat from that rank counts;
        anything else is the rank's own business (or garbage) and is ignored - never
        a reason to drop its relay, whose other ranks are innocent."""
        if rank not in link.ranks:
            raise ProtocolError(f"Data record for rank {rank}, which this relay does not carry")
        try:
            message = decode_liveness(decode_control_frame(payload, self.salt, source=f"rank {rank}"))
        except ProtocolError as exc:
            return self._ignore(rank, "malformed or unauthenticated", str(exc))
        if not isinstance(message, Heartbeat):
            return self._ignore(rank, "not a heartbeat", f"{len(payload)} bytes of other control traffic")
        if message.rank != rank:
            return self._ignore(rank, "heartbeat for another rank", f"carries rank {message.rank}")
        if self.dead.is_dead(rank):
            return  # a dead rank's heartbeats (one coming back, before it is let in) count for nothing
        if message.seq <= self.last_seq.get(rank, 0):
            return self._ignore(rank, "replayed heartbeat", f"sequence {message.seq} after {self.last_seq.get(rank, 0)}")
        self.last_seq[rank] = message.seq
        self.last_seen[rank] = trio.current_time()

    def _ignore(self, rank: int, why: str, detail: str) -> None:
        self.ignored[why] = self.ignored.get(why, 0) + 1
        if (rank, why) not in self._ignored_logged:
            self._ignored_logged.add((rank, why))
            log.warning("coordinator: ignored a control frame from rank %d (%s: %s); further ones are counted only",
                        rank, why, detail)

    async def _drop(self, link: RelayLink, why: str) -> None:
        if not link.closed:
            for rank in link.ranks:
                self.death_reasons.setdefault(rank, f"{link.name}: {why}")
        await link.close_and_declare_dead(self.dead, why, log)
