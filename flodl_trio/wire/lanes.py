"""flodl_trio extension: a round cut into lanes, and put back together.

With ``lanes = L`` a relay ships its HostFrame as up to L RoundFrames in lane
order, each holding an about equal share of the frame's payload bytes, so
that the controller can reduce lane i and send its consensus down while lane
i + 1 is still going up. A lane's frame is an ordinary RoundFrame whose
tensors are *pieces*: runs of consecutive elements of the original tensors,
each sent flat (shape ``[n]``), in the original order. A tensor may be split
across lanes; a lane that gets no bytes carries one empty piece. An elided
tensor's pieces are elided. Every lane carries the frame's kind and weight
and ends with its lane tag; lane 0 also carries the frame's *schema* (one
empty tensor per original tensor, of its dtype and shape ``[0, *shape]``),
so the controller can see whole tensors: its outer optimizer steps each
lane's elements, and it joins the lanes it keeps for checkpoints and joiners.

A delta round's frame (docs/wire.md, "Delta rounds") is cut the same way, on
coarser grains (:class:`TensorCut`): a coded tensor only at its block
boundaries, its piece being that run of blocks' scales and then their codes (a
coded payload of its own); the base digest whole, in the last lane (through
shards, in lane 0).

:class:`LaneLayout` is computed from the frame's schema alone (dtypes and
shapes), so every host that folds the same schema cuts it the same way, and
the lanes are put back into the original shapes with
:class:`LaneAssembler` (or :meth:`LaneLayout.join`). Nothing here does I/O.
See docs/wire.md ("lanes").
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Collection, Sequence

import attrs
import numpy as np

from ..errors import ConfigError, SchemaError
from .bf16 import DTYPE_NAMES, itemsize
from .constants import DTYPE_F32, MAC_LEN, MAX_TENSORS, ROUND_FRAME_MAGIC
from .quant import DTYPE_BASE_DIGEST, DeltaCodec, block_count, code_bytes
from .round_frame import RoundFrame, RoundKind, TensorPayload, check_payload, payload_nbytes, schema_frame_len
from .salt import SessionSalt

_FRAME_HEADER = struct.Struct("<IIBd")  # magic, count, kind, weight (PROTOCOL.md's RoundFrame)
_TENSOR_HEAD = struct.Struct("<BB")

MAX_LANES = 64
# A lane per this many payload bytes, at most the cluster's count: small frames go as one.
DEFAULT_LANE_MIN_BYTES = 256 << 10
_EMPTY = np.zeros(0, dtype="<f4")


def lanes_for(payload_bytes: int, count: int, min_bytes: int) -> int:
    """How many lanes a frame of ``payload_bytes`` goes in: one per ``min_bytes``
    (0: always ``count``), at least 1, at most ``count``."""
    if min_bytes <= 0:
        return count
    return max(1, min(count, payload_bytes // min_bytes))


# Lanes each shard gets at least, when the frame is large enough: a shard's first lane
# comes down while its later ones still go up (benchmarks/scale.py, 200 Mbit/s: 4 hosts
# x 8 MiB 766 ms with two lanes a shard, 665 ms with four; 8 hosts x 4 MiB 573 ms with
# one, 436 ms with two).
SHARD_PIPELINE_LANES = 4


def sharded_lane_count(lanes: int, shards: int, payload_bytes: int | None = None, min_bytes: int = 0) -> int:
    """The lanes a round through ``shards`` shards goes in, ``lanes`` being the cluster's
    count: lane 0 and k lanes for every shard (so no shard's link carries more than its
    share), k the larger of ``ceil((lanes - 1) / shards)`` and SHARD_PIPELINE_LANES,
    then no more than one per ``min_bytes`` of a shard's share of the payload, at least
    one (a frame that goes in lanes at all reaches every shard), and no more than
    MAX_LANES allows (docs/wire.md, "Shards")."""
    per_shard = max(-(-(lanes - 1) // shards), SHARD_PIPELINE_LANES)
    if min_bytes > 0 and payload_bytes is not None:
        per_shard = min(per_shard, payload_bytes // (shards * min_bytes))
    per_shard = max(1, min(per_shard, (MAX_LANES - 1) // shards))
    return min(1 + shards * per_shard, MAX_LANES)


def goes_through_shards(schema: Sequence[tuple[int, tuple[int, ...]]], shards: int) -> bool:
    """Whether a round of this (dtype, shape) schema goes through ``shards`` shards: any
    but a delta round whose means (f32, one model a round into the controller's link)
    would not weigh clearly less than the star's coded frames (one a host): a delta
    round of b-bit codes goes through them when ``shards * b >= 64``, half the star's
    bytes or less (f32: b = 32; docs/wire.md, "Delta rounds through the shards")."""
    if not schema or schema[-1][0] != DTYPE_BASE_DIGEST:
        return True
    codecs = [DeltaCodec.of_tag(dtype) for dtype, _ in schema]
    bits = min((codec.code.bits for codec in codecs if codec is not None), default=32)
    return shards * bits >= 64


def lane_owner(lane: int, shards: int, lost: Collection[int] = ()) -> int | None:
    """Which of ``shards`` reduction shards reduces lane ``lane`` (None: lane 0, the
    controller's): shard (lane - 1) mod shards, or - that one lost - the next live
    one after it (docs/wire.md, "A lost shard"). ValueError if every shard is lost."""
    if lane == 0:
        return None
    first = (lane - 1) % shards
    for step in range(shards):
        shard = (first + step) % shards
        if shard not in lost:
            return shard
    raise ValueError(f"every one of the {shards} shards is lost")


def lane_tag(index: int, count: int, schema: int = 0) -> TensorPayload:
    """The tag a lane frame ends with: a 0-element f32 tensor of shape
    ``[0, 0, count, index, schema]``, ``schema`` the number of schema tensors
    before it (lane 0's; 0 on every other lane)."""
    return TensorPayload(DTYPE_F32, (0, 0, count, index, schema), _EMPTY)


@attrs.frozen
class LaneTag:
    """Lane ``index`` of ``count``, carrying ``schema`` schema tensors before its tag."""

    index: int
    count: int
    schema: int


def read_lane_tag(frame: RoundFrame) -> LaneTag | None:
    """The tag of a lane frame (its last tensor); None if it carries none, or one
    that cannot be (an index outside the count, a schema on a lane other than 0, a
    lane 0 without one unless its tag is all it carries (a frame of no tensors),
    more schema tensors than the frame has)."""
    if not frame.tensors:
        return None
    tag = frame.tensors[-1]
    shape = tuple(tag.shape)
    if tag.dtype != DTYPE_F32 or len(shape) != 5 or shape[:2] != (0, 0):
        return None
    _, _, count, index, schema = shape
    if not 1 <= count <= MAX_LANES or not 0 <= index < count:
        return None
    if schema > 0 and index != 0:
        return None
    if schema == 0 and index == 0 and len(frame.tensors) != 1:  # lane 0 of a frame of no tensors: its tag alone
        return None
    if schema > 0 and schema > len(frame.tensors) - 2:
        return None
    return LaneTag(index, count, schema)


@attrs.frozen
class Piece:
    """Elements ``start:stop`` of tensor ``tensor`` (``stop - start`` may be 0)."""

    tensor: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@attrs.frozen
class TensorCut:
    """Where one tensor of a schema may be cut, and which of its payload's bytes a
    piece is. A cut falls on a multiple of ``grain`` elements: 1 for f32 and bf16,
    the block for a delta code (a piece of whole blocks is a coded payload of its
    own: its scales, then its codes), the whole tensor for the base digest."""

    dtype: int
    numel: int
    nbytes: int
    grain: int

    @classmethod
    def of(cls, dtype: int, shape: Sequence[int]) -> TensorCut:
        numel = math.prod(shape)  # exact: a hostile shape must not wrap around
        nbytes = payload_nbytes(dtype, numel)
        if nbytes is None:
            itemsize(dtype)  # names the unknown tag
            raise SchemaError(f"a tensor of dtype tag {dtype} and shape {list(shape)} cannot be cut into lanes")
        codec = DeltaCodec.of_tag(dtype)
        grain = codec.block if codec is not None else max(numel, 1) if dtype == DTYPE_BASE_DIGEST else 1
        return cls(dtype, numel, nbytes, grain)

    def element_at(self, offset: int) -> int:
        """The element where byte ``offset`` of the payload falls (in proportion for a
        coded one), moved down to the grain."""
        element = offset * self.numel // self.nbytes
        return element - element % self.grain

    def regions(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(offset, length) in the tensor's payload of the bytes of elements
        ``start:stop`` (``start`` on the grain), in the order a piece carries them."""
        codec = DeltaCodec.of_tag(self.dtype)
        if codec is None:
            per = self.nbytes // self.numel if self.numel else 0
            return [(start * per, (stop - start) * per)]
        first, end = start // codec.block, block_count(stop, codec.block)
        codes_at = 4 * block_count(self.numel, codec.block)
        code_start = code_bytes(codec.code, start)
        return [(4 * first, 4 * (end - first)), (codes_at + code_start, code_bytes(codec.code, stop) - code_start)]


def _bytes_of(data: object) -> memoryview:
    """A payload's bytes as a flat byte view (no copy)."""
    view = memoryview(data)  # type: ignore[arg-type]  # any buffer a TensorPayload holds
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _gather(data: object, regions: Sequence[tuple[int, int]]) -> object:
    """A piece's bytes: a view for one region, a copy for two (a coded piece)."""
    view = _bytes_of(data)
    if len(regions) == 1:
        offset, length = regions[0]
        return view[offset:offset + length]
    out = bytearray(sum(length for _, length in regions))
    at = 0
    for offset, length in regions:
        out[at:at + length] = view[offset:offset + length]
        at += length
    return out


@attrs.frozen
class LaneLayout:
    """How a frame of one schema is cut into lanes: each lane's pieces, in order."""

    schema: tuple[tuple[int, tuple[int, ...]], ...]  # (dtype, shape) per tensor
    lanes: tuple[tuple[Piece, ...], ...]

    @classmethod
    def of(cls, frame: RoundFrame, count: int, min_bytes: int = 0, *, lane0_empty: bool = False) -> LaneLayout:
        """The layout of ``frame``'s schema over ``count`` lanes (fewer for a small
        frame: one per ``min_bytes`` of payload, see :func:`lanes_for`); with
        ``lane0_empty`` lane 0 of several carries no payload (shards: docs/wire.md)."""
        schema = tuple((t.dtype, tuple(t.shape)) for t in frame.tensors)
        if not 1 <= count <= MAX_LANES:
            raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {count}")
        return _layout_for(schema, lanes_for(_payload_bytes(schema), count, min_bytes), lane0_empty)

    @classmethod
    def through_shards(cls, frame: RoundFrame, lanes: int, shards: int, min_bytes: int = 0) -> LaneLayout:
        """The layout of a round in lanes through ``shards`` shards: lane 0 empty, the
        payload over :func:`sharded_lane_count` lanes."""
        schema = tuple((t.dtype, tuple(t.shape)) for t in frame.tensors)
        return _layout_for(schema, sharded_lane_count(lanes, shards, _payload_bytes(schema), min_bytes), True)

    @classmethod
    def for_schema(
        cls, schema: Sequence[tuple[int, tuple[int, ...]]], count: int, lane0_empty: bool = False
    ) -> LaneLayout:
        if not 1 <= count <= MAX_LANES:
            raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {count}")
        if not schema:  # nothing to cut: one lane, its tag alone
            return cls((), ((),))
        if 2 * len(schema) + 1 > MAX_TENSORS:
            raise SchemaError(
                f"a frame of {len(schema)} tensors cannot be cut into lanes: lane 0 would carry up to "
                f"{2 * len(schema) + 1} (its pieces, the schema and the tag), over the {MAX_TENSORS} a frame may hold"
            )
        cuts = [TensorCut.of(dtype, shape) for dtype, shape in schema]
        numels = [c.numel for c in cuts]
        # Through shards, a delta round's base digest rides in lane 0 (the controller
        # checks it there, and its consensus carries the new one): the rest is cut.
        digest_first = lane0_empty and count > 1 and len(schema) > 1 and schema[-1][0] == DTYPE_BASE_DIGEST
        cut = cuts[:-1] if digest_first else cuts
        total = sum(c.nbytes for c in cut)
        # Byte offsets where lanes start, each moved down to where its tensor may be cut.
        if lane0_empty and count > 1:  # lane 0: the schema and the tag alone; the payload over the others
            starts = [(0, 0)] + [_element_boundary(total * k // (count - 1), cut) for k in range(count - 1)]
        else:  # lane 0 starts at the very start, so a leading tensor of no elements rides in it
            starts = [(0, 0)] + [_element_boundary(total * k // count, cuts) for k in range(1, count)]
        starts.append((len(cut), 0))
        lanes = []
        for (t0, e0), (t1, e1) in zip(starts, starts[1:]):
            lanes.append(_pieces_between(t0, e0, t1, e1, numels[:len(cut)]))
        if digest_first:
            lanes[0] = (Piece(len(cut), 0, numels[-1]),)
        return cls(tuple((dtype, tuple(shape)) for dtype, shape in schema), tuple(lanes))

    @classmethod
    def of_lane0(cls, frame: RoundFrame, lane0_empty: bool = False, *, ceiling: int | None = None) -> LaneLayout:
        """The layout a round's lane-0 frame (or its consensus) declares: its tag's lane
        count over the schema it carries; SchemaError if the frame is not a lane 0
        or its pieces are not that layout's."""
        layout = cls.declared_by(frame, lane0_empty, ceiling=ceiling)
        layout.check_lane(0, frame)
        return layout

    @classmethod
    def declared_by(cls, frame: RoundFrame, lane0_empty: bool = False, *, ceiling: int | None = None) -> LaneLayout:
        """:meth:`of_lane0` without the check of the pieces: for a delta round's lane-0
        consensus, whose pieces are the f32 means of the coded pieces that went up.
        ``ceiling``: SchemaError if the schema's payload (the whole frame the lanes
        join into, which is what a receiver sizes its buffers by) is larger."""
        tag = read_lane_tag(frame)
        if tag is None or tag.index != 0:
            raise SchemaError(f"expected a round's lane 0 with its schema, got a frame tagged {tag}")
        schema: list[tuple[int, tuple[int, ...]]] = []
        for i, t in enumerate(frame.tensors[-1 - tag.schema:-1]):
            if t.nbytes != 0 or not t.shape or t.shape[0] != 0:
                raise SchemaError(f"lane 0: schema tensor {i} has shape {list(t.shape)} and {t.nbytes} bytes; "
                                  "a schema tensor is empty, of shape [0, *shape]")
            schema.append((t.dtype, tuple(t.shape[1:])))
        if ceiling is not None and (total := _payload_bytes(tuple(schema))) > ceiling:
            raise SchemaError(f"lane 0 declares a schema of {total} payload bytes, over the frame ceiling of {ceiling}")
        return _layout_for(tuple(schema), tag.count, lane0_empty)

    @property
    def count(self) -> int:
        return len(self.lanes)

    def frame_bytes(self, index: int) -> int:
        """The length of lane ``index``'s frame with nothing elided: the most it can be."""
        pieces = [(self.schema[p.tensor][0], (p.numel,)) for p in self.lanes[index]]
        return schema_frame_len([*pieces, *((t.dtype, tuple(t.shape)) for t in self.trailer(index))])

    @property
    def max_frame_bytes(self) -> int:
        """The length of the largest lane frame (nothing elided): what a lane buffer needs."""
        return max(self.frame_bytes(k) for k in range(self.count))

    @functools.cached_property
    def cuts(self) -> tuple[TensorCut, ...]:
        """Each schema tensor's :class:`TensorCut`."""
        return tuple(TensorCut.of(dtype, shape) for dtype, shape in self.schema)

    def trailer(self, index: int) -> list[TensorPayload]:
        """What lane ``index`` carries after its pieces: on lane 0 the schema, then the tag."""
        schema = [TensorPayload(dtype, (0, *shape), _EMPTY) for dtype, shape in self.schema] if index == 0 else []
        return [*schema, lane_tag(index, self.count, len(schema))]

    def check_lane(self, index: int, frame: RoundFrame) -> None:
        """SchemaError unless ``frame`` is lane ``index`` of this layout: its pieces
        (dtype, length, and payload bytes that length's or elided), its schema (lane 0)
        and its tag. Every receiver of a lane checks it so before it places or sums
        a byte of it."""
        pieces = self.lanes[index]
        tag = read_lane_tag(frame)
        want_tag = LaneTag(index, self.count, len(self.schema) if index == 0 else 0)
        if tag != want_tag:
            raise SchemaError(f"lane {index}: tag {tag}, the layout says {want_tag}")
        want: list[tuple[int, tuple[int, ...]]] = [(self.schema[p.tensor][0], (p.numel,)) for p in pieces]
        want += [(t.dtype, tuple(t.shape)) for t in self.trailer(index)[:-1]]
        got = [(t.dtype, tuple(t.shape)) for t in frame.tensors[:-1]]
        if got != want:
            raise SchemaError(f"lane {index}: tensors {_brief(got)} before the tag, the layout says {_brief(want)}")
        for i, t in enumerate(frame.tensors):  # (the shapes are right; their bytes must be too, or elided)
            check_payload(t, i, f"lane {index}")

    def split(self, frame: RoundFrame) -> list[RoundFrame]:
        """``frame`` as its lanes' frames, each ending with its lane tag; the pieces are
        views of its payloads (no copy)."""
        self._check(frame, "the frame to split")
        out = []
        for index, pieces in enumerate(self.lanes):
            payloads = []
            for p in pieces:
                t = frame.tensors[p.tensor]
                data = t.data if t.elided else _gather(t.data, self.cuts[p.tensor].regions(p.start, p.stop))
                payloads.append(TensorPayload(t.dtype, (p.numel,), data))
            out.append(RoundFrame([*payloads, *self.trailer(index)], frame.kind, frame.weight))
        return out

    def join(self, lanes: Sequence[RoundFrame]) -> RoundFrame:
        """The lanes' frames put back into the schema's tensors (copied into new
        arrays; a tensor every piece of which is elided stays elided). The weight
        is the smallest lane's: the mass every element of the result has behind it."""
        if len(lanes) != self.count:
            raise SchemaError(f"{len(lanes)} lane frames for a layout of {self.count} lanes")
        for index, frame in enumerate(lanes):
            self.check_lane(index, frame)
        parts: list[list[tuple[Piece, TensorPayload]]] = [[] for _ in self.schema]
        for frame, pieces in zip(lanes, self.lanes):
            for p, t in zip(pieces, frame.tensors):
                parts[p.tensor].append((p, t))
        tensors = [self._joined(index, found) for index, found in enumerate(parts)]
        kinds = {frame.kind for frame in lanes}
        if len(kinds) != 1:
            raise SchemaError(f"lane frames of different kinds: {sorted(k.name for k in kinds)}")
        return RoundFrame(tensors, lanes[0].kind, min(frame.weight for frame in lanes))

    # -- internals -------------------------------------------------------------

    def _joined(self, index: int, found: list[tuple[Piece, TensorPayload]]) -> TensorPayload:
        dtype, shape = self.schema[index]
        if all(t.elided or p.numel == 0 for p, t in found) and any(t.elided for _, t in found):
            return TensorPayload(dtype, shape)
        cut = self.cuts[index]
        out = np.zeros(cut.nbytes, dtype=np.uint8)
        for p, t in found:
            if not t.elided:
                self.place(p, np.frombuffer(_bytes_of(t.data), dtype=np.uint8), out)
        return TensorPayload(dtype, shape, out)

    def place(self, piece: Piece, data: np.ndarray | None, payload: np.ndarray) -> None:
        """A piece's bytes (``data``; None: zeros) written where they go in its tensor's
        whole payload (uint8 arrays)."""
        at = 0
        for offset, length in self.cuts[piece.tensor].regions(piece.start, piece.stop):
            payload[offset:offset + length] = data[at:at + length] if data is not None else 0
            at += length

    def _check(self, frame: RoundFrame, what: str) -> None:
        schema = tuple((t.dtype, tuple(t.shape)) for t in frame.tensors)
        if schema != self.schema:
            raise SchemaError(f"{what} has schema {list(schema)}, the lane layout {list(self.schema)}")


class LaneAssembler:
    """Joins a round's consensus lanes straight into the bytes of one RoundFrame in the
    layout's shapes (every tensor written out; an elided piece as zeros), with no
    copies beyond the one into the frame. The frame's memory is lent for each round
    (:meth:`begin`), so a relay can join the consensus in the receive buffer its
    ranks' frames arrived in: it is idle until the consensus has gone out.
    Use: :meth:`begin`, :meth:`add` each lane in order, then :meth:`finish`."""

    def __init__(self, layout: LaneLayout) -> None:
        self.layout = layout
        self._heads: list[tuple[int, bytes]] = []  # (offset, bytes) of each tensor's header
        self._payload_at: list[int] = []
        at = _FRAME_HEADER.size
        for (dtype, shape), cut in zip(layout.schema, layout.cuts):
            size = cut.nbytes
            head = _TENSOR_HEAD.pack(dtype, len(shape)) + struct.pack(f"<{len(shape)}IQ", *shape, size)
            self._heads.append((at, head))
            at += len(head)
            self._payload_at.append(at)
            at += size
        self.nbytes = at + MAC_LEN  # the whole RoundFrame, its MAC included
        self._buffer: np.ndarray | None = None
        self._lanes = 0
        self._got: set[int] = set()  # the lanes added
        self._weights: dict[int, float] = {}  # each added lane's weight
        self._kind: RoundKind | None = None
        self._weight = float("inf")

    def begin(self, buffer: np.ndarray | None = None) -> None:
        """Start a round's frame in ``buffer`` (uint8, at least :attr:`nbytes`; None: a
        new array), which must stay untouched until the frame :meth:`finish` returns
        has been used."""
        if buffer is None:
            buffer = np.empty(self.nbytes, dtype=np.uint8)
        if buffer.dtype != np.uint8 or buffer.size < self.nbytes:
            raise ValueError(f"the joined frame needs {self.nbytes} bytes of uint8, got {buffer.size} of {buffer.dtype}")
        self._buffer = buffer[:self.nbytes]
        view = self._buffer.data
        for at, head in self._heads:
            view[at:at + len(head)] = head
        self._lanes, self._kind, self._weight = 0, None, float("inf")
        self._got = set()
        self._weights = {}

    @property
    def begun(self) -> bool:
        """Whether a round's frame is being joined (between :meth:`begin` and :meth:`finish`)."""
        return self._buffer is not None

    def add(self, lane: RoundFrame, index: int | None = None) -> None:
        """The next lane's consensus (its pieces must be the layout's), or - with ``index``,
        when lanes come from several senders - lane ``index``'s, in any order."""
        if index is None:
            index = self._lanes
        elif index in self._got:
            raise SchemaError(f"lane {index} came down twice")
        if self._buffer is None:
            raise SchemaError(f"lane {index} came down before the round's frame was begun")
        if index >= self.layout.count:
            raise SchemaError(f"lane {index}: the layout has {self.layout.count} lanes")
        pieces = self.layout.lanes[index]
        self.layout.check_lane(index, lane)
        if self._kind is not None and lane.kind != self._kind:
            raise SchemaError(f"lane {index} is a {lane.kind.name} frame, lane 0 a {self._kind.name} frame")
        for p, t in zip(pieces, lane.tensors):
            start = self._payload_at[p.tensor]
            target = self._buffer[start:start + self.layout.cuts[p.tensor].nbytes]
            self.layout.place(p, None if t.elided else np.frombuffer(_bytes_of(t.data), dtype=np.uint8), target)
        self._kind, self._weight, self._lanes = lane.kind, min(self._weight, lane.weight), self._lanes + 1
        self._got.add(index)
        self._weights[index] = lane.weight

    def drop(self, index: int) -> None:
        """Take lane ``index`` back out (a shard decided it again: its new bytes come in
        its place, over the old ones)."""
        if index in self._got:
            self._got.discard(index)
            del self._weights[index]
            self._lanes -= 1
            self._weight = min(self._weights.values(), default=float("inf"))

    def has(self, index: int) -> bool:
        return index in self._got

    @property
    def complete(self) -> bool:
        return self._lanes == self.layout.count

    @property
    def lanes_in(self) -> int:
        """Lanes added to the frame being joined."""
        return self._lanes

    def abandon(self) -> None:
        """Forget a frame half joined (its lanes' sender was lost, and sends them all
        again): the lent buffer is no longer written, and the next lane must be lane 0."""
        self._buffer, self._lanes, self._kind, self._weight = None, 0, None, float("inf")

    def finish(self, salt: SessionSalt | None) -> memoryview:
        """The joined frame (its weight: the smallest lane's), signed with ``salt`` or,
        with None, unsigned (zeros where the MAC goes: only for the local leg), as a
        view of the lent buffer; the assembler then waits for the next :meth:`begin`."""
        if not self.complete or self._kind is None or self._buffer is None:
            raise SchemaError(f"{self._lanes} of {self.layout.count} lanes came down")
        view = self._buffer.data
        _FRAME_HEADER.pack_into(view, 0, ROUND_FRAME_MAGIC, len(self.layout.schema), int(self._kind), self._weight)
        end = len(view) - MAC_LEN
        view[end:] = salt.mac8(view[:end]) if salt is not None else bytes(MAC_LEN)
        self._buffer, self._lanes, self._kind, self._weight = None, 0, None, float("inf")
        return view


@functools.lru_cache(maxsize=16)
def _payload_bytes(schema: tuple[tuple[int, tuple[int, ...]], ...]) -> int:
    """The payload bytes of a frame of this schema (what :func:`lanes_for` divides)."""
    return sum(TensorCut.of(dtype, shape).nbytes for dtype, shape in schema)


@functools.lru_cache(maxsize=16)
def _layout_for(schema: tuple[tuple[int, tuple[int, ...]], ...], count: int, lane0_empty: bool = False) -> LaneLayout:
    """The layouts of the few schemas a cluster reduces, computed once each."""
    return LaneLayout.for_schema(schema, count, lane0_empty)


def _brief(schema: Sequence[tuple[int, tuple[int, ...]]]) -> str:
    """A schema for an error message, cut short past a few tensors."""
    shown = ", ".join(f"{DTYPE_NAMES.get(dtype, dtype)}{list(shape)}" for dtype, shape in schema[:6])
    return f"[{shown}{', ...' if len(schema) > 6 else ''}] ({len(schema)} tensors)"


def _element_boundary(offset: int, cuts: Sequence[TensorCut]) -> tuple[int, int]:
    """The (tensor, element) where byte ``offset`` of the concatenated payloads falls,
    moved down to where that tensor may be cut."""
    for index, cut in enumerate(cuts):
        if offset < cut.nbytes:
            return index, cut.element_at(offset)
        offset -= cut.nbytes
    return len(cuts), 0


def _pieces_between(t0: int, e0: int, t1: int, e1: int, numels: list[int]) -> tuple[Piece, ...]:
    """The pieces from (tensor t0, element e0) up to, not including, (t1, e1)."""
    pieces = []
    tensor, element = t0, e0
    while (tensor, element) < (t1, e1) and tensor < len(numels):
        stop = e1 if tensor == t1 else numels[tensor]
        if stop > element or numels[tensor] == 0:
            pieces.append(Piece(tensor, element, stop))
        tensor, element = tensor + 1, 0
    if not pieces:  # a lane with no bytes still carries a frame: one empty piece
        anchor = min(t0, len(numels) - 1)
        at = e0 if t0 < len(numels) else numels[anchor]
        pieces.append(Piece(anchor, at, at))
    return tuple(pieces)


__all__ = [
    "DEFAULT_LANE_MIN_BYTES",
    "MAX_LANES",
    "SHARD_PIPELINE_LANES",
    "LaneAssembler",
    "LaneLayout",
    "LaneTag",
    "Piece",
    "TensorCut",
    "goes_through_shards",
    "lane_owner",
    "lane_tag",
    "lanes_for",
    "read_lane_tag",
    "sharded_lane_count",
]
