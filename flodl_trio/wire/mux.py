"""MuxRecord and RelayControlMsg: everything on a relay <-> controller connection.

A MuxRecord is a 25-byte header then a payload::

    u32 magic | u32 version | u8 kind | u32 rank | u32 len | MAC8(header[0:17] + payload)

The MAC sits before the payload, so a sender hashes the payload before the
header goes out; :func:`encode_mux_record` does that without joining buffers.
RelayControlMsg is bincode-2 "standard" (varint) encoded.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable, Sequence

import attrs

from ..errors import ConfigError, FramingError
from .constants import (
    DEFAULT_FRAME_CEILING,
    MAC_LEN,
    MODEL_SIGNATURE_LEN,
    MUX_HEADER_LEN,
    MUX_MAGIC,
    MUX_VERSION,
)
from .round_frame import EncodedFrame
from .salt import Buffer, SessionSalt, verify_mac

_MUX_SIGNED_HEADER = struct.Struct("<IIBII")  # magic, version, kind, rank, len
MUX_SIGNED_HEADER_LEN = _MUX_SIGNED_HEADER.size  # 17


class MuxKind(enum.IntEnum):
    DATA = 0x01
    CONTROL = 0x02
    HOST_FRAME = 0x03
    BROADCAST = 0x04


# ---------------------------------------------------------------------------
# RelayControlMsg (bincode 2, varint)
# ---------------------------------------------------------------------------


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _sigs(values: Iterable[bytes]) -> tuple[bytes, ...]:
    return tuple(bytes(v) for v in values)


@attrs.frozen
class Hello:
    """First record of a relay: which host, which global ranks (sorted)."""

    host: str
    ranks: tuple[int, ...] = attrs.field(converter=_ints)
    model_sigs: tuple[bytes, ...] = attrs.field(converter=_sigs, default=())

    @property
    def takes_extensions(self) -> bool:
        """Whether a data relay's Hello says it takes flodl_trio's control messages
        (:data:`EXTENSIONS_MARK`: docs/wire.md, "Which relays take extensions")."""
        return self.model_sigs == (EXTENSIONS_MARK,)


# The one "model signature" a flodl_trio data relay's Hello carries. flodl's data
# channel has none, and flodl's controller ignores what a data Hello carries there,
# so it costs nothing with flodl; to a flodl_trio controller it says: this relay
# takes the control messages flodl's relays do not know (a flodl relay closes on an
# unknown variant), so they may be sent to it.
EXTENSIONS_MARK = b"flodl_trio relay extensions v1".ljust(32, b"\0")


@attrs.frozen
class HelloAck:
    """Controller accepted the relay's Hello."""


@attrs.frozen
class RankExit:
    """A local rank's loopback socket closed or failed."""

    rank: int


@attrs.frozen
class DeclareDead:
    """The controller declared the rank dead: drop it from the fold barrier."""

    rank: int


@attrs.frozen
class RankJoin:
    """flodl_trio extension (variant 200; flodl peers never see it unless a rank rejoins).

    Relay -> controller: a rank that had left reconnected and asks back in.
    Controller -> relay: admitted; it enters the host's fold at the next
    window start (a refusal is a ``DeclareDead``). See docs/wire.md.
    """

    rank: int


@attrs.frozen
class RankFinished:
    """flodl_trio extension (variant 201), relay -> controller: a rank that called
    ``join`` left after saying it finished its training. Unlike ``RankExit`` (a
    crash, as far as anyone knows), it will not come back. See docs/wire.md."""

    rank: int


@attrs.frozen
class RankAway:
    """flodl_trio extension (variant 202), controller -> relay, just after HelloAck: this
    rank of yours is dead for now but may come back (it crashed, or the cluster formed
    without it); treat it as gone, and keep serving for it. See docs/wire.md."""

    rank: int


@attrs.frozen
class Lanes:
    """flodl_trio extension (variant 203), controller -> relay, right after HelloAck: the
    controller reduces each round in up to ``count`` lanes, one per ``min_bytes`` of
    the frame's payload (0: always ``count``), so the relay ships its HostFrame as
    that many tagged lane frames and takes the consensus back the same way. Sent
    only when ``count`` > 1. See docs/wire.md."""

    count: int
    min_bytes: int = 0


