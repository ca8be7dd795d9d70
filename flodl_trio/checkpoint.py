"""Consensus checkpoints: the controller's record of each window's averaged model.

:class:`ConsensusCheckpointer` is a :class:`~flodl_trio.controller.CheckpointSink`.
The controller calls it with every round's consensus, and it tells windows apart
by round kind: a Control round (the step-count gather) opens a window, the
first Model round after it is the params round (already transformed by the
outer optimizer, i.e. what the ranks adopt), the second is the float-buffers
round. On the round's critical path it only copies the arrays it will write;
a background thread writes the file::

    outer = DiLoCoNesterov()
    async with ConsensusCheckpointer("ckpt/", keep=3, outer=outer) as sink:
        async with open_controller(host, port, world_size=8, salt=salt,
                                   outer_optimizer=outer, checkpoint=sink) as controller:
            await controller.wait_finished()
    # leaving the checkpointer's block writes the last window and joins its thread

Files are safetensors (written here with numpy, no dependency), atomically:
a temp file in the same directory, fsync, ``os.replace``, fsync of the
directory. Only the newest ``keep`` ``window-NNNNNN.safetensors`` survive. If
the writer is still busy when another window completes, the pending one is
dropped for the newer (latest wins; logged): memory stays bounded at one
window being written, one pending and one being recorded.

Reading back is :func:`load_checkpoint` / :func:`latest_checkpoint` (numpy);
a rank resumes with :func:`restore_module` (imports torch when called).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import trio

from .errors import ConfigError, FlodlError, SchemaError
from .outer import DiLoCoNesterov, PlainAverage, SlowMo, consensus_as_f32
from .wire.bf16 import DTYPE_NAMES
from .wire.round_frame import RoundFrame, RoundKind

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flodl_trio.checkpoint")

FORMAT = "flodl_trio.checkpoint.v1"
FILE_RE = re.compile(r"^window-(\d+)\.safetensors$")
TEMP_RE = re.compile(r"^\.window-\d+\.safetensors\.tmp-")

_ST_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_ST_NAMES = {dt: name for name, dt in _ST_DTYPES.items()}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit


class CheckpointError(FlodlError):
    """A checkpoint file is missing, malformed, or not a flodl_trio checkpoint."""


class StatefulOuter(Protocol):
    """An outer optimizer whose state goes into checkpoints."""

    def state_dict(self) -> Mapping[str, np.ndarray]: ...


def checkpoint_name(window: int) -> str:
    return f"window-{window:06d}.safetensors"


def _version() -> str:
    import flodl_trio

    return str(getattr(flodl_trio, "__version__", "unknown"))


# ---------------------------------------------------------------------------
# safetensors, numpy only
# ---------------------------------------------------------------------------


def _st_dtype(array: np.ndarray, name: str) -> str:
    dt = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    try:
        return _ST_NAMES[np.dtype(dt)]
    except KeyError:
        raise CheckpointError(f"tensor {name!r}: dtype {array.dtype} cannot go into a checkpoint") from None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_safetensors_atomic(path: Path, tensors: Sequence[tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> None:
    """Write a safetensors file at ``path`` atomically (temp + fsync + replace + dir fsync).

    Readers see either the old file, no file, or the complete new one.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    arrays: list[np.ndarray] = []
    offset = 0
    for name, array in tensors:
        if name in header:
            raise CheckpointError(f"duplicate tensor name {name!r}")
        dtype = _st_dtype(array, name)
        flat = np.ascontiguousarray(array, dtype=_ST_DTYPES[dtype])
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + flat.nbytes]}
        offset += flat.nbytes
        arrays.append(flat)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the library aligns the data section to 8 bytes
    directory = path.parent
    temp = directory / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for flat in arrays:
                if flat.nbytes:
                    f.write(flat.reshape(-1).data.cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of a safetensors file (writable arrays over one buffer) and its metadata."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = bytearray(size)
            got = f.readinto(raw)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from None
    if got != size or size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file")
    (n,) = struct.unpack_from("<Q", raw, 0)
    if n > min(_MAX_HEADER, size - 8):
        raise CheckpointError(f"{path}: header length {n} does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(raw[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r}: bad header entry {info!r}") from None
        count = math.prod(shape)
        if not 0 <= begin <= end <= data_len or end - begin != count * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r}: offsets [{begin}, {end}] do not hold {list(shape)} x "
                f"{dtype.itemsize} bytes within a {data_len}-byte data section"
            )
        tensors[name] = np.frombuffer(raw, dtype=dtype, count=count, offset=data_start + begin).reshape(shape)
    return tensors, metadata


