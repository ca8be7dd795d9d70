"""RoundFrame: one rank's (or one host's) contribution to a round, or its consensus.

Layout (PROTOCOL.md section 4), little-endian::

    u32 magic | u32 count | u8 kind | f64 weight
    count x ( u8 dtype | u8 ndim | ndim x u32 dim | u64 nbytes | nbytes payload )
    MAC8(every preceding byte)

Encoding is streaming: :func:`encode_round_frame_chunks` returns the frame as
a list of buffers whose payload pieces are zero-copy views of the caller's
arrays, with the MAC computed incrementally over them. Decoding is zero-copy
over a buffer that already holds the whole frame (a receive buffer filled with
``recv_into``): payloads come back as memoryviews into that buffer.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import FramingError, SchemaError
from .bf16 import DTYPE_NAMES, itemsize
from .constants import DEFAULT_FRAME_CEILING, MAC_LEN, MAX_TENSORS, ROUND_FRAME_MAGIC
from .quant import DIGEST_LEN, DTYPE_BASE_DIGEST, DeltaCodec
from .salt import Buffer, SessionSalt, verify_mac

_FRAME_HEADER = struct.Struct("<IIBd")  # magic, count, kind, weight
_TENSOR_HEAD = struct.Struct("<BB")  # dtype, ndim
_U64 = struct.Struct("<Q")
FRAME_HEADER_LEN = _FRAME_HEADER.size  # 17
# Payloads smaller than this are copied into the surrounding header chunk so
# a model with hundreds of small tensors is not sent as hundreds of writes.
COALESCE_BELOW = 64 << 10


class RoundKind(enum.IntEnum):
    """Model rounds are weighted means; Control rounds are plain sums."""

    MODEL = 0
    CONTROL = 1


def _as_bytes_view(data: Any) -> memoryview:
    """A flat byte view of any buffer (bytes, bytearray, memoryview, ndarray)."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B") if view.c_contiguous else memoryview(bytes(view))
    return view


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _payload_list(values: Iterable[TensorPayload]) -> list[TensorPayload]:
    return list(values)


@attrs.frozen(eq=False)
class TensorPayload:
    """One tensor on the wire: dtype tag, shape, and its raw little-endian bytes.

    ``data`` may be empty for a non-empty shape: the tensor is all zeros
    ("zero elision"), which costs 10 + 4 x ndim bytes whatever its size.
    """

    dtype: int
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    data: memoryview = attrs.field(converter=_as_bytes_view, default=b"")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def elided(self) -> bool:
        """True when the payload is the zero-elision marker (no bytes, numel > 0)."""
        return self.data.nbytes == 0 and self.numel > 0

    def expected_nbytes(self) -> int:
        expected = payload_nbytes(self.dtype, self.numel)
        if expected is None:
            raise SchemaError(f"unknown wire dtype tag {self.dtype}")
        return expected

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorPayload):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and self.data == other.data
        )

    def __repr__(self) -> str:
        name = describe_dtype(self.dtype)
        body = "elided" if self.elided else f"{self.nbytes} bytes"
        return f"TensorPayload({name}{list(self.shape)}, {body})"


@attrs.frozen(eq=False)
class RoundFrame:
    """A list of tensors plus the realized-work mass they carry.

    For a Model round each rank sends ``w * T`` and ``weight = w``; sums never
    divide, the controller divides once by the total accepted mass.
    """

    tensors: list[TensorPayload] = attrs.field(factory=list, converter=_payload_list)
    kind: RoundKind = attrs.field(default=RoundKind.MODEL, converter=RoundKind)
    weight: float = 1.0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoundFrame):
            return NotImplemented
        return (
            self.kind == other.kind
            and self.weight == other.weight
            and self.tensors == other.tensors
        )

    @property
    def encoded_len(self) -> int:
        """Bytes this frame occupies on the wire, MAC included."""
        return round_frame_len(self.tensors)


def round_frame_len(tensors: Sequence[TensorPayload]) -> int:
    return FRAME_HEADER_LEN + MAC_LEN + sum(10 + 4 * len(t.shape) + t.nbytes for t in tensors)


