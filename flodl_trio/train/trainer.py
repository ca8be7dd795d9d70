"""The window loop of a Local SGD / DiLoCo trainer, with the round overlapped.

A trainer takes ``sync_every`` inner steps, then averages (one window:
step counts, then params by realized work, then float buffers). With
``overlap=0`` it waits for that round, as :func:`average_window` alone does.
With ``overlap=1`` the round runs in the background, on a copy of the params
the window ended with, while the next window's inner steps run; when the
consensus lands it is merged into the params that moved on meanwhile:

    params <- params + (consensus - stand_in)

where ``stand_in`` is what the rank trained on from since the boundary
(docs/outer-and-checkpoints.md, "Overlapped windows"): the params it sent or,
with an outer optimizer at the controller (SlowMo, DiLoCo), its own estimate
of the next outer params - it follows the controller's outer state from the
consensus frames it receives and takes that step from its own boundary params
(the eager update of Kale et al., 2025).
The trainer only waits when a window ends while the previous window's round
is still in flight. Every contribution is still the
params a rank had at its window's boundary, and the consensus the exact
realized-work average (or the controller's outer step of it).

With ``fragments=P`` (streamed windows, as in Streaming DiLoCo) every
parameter is cut into ``P`` runs of its elements, fragment ``p`` holding run
``p`` of each (:func:`fragment_pieces`), each fragment synced on its own
window schedule of ``sync_every`` steps, staggered so that fragment ``p``
syncs after ``(p + 1) * sync_every // P`` steps and every ``sync_every`` after:
a round carries a ``P``-th of the model, and one goes out every
``sync_every / P`` steps instead of the whole model every ``sync_every``. The
float buffers travel with the last fragment. Each fragment's Control round
carries its :class:`~flodl_trio.wire.fragment.FragmentTag`, so the
controller's outer optimizer and checkpoints keep their state per fragment.

No torch import: the tensors' own methods do the arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..client.tensors import fragment_pieces
from ..errors import ConfigError
from ..transport.tasks import one_error
from ..wire.fragment import FragmentTag
from ..wire.quant import DeltaCodec
from .mirror import OuterMirror
from .realized_work import _ReduceClientLike, average_window, check_window_tensors
from .schedule import WindowSchedule, merge_late_consensus

if TYPE_CHECKING:
    import torch


@attrs.define
class TrainerStats:
    """What the window loop did, and what the network cost the trainer."""

    steps: int = 0  # inner steps taken
    windows: int = 0  # windows whose consensus was merged
    waited_s: float = 0.0  # time the trainer was held up by rounds (its accelerator idle)
    last_counts: list[float] = attrs.field(factory=list)  # step counts of the last merged window, per rank
    late_steps: list[int] = attrs.field(factory=list)  # per merged window: inner steps taken before it landed
    fragment_windows: list[int] = attrs.field(factory=list)  # windows merged, per fragment


@attrs.define(eq=False)
class _Snapshot:
    """Two copies of the params and buffers: the stand-in the rank trains on from
    (its boundary params, or the mirror's outer step of them), and what was sent,
    where the consensus lands."""

    stand_in: list[Any]
    landing: list[Any]

    @classmethod
    def like(cls, tensors: Sequence[Any]) -> _Snapshot:
        return cls([t.detach().clone() for t in tensors], [t.detach().clone() for t in tensors])


@attrs.define(eq=False)
class _Fragment:
    """One fragment's window schedule (the whole model when unfragmented): its params
    (and the buffers, for the last), the steps since its boundary, its round's copies."""

    tag: FragmentTag | None
    tensors: list[Any]
    n_params: int
    window_len: int  # steps in its current window: the stagger first, sync_every after
    mirror: OuterMirror | None
    window_steps: int = 0
    snapshot: _Snapshot | None = None
    landed_counts: list[float] = attrs.field(factory=list)

    @property
    def index(self) -> int:
        return 0 if self.tag is None else self.tag.index

    @property
    def params(self) -> list[Any]:
        return self.tensors[: self.n_params]

    @property
    def buffers(self) -> list[Any]:
        return self.tensors[self.n_params:]

    @property
    def steps_to_sync(self) -> int:
        return self.window_len - self.window_steps


def _make_fragments(
    params: Sequence[Any], buffers: Sequence[Any], schedule: WindowSchedule, outer: object | None, start_window: int
) -> list[_Fragment]:
    """The trainer's fragments: a run of every parameter's elements each; the buffers go with the last."""
    count = schedule.fragments
    pieces = [list(params)] if count == 1 else fragment_pieces(params, count)
    shapes = tuple(tuple(t.shape) for t in params)
    OuterMirror.of(outer)  # a wrong ``outer`` is refused with any overlap (only overlap 1 uses it)
    fragments = []
    for index, run in enumerate(pieces):
        last = index == count - 1
        fragments.append(_Fragment(
            tag=FragmentTag(index, count, shapes) if count > 1 else None,
            tensors=run + (list(buffers) if last else []),
            n_params=len(run),
            window_len=schedule.steps_to_first_sync(index, start_window),
            mirror=OuterMirror.of(outer) if schedule.overlap else None,
        ))
    return fragments


class WindowTrainer:
    """Owns a trainer's window loop: counts inner steps, averages every ``sync_every``
    (each fragment on its own staggered schedule when ``fragments > 1``),
    overlapped with the next steps when ``overlap=1``.

    Open it with :func:`open_window_trainer` (trio) or
    ``BlockingReduceClient.window_trainer`` (plain Python); call :meth:`after_step`
    after every inner step, or let :meth:`run_steps` run the steps in a worker
    thread. Params and buffers are changed in place, only inside
    :meth:`after_step` and :meth:`finish` (never while an inner step runs).
    One round is in flight at a time (the connection carries one at a time):
    a sync that comes due while another is in flight waits for it.
    """

    def __init__(
        self,
        client: _ReduceClientLike,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor] = (),
        *,
        rank: int,
        world_size: int,
        schedule: WindowSchedule,
        outer: object | None = None,
        nursery: trio.Nursery,
        start_window: int = 0,
    ) -> None:
        if start_window < 0:
            raise ConfigError(f"start_window must be >= 0 (what join() returned), got {start_window}")
        _check_start_window(client, schedule, start_window)
        check_window_tensors(client, params, buffers, in_place=True)  # every window writes into them
        self._client = client
        self.rank, self.world_size = rank, world_size
        self.schedule = schedule
        self.sync_every, self.overlap, self.merge_after = schedule.sync_every, schedule.overlap, schedule.merge_after
        self._nursery = nursery
        self._fragments = _make_fragments(params, buffers, schedule, outer, start_window)
        # The fragment whose round is in flight, and the event set when it has landed.
        self._in_flight: tuple[_Fragment, trio.Event] | None = None
        self.stats = TrainerStats(fragment_windows=[0] * schedule.fragments)

    @property
    def fragments(self) -> list[list[torch.Tensor]]:
        """Each fragment's tensors, in sync order (the buffers are in the last)."""
        return [list(f.tensors) for f in self._fragments]

    # -- the loop --------------------------------------------------------------

    async def run_steps(self, steps: int, inner_step: Callable[[], object]) -> None:
        """Run ``inner_step`` (a forward, backward and optimizer step) ``steps`` times in
        a worker thread, so the event loop keeps the rounds and heartbeats moving.

        Steps run in the thread in one go up to the next point where the loop has
        work: a sync or the merge point. While a round that is to be merged when
        it lands is in flight, they run one per hop, so the event loop (which
        moves that round) gets the interpreter between steps.
        """
        remaining = steps
        while remaining > 0:
            done = await trio.to_thread.run_sync(_run_steps, inner_step, self._steps_in_one_go(remaining))
            remaining -= done
            await self._advance(done)

    def _steps_in_one_go(self, remaining: int) -> int:
        """Steps that may run before the loop must act: to the next sync and the merge point."""
        stop = min(remaining, *(f.steps_to_sync for f in self._fragments))
        if self._in_flight is not None:
            if self.merge_after is None:
                return 1
            flying = self._in_flight[0]
            if flying.window_steps < self.merge_after:
                stop = min(stop, self.merge_after - flying.window_steps)
        return stop

    async def after_step(self) -> None:
        """One inner step is done: merge a round that landed, sync what is due."""
        await self._advance(1)

    async def _advance(self, steps: int) -> None:
        self.stats.steps += steps
        for fragment in self._fragments:
            fragment.window_steps += steps
        if self.merge_after is None:
            self._merge_if_landed()
        deadline = self.schedule.merge_deadline
        if self._in_flight is not None and deadline is not None and self._in_flight[0].window_steps >= deadline:
            await self._wait_in_flight()  # merge_after: the same step on every run; merge_by: no later
        for fragment in self._fragments:
            if fragment.steps_to_sync <= 0:
                await self._end_window(fragment)

    async def finish(self) -> None:
        """Wait for a round still in flight and merge it (steps after a fragment's last
        full window are kept local: every rank must run the same number of windows)."""
        await self._wait_in_flight()

    # -- windows ---------------------------------------------------------------

    async def _end_window(self, fragment: _Fragment) -> None:
        await self._wait_in_flight()  # one round at a time per connection
        steps, fragment.window_steps, fragment.window_len = fragment.window_steps, 0, self.sync_every
        if self.overlap == 0:
            started = time.monotonic()
            result = await self._average(fragment, fragment.params, fragment.buffers, steps)
            self.stats.waited_s += time.monotonic() - started
            self._count_window(fragment, result.counts)
            return
        if fragment.snapshot is None:
            fragment.snapshot = _Snapshot.like(fragment.tensors)
        for sent, t in zip(fragment.snapshot.landing, fragment.tensors, strict=True):
            sent.copy_(t)
        _step_to_stand_in(fragment)
        landed = trio.Event()
        self._in_flight = (fragment, landed)
        self._nursery.start_soon(self._background_round, fragment, steps, landed)

    async def _background_round(self, fragment: _Fragment, steps: int, landed: trio.Event) -> None:
        assert fragment.snapshot is not None
        sent = fragment.snapshot.landing
        result = await self._average(fragment, sent[: fragment.n_params], sent[fragment.n_params:], steps)
        fragment.landed_counts = result.counts
        landed.set()

    async def _average(self, fragment: _Fragment, params: Sequence[Any], buffers: Sequence[Any], steps: int) -> Any:
        return await average_window(
            self._client, params, buffers, steps, rank=self.rank, world_size=self.world_size, gamma=self.schedule.gamma,
            in_place=True, fragment=fragment.tag,
        )

    async def _wait_in_flight(self) -> None:
        if self._in_flight is None:
            return
        landed = self._in_flight[1]
        if not landed.is_set():
            started = time.monotonic()
            await landed.wait()
            self.stats.waited_s += time.monotonic() - started
        self._merge_if_landed()

    def _merge_if_landed(self) -> None:
        if self._in_flight is None or not self._in_flight[1].is_set():
            return
        fragment, _ = self._in_flight
        snapshot = fragment.snapshot
        assert snapshot is not None
        if fragment.mirror is not None and sum(fragment.landed_counts) > 0:  # a window with no work leaves the outer state
            fragment.mirror.follow(snapshot.landing[: fragment.n_params])
        self.stats.late_steps.append(fragment.window_steps)
        merge_late_consensus(fragment.tensors, snapshot.stand_in, snapshot.landing, moved=fragment.window_steps > 0)
        self._in_flight = None
        self._count_window(fragment, fragment.landed_counts)

    def _count_window(self, fragment: _Fragment, counts: list[float]) -> None:
        self.stats.windows += 1
        self.stats.fragment_windows[fragment.index] += 1
        self.stats.last_counts = list(counts)


