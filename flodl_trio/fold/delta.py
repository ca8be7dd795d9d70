"""The arithmetic of a pseudo-gradient round, with no I/O: quantized deltas and error feedback.

A pseudo-gradient round carries deltas, not params: a rank sends what its
window changed (its params minus the consensus it started the window from,
the *base*), in a blockwise code of :mod:`flodl_trio.wire.quant`; every hop
that decodes sums in f32; the mean delta plus the previous consensus is the
new consensus. The pieces, each used by one role:

- :class:`DeltaUplink` (a rank, or a relay re-encoding its host's sum):
  quantizes a delta after adding back what its previous encode dropped, and
  keeps what this one drops (error feedback: nothing is lost, only late).
- :class:`DeltaSum` (a relay's or the controller's fold): decodes payloads
  into f32 sums, in place, one payload at a time.
- :class:`DeltaDownlink` (the controller): quantizes the new consensus as a
  delta against the base every rank holds, and advances its copy of that base
  exactly as the ranks will (:func:`apply_delta`, the same f32 operations), so
  the ranks and the controller hold the same bits. What the code dropped stays
  in the gap between the consensus and that base, and goes out with the next
  window's delta: the downlink's error feedback needs no residual of its own.
- :class:`HostDeltaUplink` / :class:`PendingHostDelta` (a relay): its host's
  summed deltas, coded once more with the relay's own error feedback - whole,
  or lane by lane as the lanes go up.
- :class:`DeltaLineage` / :class:`DeltaLineages` (the controller): per params
  set (the model, or each fragment), the exact consensus and the downlink -
  whole, or piece by piece for lanes.

Every piece of a lane starts on a block boundary, so coding a tensor piece by
piece gives the bytes (and the residual) coding it whole gives.

Every array is a 1-d f32 view of one tensor; model-sized work is numpy,
in cache-sized chunks (:mod:`flodl_trio.wire.quant`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import SchemaError
from ..wire.constants import DTYPE_F32
from ..wire.lanes import LaneLayout, Piece, read_lane_tag
from ..wire.quant import (
    DIGEST_LEN,
    DTYPE_BASE_DIGEST,
    F32,
    Code,
    DeltaCodec,
    F32Array,
    base_digest,
    decode,
    encode,
    payload_bytes,
)
from ..wire.round_frame import RoundFrame, RoundKind, TensorPayload, describe_dtype, is_delta_dtype
from .schemas import Schema

Payload = bytearray | memoryview
_CODES = list(Code)  # a code's index in a lineage's saved state


def _check_shapes(what: str, arrays: Sequence[F32Array], sizes: Sequence[int]) -> None:
    """``arrays`` must be 1-d f32 of ``sizes`` (named by tensor index when not)."""
    if len(arrays) != len(sizes):
        raise SchemaError(f"{what}: {len(arrays)} tensors, expected {len(sizes)}")
    for index, (array, size) in enumerate(zip(arrays, sizes)):
        if array.dtype != F32 or array.ndim != 1 or array.size != size:
            raise SchemaError(
                f"{what}: tensor {index} is {array.dtype} of shape {array.shape}, expected float32 of ({size},)"
            )


class DeltaUplink:
    """Quantizes one delta per window with error feedback (see the module docstring).

    A rank passes its delta pre-multiplied by its realized-work mass, as it does
    its params in a params round, so a fold's sums divide once by the round's
    accepted mass. ``error_feedback=False`` drops what the code cannot carry,
    every window: there only to show what error feedback buys.
    """

    def __init__(self, code: Code, block: int, sizes: Sequence[int], *, error_feedback: bool = True) -> None:
        self.code = code
        self.block = block
        self.sizes = tuple(sizes)
        self.error_feedback = error_feedback
        # What the previous encode dropped, per tensor; a scratch copy holds delta + residual.
        self.residual = [np.zeros(size, dtype=F32) for size in self.sizes]
        self._scratch = [np.empty(size, dtype=F32) for size in self.sizes]

    def payload_sizes(self) -> list[int]:
        return [payload_bytes(self.code, size, self.block) for size in self.sizes]

    def encode(self, deltas: Sequence[F32Array], out: Sequence[Payload]) -> None:
        """Quantize ``deltas`` (plus the residual) into ``out``, one payload per tensor."""
        _check_shapes("delta", deltas, self.sizes)
        for index, (delta, payload) in enumerate(zip(deltas, out)):
            self.encode_tensor(index, delta, payload)

    def encode_tensor(self, index: int, delta: F32Array, out: Payload) -> None:
        """One tensor of :meth:`encode`."""
        self.encode_piece(index, 0, delta, out)

    def stage(self, index: int, params: F32Array, base: F32Array, weight: np.float32) -> F32Array:
        """A rank's window change ``weight x (params - base)``, plus the residual, computed
        straight into tensor ``index``'s scratch (no delta array of its own), for
        :meth:`encode_staged`: the operations, in the order, :meth:`encode` applies."""
        scratch = self._scratch[index]
        np.subtract(params, base, out=scratch)
        np.multiply(scratch, weight, out=scratch)
        if self.error_feedback:
            np.add(scratch, self.residual[index], out=scratch)
        return scratch

    def encode_staged(self, index: int, staged: F32Array, out: Payload) -> None:
        """Code what :meth:`stage` left for tensor ``index``; the residual keeps what it drops."""
        encode(staged, out, self.code, self.block, residual=self.residual[index] if self.error_feedback else None)

    def hold_piece(self, index: int, start: int, delta: F32Array, out: Payload) -> None:
        """:meth:`encode_piece` for a delta of weight 0 (no work): coded without the
        residual, which waits for a round with mass. A round with no accepted mass is
        not divided, so a residual sent in it would move the consensus by the
        contributors' undivided masses' worth of what their codes dropped."""
        encode(delta, out, self.code, self.block)

    def encode_piece(self, index: int, start: int, delta: F32Array, out: Payload) -> None:
        """Elements ``start:start + delta.size`` of tensor ``index`` (``start`` on a block
        boundary): the bytes, and the residual, the whole tensor's encode gives them."""
        if not self.error_feedback:
            encode(delta, out, self.code, self.block)
            return
        stop = start + delta.size
        scratch, residual = self._scratch[index][start:stop], self.residual[index][start:stop]
        np.add(delta, residual, out=scratch)
        encode(scratch, out, self.code, self.block, residual=residual)


