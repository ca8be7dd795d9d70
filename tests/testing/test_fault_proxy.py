"""FaultProxy: each fault against trivial servers (exact offsets), then through real clusters.

Expected bytes and consensus values are computed independently in each test.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_trio import (
    DTYPE_F32,
    ChannelKind,
    FlodlError,
    MacError,
    RankDeadError,
    RoundFrame,
    SessionSalt,
    TensorPayload,
    connect_reduce_client,
    open_controller,
    open_relay,
)
from flodl_trio.client import ReduceClient
from flodl_trio.testing import (
    BandwidthCap,
    CutAt,
    Delay,
    DropRecord,
    DuplicateRecord,
    FaultProxy,
    FlipBit,
    HalfClose,
    Stall,
    hold_open,
    open_fault_proxy,
    open_local_cluster,
)
from flodl_trio.testing.matrix.offsets import (
    FRAME_PAYLOAD,
    MUX_HEADER,
    MUX_LENGTH_FIELD,
    consensus_frame_start,
    frame_len,
    rank_frame_start,
    rank_leg_bytes,
    uplink_first_record,
    uplink_host_frame_start,
)
from flodl_trio.testing.proxy import CHUNK, _Layout, _RecordEditor
from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA
from flodl_trio.wire.mux import (
    Hello,
    MuxKind,
    decode_mux_record,
    encode_control_record,
    encode_mux_record,
)

LOOP = "127.0.0.1"
U32 = struct.Struct("<I")


# ---------------------------------------------------------------------------
# Trivial servers
# ---------------------------------------------------------------------------


@attrs.define
class Peer:
    """What one server-side connection saw."""

    data: bytearray = attrs.field(factory=bytearray)
    arrivals: list[tuple[float, int]] = attrs.field(factory=list)  # (time, bytes so far)
    outcome: str = ""  # "eof" or "reset"
    ended: trio.Event = attrs.field(factory=trio.Event)


@attrs.define
class Server:
    port: int = 0
    peers: list[Peer] = attrs.field(factory=list)

    @property
    def address(self) -> tuple[str, int]:
        return (LOOP, self.port)

    async def peer(self, index: int) -> Peer:
        while len(self.peers) <= index:
            await trio.sleep(0.005)
        return self.peers[index]


Handler = Callable[[trio.SocketStream, Peer], Awaitable[None]]


async def read_to_end(stream: trio.SocketStream, peer: Peer) -> None:
    """Receive until EOF or reset, timestamping every arrival."""
    try:
        while chunk := await stream.receive_some(1 << 16):
            peer.data += chunk
            peer.arrivals.append((trio.current_time(), len(peer.data)))
        peer.outcome = "eof"
    except trio.BrokenResourceError:
        peer.outcome = "reset"


async def sink(stream: trio.SocketStream, peer: Peer) -> None:
    await read_to_end(stream, peer)


async def echo(stream: trio.SocketStream, peer: Peer) -> None:
    """Echo everything; pass the client's EOF back."""
    try:
        while chunk := await stream.receive_some(1 << 16):
            peer.data += chunk
            await stream.send_all(chunk)
        peer.outcome = "eof"
        await stream.send_eof()
    except trio.BrokenResourceError:
        peer.outcome = "reset"


def source(payload: bytes, *, then_read: bool = False) -> Handler:
    """Send ``payload``, then EOF; optionally keep reading what the client sends."""

    async def handler(stream: trio.SocketStream, peer: Peer) -> None:
        try:
            await stream.send_all(payload)
            await stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            peer.outcome = "reset"
            return
        if then_read:
            await read_to_end(stream, peer)

    return handler


@asynccontextmanager
async def open_server(handler: Handler) -> AsyncIterator[Server]:
    listeners = await trio.open_tcp_listeners(0, host=LOOP)
    server = Server(listeners[0].socket.getsockname()[1])

    async def serve_one(stream: trio.SocketStream, peer: Peer) -> None:
        try:
            await handler(stream, peer)
        finally:
            peer.ended.set()
            await stream.aclose()

    async def accept_loop() -> None:
        while True:
            stream = await listeners[0].accept()
            peer = Peer()
            server.peers.append(peer)
            nursery.start_soon(serve_one, stream, peer)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_loop)
        yield server
        nursery.cancel_scope.cancel()
    await listeners[0].aclose()


async def client_read_to_end(stream: trio.SocketStream) -> tuple[bytes, str]:
    peer = Peer()
    await read_to_end(stream, peer)
    return bytes(peer.data), peer.outcome


async def send_ignoring_reset(stream: trio.SocketStream, data: bytes) -> None:
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ---------------------------------------------------------------------------
# Plumbing
# ---------------------------------------------------------------------------


