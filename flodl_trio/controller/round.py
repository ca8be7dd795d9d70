"""The controller's round and membership, free of I/O.

Who must deliver (every live rank's relay), who delivered, the f32 sum of
their frames and its accepted mass, and what to send whom: the controller's
tasks tell a :class:`ControllerRound` what happened (a relay joined or left,
a HostFrame verified, a rank died, a Broadcast went out) and act on what it
returns (a :class:`Consensus` to sign and queue, the relays to queue it to).
It never awaits, so it reads and tests without trio.

Which relays carry which ranks is the controller's one :class:`~.seats.Seats`
registry, shared by every lane's round; deaths come from its shared
:class:`DeadRanks` ledger, read directly: a death declared anywhere counts the
moment it is declared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Protocol

import attrs

from ..errors import DesyncError, FlodlError, ProtocolError, SchemaError
from ..fold.accumulator import (
    FoldAccumulator,
    ImageCache,
    finish_consensus,
    shares_sums,
)
from ..fold.delta import DeltaLineages, is_delta_schema
from ..fold.schemas import AgreedSchemas, schema_of, why_taken_out
from ..fold.speculative import SpeculativeFrame
from ..transport.buffers import ReceiveBuffer
from ..transport.tasks import nothing
from ..wire.fragment import FragmentTag, fragment_of
from ..wire.mux import MuxKind
from ..wire.quant import DeltaCodec
from ..wire.round_frame import EncodedFrame, RoundFrame, RoundKind, encoded_frame_weight
from .seats import Seats
from .stats import ControllerStats


class OuterOptimizer(Protocol):
    """Transforms the params consensus of each window (DiLoCo, SlowMo, ...).

    One that also has ``step(consensus, fragment)`` is given the window's
    :class:`FragmentTag` that way when the ranks sync in fragments, and keeps
    its state per fragment (the built-in ones do). A controller with lanes
    needs ``step_lane(consensus, layout, lane, fragment)``: each lane of the
    params round stepped as it finishes (see :mod:`flodl_trio.fold.outer`).
    """

    def __call__(self, consensus: RoundFrame) -> RoundFrame: ...


class CheckpointSink(Protocol):
    """Receives every round's consensus (Model and Control); must return quickly (write elsewhere).

    Windows are told apart by ``consensus.kind``: a Control round opens a
    window, the first Model round after it is the params round (already
    transformed by the outer optimizer: what the ranks receive), the second
    the buffers round. See ``flodl_trio.controller.checkpointer.ConsensusCheckpointer``.

    With reduction shards the controller holds a round whole only when it asks the
    shards for a copy. A sink may say which rounds it records: ``wants_round(kind) ->
    bool`` before each such round, and ``skip_round(round_index, kind, weight)`` for a
    round it said no to (it then gets no ``__call__`` for it). A sink without them is
    sent every round, each copied to the controller.
    """

    def __call__(self, round_index: int, consensus: RoundFrame) -> None: ...


@attrs.frozen
class WindowPart:
    """Where a round sits in the windows of ``average_window``: round ``index`` of
    window ``window`` - 0 its Control round (the step-count gather, which opens
    it), 1 the params round, 2 the float-buffers round (if the model has any)."""

    window: int
    index: int
    fragment: FragmentTag | None = None  # the fragment the window syncs (None: the whole model)

    @property
    def kept(self) -> bool:
        """Whether the round's consensus is part of the window's state for joiners."""
        return self.index in (1, 2)

    @property
    def is_params(self) -> bool:
        """Whether this is the window's params round (the one an outer optimizer steps)."""
        return self.index == 1


