"""The controller's durable record: what a controller started again needs to resume the run.

Written atomically (temp file, fsync, rename) after every round's consensus is
final and before its first byte goes to any relay, so whatever a relay holds,
the record is at least as new: a relay that got the newest consensus is
current; one that did not is exactly one round behind and is sent the
record's Broadcast, byte for byte. What it keeps:

- where the run is: rounds finished, the window counter, the MACs of the last
  two Broadcast records (how a resuming relay says where it is: docs/wire.md,
  "Resuming");
- who is in it: dead, finished, elastic, plain and absent ranks;
- the outer optimizer's state (x_prev and momentum for SlowMo / DiLoCo);
- in a run with delta rounds, each params set's lineage (the exact consensus
  ``x`` and the base every rank holds, which the next round's deltas are
  against);
- the last round's Broadcast records, header and payload (one per lane: with
  lanes, the record is written as the last lane goes out, and the round's MAC
  is its last lane's).

The params themselves are in that Broadcast and on every rank, which is why
nothing else model-sized is kept: the ranks hold the consensus they trained
from, and the record's Broadcast is what any rank one round behind still needs.
No I/O but the file's.
"""

from __future__ import annotations

import json
import os
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from ..wire.checkpoint import CheckpointError, read_safetensors, write_safetensors_atomic
from ..wire.constants import MAC_LEN, MUX_HEADER_LEN
from ..wire.mux import NO_BROADCAST
from ..wire.round_frame import EncodedFrame
from ..wire.salt import SessionSalt

log = logging.getLogger("flodl_trio.controller")

RECORD_FILE = "resume.safetensors"
RECORD_FORMAT = "flodl_trio-resume-1"
_BROADCAST = "broadcast"  # a whole round's record; with lanes, "broadcast.0", "broadcast.1", ...
# Signed with the salt: a record of another session (another salt) is not this run's.
_FINGERPRINT_TEXT = b"flodl_trio resume record"


def broadcast_tag(record: EncodedFrame) -> bytes:
    """The MAC of an encoded MuxRecord (bytes 17..25 of its header)."""
    head = bytearray()
    for chunk in record.chunks:
        head += memoryview(chunk).cast("B")[: MUX_HEADER_LEN - len(head)]
        if len(head) == MUX_HEADER_LEN:
            break
    return bytes(head[MUX_HEADER_LEN - MAC_LEN:])


def record_bytes(frame: EncodedFrame) -> np.ndarray:
    """An encoded frame's bytes as one uint8 array of its own (one copy)."""
    return np.concatenate([np.frombuffer(memoryview(c).cast("B"), dtype=np.uint8) for c in frame.chunks])


