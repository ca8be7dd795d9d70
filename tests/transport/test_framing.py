"""Length framing and MuxRecord framing over real and in-memory trio streams
(PROTOCOL.md 2.3 and 3.2): clean EOF vs mid-frame EOF, the ceiling refused
before buffering, prefix/body drift in both directions, starvation and write
stall bounds.
"""

from __future__ import annotations

import socket as pysocket
import struct

import numpy as np
import pytest
import trio
import trio.testing

from flodl_trio import transport as stream_mod
from flodl_trio.errors import (
    ConnectFailed,
    FlodlError,
    FramingError,
    MacError,
    PeerClosedMidFrame,
    PeerTimeout,
)
from flodl_trio.transport import MessageStream, ReceiveBuffer
from flodl_trio.transport.settings import NetBounds
from flodl_trio.transport.stream import RECEIVE_LOW_WATER
from flodl_trio.wire import (
    DTYPE_BF16,
    DTYPE_F32,
    HelloAck,
    MuxKind,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    decode_round_frame,
    encode_control_record,
    encode_mux_record,
    encode_round_frame,
    encode_round_frame_chunks,
)

MID_FRAME_STARVATION_S = NetBounds().mid_frame_starvation
SALT = SessionSalt(b"\x42" * 16)
OTHER_SALT = SessionSalt(b"\x17" * 16)