class WindowCounter:
    """Places each finished round in the windows of ``average_window``: a Control
    round opens a window (syncing the fragment its tag names, if any), the Model
    rounds after it are that window's params round and buffers round."""

    def __init__(self) -> None:
        self.windows = 0  # Control rounds finished: windows opened
        self.previous_kind: RoundKind | None = None  # the last finished round's
        self._model_rounds = 0
        self._fragment: FragmentTag | None = None

    def place(self, kind: RoundKind, fragment: FragmentTag | None) -> WindowPart | None:
        """Where the round just finished sits (None: before any window); ``fragment``:
        the tag a Control round carries."""
        self.previous_kind = kind
        if kind == RoundKind.CONTROL:
            self.windows += 1
            self._model_rounds = 0
            self._fragment = fragment
            return WindowPart(self.windows - 1, 0, fragment)
        if self.windows == 0:
            return None
        self._model_rounds += 1
        return WindowPart(self.windows - 1, self._model_rounds, self._fragment)

    def restart_at(self, window: int) -> None:
        """The next Control round opens ``window`` (the cluster starts again after every
        rank died, from the last finished window; the one cut short is abandoned)."""
        self.windows = window
        self._model_rounds = 0

    @property
    def model_rounds(self) -> int:
        """Model rounds finished in the window now open."""
        return self._model_rounds

    @property
    def fragment(self) -> FragmentTag | None:
        """The fragment the window now open syncs (None: the whole model)."""
        return self._fragment

    def restore(
        self, windows: int, model_rounds: int, previous_kind: RoundKind | None, fragment: FragmentTag | None = None
    ) -> None:
        """Carry on counting where a controller that ran before stopped (its resume record),
        in the window of ``fragment`` (None: the whole model's)."""
        self.windows = windows
        self._model_rounds = model_rounds
        self.previous_kind = previous_kind
        self._fragment = fragment


@attrs.frozen
class Consensus:
    """A finished round's answer: a frame to sign, or a record signed already (computed
    while the last frame arrived). ``after_write`` gives its memory back for reuse
    once every relay has been sent it (None: never - a hook may keep it, or the
    frame is kept as the window's state for joiners). ``part``: the round's place
    in a window, if it has one. ``delivered_by``: the relays whose HostFrames it
    sums - each waits for it, even if all its ranks died since. ``for_joiners``: what
    the window state keeps instead of ``outgoing`` (a delta round's base in f32)."""

    outgoing: RoundFrame | EncodedFrame
    after_write: Callable[[], None] | None = None
    part: WindowPart | None = None
    delivered_by: frozenset[int] = frozenset()
    # What a joiner is to start from, when it is not what the ranks are sent (a delta
    # round's: its base in f32). None: the outgoing frame itself.
    for_joiners: RoundFrame | None = None


@attrs.frozen
class WindowState:
    """The consensus of the last completed window, as the ranks received it: each
    frame a RoundFrame's signed bytes (its own MAC last). What a joiner starts from.
    ``params``: the params frame, or with fragments each fragment's newest, in
    fragment order (their tensors, concatenated, are the model's params)."""

    window: int
    params: tuple[EncodedFrame, ...]
    buffers: EncodedFrame | None

    @property
    def frames(self) -> list[EncodedFrame]:
        """What a joiner is sent, in order: the params frames, then the buffers'."""
        return [*self.params, *([self.buffers] if self.buffers is not None else [])]