def _step_to_stand_in(fragment: _Fragment) -> None:
    """The stand-in the rank trains on until the consensus lands: what it sent, or for
    the params (eager update) the mirror's outer step of it, which the params move to.
    The consensus corrects the difference when it lands."""
    assert fragment.snapshot is not None
    n, stand_in, sent = fragment.n_params, fragment.snapshot.stand_in, fragment.snapshot.landing
    eager = fragment.mirror is not None and fragment.mirror.stand_in(sent[:n], stand_in[:n])
    copied_from = n if eager else 0  # what the mirror did not write is what was sent
    for s, t in zip(stand_in[copied_from:], sent[copied_from:], strict=True):
        s.copy_(t)
    if eager:
        for p, s in zip(fragment.params, stand_in[:n], strict=True):
            p.detach().copy_(s)


def _check_start_window(client: object, schedule: WindowSchedule, start_window: int) -> None:
    """A rank that joined a running fragmented cluster must say where it enters: from
    window 0's schedule it would open the wrong fragment's window (its relay would
    refuse it, and it would have trained the wrong fragments)."""
    state = getattr(client, "last_state", None)
    joined_at = None if state is None or not state.frames else state.entry
    if schedule.fragments > 1 and joined_at is not None and start_window != joined_at:
        raise ConfigError(
            f"this rank joined the cluster at window {joined_at} (what join() returned); pass "
            f"start_window={joined_at} so that its {schedule.fragments} fragments sync at the cluster's steps "
            f"(got start_window={start_window})"
        )