class DeltaSum:
    """f32 sums of quantized deltas, one per tensor, added one payload at a time."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self.sums = [np.zeros(size, dtype=F32) for size in self.sizes]
        self.count = 0

    def add(self, payloads: Sequence[Payload], code: Code, block: int) -> None:
        """Decode one contributor's payloads into the sums (a wrong length: SchemaError, nothing added)."""
        if len(payloads) != len(self.sizes):
            raise SchemaError(f"a delta of {len(payloads)} tensors, expected {len(self.sizes)}")
        for index, (payload, size) in enumerate(zip(payloads, self.sizes)):
            want = payload_bytes(code, size, block)
            if len(payload) != want:
                raise SchemaError(
                    f"tensor {index}: a {code.value} payload of {size} elements in blocks of {block} "
                    f"has {want} bytes, got {len(payload)}"
                )
        for payload, size, total in zip(payloads, self.sizes, self.sums):
            decode(payload, code, block, size, total, add=True)
        self.count += 1

    def mean(self, mass: float) -> list[F32Array]:
        """The sums divided once by the accepted mass (the contributors pre-multiplied by their weights)."""
        if not mass > 0:
            raise SchemaError(f"a round's accepted mass must be positive, got {mass}")
        return [np.divide(total, np.float32(mass), dtype=F32) for total in self.sums]

    def reset(self) -> None:
        for total in self.sums:
            total.fill(0.0)
        self.count = 0


def apply_delta(base: Sequence[F32Array], payloads: Sequence[Payload], code: Code, block: int) -> None:
    """A rank's side of the downlink: ``base += decoded delta``, in place, per tensor."""
    for array, payload in zip(base, payloads):
        decode(payload, code, block, array.size, array, add=True)