async def test_port_bound_when_started_and_forwarding_both_ways():
    async with open_server(echo) as server:
        proxy = FaultProxy(server.address)
        with pytest.raises(RuntimeError, match="not listening"):
            proxy.port
        async with trio.open_nursery() as nursery:
            port = await nursery.start(proxy.serve)
            assert port == proxy.port and proxy.address == (LOOP, port)
            payloads = [random_bytes(1 << 20, seed) for seed in range(3)]
            replies: dict[int, tuple[bytes, str]] = {}

            async def client(i: int) -> None:
                stream = await trio.open_tcp_stream(*proxy.address)
                async with stream, trio.open_nursery() as inner:
                    async def send() -> None:
                        await stream.send_all(payloads[i])
                        await stream.send_eof()

                    inner.start_soon(send)
                    replies[i] = await client_read_to_end(stream)

            async with trio.open_nursery() as clients:
                for i in range(3):
                    clients.start_soon(client, i)
            for i in range(3):
                record = await proxy.wait_closed(i)
                assert record.outcome == "closed"
                assert record.up.bytes_in == record.up.bytes_out == 1 << 20
                assert record.down.bytes_in == record.down.bytes_out == 1 << 20
                assert record.up.eof and record.down.eof
            nursery.cancel_scope.cancel()
    assert replies == {i: (payloads[i], "eof") for i in range(3)}
    assert len(server.peers) == 3  # one upstream connection per client
    assert sorted(bytes(p.data) for p in server.peers) == sorted(payloads)
    assert proxy.events == []


async def test_client_close_and_server_reset_propagate():
    async with open_server(sink) as server, open_fault_proxy(server.address) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(b"bye")
        await stream.aclose()
        peer = await server.peer(0)
        with trio.fail_after(5):
            await peer.ended.wait()
        assert (bytes(peer.data), peer.outcome) == (b"bye", "eof")
        assert (await proxy.wait_closed(0)).outcome == "closed"

    async def resetter(stream: trio.SocketStream, peer: Peer) -> None:
        await stream.receive_some(10)
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async with open_server(resetter) as server, open_fault_proxy(server.address) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(b"x")
        with trio.fail_after(5):
            data, outcome = await client_read_to_end(stream)
        assert data == b"" and outcome == "reset"
        assert (await proxy.wait_closed(0)).outcome.startswith("reset (down)")
        await stream.aclose()


async def test_leaving_the_block_closes_every_connection():
    async with open_server(echo) as server:
        async with open_fault_proxy(server.address) as proxy:
            stream = await trio.open_tcp_stream(*proxy.address)
            await stream.send_all(b"ping")
            assert await stream.receive_some(4) == b"ping"
        with trio.fail_after(5):
            data, outcome = await client_read_to_end(stream)
        assert data == b"" and outcome in ("eof", "reset")
        assert proxy.connections[0].outcome == "cancelled"
        peer = await server.peer(0)
        with trio.fail_after(5):
            await peer.ended.wait()
        await stream.aclose()


