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

No torch import: the tensors' own methods do the arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .errors import ConfigError
from .outer import DiLoCoNesterov, PlainAverage, SlowMo
from .realized_work import _ReduceClientLike, average_window
from .transport.tasks import one_error

if TYPE_CHECKING:
    import torch


@attrs.frozen
class WindowSchedule:
    """How a rank's windows run (see :func:`open_window_trainer` for each field)."""

    sync_every: int
    overlap: int = 0
    gamma: float = 1.0
    merge_after: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1 inner step, got {self.sync_every}")
        if self.overlap not in (0, 1):
            raise ConfigError(f"overlap must be 0 (wait for each window's round) or 1 (overlap it), got {self.overlap}")
        if self.merge_after is not None and not 1 <= self.merge_after <= self.sync_every:
            raise ConfigError(
                f"merge_after must be None (when it lands) or 1..sync_every={self.sync_every} steps, "
                f"got {self.merge_after}"
            )


@attrs.define
class TrainerStats:
    """What the window loop did, and what the network cost the trainer."""

    steps: int = 0  # inner steps taken
    windows: int = 0  # windows whose consensus was merged
    waited_s: float = 0.0  # time the trainer was held up by rounds (its accelerator idle)
    last_counts: list[float] = attrs.field(factory=list)  # step counts of the last merged window, per rank
    late_steps: list[int] = attrs.field(factory=list)  # per merged window: inner steps taken before it landed


def merge_late_consensus(
    live: Sequence[torch.Tensor], stand_in: Sequence[torch.Tensor], consensus: Sequence[torch.Tensor],
    *, moved: bool = True,
) -> None:
    """The merge rule, in place: ``live += consensus - stand_in``, tensor by tensor.

    ``stand_in`` (what the rank trained on from since the boundary: the params it
    sent, or the eager outer step of them) is overwritten with the correction
    ``consensus - stand_in`` (computed first, in the tensors' dtype), so the
    merge allocates nothing. When the rank has not ``moved`` since the boundary
    the rule says ``live = consensus``, and that is what it gets, bit for bit
    (``live + (consensus - live)`` may round differently on every rank).
    A model's parameters are written through ``detach()`` (their data, outside
    autograd), as an optimizer step writes them.
    """
    for p, b, c in zip(live, stand_in, consensus, strict=True):
        if not moved:
            p.detach().copy_(c)
            continue
        b.neg_().add_(c)
        p.detach().add_(b)


class OuterMirror:
    """The controller's outer optimizer, followed from the rank's side: its state
    (the outer params ``x`` and momentum ``m``) recovered from the consensus frames
    the rank receives, so the rank can compute its eager stand-in - the outer step
    the controller would take if the average were the rank's own boundary params.

    The recovery inverts the controller's update: SlowMo gives
    ``m = (x - x_new) / lr``; DiLoCo's Nesterov step gives
    ``m = (momentum * m + (x - x_new) / lr) / (1 + momentum)``. It is exact up to
    rounding; it only shapes the stand-in, never the consensus the rank ends on.
    """

    def __init__(self, nesterov: bool, lr: float, momentum: float) -> None:
        self.nesterov, self.lr, self.momentum = nesterov, lr, momentum
        self._x: list[Any] | None = None
        self._m: list[Any] = []

    @classmethod
    def of(cls, outer: object | None) -> OuterMirror | None:
        """The mirror of the controller's ``outer`` (None for plain averaging)."""
        if outer is None or isinstance(outer, PlainAverage):
            return None
        if isinstance(outer, SlowMo | DiLoCoNesterov):
            return cls(isinstance(outer, DiLoCoNesterov), outer.lr, outer.momentum)
        raise ConfigError(f"outer must be None, PlainAverage, SlowMo or DiLoCoNesterov (the controller's); got {outer!r}")

    def stand_in(self, boundary: Sequence[Any], out: Sequence[Any]) -> bool:
        """Write into ``out`` the outer step from ``boundary`` as the average; False (nothing
        written) before the first consensus told the mirror where the outer params are."""
        if self._x is None:
            return False
        beta = self.momentum
        for x, m, b, o in zip(self._x, self._m, boundary, out, strict=True):
            o.copy_(x).sub_(b)  # g = x - c
            if self.nesterov:  # x - lr ((1 + beta) g + beta^2 m)
                o.mul_(1 + beta).add_(m, alpha=beta * beta)
            else:  # x - lr (beta m + g)
                o.add_(m, alpha=beta)
            o.mul_(-self.lr).add_(x)
        return True

    def follow(self, new_x: Sequence[Any]) -> None:
        """The controller's output for a window with mass: update the mirrored state."""
        if self._x is None:  # the controller's first window only sets x
            self._x = [t.detach().clone() for t in new_x]
            self._m = [t.detach().clone().zero_() for t in new_x]
            return
        for x, m, new in zip(self._x, self._m, new_x, strict=True):
            x.sub_(new).div_(self.lr)  # (x - x_new) / lr
            if self.nesterov:
                m.mul_(self.momentum).add_(x).div_(1 + self.momentum)
            else:
                m.copy_(x)
            x.copy_(new)


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


