"""Consensus checkpoints: the file format, and everything a rank needs to read one.

A checkpoint is one window's consensus (the params the ranks adopted, the
float buffers, the outer optimizer's state) in a standard safetensors file,
``window-NNNNNN.safetensors``. The ``safetensors`` library writes and reads
the files: the format is its to define, and its numpy API needs no torch.

This module is the format alone, with neither trio nor torch: what the
controller's writer (:class:`~flodl_trio.controller.checkpointer.ConsensusCheckpointer`)
and a resuming rank share. A rank reads with :func:`load_checkpoint` and
:func:`latest_checkpoint`, and copies one into a torch module with
:func:`flodl_trio.train.checkpoint.restore_module`.

:func:`write_safetensors_atomic` is the format-level writer the checkpointer
uses: a reader sees either a complete file or none.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import safetensors
import safetensors.numpy

from ..errors import FlodlError

T = TypeVar("T")

FORMAT = "flodl_trio.checkpoint.v1"
FILE_RE = re.compile(r"^window-(\d+)\.safetensors$")
TEMP_RE = re.compile(r"^\.window-\d+\.safetensors\.tmp-")
FILE_MODE = 0o644  # readable by ranks running as other users on a shared filesystem

# What safetensors raises for a file or an array it cannot handle, besides OSError.
_LIBRARY_ERRORS: tuple[type[Exception], ...] = (safetensors.SafetensorError, ValueError, TypeError)


class CheckpointError(FlodlError):
    """A checkpoint file is missing, malformed, or not a flodl_trio checkpoint."""


def checkpoint_name(window: int) -> str:
    return f"window-{window:06d}.safetensors"


# ---------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------


def c_contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in C order, copied only if needed. Unlike ``np.ascontiguousarray``, 0-d stays 0-d."""
    array = np.asarray(array)
    return array if array.flags.c_contiguous else array.copy(order="C")


def _named_arrays(tensors: Sequence[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Name -> C-contiguous array, as ``save_file`` needs: it reads raw memory, so a strided view would be garbage."""
    out: dict[str, np.ndarray] = {}
    for name, array in tensors:
        if name in out:
            raise CheckpointError(f"duplicate tensor name {name!r}")
        out[name] = c_contiguous(array)
    return out


def _temp_path_for(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; best effort where directories cannot be opened or synced."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_safetensors_atomic(path: Path, tensors: Sequence[tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` and ``metadata`` as a safetensors file at ``path``, atomically.

    The library writes a temp file in the same directory; it is fsync'd, renamed
    over ``path`` and the directory fsync'd, so a reader (or a crash) sees the old
    file, no file, or the complete new one, never a torn one. On failure the temp
    file is removed and :class:`CheckpointError` (naming ``path``, the cause
    chained) is raised.
    """
    path = Path(path)
    arrays = _named_arrays(tensors)
    temp = _temp_path_for(path)
    try:
        safetensors.numpy.save_file(arrays, str(temp), metadata=dict(metadata))
        os.chmod(temp, FILE_MODE)
        _fsync_file(temp)
        os.replace(temp, path)
    except BaseException as exc:
        temp.unlink(missing_ok=True)
        if isinstance(exc, (OSError, *_LIBRARY_ERRORS)):
            raise CheckpointError(f"{path}: cannot write: {exc}") from exc
        raise
    _fsync_dir(path.parent)


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of a safetensors file (as numpy arrays) and its metadata.

    One open for both, so tensors and metadata always come from the same file.
    Anything the library rejects becomes a :class:`CheckpointError` naming the file.
    """
    path = Path(path)
    try:
        with safetensors.safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            names = f.keys()
            tensors = {name: f.get_tensor(name) for name in names}
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    except _LIBRARY_ERRORS as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc
    return tensors, dict(metadata)


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
        return self._metadata("window", int)

    @property
    def round_index(self) -> int:
        """The controller's round counter at this window's params round."""
        return self._metadata("round", int)

    @property
    def mass(self) -> float:
        """Accepted mass of the params round."""
        return self._metadata("mass", float)

    @property
    def buffers_mass(self) -> float:
        return self._metadata("buffers_mass", float, "0")

    @property
    def wire_dtype(self) -> str:
        return self._metadata("wire_dtype", str)

    def _metadata(self, key: str, parse: Callable[[str], T], default: str | None = None) -> T:
        """A metadata value, parsed; a key the file lacks or cannot parse is a CheckpointError
        naming the file and the key (a damaged or hand-made file, not a KeyError)."""
        raw = self.metadata.get(key, default)
        if raw is None:
            raise CheckpointError(f"{self.path or 'checkpoint'}: metadata has no {key!r}")
        try:
            return parse(raw)
        except ValueError:
            raise CheckpointError(f"{self.path or 'checkpoint'}: metadata {key} is {raw!r}, "
                                  f"not {'an integer' if parse is int else 'a number'}") from None

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


def _check_declared_count(metadata: Mapping[str, str], what: str, held: int, path: Path) -> None:
    raw = metadata.get(f"{what}_count", str(held))
    try:
        declared = int(raw)
    except ValueError:
        raise CheckpointError(f"{path}: metadata {what}_count is {raw!r}, not an integer") from None
    if declared != held:
        raise CheckpointError(f"{path}: metadata declares {declared} {what} tensors, the file holds {held}")


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint written by the controller's checkpointer."""
    path = Path(path)
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a flodl_trio checkpoint (format {metadata.get('format')!r}, want {FORMAT!r})")
    params = _indexed(tensors, "params.", path)
    buffers = _indexed(tensors, "buffers.", path)
    _check_declared_count(metadata, "params", len(params), path)
    _check_declared_count(metadata, "buffers", len(buffers), path)
    outer = {name[len("outer.") :]: a for name, a in tensors.items() if name.startswith("outer.")}
    if len(params) + len(buffers) + len(outer) != len(tensors):
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
    except OSError as exc:  # a file, or a directory this user may not read
        raise CheckpointError(f"{directory}: cannot list checkpoints there: {exc.strerror or exc}") from exc
    found = [(int(m.group(1)), directory / name) for name in names if (m := FILE_RE.match(name))]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest (highest window) checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_safetensors",
    "write_safetensors_atomic",
]