class DeltaDownlink:
    """The controller's downlink: the new consensus as a delta against the ranks' base."""

    def __init__(self, code: Code, block: int, base: Sequence[F32Array]) -> None:
        self.code = code
        self.block = block
        # The base every rank holds, bit for bit (a copy: the caller's arrays stay its own).
        self.base = [np.array(array, dtype=F32, copy=True) for array in base]
        self._scratch = [np.empty_like(array) for array in self.base]

    def encode(self, consensus: Sequence[F32Array], out: Sequence[Payload]) -> None:
        """Quantize ``consensus - base`` into ``out``; the base then advances as each rank's will."""
        _check_shapes("consensus", consensus, [array.size for array in self.base])
        for index, (target, payload) in enumerate(zip(consensus, out)):
            self.encode_tensor(index, target, payload)

    def encode_tensor(self, index: int, target: F32Array, out: Payload) -> None:
        """One tensor of :meth:`encode`: its delta coded into ``out``, its base advanced
        with the operation a rank's :func:`apply_delta` does."""
        self.encode_piece(index, 0, target, out)

    def encode_piece(self, index: int, start: int, target: F32Array, out: Payload) -> None:
        """Elements ``start:start + target.size`` of tensor ``index`` (``start`` on a block
        boundary, as a lane's piece is): the same bytes, and the same advanced base,
        as those blocks get when the whole tensor is coded."""
        stop = start + target.size
        scratch, base = self._scratch[index][start:stop], self.base[index][start:stop]
        np.subtract(target, base, out=scratch)
        encode(scratch, out, self.code, self.block)
        decode(out, self.code, self.block, target.size, base, add=True)


# -- delta rounds on the wire (docs/wire.md, "Delta rounds") ----------------

NO_BASE = bytes(DIGEST_LEN)  # the digest a rank sends with the f32 params that start a lineage


def digest_of(frame: RoundFrame) -> bytes | None:
    """A delta round frame's base digest (its last tensor); None for any other frame."""
    if frame.kind != RoundKind.MODEL or not frame.tensors or frame.tensors[-1].dtype != DTYPE_BASE_DIGEST:
        return None
    return bytes(frame.tensors[-1].data)


def is_delta_schema(schema: Sequence[tuple[int, tuple[int, ...]]]) -> bool:
    """Whether tensors of this (dtype, shape) schema are a delta round's: the last is the base digest."""
    return tuple(schema[-1:]) == ((DTYPE_BASE_DIGEST, (DIGEST_LEN,)),)


def lane_digest_of(frame: RoundFrame) -> bytes | None:
    """:func:`digest_of`, for a whole frame or a lane's: a delta round's last lane carries
    the digest as its last piece (before lane 0's schema, if it is also lane 0); through
    shards, lane 0 carries it as its one piece."""
    tag = read_lane_tag(frame)
    if tag is None:
        return digest_of(frame)
    at = len(frame.tensors) - 2 - tag.schema
    if frame.kind != RoundKind.MODEL or tag.index not in (0, tag.count - 1) or at < 0:
        return None
    t = frame.tensors[at]
    return bytes(t.data) if t.dtype == DTYPE_BASE_DIGEST and t.nbytes == DIGEST_LEN else None


def carries_codes(frame: RoundFrame) -> bool:
    """Whether any tensor of ``frame`` holds coded deltas (empty schema tensors aside)."""
    return any(DeltaCodec.of_tag(t.dtype) is not None and t.numel > 0 for t in frame.tensors)


def codec_of(frame: RoundFrame) -> DeltaCodec | None:
    """The delta codec of a delta round's frame (None: its tensors are f32, a lineage's first)."""
    codecs = {DeltaCodec.of_tag(t.dtype) for t in frame.tensors[:-1]}
    if codecs == {None}:
        return None
    if len(codecs) != 1 or None in codecs:
        raise SchemaError(f"a delta round's tensors must share one code, got {sorted(str(c) for c in codecs)}")
    return codecs.pop()


def flat_f32(payload: TensorPayload) -> F32Array:
    """An f32 payload as a flat array (zeros for an elided one)."""
    if payload.nbytes == 0:
        return np.zeros(payload.numel, dtype=F32)
    return np.frombuffer(payload.data, dtype=F32)


EncodeOne = Callable[[int, F32Array, Payload], None]  # (tensor index, values, payload to fill)