def check_payloads(frame: RoundFrame, source: str) -> None:
    """Every payload of ``frame`` has a known dtype and the byte count its shape needs
    (or is elided): SchemaError naming ``source`` and the tensor otherwise."""
    for index, tensor in enumerate(frame.tensors):
        check_payload(tensor, index, source)
        if frame.kind == RoundKind.CONTROL and is_delta_dtype(tensor.dtype):
            raise SchemaError(f"{source} tensor {index}: a {describe_dtype(tensor.dtype)} in a Control frame (Model only)")


def schema_frame_len(schema: Iterable[tuple[int, Sequence[int]]]) -> int:
    """Length of a frame of this ``(dtype, shape)`` schema with nothing elided: the
    largest a consensus for it can be (known dtypes only)."""
    total = FRAME_HEADER_LEN + MAC_LEN
    for dtype, shape in schema:
        nbytes = payload_nbytes(dtype, math.prod(shape))
        if nbytes is None:
            raise SchemaError(f"unknown wire dtype tag {dtype}")
        total += 10 + 4 * len(shape) + nbytes
    return total


def payload_nbytes(dtype: int, numel: int) -> int | None:
    """The payload bytes of a tensor of ``numel`` elements in ``dtype`` (None: a tag
    this version does not know). f32 and bf16 are flodl's; the delta codes and the
    base digest are flodl_trio's (docs/wire.md, "Delta rounds")."""
    if dtype in DTYPE_NAMES:
        return numel * itemsize(dtype)
    if dtype == DTYPE_BASE_DIGEST:  # 16 bytes; 0 only in a lane-0 schema tensor ([0, 16])
        return numel if numel in (0, DIGEST_LEN) else None
    codec = DeltaCodec.of_tag(dtype)
    return None if codec is None else codec.payload_bytes(numel)


def is_delta_dtype(dtype: int) -> bool:
    """Whether ``dtype`` is one of flodl_trio's delta-round tags (a code or the digest)."""
    return dtype == DTYPE_BASE_DIGEST or DeltaCodec.of_tag(dtype) is not None


def describe_dtype(dtype: int) -> str:
    """A dtype tag as a reader wants it in an error ("bf16", "int8:1024 delta", or "dtype tag 7")."""
    if dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if dtype == DTYPE_BASE_DIGEST:
        return "base digest"
    codec = DeltaCodec.of_tag(dtype)
    return f"{codec} delta" if codec is not None else f"dtype tag {dtype}"


# The base digest's shapes: itself; in lane frames an empty piece, and lane 0's schema tensor.
_DIGEST_SHAPES = ((DIGEST_LEN,), (0,), (0, DIGEST_LEN))


def check_payload(t: TensorPayload, index: int, source: str) -> None:
    """A payload's byte length must be what its dtype and shape need (or the elision marker)."""
    expected = payload_nbytes(t.dtype, t.numel)
    if t.dtype == DTYPE_BASE_DIGEST and tuple(t.shape) not in _DIGEST_SHAPES:
        expected = None
    if expected is None:
        if t.dtype == DTYPE_BASE_DIGEST:
            raise SchemaError(f"{source} tensor {index}: a base digest of shape {list(t.shape)}, expected "
                              f"[{DIGEST_LEN}] (in a lane frame also [0] or [0, {DIGEST_LEN}])")
        raise SchemaError(
            f"{source} tensor {index}: unknown dtype tag {t.dtype} (0 = f32, 1 = bf16, 0x7F base digest, "
            f"0x80-0xAC delta codes)"
        )
    if t.nbytes not in (0, expected) or (t.dtype == DTYPE_BASE_DIGEST and t.nbytes != expected):
        per = f"{itemsize(t.dtype)} bytes of " if t.dtype in DTYPE_NAMES else ""
        raise SchemaError(
            f"{source} tensor {index}: {t.nbytes} payload bytes, expected {expected} "
            f"(numel {t.numel} x {per}{describe_dtype(t.dtype)})"
        )


@attrs.frozen
class EncodedFrame:
    """A frame ready for the socket: buffers to write in order, and their total."""

    chunks: list[Buffer]
    nbytes: int

    def tobytes(self) -> bytes:
        return b"".join(self.chunks)