class WindowTrainer:
    """Owns a trainer's window loop: counts inner steps, averages every ``sync_every``,
    overlapped with the next window's steps when ``overlap=1``.

    Open it with :func:`open_window_trainer` (trio) or
    ``BlockingReduceClient.window_trainer`` (plain Python); call :meth:`after_step`
    after every inner step, or let :meth:`run_steps` run the steps in a worker
    thread. Params and buffers are changed in place, only inside
    :meth:`after_step` and :meth:`finish` (never while an inner step runs).
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
    ) -> None:
        self._client = client
        self._tensors = [*params, *buffers]
        self._n_params = len(params)
        self.rank, self.world_size = rank, world_size
        self.schedule = schedule
        self.sync_every, self.overlap, self.merge_after = schedule.sync_every, schedule.overlap, schedule.merge_after
        self._nursery = nursery
        self._window_steps = 0
        self._snapshot: _Snapshot | None = None
        self._in_flight: trio.Event | None = None  # set when the background round landed
        self._landed_counts: list[float] = []
        self._mirror = OuterMirror.of(outer) if self.overlap else None
        self.stats = TrainerStats()

    # -- the loop --------------------------------------------------------------

    async def run_steps(self, steps: int, inner_step: Callable[[], object]) -> None:
        """Run ``inner_step`` (a forward, backward and optimizer step) ``steps`` times in
        a worker thread, so the event loop keeps the rounds and heartbeats moving.

        Steps run in the thread in one go up to the next point where the loop has
        work: the window's end or the merge point. While a round that is to be
        merged when it lands is in flight, they run one per hop, so the event
        loop (which moves that round) gets the interpreter between steps.
        """
        remaining = steps
        while remaining > 0:
            done = await trio.to_thread.run_sync(_run_steps, inner_step, self._steps_in_one_go(remaining))
            remaining -= done
            await self._advance(done)

    def _steps_in_one_go(self, remaining: int) -> int:
        """Steps that may run before the loop must act: to the window's end and the merge point."""
        stop = min(remaining, self.sync_every - self._window_steps)
        if self._in_flight is not None:
            if self.merge_after is None:
                return 1
            if self._window_steps < self.merge_after:
                stop = min(stop, self.merge_after - self._window_steps)
        return stop

    async def after_step(self) -> None:
        """One inner step is done: merge a round that landed, end the window if it is due."""
        await self._advance(1)

    async def _advance(self, steps: int) -> None:
        self.stats.steps += steps
        self._window_steps += steps
        if self.merge_after is None:
            self._merge_if_landed()
        elif self._in_flight is not None and self._window_steps >= self.merge_after:
            await self._wait_in_flight()  # a fixed merge point: the same step on every run
        if self._window_steps >= self.sync_every:
            await self._end_window()

    async def finish(self) -> None:
        """Wait for a round still in flight and merge it (steps after the last full
        window are kept local: every rank must run the same number of windows)."""
        await self._wait_in_flight()

    # -- windows ---------------------------------------------------------------

    async def _end_window(self) -> None:
        await self._wait_in_flight()  # one round at a time per connection
        steps, self._window_steps = self._window_steps, 0
        if self.overlap == 0:
            started = time.monotonic()
            result = await self._average(self._params(), self._buffers(), steps)
            self.stats.waited_s += time.monotonic() - started
            self._count_window(result.counts)
            return
        if self._snapshot is None:
            self._snapshot = _Snapshot.like(self._tensors)
        for sent, t in zip(self._snapshot.landing, self._tensors, strict=True):
            sent.copy_(t)
        self._step_to_stand_in()
        self._in_flight = trio.Event()
        self._nursery.start_soon(self._background_round, steps, self._in_flight)

    def _step_to_stand_in(self) -> None:
        """The stand-in the rank trains on until the consensus lands: what it sent, or for
        the params (eager update) the mirror's outer step of it, which the params move to.
        The consensus corrects the difference when it lands."""
        assert self._snapshot is not None
        n, stand_in, sent = self._n_params, self._snapshot.stand_in, self._snapshot.landing
        eager = self._mirror is not None and self._mirror.stand_in(sent[:n], stand_in[:n])
        copied_from = n if eager else 0  # what the mirror did not write is what was sent
        for s, t in zip(stand_in[copied_from:], sent[copied_from:], strict=True):
            s.copy_(t)
        if eager:
            for p, s in zip(self._params(), stand_in[:n], strict=True):
                p.detach().copy_(s)

    async def _background_round(self, steps: int, landed: trio.Event) -> None:
        assert self._snapshot is not None
        sent = self._snapshot.landing
        result = await self._average(sent[: self._n_params], sent[self._n_params:], steps)
        self._landed_counts = result.counts
        landed.set()

    async def _average(self, params: Sequence[Any], buffers: Sequence[Any], steps: int) -> Any:
        return await average_window(
            self._client, params, buffers, steps, rank=self.rank, world_size=self.world_size, gamma=self.schedule.gamma,
            in_place=True,
        )

    async def _wait_in_flight(self) -> None:
        if self._in_flight is None:
            return
        if not self._in_flight.is_set():
            started = time.monotonic()
            await self._in_flight.wait()
            self.stats.waited_s += time.monotonic() - started
        self._merge_if_landed()

    def _merge_if_landed(self) -> None:
        if self._in_flight is None or not self._in_flight.is_set():
            return
        assert self._snapshot is not None
        if self._mirror is not None and sum(self._landed_counts) > 0:  # a window with no work leaves the outer state
            self._mirror.follow(self._snapshot.landing[: self._n_params])
        moved = self._window_steps > 0
        self.stats.late_steps.append(self._window_steps)
        merge_late_consensus(self._tensors, self._snapshot.stand_in, self._snapshot.landing, moved=moved)
        self._in_flight = None
        self._count_window(self._landed_counts)

    def _count_window(self, counts: list[float]) -> None:
        self.stats.windows += 1
        self.stats.last_counts = list(counts)

    def _params(self) -> list[Any]:
        return self._tensors[: self._n_params]

    def _buffers(self) -> list[Any]:
        return self._tensors[self._n_params:]


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
) -> AsyncIterator[WindowTrainer]:
    """A :class:`WindowTrainer` whose background rounds live in a nursery of its own.

    ``outer``: the controller's outer optimizer (an object of the same class and
    hyperparameters, e.g. ``DiLoCoNesterov(0.7, 0.9)`` for ``--outer diloco``);
    with ``overlap=1`` the rank steps to its own estimate of the outer step while
    the round is in flight instead of staying at its boundary params.
    ``merge_after``: merge each consensus after exactly this many inner steps of
    the next window (waiting for it if it has not landed), instead of as soon
    as it lands; the params then do not depend on the network's timing (with
    the cluster's deterministic mode, two runs end bit-identical) and no step
    runs further than that from the consensus.

    Leaving the block normally waits for the last round and merges it. A round
    that fails (the relay or controller gone, this rank declared dead) cancels
    the block and comes out as that one :class:`FlodlError`.
    """
    with one_error():
        async with trio.open_nursery() as nursery:
            schedule = WindowSchedule(sync_every, overlap, gamma, merge_after)
            if bf16_wire is not None:  # the params rounds' wire dtype (step counts always go f32)
                client.bf16_wire = bf16_wire
            trainer = WindowTrainer(
                client, params, buffers, rank=rank, world_size=world_size, schedule=schedule, outer=outer,
                nursery=nursery,
            )
            yield trainer
            await trainer.finish()


__all__ = ["OuterMirror", "TrainerStats", "WindowSchedule", "WindowTrainer", "merge_late_consensus", "open_window_trainer"]
