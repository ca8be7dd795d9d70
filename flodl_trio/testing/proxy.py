"""FaultProxy: a TCP proxy that breaks one leg of a cluster on purpose, for tests.

Put it on any leg (rank <-> relay loopback, relay <-> controller) and point
the client side at ``proxy.address``::

    async with open_fault_proxy(target=(host, port), faults=[CutAt(1000)]) as proxy:  # or FaultProxy(...)
        ...connect to proxy.address...
        await proxy.wait_fired(CutAt)

Each accepted connection gets its own upstream connection to the target and
two pumps: ``"up"`` (client -> target) and ``"down"`` (target -> client).
Faults are value types naming a direction and, optionally, the index of the
connection they apply to. Byte offsets count the bytes the *sender* wrote on
that connection in that direction (0-based, handshakes included, before any
record fault edits the stream); record indices count that flow's records.

Bytes move in large chunks; a chunk is split only at a fault's exact offset
(or at a record boundary when a record fault needs one). The proxy never hangs
a test: an EOF is passed on as a half-close, a reset or a cut resets both
sides, and leaving the block closes every socket.
"""

from __future__ import annotations

import itertools
import math
import operator
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Literal, TypeAlias

import attrs
import trio

from ..transport.tasks import ChangeSignal, one_error, service_nursery
from ..wire.constants import MUX_HEADER_LEN
from ..wire.handshake import DATA_ACK_LEN, DATA_HANDSHAKE_LEN

try:  # Linux: how many written bytes the peer has not acknowledged yet.
    import fcntl
    import termios

    _TIOCOUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _TIOCOUTQ = None

LOOPBACK = "127.0.0.1"

Direction: TypeAlias = Literal["up", "down", "both"]
Framing: TypeAlias = Literal["len", "mux"]
FlowName: TypeAlias = Literal["up", "down"]
FLOWS: tuple[FlowName, FlowName] = ("up", "down")

# Bytes asked of the kernel per receive.
CHUNK = 256 << 10
DELAY_LINE_CHUNKS = 64  # chunks a Delay holds in flight at once
# A cut waits at most this long for the bytes before it to reach the peer.
DRAIN_TIMEOUT_S = 2.0
# A bandwidth cap writes about this much time's worth of bytes at once.
PACING_SLICE_S = 0.02
# Offset of the u32 payload length inside a MuxRecord header.
MUX_LENGTH_OFFSET = 13
_U32 = struct.Struct("<I")
# Bytes before the first record when ``skip_bytes`` is not given, per framing and flow:
# the data handshake (rank -> relay) and its ack; the channel magic (relay -> controller).
DEFAULT_SKIP: dict[tuple[Framing, FlowName], int] = {
    ("len", "up"): DATA_HANDSHAKE_LEN,
    ("len", "down"): DATA_ACK_LEN,
    ("mux", "up"): 4,
    ("mux", "down"): 0,
}


# ---------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------