def _validate_for_encode(frame: RoundFrame) -> None:
    if len(frame.tensors) > MAX_TENSORS:
        raise SchemaError(
            f"RoundFrame has {len(frame.tensors)} tensors; the protocol allows at most {MAX_TENSORS}"
        )
    if not (math.isfinite(frame.weight) and frame.weight >= 0):
        raise SchemaError(f"RoundFrame weight must be finite and >= 0, got {frame.weight!r}")
    for i, t in enumerate(frame.tensors):
        if len(t.shape) > 255:
            raise SchemaError(f"tensor {i}: {len(t.shape)} dims; the protocol allows at most 255")
        if any(not 0 <= d <= 0xFFFFFFFF for d in t.shape):
            raise SchemaError(f"tensor {i}: dim out of u32 range in shape {list(t.shape)}")


def frame_body_chunks(frame: RoundFrame) -> EncodedFrame:
    """The frame's bytes before its MAC, as buffers: small pieces joined, payloads as views."""
    _validate_for_encode(frame)
    chunks: list[Buffer] = []
    pending = bytearray(
        _FRAME_HEADER.pack(ROUND_FRAME_MAGIC, len(frame.tensors), int(frame.kind), frame.weight)
    )
    total = 0
    for t in frame.tensors:
        pending += _TENSOR_HEAD.pack(t.dtype, len(t.shape))
        pending += struct.pack(f"<{len(t.shape)}I", *t.shape)
        pending += _U64.pack(t.nbytes)
        if t.nbytes < COALESCE_BELOW:
            pending += t.data
            continue
        chunks.append(bytes(pending))
        total += len(pending)
        pending = bytearray()
        chunks.append(t.data)
        total += t.nbytes
    if pending:
        chunks.append(bytes(pending))
        total += len(pending)
    return EncodedFrame(chunks, total)


def encoded_frame_weight(frame: EncodedFrame) -> float:
    """The weight field of an encoded RoundFrame (its header's last 8 bytes), read in
    place: a frame this side encoded or verified, so its header is whole."""
    head = bytearray()
    for chunk in frame.chunks:
        head += memoryview(chunk).cast("B")[: _FRAME_HEADER.size - len(head)]
        if len(head) == _FRAME_HEADER.size:
            return float(_FRAME_HEADER.unpack(head)[3])
    raise FramingError(f"an encoded RoundFrame of {frame.nbytes} bytes, shorter than its {_FRAME_HEADER.size}-byte header")


def encode_round_frame_chunks(frame: RoundFrame, salt: SessionSalt) -> EncodedFrame:
    """Serialize and sign ``frame`` without copying its large payloads."""
    body = frame_body_chunks(frame)
    tag = salt.mac8_of(body.chunks)
    return EncodedFrame([*body.chunks, tag], body.nbytes + MAC_LEN)


def encode_round_frame(frame: RoundFrame, salt: SessionSalt) -> bytes:
    """The frame as one bytes object (tests, golden vectors, small frames)."""
    return encode_round_frame_chunks(frame, salt).tobytes()


class _Cursor:
    """Bounds-checked reader over a frame body, naming what ran out."""

    __slots__ = ("pos", "source", "view")

    def __init__(self, view: memoryview, source: str) -> None:
        self.view = view
        self.source = source
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.view):
            raise FramingError(
                f"RoundFrame from {self.source} ended inside {what}: it needs {n} bytes at offset {self.pos} "
                f"but the message holds only {len(self.view)} bytes (length prefix smaller than the frame?)"
            )
        out = self.view[self.pos:end]
        self.pos = end
        return out


