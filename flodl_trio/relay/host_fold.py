"""The host's round, free of I/O: which local ranks must deposit, who did, the f32
sum of their frames, and who is owed the consensus.

The data channel's tasks call into it (a frame verified, a rank gone, a
HostFrame written, a Broadcast arrived) and act on what it returns (a frame to
ship, the ranks to answer); it never awaits anything, so it can be tested and
read without trio.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import DesyncError, SchemaError
from ..fold.accumulator import FoldAccumulator, ImageCache
from ..fold.delta import HostDeltaUplink, PendingHostDelta, digest_of, is_delta_schema
from ..fold.schemas import AgreedSchemas, Schema, schema_of, why_taken_out
from ..transport.tasks import nothing
from ..wire.constants import MAC_LEN
from ..wire.fragment import fragment_of
from ..wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST
from ..wire.round_frame import FRAME_HEADER_LEN, RoundFrame, RoundKind, TensorPayload


@attrs.frozen
class FoldedHostFrame:
    """The host's fold, ready to sign and send; ``images`` (the fold's f32 sums, which
    its payloads may alias) go back to the fold's cache once it has been written."""

    frame: RoundFrame | PendingHostDelta  # a delta round's sums are coded as they go up
    images: list[Any]


_DIGEST_HEAD = struct.Struct("<BBIQ")  # the digest tensor's dtype, ndim, dim, byte count