def delta_frame(
    values: Sequence[F32Array], shapes: Sequence[tuple[int, ...]], codec: DeltaCodec,
    digest: bytes | Callable[[], bytes], weight: float, encode_one: EncodeOne,
) -> RoundFrame:
    """A delta round's frame: each tensor coded by ``encode_one``, then the base digest
    (``digest``, or what it returns once every tensor is coded: the downlink's digest
    is of the base the coding advanced)."""
    tensors = []
    for index, (array, shape) in enumerate(zip(values, shapes)):
        payload = bytearray(codec.payload_bytes(array.size))
        encode_one(index, array, payload)
        tensors.append(TensorPayload(codec.tag, shape, payload))
    tail = digest if isinstance(digest, bytes) else digest()
    tensors.append(TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), tail))
    return RoundFrame(tensors, RoundKind.MODEL, weight)


class HostDeltaUplink:
    """A relay's re-encode of its host's summed deltas, with error feedback.

    The relay keeps one :class:`DeltaUplink` per params set (the whole model, or
    each fragment) and schema: an f32 residual and a scratch per tensor, two
    arrays of the set's size each (with fragments, two model-sized arrays in
    all), for as long as the relay runs (at most ``limit`` of them).
    """

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._uplinks: OrderedDict[tuple[int | None, Schema], DeltaUplink] = OrderedDict()

    def encode(self, schema: Schema, summed: RoundFrame, fragment: int | None = None) -> RoundFrame:
        """``summed`` (a fold's result: f32 sums, then the digest) coded as ``schema`` says."""
        return self.pending(schema, summed, fragment).whole()

    def pending(self, schema: Schema, summed: RoundFrame, fragment: int | None = None) -> PendingHostDelta:
        """``summed``, to be coded as it goes up: whole, or lane by lane. ``fragment``:
        the params set it is (None, the model), whose error feedback it carries on."""
        codec = DeltaCodec.of_tag(schema[1][0][0])
        assert codec is not None and digest_of(summed) is not None
        sums = [flat_f32(t) for t in summed.tensors[:-1]]
        uplink = self._uplink_for((fragment, schema), codec, [a.size for a in sums])
        return PendingHostDelta(schema, summed, codec, uplink, sums)

    def _uplink_for(self, key: tuple[int | None, Schema], codec: DeltaCodec, sizes: list[int]) -> DeltaUplink:
        uplink = self._uplinks.get(key)
        if uplink is None:
            uplink = self._uplinks[key] = DeltaUplink(codec.code, codec.block, sizes)
            while len(self._uplinks) > self.limit:
                self._uplinks.popitem(last=False)
        self._uplinks.move_to_end(key)
        return uplink


class PendingHostDelta:
    """A relay's summed deltas, coded for the uplink only as they go: :meth:`whole` for
    one frame, or :meth:`lane` for each lane in order (its encode then overlaps the
    lanes before it going up). Either way the bytes and the error feedback are the
    same (pieces start on block boundaries), and each element is coded once."""

    def __init__(self, schema: Schema, summed: RoundFrame, codec: DeltaCodec, uplink: DeltaUplink,
                 sums: list[F32Array]) -> None:
        self.schema = schema
        self.summed = summed
        self.codec = codec
        self._uplink = uplink
        self._sums = sums
        # A host whose ranks did no work sends its sums (zeros) without its residual.
        self._encode_piece = uplink.encode_piece if summed.weight > 0 else uplink.hold_piece

    @property
    def weight(self) -> float:
        return self.summed.weight

    def _encode_tensor(self, index: int, delta: F32Array, out: Payload) -> None:
        self._encode_piece(index, 0, delta, out)

    def schema_frame(self) -> RoundFrame:
        """The frame's schema (empty tensors of its coded dtypes): what its lanes are cut by."""
        return RoundFrame([TensorPayload(dtype, shape) for dtype, shape in self.schema[1]], RoundKind.MODEL)

    def whole(self) -> RoundFrame:
        shapes = [tuple(t.shape) for t in self.summed.tensors[:-1]]
        digest = digest_of(self.summed)
        assert digest is not None
        return delta_frame(self._sums, shapes, self.codec, digest, self.weight, self._encode_tensor)

    def lanes(self, layout: LaneLayout) -> Iterator[RoundFrame]:
        """The frame as ``layout``'s lane frames, in order (as :meth:`LaneLayout.split`
        cuts a frame), each lane coded only when it is asked for."""
        for index, pieces in enumerate(layout.lanes):
            yield self.lane(pieces, layout.trailer(index))

    def lane(self, pieces: Sequence[Piece], trailer: Sequence[TensorPayload]) -> RoundFrame:
        """One lane's frame: its ``pieces`` coded (the digest's piece as it is), then ``trailer``."""
        tensors = []
        for p in pieces:
            if p.tensor == len(self._sums):
                tensors.append(self.summed.tensors[-1])
                continue
            out = bytearray(self.codec.payload_bytes(p.numel))
            self._encode_piece(p.tensor, p.start, self._sums[p.tensor][p.start:p.stop], out)
            tensors.append(TensorPayload(self.codec.tag, (p.numel,), out))
        return RoundFrame([*tensors, *trailer], RoundKind.MODEL, self.weight)