# ---------------------------------------------------------------------------
# reading checkpoints
# ---------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Checkpoint:
    """One consensus checkpoint, as numpy arrays.

    ``params`` and ``buffers`` are f32 in the order the ranks sent them;
    ``outer`` is the outer optimizer's state (its ``state_dict`` keys, without
    the ``outer.`` prefix; empty without one); ``metadata`` the raw strings.
    """

    params: list[np.ndarray]
    buffers: list[np.ndarray]
    outer: dict[str, np.ndarray]
    metadata: dict[str, str]
    path: Path | None = None

    @property
    def window(self) -> int:
        return int(self.metadata["window"])

    @property
    def round_index(self) -> int:
        """The controller's round counter at this window's params round."""
        return int(self.metadata["round"])

    @property
    def mass(self) -> float:
        """Accepted mass of the params round."""
        return float(self.metadata["mass"])

    @property
    def buffers_mass(self) -> float:
        return float(self.metadata.get("buffers_mass", "0"))

    @property
    def wire_dtype(self) -> str:
        return self.metadata["wire_dtype"]

    @property
    def version(self) -> str:
        return self.metadata.get("flodl_trio_version", "unknown")

    @property
    def outer_config(self) -> dict[str, Any] | None:
        raw = self.metadata.get("outer", "")
        return json.loads(raw) if raw else None


def _indexed(tensors: dict[str, np.ndarray], prefix: str, path: Path) -> list[np.ndarray]:
    found: dict[int, np.ndarray] = {}
    for name, array in tensors.items():
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            found[int(name[len(prefix) :])] = array
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{path}: {prefix}N tensors are not numbered 0..n-1: {sorted(found)}")
    return [found[i] for i in range(len(found))]


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint written by :class:`ConsensusCheckpointer`."""
    path = Path(path)
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a flodl_trio checkpoint (format {metadata.get('format')!r}, want {FORMAT!r})")
    params = _indexed(tensors, "params.", path)
    buffers = _indexed(tensors, "buffers.", path)
    for what, got in (("params", params), ("buffers", buffers)):
        declared = int(metadata.get(f"{what}_count", len(got)))
        if declared != len(got):
            raise CheckpointError(f"{path}: metadata declares {declared} {what} tensors, the file holds {len(got)}")
    outer = {name[len("outer.") :]: a for name, a in tensors.items() if name.startswith("outer.")}
    known = len(params) + len(buffers) + len(outer)
    if known != len(tensors):
        extra = sorted(n for n in tensors if not n.startswith(("params.", "buffers.", "outer.")))
        raise CheckpointError(f"{path}: unexpected tensors {extra}")
    return Checkpoint(params, buffers, outer, metadata, path)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(window, path)`` of every checkpoint file in ``directory``, oldest first."""
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), directory / name) for name in names if (m := FILE_RE.match(name))]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest (highest window) checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------
# rank side
# ---------------------------------------------------------------------------


