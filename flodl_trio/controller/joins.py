"""Ranks coming back: the join exchange on the controller's side (docs/wire.md,
"The join exchange"; docs/liveness.md, "Membership").

A return has two halves - the relay's ``RankJoin`` (the rank reconnected its
data connection) and the rank's verified state request - and :class:`Returns`
pairs them: the newest finished window's state goes out while the rank is in
no barrier, its receipt makes it *primed*, and at the next window boundary
its relay is told ``RankJoin`` and the rank its entry. Anything that goes
wrong on the way (a stalled write, a connection that closes, a relay that
leaves) calls that one return off and costs nobody else. Membership's states
live in :class:`~.membership.Membership`; this module moves the bytes and
keeps each return's exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import trio

from ..errors import MacError, ProtocolError
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal, nothing
from ..wire.mux import DeclareDead, RankJoin
from ..wire.salt import Buffer
from ..wire.state import (
    STATE_ANSWER_LEN,
    STATE_RECEIPT_LEN,
    STATE_REQUEST_LEN,
    EntryStatus,
    JoinNonces,
    StateEntry,
    StateReply,
    StateRequest,
    StateStatus,
    check_state_answer,
    check_state_receipt,
    decode_state_request,
    encode_state_challenge,
    encode_state_entry,
    encode_state_reply,
    new_nonce,
)
from .config import ControllerConfig
from .dead_ranks import DeadRanks
from .links import RelayLink
from .membership import Membership
from .round import WindowState, WindowStore
from .stats import ControllerStats
from .windows import Windows

def _now(call: Callable[[], None]) -> None:
    call()


def _call_each(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


log = logging.getLogger("flodl_trio.controller")


@attrs.define(eq=False)
class Joiner:
    """A dead rank's verified state request, from its answer to its entry: its state
    goes out once both halves of the return are in (``state_due``), and it enters
    at a boundary once it has it (``decided``), unless the return is called off."""

    nonces: JoinNonces
    state_due: trio.Event = attrs.field(factory=trio.Event)
    decided: trio.Event = attrs.field(factory=trio.Event)
    state: WindowState | None = None
    entry: int | None = None  # the first window it runs in its host's barrier
    refusal: str | None = None
    fresh_from: int = -1  # the oldest window whose state it may be sent

    def send_state(self, state: WindowState | None) -> None:
        self.state = state
        self.state_due.set()

    def enter(self, window: int) -> None:
        self.entry = window
        self.decided.set()

    def refuse(self, reason: str) -> None:
        if self.entry is None:
            self.refusal = reason
            self.state_due.set()
            self.decided.set()


async def _cancel_on_eof(conn: MessageStream, scope: trio.CancelScope) -> None:
    """A waiting state request has nothing more to say: any byte, or the end, ends the wait."""
    try:
        await conn.stream.receive_some(1)
    except CONNECTION_LOST:
        pass
    scope.cancel()


async def _wait_unless_peer_leaves(
    conn: MessageStream, event: trio.Event, meanwhile: Callable[[], Awaitable[None]] | None = None
) -> bool:
    """Wait for ``event``; False if the peer closed (or spoke out of turn) first.
    ``meanwhile`` runs beside the wait (and is cancelled with it)."""
    with trio.CancelScope() as waiting:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_eof, conn, waiting)
            if meanwhile is not None:
                nursery.start_soon(meanwhile)
            await event.wait()
            nursery.cancel_scope.cancel()
    return not waiting.cancelled_caught


@attrs.define(eq=False)
class Returns:
    """Every return in progress, keyed by rank: the controller routes state
    connections and relays' ``RankJoin`` here, and calls :meth:`at_boundary`
    when a window's state has been kept."""

    config: ControllerConfig
    membership: Membership
    changed: ChangeSignal  # membership changed (formation and the finish watch wait on it)
    dead: DeadRanks
    stats: ControllerStats
    window_store: WindowStore
    windows: Windows  # whoever counts the windows (:mod:`.windows`)
    links: dict[int, RelayLink]
    refused: Callable[[str], None]  # log and count a refused connection
    revive: Callable[[int], None]  # the rank is live again: the controller forgets its death
    joiners: dict[int, Joiner] = attrs.field(factory=dict)  # rank -> its verified state request
    asks: dict[int, int] = attrs.field(factory=dict)  # rank -> how many times its relay asked it back (names each ask)
    nursery: trio.Nursery | None = None  # where the handshake-bound watches run
    # With shards the kept state is of the last window the controller got whole, maybe
    # long ago: a joiner waits for one that ended after it asked.
    kept_state_may_be_old: bool = False

    def needs_whole_rounds(self) -> bool:
        """Whether rounds must come whole to the controller (with shards): a return is in
        progress, from its state request to its entry."""
        return bool(self.joiners)

    def at_boundary(self) -> Callable[[], None]:
        """A window just finished (its state is kept): returns that have their state
        enter the next window (live from now on; they and their relays are told when
        the returned function is called: after the round is recorded, so no relay
        hears of a return a controller started again would not know); those waiting
        for a first finished window get this one."""
        latest = self.window_store.latest
        if latest is None:
            return nothing
        told: list[Callable[[], None]] = []
        self._let_joiners_in(latest.window + 1, told.append)
        self._send_states_due()
        return partial(_call_each, told)

    async def serve(self, conn: MessageStream, magic: bytes) -> None:
        """A rank asks (through its relay) for the state to start from: at once for a
        fresh start or a refusal, at the next window boundary for a return. Nothing
        is sent to a request that does not verify; the frames go out from the
        memory they were kept in, so joiners cost no copy."""
        try:
            request = await self._read_request(conn, magic)
            if request is not None:
                await self._answer_request(conn, request)
        except CONNECTION_LOST as exc:
            log.info("controller: a state request's connection closed: %s", exc)
        finally:
            await conn.aclose()

    async def _read_request(self, conn: MessageStream, magic: bytes) -> StateRequest | None:
        try:
            with trio.fail_after(self.config.bounds.handshake):
                rest = await conn.receive_exactly(STATE_REQUEST_LEN - 4, "the state request")
            return decode_state_request(magic + rest, self.config.world_size, self.config.salt)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            self._refuse_request(conn, exc, "no complete request within the handshake deadline")
            return None

    def _refuse_request(self, conn: MessageStream, exc: BaseException, too_slow: str) -> None:
        """A state request that failed a check or a bound: logged and counted, no byte back."""
        if isinstance(exc, MacError):
            self.stats.mac_failures += 1
        reason = too_slow if isinstance(exc, trio.TooSlowError) else str(exc)
        self.refused(f"state request from {conn.peer} refused: {reason}")

    async def _answer_request(self, conn: MessageStream, request: StateRequest) -> None:
        """Challenge a verified request; once answered, the rank is present: a fresh
        start or a refusal is said at once, and a dead rank's return goes on."""
        rank = request.rank
        conn.peer = f"rank {rank} (state request)"
        nonces = await self._challenge(conn, request)
        if nonces is None:
            return
        self.membership.joined(rank)
        self.changed.notify()  # one more rank present (formation counts them)
        if self.membership.rejoin_timeout > 0:
            self.windows.keep_window_state = True  # an elastic rank: keep each window's state from now on
        dead = self.dead.is_dead(rank)
        if not dead and self.windows.windows == 0:
            return await conn.send_chunks([encode_state_reply(StateReply(StateStatus.OK), nonces, self.config.salt)])
        refusal = self.membership.refusal(rank, trio.current_time(), dead=dead)
        if refusal is None and rank in self.joiners:
            refusal = f"rank {rank} already has a state request waiting"
        if refusal is not None:
            self.stats.rejoins_refused += 1
            log.warning("controller: rank %d may not rejoin: %s", rank, refusal)
            return await conn.send_chunks([encode_state_reply(StateReply.refused(refusal), nonces, self.config.salt)])
        fresh_from = self.windows.windows - 1 if self.kept_state_may_be_old else -1
        await self._serve_return(conn, rank, Joiner(nonces, fresh_from=fresh_from))

    async def _challenge(self, conn: MessageStream, request: StateRequest) -> JoinNonces | None:
        """The controller's fresh nonce out, the rank's answer in: a replayed request
        (a peer without the salt) cannot answer, and gets nothing more."""
        nonces = JoinNonces(request.nonce, new_nonce())
        try:
            await conn.send_chunks([encode_state_challenge(nonces, self.config.salt)])
            with trio.fail_after(self.config.bounds.handshake):
                answer = await conn.receive_exactly(STATE_ANSWER_LEN, "the state answer")
            check_state_answer(answer, request.rank, nonces, self.config.salt)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            self._refuse_request(conn, exc, "no answer to its challenge within the handshake deadline")
            return None
        return nonces

    async def _serve_return(self, conn: MessageStream, rank: int, joiner: Joiner) -> None:
        """A dead rank coming back: its state once both halves are in, its receipt,
        then its entry at the next boundary. Until the receipt it is in no barrier,
        so a joiner that reads slowly or not at all costs only itself."""
        self.joiners[rank] = joiner
        self.membership.wait_for_state(rank)
        self._send_states_due()
        salt = self.config.salt
        try:
            if not await _wait_unless_peer_leaves(conn, joiner.state_due, self._enter_once_nobody_is_live):
                return log.info("controller: rank %d left while it waited to rejoin", rank)
            if joiner.refusal is not None:
                return await conn.send_chunks([encode_state_reply(StateReply.refused(joiner.refusal), joiner.nonces, salt)])
            if joiner.state is not None:
                await self._send_state(conn, rank, joiner)
            self.membership.prime(rank)
            self._let_joiners_in_if_nobody_is_live()
            self.changed.notify()
            if joiner.state is None:  # nothing was sent, so the rank is in already (a fresh start)
                return
            if not await _wait_unless_peer_leaves(conn, joiner.decided, self._enter_once_nobody_is_live):
                return log.info("controller: rank %d left while it waited for its window", rank)
            await self._send_entry(conn, joiner)
        except (ProtocolError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            reason = "its receipt did not come in time" if isinstance(exc, trio.TooSlowError) else str(exc)
            self.refuse(rank, self.links.get(self.membership.asked.get(rank, -1)), f"its state transfer failed: {reason}")
        finally:
            del self.joiners[rank]
            if joiner.entry is None:
                self.membership.withdraw(rank)
                self.changed.notify()

    async def _send_entry(self, conn: MessageStream, joiner: Joiner) -> None:
        """Where the rank enters; in a delta run that finished windows since its state,
        with their params consensus as the ranks got it (docs/wire.md, "Delta rounds"):
        the state alone is an older base than its host's."""
        salt = self.config.salt
        assert joiner.state is not None
        if joiner.entry is None:
            return await conn.send_chunks([encode_state_entry(StateEntry.called_off(), joiner.nonces, salt)])
        # Checked before it was let in (None: it was refused, not let in).
        catch_up = self.window_store.catch_up_between(joiner.state.window, joiner.entry) or []
        status = EntryStatus.CATCH_UP if catch_up else EntryStatus.ENTERED
        chunks: list[Buffer] = [encode_state_entry(StateEntry(status, joiner.entry), joiner.nonces, salt)]
        for frame in catch_up:
            chunks += [frame.nbytes.to_bytes(4, "little"), *frame.chunks]
        await conn.send_chunks(chunks)

    async def _send_state(self, conn: MessageStream, rank: int, joiner: Joiner) -> None:
        """The reply and its frames (from the memory they were kept in: no copy), then
        the rank's receipt; the write and the receipt are bounded by the write-stall bound."""
        state = joiner.state
        assert state is not None
        frames = state.frames
        reply = StateReply(StateStatus.OK, state.window, len(frames), lengths=tuple(f.nbytes for f in frames))
        chunks: list[Buffer] = [encode_state_reply(reply, joiner.nonces, self.config.salt)]
        for frame in frames:
            chunks += [frame.nbytes.to_bytes(4, "little"), *frame.chunks]
        await conn.send_chunks(chunks)
        with trio.fail_after(self.config.bounds.write_stall):
            receipt = await conn.receive_exactly(STATE_RECEIPT_LEN, "the state receipt")
        check_state_receipt(receipt, rank, joiner.nonces, self.config.salt)
        self.stats.states_served += 1
        log.info("controller: rank %d has the consensus of window %d; it enters at the next boundary", rank, state.window)

    def relay_asks(self, link: RelayLink, rank: int) -> None:
        """A rank that had left reconnected to its relay: say no now, or send it its
        state once its verified state request is in too (it must come within the
        handshake bound: a connection that only replays a rank's handshake holds
        the rank's seat no longer than that)."""
        refusal = self.membership.refusal(rank, trio.current_time(), dead=self.dead.is_dead(rank))
        if refusal is not None:
            return self.refuse(rank, link, refusal)
        self.membership.ask(rank, link.id)
        ask = self.asks[rank] = self.asks.get(rank, 0) + 1
        log.info("controller: rank %d asks to rejoin (%s); its state goes out once it asks for it", rank, link.name)
        if self.nursery is not None and rank not in self.membership.waiting:
            self.nursery.start_soon(self._expect_request, rank, ask, link)
        self._send_states_due()

    async def _expect_request(self, rank: int, ask: int, link: RelayLink) -> None:
        """Call a return off whose rank sends no verified state request in time."""
        bound = self.config.bounds.handshake
        await trio.sleep(bound)
        if self.asks.get(rank) == ask and rank in self.membership.asked and rank not in self.membership.waiting:
            self.refuse(rank, link, f"it reconnected to {link.name} but sent no verified state request "
                                            f"within {bound:g} s (join() comes right after connecting)")

    def refuse(self, rank: int, link: RelayLink | None, reason: str) -> None:
        """Say no to a return: its relay drops the connection; a waiting state request
        is answered with the reason (and counted, like every refused state request)."""
        log.warning("controller: rank %d may not rejoin: %s", rank, reason)
        if link is not None:
            link.queue_control(DeclareDead(rank), self.config.salt)
        if rank in self.joiners:
            self.stats.rejoins_refused += 1
        self.call_off(rank, reason)

    def call_off(self, rank: int, reason: str) -> None:
        """A return cannot go on: forget both halves; a waiting state request is refused."""
        self.membership.withdraw(rank)
        joiner = self.joiners.get(rank)
        if joiner is not None:
            joiner.refuse(reason)

    def _tell_entry(self, link: RelayLink, rank: int, joiner: Joiner, window: int) -> None:
        """The relay lets the rank into its host's fold; the rank hears which window it enters."""
        link.queue_control(RankJoin(rank), self.config.salt)
        joiner.enter(window)

    def _send_states_due(self) -> None:
        """Each return whose both halves are in gets the newest finished window now,
        while it is in no barrier (the others train on); one whose cluster has no
        finished window yet waits for the first."""
        state = self.window_store.latest
        for rank, _seat in self.membership.ready():
            joiner = self.joiners.get(rank)
            if (joiner is not None and not joiner.state_due.is_set() and state is not None
                    and state.window >= joiner.fresh_from):
                joiner.send_state(state)
        self._let_joiners_in_if_nobody_is_live()

    def _let_joiners_in_if_nobody_is_live(self) -> None:
        """With every rank dead no window will end, so now is a boundary: the cluster
        starts again from the last finished window (a window cut short by the deaths
        is abandoned), with whoever has come back and has its state (with no
        finished window, whoever has come back: there is nothing to send)."""
        if self.dead.dead_count() < self.config.world_size:
            return
        if self.window_store.end_unnamed_window():  # the run's first window, say: it did finish
            return self._send_states_due()  # (which comes back here, with that window's state)
        state = self.window_store.latest
        if self.kept_state_may_be_old and self.window_store.ended > (-1 if state is None else state.window):
            return self._refuse_every_return(
                f"every rank died, and this controller reduces with shards: it holds the consensus of window "
                f"{self.window_store.ended}, the last to finish, only in part (the shards hold its lanes), so the "
                "run cannot restart from it here; restart the job from its checkpoints"
            )
        if state is None:
            for rank, _seat in self.membership.ready():
                joiner = self.joiners.get(rank)
                if joiner is not None and not joiner.state_due.is_set():
                    joiner.send_state(None)
                    self.membership.prime(rank)
        if not self.membership.entering():
            return
        next_window = 0 if state is None else state.window + 1
        if state is None:  # (the returns start from their own params: a delta run's lineages anew)
            self.windows.lineages.forget()
        self.windows.restart_windows_at(next_window)
        self.window_store.abandon_window()
        log.info("controller: every rank is dead; restarting at window %d with those who came back", next_window)
        self._let_joiners_in(next_window)

    async def _enter_once_nobody_is_live(self) -> None:
        """Beside a return's waits (for its state, for its boundary): the last live ranks
        may die or finish without ending another window (between their last window
        and leaving), and then none will end. Each membership change checks for that,
        once the controller has noted every death (so a round the last death ends
        is done with first), and the return goes on now."""
        while True:
            await self.changed.wait()
            if self.dead.snapshot() <= self.membership.died_at.keys():
                self._let_joiners_in_if_nobody_is_live()

    def _refuse_every_return(self, reason: str) -> None:
        for rank in sorted(set(self.joiners) | {rank for rank, _seat in self.membership.entering()}):
            self.refuse(rank, self.links.get(self.membership.asked.get(rank, -1)), reason)

    def _let_joiners_in(self, window: int, tell: Callable[[Callable[[], None]], None] = _now) -> None:
        """A window boundary: every return that has its state becomes live, and its
        relay hears so before the window's last consensus (it enters the next round,
        the start of ``window``); the rank is told it enters ``window``. ``tell``:
        hold the telling (relay and rank) for the caller to do (default: now)."""
        now = trio.current_time()
        for rank, seat in self.membership.entering():
            link = self.links.get(seat)
            refusal = self.membership.refusal(rank, now, dead=self.dead.is_dead(rank))
            if link is None or link.closed or refusal is not None:
                self.refuse(rank, None, refusal or "its relay left before it could be let in")
                continue
            joiner = self.joiners[rank]
            loaded = -1 if joiner.state is None else joiner.state.window
            catch_up = self.window_store.catch_up_between(loaded, window)
            if catch_up is None:
                self.refuse(rank, link, f"it is more than {self.window_store.catch_up_limit} windows behind "
                                        "in a delta run (it may ask again)")
                continue
            self.membership.rejoined(rank)
            self.revive(rank)
            self.stats.rejoins, self.stats.late_joins = self.membership.rejoins, self.membership.late_joins
            tell(partial(self._tell_entry, link, rank, joiner, window))
            behind = ""
            if catch_up:
                behind = f" (the {len(catch_up)} delta consensus frame(s) since go with its entry)"
            elif loaded + 1 < window:
                behind = " (behind: its first window carries no work)"
            log.info("controller: rank %d rejoins (%s) with the consensus of window %d; it enters window %d%s",
                     rank, link.name, loaded, window, behind)
        self.changed.notify()


__all__ = ["Joiner", "Returns"]