def _integer(value: Any) -> int:
    """A byte offset, record index, bit or connection number as a plain int.

    Any integer type passes (numpy's too); a float or a bool is refused here, where the
    fault is written: no byte sits at offset 2.5, and a fault aimed there never fires.
    """
    if isinstance(value, bool):
        raise TypeError(f"want an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"want an integer, got {value!r} ({type(value).__name__})") from None


def _optional_integer(value: Any) -> int | None:
    return None if value is None else _integer(value)


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _positive(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


@attrs.frozen
class BaseFault:
    """Where a fault applies: a direction, and every connection or only the Nth."""

    direction: Direction = attrs.field(default="up", kw_only=True, validator=attrs.validators.in_(("up", "down", "both")))
    connection: int | None = attrs.field(
        default=None, kw_only=True, converter=_optional_integer, validator=attrs.validators.optional(attrs.validators.ge(0))
    )

    def applies_to(self, connection: int, flow: FlowName) -> bool:
        return self.direction in (flow, "both") and self.connection in (None, connection)


@attrs.frozen
class Delay(BaseFault):
    """Forward each received chunk ``seconds`` after it arrived (a long link: latency, not
    a cap on throughput; the chunks behind it keep arriving meanwhile)."""

    seconds: float = attrs.field(validator=_non_negative)


@attrs.frozen
class BandwidthCap(BaseFault):
    """Forward at most ``bytes_per_second`` (a thin link; writes are paced in small slices)."""

    bytes_per_second: float = attrs.field(validator=_positive)


@attrs.frozen
class Stall(BaseFault):
    """Forward nothing for ``seconds`` once ``at_byte`` bytes have passed (a frozen peer or path)."""

    at_byte: int = attrs.field(converter=_integer, validator=_non_negative)
    seconds: float = attrs.field(validator=_non_negative)


@attrs.frozen
class CutAt(BaseFault):
    """Forward exactly ``at_byte`` bytes, then reset both sides (a crash or a pulled cable)."""

    at_byte: int = attrs.field(converter=_integer, validator=_non_negative)


@attrs.frozen
class FlipBit(BaseFault):
    """Flip bit ``bit`` of the byte at offset ``at_byte`` (corruption the MACs must catch)."""

    at_byte: int = attrs.field(converter=_integer, validator=_non_negative)
    bit: int = attrs.field(default=0, converter=_integer, validator=[attrs.validators.ge(0), attrs.validators.le(7)])


@attrs.frozen
class HalfClose(BaseFault):
    """After ``at_byte`` bytes, send EOF this way (later bytes are discarded); the other way stays open."""

    at_byte: int = attrs.field(converter=_integer, validator=_non_negative)


@attrs.frozen
class RecordFault(BaseFault):
    """A fault on whole records; the proxy parses the framing to find their boundaries.

    ``framing="len"``: u32 little-endian length prefix then body (rank <-> relay,
    after the handshake). ``framing="mux"``: 25-byte MuxRecord header whose u32
    payload length sits at header offset 13, then the payload (relay <->
    controller, after the channel magic upstream). ``skip_bytes`` is what
    precedes the first record; None means the data-channel default for the
    flow (see :data:`DEFAULT_SKIP`; a control-channel rank leg needs 56 up,
    16 down). ``index`` counts records, 0-based.
    """

    index: int = attrs.field(converter=_integer, validator=_non_negative)
    framing: Framing = attrs.field(default="len", validator=attrs.validators.in_(("len", "mux")))
    skip_bytes: int | None = attrs.field(
        default=None, converter=_optional_integer, validator=attrs.validators.optional(_non_negative)
    )

    def layout(self, flow: FlowName) -> _Layout:
        skip = DEFAULT_SKIP[self.framing, flow] if self.skip_bytes is None else self.skip_bytes
        return _Layout(self.framing, skip)


@attrs.frozen
class DropRecord(RecordFault):
    """Swallow record ``index`` whole (a lost message the protocol must notice)."""


@attrs.frozen
class DuplicateRecord(RecordFault):
    """Deliver record ``index`` twice in a row (a replay the protocol must refuse)."""


Fault: TypeAlias = Delay | BandwidthCap | Stall | CutAt | FlipBit | HalfClose | DropRecord | DuplicateRecord
_PointFault: TypeAlias = Stall | CutAt | FlipBit | HalfClose


def _may_meet(a: BaseFault, b: BaseFault, flow: FlowName) -> bool:
    """Whether two faults can both apply to ``flow`` of one connection."""
    both_here = a.direction in (flow, "both") and b.direction in (flow, "both")
    return both_here and (a.connection is None or b.connection is None or a.connection == b.connection)


def _check_record_faults(faults: Sequence[Fault]) -> None:
    """Record faults that can meet on one flow must agree on its framing and not share an index."""
    records = [f for f in faults if isinstance(f, RecordFault)]
    for a, b in itertools.combinations(records, 2):
        for flow in FLOWS:
            if not _may_meet(a, b, flow):
                continue
            if a.layout(flow) != b.layout(flow):
                raise ValueError(f"{a} and {b} disagree on the {flow} framing")
            if a.index == b.index:
                raise ValueError(f"{a} and {b} both target {flow} record {a.index}")


# ---------------------------------------------------------------------------
# What happened
# ---------------------------------------------------------------------------


@attrs.define
class FaultEvent:
    """One firing of a fault: where (connection, flow, sender offset) and when (trio clock)."""

    connection: int
    direction: FlowName
    fault: Fault
    offset: int
    time: float
    detail: str = ""


@attrs.define
class FlowRecord:
    """Byte counts of one direction of one connection."""

    bytes_in: int = 0  # received from the sender
    bytes_out: int = 0  # written to the receiver
    bytes_discarded: int = 0  # received after a HalfClose, never forwarded
    records: int = 0  # complete records seen (only when a record fault parses this flow)
    eof: bool = False  # the sender's EOF was passed on


@attrs.define
class ConnectionRecord:
    """One accepted connection: both flows and how it ended."""

    index: int
    opened_at: float
    up: FlowRecord = attrs.field(factory=FlowRecord)
    down: FlowRecord = attrs.field(factory=FlowRecord)
    outcome: str = "open"  # closed | cut | reset: ... | target unreachable: ... | cancelled
    closed_at: float | None = None

    def flow(self, direction: FlowName) -> FlowRecord:
        return self.up if direction == "up" else self.down


# ---------------------------------------------------------------------------
# Record boundaries (sans-IO)
# ---------------------------------------------------------------------------


@attrs.frozen
class _Layout:
    framing: Framing
    skip: int

    @property
    def header_len(self) -> int:
        return 4 if self.framing == "len" else MUX_HEADER_LEN

    def body_len(self, header: bytes | bytearray) -> int:
        return _U32.unpack_from(header, 0 if self.framing == "len" else MUX_LENGTH_OFFSET)[0]


FireCallback: TypeAlias = Callable[[Fault, int, str], None]


class _RecordEditor:
    """Finds record boundaries in one flow and drops or repeats whole records.

    Streaming: bytes of kept records pass through as slices of the input; only
    a dropped record's header (until its length is known) and a duplicated
    record's copy are held.
    """

    def __init__(self, layout: _Layout, actions: dict[int, DropRecord | DuplicateRecord], fire: FireCallback) -> None:
        self.layout = layout
        self.actions = actions
        self.fire = fire
        self.skip_left = layout.skip
        self.offset = 0  # sender offset of the next byte fed
        self.index = 0  # records completed so far
        self.record_start = 0
        self.header = bytearray()
        self.body_left: int | None = None  # None while the header is incomplete
        self.copy: bytearray | None = None

    @property
    def action(self) -> DropRecord | DuplicateRecord | None:
        return self.actions.get(self.index)

    def feed(self, data: memoryview) -> list[memoryview | bytes]:
        """The bytes to forward for ``data``, in order."""
        out: list[memoryview | bytes] = []
        while data:
            n = self._step(data, out)
            data = data[n:]
        return out

    def _step(self, data: memoryview, out: list[memoryview | bytes]) -> int:
        """Consume one run of ``data`` that stays inside one part (skip, header, body)."""
        if self.skip_left:
            n = min(self.skip_left, len(data))
            self.skip_left -= n
            self.offset += n
            out.append(data[:n])
            return n
        if self.body_left is None:
            return self._take_header(data, out)
        n = min(self.body_left, len(data))
        self._keep(data[:n], out)
        self.body_left -= n
        if self.body_left == 0:
            self._end_record(out)
        return n

    def _take_header(self, data: memoryview, out: list[memoryview | bytes]) -> int:
        if not self.header:
            self.record_start = self.offset
            self.copy = bytearray() if isinstance(self.action, DuplicateRecord) else None
        n = min(self.layout.header_len - len(self.header), len(data))
        self.header += data[:n]
        self._keep(data[:n], out)
        if len(self.header) == self.layout.header_len:
            self.body_left = self.layout.body_len(self.header)
            if self.body_left == 0:
                self._end_record(out)
        return n

    def _keep(self, piece: memoryview, out: list[memoryview | bytes]) -> None:
        self.offset += len(piece)
        if isinstance(self.action, DropRecord):
            return
        out.append(piece)
        if self.copy is not None:
            self.copy += piece

    def _end_record(self, out: list[memoryview | bytes]) -> None:
        action = self.action
        size = self.offset - self.record_start
        if isinstance(action, DuplicateRecord) and self.copy is not None:
            out.append(bytes(self.copy))
            self.fire(action, self.record_start, f"record {self.index} ({size} bytes) sent twice")
        elif isinstance(action, DropRecord):
            self.fire(action, self.record_start, f"record {self.index} ({size} bytes) dropped")
        self.index += 1
        self.header.clear()
        self.body_left = None
        self.copy = None


def _editor_for(faults: Sequence[Fault], flow: FlowName, fire: FireCallback) -> _RecordEditor | None:
    """A record editor when some record fault applies to this flow (layouts already checked)."""
    records = [f for f in faults if isinstance(f, (DropRecord, DuplicateRecord))]
    if not records:
        return None
    return _RecordEditor(records[0].layout(flow), {f.index: f for f in records}, fire)


# ---------------------------------------------------------------------------
# Sockets
# ---------------------------------------------------------------------------


def _unacked_bytes(stream: trio.SocketStream) -> int | None:
    """Bytes written but not yet acknowledged by the peer (None where the OS cannot tell)."""
    if _TIOCOUTQ is None:
        return None
    try:
        raw = fcntl.ioctl(stream.socket.fileno(), _TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return None
    return int(struct.unpack("i", raw)[0])


async def _drain(stream: trio.SocketStream, timeout: float) -> bool:
    """Wait until the peer's kernel holds every byte we wrote, so a reset destroys none of them."""
    deadline = trio.current_time() + timeout
    while (left := _unacked_bytes(stream)) is not None and left > 0:
        if trio.current_time() >= deadline:
            return False
        await trio.sleep(0.002)
    return True


async def _reset(stream: trio.SocketStream) -> None:
    """Close with SO_LINGER 0: the peer gets a RST, not a FIN (a real cut)."""
    try:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, trio.ClosedResourceError):
        pass
    await stream.aclose()


def _nodelay(stream: trio.SocketStream) -> None:
    """The proxy must not add Nagle latency to a ping-pong protocol."""
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except OSError:
        pass


# ---------------------------------------------------------------------------
# Pumps
# ---------------------------------------------------------------------------


class _Cut(Exception):
    """A CutAt fired: the connection resets both sides."""


_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class _Pacer:
    """Token-bucket pacing in slices of PACING_SLICE_S worth of bytes; no burst after idling."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.slice = max(1, int(rate * PACING_SLICE_S))
        self.next_free = -math.inf

    async def send(self, dst: trio.SocketStream, data: memoryview | bytes) -> None:
        for start in range(0, len(data), self.slice):
            part = data[start:start + self.slice]
            self.next_free = max(self.next_free, trio.current_time())
            await trio.sleep_until(self.next_free)
            await dst.send_all(part)
            self.next_free += len(part) / self.rate


class _Pump:
    """One direction of one connection: sender -> faults -> receiver."""

    def __init__(
        self, proxy: FaultProxy, record: ConnectionRecord, flow: FlowName,
        src: trio.SocketStream, dst: trio.SocketStream, faults: Sequence[Fault],
    ) -> None:
        self.proxy = proxy
        self.connection = record.index
        self.flow = flow
        self.stats = record.flow(flow)
        self.src = src
        self.dst = dst
        self.points: list[_PointFault] = sorted(
            (f for f in faults if isinstance(f, (Stall, CutAt, FlipBit, HalfClose))), key=lambda f: f.at_byte
        )
        self.delays = [f for f in faults if isinstance(f, Delay)]
        caps = [f for f in faults if isinstance(f, BandwidthCap)]
        self.cap = min(caps, key=lambda c: c.bytes_per_second) if caps else None
        self.pacer = _Pacer(self.cap.bytes_per_second) if self.cap else None
        self.cap_engaged = False  # its event is recorded once, when pacing starts
        self.editor = _editor_for(faults, flow, self._fire)
        self.pos = 0  # sender bytes handled so far
        self.shut = False  # a HalfClose sent EOF: later bytes are discarded

    def _fire(self, fault: Fault, offset: int, detail: str = "") -> None:
        self.proxy._record(FaultEvent(self.connection, self.flow, fault, offset, trio.current_time(), detail))

    async def run(self) -> None:
        """Forward until the sender's EOF (passed on as a half-close); raises on reset or cut."""
        await self._fire_boundaries()
        if self.delays:
            with one_error():
                return await self._run_delayed()
        while True:
            data = await self.src.receive_some(CHUNK)
            if not data:
                await self._end_of_stream()
                return
            self.stats.bytes_in += len(data)
            await self._forward(memoryview(data))

    async def _run_delayed(self) -> None:
        """A delay line: each chunk (and the EOF) goes on its delay after it arrived while
        later ones keep arriving, as on a long link - latency, not a cap on throughput (up
        to ``DELAY_LINE_CHUNKS`` chunks in flight: a bandwidth-delay product of 16 MiB)."""
        held = sum(delay.seconds for delay in self.delays)
        send, line = trio.open_memory_channel[tuple[float, bytes]](DELAY_LINE_CHUNKS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_into_line, send, held)
            async with line:
                async for due, data in line:
                    await trio.sleep_until(due)
                    if not data:
                        return await self._end_of_stream()
                    await self._forward(memoryview(data))

    async def _read_into_line(self, line: trio.MemorySendChannel[tuple[float, bytes]], held: float) -> None:
        async with line:
            while True:
                data = await self.src.receive_some(CHUNK)
                if data:
                    self.stats.bytes_in += len(data)
                    for delay in [] if self.shut else self.delays:
                        self._fire(delay, self.stats.bytes_in - len(data), f"{len(data)} bytes held {delay.seconds} s")
                await line.send((trio.current_time() + held, bytes(data)))
                if not data:
                    return

    async def _forward(self, view: memoryview) -> None:
        """Split ``view`` only at fault offsets; everything between goes out as one slice."""
        while view:
            await self._fire_boundaries()
            mask = self._take_flips(view[0])
            if mask:
                await self._emit(memoryview(bytes((view[0] ^ mask,))))
                view = view[1:]
                continue
            upcoming = min((p.at_byte for p in self.points), default=math.inf)
            n = int(min(len(view), upcoming - self.pos))
            await self._emit(view[:n])
            view = view[n:]
        await self._fire_boundaries()

    def _due(self) -> list[_PointFault]:
        return [p for p in self.points if p.at_byte == self.pos]

    def _take_flips(self, byte: int) -> int:
        """XOR mask of the FlipBits due on the byte at the current offset (consumed)."""
        mask = 0
        for flip in [p for p in self._due() if isinstance(p, FlipBit)]:
            self.points.remove(flip)
            mask ^= 1 << flip.bit
            self._fire(flip, self.pos, f"byte 0x{byte:02x} -> 0x{byte ^ mask:02x}")
        return mask

    async def _fire_boundaries(self) -> None:
        """Stall, HalfClose and CutAt fire as soon as their offset is reached, before more data."""
        for fault in [p for p in self._due() if not isinstance(p, FlipBit)]:
            self.points.remove(fault)
            if isinstance(fault, Stall):
                self._fire(fault, self.pos, f"stalled {fault.seconds} s")
                await trio.sleep(fault.seconds)
            elif isinstance(fault, HalfClose):
                self._fire(fault, self.pos, "EOF sent")
                await self._send_eof()
                self.shut = True
            elif isinstance(fault, CutAt):
                drained = await _drain(self.dst, self.proxy.drain_timeout)
                unacked = "" if drained else " (not all acknowledged)"
                self._fire(fault, self.pos, f"{self.stats.bytes_out} bytes delivered{unacked}")
                raise _Cut()

    async def _emit(self, segment: memoryview) -> None:
        start = self.pos
        self.pos += len(segment)
        if self.shut:
            self.stats.bytes_discarded += len(segment)
            return
        if self.cap is not None and not self.cap_engaged:
            self.cap_engaged = True
            self._fire(self.cap, start, f"pacing at {self.cap.bytes_per_second:g} B/s")
        pieces = self.editor.feed(segment) if self.editor is not None else [segment]
        for piece in pieces:
            await self._write(piece)
        if self.editor is not None:
            self.stats.records = self.editor.index

    async def _write(self, piece: memoryview | bytes) -> None:
        if self.pacer is None:
            await self.dst.send_all(piece)
        else:
            await self.pacer.send(self.dst, piece)
        self.stats.bytes_out += len(piece)

    async def _end_of_stream(self) -> None:
        if not self.shut:
            await self._send_eof()
        self.stats.eof = True

    async def _send_eof(self) -> None:
        try:
            await self.dst.send_eof()
        except _BROKEN:
            pass  # the receiver is already gone; the other pump finds out


class _Connection:
    """One client connection and its own upstream connection; ends both together."""

    def __init__(self, proxy: FaultProxy, record: ConnectionRecord, client: trio.SocketStream, upstream: trio.SocketStream) -> None:
        self.proxy = proxy
        self.record = record
        self.client = client
        self.upstream = upstream
        self.aborted = False
        self.finished = 0

    async def run(self) -> None:
        applicable = {flow: [f for f in self.proxy.faults if f.applies_to(self.record.index, flow)] for flow in FLOWS}
        pumps = [
            _Pump(self.proxy, self.record, "up", self.client, self.upstream, applicable["up"]),
            _Pump(self.proxy, self.record, "down", self.upstream, self.client, applicable["down"]),
        ]
        try:
            async with trio.open_nursery() as nursery:
                for pump in pumps:
                    nursery.start_soon(self._guard, pump, nursery.cancel_scope)
        finally:
            with trio.CancelScope(shield=True):
                await self._close()

    async def _guard(self, pump: _Pump, scope: trio.CancelScope) -> None:
        """A pump's reset or cut ends the whole connection; a clean EOF ends only its direction."""
        try:
            await pump.run()
            self.finished += 1
        except _Cut:
            self._abort("cut", scope)
        except _BROKEN as exc:
            self._abort(f"reset ({pump.flow}): {type(exc).__name__}: {exc}", scope)

    def _abort(self, outcome: str, scope: trio.CancelScope) -> None:
        if not self.aborted:
            self.aborted = True
            self.record.outcome = outcome
        scope.cancel()

    async def _close(self) -> None:
        if self.aborted:
            await _reset(self.client)
            await _reset(self.upstream)
            return
        await self.client.aclose()
        await self.upstream.aclose()
        self.record.outcome = "closed" if self.finished == 2 else "cancelled"


# ---------------------------------------------------------------------------
# The proxy
# ---------------------------------------------------------------------------


FaultKind: TypeAlias = type[BaseFault]


class FaultProxy:
    """A TCP proxy in front of ``target`` that injects ``faults`` and records what happened.

    Run it as an async context manager (``async with FaultProxy(target, faults)
    as proxy:`` - it serves in a nursery of its own, ``proxy.port`` is bound on
    entry and leaving the block closes every proxied connection), with
    :func:`open_fault_proxy` (the same), or in a nursery of yours with
    ``await nursery.start(proxy.serve)`` (returns the bound port).
    """

    def __init__(
        self,
        target: tuple[str, int],
        faults: Sequence[Fault] = (),
        *,
        host: str = LOOPBACK,
        port: int = 0,
        drain_timeout: float = DRAIN_TIMEOUT_S,
    ) -> None:
        if isinstance(faults, BaseFault):
            raise TypeError(f"faults is a list of faults: pass [{faults!r}], not the fault alone")
        for fault in faults:
            if not isinstance(fault, BaseFault):
                raise TypeError(f"not a fault: {fault!r}")
        _check_record_faults(faults)
        self.target = (str(target[0]), int(target[1]))
        self.faults: tuple[Fault, ...] = tuple(faults)
        self.host = host
        self.drain_timeout = drain_timeout
        self.connections: list[ConnectionRecord] = []
        self.events: list[FaultEvent] = []
        self._requested_port = port
        self._port: int | None = None
        self._changed = ChangeSignal()
        self._session: AbstractAsyncContextManager[trio.Nursery] | None = None  # while ``async with`` serves it

    # -- as an async context manager ----------------------------------------

    async def __aenter__(self) -> FaultProxy:
        """Serve in a nursery of its own until the block is left; ``port`` is bound on return."""
        if self._session is not None:
            raise RuntimeError("this FaultProxy is already serving an `async with` block")
        session = service_nursery()
        nursery = await session.__aenter__()
        try:
            await nursery.start(self.serve)
        except BaseException as exc:
            await session.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._session = session
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        """Stop serving: every proxied connection is closed."""
        session, self._session = self._session, None
        assert session is not None, "__aexit__ without __aenter__"
        return await session.__aexit__(exc_type, exc, tb)

    # -- where ---------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(
                "the proxy is not listening yet (enter `async with proxy:` or start it with nursery.start(proxy.serve))"
            )
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """What the client side connects to instead of the target."""
        return (self.host, self.port)

    # -- what happened -------------------------------------------------------

    def fired(
        self, fault: Fault | FaultKind | None = None, *, connection: int | None = None, direction: FlowName | None = None
    ) -> list[FaultEvent]:
        """Events of one fault (an instance, or every fault of a type), optionally filtered."""
        def wanted(event: FaultEvent) -> bool:
            if isinstance(fault, type):
                match = isinstance(event.fault, fault)
            else:
                match = fault is None or event.fault == fault
            return match and connection in (None, event.connection) and direction in (None, event.direction)

        return [e for e in self.events if wanted(e)]

    async def wait_fired(self, fault: Fault | FaultKind | None = None, *, count: int = 1) -> list[FaultEvent]:
        """Wait until ``fault`` has fired ``count`` times; its events so far."""
        while len(self.fired(fault)) < count:
            await self._wait_change()
        return self.fired(fault)

    async def wait_closed(self, connection: int) -> ConnectionRecord:
        """Wait until connection ``connection`` (0-based accept order) has ended."""
        while len(self.connections) <= connection or self.connections[connection].closed_at is None:
            await self._wait_change()
        return self.connections[connection]

    def _record(self, event: FaultEvent) -> None:
        self.events.append(event)
        self._notify()

    def _notify(self) -> None:
        self._changed.notify()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    # -- serving -------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, hand the bound port to ``nursery.start``, proxy until cancelled."""
        listeners = await trio.open_tcp_listeners(self._requested_port, host=self.host)
        self._port = int(listeners[0].socket.getsockname()[1])
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._serve_client, listeners)
            task_status.started(self._port)

    async def _serve_client(self, client: trio.SocketStream) -> None:
        record = ConnectionRecord(len(self.connections), trio.current_time())
        self.connections.append(record)
        await self._serve_connection(client, record)

    async def _serve_connection(self, client: trio.SocketStream, record: ConnectionRecord) -> None:
        """Dial the target for this client (an unreachable target resets the client), then pump."""
        _nodelay(client)
        try:
            try:
                upstream = await trio.open_tcp_stream(*self.target)
            except OSError as exc:
                record.outcome = f"target unreachable: {exc}"
                with trio.CancelScope(shield=True):
                    await _reset(client)
                return
            except BaseException:
                with trio.CancelScope(shield=True):
                    await client.aclose()
                record.outcome = "cancelled"
                raise
            _nodelay(upstream)
            await _Connection(self, record, client, upstream).run()
        finally:
            record.closed_at = trio.current_time()
            self._notify()


@asynccontextmanager
async def open_fault_proxy(
    target: tuple[str, int],
    faults: Sequence[Fault] = (),
    *,
    host: str = LOOPBACK,
    port: int = 0,
    drain_timeout: float = DRAIN_TIMEOUT_S,
) -> AsyncIterator[FaultProxy]:
    """Run a :class:`FaultProxy` for the block; ``proxy.port`` is bound on entry.

    Leaving the block cancels the proxy: every proxied connection is closed.
    """
    async with FaultProxy(target, faults, host=host, port=port, drain_timeout=drain_timeout) as proxy:
        yield proxy


__all__ = [
    "BandwidthCap",
    "BaseFault",
    "ConnectionRecord",
    "CutAt",
    "Delay",
    "DropRecord",
    "DuplicateRecord",
    "Fault",
    "FaultEvent",
    "FaultProxy",
    "FlipBit",
    "FlowRecord",
    "HalfClose",
    "RecordFault",
    "Stall",
    "open_fault_proxy",
]