class DeltaLineage:
    """The controller's side of the delta rounds of one params set (the model, or a
    fragment): the exact consensus ``x`` (what the outer step moves), and the base
    every rank holds, which trails ``x`` by what the downlink's code dropped.

    A lineage starts with an f32 params round whose frames carry :data:`NO_BASE`;
    after it every params round carries deltas against the base.
    """

    def __init__(self) -> None:
        self.x: list[F32Array] | None = None
        self.downlink: DeltaDownlink | None = None
        self.digest = NO_BASE
        self.rounds = 0  # rounds finished (each changes x and the base)
        self._shapes: list[tuple[int, ...]] = []
        self._first_in_lanes = False  # a lineage's first round, going out lane by lane
        self._lanes_start = True  # whether that first round has mass (starts the lineage)
        self._lane_codec: DeltaCodec | None = None  # the code of the round going out lane by lane
        # The new base's digest, fed piece by piece as lanes go out (they come in order).
        self._lane_hash = hashlib.blake2b(digest_size=DIGEST_LEN)

    @property
    def base(self) -> list[F32Array] | None:
        return None if self.downlink is None else self.downlink.base

    def check_base(self, frame: RoundFrame, source: str) -> None:
        """A contribution (a whole frame, or a delta round's last lane: the one with the
        digest) must be against this lineage's base (SchemaError naming ``source``)."""
        digest = lane_digest_of(frame)
        tag = read_lane_tag(frame)
        if tag is None:
            self._check_tags(tuple((t.dtype, tuple(t.shape)) for t in frame.tensors), source)
        elif tag.index == 0:
            self._check_tags(LaneLayout.declared_by(frame).schema, source)
        if digest == self.digest and digest != NO_BASE and tag is None:
            self._check_shapes([tuple(t.shape) for t in frame.tensors[:-1]], source)
        elif tag is not None and tag.index == 0 and self.downlink is not None:
            schema = LaneLayout.declared_by(frame).schema  # what its lanes say the round's tensors are
            if is_delta_schema(schema) and DeltaCodec.of_tag(schema[0][0]) is not None:
                self._check_shapes([shape for _, shape in schema[:-1]], source)
            elif is_delta_schema(schema):  # its last lane will carry no base: refused before any lane folds
                self._refuse(NO_BASE, source)
        if digest is None or digest == self.digest:
            return
        self._refuse(digest, source)

    def _check_tags(self, schema: Sequence[tuple[int, tuple[int, ...]]], source: str) -> None:
        """A frame (or the schema a lane 0 declares) with delta tags is a delta round's:
        one or more params, all plain (a lineage's first round) or all in one code, then
        the base digest once, last; coded only against a base. Else SchemaError naming
        ``source``: folded, its sums would make a consensus no lane or relay takes (the
        controller stopped on it)."""
        if not any(is_delta_dtype(dtype) for dtype, _ in schema):
            return
        params = schema[:-1]
        if not params or not is_delta_schema(schema) or any(dtype == DTYPE_BASE_DIGEST for dtype, _ in params):
            raise SchemaError(
                f"{source} sent tensors {[describe_dtype(d) for d, _ in schema]}: a delta round's frame is its "
                "params, then the base digest once, last"
            )
        codecs = {DeltaCodec.of_tag(dtype) for dtype, _ in params}
        if len(codecs) != 1:
            raise SchemaError(f"{source}'s delta round tensors must share one code, got "
                              f"{sorted(describe_dtype(d) for d in {d for d, _ in params})}")
        if codecs != {None} and self.digest == NO_BASE:
            raise SchemaError(f"{source} sent coded deltas, but the controller's lineage has no base yet "
                              "(a lineage's first round is the params in f32)")

    def _refuse(self, digest: bytes, source: str) -> None:
        """A contribution against another base than this lineage's. Once the lineage has a
        base, a lineage's first round (f32, the zero digest) is one too: honest ranks
        hold the base (a joiner is given it), and one folded first would otherwise have
        its neighbours' deltas against the base dropped as the odd schema out."""
        raise SchemaError(
            f"{source}'s delta is against base {digest.hex()}, the controller's is {self.digest.hex()} "
            "(it missed a consensus, or started from other params)"
        )

    def _check_shapes(self, shapes: list[tuple[int, ...]], source: str) -> None:
        """A delta against this base (a whole frame, or the schema a lane 0 declares) holds
        one tensor per param, of its shape (it could not be added to ``x`` otherwise)."""
        if self._shapes and shapes != self._shapes:
            raise SchemaError(
                f"{source}'s delta has tensors of shapes {shapes}; the params its base is of have {self._shapes}"
            )

    def averaged(self, consensus: RoundFrame) -> RoundFrame:
        """The round's mean (f32 tensors, then the digest) as the params the outer step
        takes: ``x + mean delta``, or for a lineage's first round the f32 mean itself."""
        tensors = consensus.tensors[:-1]
        if self.x is None or digest_of(consensus) == NO_BASE:
            return RoundFrame(list(tensors), RoundKind.MODEL, consensus.weight)
        values = [np.add(x, flat_f32(t), dtype=F32).reshape(t.shape) for x, t in zip(self.x, tensors)]
        return RoundFrame(
            [TensorPayload(0, t.shape, v) for t, v in zip(tensors, values)], RoundKind.MODEL, consensus.weight
        )

    def downlink_frame(self, params: RoundFrame, codec: DeltaCodec | None) -> RoundFrame:
        """The stepped params out, as the ranks are sent them (a joiner is sent
        :meth:`joiner_frame`).

        ``codec`` None (a lineage's first round): the f32 params and their digest,
        which becomes the base. Else the params as a delta against the base, coded
        with the round's codec (the base then advances as each rank's will), and the
        new base's digest."""
        x = [np.array(flat_f32(t), dtype=F32, copy=True) for t in params.tensors]
        self._shapes = [tuple(t.shape) for t in params.tensors]
        self.x = x
        if codec is None and not params.weight > 0:
            return self._not_started(params)
        if codec is None or self.downlink is None:
            self.downlink = DeltaDownlink(codec.code if codec else Code.INT8, codec.block if codec else 1024, x)
            self.digest = base_digest(self.downlink.base)
            self.rounds += 1
            out = [*params.tensors, TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), self.digest)]
            return RoundFrame(out, RoundKind.MODEL, params.weight)
        downlink = self.downlink
        downlink.code, downlink.block = codec.code, codec.block
        return delta_frame(x, self._shapes, codec, self._advanced_digest, params.weight, downlink.encode_tensor)

    def _not_started(self, params: RoundFrame) -> RoundFrame:
        """A first round with zero accepted mass: every rank sent ``0 x params``, so the
        sums are no params of anyone's and start no lineage. The ranks keep their own
        params and no base (the digest goes back as :data:`NO_BASE`); the next round
        with mass is the lineage's first."""
        self.downlink, self.digest = None, NO_BASE
        return RoundFrame([*params.tensors, TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), NO_BASE)],
                          RoundKind.MODEL, params.weight)

    def _advanced_digest(self) -> bytes:
        """The digest of the base as the downlink just advanced it (kept for the next round's checks)."""
        assert self.downlink is not None
        self.digest = base_digest(self.downlink.base)
        self.rounds += 1
        return self.digest

    # -- a delta round that goes out lane by lane (docs/wire.md, "In lanes") --------

    def begin_lanes(self, shapes: Sequence[tuple[int, ...]], codec: DeltaCodec | None, weight: float = 1.0) -> None:
        """A round in lanes starts; ``codec`` None: its params are f32 (a lineage's first,
        unless its accepted mass ``weight`` is 0: see :meth:`_not_started`)."""
        self._lane_hash = hashlib.blake2b(digest_size=DIGEST_LEN)
        self._lane_codec = codec
        if codec is None or self.downlink is None:
            self._shapes = [tuple(shape) for shape in shapes]
            self.x = [np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=F32) for shape in shapes]
            self._first_in_lanes = True
            self._lanes_start = weight > 0
            return
        if [tuple(shape) for shape in shapes] != self._shapes:
            raise SchemaError(f"a delta round of shapes {[list(s) for s in shapes]}, the lineage's are "
                              f"{[list(s) for s in self._shapes]}")
        self.downlink.code, self.downlink.block = codec.code, codec.block
        self._first_in_lanes = False

    def lane_params(self, tensor: int, start: int, mean: F32Array) -> F32Array:
        """The params the outer step takes for elements ``start:`` of ``tensor`` (as many
        as ``mean`` has): ``x + mean delta``, or in a first round the mean itself (a copy)."""
        if self._first_in_lanes:
            return np.array(mean, dtype=F32, copy=True)
        assert self.x is not None
        return np.add(self.x[tensor][start:start + mean.size], mean, dtype=F32)

    def lane_downlink(self, tensor: int, start: int, stepped: F32Array) -> tuple[int, Payload | F32Array]:
        """A piece's stepped params out, as (dtype, payload): ``x`` takes them; coded against
        the base, which advances as the ranks' will (bytes the whole tensor's coding
        gives those blocks), or in a first round f32 as they are."""
        assert self.x is not None
        stop = start + stepped.size
        self.x[tensor][start:stop] = stepped
        codec = self._lane_codec
        if self._first_in_lanes or self.downlink is None or codec is None:
            self._lane_hash.update(self.x[tensor][start:stop].view(np.uint8).data)
            return DTYPE_F32, stepped
        out = bytearray(codec.payload_bytes(stepped.size))
        self.downlink.encode_piece(tensor, start, stepped, out)
        self._lane_hash.update(self.downlink.base[tensor][start:stop].view(np.uint8).data)
        return codec.tag, out

    def lanes_done(self) -> bytes:
        """Every piece of the round went out: the digest of the base the ranks now hold
        (after a first round, ``x`` itself), hashed piece by piece as they went (the
        pieces cover every tensor in order: :func:`base_digest`'s bytes)."""
        if self._first_in_lanes and not self._lanes_start:  # zero mass: no lineage (see _not_started)
            self._first_in_lanes = False
            self.downlink, self.digest = None, NO_BASE
            return NO_BASE
        if self._first_in_lanes:
            assert self.x is not None
            self.downlink = DeltaDownlink(Code.INT8, 1024, self.x)
            self._first_in_lanes = False
        self.digest = self._lane_hash.digest()
        self.rounds += 1
        return self.digest

    # -- a controller's resume record (docs/wire.md, "Resuming") ------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """What a controller started again needs to go on with this lineage: ``x``, the
        base and their shapes, the downlink's code and the base's digest. The arrays
        are views: both move in place with the next round, so the caller saves them
        before it (the controller writes its record before the consensus goes out,
        and no next round comes before that). Empty before the lineage's first round."""
        if self.x is None or self.downlink is None:
            return {}
        state: dict[str, np.ndarray] = {
            "digest": np.frombuffer(self.digest, dtype=np.uint8).copy(),
            "code": np.array([_CODES.index(self.downlink.code), self.downlink.block], dtype=np.int64),
        }
        for i, (shape, x, base) in enumerate(zip(self._shapes, self.x, self.downlink.base)):
            state[f"shape.{i}"] = np.array(shape, dtype=np.int64)
            state[f"x.{i}"] = x
            state[f"base.{i}"] = base
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], where: str) -> DeltaLineage:
        """A lineage as :meth:`state_dict` left it (SchemaError naming ``where`` if the
        state is not one)."""
        lineage = cls()
        try:
            count = sum(1 for key in state if key.startswith("shape."))
            shapes = [tuple(int(d) for d in state[f"shape.{i}"]) for i in range(count)]
            xs = [np.ascontiguousarray(state[f"x.{i}"], dtype=F32) for i in range(count)]
            bases = [state[f"base.{i}"] for i in range(count)]
            code, block = (int(v) for v in state["code"])
            digest = bytes(np.asarray(state["digest"], dtype=np.uint8))
            sizes_agree = all(x.size == b.size == int(np.prod(s, dtype=np.int64)) for x, b, s in zip(xs, bases, shapes))
            if not sizes_agree or len(digest) != DIGEST_LEN or not 0 <= code < len(_CODES):
                raise ValueError("its arrays, code or digest do not agree")
        except (KeyError, ValueError, TypeError) as exc:
            raise SchemaError(f"{where}: not a delta lineage's state ({exc})") from exc
        lineage.x, lineage._shapes, lineage.digest = xs, shapes, digest
        lineage.downlink = DeltaDownlink(_CODES[code], block, bases)
        return lineage

    def params_frame(self, weight: float) -> RoundFrame:
        """``x`` in f32 in its shapes (copies), as the hooks see a whole delta round's params."""
        assert self.x is not None
        return RoundFrame(
            [TensorPayload(DTYPE_F32, shape, x.copy()) for shape, x in zip(self._shapes, self.x)], RoundKind.MODEL, weight
        )

    def joiner_frame(self, weight: float) -> RoundFrame:
        """The base in f32, as a params consensus: where a joiner starts. A copy: the
        base advances in place with the next round, while this frame is kept (signed,
        its payloads read as they are) until a later window replaces it. Before the
        lineage started (a first round with zero mass) it is that round's weight-0
        params: the ranks kept their own, and so does a joiner."""
        if self.downlink is None:
            assert self.x is not None
            return RoundFrame([TensorPayload(0, shape, x.copy()) for shape, x in zip(self._shapes, self.x)],
                              RoundKind.MODEL, 0.0)
        return RoundFrame(
            [TensorPayload(0, shape, base.copy()) for shape, base in zip(self._shapes, self.downlink.base)],
            # Every rank takes a delta consensus, mass 0 or not (the base moves): never
            # a weight-0 frame, which a joiner would skip.
            RoundKind.MODEL, weight if weight > 0 else 1.0,
        )


