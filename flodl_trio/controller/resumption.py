"""A controller that comes back: its record written each round, read at start, and
what it answers a relay that resumes (docs/wire.md, "Resuming"; docs/liveness.md).

:class:`Resumption` is the controller's one place for it. Each round, before the
consensus goes out, :meth:`Resumption.record` makes the round durable
(:mod:`.resume`). At start, :meth:`Resumption.restore` puts a run's record back
into the round, the membership, the dead-rank ledger and the coordinator. When a
relay's ``Resume`` arrives, :meth:`Resumption.answer` says what it is owed: nothing
(it has every consensus), or the last Broadcast again (it is one round behind, and
the HostFrame it sends again is stale: :meth:`Resumption.stale_host_frame` drops
it). No socket I/O.

With lanes a round's consensus goes out as one Broadcast record per lane, and the
record is written as its last lane goes: every lane's record is in it (a relay one
round behind is sent all of them again), and the round's place is its last lane's
MAC. Lanes that went out before a controller was lost, in a round it had not
recorded, are void: the relays drop what they had of them and send every lane of
their HostFrame again (docs/wire.md, "Resuming").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import attrs
import numpy as np
import trio

from ..errors import DesyncError, FlodlError
from ..transport.settings import DEFAULT_CONTROLLER_OUTAGE, NetBounds
from ..wire.checkpoint import CheckpointError
from ..wire.fragment import FragmentTag
from ..wire.mux import Resume
from ..wire.round_frame import EncodedFrame, RoundKind
from ..wire.salt import SessionSalt
from .coordinator import Coordinator
from .dead_ranks import DeadRanks
from .membership import Membership
from .resume import BroadcastTags, Resumed, ResumeLog, RunRecord, broadcast_tag, record_bytes
from .shards import ShardSet
from .round import CheckpointSink, WindowPart, WindowState, WindowStore
from .stats import ControllerStats
from .windows import Windows

log = logging.getLogger("flodl_trio.controller")


class Resumption:
    """The controller's durable record and its answers to resuming relays."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        salt: SessionSalt,
        windows: Windows,
        window_store: WindowStore,
        checkpoint: CheckpointSink | None,
        membership: Membership,
        dead: DeadRanks,
        coordinator: Coordinator,
        stats: ControllerStats,
    ) -> None:
        self.log = ResumeLog(directory, salt, dead.world_size) if directory is not None else None
        self.windows = windows
        self.checkpoint = checkpoint
        self.window_store = window_store
        self.membership = membership
        self.dead = dead
        self.coordinator = coordinator
        self.stats = stats
        self.tags = BroadcastTags()
        self._outer_file: str | None = None
        self._delta_file: str | None = None
        self._delta_rounds = 0  # the lineages' rounds when their state was last written
        # The window state's file, its window, and how many of its frames are params.
        self._window: tuple[str, int, int] | None = None
        self._stale: set[int] = set()  # relays whose next HostFrame (every lane) is of a round already finished
        self._lanes_out: list[np.ndarray] = []  # the bytes of the round's lanes gone out so far
        # Why this run cannot be resumed (a record that says so: one written by an older version).
        self.not_resumable: str | None = None
        self.restored: RunRecord | None = None  # the run a record gave back at start
        self.shards: ShardSet | None = None  # the reduction shards, once used (their state is recorded)

    def announced_outage_ms(self, bounds: NetBounds) -> int:
        """What relays and ranks are told to hold for this controller if it is lost (ms):
        with a record, its bound (default DEFAULT_CONTROLLER_OUTAGE); without, nothing."""
        if self.log is None:
            return 0
        outage = DEFAULT_CONTROLLER_OUTAGE if bounds.controller_outage is None else bounds.controller_outage
        return min(round(outage * 1000), 0xFFFFFFFF)  # a u32 on the wire: 49 days at most

    # -- at start --------------------------------------------------------------

    def restore(self) -> None:
        """Take on the run the record describes, if there is one."""
        if self.log is None:
            return
        resumed = self.log.load()
        if resumed is None:
            return
        run = resumed.run
        if run.not_resumable is not None:
            self.not_resumable = run.not_resumable
            log.error("controller: the record in %s cannot be resumed (%s); relays that resume will be refused",
                      self.log.path, run.not_resumable)
            return
        self.restored = run
        now = trio.current_time()
        self.stats.rounds = run.rounds
        self.windows.rounds = run.rounds if run.whole_rounds is None else run.whole_rounds
        fragment = None if run.fragment is None else FragmentTag(*run.fragment, run.fragment_shapes)
        self.windows.counter.restore(
            run.windows, run.model_rounds, None if run.previous_kind is None else RoundKind(run.previous_kind), fragment
        )
        self._restore_lineages(resumed.delta, run.delta_file, fragment)
        outer = self.windows.outer_optimizer
        if resumed.outer:
            load = getattr(outer, "load_state_dict", None)
            if not callable(load):
                raise FlodlError(f"the resume record in {self.log.path} has outer optimizer state, but this "
                                 f"controller's outer optimizer ({outer!r}) takes none: start it as it was started")
            load(resumed.outer)
            self._outer_file = run.outer_file
        self._restore_window_store(resumed, fragment)
        self._reopen_checkpoint_window(run, fragment)
        m = self.membership
        m.formed = run.formed
        m.elastic |= set(run.elastic)
        m.finished |= set(run.finished)
        m.plain |= set(run.plain)
        m.absent |= set(run.absent)
        for rank in run.dead:
            self.coordinator.death_reasons.setdefault(rank, "dead before the controller was restarted")
            m.died(rank, now)
            self.dead.declare_dead(rank)
        self.coordinator.finished |= set(run.finished)
        # A rank that never shows up again is declared dead a heartbeat timeout from now.
        self.coordinator.expect([r for r in range(self.dead.world_size) if r not in run.dead], now)
        self.tags = BroadcastTags(run.last_tag, run.previous_tag)
        self.stats.resumed_runs += 1
        log.info("controller: resuming the run from %s: %d rounds done (window %d), dead ranks %s",
                 self.log.path, run.rounds, run.windows, sorted(run.dead))

    def _restore_lineages(self, state: Mapping[str, np.ndarray], file: str | None, fragment: FragmentTag | None) -> None:
        """A delta run's lineages as the record left them, the open window's set current."""
        lineages = self.windows.lineages
        lineages.window_fragment = None if fragment is None else fragment.index
        if not state or file is None:
            return
        lineages.load_state_dict(state, str(self.log.path.parent / file) if self.log is not None else file)
        self._delta_file, self._delta_rounds = file, lineages.rounds

    def _reopen_checkpoint_window(self, run: RunRecord, fragment: FragmentTag | None) -> None:
        """A checkpoint sink that can (:class:`~.checkpointer.ConsensusCheckpointer`) is told
        the window open when the controller stopped, so its rounds after the restart count,
        and the run's window count, so it numbers the windows on as the lost one did."""
        reopen = getattr(self.checkpoint, "reopen_window", None)
        if callable(reopen) and run.windows > 0:
            reopen(run.model_rounds, fragment, windows=run.windows)

    def _restore_window_store(self, resumed: Resumed, fragment: FragmentTag | None) -> None:
        """Where windows end, per fragment, and the last finished window's state for joiners."""
        run = resumed.run
        shapes: dict[FragmentTag | None, int] = {
            (None if count == 0 else FragmentTag(index, count)): rounds for index, count, rounds in run.window_shapes
        }
        if not shapes and run.model_rounds_per_window is not None:  # a record of a whole-model run
            shapes[None] = run.model_rounds_per_window
        latest = None
        if resumed.window_frames and run.window_file is not None and run.state_window is not None:
            frames = [EncodedFrame([raw], len(raw)) for raw in resumed.window_frames]
            count = run.window_params
            if count is None:  # a whole-model run's: the params, then the buffers if a window has two rounds
                count = len(frames) - 1 if run.model_rounds_per_window == 2 else len(frames)
            latest = WindowState(run.state_window, tuple(frames[:count]), frames[count] if len(frames) > count else None)
            self._window = (run.window_file, run.state_window, count)
            # It kept each window's state for joiners (a rank called join()): so does this one, from the start.
            self.windows.keep_window_state = True
        self.window_store.restore(latest, shapes, None if fragment is None else fragment.count)

    # -- every round -------------------------------------------------------------

    async def record(
        self, broadcast: EncodedFrame, part: WindowPart | None, window: WindowState | None = None, *,
        opens_round: bool = True, ends_round: bool = True,
    ) -> None:
        """Make the round whose Broadcast this is durable, before anyone is sent it;
        ``window``: the state for joiners, when this round finished a window. With
        lanes, one call per lane, in order: a lane before the last is kept (a copy of
        its bytes) for the record that the round's last lane writes."""
        if opens_round:
            self._lanes_out = []
        if not ends_round:
            if self.log is not None:
                self._lanes_out.append(await trio.to_thread.run_sync(record_bytes, broadcast))
            return
        tag = broadcast_tag(broadcast)
        lanes: list[EncodedFrame | np.ndarray] = [*self._lanes_out]
        self._lanes_out = []
        if self.log is None:
            self.tags.advance(tag)
            return
        run = self._run_record(tag, window)
        outer = self._outer_state(part)
        delta = self._delta_state()
        frames = None if window is None else window.frames
        try:
            written = await trio.to_thread.run_sync(self.log.write, run, [*lanes, broadcast], outer, frames, delta)
        except CheckpointError as exc:
            # Without a record a restarted controller would resume wrongly: none at all.
            log.error("controller: the resume record could not be written (%s); removed: a controller started "
                      "again will not resume this run", exc)
            self.log.clear()
            self.log = None
        else:
            self._outer_file, self._delta_file = written.outer_file, written.delta_file
            if delta is not None:
                self._delta_rounds = self.windows.lineages.rounds
            if window is not None and written.window_file is not None:
                self._window = (written.window_file, window.window, len(window.params))
        self.tags.advance(tag)

    def _run_record(self, tag: bytes, window: WindowState | None) -> RunRecord:
        counter = self.windows.counter
        state_window = window.window if window is not None else self._window[1] if self._window else None
        m = self.membership
        fragment = counter.fragment
        record = RunRecord(
            rounds=self.stats.rounds,
            whole_rounds=self.windows.rounds,
            windows=counter.windows,
            model_rounds=counter.model_rounds,
            previous_kind=None if counter.previous_kind is None else int(counter.previous_kind),
            fragment=None if fragment is None else (fragment.index, fragment.count),
            fragment_shapes=() if fragment is None else fragment.shapes,
            last_tag=tag,
            previous_tag=self.tags.latest,
            dead=tuple(sorted(self.dead.snapshot())),
            finished=tuple(sorted(m.finished)),
            elastic=tuple(sorted(m.elastic)),
            plain=tuple(sorted(m.plain)),
            absent=tuple(sorted(m.absent)),
            formed=m.formed,
            outer_file=self._outer_file,
            window_file=self._window[0] if self._window and window is None else None,
            state_window=state_window,
            model_rounds_per_window=self.window_store.model_rounds_per_window,
            window_params=len(window.params) if window is not None else self._window[2] if self._window else None,
            window_shapes=tuple(
                (-1, 0, rounds) if shape is None else (shape.index, shape.count, rounds)
                for shape, rounds in self.window_store.window_shapes.items()
            ),
            delta_file=self._delta_file,
        )
        return record if self.shards is None else self._with_shards(record, self.shards)

    @staticmethod
    def _with_shards(record: RunRecord, shards: ShardSet) -> RunRecord:
        """Where the shards are: a controller started again takes them on from there."""
        return attrs.evolve(record, shards=shards.addresses, shards_lost=tuple(sorted(shards.lost)),
                            sharded_rounds=shards.rounds, decisions=shards.decisions)

    def _delta_state(self) -> Mapping[str, np.ndarray] | None:
        """The delta lineages' state, if a round moved it since it was last written."""
        lineages = self.windows.lineages
        return lineages.state_dict() if lineages.rounds != self._delta_rounds else None

    def _outer_state(self, part: WindowPart | None) -> Mapping[str, np.ndarray] | None:
        """The outer optimizer's state, if this round stepped it (else the record keeps the last file)."""
        if part is None or not part.is_params:
            return None
        state_dict = getattr(self.windows.outer_optimizer, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    # -- a relay that resumes ---------------------------------------------------

    def answer(self, seat_id: int, name: str, msg: Resume) -> EncodedFrame | None:
        """What ``msg`` from the relay of ``seat_id`` is owed: None (it is current), or
        the last Broadcast again (with lanes, every lane's record). DesyncError (the relay is dropped) when the
        relay is somewhere this controller never was."""
        if self.not_resumable is not None and msg.last_broadcast != self.tags.latest:
            raise DesyncError(f"resumed a run this controller cannot take on: {self.not_resumable}")
        if msg.last_broadcast == self.tags.latest:
            if msg.awaiting and not msg.resends:
                raise DesyncError("resumed waiting for a consensus it began to receive, but this controller "
                                  "never sent one after the last it has")
            log.info("controller: %s resumed with every consensus%s", name,
                     "; its HostFrame comes again" if msg.resends else "")
            self.stats.relays_resumed += 1
            return None
        if msg.last_broadcast == self.tags.previous and msg.awaiting:
            record = self.log.last_broadcast() if self.log is not None else None
            if record is None:
                raise DesyncError("resumed one consensus behind, and this controller keeps no record to send it "
                                  "again (start it with a checkpoint directory)")
            if msg.resends:
                self._stale.add(seat_id)
            log.info("controller: %s resumed one consensus behind; it is sent the last one again", name)
            self.stats.relays_resumed += 1
            return record
        known = "none yet" if self.tags.previous is None else f"{self.tags.latest.hex()} and {self.tags.previous.hex()}"
        raise DesyncError(
            f"resumed after the Broadcast with MAC {msg.last_broadcast.hex()}, which is not one of this "
            f"controller's last two ({known}): it belongs to another run, or this controller was started "
            "without the record of this one (give it the same checkpoint directory)"
        )

    def stale_host_frame(self, seat_id: int, *, last_lane: bool = True) -> bool:
        """Whether this HostFrame (or lane of one: ``last_lane`` says if it is the
        last) is one a resuming relay sent again for a round already finished
        (dropped: its consensus went out again instead)."""
        if seat_id in self._stale:
            if last_lane:
                self._stale.discard(seat_id)
            return True
        return False

    def sends_stale(self, seat_id: int) -> bool:
        """Whether this relay's next HostFrame (or lane) is one it sends again for a round
        already finished: dropped as it comes, so it waits for no other relay's."""
        return seat_id in self._stale

    def forget(self, seat_id: int) -> None:
        self._stale.discard(seat_id)

    def run_over(self) -> None:
        """Every rank finished or is gone for good: a controller started next starts anew."""
        if self.log is not None:
            self.log.clear()


__all__ = ["Resumption"]
