"""The controller's consensus checkpointer: record each window, write it off the round path.

:class:`ConsensusCheckpointer` is a :class:`~flodl_trio.controller.CheckpointSink`.
The controller calls it with every round's consensus, and it tells windows
apart by round kind: a Control round (the step-count gather) opens a window,
the first Model round after it is the params round (already transformed by the
outer optimizer, i.e. what the ranks adopt), the second is the float-buffers
round::

    outer = DiLoCoNesterov()
    async with ConsensusCheckpointer("ckpt/", keep=3, outer=outer) as sink:
        async with open_controller(host, port, world_size=8, salt=salt,
                                   outer_optimizer=outer, checkpoint=sink) as controller:
            await controller.wait_finished()
    # leaving the checkpointer's block writes the last window and waits for the writer

The call is synchronous because it sits on the round's critical path: it only
copies the arrays it will write and hands the window to a writer task over a
one-slot memory channel. The writer runs each file write (fsync and rename
included) in a worker thread, so neither the round nor the event loop waits
for the disk. A writer still busy when another window completes keeps only
the newest pending one (latest wins; logged and counted), so memory stays
bounded at one window being written, one pending and one being recorded.

The file format and the readers are in :mod:`flodl_trio.wire.checkpoint`.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

import attrs
import numpy as np
import numpy.typing as npt
import trio

from .._version import __version__
from ..errors import ConfigError
from ..fold.outer import DiLoCoNesterov, PlainAverage, SlowMo, consensus_as_f32
from ..transport.tasks import one_error
from ..wire.bf16 import DTYPE_NAMES
from ..wire.checkpoint import (
    FORMAT,
    TEMP_RE,
    checkpoint_name,
    list_checkpoints,
    write_safetensors_atomic,
)
from ..wire.fragment import FragmentTag, fragment_of, piece_range
from ..wire.round_frame import RoundFrame, RoundKind

# The name operators already filter on; the checkpointer's messages keep it.
log = logging.getLogger("flodl_trio.checkpoint")


class StatefulOuter(Protocol):
    """An outer optimizer whose state goes into checkpoints."""

    def state_dict(self) -> Mapping[str, np.ndarray]: ...


@attrs.define(eq=False)
class _Snapshot:
    """One window's arrays, owned (copied off the controller's buffers)."""

    window: int
    round_index: int
    params: list[npt.NDArray[np.float32]]
    mass: float
    wire_dtype: str
    outer_state: dict[str, np.ndarray] | None
    outer_config: dict[str, object] | None
    buffers: list[npt.NDArray[np.float32]] | None = None
    buffers_round: int | None = None
    buffers_mass: float = 0.0
    buffers_absent: bool = False
    fragment: FragmentTag | None = None  # the fragment whose window this is (None: unfragmented)

    def tensors(self) -> list[tuple[str, np.ndarray]]:
        out = [(f"params.{i}", a) for i, a in enumerate(self.params)]
        out += [(f"buffers.{i}", a) for i, a in enumerate(self.buffers or [])]
        out += [(f"outer.{k}", a) for k, a in sorted((self.outer_state or {}).items())]
        return out

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "window": str(self.window),
            "round": str(self.round_index),
            "mass": repr(float(self.mass)),
            "buffers_round": "" if self.buffers_round is None else str(self.buffers_round),
            "buffers_mass": repr(float(self.buffers_mass)),
            "buffers": "absent" if self.buffers_absent else ("present" if self.buffers else "none"),
            "wire_dtype": self.wire_dtype,
            "params_count": str(len(self.params)),
            "buffers_count": str(len(self.buffers or [])),
            "outer": json.dumps(self.outer_config) if self.outer_config is not None else "",
            "fragments": "" if self.fragment is None else str(self.fragment.count),
            "fragment": "" if self.fragment is None else str(self.fragment.index),
            "flodl_trio_version": __version__,
            "created_unix": f"{time.time():.3f}",
        }


def _wire_dtype_name(frame: RoundFrame) -> str:
    names = {DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in frame.tensors}
    if len(names) == 1:
        return names.pop()
    return "mixed" if names else "f32"


_BUILTIN_OUTERS = (PlainAverage, SlowMo, DiLoCoNesterov)  # their state_dict() already returns copies


class _Stage(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class ConsensusCheckpointer:
    """Write each window's consensus (params, float buffers, outer state) to ``directory``.

    - ``every``: checkpoint windows whose index is a multiple of ``every``
      (others are not even copied).
    - ``keep``: how many newest files survive pruning.
    - ``outer``: the controller's outer optimizer, whose ``state_dict()`` is
      saved as ``outer.*`` tensors (snapshotted at the window's params round).
    - ``start_window``: index of the first window seen; by default one past
      the newest checkpoint already in ``directory`` (so a resumed run neither
      overwrites nor prunes away its new files). By default, a controller
      started again on its resume record sets it from the run's window count
      (:meth:`reopen_window`).

    Use it once, as ``async with``: the block runs the writer task. Leaving the
    block, however it is left, writes the window being recorded (even without
    its buffers round) and whatever is pending, then waits for the writer
    (shielded from cancellation: the last window is the one a restart needs).
    Windows completed before the block opens wait (latest wins) and are written
    once it does. One checkpointer per directory: opening removes stale temp
    files of interrupted writes.

    With fragments (a tagged Control round opens each fragment's window) it
    keeps each fragment's newest params and writes the whole model each due
    window, once every fragment has had one (docs/outer-and-checkpoints.md).

    Outcomes, for monitoring and tests: ``written`` (paths), ``skipped_windows``
    (dropped for a newer one), ``failures`` and ``last_error`` (recording or
    writing errors, which are logged and never raised into the controller).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int = 1,
        keep: int = 3,
        outer: StatefulOuter | None = None,
        start_window: int | None = None,
    ) -> None:
        if int(every) < 1:
            raise ConfigError(f"every must be >= 1, got {every}")
        if int(keep) < 1:
            raise ConfigError(f"keep must be >= 1, got {keep}")
        if start_window is not None and start_window < 0:
            raise ConfigError(f"start_window must be >= 0, got {start_window}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every = int(every)
        self.keep = int(keep)
        self.outer = outer
        self._numbered_here = start_window is None  # (not set by the caller: a restart may set it)
        if start_window is None:
            existing = list_checkpoints(self.directory)
            start_window = existing[-1][0] + 1 if existing else 0
        self.next_window = start_window
        # Round-kind tracking (the controller's task only).
        self._window_open = False
        self._model_rounds = 0
        self._current: _Snapshot | None = None
        self._warned_unwindowed = False
        self._warned_extra = False
        self._warned_unopened = False
        # Fragmented windows: each fragment's newest params (f32, replaced whole), the newest buffers.
        self._fragment: FragmentTag | None = None
        self._fragments: list[list[npt.NDArray[np.float32]] | None] = []
        self._fragment_buffers: list[npt.NDArray[np.float32]] | None = None
        # Handoff to the writer task: one slot, the pending window.
        self._send, self._receive = trio.open_memory_channel[_Snapshot](1)
        self._stage = _Stage.NEW
        self._running: AbstractAsyncContextManager[None] | None = None
        self._outstanding = 0  # windows pending or being written
        self._idle = trio.Event()
        self._idle.set()
        # Outcomes.
        self.written: list[Path] = []
        self.skipped_windows: list[int] = []
        self.failures = 0
        self.last_error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._stage is not _Stage.NEW:
            raise ConfigError(f"this ConsensusCheckpointer is {self._stage.value}; make a new one")
        self._stage = _Stage.OPEN  # before any await: a second entry fails at once
        self._running = self._run_writer()
        await self._running.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._running is not None
        return await self._running.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _run_writer(self) -> AsyncIterator[None]:
        await trio.to_thread.run_sync(self._remove_stale_temps)
        # The writer never raises: a group holds the caller's own exception; give it back as itself.
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_submitted)
                try:
                    yield
                finally:
                    self._close_intake()

    def _close_intake(self) -> None:
        """Submit the window being recorded, then end the writer's input (it drains what is there)."""
        current, self._current = self._current, None
        if current is not None:
            self._submit(current)
        self._stage = _Stage.CLOSED
        self._send.close()

    async def wait_idle(self) -> None:
        """Return once every window submitted so far has been written (or has failed).

        It has no timeout of its own: put ``trio.fail_after`` around it. Before
        the block opens nothing is written, so it waits for that too.
        """
        while self._outstanding:
            await self._idle.wait()

    # -- the sink (controller's task; must be quick and never raise) -----------

    def __call__(self, round_index: int, consensus: RoundFrame) -> None:
        try:
            if consensus.kind == RoundKind.CONTROL:
                self._on_control(fragment_of(consensus))
            else:
                self._on_model(round_index, consensus)
        except Exception as exc:  # a checkpoint problem must never stop training
            self._record_failure(f"could not record round {round_index}", exc)

    def wants_round(self, kind: RoundKind) -> bool:
        """Whether the next round of ``kind`` is one this checkpointer records. With
        reduction shards the controller holds a round whole only when asked (the shards
        copy it there), so it asks this first: a due window's params and buffers rounds,
        every round of a run that syncs fragments (each fragment's newest params make
        the model), and every Control round."""
        if kind == RoundKind.CONTROL:
            return True
        if not self._window_open or self._fragment is not None:
            return self._window_open
        if self._model_rounds == 0:
            return self.next_window % self.every == 0
        return self._model_rounds == 1 and self._current is not None

    def skip_round(self, round_index: int, kind: RoundKind, weight: float) -> None:
        """A round :meth:`wants_round` said no to went by without its consensus here:
        its window is counted as if it had come."""
        try:
            if kind == RoundKind.CONTROL:  # (never skipped: wants_round takes every Control round)
                self._on_control(None)
            else:
                self._on_model(round_index, None)
        except Exception as exc:
            self._record_failure(f"could not count round {round_index}", exc)

    def reopen_window(self, model_rounds: int, fragment: FragmentTag | None, windows: int | None = None) -> None:
        """A controller started again on its resume record goes on inside the window that
        was open (``model_rounds`` of its Model rounds done, syncing ``fragment``): its
        later rounds are that window's. What the lost controller had recorded of the
        window's earlier rounds is gone, so a window whose params round was done
        before the restart is not saved here (a lost checkpointer whose block was left
        wrote it as it had it: the params, without the buffers).

        ``windows``: the run's window count (windows opened, the open one included).
        Unless ``start_window`` was given, the next params round is numbered from it, as
        the lost controller's checkpointer would have numbered it (the files are those
        of the run uninterrupted: with ``every`` > 1 windows not due wrote none, so the
        newest file does not say where the run is). That holds where the run's first
        window was window 0 here; a directory with newer files than that (the run
        itself resumed after an earlier run's checkpoints) keeps numbering after them.
        """
        self._on_control(fragment)
        self._model_rounds = model_rounds
        if windows is None or not self._numbered_here:
            return
        window = windows - 1 if model_rounds == 0 else windows  # the next params round's
        existing = list_checkpoints(self.directory)
        newest = existing[-1][0] if existing else -1
        # newest == window: the lost checkpointer wrote this window as it stopped (its params
        # round was not in the record): the round runs again, and its file is written again.
        self.next_window = window if newest <= window else newest + 1

    def _on_control(self, fragment: FragmentTag | None) -> None:
        if self._current is not None:
            # The previous window had no buffers round (a model without float buffers).
            self._submit(self._current)
            self._current = None
        self._window_open = True
        self._model_rounds = 0
        self._fragment = fragment
        if fragment is not None and len(self._fragments) != fragment.count:
            self._fragments = [None] * fragment.count  # a new fragment layout: start over

    def _on_model(self, round_index: int, consensus: RoundFrame | None) -> None:
        """A Model round (None: one the controller did not hold whole, which
        :meth:`wants_round` did not want)."""
        if not self._window_open:
            if not self._warned_unwindowed:
                self._warned_unwindowed = True
                log.info(
                    "checkpoint: round %d is a Model round outside a window (no Control round before it); "
                    "only average_window-style windows are checkpointed", round_index,
                )
            return
        self._model_rounds += 1
        if self._model_rounds == 1:
            self._on_params(round_index, consensus)
        elif self._model_rounds == 2:
            self._on_buffers(round_index, consensus)
        elif not self._warned_extra:
            self._warned_extra = True
            log.info("checkpoint: round %d is a third Model round in one window; ignored", round_index)

    def _on_params(self, round_index: int, consensus: RoundFrame | None) -> None:
        window = self.next_window
        self.next_window += 1
        if consensus is None:
            return  # (not due)
        if not consensus.weight > 0:
            log.info("checkpoint: window %d had zero accepted mass (the ranks kept their params); not saved", window)
            return
        fragment = self._fragment
        if fragment is not None:
            self._fragments[fragment.index] = consensus_as_f32(consensus, copy=True)
        if window % self.every:
            return
        params = self._model_params(window, consensus)
        if params is None:
            return
        outer_state, outer_config = self._outer_snapshot()
        self._current = _Snapshot(
            window=window,
            round_index=round_index,
            params=params,
            mass=float(consensus.weight),
            wire_dtype=_wire_dtype_name(consensus),
            outer_state=outer_state,
            outer_config=outer_config,
            fragment=fragment,
        )
        if fragment is not None and self._fragment_buffers is not None:
            self._current.buffers = self._fragment_buffers  # the newest, until this window brings its own

    def _model_params(self, window: int, consensus: RoundFrame) -> list[npt.NDArray[np.float32]] | None:
        """The whole model's params as of this window: the consensus itself, or with
        fragments every fragment's newest (None until each has had a window)."""
        if self._fragment is None:
            return consensus_as_f32(consensus, copy=True)
        missing = [i for i, arrays in enumerate(self._fragments) if arrays is None]
        if missing:
            log.info("checkpoint: window %d not saved: fragments %s of %d have had no window with mass yet",
                     window, missing, len(self._fragments))
            return None
        return self._joined_fragments(window, [arrays for arrays in self._fragments if arrays is not None])

    def _joined_fragments(
        self, window: int, fragments: list[list[npt.NDArray[np.float32]]]
    ) -> list[npt.NDArray[np.float32]] | None:
        """The model's params from every fragment's newest pieces (fragment p holds run p
        of every tensor's elements; the Control round's shapes say how to put them back)."""
        assert self._fragment is not None
        shapes, count = self._fragment.shapes, len(fragments)
        fits = bool(shapes) and all(len(arrays) == len(shapes) for arrays in fragments) and all(
            arrays[i].size == stop - start
            for i, shape in enumerate(shapes)
            for p, arrays in enumerate(fragments)
            for start, stop in [piece_range(math.prod(shape), count, p)]
        )
        if not fits:
            log.warning("checkpoint: window %d not saved: the fragments' pieces %s do not cut the model's %d tensors "
                        "as its Control round's shapes say", window, [len(a) for a in fragments], len(shapes))
            return None
        return [np.concatenate([arrays[i].reshape(-1) for arrays in fragments]).reshape(shape)
                for i, shape in enumerate(shapes)]

    def _outer_snapshot(self) -> tuple[dict[str, np.ndarray] | None, dict[str, object] | None]:
        """The outer optimizer's state (owned) and config at this params round."""
        if self.outer is None:
            return None, None
        state = self.outer.state_dict()
        builtin = isinstance(self.outer, _BUILTIN_OUTERS)
        owned = {k: (np.asarray(v) if builtin else np.array(v, copy=True)) for k, v in state.items()}
        config = getattr(self.outer, "config", None)
        return owned, (config() if callable(config) else {"type": type(self.outer).__name__})

    def _on_buffers(self, round_index: int, consensus: RoundFrame | None) -> None:
        snap, self._current = self._current, None
        if consensus is None:
            return  # (no window due)
        buffers = consensus_as_f32(consensus, copy=True) if consensus.weight > 0 and (
            snap is not None or self._fragment is not None) else None
        if self._fragment is not None and buffers is not None:
            self._fragment_buffers = buffers  # the newest, for the other fragments' checkpoints
        if snap is None:
            return  # window not due, or zero mass
        snap.buffers_round = round_index
        snap.buffers_mass = float(consensus.weight)
        if buffers is not None:
            snap.buffers = buffers
        else:
            snap.buffers = None
            snap.buffers_absent = True  # the ranks kept their own buffers: nothing common to save
        self._submit(snap)

    def _submit(self, snap: _Snapshot) -> None:
        """Hand a complete window to the writer without waiting; a pending one is replaced (latest wins)."""
        if self._stage is _Stage.CLOSED:
            log.warning("checkpoint: window %d completed after the checkpointer closed; not saved", snap.window)
            return
        if self._stage is _Stage.NEW and not self._warned_unopened:
            self._warned_unopened = True
            log.warning("checkpoint: ConsensusCheckpointer used before its async with block; "
                        "windows wait until the block opens")
        try:
            self._send.send_nowait(snap)
        except trio.WouldBlock:
            self._replace_pending(snap)
        else:
            self._add_outstanding()

    def _replace_pending(self, snap: _Snapshot) -> None:
        # The slot is full only while no writer waits on it, so nothing can take it in between.
        dropped = self._receive.receive_nowait()
        self.skipped_windows.append(dropped.window)
        log.warning(
            "checkpoint: writer is behind; window %d skipped, window %d replaces it (latest wins)",
            dropped.window, snap.window,
        )
        self._send.send_nowait(snap)

    def _add_outstanding(self) -> None:
        if self._outstanding == 0:
            self._idle = trio.Event()
        self._outstanding += 1

    def _settle_one(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle.set()

    def _record_failure(self, what: str, exc: Exception) -> None:
        self.failures += 1
        self.last_error = exc
        log.error("checkpoint: %s: %s", what, exc, exc_info=exc)

    # -- the writer task ---------------------------------------------------------

    async def _write_submitted(self) -> None:
        """Write windows as they come until the intake closes.

        Shielded, so that leaving the block by cancellation or an error still
        writes the last windows (the ones worth having); it always ends, because
        leaving the block closes the intake.
        """
        with trio.CancelScope(shield=True):
            async with self._receive:
                async for snap in self._receive:
                    await self._write_one(snap)

    async def _write_one(self, snap: _Snapshot) -> None:
        try:
            path = await trio.to_thread.run_sync(self._store, snap)
        except Exception as exc:
            self._record_failure(f"writing window {snap.window} failed", exc)
        else:
            self.written.append(path)
        finally:
            self._settle_one()

    def _store(self, snap: _Snapshot) -> Path:
        """Worker thread: write the file, then prune to ``keep``."""
        path = self._write(snap)
        self._prune()
        return path

    def _write(self, snap: _Snapshot) -> Path:
        path = self.directory / checkpoint_name(snap.window)
        write_safetensors_atomic(path, snap.tensors(), snap.metadata())
        log.info("checkpoint: wrote %s (round %d, mass %g)", path, snap.round_index, snap.mass)
        return path

    def _prune(self) -> None:
        found = list_checkpoints(self.directory)
        for _window, path in found[: max(0, len(found) - self.keep)]:
            try:
                path.unlink()
                log.info("checkpoint: pruned %s", path)
            except FileNotFoundError:
                pass

    def _remove_stale_temps(self) -> None:
        for name in os.listdir(self.directory):
            if TEMP_RE.match(name):
                try:
                    (self.directory / name).unlink()
                    log.info("checkpoint: removed %s, left by an interrupted write", name)
                except OSError:
                    pass


__all__ = ["ConsensusCheckpointer", "StatefulOuter"]