def restore_module(module: torch.nn.Module, checkpoint: Checkpoint, *, buffers: bool = True) -> None:
    """Copy a checkpoint into ``module``: its parameters, then its float buffers,
    in registration order (``module.parameters()`` / floating ``module.buffers()``:
    the order a rank passes them to ``average_window``).

    Everything is checked before anything is copied; a count or shape mismatch
    raises :class:`SchemaError` naming the index, the module's name for it and
    both shapes. ``buffers=False`` restores the parameters only. Values are
    cast to each tensor's dtype and device.
    """
    import torch

    named_params: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    named_buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()] if buffers else []
    pairs: list[tuple[torch.Tensor, np.ndarray]] = []
    groups = [("parameter", named_params, checkpoint.params)]
    if buffers:
        groups.append(("float buffer", named_buffers, checkpoint.buffers))
    for what, named, stored in groups:
        if len(named) != len(stored):
            hint = ""
            if what == "float buffer" and not stored and checkpoint.metadata.get("buffers", "") == "absent":
                hint = " (this window's buffers round had zero mass; pass buffers=False to restore parameters only)"
            raise SchemaError(
                f"restore_module: the checkpoint holds {len(stored)} {what}s, the module has {len(named)}{hint}"
            )
        for i, ((name, tensor), array) in enumerate(zip(named, stored)):
            if tuple(tensor.shape) != tuple(array.shape):
                raise SchemaError(
                    f"restore_module: {what} {i} ({name}): the checkpoint has shape {list(array.shape)}, "
                    f"the module has {list(tensor.shape)}"
                )
            pairs.append((tensor, array))
    with torch.no_grad():
        for tensor, array in pairs:
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(array)))


# ---------------------------------------------------------------------------
# the controller-side sink
# ---------------------------------------------------------------------------


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
            "flodl_trio_version": _version(),
            "created_unix": f"{time.time():.3f}",
        }


def _wire_dtype_name(frame: RoundFrame) -> str:
    names = {DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in frame.tensors}
    if len(names) == 1:
        return names.pop()
    return "mixed" if names else "f32"


_BUILTIN_OUTERS = (PlainAverage, SlowMo, DiLoCoNesterov)  # their state_dict() already returns copies