def decode_round_frame(
    body: Buffer | np.ndarray,
    salt: SessionSalt | None,
    *,
    ceiling: int = DEFAULT_FRAME_CEILING,
    source: str = "peer",
    mac_of_body: bytes | None = None,
    authenticated: bool = False,
) -> RoundFrame:
    """Parse and verify one RoundFrame that fills ``body`` exactly.

    Checks, in PROTOCOL.md's order: magic, count, kind, weight, the running
    payload total against ``ceiling``, then the MAC; then that the frame used
    the whole message. Payloads are zero-copy views into ``body``. dtype and
    shape-vs-bytes are left to the fold/decode, which name the tensor.

    ``mac_of_body`` is MAC8 of ``body[:-8]`` computed while the bytes arrived
    (so the check costs no second pass). ``authenticated`` says the frame's own
    tag is not to be checked, because every byte of ``body`` was vouched for
    otherwise: by the MAC of the MuxRecord that carried it (same key), by this
    process having built it, or by arriving on the same-uid local leg, where
    frames are not signed (docs/wire.md); ``salt`` may then be None.
    """
    view = _as_bytes_view(body)
    cur = _Cursor(view, source)
    magic, count, kind, weight = _FRAME_HEADER.unpack(cur.take(FRAME_HEADER_LEN, "the frame header"))
    if magic != ROUND_FRAME_MAGIC:
        raise FramingError(f"RoundFrame from {source}: bad magic 0x{magic:08X} (want 0x{ROUND_FRAME_MAGIC:08X})")
    if count > MAX_TENSORS:
        raise FramingError(f"RoundFrame from {source}: tensor count {count} exceeds {MAX_TENSORS}")
    if kind not in (RoundKind.MODEL, RoundKind.CONTROL):
        raise FramingError(f"RoundFrame from {source}: unknown kind byte {kind} (0 Model, 1 Control)")
    if not (math.isfinite(weight) and weight >= 0):
        raise FramingError(f"RoundFrame from {source}: weight {weight!r} is not finite and >= 0")
    headers: list[tuple[int, tuple[int, ...], memoryview]] = []
    payload_total = 0
    for i in range(count):
        dtype, ndim = _TENSOR_HEAD.unpack(cur.take(2, f"tensor {i}'s dtype/ndim"))
        shape = struct.unpack(f"<{ndim}I", cur.take(4 * ndim, f"tensor {i}'s dims"))
        (nbytes,) = _U64.unpack(cur.take(8, f"tensor {i}'s byte length"))
        payload_total += nbytes
        if payload_total > ceiling:
            raise FramingError(
                f"RoundFrame from {source}: tensor {i} brings the payload total to "
                f"{payload_total} bytes, over the frame ceiling of {ceiling}"
            )
        headers.append((dtype, shape, cur.take(nbytes, f"tensor {i}'s {nbytes}-byte payload")))
    signed_end = cur.pos
    tag = cur.take(MAC_LEN, "the MAC")
    if cur.pos != len(view):
        raise FramingError(
            f"RoundFrame from {source} used {cur.pos} bytes, {len(view) - cur.pos} fewer than "
            f"its length prefix declared ({len(view)}): the stream is desynced"
        )
    if not authenticated:
        if mac_of_body is not None:
            expected = mac_of_body
        elif salt is not None:
            expected = salt.mac8(view[:signed_end])
        else:
            raise TypeError("decode_round_frame needs the salt to verify the frame's MAC")
        verify_mac(expected, tag, f"RoundFrame from {source}")
    _check_declared_total(headers, ceiling, source)
    tensors = [TensorPayload(d, s, p) for d, s, p in headers]
    return RoundFrame(tensors, RoundKind(kind), weight)


def _check_declared_total(headers: Sequence[tuple[int, tuple[int, ...], memoryview]], ceiling: int, source: str) -> None:
    """An elided tensor stands for its whole shape: whoever folds it or cuts it into lanes
    sizes buffers by that, so the payload the frame declares - every elided tensor
    counted at its full size - must fit the ceiling too (a 61-byte frame must not
    declare terabytes). Unknown dtypes are left to :func:`check_payload`."""
    declared = 0
    for i, (dtype, shape, payload) in enumerate(headers):
        if payload.nbytes:
            declared += payload.nbytes
            continue
        full = payload_nbytes(dtype, math.prod(shape))
        declared += full or 0
        if declared > ceiling:
            raise FramingError(
                f"RoundFrame from {source}: tensor {i} (elided, shape {list(shape)}) brings the payload the frame "
                f"declares to {declared} bytes, over the frame ceiling of {ceiling}"
            )
