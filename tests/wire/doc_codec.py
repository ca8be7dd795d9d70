"""An encoder and decoder of the wire, written from PROTOCOL.md and docs/wire.md alone.

Nothing here imports ``flodl_trio``: the conformance tests
(``test_conformance.py``) check the project's bytes against these and feed
these to the project, so a mistake shared by the project's encoder and
decoder cannot hide behind a round trip. Plain ``struct``, ``hmac`` and
numpy, one function per message, in the docs' words.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROUND_MAGIC = 0xF10D17F1
MUX_MAGIC = 0xF10D17D0
MODEL, CONTROL = 0, 1
F32, BF16, DIGEST = 0, 1, 0x7F
ITEMSIZE = {F32: 4, BF16: 2}
MUX_DATA, MUX_CONTROL, MUX_HOST_FRAME, MUX_BROADCAST = 1, 2, 3, 4


def mac8(salt: bytes, *parts: bytes) -> bytes:
    """PROTOCOL.md: the first 8 bytes of HMAC-SHA256 keyed with the raw salt."""
    return hmac.new(salt, b"".join(parts), hashlib.sha256).digest()[:8]


# -- RoundFrame ---------------------------------------------------------------


@dataclass
class Tensor:
    dtype: int
    shape: tuple[int, ...]
    data: bytes = b""


@dataclass
class Frame:
    tensors: list[Tensor] = field(default_factory=list)
    kind: int = MODEL
    weight: float = 1.0
    mac: bytes = b""


def frame_body(frame: Frame) -> bytes:
    """Every byte of a RoundFrame before its MAC."""
    out = [struct.pack("<IIBd", ROUND_MAGIC, len(frame.tensors), frame.kind, frame.weight)]
    for t in frame.tensors:
        out.append(struct.pack("<BB", t.dtype, len(t.shape)))
        out.append(struct.pack(f"<{len(t.shape)}I", *t.shape))
        out.append(struct.pack("<Q", len(t.data)))
        out.append(bytes(t.data))
    return b"".join(out)


def encode_frame(frame: Frame, salt: bytes | None) -> bytes:
    """A RoundFrame; ``salt`` None puts 8 zero bytes where the MAC goes (lane frames, local leg)."""
    body = frame_body(frame)
    return body + (mac8(salt, body) if salt is not None else bytes(8))


def decode_frame(data: bytes) -> Frame:
    """Parse a RoundFrame (no MAC check: the caller checks what the docs say it must)."""
    magic, count, kind, weight = struct.unpack_from("<IIBd", data, 0)
    assert magic == ROUND_MAGIC, hex(magic)
    pos = 17
    tensors = []
    for _ in range(count):
        dtype, ndim = struct.unpack_from("<BB", data, pos)
        pos += 2
        shape = struct.unpack_from(f"<{ndim}I", data, pos)
        pos += 4 * ndim
        (nbytes,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        tensors.append(Tensor(dtype, tuple(shape), bytes(data[pos : pos + nbytes])))
        pos += nbytes
    mac = bytes(data[pos : pos + 8])
    assert pos + 8 == len(data), f"frame of {len(data)} bytes ends at {pos + 8}"
    return Frame(tensors, kind, weight, mac)


def frame_mac_ok(data: bytes, salt: bytes) -> bool:
    return hmac.compare_digest(mac8(salt, data[:-8]), data[-8:])


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# -- MuxRecord ----------------------------------------------------------------


def encode_record(kind: int, payload: bytes, salt: bytes, rank: int = 0) -> bytes:
    head = struct.pack("<IIBII", MUX_MAGIC, 1, kind, rank, len(payload))
    return head + mac8(salt, head, payload) + payload


@dataclass
class Record:
    kind: int
    rank: int
    payload: bytes
    mac: bytes


def decode_records(data: bytes, salt: bytes) -> list[Record]:
    """Every MuxRecord of a byte stream, each MAC checked."""
    out = []
    pos = 0
    while pos < len(data):
        magic, version, kind, rank, length = struct.unpack_from("<IIBII", data, pos)
        assert (magic, version) == (MUX_MAGIC, 1), (hex(magic), version)
        tag = data[pos + 17 : pos + 25]
        payload = data[pos + 25 : pos + 25 + length]
        assert len(payload) == length, "record cut short"
        assert hmac.compare_digest(mac8(salt, data[pos : pos + 17], payload), tag), "record MAC"
        out.append(Record(kind, rank, bytes(payload), bytes(tag)))
        pos += 25 + length
    return out


# -- bincode RelayControlMsg --------------------------------------------------


def varint(value: int) -> bytes:
    if value <= 250:
        return bytes([value])
    if value <= 0xFFFF:
        return b"\xfb" + struct.pack("<H", value)
    if value <= 0xFFFFFFFF:
        return b"\xfc" + struct.pack("<I", value)
    return b"\xfd" + struct.pack("<Q", value)


def string(text: str) -> bytes:
    raw = text.encode()
    return varint(len(raw)) + raw


def varints(values: Sequence[int]) -> bytes:
    return varint(len(values)) + b"".join(varint(v) for v in values)


def address(host: str, port: int) -> bytes:
    return string(host) + varint(port)


class Reader:
    """bincode "standard" reader: the varints of the docs."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = bytes(data), 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        assert len(out) == n, "ran out of bytes"
        self.pos += n
        return out

    def varint(self) -> int:
        first = self.take(1)[0]
        if first <= 250:
            return first
        width = {251: ("<H", 2), 252: ("<I", 4), 253: ("<Q", 8)}[first]
        return struct.unpack(width[0], self.take(width[1]))[0]

    def string(self) -> str:
        return self.take(self.varint()).decode()

    def varints(self) -> list[int]:
        return [self.varint() for _ in range(self.varint())]

    def done(self) -> bool:
        return self.pos == len(self.data)