class TrickleStream(trio.abc.Stream):
    """Wraps a stream so every receive_some returns at most one byte."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(1)

    async def send_all(self, data):
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self):
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self):
        await self.inner.send_eof()

    async def aclose(self):
        await self.inner.aclose()


TRANSPORTS = ["memory", "socket", "trickle"]


def open_pair(kind: str) -> tuple[trio.abc.Stream, trio.abc.Stream]:
    """(writer, reader) connected streams of the given kind."""
    if kind == "socket":
        s1, s2 = trio.socket.socketpair()
        return trio.SocketStream(s1), trio.SocketStream(s2)
    a, b = trio.testing.memory_stream_pair()
    return a, (TrickleStream(b) if kind == "trickle" else b)


def rf(values, weight=1.0, kind=RoundKind.MODEL) -> RoundFrame:
    arr = np.asarray(values, "<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, arr.shape, arr)], kind, weight)


def lf(body: bytes, prefix: int | None = None) -> bytes:
    return struct.pack("<I", len(body) if prefix is None else prefix) + body


# -- clean EOF vs mid-frame EOF -------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_clean_eof_before_first_byte_is_none(transport):
    writer, reader = open_pair(transport)
    await writer.send_eof()
    ms = MessageStream(reader)
    assert await ms.receive_len_framed(ReceiveBuffer()) is None


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_clean_eof_after_whole_messages_is_none(transport):
    writer, reader = open_pair(transport)
    one, two = encode_round_frame(rf([1.0, 2.0]), SALT), encode_round_frame(rf([3.0], 0.5), SALT)
    await writer.send_all(lf(one) + lf(two))
    await writer.send_eof()
    ms, buf = MessageStream(reader), ReceiveBuffer()
    assert bytes(await ms.receive_len_framed(buf)) == one
    assert bytes(await ms.receive_len_framed(buf)) == two
    assert await ms.receive_len_framed(buf) is None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, 20, 50])
async def test_eof_after_first_byte_is_mid_frame(transport, cut):
    body = encode_round_frame(rf([1.0, 2.0]), SALT)
    wire = lf(body)
    assert cut < len(wire)
    writer, reader = open_pair(transport)
    await writer.send_all(wire[:cut])
    await writer.send_eof()
    ms = MessageStream(reader, peer="rank 3")
    with pytest.raises(PeerClosedMidFrame, match="mid-frame") as info:
        await ms.receive_len_framed(ReceiveBuffer())
    assert "rank 3" in str(info.value)
    assert isinstance(info.value, FramingError)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cut", [1, 17, 24, 25, 30])
async def test_mux_eof_mid_record_is_mid_frame(transport, cut):
    wire = encode_mux_record(MuxKind.DATA, b"0123456789", SALT, rank=2).tobytes()
    writer, reader = open_pair(transport)
    await writer.send_all(wire[:cut])
    await writer.send_eof()
    ms = MessageStream(reader)
    with pytest.raises(PeerClosedMidFrame, match="mid-frame"):
        header = await ms.receive_mux_header()
        assert header is not None
        await ms.receive_mux_payload(header, ReceiveBuffer(), SALT)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mux_clean_eof_before_header_is_none(transport):
    writer, reader = open_pair(transport)
    await writer.send_all(encode_control_record(HelloAck(), SALT))
    await writer.send_eof()
    ms = MessageStream(reader)
    header = await ms.receive_mux_header()
    kind, payload = await ms.receive_mux_payload(header, ReceiveBuffer(), SALT)
    assert (kind, bytes(payload)) == (MuxKind.CONTROL, b"\x01")
    assert await ms.receive_mux_header() is None


async def test_receive_exactly_eof_is_mid_frame():
    writer, reader = open_pair("memory")
    await writer.send_all(b"abc")
    await writer.send_eof()
    with pytest.raises(PeerClosedMidFrame, match="mid-frame"):
        await MessageStream(reader).receive_exactly(8, "a handshake")


async def test_receive_exactly_eof_before_any_byte_is_also_an_error():
    writer, reader = open_pair("memory")
    await writer.send_eof()
    with pytest.raises(PeerClosedMidFrame):
        await MessageStream(reader).receive_exactly(16, "a handshake")


# -- ceiling ---------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_prefix_above_ceiling_refused_without_waiting_for_body(transport):
    """Only the prefix is sent and the stream stays open: the refusal cannot depend on the body."""
    writer, reader = open_pair(transport)
    await writer.send_all(struct.pack("<I", 1001))
    ms, buf = MessageStream(reader), ReceiveBuffer()
    with trio.fail_after(5):
        with pytest.raises(FramingError, match="ceiling") as info:
            await ms.receive_len_framed(buf, ceiling=1000)
    assert not isinstance(info.value, PeerClosedMidFrame)
    assert "1001" in str(info.value) and "1000" in str(info.value)
    assert buf.capacity == 0


async def test_prefix_equal_to_ceiling_is_accepted():
    writer, reader = open_pair("memory")
    await writer.send_all(lf(b"x" * 1000))
    ms = MessageStream(reader)
    assert bytes(await ms.receive_len_framed(ReceiveBuffer(), ceiling=1000)) == b"x" * 1000


async def test_prefix_max_u32_refused_with_default_ceiling():
    writer, reader = open_pair("memory")
    await writer.send_all(struct.pack("<I", 2**32 - 1))
    with pytest.raises(FramingError, match="refused before buffering"):
        await MessageStream(reader).receive_len_framed(ReceiveBuffer())


async def test_mux_length_above_ceiling_refused_before_payload():
    rec = encode_mux_record(MuxKind.HOST_FRAME, b"p" * 100, SALT).tobytes()
    writer, reader = open_pair("memory")
    await writer.send_all(rec[:25])  # header only, stream left open
    with trio.fail_after(5):
        with pytest.raises(FramingError, match="ceiling"):
            await MessageStream(reader).receive_mux_header(ceiling=99)


async def test_zero_length_message():
    writer, reader = open_pair("memory")
    await writer.send_all(lf(b"") + lf(b"z"))
    ms, buf = MessageStream(reader), ReceiveBuffer()
    assert bytes(await ms.receive_len_framed(buf)) == b""
    assert bytes(await ms.receive_len_framed(buf)) == b"z"


# -- prefix / body drift (seed test framed_round_rejects_prefix_body_drift) -----------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_framed_round_rejects_prefix_body_drift(transport):
    frame = encode_round_frame(rf([1.0, 2.0], 1.0, RoundKind.MODEL), SALT)
    follow = encode_round_frame(rf([5.0, 6.0, 7.0], 3.0), SALT)

    # Prefix 10 bytes longer than the frame, 10 zero bytes of padding after it.
    writer, reader = open_pair(transport)
    await writer.send_all(lf(frame + bytes(10), prefix=len(frame) + 10) + lf(follow))
    ms, buf = MessageStream(reader), ReceiveBuffer()
    body = await ms.receive_len_framed(buf)
    assert len(body) == len(frame) + 10
    with pytest.raises(FramingError, match="fewer than its length prefix") as info:
        decode_round_frame(body, SALT)
    assert "desynced" in str(info.value)
    # The reader consumed exactly the declared budget: the next message is intact.
    assert decode_round_frame(await ms.receive_len_framed(buf), SALT) == rf([5.0, 6.0, 7.0], 3.0)

    # Prefix 10 bytes shorter than the frame, full frame sent.
    writer, reader = open_pair(transport)
    await writer.send_all(lf(frame, prefix=len(frame) - 10) + lf(follow))
    ms, buf = MessageStream(reader), ReceiveBuffer()
    body = await ms.receive_len_framed(buf)
    assert bytes(body) == frame[:-10]
    with pytest.raises(FramingError, match="ended inside"):
        decode_round_frame(body, SALT)
    # Never took bytes beyond the declared length: the frame's last 10 bytes and the
    # following message are still on the stream, untouched.
    assert await ms.receive_exactly(10, "the rest") == frame[-10:]
    assert decode_round_frame(await ms.receive_len_framed(buf), SALT) == rf([5.0, 6.0, 7.0], 3.0)


@pytest.mark.parametrize("short_by", [1, 8, 9, 20, 46])
def test_short_prefix_ended_inside_names_the_part(short_by):
    frame = encode_round_frame(rf([1.0, 2.0]), SALT)
    with pytest.raises(FramingError, match="RoundFrame from rank 5 on host h1 ended inside"):
        decode_round_frame(frame[:-short_by], SALT, source="rank 5 on host h1")


@pytest.mark.parametrize("extra", [1, 7, 8, 100])
def test_long_prefix_fewer_than_declared(extra):
    frame = encode_round_frame(rf([1.0, 2.0]), SALT)
    with pytest.raises(FramingError, match="fewer than its length prefix"):
        decode_round_frame(frame + b"\x00" * extra, SALT)


# -- reuse, reassembly, big messages ----------------------------------------------------


@pytest.mark.parametrize("transport", ["memory", "socket"])
async def test_large_frame_reassembles_and_buffer_is_reused(transport):
    rng = np.random.default_rng(3)
    big = rng.standard_normal(300_000).astype("<f4")  # 1.2 MB payload (> SMALL_CHUNK, spans pieces)
    frame = RoundFrame(
        [TensorPayload(DTYPE_F32, (300_000,), big), TensorPayload(DTYPE_BF16, (3,), np.array([1, 2, 3], "<u2"))],
        RoundKind.MODEL,
        4.0,
    )
    enc = encode_round_frame_chunks(frame, SALT)
    small = encode_round_frame(rf([9.0]), SALT)
    writer, reader = open_pair(transport)
    sender, receiver = MessageStream(writer), MessageStream(reader)
    buf = ReceiveBuffer()
    got = []

    async def read():
        got.append(decode_round_frame(bytes(await receiver.receive_len_framed(buf)), SALT))
        cap = buf.capacity
        got.append(decode_round_frame(bytes(await receiver.receive_len_framed(buf)), SALT))
        assert buf.capacity == cap  # a smaller message reuses the buffer
        got.append(await receiver.receive_len_framed(buf))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await sender.send_len_framed(enc.chunks, enc.nbytes)
        await sender.send_len_framed([small], len(small))
        await writer.send_eof()
    assert got[0] == frame
    assert got[1] == rf([9.0])
    assert got[2] is None
    assert sender.bytes_sent == receiver.bytes_received == 8 + enc.nbytes + len(small)


async def test_mux_records_back_to_back_with_bad_mac_and_unknown_kind():
    good = encode_mux_record(MuxKind.BROADCAST, b"payload", SALT).tobytes()
    bad_mac = encode_mux_record(MuxKind.BROADCAST, b"payload", OTHER_SALT).tobytes()
    writer, reader = open_pair("memory")
    await writer.send_all(good + bad_mac)
    ms, buf = MessageStream(reader, peer="relay h1"), ReceiveBuffer()
    kind, payload = await ms.receive_mux_payload(await ms.receive_mux_header(), buf, SALT)
    assert (kind, bytes(payload)) == (MuxKind.BROADCAST, b"payload")
    with pytest.raises(MacError, match="relay h1"):
        await ms.receive_mux_payload(await ms.receive_mux_header(), buf, SALT)


# -- starvation and write stall (virtual time) ---------------------------------------------


@pytest.mark.deadline(MID_FRAME_STARVATION_S * 3)
async def test_mid_frame_starvation_times_out(autojump_clock):
    writer, reader = open_pair("memory")
    await writer.send_all(lf(b"0123456789")[:7])  # prefix + 3 bytes, then silence
    ms = MessageStream(reader, peer="rank 5")
    start = trio.current_time()
    with pytest.raises(PeerTimeout, match="no progress") as info:
        await ms.receive_len_framed(ReceiveBuffer())
    assert trio.current_time() - start == pytest.approx(MID_FRAME_STARVATION_S)
    assert "rank 5" in str(info.value)
    assert not isinstance(info.value, FramingError)


@pytest.mark.deadline(10_000)
async def test_slow_trickle_with_progress_is_not_starvation(autojump_clock):
    """A trickle that keeps making progress is slow, not starved."""
    writer, reader = open_pair("memory")
    wire = lf(b"x" * 6)
    ms = MessageStream(reader)
    result = []

    async def read():
        result.append(bytes(await ms.receive_len_framed(ReceiveBuffer())))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for i in range(len(wire)):
            await trio.sleep(MID_FRAME_STARVATION_S * 0.9)
            await writer.send_all(wire[i : i + 1])
    assert result == [b"x" * 6]


@pytest.mark.deadline(10_000)
async def test_waiting_for_first_byte_has_no_bound(autojump_clock):
    writer, reader = open_pair("memory")
    ms = MessageStream(reader)
    with trio.move_on_after(MID_FRAME_STARVATION_S * 50) as scope:
        await ms.receive_len_framed(ReceiveBuffer())
    assert scope.cancelled_caught


@pytest.mark.deadline(1_000)
async def test_write_stall_times_out(autojump_clock, monkeypatch):
    monkeypatch.delenv("FLODL_NET_TIMEOUT_SCALE", raising=False)
    writer, _reader = trio.testing.lockstep_stream_pair()  # nobody ever reads
    ms = MessageStream(writer, peer="controller")
    start = trio.current_time()
    with pytest.raises(PeerTimeout, match="write stalled"):
        await ms.send_len_framed([b"hello"], 5)
    assert trio.current_time() - start == pytest.approx(30.0)


async def test_cancelled_send_is_never_half_written():
    """Sends are shielded: cancelling the sender mid-write still delivers the whole message."""
    writer, reader = trio.testing.lockstep_stream_pair()
    sender, receiver = MessageStream(writer), MessageStream(reader)
    body = encode_round_frame(rf(np.arange(100_000, dtype="<f4")), SALT)
    got = []

    async with trio.open_nursery() as nursery:

        async def send():
            with trio.CancelScope() as scope:
                scope.cancel()  # already cancelled before the write starts
                await sender.send_len_framed([body], len(body))

        async def read():
            got.append(bytes(await receiver.receive_len_framed(ReceiveBuffer())))

        nursery.start_soon(send)
        nursery.start_soon(read)
    assert got == [body]


def test_framing_errors_are_flodl_errors():
    for exc in (FramingError, PeerClosedMidFrame, MacError, PeerTimeout):
        assert issubclass(exc, FlodlError)
    assert issubclass(PeerClosedMidFrame, FramingError)


# -- connecting and buffer pools -------------------------------------------------------------


async def test_connect_with_retry_gives_up_with_connect_failed():
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there any more
    with pytest.raises(ConnectFailed, match=r"after 2 attempts") as info:
        await stream_mod.connect_with_retry("127.0.0.1", port, "relay upstream", NetBounds(connect_attempts=2, connect_interval=0.01))
    assert isinstance(info.value, FlodlError)
    assert f"127.0.0.1:{port}" in str(info.value)


async def test_connect_with_retry_connects_and_tunes(caplog):
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted = []

        async def accept():
            accepted.append(await listeners[0].accept())

        nursery.start_soon(accept)
        stream = await stream_mod.connect_with_retry("127.0.0.1", port, "rank 0", NetBounds(connect_attempts=3, connect_interval=0.01))
    assert stream.getsockopt(pysocket.IPPROTO_TCP, pysocket.TCP_NODELAY)
    assert stream.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_KEEPALIVE)
    assert stream_mod.peer_host(stream) == "127.0.0.1"
    assert not [r for r in caplog.records if "NOT encrypted" in r.getMessage()]
    ms = MessageStream(stream)
    await ms.send_len_framed([b"ping"], 4)
    got = await MessageStream(accepted[0]).receive_len_framed(ReceiveBuffer())
    assert bytes(got) == b"ping"
    await stream.aclose()
    await accepted[0].aclose()
    await listeners[0].aclose()


async def test_buffer_pool_bounds_concurrent_buffers():
    pool = stream_mod.BufferPool(1)
    first = await pool.acquire()
    with trio.move_on_after(0.05) as scope:
        await pool.acquire()
    assert scope.cancelled_caught  # the second reader waits
    pool.release(first)
    assert await pool.acquire() is first


async def test_buffer_pool_grows_only_up_to_its_limit():
    pool = stream_mod.BufferPool(1, limit=2)
    first = await pool.acquire()
    second = stream_mod.ReceiveBuffer(1000)  # sized up front: a size already proven
    assert second.capacity == 1000
    pool.add(second)
    assert await pool.acquire() is second
    with pytest.raises(RuntimeError, match="limit of 2"):
        pool.add(stream_mod.ReceiveBuffer())
    pool.release(first)
    pool.release(second)
    assert {id(await pool.acquire()), id(await pool.acquire())} == {id(first), id(second)}


async def test_a_large_message_trickling_in_is_read_in_few_large_reads():
    """4 MiB sent as 256 pieces of 16 KiB, a pause after each: without a receive
    low-water mark the reader wakes for nearly every piece; with it, a read waits
    for 256 KiB (and a read attempted right after may take a small rest)."""

    class CountingWatch(stream_mod.ArrivalWatch):
        reads = 0

        def advance(self, filled: int) -> None:
            self.reads += 1
            super().advance(filled)

    size, piece = 4 << 20, 16 << 10
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    sender = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
    receiver = await listeners[0].accept()
    conn = stream_mod.MessageStream(receiver, "sender")
    watch = CountingWatch(size)
    payload = bytes(range(256)) * (size // 256)

    async def trickle() -> None:
        for i in range(0, size, piece):
            await sender.send_all(payload[i:i + piece])
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        body = await conn.receive_into_buffer(stream_mod.ReceiveBuffer(), size, "a trickled message", watch=watch)
    assert bytes(body) == payload
    assert watch.reads <= 2 * size // RECEIVE_LOW_WATER + 40, watch.reads
    for s in (sender, receiver, listeners[0]):
        await s.aclose()