class WindowStore:
    """Keeps the signed consensus frames of the last completed window, fed every
    window round's consensus in order; says when a window ends.

    A window is a Control round and then the Model rounds up to the next
    Control round; how many Model rounds is learned from each window for the
    next (two with float buffers, one without), per fragment when the ranks
    sync in fragments (the buffers go with the last). Knowing it, :meth:`keep`
    says which consensus is a window's last *before* it goes out: the moment
    the controller lets joiners in. With fragments the state is every
    fragment's newest params (and the newest buffers), complete once each
    fragment has had a window. Kept frames are never recycled; a joiner's
    transfer holds references to the state it is sending, so replacing it
    never changes bytes in flight.
    """

    def __init__(self) -> None:
        self.latest: WindowState | None = None
        self._shapes: dict[FragmentTag | None, int] = {}  # Model rounds per window, learned per fragment
        self._window = -1
        self._fragment: FragmentTag | None = None
        self._model_rounds = 0
        self._params: EncodedFrame | None = None
        self._buffers: EncodedFrame | None = None
        self._not_held = False  # a round of the window in progress was not held here (shards)
        self.ended = -1  # the newest window whose rounds all went out (held here or not)
        # With fragments: each fragment's newest params, and the newest buffers.
        self._newest: list[EncodedFrame | None] = []
        self._newest_buffers: EncodedFrame | None = None
        # A delta run's params consensus frames as the ranks got them, by window: what
        # brings a joiner whose state is some windows old up to its host's base.
        self.catch_up_limit = 8
        self._catch_up: dict[int, EncodedFrame] = {}

    def keep_catch_up(self, window: int, frame: EncodedFrame) -> None:
        """A delta round's params consensus went out for ``window`` (the newest few are kept)."""
        self._catch_up[window] = frame
        for old in [w for w in self._catch_up if w <= window - self.catch_up_limit]:
            del self._catch_up[old]

    def catch_up_between(self, state_window: int, entry: int) -> list[EncodedFrame] | None:
        """The kept params frames of the windows after ``state_window`` and before ``entry``:
        [] when there are none to send (no window between, or not a delta run), None
        when a delta run's joiner is further behind than the frames kept."""
        if not self._catch_up:
            return []
        kept = [self._catch_up.get(window) for window in range(state_window + 1, entry)]
        if any(frame is None for frame in kept):
            return None
        return [frame for frame in kept if frame is not None]

    @property
    def model_rounds_per_window(self) -> int | None:
        """Model rounds a window of the current window's fragment has (None: not learned yet)."""
        return self._shapes.get(self._fragment)

    def keep(self, part: WindowPart, frame: EncodedFrame | None) -> bool:
        """Take a window round's consensus (None: a round not held here - with shards,
        one the controller got lane 0 of alone: its window yields no state); True if it
        ends the window (a boundary) and a joiner can be given the state."""
        if part.index == 0:
            if self._window >= 0:
                self._shapes[self._fragment] = self._model_rounds
                self._complete()  # a no-op if the window ended at its boundary already
            self._window, self._fragment, self._model_rounds = part.window, part.fragment, 0
            self._not_held = False
            return False
        if self._window < 0:
            return False  # a window whose first round it did not see (kept from mid-window on): not one to keep
        self._model_rounds += 1
        if frame is None:
            self._not_held = True
        elif part.index == 1:
            self._params = frame
        elif part.index == 2:
            self._buffers = frame
        if self._model_rounds == self.model_rounds_per_window:
            self._complete()
            return self.latest is not None and self.latest.window == self._window
        return False

    @property
    def window_shapes(self) -> dict[FragmentTag | None, int]:
        """Model rounds per window, as learned for each fragment (None: the whole model)."""
        return dict(self._shapes)

    def restore(
        self, latest: WindowState | None, shapes: Mapping[FragmentTag | None, int], fragments: int | None = None
    ) -> None:
        """Serve joiners the state a controller that ran before kept (its resume record),
        and know where windows end as it did. ``fragments``: the run syncs that many
        fragments, whose newest params ``latest`` holds in fragment order."""
        self.latest = latest
        self._shapes.update(shapes)
        if latest is not None and fragments is not None and len(latest.params) == fragments:
            self._newest, self._newest_buffers = list(latest.params), latest.buffers

    def end_unnamed_window(self) -> bool:
        """Every rank is dead: the window in progress gets no more rounds. One whose shape
        is not learned yet (the run's first window, or a fragment's first) could not be
        named finished at its last round, though its Model rounds went out and the
        ranks held them: it ends now, so a returning rank loads them. Its shape stays
        unlearned: a first window cut short between its params and buffers rounds looks
        the same, and its params are what the ranks held too. True if that made a new
        state for joiners."""
        if self._window < 0 or self.model_rounds_per_window is not None or self._model_rounds == 0:
            return False
        before = self.latest
        self._complete()
        return self.latest is not before

    def abandon_window(self) -> None:
        """The window in progress will not finish (every rank died): forget its frames,
        and do not learn the window shape from it."""
        self._window, self._model_rounds = -1, 0
        self._params = self._buffers = None
        self._not_held = False

    def _complete(self) -> None:
        params, buffers, self._params, self._buffers = self._params, self._buffers, None, None
        self.ended = max(self.ended, self._window)
        fragment = self._fragment
        if self._not_held:  # no state from this window; with fragments, start over
            self._not_held = False
            if fragment is not None:
                self._newest, self._newest_buffers = [None] * fragment.count, None
            return
        if params is None:
            return
        if fragment is None:
            before = self.latest
            if before is not None and len(before.params) == 1:
                params = _with_work(params, before.params[0])
            if buffers is not None and before is not None:
                buffers = _with_work(buffers, before.buffers)
            self.latest = WindowState(self._window, (params,), buffers)
            return
        if len(self._newest) != fragment.count:  # a new fragment layout: start over
            self._newest, self._newest_buffers = [None] * fragment.count, None
        self._newest[fragment.index] = _with_work(params, self._newest[fragment.index])
        if buffers is not None:
            self._newest_buffers = _with_work(buffers, self._newest_buffers)
        newest = [f for f in self._newest if f is not None]
        if len(newest) == fragment.count:  # every fragment has had a window
            self.latest = WindowState(self._window, tuple(newest), self._newest_buffers)