def _run_steps(inner_step: Callable[[], object], steps: int) -> int:
    """In the worker thread: ``steps`` inner steps."""
    for _ in range(steps):
        inner_step()
    return steps


@asynccontextmanager
async def open_window_trainer(
    client: _ReduceClientLike,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor] = (),
    *,
    rank: int,
    world_size: int,
    sync_every: int,
    overlap: int = 0,
    gamma: float = 1.0,
    bf16_wire: bool | None = None,
    outer: object | None = None,
    merge_after: int | None = None,
    fragments: int = 1,
    start_window: int = 0,
    merge_by: int | None = None,
    codec: DeltaCodec | str | None = None,
) -> AsyncIterator[WindowTrainer]:
    """A :class:`WindowTrainer` whose background rounds live in a nursery of its own.

    ``outer``: None (the default) trains the steps taken while a round is in
    flight from the params the rank sent; the controller's outer optimizer (an
    object of the same class and hyperparameters, e.g. ``DiLoCoNesterov(0.7, 0.9)``
    for ``--outer diloco``) makes the rank step to its own estimate of the outer
    step meanwhile (the eager stand-in; it ended at a higher loss on the demo's
    model, see docs/performance.md).
    ``merge_after``: merge each consensus after exactly this many inner steps of
    the next window (waiting for it if it has not landed), instead of as soon
    as it lands; the params then do not depend on the network's timing (with
    the cluster's deterministic mode, two runs end bit-identical) and no step
    runs further than that from the consensus.
    ``merge_by``: merge each consensus when it lands, but at the latest after
    this many inner steps of the next window (waiting for it there): the
    staleness is bounded, and a round that lands early is merged early. With
    DiLoCo the loss depends on it (docs/outer-and-checkpoints.md); give one of
    ``merge_after`` and ``merge_by``.
    ``codec`` (``"int8"``, ``"fp4"``, ``"int4"``, optionally ``":BLOCK"``): the
    params rounds carry coded deltas with error feedback (docs/wire.md, "Delta
    rounds"); set it on the client (``client.delta_codec``) before ``join()``
    instead when the rank may join a running cluster, so its base is kept.

    Leaving the block normally waits for the last round and merges it. A round
    that fails (the relay or controller gone, this rank declared dead) cancels
    the block and comes out as that one :class:`FlodlError`.
    """
    with one_error():
        async with trio.open_nursery() as nursery:
            schedule = WindowSchedule(sync_every, overlap, gamma, merge_after, fragments, merge_by)
            if bf16_wire is not None:  # the params rounds' wire dtype (step counts always go f32)
                client.bf16_wire = bf16_wire
            if codec is not None:
                client.delta_codec = codec if isinstance(codec, DeltaCodec) else DeltaCodec.parse(codec)
            trainer = WindowTrainer(
                client, params, buffers, rank=rank, world_size=world_size, schedule=schedule, outer=outer,
                nursery=nursery, start_window=start_window,
            )
            yield trainer
            await trainer.finish()


__all__ = ["TrainerStats", "WindowTrainer", "open_window_trainer"]