def encode_msg(name: str, **f: object) -> bytes:
    """One RelayControlMsg, from the docs' tables (PROTOCOL.md 3.3, wire.md)."""
    v = varint
    match name:
        case "Hello":
            sigs = f["model_sigs"]
            return v(0) + string(f["host"]) + varints(f["ranks"]) + v(len(sigs)) + b"".join(sigs)
        case "HelloAck":
            return v(1)
        case "RankExit" | "DeclareDead" | "RankJoin" | "RankFinished" | "RankAway":
            index = {"RankExit": 2, "DeclareDead": 3, "RankJoin": 200, "RankFinished": 201, "RankAway": 202}[name]
            return v(index) + v(f["rank"])
        case "Lanes":
            return v(203) + v(f["count"]) + v(f["min_bytes"])
        case "Resume":
            return v(204) + f["last_broadcast"] + v(f["awaiting"]) + v(f["resends"])
        case "Outage":
            return v(205) + v(f["millis"])
        case "Shards":
            addrs = f["addresses"]
            return v(206) + v(len(addrs)) + b"".join(address(h, p) for h, p in addrs)
        case "ShardSetup":
            return v(207) + v(f["index"]) + v(f["count"]) + v(f["heartbeat_ms"])
        case "Decide":
            schema = f["schema"]
            out = v(208) + v(f["decision"]) + v(f["round"]) + v(f["lanes"]) + v(len(schema))
            for dtype, shape in schema:
                out += v(dtype) + v(len(shape)) + b"".join(v(d) for d in shape)
            out += varints(f["hosts"]) + varints(f["targets"]) + v(f["copy"])
            step = f["step"]
            out += v(0) if step is None else v(1) if step == "whole" else v(2) + v(step[0]) + v(step[1])
            return out
        case "ShardAck":
            return v(209) + v(f["lane"])
        case "ShardLost":
            return v(210) + v(f["shard"])
        case "Decided" | "LanesIn" | "Mirrored":
            return v({"Decided": 211, "LanesIn": 212, "Mirrored": 221}[name]) + v(f["decision"])
        case "Pieces":
            return v(213) + v(f["round"])
        case "ShardAlive":
            return v(214)
        case "PieceRefused":
            return v(215) + v(f["host"]) + string(f["reason"])
        case "ShardOffer":
            return v(216) + address(f["host"], f["port"])
        case "ShardOuter":
            return v(217) + v(f["kind"]) + struct.pack("<dd", f["lr"], f["momentum"])
        case "ShardBack" | "ShardMoved":
            return v({"ShardBack": 218, "ShardMoved": 219}[name]) + v(f["shard"]) + address(f["host"], f["port"])
        case "Mirror":
            return v(220) + v(f["shard"]) + v(f["decision"]) + v(f["start"])
        case "Handoff":
            frag = f["fragment"]
            return v(222) + v(f["shard"]) + (v(0) if frag is None else v(1) + v(frag[0]) + v(frag[1]))
        case "HandedBack":
            return v(223) + v(f["shard"]) + v(f["lanes"])
        case "Seed":
            return v(224) + v(f["decision"]) + v(f["lanes"])
    raise ValueError(name)