@attrs.frozen
class Resume:
    """flodl_trio extension (variant 204), relay -> controller, the first record after
    HelloAck on a connection that replaces one the relay lost (the controller died,
    or the link broke): the MAC of the last Broadcast record the relay took whole
    (8 zero bytes: none yet); whether it waits for a consensus (its HostFrame went
    up, no Broadcast came back whole); and whether that HostFrame follows again
    (it does unless the Broadcast had begun to arrive). See docs/wire.md, "Resuming"."""

    last_broadcast: bytes = attrs.field(converter=bytes)
    awaiting: bool = False
    resends: bool = False

    def __attrs_post_init__(self) -> None:
        if len(self.last_broadcast) != MAC_LEN:
            raise ConfigError(f"Resume.last_broadcast must be {MAC_LEN} bytes, got {len(self.last_broadcast)}")
        if self.resends and not self.awaiting:
            raise ConfigError("Resume: a relay that resends its HostFrame awaits its consensus")


@attrs.frozen
class Outage:
    """flodl_trio extension (variant 205), controller -> relay, right after HelloAck (and
    ``Lanes``): this controller keeps a resume record; should its connection break, hold
    your ranks and dial it again for up to ``millis`` ms (unless told otherwise locally).
    Sent only by a controller that keeps a record. See docs/wire.md, "Resuming"."""

    millis: int


def _addresses(addresses: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple((str(host), int(port)) for host, port in addresses)


def _ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(rank) for rank in ranks)