class ConsensusCheckpointer:
    """Write each window's consensus (params, float buffers, outer state) to ``directory``.

    - ``every``: checkpoint windows whose index is a multiple of ``every``
      (others are not even copied).
    - ``keep``: how many newest files survive pruning.
    - ``outer``: the controller's outer optimizer, whose ``state_dict()`` is
      saved as ``outer.*`` tensors (snapshotted at the window's params round).
    - ``start_window``: index of the first window seen; by default one past
      the newest checkpoint already in ``directory`` (so a resumed run neither
      overwrites nor prunes away its new files).

    Lifecycle: ``async with`` (or ``with``, or :meth:`start` / :meth:`close`).
    Closing writes the window being recorded (even without its buffers round),
    then joins the writer thread. Called while not started, it starts the
    thread itself (with a warning): close it anyway, or the last window is lost.
    One checkpointer per directory: starting removes stale temp files of
    interrupted writes.
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
        if start_window is None:
            existing = list_checkpoints(self.directory)
            start_window = existing[-1][0] + 1 if existing else 0
        self.next_window = start_window
        # Round-kind tracking (controller's task only).
        self._window_open = False
        self._model_rounds = 0
        self._current: _Snapshot | None = None
        self._warned_unwindowed = False
        self._warned_extra = False
        # Handoff to the writer thread.
        self._cond = threading.Condition()
        self._pending: _Snapshot | None = None
        self._busy = False
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Outcomes (read them after close, or under no particular lock for monitoring).
        self.written: list[Path] = []
        self.skipped_windows: list[int] = []
        self.failures = 0
        self.last_error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread (idempotent)."""
        with self._cond:
            if self._closed or self._closing:
                raise ConfigError("this ConsensusCheckpointer is closed; make a new one")
            if self._thread is not None:
                return
            self._remove_stale_temps()
            self._thread = threading.Thread(target=self._writer, name=f"flodl-checkpoint:{self.directory}", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Write what is pending (including a window still being recorded), stop the thread."""
        with self._cond:
            if self._closed:
                return
            current, self._current = self._current, None
            if current is not None:
                self._handoff_locked(current)
            self._closing = True
            need_thread = self._thread is None and self._pending is not None
            self._cond.notify_all()
        if need_thread:
            self._thread = threading.Thread(target=self._writer, name=f"flodl-checkpoint:{self.directory}", daemon=True)
            self._thread.start()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            self._closed = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or being written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def __enter__(self) -> ConsensusCheckpointer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ConsensusCheckpointer:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The final write happens in a worker thread; the event loop stays free.
        await trio.to_thread.run_sync(self.close)

    # -- the sink (controller's task; must be quick and never raise) -----------

    def __call__(self, round_index: int, consensus: RoundFrame) -> None:
        try:
            if consensus.kind == RoundKind.CONTROL:
                self._on_control()
            else:
                self._on_model(round_index, consensus)
        except Exception as exc:  # a checkpoint problem must never stop training
            self.failures += 1
            self.last_error = exc
            log.error("checkpoint: could not record round %d: %s", round_index, exc, exc_info=True)

    def _on_control(self) -> None:
        if self._current is not None:
            # The previous window had no buffers round (a model without float buffers).
            self._submit(self._current)
            self._current = None
        self._window_open = True
        self._model_rounds = 0

    def _on_model(self, round_index: int, consensus: RoundFrame) -> None:
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

    def _on_params(self, round_index: int, consensus: RoundFrame) -> None:
        window = self.next_window
        self.next_window += 1
        if not consensus.weight > 0:
            log.info("checkpoint: window %d had zero accepted mass (the ranks kept their params); not saved", window)
            return
        if window % self.every:
            return
        outer_state = None
        outer_config = None
        if self.outer is not None:
            state = self.outer.state_dict()
            builtin = isinstance(self.outer, _BUILTIN_OUTERS)
            outer_state = {k: (np.asarray(v) if builtin else np.array(v, copy=True)) for k, v in state.items()}
            config = getattr(self.outer, "config", None)
            outer_config = config() if callable(config) else {"type": type(self.outer).__name__}
        self._current = _Snapshot(
            window=window,
            round_index=round_index,
            params=consensus_as_f32(consensus, copy=True),
            mass=float(consensus.weight),
            wire_dtype=_wire_dtype_name(consensus),
            outer_state=outer_state,
            outer_config=outer_config,
        )

    def _on_buffers(self, round_index: int, consensus: RoundFrame) -> None:
        snap, self._current = self._current, None
        if snap is None:
            return  # window not due, or zero mass
        snap.buffers_round = round_index
        snap.buffers_mass = float(consensus.weight)
        if consensus.weight > 0:
            snap.buffers = consensus_as_f32(consensus, copy=True)
        else:
            snap.buffers_absent = True  # the ranks kept their own buffers: nothing common to save
        self._submit(snap)

    def _submit(self, snap: _Snapshot) -> None:
        start = False
        with self._cond:
            if self._closing or self._closed:
                log.warning("checkpoint: window %d completed after close(); not saved", snap.window)
                return
            self._handoff_locked(snap)
            start = self._thread is None
        if start:
            log.warning("checkpoint: ConsensusCheckpointer used before start(); starting its writer now")
            self.start()

    def _handoff_locked(self, snap: _Snapshot) -> None:
        if self._pending is not None:
            dropped = self._pending.window
            self.skipped_windows.append(dropped)
            log.warning(
                "checkpoint: writer is behind; window %d skipped, window %d replaces it (latest wins)",
                dropped, snap.window,
            )
        self._pending = snap
        self._cond.notify_all()

    # -- the writer thread -----------------------------------------------------

    def _writer(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                snap, self._pending = self._pending, None
                self._busy = True
            try:
                path = self._write(snap)
                self.written.append(path)
                self._prune()
            except Exception as exc:
                self.failures += 1
                self.last_error = exc
                log.error("checkpoint: writing window %d failed: %s", snap.window, exc, exc_info=True)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

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


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConsensusCheckpointer",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_safetensors",
    "restore_module",
    "write_safetensors_atomic",
]