EXTENSIONS_MARK = b"flodl_trio relay extensions v1".ljust(32, b"\0")


# -- lanes (wire.md "flodl_trio extension: lanes") ----------------------------


def lanes_for(payload_bytes: int, count: int, min_bytes: int) -> int:
    if min_bytes == 0:
        return count
    return max(1, min(count, payload_bytes // min_bytes))


def sharded_lanes_per_shard(lanes: int, shards: int, payload_bytes: int, min_bytes: int) -> int:
    terms = [max(math.ceil((lanes - 1) / shards), 4), 63 // shards]
    if min_bytes > 0:
        terms.append(payload_bytes // (shards * min_bytes))
    return max(1, min(terms))


def lane_tag(n: int, k: int, s: int) -> Tensor:
    return Tensor(F32, (0, 0, n, k, s))


def _tensor_bytes(t: Tensor) -> int:
    return numel(t.shape) * ITEMSIZE[t.dtype]


def _moved_down(byte: int, tensors: Sequence[Tensor]) -> int:
    """A lane's start: payload byte ``byte`` moved down to the start of the element it falls in."""
    base = 0
    for t in tensors:
        size = _tensor_bytes(t)
        if byte < base + size:
            return base + (byte - base) // ITEMSIZE[t.dtype] * ITEMSIZE[t.dtype]
        base += size
    return base


def _dtype_at(byte: int, tensors: Sequence[Tensor]) -> int:
    """The dtype of the tensor a lane starting at ``byte`` falls in (past the end: the last one's)."""
    base = 0
    for t in tensors:
        if base <= byte < base + _tensor_bytes(t):
            return t.dtype
        base += _tensor_bytes(t)
    return tensors[-1].dtype


def cut_lanes(frame: Frame, n: int, *, lane0_empty: bool = False) -> list[Frame]:
    """A HostFrame cut in ``n`` lanes as wire.md says (``lane0_empty``: the shards' layout)."""
    total = sum(_tensor_bytes(t) for t in frame.tensors)
    if not frame.tensors:
        return [Frame([lane_tag(1, 0, 0)], frame.kind, frame.weight)]
    first = 1 if lane0_empty and n > 1 else 0
    cut = n - first
    starts = [0] * first + [_moved_down(k * total // cut, frame.tensors) for k in range(cut)]
    stops = starts[1:] + [total]
    body: list[list[Tensor]] = [[] for _ in range(n)]
    base = 0
    for t in frame.tensors:
        size, item = _tensor_bytes(t), ITEMSIZE[t.dtype]
        if size == 0:  # a tensor of no elements: a piece of its own where it sits
            k = max([k for k in range(first, n) if starts[k] < base] or [0])
            body[k].append(Tensor(t.dtype, (0,)))
        for k in range(first, n):
            a, b = max(starts[k], base), min(stops[k], base + size)
            if b > a:
                data = t.data[a - base : b - base] if t.data else b""
                body[k].append(Tensor(t.dtype, ((b - a) // item,), data))
        base += size
    schema = [Tensor(t.dtype, (0, *t.shape)) for t in frame.tensors]
    lanes = []
    for k in range(n):
        tensors = body[k] or [Tensor(_dtype_at(starts[k], frame.tensors), (0,))]
        if k == 0:
            tensors = tensors + schema
        tensors = tensors + [lane_tag(n, k, len(schema) if k == 0 else 0)]
        lanes.append(Frame(tensors, frame.kind, frame.weight))
    return lanes


# -- fragment tag ---------------------------------------------------------------


def fragment_tag(count: int, index: int) -> bytes:
    """The 22 bytes wire.md gives for fragment ``index`` of ``count``."""
    return b"\x00\x03" + struct.pack("<III", 0, count, index) + bytes(8)


def fragment_range(n: int, count: int, index: int) -> tuple[int, int]:
    return n * index // count, n * (index + 1) // count


# -- delta codes ----------------------------------------------------------------

INT8, INT4, FP4 = 0, 1, 2
MAX_LEVEL = {INT8: 127.0, INT4: 7.0, FP4: 6.0}
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def delta_tag(code: int, block: int) -> int:
    return 0x80 | code << 4 | int(math.log2(block))


def code_of_tag(tag: int) -> tuple[int, int]:
    assert tag & 0x80
    return (tag >> 4) & 0x7, 1 << (tag & 0xF)


def code_payload_bytes(code: int, n: int, block: int) -> int:
    codes = n if code == INT8 else (n + 1) // 2
    return 4 * math.ceil(n / block) + codes


def _nibble_level(code: int, nibble: int) -> float:
    if code == INT4:
        return float(nibble - 8)
    sign = -1.0 if nibble & 8 else 1.0
    return sign * FP4_MAGNITUDES[nibble & 7]


def decode_code(payload: bytes, code: int, block: int, n: int) -> np.ndarray:
    """Decode a coded delta payload as wire.md's table says."""
    blocks = math.ceil(n / block)
    assert len(payload) == code_payload_bytes(code, n, block), (len(payload), code_payload_bytes(code, n, block))
    scales = np.frombuffer(payload[: 4 * blocks], dtype="<f4")
    raw = payload[4 * blocks :]
    if code == INT8:
        levels = np.frombuffer(raw, dtype=np.int8).astype(np.float32)
    else:
        levels = np.empty(n, dtype=np.float32)
        for i in range(n):
            byte = raw[i // 2]
            levels[i] = _nibble_level(code, byte & 0xF if i % 2 == 0 else byte >> 4)
    out = np.empty(n, dtype=np.float32)
    for b in range(blocks):
        out[b * block : (b + 1) * block] = levels[b * block : (b + 1) * block] * scales[b]
    return out


def _level_of(code: int, x: float) -> int:
    """The code (byte or nibble) of the level nearest ``x`` (in level units)."""
    if code == INT8:
        return int(np.clip(np.rint(x), -127, 127)) & 0xFF
    if code == INT4:
        return int(np.clip(np.rint(x), -7, 7)) + 8
    mags = np.array(FP4_MAGNITUDES)
    i = int(np.argmin(np.abs(mags - abs(x))))
    return i | (8 if x < 0 and i else 0)


def encode_code(values: np.ndarray, code: int, block: int) -> bytes:
    """A coded payload: scale = block max magnitude / the code's largest level, nearest levels."""
    n = len(values)
    values = values.astype(np.float32)
    scales = []
    keys = []
    for b in range(math.ceil(n / block)):
        chunk = values[b * block : (b + 1) * block]
        scale = np.float32(np.max(np.abs(chunk)) / np.float32(MAX_LEVEL[code]))
        scales.append(scale)
        keys.extend(_level_of(code, float(x / scale)) if scale else _level_of(code, 0.0) for x in chunk)
    out = np.array(scales, dtype="<f4").tobytes()
    if code == INT8:
        return out + bytes(keys)
    if len(keys) % 2:
        keys.append(8 if code == INT4 else 0)
    return out + bytes(keys[i] | keys[i + 1] << 4 for i in range(0, len(keys), 2))


def base_digest(tensors: Sequence[np.ndarray]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(np.ascontiguousarray(t, dtype="<f4").tobytes())
    return h.digest()


# -- the join exchange (wire.md "The join exchange") --------------------------


def state_request(rank: int, world: int, nr: bytes, salt: bytes) -> bytes:
    body = struct.pack("<IIII", 0xF10D17E8, 2, rank, world) + nr
    return body + mac8(salt, body)


def state_challenge(nc: bytes, nr: bytes, salt: bytes) -> bytes:
    body = struct.pack("<II", 0xF10D17EA, 2) + nc
    return body + mac8(salt, body, nr)


def state_answer(rank: int, nr: bytes, nc: bytes, salt: bytes) -> bytes:
    body = struct.pack("<II", 0xF10D17EB, 2)
    return body + mac8(salt, body, nc, nr, struct.pack("<I", rank))


def state_reply(status: int, window: int, reason: str, lengths: Sequence[int], nr: bytes, nc: bytes, salt: bytes) -> bytes:
    raw = reason.encode()
    body = struct.pack("<IIIIqI", 0xF10D17E9, 2, status, len(lengths), window, len(raw)) + raw
    body += b"".join(struct.pack("<I", n) for n in lengths)
    return body + mac8(salt, body, nr, nc)


def state_receipt(nr: bytes, nc: bytes, salt: bytes) -> bytes:
    body = struct.pack("<II", 0xF10D17EC, 2)
    return body + mac8(salt, body, nr, nc)


def state_entry(status: int, window: int, nr: bytes, nc: bytes, salt: bytes) -> bytes:
    body = struct.pack("<IIIq", 0xF10D17ED, 2, status, window)
    return body + mac8(salt, body, nr, nc)


# -- the local leg and the control channel ------------------------------------


def local_handshake(rank: int, world: int, salt: bytes) -> bytes:
    body = struct.pack("<IIII", 0xF10D17C0, 3, rank, world)
    return body + mac8(salt, body)


def local_ack(handshake16: bytes, salt: bytes) -> bytes:
    body = struct.pack("<II", 0xF10D17C1, 3)
    return body + mac8(salt, handshake16, body)


def control_frame(kind: int, payload: bytes, salt: bytes) -> bytes:
    tag = mac8(salt, struct.pack("<II", kind, len(payload)), payload)
    return struct.pack("<II", 0xF10D17C4, 4) + tag + struct.pack("<II", kind, len(payload)) + payload


def heartbeat(rank: int, seq: int) -> bytes:
    return b"HB01" + struct.pack("<IQ", rank, seq)


def beacon(seq: int, world: int, dead: int, timeout_ms: int, outage_ms: int | None = None) -> bytes:
    if outage_ms is None:
        return b"BC01" + struct.pack("<QIII", seq, world, dead, timeout_ms)
    return b"BC02" + struct.pack("<QIIII", seq, world, dead, timeout_ms, outage_ms)


# -- delta rounds in lanes (wire.md "In lanes", "Delta rounds through the shards") --


def payload_size(t: Tensor) -> int:
    """What a tensor counts in a lane cut's B: its whole payload as its dtype says."""
    if t.dtype == DIGEST:
        return 16
    if t.dtype & 0x80:
        code, block = code_of_tag(t.dtype)
        return code_payload_bytes(code, numel(t.shape), block)
    return numel(t.shape) * ITEMSIZE[t.dtype]


def _cut_element(t: Tensor, offset: int) -> int:
    """The element a lane start at byte ``offset`` of ``t``'s payload moves down to."""
    n = numel(t.shape)
    if t.dtype & 0x80:
        block = code_of_tag(t.dtype)[1]
        return offset * n // payload_size(t) // block * block
    return offset // ITEMSIZE[t.dtype]


def _coded_piece(t: Tensor, a: int, b: int) -> bytes:
    """Elements a..b of a coded tensor: its blocks' scales, then those elements' codes."""
    if not t.data:
        return b""
    code, block = code_of_tag(t.dtype)
    blocks = math.ceil(numel(t.shape) / block)
    scales = t.data[4 * (a // block) : 4 * math.ceil(b / block)]
    codes = t.data[4 * blocks :]
    if code == INT8:
        return scales + codes[a:b]
    return scales + codes[a // 2 : math.ceil(b / 2)]


def _piece(t: Tensor, a: int, b: int) -> Tensor:
    if t.dtype & 0x80:
        return Tensor(t.dtype, (b - a,), _coded_piece(t, a, b))
    size = ITEMSIZE.get(t.dtype, 1)
    return Tensor(t.dtype, (b - a,), t.data[a * size : b * size] if t.data else b"")


def cut_delta_lanes(frame: Frame, n: int, *, through_shards: bool = False) -> list[Frame]:
    """A delta round's HostFrame (its last tensor the digest) cut in ``n`` lanes as wire.md says."""
    tensors = frame.tensors
    digest = tensors[-1]
    assert digest.dtype == DIGEST
    cut_tensors = tensors[:-1] if through_shards else tensors
    total = sum(payload_size(t) for t in cut_tensors)
    first = 1 if through_shards else 0
    cut = n - first

    def position(byte: int) -> tuple[int, int]:
        base = 0
        for i, t in enumerate(cut_tensors):
            if byte < base + payload_size(t):
                if t.dtype == DIGEST:  # never cut: a start inside it moves to its start
                    return i, 0
                return i, _cut_element(t, byte - base)
            base += payload_size(t)
        return len(cut_tensors), 0

    starts = [(0, 0)] * first + [position(k * total // cut) for k in range(cut)]
    starts[first] = (0, 0)
    stops = starts[1:] + [(len(cut_tensors), 0)]
    lanes = []
    schema = [Tensor(t.dtype, (0, *t.shape)) for t in tensors]
    for k in range(n):
        pieces = []
        if k >= first:
            for i, t in enumerate(cut_tensors):
                m = numel(t.shape)
                a = starts[k][1] if i == starts[k][0] else (0 if i > starts[k][0] else m)
                b = stops[k][1] if i == stops[k][0] else (m if i < stops[k][0] else 0)
                if b > a:
                    pieces.append(_piece(t, a, b))
        elif through_shards:
            pieces = [digest]
        if not pieces:
            t = cut_tensors[min(starts[k][0], len(cut_tensors) - 1)]
            pieces = [Tensor(t.dtype, (0,))]
        trailer = schema if k == 0 else []
        lanes.append(Frame(pieces + trailer + [lane_tag(n, k, len(trailer))], frame.kind, frame.weight))
    return lanes


# -- RelayControlMsg, read ------------------------------------------------------

_RANK_ONLY = {2: "RankExit", 3: "DeclareDead", 200: "RankJoin", 201: "RankFinished", 202: "RankAway"}


def decode_msg(payload: bytes) -> tuple[str, dict]:
    """A RelayControlMsg as the docs' tables lay it out; AssertionError on trailing bytes."""
    r = Reader(payload)
    index = r.varint()
    f: dict = {}
    if index == 0:
        name = "Hello"
        f["host"] = r.string()
        f["ranks"] = r.varints()
        f["model_sigs"] = [r.take(32) for _ in range(r.varint())]
    elif index == 1:
        name = "HelloAck"
    elif index in _RANK_ONLY:
        name = _RANK_ONLY[index]
        f["rank"] = r.varint()
    elif index == 203:
        name, f["count"], f["min_bytes"] = "Lanes", r.varint(), r.varint()
    elif index == 204:
        name, f["last_broadcast"], f["awaiting"], f["resends"] = "Resume", r.take(8), r.varint(), r.varint()
    elif index == 205:
        name, f["millis"] = "Outage", r.varint()
    elif index == 206:
        name = "Shards"
        f["addresses"] = [(r.string(), r.varint()) for _ in range(r.varint())]
    elif index == 207:
        name, f["index"], f["count"], f["heartbeat_ms"] = "ShardSetup", r.varint(), r.varint(), r.varint()
    elif index == 208:
        name = "Decide"
        f["decision"], f["round"], f["lanes"] = r.varint(), r.varint(), r.varint()
        schema = []
        for _ in range(r.varint()):
            dtype, ndim = r.varint(), r.varint()
            schema.append((dtype, tuple(r.varint() for _ in range(ndim))))
        f["schema"] = schema
        f["hosts"], f["targets"], f["copy"] = r.varints(), r.varints(), r.varint()
        assert f["copy"] in (0, 1, 2)
        step = r.varint()
        assert step in (0, 1, 2)
        f["step"] = None if step == 0 else "whole" if step == 1 else (r.varint(), r.varint())
    elif index in (209, 210, 211, 212, 213, 221):
        name = {209: "ShardAck", 210: "ShardLost", 211: "Decided", 212: "LanesIn", 213: "Pieces", 221: "Mirrored"}[index]
        key = {209: "lane", 210: "shard", 213: "round"}.get(index, "decision")
        f[key] = r.varint()
    elif index == 214:
        name = "ShardAlive"
    elif index == 215:
        name, f["host"], f["reason"] = "PieceRefused", r.varint(), r.string()
    elif index == 216:
        name, f["host"], f["port"] = "ShardOffer", r.string(), r.varint()
    elif index == 217:
        name, f["kind"] = "ShardOuter", r.varint()
        f["lr"], f["momentum"] = struct.unpack("<dd", r.take(16))
    elif index in (218, 219):
        name = "ShardBack" if index == 218 else "ShardMoved"
        f["shard"], f["host"], f["port"] = r.varint(), r.string(), r.varint()
    elif index == 220:
        name, f["shard"], f["decision"], f["start"] = "Mirror", r.varint(), r.varint(), r.varint()
        assert f["start"] in (0, 1, 2)
    elif index == 222:
        name, f["shard"] = "Handoff", r.varint()
        which = r.varint()
        assert which in (0, 1)
        f["fragment"] = None if which == 0 else (r.varint(), r.varint())
    elif index == 223:
        name, f["shard"], f["lanes"] = "HandedBack", r.varint(), r.varint()
    elif index == 224:
        name, f["decision"], f["lanes"] = "Seed", r.varint(), r.varint()
    else:
        raise AssertionError(f"variant {index} is in no doc table")
    assert r.done(), f"{name}: {len(payload) - r.pos} bytes after its last field"
    assert encode_msg(name, **f) == bytes(payload), f"{name} re-encodes to other bytes"
    return name, f


def split_stream(data: bytes) -> tuple[int | None, bytes]:
    """A relay/controller/shard connection's bytes: (its 4-byte channel magic or None, the records)."""
    if len(data) >= 4 and data[:4] != struct.pack("<I", MUX_MAGIC):
        return struct.unpack_from("<I", data)[0], data[4:]
    return None, data