def _schema(schema: Iterable[tuple[int, Iterable[int]]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    return tuple((int(dtype), tuple(int(d) for d in shape)) for dtype, shape in schema)


@attrs.frozen
class Shards:
    """flodl_trio extension (variant 206), controller -> relay, before HelloAck (after
    ``Lanes``), or mid-session once the controller fixed the shards its relays offered
    (then for the relay's rounds after the one in progress): the reduction shards'
    addresses. Lane k >= 1 of a round in several lanes goes to its owner, shard
    (k - 1) mod len(addresses) while it is live, lane 0 to the controller (see
    docs/wire.md, "Shards")."""

    addresses: tuple[tuple[str, int], ...] = attrs.field(converter=_addresses)


@attrs.frozen
class ShardOffer:
    """flodl_trio extension (variant 216), data relay -> controller, right after HelloAck:
    this relay serves a reduction shard at ``host:port``, which the controller may name
    among the cluster's shards once the cluster has formed (docs/wire.md, "Shards by
    default")."""

    host: str
    port: int


@attrs.frozen
class ShardBack:
    """flodl_trio extension (variant 218), controller -> relays and shards: shard ``shard``,
    lost, is served again at ``host:port`` (a relay's offer, set up by the controller as
    that shard) from each relay's round after the one in progress (docs/wire.md, "A lost
    shard served again")."""

    shard: int
    host: str
    port: int


@attrs.frozen
class ShardSetup:
    """flodl_trio extension (variant 207), controller -> shard, the first record on the
    controller's connection to a shard: it is shard ``index`` of ``count``, and says it is
    alive (``ShardAlive``) at least every ``heartbeat_ms`` / 4 (the controller's bound)."""

    index: int
    count: int
    heartbeat_ms: int


# Decide.copy: what a shard sends its controller besides its relays' lanes.
COPY_NONE = 0  # nothing
COPY_LANES = 1  # each lane it sums (the controller keeps the round whole)
COPY_WITH_STATE = 2  # ... and after each stepped lane, that lane's outer state (a checkpoint)


@attrs.frozen
class Decide:
    """flodl_trio extension (variant 208), controller -> shard: decision number
    ``decision`` (counted over the run; a round decided again gets the next) for round
    ``round`` (the controller's count of sharded rounds; the same when decided again),
    whose lane 0 finished, of ``lanes`` lanes cut from a frame of ``schema`` ((dtype,
    shape) per tensor, which lane 0 carried: every piece is checked against it): sum
    the pieces of ``hosts`` (each named by its lowest rank, in host order) and send
    each lane to ``targets`` (the same naming); ``copy``: 1 (``COPY_LANES``), send them to
    the controller too (it needs the whole consensus of this round: a rank is rejoining,
    or a checkpoint is due); 2 (``COPY_WITH_STATE``), and after each stepped lane its outer
    state (a checkpoint of a params round); ``step``:
    the round is a window's params round, whose lanes the shard steps with the outer
    optimizer ``ShardOuter`` named, in the state of params fragment ``fragment``
    ((index, count); None: the whole model's)."""

    decision: int
    round: int
    lanes: int
    schema: tuple[tuple[int, tuple[int, ...]], ...] = attrs.field(converter=_schema)
    hosts: tuple[int, ...] = attrs.field(converter=_ranks)
    targets: tuple[int, ...] = attrs.field(converter=_ranks)
    copy: int = attrs.field(default=0, converter=int)
    step: bool = False
    fragment: tuple[int, int] | None = None

    def __attrs_post_init__(self) -> None:
        if self.copy not in (COPY_NONE, COPY_LANES, COPY_WITH_STATE):
            raise FramingError(f"Decide copy must be 0, 1 or 2, got {self.copy}")


@attrs.frozen
class ShardOuter:
    """flodl_trio extension (variant 217), controller -> shard, right after ``ShardSetup``
    when the controller has an outer optimizer a shard can run: ``kind`` 1 is SlowMo, 2
    DiLoCo's Nesterov step, with ``lr`` and ``momentum`` (f64). The shard steps the lanes
    it reduces of each round a ``Decide`` says to step (docs/wire.md, "The outer step on
    the shards")."""

    kind: int
    lr: float
    momentum: float


@attrs.frozen
class ShardAck:
    """flodl_trio extension (variant 209), shard -> relay: lane ``lane`` of the relay's
    HostFrame is in, verified and kept."""

    lane: int


@attrs.frozen
class ShardLost:
    """flodl_trio extension (variant 210), controller -> relays and shards, and relay ->
    the shard it resends pieces to: shard ``shard`` is lost; its lanes belong to the
    next live shard after it (docs/wire.md, "A lost shard")."""

    shard: int


@attrs.frozen
class Decided:
    """flodl_trio extension (variant 211), shard -> relay: the consensus lanes that
    follow on this connection are decision ``decision``'s."""

    decision: int


@attrs.frozen
class LanesIn:
    """flodl_trio extension (variant 212), relay -> controller: every shard's lane of
    decision ``decision`` is in; the controller's lane 0 commits the round."""

    decision: int


@attrs.frozen
class Pieces:
    """flodl_trio extension (variant 213), relay -> shard: the lane frames that follow
    on this connection are of the relay's round ``round`` (counted per relay; the same
    number again: pieces resent to a new owner)."""

    round: int


@attrs.frozen
class PieceRefused:
    """flodl_trio extension (variant 215), shard -> controller: the relay whose lowest
    rank is ``host`` sent this shard a piece that is not what the round's schema says
    (``reason``): the controller drops that relay, and decides the round without it."""

    host: int
    reason: str


@attrs.frozen
class ShardAlive:
    """flodl_trio extension (variant 214), shard -> controller: a heartbeat, so a frozen
    shard is told from a slow one."""


@attrs.frozen
class ShardMoved:
    """flodl_trio extension (variant 219), controller -> relays: shard ``shard``, the last
    live one, is now served at ``host:port`` by the controller itself (the shard it was
    is lost), at once: each relay sends it its lanes of the round in progress, which is
    decided again (docs/wire.md, "When every shard is lost")."""

    shard: int
    host: str
    port: int


@attrs.frozen
class Mirror:
    """flodl_trio extension (variant 220), shard -> its backup (the next live shard), on the
    mirror connection: the lane record that follows is shard ``shard``'s divided lane of
    decision ``decision``, before its outer step. ``start`` says where the backup's step
    of it starts: 0 its own mirror of the lane, 1 the lane's outer state as the round
    started, in a record right before the lane, 2 nothing (the lane's first params
    window) (docs/wire.md, "The outer state through a lost shard")."""

    shard: int
    decision: int
    start: int


@attrs.frozen
class Mirrored:
    """flodl_trio extension (variant 221), shard -> controller: this shard stepped a mirror
    of every lane of decision ``decision`` that its predecessors step; the controller
    commits a stepped round only once every live shard said so."""

    decision: int


@attrs.frozen
class Handoff:
    """flodl_trio extension (variant 222), shard -> a shard served again, on a mirror
    connection: the record that follows is the outer state of one of its lanes (of params
    fragment ``fragment``, or the whole model's: None), as the newest step left it."""

    shard: int
    fragment: tuple[int, int] | None = None


@attrs.frozen
class HandedBack:
    """flodl_trio extension (variant 223), shard -> a shard served again: every lane state
    it had for it went (``lanes`` of them); the served-again shard steps its lanes now."""

    shard: int
    lanes: int


@attrs.frozen
class Seed:
    """flodl_trio extension (variant 224), controller -> shard, right before ``Decide``
    ``decision`` on the same connection: the ``lanes`` Broadcast records that follow
    are the outer state (as ``Decide.copy`` 2 lays it out) that the shard's lanes of that
    decision start from - the controller's own optimizer's, which held it before the
    shards stepped that params set (docs/wire.md, "Seeding the shards' outer state")."""

    decision: int
    lanes: int


NO_BROADCAST = bytes(MAC_LEN)  # Resume.last_broadcast of a relay that has had no consensus yet

RelayControlMsg = (
    Hello | HelloAck | RankExit | DeclareDead | RankJoin | RankFinished | RankAway | Lanes | Resume | Outage
    | Shards | ShardSetup | Decide | ShardAck | ShardLost | Decided | LanesIn | Pieces | ShardAlive | PieceRefused
    | ShardOffer | ShardOuter | ShardBack | ShardMoved | Mirror | Mirrored | Handoff | HandedBack | Seed
)
# flodl's variants are 0..3; flodl_trio's extensions count from 200, clear of any flodl adds.
_VARIANT = {
    Hello: 0, HelloAck: 1, RankExit: 2, DeclareDead: 3, RankJoin: 200, RankFinished: 201, RankAway: 202, Lanes: 203,
    Resume: 204, Outage: 205, Shards: 206, ShardSetup: 207, Decide: 208, ShardAck: 209,
    ShardLost: 210, Decided: 211, LanesIn: 212, Pieces: 213, ShardAlive: 214, PieceRefused: 215, ShardOffer: 216,
    ShardOuter: 217, ShardBack: 218, ShardMoved: 219, Mirror: 220, Mirrored: 221,
    Handoff: 222, HandedBack: 223, Seed: 224,
}


def _check_u32(value: int, what: str) -> None:
    if not 0 <= value <= 0xFFFFFFFF:
        raise ConfigError(f"{what} {value} does not fit in a u32")


def _address(host: str, port: int) -> bytes:
    raw = host.encode("utf-8")
    _check_u32(port, "a shard's port")
    return _varint(len(raw)) + raw + _varint(port)


def _read_address(reader: _BincodeReader, what: str) -> tuple[str, int]:
    raw = reader._take(reader.count(f"{what} host length", 1), f"{what} host")
    try:
        return raw.decode("utf-8"), reader.varint(f"{what} port", limit=0xFFFF)
    except UnicodeDecodeError:
        raise FramingError(f"RelayControlMsg: {what}'s host is not UTF-8: {raw!r}") from None


def _varint(value: int) -> bytes:
    _check_u32(value, "varint field")
    if value <= 250:
        return bytes((value,))
    if value <= 0xFFFF:
        return b"\xfb" + struct.pack("<H", value)
    return b"\xfc" + struct.pack("<I", value)


def encode_control_msg(msg: RelayControlMsg) -> bytes:
    out = bytearray(_varint(_VARIANT[type(msg)]))
    match msg:
        case Hello(host=host, ranks=ranks, model_sigs=sigs):
            raw = host.encode("utf-8")
            out += _varint(len(raw)) + raw
            out += _varint(len(ranks))
            for r in ranks:
                out += _varint(r)
            out += _varint(len(sigs))
            for sig in sigs:
                if len(sig) != MODEL_SIGNATURE_LEN:
                    raise ConfigError(f"model signature must be {MODEL_SIGNATURE_LEN} bytes, got {len(sig)}")
                out += sig
        case RankExit(rank=r) | DeclareDead(rank=r) | RankJoin(rank=r) | RankFinished(rank=r) | RankAway(rank=r):
            out += _varint(r)
        case Lanes(count=count, min_bytes=min_bytes):
            out += _varint(count) + _varint(min_bytes)
        case Outage(millis=millis):
            out += _varint(millis)
        case Shards(addresses=addresses):
            out += _varint(len(addresses))
            for host, port in addresses:
                out += _address(host, port)
        case ShardOffer(host=host, port=port):
            out += _address(host, port)
        case ShardBack(shard=shard, host=host, port=port) | ShardMoved(shard=shard, host=host, port=port):
            out += _varint(shard) + _address(host, port)
        case ShardSetup(index=index, count=count, heartbeat_ms=heartbeat_ms):
            out += _varint(index) + _varint(count) + _varint(heartbeat_ms)
        case Decide(decision=decision, round=round_, lanes=lanes, schema=schema, hosts=hosts, targets=targets,
                    copy=copy, step=step, fragment=fragment):
            out += _varint(decision) + _varint(round_) + _varint(lanes) + _varint(len(schema))
            for dtype, shape in schema:
                out += _varint(dtype) + _varint(len(shape)) + b"".join(_varint(d) for d in shape)
            for ranks in (hosts, targets):
                out += _varint(len(ranks))
                for r in ranks:
                    out += _varint(r)
            out += _varint(int(copy))
            if not step:
                out += _varint(0)
            elif fragment is None:
                out += _varint(1)
            else:
                out += _varint(2) + _varint(fragment[0]) + _varint(fragment[1])
        case ShardOuter(kind=kind, lr=lr, momentum=momentum):
            out += _varint(kind) + struct.pack("<dd", lr, momentum)
        case ShardAck(lane=lane):
            out += _varint(lane)
        case Handoff(shard=shard, fragment=fragment):
            out += _varint(shard) + (_varint(0) if fragment is None else _varint(1) + _varint(fragment[0])
                                     + _varint(fragment[1]))
        case HandedBack(shard=shard, lanes=lanes):
            out += _varint(shard) + _varint(lanes)
        case Seed(decision=decision, lanes=lanes):
            out += _varint(decision) + _varint(lanes)
        case Mirror(shard=shard, decision=decision, start=start):
            out += _varint(shard) + _varint(decision) + _varint(start)
        case (ShardLost(shard=number) | Decided(decision=number) | LanesIn(decision=number) | Pieces(round=number)
              | Mirrored(decision=number)):
            out += _varint(number)
        case Resume(last_broadcast=last, awaiting=awaiting, resends=resends):
            out += last + _varint(int(awaiting)) + _varint(int(resends))
        case PieceRefused(host=host, reason=reason):
            raw = reason.encode("utf-8")
            out += _varint(host) + _varint(len(raw)) + raw
        case HelloAck() | ShardAlive():
            pass
    return bytes(out)


class _BincodeReader:
    __slots__ = ("data", "pos")

    def __init__(self, data: Buffer) -> None:
        self.data = bytes(data)
        self.pos = 0

    def _take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise FramingError(
                f"RelayControlMsg ended inside {what}: needs {n} bytes at offset {self.pos}, "
                f"message is {len(self.data)} bytes"
            )
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def varint(self, what: str, limit: int = 0xFFFFFFFF) -> int:
        lead = self._take(1, what)[0]
        if lead <= 250:
            value = lead
        elif lead == 251:
            (value,) = struct.unpack("<H", self._take(2, what))
        elif lead == 252:
            (value,) = struct.unpack("<I", self._take(4, what))
        elif lead == 253:
            (value,) = struct.unpack("<Q", self._take(8, what))
        else:
            raise FramingError(f"RelayControlMsg: invalid varint tag {lead} in {what}")
        if value > limit:
            raise FramingError(f"RelayControlMsg: {what} = {value} exceeds {limit}")
        return value

    def count(self, what: str, min_item_len: int) -> int:
        """A list/string length, refused if the remaining bytes cannot hold it."""
        n = self.varint(what)
        remaining = len(self.data) - self.pos
        if n * min_item_len > remaining:
            raise FramingError(
                f"RelayControlMsg: {what} claims {n} items but only {remaining} bytes remain"
            )
        return n


# The variants whose one field is a varint: (class, the field as errors name it).
_ONE_VARINT: dict[int, tuple[Callable[[int], RelayControlMsg], str]] = {
    variant: (cls, f"{cls.__name__} {field}")
    for variant, cls, field in (
        (2, RankExit, "rank"), (3, DeclareDead, "rank"), (200, RankJoin, "rank"), (201, RankFinished, "rank"),
        (202, RankAway, "rank"), (205, Outage, "millis"), (209, ShardAck, "lane"), (210, ShardLost, "shard"),
        (211, Decided, "decision"), (212, LanesIn, "decision"), (213, Pieces, "round"),
        (221, Mirrored, "decision"),
    )
}


def decode_control_msg(payload: Buffer) -> RelayControlMsg:
    reader = _BincodeReader(payload)
    variant = reader.varint("variant index")
    msg: RelayControlMsg
    if variant == 0:
        raw = reader._take(reader.count("host length", 1), "host name")
        try:
            host = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FramingError(f"RelayControlMsg Hello: host name is not UTF-8: {raw!r}") from None
        ranks = [reader.varint(f"rank {i}") for i in range(reader.count("rank count", 1))]
        n_sigs = reader.count("model signature count", MODEL_SIGNATURE_LEN)
        sigs = [reader._take(MODEL_SIGNATURE_LEN, f"model signature {i}") for i in range(n_sigs)]
        msg = Hello(host, ranks, sigs)
    elif variant in _ONE_VARINT:
        make, field = _ONE_VARINT[variant]
        msg = make(reader.varint(field))
    elif variant == 1:
        msg = HelloAck()
    elif variant == 203:
        msg = Lanes(reader.varint("Lanes count"), reader.varint("Lanes min_bytes"))
    elif variant == 206:
        msg = Shards([_read_address(reader, f"shard {i}") for i in range(reader.count("shard count", 2))])
    elif variant == 216:
        msg = ShardOffer(*_read_address(reader, "ShardOffer"))
    elif variant == 218:
        msg = ShardBack(reader.varint("ShardBack shard"), *_read_address(reader, "ShardBack"))
    elif variant == 219:
        msg = ShardMoved(reader.varint("ShardMoved shard"), *_read_address(reader, "ShardMoved"))
    elif variant == 222:
        shard = reader.varint("Handoff shard")
        handed: tuple[int, int] | None = None
        if reader.varint("Handoff fragment", limit=1):
            handed = (reader.varint("Handoff fragment index"), reader.varint("Handoff fragment count"))
            if not handed[0] < handed[1]:
                raise FramingError(f"RelayControlMsg Handoff: fragment {handed[0]} of {handed[1]}")
        msg = Handoff(shard, handed)
    elif variant == 223:
        msg = HandedBack(reader.varint("HandedBack shard"), reader.varint("HandedBack lanes"))
    elif variant == 224:
        msg = Seed(reader.varint("Seed decision"), reader.varint("Seed lanes"))
    elif variant == 220:
        msg = Mirror(reader.varint("Mirror shard"), reader.varint("Mirror decision"),
                     reader.varint("Mirror start", limit=2))
    elif variant == 207:
        msg = ShardSetup(reader.varint("ShardSetup index"), reader.varint("ShardSetup count"),
                         reader.varint("ShardSetup heartbeat_ms"))
    elif variant == 208:
        decision, round_ = reader.varint("Decide decision"), reader.varint("Decide round")
        lanes = reader.varint("Decide lanes")
        schema = []
        for i in range(reader.count("Decide schema count", 2)):
            dtype = reader.varint(f"Decide schema {i} dtype", limit=0xFF)
            schema.append((dtype, [reader.varint(f"Decide schema {i} dim") for _ in range(
                reader.count(f"Decide schema {i} ndim", 1))]))
        hosts = [reader.varint(f"Decide host {i}") for i in range(reader.count("Decide host count", 1))]
        targets = [reader.varint(f"Decide target {i}") for i in range(reader.count("Decide target count", 1))]
        copy = reader.varint("Decide copy", limit=COPY_WITH_STATE)
        step = reader.varint("Decide step", limit=2)
        fragment = None
        if step == 2:
            fragment = (reader.varint("Decide fragment index"), reader.varint("Decide fragment count"))
            if not fragment[0] < fragment[1]:
                raise FramingError(f"RelayControlMsg Decide: fragment {fragment[0]} of {fragment[1]}")
        msg = Decide(decision, round_, lanes, schema, hosts, targets, copy, step > 0, fragment)
    elif variant == 217:
        kind = reader.varint("ShardOuter kind", limit=2)
        if kind == 0:
            raise FramingError("RelayControlMsg ShardOuter: kind 0 names no optimizer (1: SlowMo, 2: DiLoCoNesterov)")
        lr, momentum = struct.unpack("<dd", reader._take(16, "ShardOuter lr and momentum"))
        msg = ShardOuter(kind, lr, momentum)
    elif variant == 214:
        msg = ShardAlive()
    elif variant == 215:
        refused = reader.varint("PieceRefused host")
        why = reader._take(reader.count("PieceRefused reason length", 1), "PieceRefused reason")
        msg = PieceRefused(refused, why.decode("utf-8", errors="replace"))
    elif variant == 204:
        last = reader._take(MAC_LEN, "Resume last_broadcast")
        awaiting = bool(reader.varint("Resume awaiting", limit=1))
        resends = bool(reader.varint("Resume resends", limit=1))
        if resends and not awaiting:
            raise FramingError("RelayControlMsg Resume: resends a HostFrame it does not await the consensus of")
        msg = Resume(last, awaiting, resends)
    else:
        raise FramingError(f"RelayControlMsg: unknown variant index {variant}")
    if reader.pos != len(reader.data):
        raise FramingError(
            f"RelayControlMsg {type(msg).__name__}: {len(reader.data) - reader.pos} trailing bytes"
        )
    return msg


# ---------------------------------------------------------------------------
# MuxRecord
# ---------------------------------------------------------------------------


@attrs.frozen
class MuxHeader:
    """A verified-shape (not yet MAC-checked) MuxRecord header."""

    kind: int
    rank: int
    length: int
    signed: bytes  # header bytes 0..17, the MAC's prefix
    tag: bytes


def mux_signed_header(kind: MuxKind, length: int, *, rank: int = 0) -> bytes:
    """Header bytes 0..17: the prefix of the record's MAC."""
    _check_u32(rank, "MuxRecord rank")
    return _MUX_SIGNED_HEADER.pack(MUX_MAGIC, MUX_VERSION, int(kind), rank, length)


def encode_mux_record(
    kind: MuxKind,
    payload: Buffer | EncodedFrame,
    salt: SessionSalt,
    *,
    rank: int = 0,
) -> EncodedFrame:
    """Sign and frame ``payload``; large payload buffers are not copied."""
    chunks: Sequence[Buffer]
    if isinstance(payload, EncodedFrame):
        chunks, length = payload.chunks, payload.nbytes
    else:
        chunks, length = [payload], memoryview(payload).nbytes
    signed = mux_signed_header(kind, length, rank=rank)
    mac = salt.hmac()
    mac.update(signed)
    for chunk in chunks:
        mac.update(chunk)
    header = signed + mac.digest()[:MAC_LEN]
    if length < 4096:
        return EncodedFrame([header + b"".join(chunks)], MUX_HEADER_LEN + length)
    return EncodedFrame([header, *chunks], MUX_HEADER_LEN + length)


def record_payload(record: EncodedFrame) -> EncodedFrame:
    """The payload of an encoded MuxRecord (its bytes after the 25-byte header), zero-copy."""
    views: list[Buffer] = []
    skip = MUX_HEADER_LEN
    for chunk in record.chunks:
        view = memoryview(chunk).cast("B")
        if skip >= len(view):
            skip -= len(view)
            continue
        views.append(view[skip:])
        skip = 0
    return EncodedFrame(views, record.nbytes - MUX_HEADER_LEN)


def encode_control_record(msg: RelayControlMsg, salt: SessionSalt) -> bytes:
    return encode_mux_record(MuxKind.CONTROL, encode_control_msg(msg), salt).tobytes()


def parse_mux_header(
    header: Buffer, *, ceiling: int = DEFAULT_FRAME_CEILING, source: str = "peer"
) -> MuxHeader:
    """Check magic, version and length (before any payload is buffered)."""
    raw = bytes(header)
    if len(raw) != MUX_HEADER_LEN:
        raise FramingError(f"MuxRecord header from {source} is {len(raw)} bytes, want {MUX_HEADER_LEN}")
    magic, version, kind, rank, length = _MUX_SIGNED_HEADER.unpack_from(raw)
    if magic != MUX_MAGIC:
        raise FramingError(f"MuxRecord from {source}: bad magic 0x{magic:08X} (want 0x{MUX_MAGIC:08X})")
    if version != MUX_VERSION:
        raise FramingError(f"MuxRecord from {source}: unsupported version {version} (want {MUX_VERSION})")
    if length > ceiling:
        raise FramingError(
            f"MuxRecord from {source}: payload length {length} exceeds the frame ceiling {ceiling}"
        )
    return MuxHeader(kind, rank, length, raw[:MUX_SIGNED_HEADER_LEN], raw[MUX_SIGNED_HEADER_LEN:])


def verify_mux_payload(
    header: MuxHeader, payload: Buffer, salt: SessionSalt, *, source: str = "peer", tag: bytes | None = None
) -> MuxKind:
    """Check the record's MAC, then its kind (unknown kinds only after the MAC passed).

    ``tag`` is the MAC computed while the payload arrived (no second pass).
    """
    expected = tag if tag is not None else salt.mac8(header.signed, payload)
    verify_mac(expected, header.tag, f"MuxRecord from {source}")
    try:
        return MuxKind(header.kind)
    except ValueError:
        raise FramingError(f"MuxRecord from {source}: unknown kind 0x{header.kind:02X}") from None


@attrs.frozen
class MuxRecord:
    """A decoded record (used for small records and tests; big payloads stay views)."""

    kind: MuxKind
    payload: Buffer
    rank: int = 0

    def control(self) -> RelayControlMsg:
        return decode_control_msg(self.payload)


def decode_mux_record(data: Buffer, salt: SessionSalt, *, ceiling: int = DEFAULT_FRAME_CEILING) -> MuxRecord:
    """Decode one whole record held in memory (sans-IO; streams use the reader)."""
    view = memoryview(data)
    if len(view) < MUX_HEADER_LEN:
        raise FramingError(f"MuxRecord is {len(view)} bytes, shorter than its {MUX_HEADER_LEN}-byte header")
    header = parse_mux_header(view[:MUX_HEADER_LEN], ceiling=ceiling)
    payload = view[MUX_HEADER_LEN:]
    if len(payload) != header.length:
        raise FramingError(
            f"MuxRecord declares a {header.length}-byte payload but {len(payload)} bytes follow its header"
        )
    kind = verify_mux_payload(header, payload, salt)
    return MuxRecord(kind, payload, header.rank)