class HostFold:
    """The host's fold barrier: every live local rank deposits, then one frame ships.

    A rank that deposited is owed the round's consensus; a second frame from
    it before that consensus arrived breaks the ping-pong (``DesyncError``).
    Frames that disagree on the round's schema cost the rank whose schema no
    completed round had (:mod:`flodl_trio.fold.schemas`): when that is the
    ranks already folded, their contributions are taken out and they are
    listed in :attr:`expelled` for the channel to drop.
    ``on_change`` is called whenever the set of frames the round waits for
    moves (a task speculating on the last frame waits for that).
    """

    def __init__(self, host: str, ranks: Sequence[int], *, on_change: Callable[[], None] = nothing) -> None:
        self.host = host
        self.ranks = frozenset(ranks)
        self.dead: set[int] = set()
        self.deposited: set[int] = set()
        self.awaiting_reply: set[int] = set()
        self.host_frame_up = False
        # Ranks that left and came back; they enter the barrier only at a window start.
        self.joining: set[int] = set()  # reconnected, not yet let back in by the controller
        self.entering: set[int] = set()  # let back in: enter with the round after the next consensus
        self.fresh: set[int] = set()  # entered, first frame not yet folded (it must be a Control frame)
        self.held: dict[int, RoundFrame] = {}  # a joiner's early first frame (a copy), until it enters
        self.images = ImageCache()
        self.acc = FoldAccumulator(self.images)
        self.agreed = AgreedSchemas()  # schemas of rounds whose consensus came back
        self._schema_up: Schema | None = None  # the schema of the HostFrame in flight
        self.expelled: dict[int, str] = {}  # ranks whose folded frames proved wrong: why, until dropped
        # Delta rounds (docs/wire.md): the host's sums re-encoded with error feedback, and
        # the base the last delta consensus gave every rank, per params set: the model
        # (None) or each fragment (its index), as the window's Control round names it.
        self.delta_uplink = HostDeltaUplink()
        self.base_digests: dict[int | None, bytes] = {}
        self.window_fragment: int | None = None
        self._delta_up = False  # the HostFrame in flight is a delta round's
        self._on_change = on_change

    @property
    def live(self) -> frozenset[int]:
        return self.ranks - self.dead

    @property
    def idle(self) -> bool:
        """No live rank and no round in flight: nothing will come down from the controller."""
        return not self.live and not self.host_frame_up

    def may_fold_now(self, rank: int) -> bool:
        """In rank order: whether ``rank``'s next frame may be folded now - it is the
        lowest rank the round still waits for, or not one the round waits for at
        all (a joiner's frame is held; a second frame in one round must reach
        :meth:`deposit` to be refused)."""
        pending = self.live - self.deposited - self.joining - self.entering
        return rank not in pending or rank == min(pending)

    def waiting_to_enter(self, rank: int) -> bool:
        """Whether ``rank`` came back and is not in the barrier yet (its frames are held)."""
        return rank in self.joining or rank in self.entering

    # -- frames in -----------------------------------------------------------

    def deposit(self, rank: int, frame: RoundFrame) -> FoldedHostFrame | None:
        """Fold one verified frame; the folded round when this deposit completes it.

        A joiner's frame that arrives before it entered the barrier is held
        until it does (see :meth:`enter_approved`).
        """
        if rank in self.entering and self.idle:
            # Nothing will come down to mark the window start: the first frame of a
            # rank let back in is it, for every rank let in with it.
            self._hold(rank, frame)
            return self.enter_approved()
        if rank in self.joining or rank in self.entering:
            self._hold(rank, frame)
            return None
        if rank in self.fresh:
            self.fresh.discard(rank)
            self._check_first_frame(rank, frame)
        if frame.kind == RoundKind.CONTROL:  # a window opens: its params round syncs this fragment
            tag = fragment_of(frame)
            self.window_fragment = None if tag is None else tag.index
        self._check_base(rank, frame)
        self._owe_reply(rank)
        try:
            self.acc.add(frame, f"rank {rank}")
        except SchemaError:  # nothing of the frame was added: see who is wrong
            if not self.agreed.folded_frames_at_fault(self.acc.schema, schema_of(frame)):
                raise
            self._take_out_folded(rank, frame)
            self.acc.add(frame, f"rank {rank}")
        self.deposited.add(rank)
        self._on_change()
        return self._take_if_complete()

    def _take_out_folded(self, rank: int, frame: RoundFrame) -> None:
        """``rank``'s frame has the schema the cluster completed rounds with; the ones
        folded before it have another: start the round's sum again without them."""
        folded = self.acc.schema
        assert folded is not None
        why = why_taken_out(folded, schema_of(frame), f"rank {rank}")
        for culprit in sorted(self.deposited):
            self.expelled[culprit] = f"relay {self.host}: rank {culprit}'s frame {why}"
            self.awaiting_reply.discard(culprit)
        self.images.give(self.acc.sums())
        self.acc = FoldAccumulator(self.images)
        self.deposited.clear()

    def take_expelled(self) -> dict[int, str]:
        """The ranks to drop (and why) since the last call."""
        expelled, self.expelled = self.expelled, {}
        return expelled

    # -- ranks that come back ----------------------------------------------------

    def rejoin(self, rank: int) -> None:
        """A rank that had left reconnected; it stays out of the barrier until it enters."""
        self.joining.add(rank)

    def approve(self, rank: int) -> bool:
        """The controller let ``rank`` back in, just before the consensus that ends a
        window: it enters the barrier with the round after that consensus. False if
        the rank is not waiting to be let in (it left again meanwhile)."""
        if rank not in self.joining:
            return False
        self.joining.discard(rank)
        self.entering.add(rank)
        return True

    def enter_approved(self) -> FoldedHostFrame | None:
        """A window's last consensus came down: approved joiners are in the barrier
        from the next round (the window start) on; one that sent its first frame
        early has it folded now."""
        entering, self.entering = sorted(self.entering), set()
        for rank in entering:  # all of them in the barrier first, then their early frames
            self.dead.discard(rank)
            self.fresh.add(rank)
        self._on_change()
        folded = None
        for rank in entering:
            frame = self.held.pop(rank, None)
            if frame is not None:
                folded = self.deposit(rank, frame) or folded
        return folded

    def _hold(self, rank: int, frame: RoundFrame) -> None:
        if rank in self.held:
            raise DesyncError(
                f"relay {self.host}: rank {rank} sent a second frame before the controller let it back in "
                "(a rank coming back waits for its state first: call join() before the first window)"
            )
        self._check_first_frame(rank, frame)
        # The frame's payloads live in a pooled receive buffer: keep a copy (a Control frame is small).
        self.held[rank] = RoundFrame(
            [TensorPayload(t.dtype, t.shape, bytes(t.data)) for t in frame.tensors], frame.kind, frame.weight
        )

    def _check_first_frame(self, rank: int, frame: RoundFrame) -> None:
        if frame.kind != RoundKind.CONTROL:
            raise SchemaError(
                f"relay {self.host}: rank {rank} comes back with a {frame.kind.name} frame; it enters at a "
                "window start, so its first frame must be a window's Control round (use average_window)"
            )

    def _check_base(self, rank: int, frame: RoundFrame) -> None:
        """A rank's delta must be against the base the last delta consensus gave the host:
        once it gave one, a lineage's first round (the zero digest) is against another
        (every rank holds the base; a joiner is given it), refused before it folds - folded
        first, its neighbours' deltas would be dropped as the odd schema out."""
        digest = digest_of(frame)
        known = self.base_digests.get(self.window_fragment)
        if digest is None or known is None or digest == known:
            return
        fragment = "" if self.window_fragment is None else f" of fragment {self.window_fragment}"
        raise SchemaError(
            f"relay {self.host}: rank {rank}'s delta{fragment} is against base {digest.hex()}, but the last consensus "
            f"gave this host {known.hex()} (it missed a consensus, or started from other params)"
        )

    @property
    def base_digest(self) -> bytes | None:
        """The base the last delta consensus of the window's params set gave every rank."""
        return self.base_digests.get(self.window_fragment)

    def learn_base(self, consensus: memoryview) -> None:
        """A verified consensus came down whole: if it answers a delta round, its last
        tensor is the base every rank now holds (checked by layout, not guessed)."""
        if not self._delta_up:
            return
        self._delta_up = False
        if len(consensus) < FRAME_HEADER_LEN + _DIGEST_HEAD.size + DIGEST_LEN + MAC_LEN:
            return
        tail = consensus[-(MAC_LEN + DIGEST_LEN + _DIGEST_HEAD.size):]
        head = _DIGEST_HEAD.unpack_from(tail)
        if head == (DTYPE_BASE_DIGEST, 1, DIGEST_LEN, DIGEST_LEN):
            self.base_digests[self.window_fragment] = bytes(tail[_DIGEST_HEAD.size:_DIGEST_HEAD.size + DIGEST_LEN])

    def forward(self, rank: int) -> None:
        """A single-rank host's verified frame, which goes up as it is (no fold)."""
        self._owe_reply(rank)

    def only_missing(self, rank: int) -> bool:
        """Whether ``rank``'s frame is the last one this round waits for (after another)."""
        return bool(self.deposited) and self.live - self.deposited == {rank}

    def complete_ahead(self, rank: int, acc: FoldAccumulator) -> bool:
        """Close the round with a frame computed ahead from ``acc`` plus ``rank``'s
        verified frame, if that is still exactly what the round needs."""
        if rank in self.awaiting_reply:
            self._owe_reply(rank)  # raises: a second frame in one round
        if acc is not self.acc or not self.only_missing(rank):
            return False
        self.awaiting_reply.add(rank)
        self._schema_up = acc.schema
        self._next_round()
        # The frame computed ahead has its own buffer: nothing reads these sums now.
        self.images.give(acc.sums())
        return True

    def mark_dead(self, rank: int) -> FoldedHostFrame | None:
        """Drop ``rank`` from the barrier (a frame it already folded stays: realized work)."""
        self.dead.add(rank)
        self.awaiting_reply.discard(rank)
        self.joining.discard(rank)
        self.entering.discard(rank)
        self.fresh.discard(rank)
        self.held.pop(rank, None)
        if not self.live:  # nobody here holds a base now: a return is given one, or starts a lineage anew
            self.base_digests.clear()
        self._on_change()
        return self._take_if_complete()

    # -- the consensus back --------------------------------------------------

    def host_frame_sent(self) -> None:
        """A HostFrame is going up: its Broadcast may come back (not before)."""
        self.host_frame_up = True

    def consensus_arrived(self) -> list[int]:
        """A Broadcast came down: the ranks owed it, in rank order (they may deposit again)."""
        if not self.host_frame_up:
            raise DesyncError(
                f"relay {self.host}: the controller sent a Broadcast this host did not ask for "
                "(a replayed record, or the ping-pong broke)"
            )
        self.host_frame_up = False
        self._delta_up = self._schema_up is not None and is_delta_schema(self._schema_up[1])
        if self._schema_up is not None:
            self.agreed.agree(self._schema_up)
            self._schema_up = None
        targets = sorted(self.awaiting_reply)
        self.awaiting_reply.clear()
        return targets

    # -- internals -----------------------------------------------------------

    def _owe_reply(self, rank: int) -> None:
        if rank in self.awaiting_reply:
            raise DesyncError(
                f"relay {self.host}: rank {rank} deposited twice in one round "
                "(sent a frame before receiving the last consensus; stream desynced)"
            )
        self.awaiting_reply.add(rank)

    def _take_if_complete(self) -> FoldedHostFrame | None:
        if not self.deposited or not self.live <= self.deposited:
            return None
        # The frame may alias the sums (it always does for f32): they go back once it is written.
        schema = self._schema_up = self.acc.schema
        result = self.acc.result(overwrite_sums=True)
        if schema is not None and digest_of(result) is not None and result.tensors[0].dtype != schema[1][0][0]:
            # The sums, coded once more for the uplink (as they go: lane by lane with lanes).
            pending = self.delta_uplink.pending(schema, result, self.window_fragment)
            folded = FoldedHostFrame(pending, self.acc.sums())
        else:
            folded = FoldedHostFrame(result, self.acc.sums())
        self._next_round()
        return folded

    def _next_round(self) -> None:
        self.acc = FoldAccumulator(self.images)
        self.deposited.clear()
        self._on_change()


__all__ = ["FoldedHostFrame", "HostFold"]