def _broadcast_pieces(tensors: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """A record's Broadcast records, in lane order."""
    if _BROADCAST in tensors:
        return [tensors[_BROADCAST]]
    return [tensors[f"{_BROADCAST}.{i}"] for i in range(len(tensors)) if f"{_BROADCAST}.{i}" in tensors]


@attrs.frozen
class RunRecord:
    """Where the run stood after round ``rounds`` (all but the arrays)."""

    rounds: int  # rounds finished, as the stats count them (with lanes, one per lane)
    windows: int
    model_rounds: int  # Model rounds finished in the current window
    previous_kind: int | None  # the last round's kind (RoundKind value)
    fragment: tuple[int, int] | None  # the current window's fragment (index, count)
    last_tag: bytes
    previous_tag: bytes | None
    dead: tuple[int, ...] = ()
    finished: tuple[int, ...] = ()
    elastic: tuple[int, ...] = ()
    plain: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()
    formed: bool = False
    # Why a controller started again cannot take this run on (None: it can).
    not_resumable: str | None = None
    # The file beside the record with the outer optimizer's state after the newest params round.
    outer_file: str | None = None
    # The file with the last finished window's state for joiners, that window, and how
    # many Model rounds a window has (None: no state kept).
    window_file: str | None = None
    state_window: int | None = None
    model_rounds_per_window: int | None = None
    # Whole rounds finished (None: as many as ``rounds``, a run without lanes).
    whole_rounds: int | None = None
    # How many of the window state's frames are params (one, or one per fragment; the
    # rest: buffers), and the Model rounds a window has, learned per fragment:
    # (index, count, rounds), index -1 and count 0 for the whole model.
    window_params: int | None = None
    window_shapes: tuple[tuple[int, int, int], ...] = ()
    # The file with the delta lineages' state after the newest delta round (None: none ran).
    delta_file: str | None = None
    # The model's parameter shapes the current window's fragment tag carries.
    fragment_shapes: tuple[tuple[int, ...], ...] = ()
    # With shards: their addresses (one per shard, as served last), those lost, the
    # rounds decided (the next Decide's round) and decision numbers given so far.
    shards: tuple[tuple[str, int], ...] = ()
    shards_lost: tuple[int, ...] = ()
    sharded_rounds: int = 0
    decisions: int = 0

    def to_json(self) -> str:
        fields = attrs.asdict(self)
        fields["last_tag"] = self.last_tag.hex()
        fields["previous_tag"] = None if self.previous_tag is None else self.previous_tag.hex()
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: Path) -> RunRecord:
        try:
            fields = json.loads(text)
            fields["last_tag"] = bytes.fromhex(fields["last_tag"])
            if fields["previous_tag"] is not None:
                fields["previous_tag"] = bytes.fromhex(fields["previous_tag"])
            for name in ("dead", "finished", "elastic", "plain", "absent"):
                fields[name] = tuple(int(r) for r in fields[name])
            if fields["fragment"] is not None:
                fields["fragment"] = tuple(fields["fragment"])
            fields["window_shapes"] = tuple(tuple(int(v) for v in shape) for shape in fields.get("window_shapes", ()))
            fields["fragment_shapes"] = tuple(tuple(int(d) for d in s) for s in fields.get("fragment_shapes", ()))
            fields["shards"] = tuple((str(host), int(port)) for host, port in fields.get("shards", ()))
            fields["shards_lost"] = tuple(int(i) for i in fields.get("shards_lost", ()))
            return cls(**fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{where}: the resume record is not readable: {exc}") from exc


@attrs.frozen
class Resumed:
    """A record read back: the run, the outer state, and the frames of the last finished
    window (what a joiner is sent, in order). Its Broadcast is read when a relay needs
    it again (:meth:`ResumeLog.last_broadcast`): the record's newest, not this one's."""

    run: RunRecord
    outer: dict[str, np.ndarray]
    window_frames: list[bytes] = attrs.field(factory=list)
    delta: dict[str, np.ndarray] = attrs.field(factory=dict)


class ResumeLog:
    """The record file of one run in ``directory`` (the checkpoint directory)."""

    def __init__(self, directory: str | os.PathLike[str], salt: SessionSalt, world_size: int) -> None:
        self.path = Path(directory) / RECORD_FILE
        self.salt = salt
        self.world_size = world_size
        self.writes = 0

    @property
    def fingerprint(self) -> str:
        return self.salt.mac8(_FINGERPRINT_TEXT).hex()

    def write(
        self,
        run: RunRecord,
        broadcast: EncodedFrame | Sequence[EncodedFrame | np.ndarray],
        outer: Mapping[str, np.ndarray] | None = None,
        window_frames: list[EncodedFrame] | None = None,
        delta: Mapping[str, np.ndarray] | None = None,
    ) -> RunRecord:
        """Replace the record with this round's, atomically (blocking: call it in a thread).
        ``broadcast``: the round's Broadcast record, or its lanes' in order; ``outer``: the outer optimizer's state, when this round stepped it;
        ``window_frames``: a window's state for joiners, when this round finished it;
        ``delta``: the delta lineages' state, when this round moved it.
        Each goes in a file of its own (written first, so the record never names a
        missing one), and the record as written, which names them, is returned."""
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        if outer is not None:
            name = f"resume-outer-{run.rounds}.safetensors"
            arrays = [(key, np.ascontiguousarray(a)) for key, a in outer.items()]
            write_safetensors_atomic(directory / name, arrays, self._metadata())
            run = attrs.evolve(run, outer_file=name)
        if window_frames is not None:
            name = f"resume-window-{run.rounds}.safetensors"
            frames = [(f"frame.{i}", record_bytes(frame)) for i, frame in enumerate(window_frames)]
            write_safetensors_atomic(directory / name, frames, self._metadata())
            run = attrs.evolve(run, window_file=name)
        if delta is not None:
            name = f"resume-delta-{run.rounds}.safetensors"
            write_safetensors_atomic(directory / name, list(delta.items()), self._metadata())
            run = attrs.evolve(run, delta_file=name)
        pieces = [broadcast] if isinstance(broadcast, EncodedFrame) else list(broadcast)
        arrays = [(f"{_BROADCAST}.{i}", p if isinstance(p, np.ndarray) else record_bytes(p)) for i, p in enumerate(pieces)]
        write_safetensors_atomic(self.path, arrays, {**self._metadata(), "run": run.to_json()})
        self._remove_files_but("resume-outer-", run.outer_file)
        self._remove_files_but("resume-window-", run.window_file)
        self._remove_files_but("resume-delta-", run.delta_file)
        self.writes += 1
        return run

    def _metadata(self) -> dict[str, str]:
        return {"format": RECORD_FORMAT, "fingerprint": self.fingerprint, "world_size": str(self.world_size)}

    def _remove_files_but(self, prefix: str, keep: str | None) -> None:
        for old in self.path.parent.glob(f"{prefix}*.safetensors"):
            if old.name != keep:
                old.unlink(missing_ok=True)

    def load(self) -> Resumed | None:
        """This run's record, if there is one; a record of another session or world is
        left alone (None, logged): the controller starts a new run."""
        if not self.path.exists():
            return None
        tensors, metadata = read_safetensors(self.path)
        if metadata.get("format") != RECORD_FORMAT:
            raise CheckpointError(f"{self.path}: not a flodl_trio resume record (format {metadata.get('format')!r})")
        if metadata.get("fingerprint") != self.fingerprint:
            log.warning("controller: %s is another session's resume record (another salt); starting a new run",
                        self.path)
            return None
        if metadata.get("world_size") != str(self.world_size):
            log.warning("controller: %s is the record of a run of world_size %s, this one has %d; starting a new run",
                        self.path, metadata.get("world_size"), self.world_size)
            return None
        if not _broadcast_pieces(tensors):
            raise CheckpointError(f"{self.path}: the resume record has no Broadcast")
        run = RunRecord.from_json(metadata.get("run", ""), self.path)
        outer: dict[str, np.ndarray] = {}
        if run.outer_file is not None:
            outer, _ = read_safetensors(self.path.parent / run.outer_file)
        frames: list[bytes] = []
        if run.window_file is not None:
            saved, _ = read_safetensors(self.path.parent / run.window_file)
            frames = [saved[f"frame.{i}"].tobytes() for i in range(len(saved))]
        delta: dict[str, np.ndarray] = {}
        if run.delta_file is not None:
            delta, _ = read_safetensors(self.path.parent / run.delta_file)
        return Resumed(run, outer, frames, delta)

    def last_broadcast(self) -> EncodedFrame | None:
        """The newest record's Broadcast, as it went out: its lanes' records back to back
        (None: no record)."""
        if not self.path.exists():
            return None
        tensors, _ = read_safetensors(self.path)
        pieces: list[bytes | bytearray | memoryview] = [p.tobytes() for p in _broadcast_pieces(tensors)]
        if not pieces:
            return None
        return EncodedFrame(pieces, sum(len(p) for p in pieces))

    def clear(self) -> None:
        """The run is over: a controller started next starts a new one."""
        self.path.unlink(missing_ok=True)
        self._remove_files_but("resume-outer-", None)
        self._remove_files_but("resume-window-", None)
        self._remove_files_but("resume-delta-", None)




@attrs.define
class BroadcastTags:
    """The MACs of the last two Broadcast records: where a resuming relay may be."""

    latest: bytes = NO_BROADCAST
    previous: bytes | None = None

    def advance(self, tag: bytes) -> None:
        self.latest, self.previous = tag, self.latest


__all__ = [
    "NO_BROADCAST", "RECORD_FILE", "BroadcastTags", "ResumeLog", "Resumed", "RunRecord", "broadcast_tag", "record_bytes",
]