class DeltaLineages:
    """The controller's lineages, one per params set: the whole model (None) or each
    fragment (its index). ``window_fragment`` is the set the window in progress
    syncs: whoever places rounds in windows sets it when a Control round opens one."""

    def __init__(self) -> None:
        self._lineages: dict[int | None, DeltaLineage] = {}
        self.window_fragment: int | None = None

    @property
    def rounds(self) -> int:
        """Delta rounds finished over every lineage: it moves whenever their state does."""
        return sum(lineage.rounds for lineage in self._lineages.values())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every lineage's :meth:`DeltaLineage.state_dict`, under ``model.`` (the whole
        model's) or ``fragment.<index>.``."""
        state: dict[str, np.ndarray] = {}
        for key, lineage in self._lineages.items():
            prefix = "model." if key is None else f"fragment.{key}."
            state.update({prefix + name: array for name, array in lineage.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray], where: str) -> None:
        """Take on the lineages a controller that ran before had (its resume record)."""
        grouped: dict[int | None, dict[str, np.ndarray]] = {}
        for name, array in state.items():
            head, _, rest = name.partition(".")
            if head == "model":
                grouped.setdefault(None, {})[rest] = array
            elif head == "fragment" and rest.partition(".")[0].isdigit():
                index, _, field = rest.partition(".")
                grouped.setdefault(int(index), {})[field] = array
            else:
                raise SchemaError(f"{where}: {name!r} is not a key of delta lineages' state")
        self._lineages = {key: DeltaLineage.from_state(fields, where) for key, fields in grouped.items()}

    def forget(self) -> None:
        """The run starts again from no state (every rank died before any window could be
        kept): no rank holds a base, so each lineage starts anew with its first round."""
        self._lineages.clear()

    @property
    def current(self) -> DeltaLineage:
        """The lineage of the window in progress' params set."""
        lineage = self._lineages.get(self.window_fragment)
        if lineage is None:
            lineage = self._lineages[self.window_fragment] = DeltaLineage()
        return lineage


__all__ = [
    "NO_BASE",
    "DeltaDownlink",
    "DeltaLineage",
    "DeltaLineages",
    "DeltaSum",
    "DeltaUplink",
    "HostDeltaUplink",
    "PendingHostDelta",
    "apply_delta",
    "carries_codes",
    "codec_of",
    "delta_frame",
    "digest_of",
    "flat_f32",
    "is_delta_schema",
    "lane_digest_of",
]