def _with_work(frame: EncodedFrame, before: EncodedFrame | None) -> EncodedFrame:
    """A window's consensus frame, or - when its accepted mass was 0 (no rank did any
    work, so every rank kept what it held) - the frame before it, which is what the
    ranks hold (docs/wire.md, "Zero accepted mass"). A joiner loads that, not the
    weight-0 sums its join would skip."""
    if before is not None and encoded_frame_weight(frame) <= 0:
        return before
    return frame


class ControllerRound:
    """The round in progress, computed over the relays of ``seats``.

    A round completes when every rank of the world is dead or carried by a
    relay that delivered; the sum is divided once by the accepted mass.
    ``on_change`` is called whenever the set of frames the round waits for
    moves (a task speculating on the last frame waits for that).
    ``computes_ahead``: whether a consensus may be computed and signed while
    the round's last frame arrives (not for one lane of several: the windows
    step each lane before it is signed).
    """

    def __init__(
        self,
        seats: Seats,
        stats: ControllerStats,
        *,
        outer_optimizer: OuterOptimizer | None = None,
        checkpoint: CheckpointSink | None = None,
        on_change: Callable[[], None] = nothing,
        keep_window_state: bool = False,
        computes_ahead: bool = True,
    ) -> None:
        self.seats = seats
        # Whether windows' consensus frames are kept for joiners (else their memory is reused).
        self.keep_window_state = keep_window_state
        self.dead = seats.dead
        self.stats = stats
        self.outer_optimizer = outer_optimizer
        self.checkpoint = checkpoint
        self.computes_ahead = computes_ahead
        self._on_change = on_change
        # Relays whose HostFrame was accepted and whose consensus has not gone out
        # yet: another HostFrame from one of them now is a replay or a desync.
        self.awaiting_broadcast: set[int] = set()
        self.images = ImageCache()
        self.acc = FoldAccumulator(self.images)
        self.delivered: set[int] = set()
        self.agreed = AgreedSchemas()  # schemas of the rounds completed (:mod:`flodl_trio.fold.schemas`)
        self.expelled: dict[int, str] = {}  # relays whose folded frames proved wrong: why, until dropped
        self.started: float | None = None  # when the round's first contribution arrived
        self.counter = WindowCounter()
        # Delta rounds: per params set, the exact consensus and the ranks' base; which set
        # a window syncs is this round's to say, unless a lane windows keeper says it.
        self.lineages = DeltaLineages()
        self.names_window_fragment = True
        self.last_was_delta = False  # whether the last round finished was a delta round
        # Buffers of consensus frames computed ahead and since sent to every relay.
        self._spare_buffers: list[ReceiveBuffer] = []

    # -- frames in -----------------------------------------------------------

    def completes(self, seat_id: int | None) -> bool:
        """Whether every live rank's frame is in once ``seat_id``'s is (None: as things stand)."""
        for rank in range(self.seats.world_size):
            if self.dead.is_dead(rank):
                continue
            owner = self.seats.owner(rank)
            if owner is None or (owner != seat_id and owner not in self.delivered):
                return False
        return True

    def may_fold_now(self, seat_id: int) -> bool:
        """In host order: whether ``seat_id``'s HostFrame may be folded now - its relay
        is the first (by its lowest rank) that the round still waits for, or not one
        the round waits for at all (its frame must reach the checks to be refused
        or dropped)."""
        pending = [sid for sid in self.seats.broadcast_targets() if sid not in self.delivered]
        return seat_id not in pending or seat_id == self.seats.first_in_host_order(pending)

    def accepts_host_frame(self, seat_id: int) -> bool:
        """Whether a HostFrame from this relay counts: False for a late frame whose
        ranks are all dead (dropped); DesyncError for a second frame in one round."""
        if not self.seats.has_live_rank(seat_id):
            return False
        if seat_id in self.awaiting_broadcast:
            raise DesyncError(
                "sent a HostFrame before the consensus of its previous one went out "
                "(a replayed record, or the ping-pong broke)"
            )
        return True

    def deposit(self, seat_id: int, frame: RoundFrame, now: float) -> Consensus | None:
        """Fold a verified HostFrame (accepted by :meth:`accepts_host_frame`); the
        consensus when it completes the round."""
        if self.acc.count == 0:
            self.started = now
        self.lineages.current.check_base(frame, self.seats.name(seat_id))
        try:
            self.acc.add(frame, self.seats.name(seat_id))
        except SchemaError:  # nothing of the frame was added: see who is wrong
            if not self.agreed.folded_frames_at_fault(self.acc.schema, schema_of(frame)):
                raise
            self._take_out_folded(seat_id, frame)
            self.acc.add(frame, self.seats.name(seat_id))
        self._delivered_by(seat_id)
        self._on_change()
        return self.consensus_if_complete(now)

    def _take_out_folded(self, seat_id: int, frame: RoundFrame) -> None:
        """``seat_id``'s HostFrame has the schema completed rounds had; the ones folded
        before it have another: start the round's sum again without them. Their
        relays stay in the barrier (their ranks live) until the caller drops them."""
        folded = self.acc.schema
        assert folded is not None
        why = why_taken_out(folded, schema_of(frame), self.seats.name(seat_id))
        for culprit in sorted(self.delivered):
            self.expelled[culprit] = f"its HostFrame {why}"
        self.images.give(self.acc.sums())
        self.acc = FoldAccumulator(self.images)
        self.delivered = set()

    def take_expelled(self) -> dict[int, str]:
        """The relays to drop (seat id: why) since the last call."""
        expelled, self.expelled = self.expelled, {}
        return expelled

    def rank_died(self, now: float) -> Consensus | None:
        """A death was declared: the round may now be complete without it."""
        self._on_change()
        return self.consensus_if_complete(now)

    def consensus_if_complete(self, now: float) -> Consensus | None:
        if self.acc.count == 0 or not self.completes(None):
            return None
        acc = self.acc
        if acc.schema is not None and is_delta_schema(acc.schema[1]):
            return self._finish_delta(finish_consensus(acc), now)
        self.last_was_delta = False
        # Without hooks the consensus's memory is reused once written, so a bf16
        # one may as well be rounded over the sums as into new arrays.
        consensus = finish_consensus(acc, overwrite_sums=not self.hooked)
        # Only through the consensus could anyone still read the sums: free now if
        # it does not alias them (re-encoded to bf16), else once every relay has
        # been sent it - and never if a hook saw it (a hook may keep the frame).
        sums = acc.sums()
        if shares_sums(acc, consensus):
            return self._finish(consensus, None, partial(self.images.give, sums), now)
        self.images.give(sums)
        return self._finish(consensus, None, None, now)

    # -- speculation: the consensus computed while the last frame arrives ------

    def may_speculate(self, seat_id: int, kind: int) -> bool:
        """Whether a record (by its still unverified header) may be a HostFrame whose
        consensus goes out unchanged, should it become the round's last."""
        if not self.computes_ahead or kind != MuxKind.HOST_FRAME:
            return False
        if seat_id in self.awaiting_broadcast or seat_id in self.delivered:
            return False
        # A params round's consensus is transformed by the outer step before it is signed.
        return self.outer_optimizer is None or self.counter.previous_kind != RoundKind.CONTROL

    def is_last(self, seat_id: int) -> bool:
        """Whether ``seat_id``'s frame is now the only one the round waits for."""
        return self.completes(seat_id) and self.seats.has_live_rank(seat_id)

    def begin_speculation(self, in_length: int) -> SpeculativeFrame | None:
        """A speculative consensus over the round as it stands (None: not possible)."""
        out = self._spare_buffers.pop() if self._spare_buffers else None
        frame = SpeculativeFrame(self.acc, divide=True, in_length=in_length, out=out)
        if frame.supported:
            return frame
        self._spare_buffers.append(frame.buffer)
        return None

    def commit_speculation(self, seat_id: int, frame: SpeculativeFrame, record: EncodedFrame, now: float) -> Consensus | None:
        """Close the round with a consensus computed ahead from the round's fold plus
        ``seat_id``'s verified frame, if that is still exactly what the round needs
        (None: it is not; the caller deposits the frame the ordinary way)."""
        if frame.acc is not self.acc or not self.completes(seat_id):
            return None
        if self.acc.count == 0:
            self.started = now
        self._delivered_by(seat_id)
        self.stats.rounds_finished_ahead += 1
        # The consensus lives in the speculation's own buffer: the sums it read are free.
        self.images.give(frame.acc.sums())
        return self._finish(frame.frame(), record, partial(self._spare_buffers.append, frame.buffer), now)

    def give_back(self, frame: SpeculativeFrame | None) -> None:
        """A speculation that did not become the round's consensus returns its buffer."""
        if frame is not None:
            self._spare_buffers.append(frame.buffer)

    # -- the consensus out ---------------------------------------------------

    def broadcast_going_out(self, seat_id: int) -> None:
        """The relay is being written its consensus: its next HostFrame may follow at once."""
        self.awaiting_broadcast.discard(seat_id)

    @property
    def hooked(self) -> bool:
        """Whether an outer optimizer or checkpoint sink sees each consensus (and may keep it)."""
        return self.outer_optimizer is not None or self.checkpoint is not None

    # -- internals -----------------------------------------------------------

    def _delivered_by(self, seat_id: int) -> None:
        self.delivered.add(seat_id)
        self.awaiting_broadcast.add(seat_id)

    def _finish_delta(self, mean: RoundFrame, now: float) -> Consensus:
        """A delta round's end (docs/wire.md, "Delta rounds"): the mean delta plus the
        exact consensus before it is the params the hooks see; the stepped params go
        out as a delta against the ranks' base, coded as the ranks coded theirs, and a
        joiner is given that base in f32."""
        assert self.acc.schema is not None
        codec = DeltaCodec.of_tag(self.acc.schema[1][0][0])
        self.last_was_delta = True
        lineage = self.lineages.current
        averaged = lineage.averaged(mean)
        finished = self._finish(averaged, None, None, now)
        assert isinstance(finished.outgoing, RoundFrame)  # the stepped params: no record was signed ahead
        outgoing = lineage.downlink_frame(finished.outgoing, codec)
        for_joiners = lineage.joiner_frame(outgoing.weight) if self.keep_window_state else None
        return attrs.evolve(finished, outgoing=outgoing, after_write=None, for_joiners=for_joiners)

    def _finish(
        self, consensus: RoundFrame, record: EncodedFrame | None, after_write: Callable[[], None] | None, now: float
    ) -> Consensus:
        """Account for the finished round, start the next, and apply the hooks."""
        started = self.started if self.started is not None else now
        delivered_by = frozenset(self.delivered)
        self.agreed.agree(self.acc.schema or schema_of(consensus))
        self.acc = FoldAccumulator(self.images)
        self.delivered = set()
        self.started = None
        self._on_change()
        self.stats.rounds += 1
        self.stats.fold_images_reused = self.images.reused
        self.stats.round_seconds.observe(now - started)
        self.stats.last_mass = consensus.weight
        part = self.counter.place(consensus.kind, fragment_of(consensus))
        if consensus.kind == RoundKind.CONTROL and self.names_window_fragment:  # its params round is this set's
            self.lineages.window_fragment = part.fragment.index if part is not None and part.fragment else None
        transformed = self._apply_hooks(consensus, part)
        if self.hooked or (self.keep_window_state and part is not None and part.kept):
            after_write = None  # a hook may keep it; a window's params or buffers are kept for joiners
        if record is not None and transformed is consensus:
            return Consensus(record, after_write, part, delivered_by)
        return Consensus(transformed, after_write, part, delivered_by)

    @property
    def windows(self) -> int:
        """Windows opened (Control rounds finished)."""
        return self.counter.windows

    def restart_windows_at(self, window: int) -> None:
        """The next Control round opens ``window`` (see :meth:`WindowCounter.restart_at`)."""
        self.counter.restart_at(window)

    def _apply_hooks(self, consensus: RoundFrame, part: WindowPart | None) -> RoundFrame:
        if part is not None and part.is_params and self.outer_optimizer is not None and consensus.weight > 0:
            step = getattr(self.outer_optimizer, "step", None)
            try:
                if part.fragment is not None and callable(step):
                    consensus = step(consensus, part.fragment)
                else:
                    consensus = self.outer_optimizer(consensus)
            except ProtocolError as exc:
                raise _refused(f"the outer optimizer refused round {self.stats.rounds}'s params consensus: {exc}",
                               exc) from exc
        if self.checkpoint is not None:
            self.checkpoint(self.stats.rounds, consensus)
        return consensus


class OuterSchemaRefused(SchemaError):
    """The outer optimizer refused a params consensus for its schema (the model changed
    between windows): the controller's own error, which stops it, not the fault of the
    relay whose frame closed the round (whose reader it may be raised in: that reader
    lets it through instead of dropping its relay). ``wait_finished()`` raises it, a
    SchemaError (docs/outer-and-checkpoints.md, "Guards")."""


def _refused(why: str, exc: ProtocolError) -> FlodlError:
    """What the outer optimizer's refusal of a params consensus stops the controller with:
    an :class:`OuterSchemaRefused` for a schema change, else a plain FlodlError (no
    ProtocolError either way, which would read as the closing relay's fault)."""
    return OuterSchemaRefused(why) if isinstance(exc, SchemaError) else FlodlError(why)


__all__ = [
    "CheckpointSink",
    "Consensus",
    "ControllerRound",
    "OuterOptimizer",
    "OuterSchemaRefused",
    "WindowPart",
    "WindowState",
    "WindowCounter",
    "WindowStore",
]