async def test_unreachable_target_resets_the_client():
    dead = trio.socket.socket()
    await dead.bind((LOOP, 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    async with open_fault_proxy((LOOP, port)) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        with trio.fail_after(5):
            data, outcome = await client_read_to_end(stream)
        assert data == b"" and outcome in ("eof", "reset")
        record = await proxy.wait_closed(0)
        assert record.outcome.startswith("target unreachable")
        await stream.aclose()


def test_fault_arguments_are_validated():
    with pytest.raises(ValueError):
        FlipBit(0, bit=8)
    with pytest.raises(ValueError):
        CutAt(-1)
    with pytest.raises(ValueError):
        BandwidthCap(0)
    with pytest.raises(ValueError):
        Delay(0.1, direction="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DropRecord(0, framing="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disagree on the up framing"):
        FaultProxy((LOOP, 1), [DropRecord(0), DuplicateRecord(1, framing="mux")])
    with pytest.raises(ValueError, match="both target up record 2"):
        FaultProxy((LOOP, 1), [DropRecord(2), DuplicateRecord(2, direction="both")])
    with pytest.raises(TypeError):
        FaultProxy((LOOP, 1), ["cut"])  # type: ignore[list-item]
    # Different connections or directions never meet: no conflict.
    FaultProxy((LOOP, 1), [DropRecord(0, connection=0), DuplicateRecord(0, framing="mux", connection=1)])
    FaultProxy((LOOP, 1), [DropRecord(0), DuplicateRecord(0, direction="down")])


@pytest.mark.parametrize(
    "make",
    [
        lambda: CutAt(2.5),
        lambda: FlipBit(3.0),
        lambda: FlipBit(3, bit=1.5),
        lambda: Stall(1.5, 0.1),
        lambda: HalfClose(True),
        lambda: DropRecord(1.5),
        lambda: DuplicateRecord(0, skip_bytes=2.5),
        lambda: CutAt(3, connection=0.5),
        lambda: FaultProxy((LOOP, 1), CutAt(3)),  # one fault, not a list of them
    ],
    ids=["cut", "flip", "flip-bit", "stall", "half-close-bool", "drop", "skip", "connection", "not-a-list"],
)
def test_offsets_and_indices_must_be_integers(make):
    """A byte offset that no byte sits at (2.5) never fires - worse, the pump spun on it
    for ever instead of forwarding: refused where the fault is written."""
    with pytest.raises(TypeError, match="integer|list of faults"):
        make()


def test_offsets_accept_any_integer_type():
    fault = CutAt(np.int64(7), connection=np.int32(1))
    assert fault == CutAt(7, connection=1) and type(fault.at_byte) is int


# ---------------------------------------------------------------------------
# Timing faults
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("direction", "hops"), [("up", 1), ("down", 1), ("both", 2)])
async def test_delay_holds_each_chunk(direction, hops):
    fault = Delay(0.3, direction=direction)
    async with open_server(echo) as server, open_fault_proxy(server.address, [fault]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        start = trio.current_time()
        await stream.send_all(b"ping")
        got = b""
        while len(got) < 4:
            got += await stream.receive_some(4)
        elapsed = trio.current_time() - start
        await stream.aclose()
    assert got == b"ping"
    assert 0.3 * hops <= elapsed < 0.3 * hops + 1.0
    assert [(e.direction, e.offset) for e in proxy.fired(Delay)] == (
        [(direction, 0)] if hops == 1 else [("up", 0), ("down", 0)]
    )


async def test_delay_is_latency_not_a_cap_on_throughput():
    """A Delay is a long link: 8 MiB (32 of the proxy's chunks) arrive about one delay
    after they were sent, intact and in order - not one delay per chunk (16 s here),
    which made a delayed link a thin one too."""
    payload = random_bytes(8 << 20)
    async with open_server(source(payload, then_read=True)) as server, \
            open_fault_proxy(server.address, [Delay(0.5, direction="down")]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        start = trio.current_time()
        data, outcome = await client_read_to_end(stream)
        elapsed = trio.current_time() - start
        await stream.aclose()
    assert data == payload and outcome == "eof"
    assert 0.5 <= elapsed < 8.0, elapsed  # the EOF is held a delay too; 32 delays would be 16 s
    assert len(proxy.fired(Delay)) >= 2  # every chunk held (the source's writes arrive in several)


async def test_bandwidth_cap_paces_one_direction():
    payload = random_bytes(200_000)
    cap = BandwidthCap(400_000, direction="down")
    async with open_server(source(payload, then_read=True)) as server, open_fault_proxy(server.address, [cap]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        start = trio.current_time()
        data, outcome = await client_read_to_end(stream)
        elapsed = trio.current_time() - start
        # The other direction is not capped: 200 kB up is immediate.
        start_up = trio.current_time()
        await stream.send_all(payload)
        await stream.aclose()
        record = await proxy.wait_closed(0)
        up_elapsed = trio.current_time() - start_up
    assert data == payload and outcome == "eof"
    assert 0.35 <= elapsed <= 1.5, elapsed  # nominal 0.5 s
    assert up_elapsed < 0.3, up_elapsed
    assert record.down.bytes_out == record.up.bytes_out == 200_000
    assert bytes(server.peers[0].data) == payload
    assert [(e.direction, e.offset) for e in proxy.fired(cap)] == [("down", 0)]  # once, when pacing starts


async def test_stall_pauses_at_the_offset_then_resumes():
    payload = random_bytes(3000)
    stall = Stall(at_byte=1000, seconds=0.5)
    async with open_server(sink) as server, open_fault_proxy(server.address, [stall]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        start = trio.current_time()
        await stream.send_all(payload)
        await stream.send_eof()
        (event,) = await proxy.wait_fired(Stall)
        peer = await server.peer(0)
        with trio.fail_after(5):
            await peer.ended.wait()
        await stream.aclose()
    assert bytes(peer.data) == payload and peer.outcome == "eof"
    assert trio.current_time() - event.time >= 0.45  # it resumed only after the stall
    counts = [n for _, n in peer.arrivals]
    assert 1000 in counts  # exactly the first 1000 bytes went out before the stall
    before = max(t for t, n in peer.arrivals if n <= 1000)
    after = min(t for t, n in peer.arrivals if n > 1000)
    assert before - start < 0.25
    assert after - before >= 0.45
    (event,) = proxy.fired(stall)
    assert (event.connection, event.direction, event.offset) == (0, "up", 1000)


# ---------------------------------------------------------------------------
# Cut, flip, half-close
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("at_byte", [0, 1, 777, CHUNK + 12345])
async def test_cut_up_delivers_exactly_n_bytes_then_resets(at_byte):
    payload = random_bytes(CHUNK + 100_000)
    async with open_server(sink) as server, open_fault_proxy(server.address, [CutAt(at_byte)]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await send_ignoring_reset(stream, payload)
        with trio.fail_after(5):
            tail, outcome = await client_read_to_end(stream)
        assert tail == b"" and outcome in ("eof", "reset")
        peer = await server.peer(0)
        with trio.fail_after(5):
            await peer.ended.wait()
        record = await proxy.wait_closed(0)
        await stream.aclose()
    assert bytes(peer.data) == payload[:at_byte]
    assert peer.outcome == "reset"  # a real cut, not a clean FIN
    assert record.outcome == "cut" and record.up.bytes_out == at_byte
    (event,) = proxy.fired(CutAt)
    assert (event.direction, event.offset) == ("up", at_byte)


async def test_cut_down_delivers_exactly_n_bytes_to_the_client():
    payload = random_bytes(100_000, seed=3)
    async with open_server(source(payload)) as server, open_fault_proxy(server.address, [CutAt(5000, direction="down")]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        with trio.fail_after(5):
            data, outcome = await client_read_to_end(stream)
        await stream.aclose()
        assert (await proxy.wait_closed(0)).outcome == "cut"
    assert data == payload[:5000]
    assert outcome == "reset"
    assert server.peers  # the server was reached


def flipped(payload: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(payload)
    for at, bit in flips:
        out[at] ^= 1 << bit
    return bytes(out)


@pytest.mark.parametrize(
    "flips",
    [[(0, 0)], [(100, 3)], [(99_999, 7)], [(5, 0), (5, 1), (50_000, 7), (70_000, 2)]],
    ids=["first-byte", "mid", "last-byte", "several"],
)
async def test_flip_bit_up_at_exact_offsets(flips):
    payload = random_bytes(100_000, seed=1)
    faults = [FlipBit(at, bit=bit) for at, bit in flips]
    async with open_server(sink) as server, open_fault_proxy(server.address, faults) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(payload)
        await stream.send_eof()
        peer = await server.peer(0)
        with trio.fail_after(5):
            await peer.ended.wait()
        await stream.aclose()
    assert bytes(peer.data) == flipped(payload, flips)
    assert sorted(e.offset for e in proxy.fired(FlipBit)) == sorted(at for at, _ in flips)


async def test_flip_bit_down_only_touches_the_reply():
    payload = random_bytes(10_000, seed=2)
    async with open_server(echo) as server, open_fault_proxy(server.address, [FlipBit(4321, bit=6, direction="down")]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(payload)
        await stream.send_eof()
        data, outcome = await client_read_to_end(stream)
        await stream.aclose()
    assert bytes(server.peers[0].data) == payload  # the server got it intact
    assert data == flipped(payload, [(4321, 6)]) and outcome == "eof"
    assert [e.direction for e in proxy.fired(FlipBit)] == ["down"]


async def test_half_close_up_keeps_the_reply_direction_open():
    async def reply_after_eof(stream: trio.SocketStream, peer: Peer) -> None:
        await read_to_end(stream, peer)
        await stream.send_all(b"got:" + bytes(peer.data))

    payload = random_bytes(100, seed=4)
    async with open_server(reply_after_eof) as server, open_fault_proxy(server.address, [HalfClose(40)]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(payload)  # all 100 bytes; the server sees 40 then EOF
        with trio.fail_after(5):
            reply, outcome = await client_read_to_end(stream)
        await stream.aclose()
        record = await proxy.wait_closed(0)
    assert reply == b"got:" + payload[:40] and outcome == "eof"
    assert server.peers[0].outcome == "eof"
    assert record.up.bytes_out == 40 and record.up.bytes_discarded == 60
    assert record.outcome == "closed"
    (event,) = proxy.fired(HalfClose)
    assert (event.direction, event.offset) == ("up", 40)


async def test_half_close_down_keeps_the_request_direction_open():
    async with open_server(source(b"0123456789", then_read=True)) as server, open_fault_proxy(
        server.address, [HalfClose(4, direction="down")]
    ) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        with trio.fail_after(5):
            data, outcome = await client_read_to_end(stream)
        assert (data, outcome) == (b"0123", "eof")
        await stream.send_all(b"still here")  # the other way still works
        await stream.send_eof()
        peer = await server.peer(0)
        with trio.fail_after(5):
            await peer.ended.wait()
        await stream.aclose()
    assert (bytes(peer.data), peer.outcome) == (b"still here", "eof")


async def test_fault_on_one_connection_only():
    payload = bytes(range(64))
    fault = FlipBit(10, bit=0, connection=1)
    async with open_server(sink) as server, open_fault_proxy(server.address, [fault]) as proxy:
        for i in range(3):
            stream = await trio.open_tcp_stream(*proxy.address)
            await stream.send_all(payload)
            await stream.aclose()
            peer = await server.peer(i)
            with trio.fail_after(5):
                await peer.ended.wait()
    got = [bytes(p.data) for p in server.peers]
    assert got == [payload, flipped(payload, [(10, 0)]), payload]
    assert [e.connection for e in proxy.fired(fault)] == [1]


# ---------------------------------------------------------------------------
# Record faults
# ---------------------------------------------------------------------------


LEN_BODIES = [b"", b"hello", random_bytes(CHUNK + 50_000, seed=5), b"x" * 17, b"!"]


def len_stream(prefix: bytes, bodies: list[bytes]) -> tuple[bytes, list[bytes]]:
    records = [U32.pack(len(b)) + b for b in bodies]
    return prefix + b"".join(records), records


def edited(prefix: bytes, records: list[bytes], drop: int | None = None, dup: int | None = None) -> bytes:
    out = bytearray(prefix)
    for i, rec in enumerate(records):
        if i != drop:
            out += rec
        if i == dup:
            out += rec
    return bytes(out)


async def send_in_awkward_pieces(stream: trio.SocketStream, data: bytes) -> None:
    """Tiny pieces first (headers split across receives), then the rest at once."""
    for i in range(0, 60, 3):
        await stream.send_all(data[i:i + 3])
        await trio.sleep(0.001)
    await stream.send_all(data[60:])


@pytest.mark.parametrize("fault_type", [DropRecord, DuplicateRecord])
@pytest.mark.parametrize("index", [0, 2, 4])
async def test_len_records_up_after_the_16_byte_handshake(fault_type, index):
    prefix = random_bytes(16, seed=6)
    stream_bytes, records = len_stream(prefix, LEN_BODIES)
    fault = fault_type(index, framing="len")
    async with open_server(sink) as server, open_fault_proxy(server.address, [fault]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await send_in_awkward_pieces(stream, stream_bytes)
        await stream.send_eof()
        peer = await server.peer(0)
        with trio.fail_after(10):
            await peer.ended.wait()
        await stream.aclose()
        record = await proxy.wait_closed(0)
    want = edited(prefix, records, **({"drop": index} if fault_type is DropRecord else {"dup": index}))
    assert bytes(peer.data) == want
    (event,) = proxy.fired(fault)
    assert event.offset == len(prefix) + sum(len(r) for r in records[:index])
    assert record.up.records == len(records)


@pytest.mark.parametrize("fault_type", [DropRecord, DuplicateRecord])
async def test_len_records_down_after_the_8_byte_ack(fault_type):
    prefix = random_bytes(8, seed=7)
    stream_bytes, records = len_stream(prefix, LEN_BODIES)
    fault = fault_type(1, framing="len", direction="down")
    async with open_server(source(stream_bytes)) as server, open_fault_proxy(server.address, [fault]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        with trio.fail_after(10):
            data, outcome = await client_read_to_end(stream)
        await stream.aclose()
    want = edited(prefix, records, **({"drop": 1} if fault_type is DropRecord else {"dup": 1}))
    assert data == want and outcome == "eof"
    assert server.peers and len(proxy.fired(fault)) == 1


def mux_records(salt: SessionSalt) -> list[bytes]:
    frame = encode_mux_record(MuxKind.HOST_FRAME, random_bytes(70_000, seed=8), salt).tobytes()
    return [
        encode_control_record(Hello("h0", [0, 1]), salt),
        frame,
        encode_mux_record(MuxKind.DATA, b"", salt, rank=1).tobytes(),
        encode_mux_record(MuxKind.BROADCAST, b"tail", salt).tobytes(),
    ]


def split_mux(data: bytes, salt: SessionSalt) -> list[bytes]:
    """Independent parse of a MuxRecord stream, each record MAC-checked."""
    out = []
    pos = 0
    while pos < len(data):
        (length,) = U32.unpack_from(data, pos + MUX_LENGTH_FIELD)
        record = data[pos:pos + MUX_HEADER + length]
        decode_mux_record(record, salt)
        out.append(record)
        pos += MUX_HEADER + length
    return out


@pytest.mark.parametrize("fault_type", [DropRecord, DuplicateRecord])
@pytest.mark.parametrize("index", [0, 1, 2, 3])
async def test_mux_records_up_after_the_channel_magic(salt, fault_type, index):
    records = mux_records(salt)
    magic = CHANNEL_MAGIC_DATA.to_bytes(4, "little")
    fault = fault_type(index, framing="mux")
    async with open_server(sink) as server, open_fault_proxy(server.address, [fault]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await send_in_awkward_pieces(stream, magic + b"".join(records))
        await stream.send_eof()
        peer = await server.peer(0)
        with trio.fail_after(10):
            await peer.ended.wait()
        await stream.aclose()
    got = bytes(peer.data)
    assert got[:4] == magic
    want = [r for i, r in enumerate(records) if not (fault_type is DropRecord and i == index)]
    if fault_type is DuplicateRecord:
        want.insert(index, records[index])
    assert split_mux(got[4:], salt) == want
    (event,) = proxy.fired(fault)
    assert event.offset == 4 + sum(len(r) for r in records[:index])


async def test_mux_records_down_start_at_offset_zero(salt):
    records = mux_records(salt)
    fault = DuplicateRecord(3, framing="mux", direction="down")
    async with open_server(source(b"".join(records))) as server, open_fault_proxy(server.address, [fault]) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        with trio.fail_after(10):
            data, outcome = await client_read_to_end(stream)
        await stream.aclose()
    assert split_mux(data, salt) == [*records, records[3]] and outcome == "eof"


@settings(max_examples=200, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=40), max_size=6),
    skip=st.integers(0, 20),
    cuts=st.lists(st.integers(1, 400), max_size=30),
    drop=st.one_of(st.none(), st.integers(0, 6)),
    dup=st.one_of(st.none(), st.integers(0, 6)),
)
def test_record_editor_is_independent_of_how_bytes_arrive(bodies, skip, cuts, drop, dup):
    """However the stream is split into receives, the edited output is the same."""
    if drop is not None and drop == dup:
        dup = None
    prefix = bytes(range(skip))
    data, records = len_stream(prefix, bodies)
    actions = {}
    if drop is not None:
        actions[drop] = DropRecord(drop)
    if dup is not None:
        actions[dup] = DuplicateRecord(dup)
    fired: list[int] = []
    editor = _RecordEditor(_Layout("len", skip), actions, lambda fault, offset, detail: fired.append(offset))
    out = bytearray()
    view = memoryview(data)
    points = sorted({c for c in cuts if c < len(data)})
    start = 0
    for point in [*points, len(data)]:
        for piece in editor.feed(view[start:point]):
            out += piece
        start = point
    assert bytes(out) == edited(prefix, records, drop=drop, dup=dup)
    assert editor.index == len(records)
    starts = [len(prefix) + sum(len(r) for r in records[:i]) for i in range(len(records))]
    assert sorted(fired) == sorted(starts[i] for i in actions if i < len(records))


# ---------------------------------------------------------------------------
# Through a real cluster
# ---------------------------------------------------------------------------


N = 8


def rank_values(rank: int, round_index: int) -> np.ndarray:
    return (np.arange(N, dtype=np.float32) * (rank + 1) + 10 * round_index + rank).astype("<f4")


def frame_of(values: np.ndarray) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, (N,), values)], weight=1.0)


def consensus(hosts: list[list[np.ndarray]]) -> np.ndarray:
    """Independent reference: f32 fold per host, f32 sum of hosts, times f32(1 / mass)."""
    host_sums = []
    for values in hosts:
        acc = values[0].astype(np.float32).copy()
        for v in values[1:]:
            acc = (acc + v).astype(np.float32)
        host_sums.append(acc)
    total = host_sums[0]
    for s in host_sums[1:]:
        total = (total + s).astype(np.float32)
    mass = sum(len(v) for v in hosts)
    return (total * np.float32(1.0 / mass)).astype(np.float32)


def as_array(reply: RoundFrame) -> np.ndarray:
    return np.frombuffer(reply.tensors[0].data, dtype="<f4").copy()


# Bytes of one rank frame / HostFrame payload carrying one f32[N] tensor.
FRAME_LEN = frame_len(N)


async def test_cluster_all_reduce_through_a_clean_proxy(salt):
    world, hosts, rounds = 4, [[0, 1], [2, 3]], 3
    results: dict[tuple[int, int], np.ndarray] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        async with open_fault_proxy(cluster.relay_address(0)) as proxy:
            async def rank_main(rank: int) -> None:
                address = proxy.address if rank in (0, 1) else cluster.relay_address(rank)
                async with connect_reduce_client(address, rank, world, salt) as client:
                    for k in range(rounds):
                        results[k, rank] = as_array(await client.all_reduce(frame_of(rank_values(rank, k))))

            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
            for i in range(2):
                record = await proxy.wait_closed(i)
                assert record.outcome == "closed"
                assert record.up.bytes_out == rank_leg_bytes(rounds, N, direction="up")
                assert record.down.bytes_out == rank_leg_bytes(rounds, N, direction="down")
        await cluster.controller.wait_finished()
    for k in range(rounds):
        want = consensus([[rank_values(r, k) for r in h] for h in hosts])
        for rank in range(world):
            np.testing.assert_array_equal(results[k, rank], want, err_msg=f"round {k} rank {rank}")


async def test_flipped_bit_in_rank_frame_drops_only_that_rank(salt, caplog):
    """A bit flipped in rank 0's payload: the relay's MAC check drops rank 0; the
    survivors (rank 1 on the same host, host 1) average without it."""
    caplog.set_level(logging.WARNING, logger="flodl_trio.relay")
    world, hosts = 4, [[0, 1], [2, 3]]
    # the second byte of element 3 of rank 0's first payload
    flip = FlipBit(rank_frame_start(0, N) + FRAME_PAYLOAD + 4 * 3 + 1, bit=5)
    results: dict[tuple[int, int], np.ndarray] = {}
    errors: dict[int, BaseException] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        async with open_fault_proxy(cluster.relay_address(0), [flip]) as proxy:
            async def rank_main(rank: int, client: ReduceClient) -> None:
                if rank == 0:  # the victim, behind the proxy
                    with pytest.raises(FlodlError) as info:
                        await client.all_reduce(frame_of(rank_values(0, 0)))
                    errors[0] = info.value
                    return
                for k in range(2):
                    results[k, rank] = as_array(await client.all_reduce(frame_of(rank_values(rank, k))))

            await cluster.run_ranks(rank_main, addresses={0: proxy.address})
            (event,) = proxy.fired(flip)
            assert event.direction == "up"
        await cluster.controller.wait_finished()
        assert cluster.controller.dead_ranks.snapshot() >= {0}
    assert isinstance(errors[0], RankDeadError), errors
    assert any("rank 0 dropped" in r.getMessage() and "MAC mismatch" in r.getMessage() for r in caplog.records)
    for k in range(2):
        want = consensus([[rank_values(1, k)], [rank_values(2, k), rank_values(3, k)]])
        for rank in (1, 2, 3):
            np.testing.assert_array_equal(results[k, rank], want, err_msg=f"round {k} rank {rank}")


async def test_flipped_bit_in_consensus_is_caught_by_the_rank(salt):
    """Relay -> rank 0: one bit of the consensus payload flipped. Rank 0 refuses it
    (MAC); rank 1 got the true consensus, then carries on alone once rank 0 left."""
    flip = FlipBit(consensus_frame_start(0, N) + FRAME_PAYLOAD + 5, bit=1, direction="down")
    results: dict[tuple[int, int], np.ndarray] = {}
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        async with open_fault_proxy(cluster.relay_address(0), [flip]) as proxy:
            async def victim() -> None:
                async with connect_reduce_client(proxy.address, 0, 2, salt) as client:
                    with pytest.raises(MacError, match="consensus"):
                        await client.all_reduce(frame_of(rank_values(0, 0)))

            async def survivor() -> None:
                async with connect_reduce_client(cluster.relay_address(1), 1, 2, salt) as client:
                    for k in range(2):
                        results[k, 1] = as_array(await client.all_reduce(frame_of(rank_values(1, k))))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim)
                nursery.start_soon(survivor)
            assert len(proxy.fired(flip)) == 1
    np.testing.assert_array_equal(results[0, 1], consensus([[rank_values(0, 0), rank_values(1, 0)]]))
    np.testing.assert_array_equal(results[1, 1], consensus([[rank_values(1, 1)]]))


async def test_duplicated_rank_frame_is_a_desync_that_costs_only_that_rank(salt, caplog):
    """Rank 0's first frame delivered twice ("len" framing after the 16-byte handshake).

    Rank 1 holds its frame back until rank 0 has been dropped, so the copy lands
    while rank 0 is still waiting for its first consensus. Rank 0 raises; rank 1's
    round completes with rank 0's first (folded) frame and its own.
    """
    caplog.set_level(logging.WARNING, logger="flodl_trio.relay")
    dup = DuplicateRecord(0, framing="len")
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        async with open_fault_proxy(cluster.relay_address(0), [dup]) as proxy:
            dropped = trio.Event()

            async def victim() -> None:
                async with connect_reduce_client(proxy.address, 0, 2, salt) as client:
                    with pytest.raises(RankDeadError):
                        await client.all_reduce(frame_of(rank_values(0, 0)))
                dropped.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim)
                async with connect_reduce_client(cluster.relay_address(1), 1, 2, salt) as honest:
                    await dropped.wait()
                    result = as_array(await honest.all_reduce(frame_of(rank_values(1, 0))))
            (event,) = proxy.fired(dup)
            assert event.offset == rank_leg_bytes(0, N)  # the first record after the handshake
    np.testing.assert_array_equal(result, consensus([[rank_values(0, 0), rank_values(1, 0)]]))
    assert any("rank 0 dropped" in r.getMessage() and "deposited twice" in r.getMessage() for r in caplog.records)


async def test_cut_mid_host_frame_kills_that_host_only(salt):
    """Relay host0 -> controller is cut half-way through its second HostFrame:
    the controller marks ranks 0 and 1 dead; host1 carries on alone."""
    world, rounds = 4, 3
    # half-way through the payload of host0's second HostFrame record
    cut_at = uplink_host_frame_start("host0", [0, 1], 1, N) + MUX_HEADER + FRAME_LEN // 2
    results: dict[tuple[int, int], np.ndarray] = {}
    errors: dict[int, BaseException] = {}
    async with open_controller(LOOP, 0, world_size=world, salt=salt) as ctl:
        async with open_fault_proxy((LOOP, ctl.port), [CutAt(cut_at)]) as proxy:
            relay0 = open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=proxy.address, host_name="host0",
                                ranks=[0, 1], world_size=world, salt=salt)
            relay1 = open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name="host1",
                                ranks=[2, 3], world_size=world, salt=salt)
            # Each relay in a task of its own, as on its own host: host0's failure cancels only it.
            async with trio.open_nursery() as hosts:
                h0 = await hosts.start(hold_open, relay0)
                h1 = await hosts.start(hold_open, relay1)
                async def cut_rank(rank: int) -> None:
                    async with connect_reduce_client((LOOP, h0.port), rank, world, salt) as client:
                        results[0, rank] = as_array(await client.all_reduce(frame_of(rank_values(rank, 0))))
                        with pytest.raises(RankDeadError) as info:
                            await client.all_reduce(frame_of(rank_values(rank, 1)))
                        errors[rank] = info.value

                async def live_rank(rank: int) -> None:
                    async with connect_reduce_client((LOOP, h1.port), rank, world, salt) as client:
                        for k in range(rounds):
                            results[k, rank] = as_array(await client.all_reduce(frame_of(rank_values(rank, k))))

                async with trio.open_nursery() as nursery:
                    for rank in (0, 1):
                        nursery.start_soon(cut_rank, rank)
                    for rank in (2, 3):
                        nursery.start_soon(live_rank, rank)
                with pytest.raises(FlodlError):
                    await h0.wait_finished()
                hosts.cancel_scope.cancel()
            record = await proxy.wait_closed(0)
            assert record.outcome == "cut" and record.up.bytes_out == cut_at
            (event,) = proxy.fired(CutAt)
            assert event.offset == cut_at
        await ctl.wait_finished()
        assert ctl.dead_ranks.snapshot() == {0, 1, 2, 3}
        assert ctl.stats.rounds == rounds
    assert set(errors) == {0, 1}
    want0 = consensus([[rank_values(0, 0), rank_values(1, 0)], [rank_values(2, 0), rank_values(3, 0)]])
    for rank in range(4):
        np.testing.assert_array_equal(results[0, rank], want0, err_msg=f"round 0 rank {rank}")
    for k in (1, 2):
        want = consensus([[rank_values(2, k), rank_values(3, k)]])
        for rank in (2, 3):
            np.testing.assert_array_equal(results[k, rank], want, err_msg=f"round {k} rank {rank}")


async def test_duplicated_host_frame_costs_only_that_relay(salt, caplog):
    """Relay -> controller, "mux" framing after the 4-byte magic: record 0 is the
    Hello, record 1 the first HostFrame, delivered twice in one round. The
    controller drops relay host0 (its ranks are dead and raise) and keeps serving."""
    caplog.set_level(logging.WARNING, logger="flodl_trio.controller")
    dup = DuplicateRecord(1, framing="mux")
    async with open_controller(LOOP, 0, world_size=4, salt=salt) as ctl:
        async with open_fault_proxy((LOOP, ctl.port), [dup]) as proxy:
            async with open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=proxy.address, host_name="host0",
                                  ranks=[0, 1], world_size=4, salt=salt) as relay:
                async def rank_main(rank: int) -> None:
                    async with connect_reduce_client((LOOP, relay.port), rank, 4, salt) as client:
                        with pytest.raises(RankDeadError):
                            await client.all_reduce(frame_of(rank_values(rank, 0)))

                # Ranks 2 and 3 never join, so the round cannot complete before the copy lands.
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(rank_main, 0)
                    nursery.start_soon(rank_main, 1)
            (event,) = proxy.fired(dup)
            assert event.offset == uplink_first_record("host0", [0, 1])
        assert ctl.dead_ranks.snapshot() == {0, 1}
        assert ctl.stats.relays_dropped == 1
    dropped = [r.getMessage() for r in caplog.records if "dropped for breaking the protocol" in r.getMessage()]
    assert len(dropped) == 1 and "relay host0" in dropped[0] and "HostFrame before the consensus of its previous one" in dropped[0]


async def test_slow_and_stalling_controller_leg_changes_nothing_but_time(salt):
    """Latency, a thin pipe and a 0.3 s stall inside a HostFrame on relay host0 ->
    controller: every round still completes with the exact consensus."""
    world, hosts, rounds = 4, [[0, 1], [2, 3]], 3
    stall = Stall(uplink_first_record("host0", [0, 1]) + MUX_HEADER + 10, seconds=0.3)  # inside the first HostFrame
    faults = [Delay(0.02, direction="both"), BandwidthCap(50_000, direction="both"), stall]
    results: dict[tuple[int, int], np.ndarray] = {}
    async with open_controller(LOOP, 0, world_size=world, salt=salt) as ctl:
        async with open_fault_proxy((LOOP, ctl.port), faults) as proxy:
            relay0 = open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=proxy.address, host_name="host0",
                                ranks=[0, 1], world_size=world, salt=salt)
            relay1 = open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name="host1",
                                ranks=[2, 3], world_size=world, salt=salt)
            async with relay0 as h0, relay1 as h1:
                async def rank_main(rank: int) -> None:
                    port = h0.port if rank < 2 else h1.port
                    async with connect_reduce_client((LOOP, port), rank, world, salt) as client:
                        for k in range(rounds):
                            results[k, rank] = as_array(await client.all_reduce(frame_of(rank_values(rank, k))))

                start = trio.current_time()
                async with trio.open_nursery() as nursery:
                    for rank in range(world):
                        nursery.start_soon(rank_main, rank)
                assert trio.current_time() - start >= 0.3
            (event,) = proxy.fired(stall)
            assert (event.direction, event.offset) == ("up", stall.at_byte)
        await ctl.wait_finished()
    for k in range(rounds):
        want = consensus([[rank_values(r, k) for r in h] for h in hosts])
        for rank in range(world):
            np.testing.assert_array_equal(results[k, rank], want, err_msg=f"round {k} rank {rank}")


@pytest.mark.parametrize(
    ("at_byte", "pause"),
    [(consensus_frame_start(0, N) + FRAME_LEN // 2, 0.0), (rank_leg_bytes(0, direction="down"), 0.0),
     (rank_leg_bytes(0, direction="down"), 0.2)],
    ids=["mid-consensus", "right-after-ack", "before-send"],
)
async def test_reset_on_rank_leg_is_a_flodl_error_and_survivors_continue(salt, at_byte, pause):
    """The rank's loopback connection is reset (relay -> rank direction cut): the
    rank's pending call must fail with RankDeadError (its relay went away), not
    a raw socket error, and the relay drops it so the survivors average without it."""
    world, hosts = 4, [[0, 1], [2, 3]]
    results: dict[tuple[int, int], np.ndarray] = {}
    errors: dict[int, BaseException] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        async with open_fault_proxy(cluster.relay_address(0), [CutAt(at_byte, direction="down")]) as proxy:
            async def rank_main(rank: int, client: ReduceClient) -> None:
                if rank == 0:  # the victim, behind the proxy
                    await trio.sleep(pause)  # > 0: the reset is already there when the frame is sent
                    try:
                        results[0, 0] = as_array(await client.all_reduce(frame_of(rank_values(0, 0))))
                    except Exception as exc:  # judged below, outside the nursery
                        errors[0] = exc
                    return
                for k in range(2):
                    results[k, rank] = as_array(await client.all_reduce(frame_of(rank_values(rank, k))))

            await cluster.run_ranks(rank_main, addresses={0: proxy.address})
            assert (await proxy.wait_closed(0)).outcome == "cut"
    # Round 1 never includes rank 0 (round 0 does only if its frame got in before the cut).
    want1 = consensus([[rank_values(1, 1)], [rank_values(2, 1), rank_values(3, 1)]])
    for rank in (1, 2, 3):
        np.testing.assert_array_equal(results[1, rank], want1, err_msg=f"round 1 rank {rank}")
    assert (0, 0) not in results and 0 in errors
    assert isinstance(errors[0], RankDeadError), f"rank 0 got {type(errors[0]).__name__}: {errors[0]}"
