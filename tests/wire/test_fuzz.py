"""Fuzzing every wire decoder: only FlodlError subclasses may escape, MACs catch
every flipped bit, and nothing allocates ahead of the bytes that actually arrived.

Decoders are fed arbitrary bytes and mutated valid encodings (bit flips,
truncation, extension, random splices, overwrites). Any exception that is not
a :class:`flodl_trio.errors.FlodlError` (struct.error, IndexError, ValueError,
UnicodeDecodeError, MemoryError, OverflowError, ...) fails the test.
"""

from __future__ import annotations

import math
import struct
import tracemalloc

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_trio.errors import FlodlError, FramingError, MacError, PeerClosedMidFrame
from flodl_trio.testing.matrix.offsets import MUX_HEADER, MUX_LENGTH_FIELD
from flodl_trio.transport import MessageStream, ReceiveBuffer
from flodl_trio.wire import (
    DEFAULT_FRAME_CEILING,
    DTYPE_BF16,
    DTYPE_F32,
    ControlFrame,
    DeclareDead,
    Hello,
    HelloAck,
    MuxKind,
    RankExit,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    decode_control_ack,
    decode_control_frame,
    decode_control_handshake,
    decode_control_msg,
    decode_data_ack,
    decode_data_handshake,
    decode_mux_record,
    decode_round_frame,
    encode_control_ack,
    encode_control_frame,
    encode_control_handshake,
    encode_control_msg,
    encode_data_ack,
    encode_data_handshake,
    encode_mux_record,
    encode_round_frame,
)

SALT = SessionSalt(b"\x42" * 16)
OTHER_SALT = SessionSalt(b"\x43" * 16)
WORLD = 4
MiB = 1 << 20

FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ_SMALL = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies for valid messages ---------------------------------------------------

u32 = st.integers(0, 0xFFFFFFFF)


@st.composite
def tensor_payloads(draw):
    dtype = draw(st.sampled_from([DTYPE_F32, DTYPE_BF16]))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    n = math.prod(shape) * (4 if dtype == DTYPE_F32 else 2)
    data = b"" if draw(st.booleans()) else draw(st.binary(min_size=n, max_size=n))
    return TensorPayload(dtype, shape, data)


round_frames = st.builds(
    RoundFrame,
    st.lists(tensor_payloads(), max_size=4),
    st.sampled_from([RoundKind.MODEL, RoundKind.CONTROL]),
    st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False),
)

control_msgs = st.one_of(
    st.builds(
        Hello,
        st.text(max_size=12),
        st.lists(u32, max_size=5),
        st.lists(st.binary(min_size=32, max_size=32), max_size=2),
    ),
    st.just(HelloAck()),
    st.builds(RankExit, u32),
    st.builds(DeclareDead, u32),
)

mux_records = st.builds(
    lambda kind, payload, rank: encode_mux_record(kind, payload, SALT, rank=rank).tobytes(),
    st.sampled_from(list(MuxKind)),
    st.binary(max_size=64) | control_msgs.map(encode_control_msg) | round_frames.map(lambda f: encode_round_frame(f, SALT)),
    u32,
)

control_frames = st.builds(
    lambda kind, payload: encode_control_frame(ControlFrame(kind, payload), SALT),
    u32,
    st.binary(max_size=64),
)

control_handshakes = st.builds(
    lambda rank, sig: encode_control_handshake(rank, WORLD, sig, SALT),
    u32,
    st.binary(min_size=32, max_size=32),
)


# -- mutations -------------------------------------------------------------------------


@st.composite
def mutated(draw, valid: st.SearchStrategy[bytes]):
    """A valid encoding after one to three random mutations."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "extend", "splice", "overwrite", "insert"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            other = draw(valid | st.binary(max_size=64))
            i = draw(st.integers(0, len(data)))
            j = draw(st.integers(0, len(other)))
            data = data[:i] + bytearray(other[j:])
        elif op == "overwrite" and data:
            i = draw(st.integers(0, len(data) - 1))
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[i : i + len(chunk)] = chunk
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def fuzz_input(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200), mutated(valid), valid)


@st.composite
def one_bit_flip(draw, valid: st.SearchStrategy[bytes]):
    data = bytearray(draw(valid))
    bit = draw(st.integers(0, 8 * len(data) - 1))
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data), bit


def only_flodl_errors(fn, *args, **kwargs):
    """Call a decoder; return its result or the FlodlError it raised. Anything else propagates."""
    try:
        return fn(*args, **kwargs)
    except FlodlError as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return exc


# -- sans-IO decoders: arbitrary and mutated input ----------------------------------------


@FUZZ
@given(fuzz_input(round_frames.map(lambda f: encode_round_frame(f, SALT))), st.sampled_from([64, 4096, DEFAULT_FRAME_CEILING]))
def test_fuzz_decode_round_frame(data, ceiling):
    only_flodl_errors(decode_round_frame, data, SALT, ceiling=ceiling)


@FUZZ
@given(fuzz_input(mux_records), st.sampled_from([16, 4096, DEFAULT_FRAME_CEILING]))
def test_fuzz_decode_mux_record(data, ceiling):
    out = only_flodl_errors(decode_mux_record, data, SALT, ceiling=ceiling)
    if not isinstance(out, Exception) and out.kind == MuxKind.CONTROL:
        only_flodl_errors(out.control)


@FUZZ
@given(fuzz_input(control_msgs.map(encode_control_msg)))
def test_fuzz_decode_control_msg(data):
    out = only_flodl_errors(decode_control_msg, data)
    if not isinstance(out, Exception):
        # whatever decodes re-encodes to a value that decodes to itself
        assert decode_control_msg(encode_control_msg(out)) == out


@FUZZ
@given(fuzz_input(control_frames))
def test_fuzz_decode_control_frame(data):
    only_flodl_errors(decode_control_frame, data, SALT)


@FUZZ
@given(fuzz_input(st.builds(encode_data_handshake, u32, st.integers(0, 8))))
def test_fuzz_decode_data_handshake(data):
    only_flodl_errors(decode_data_handshake, data, WORLD)


@FUZZ
@given(fuzz_input(st.just(encode_data_ack())))
def test_fuzz_decode_data_ack(data):
    only_flodl_errors(decode_data_ack, data)


@FUZZ
@given(fuzz_input(control_handshakes))
def test_fuzz_decode_control_handshake(data):
    only_flodl_errors(decode_control_handshake, data, WORLD, SALT)


@FUZZ
@given(fuzz_input(st.just(encode_control_ack(SALT))))
def test_fuzz_decode_control_ack(data):
    only_flodl_errors(decode_control_ack, data, SALT)


@FUZZ
@given(st.binary(max_size=64))
def test_fuzz_all_decoders_on_raw_bytes(data):
    for fn, args in [
        (decode_round_frame, (SALT,)),
        (decode_mux_record, (SALT,)),
        (decode_control_msg, ()),
        (decode_control_frame, (SALT,)),
        (decode_data_handshake, (WORLD,)),
        (decode_data_ack, ()),
        (decode_control_handshake, (WORLD, SALT)),
        (decode_control_ack, (SALT,)),
    ]:
        only_flodl_errors(fn, data, *args)
        only_flodl_errors(fn, bytearray(data), *args)
        only_flodl_errors(fn, memoryview(data), *args)


# -- round trips of valid encodings -----------------------------------------------------


@FUZZ
@given(round_frames)
def test_round_frame_round_trip(frame):
    raw = encode_round_frame(frame, SALT)
    assert len(raw) == frame.encoded_len
    assert decode_round_frame(raw, SALT) == frame
    with pytest.raises(MacError):
        decode_round_frame(raw, OTHER_SALT)


@FUZZ
@given(control_msgs)
def test_control_msg_round_trip(msg):
    assert decode_control_msg(encode_control_msg(msg)) == msg


@FUZZ
@given(st.sampled_from(list(MuxKind)), st.binary(max_size=300), u32)
def test_mux_record_round_trip(kind, payload, rank):
    raw = encode_mux_record(kind, payload, SALT, rank=rank).tobytes()
    rec = decode_mux_record(raw, SALT)
    assert (rec.kind, bytes(rec.payload), rec.rank) == (kind, payload, rank)


@FUZZ
@given(u32, st.binary(max_size=300))
def test_control_frame_round_trip(kind, payload):
    assert decode_control_frame(encode_control_frame(ControlFrame(kind, payload), SALT), SALT) == ControlFrame(
        kind, payload
    )


# -- a single flipped bit anywhere is always caught -----------------------------------------


@FUZZ
@given(one_bit_flip(round_frames.map(lambda f: encode_round_frame(f, SALT))))
def test_bit_flip_in_round_frame_is_caught(flipped):
    data, bit = flipped
    with pytest.raises(FlodlError):
        decode_round_frame(data, SALT)


@FUZZ
@given(one_bit_flip(mux_records))
def test_bit_flip_in_mux_record_is_caught(flipped):
    data, bit = flipped
    with pytest.raises(FlodlError):
        decode_mux_record(data, SALT)


@FUZZ
@given(one_bit_flip(control_frames))
def test_bit_flip_in_control_frame_is_caught(flipped):
    data, bit = flipped
    with pytest.raises(FlodlError):
        decode_control_frame(data, SALT)


@FUZZ
@given(one_bit_flip(control_handshakes))
def test_bit_flip_in_control_handshake_is_caught(flipped):
    data, bit = flipped
    with pytest.raises(FlodlError):
        decode_control_handshake(data, WORLD, SALT)


@pytest.mark.parametrize("bit", range(8 * 16))
def test_bit_flip_in_control_ack_is_caught(bit):
    data = bytearray(encode_control_ack(SALT))
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FlodlError):
        decode_control_ack(bytes(data), SALT)


def test_every_bit_flip_of_golden_round_frame_is_caught():
    frame = RoundFrame(
        [
            TensorPayload(DTYPE_F32, (2, 3), bytes(range(24))),
            TensorPayload(DTYPE_BF16, (2,), b"\x80\x3f\x00\xc0"),
            TensorPayload(DTYPE_F32, (7,)),
        ],
        RoundKind.MODEL,
        2.5,
    )
    raw = encode_round_frame(frame, SALT)
    for bit in range(8 * len(raw)):
        data = bytearray(raw)
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FlodlError):
            decode_round_frame(bytes(data), SALT)


def test_every_bit_flip_of_mux_and_control_frame_is_caught():
    rec = encode_mux_record(MuxKind.DATA, encode_control_frame(ControlFrame(5, b"hb"), SALT), SALT, rank=3).tobytes()
    for bit in range(8 * len(rec)):
        data = bytearray(rec)
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FlodlError):
            decode_mux_record(bytes(data), SALT)
    cf = encode_control_frame(ControlFrame(5, b"heartbeat"), SALT)
    for bit in range(8 * len(cf)):
        data = bytearray(cf)
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FlodlError):
            decode_control_frame(bytes(data), SALT)
    hs = encode_control_handshake(1, WORLD, bytes(range(32)), SALT)
    for bit in range(8 * len(hs)):
        data = bytearray(hs)
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FlodlError):
            decode_control_handshake(bytes(data), WORLD, SALT)


# -- stream readers ---------------------------------------------------------------------------


def _run_reader(chunks: list[bytes], read) -> None:
    """Feed ``chunks`` into an in-memory stream, close it, and run ``read(MessageStream)``."""

    async def main():
        with trio.fail_after(10):
            a, b = trio.testing.memory_stream_pair()
            for chunk in chunks:
                await a.send_all(chunk)
            await a.send_stream.aclose()
            await read(MessageStream(b, peer="fuzz"))

    trio.run(main)


@st.composite
def chunked(draw, data_strategy):
    data = draw(data_strategy)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    bounds = [0, *cuts, len(data)]
    return [data[i:j] for i, j in zip(bounds, bounds[1:]) if j > i]


def _len_framed(frames: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(f)) + f for f in frames)


len_framed_streams = st.lists(round_frames.map(lambda f: encode_round_frame(f, SALT)), min_size=1, max_size=3).map(
    _len_framed
)


@FUZZ_SMALL
@given(chunked(fuzz_input(len_framed_streams)), st.sampled_from([64, 4096, DEFAULT_FRAME_CEILING]))
def test_fuzz_receive_len_framed(chunks, ceiling):
    async def read(ms: MessageStream):
        buf = ReceiveBuffer()
        try:
            while (body := await ms.receive_len_framed(buf, ceiling=ceiling)) is not None:
                assert len(body) <= ceiling
                only_flodl_errors(decode_round_frame, body, SALT, ceiling=ceiling)
        except FlodlError:
            pass

    _run_reader(chunks, read)


mux_streams = st.lists(mux_records, min_size=1, max_size=3).map(b"".join)


@FUZZ_SMALL
@given(chunked(fuzz_input(mux_streams)), st.sampled_from([16, 4096, DEFAULT_FRAME_CEILING]))
def test_fuzz_receive_mux(chunks, ceiling):
    async def read(ms: MessageStream):
        buf = ReceiveBuffer()
        try:
            while (header := await ms.receive_mux_header(ceiling=ceiling)) is not None:
                assert header.length <= ceiling
                kind, payload = await ms.receive_mux_payload(header, buf, SALT)
                assert len(payload) == header.length
                if kind == MuxKind.CONTROL:
                    only_flodl_errors(decode_control_msg, payload)
        except FlodlError:
            pass

    _run_reader(chunks, read)


@FUZZ_SMALL
@given(chunked(mux_streams))
def test_valid_mux_stream_reads_back_intact(chunks):
    want = []
    raw = b"".join(chunks)
    pos = 0
    while pos < len(raw):
        (length,) = struct.unpack_from("<I", raw, pos + MUX_LENGTH_FIELD)
        want.append(decode_mux_record(raw[pos : pos + MUX_HEADER + length], SALT))
        pos += MUX_HEADER + length
    got = []

    async def read(ms: MessageStream):
        buf = ReceiveBuffer()
        while (header := await ms.receive_mux_header()) is not None:
            kind, payload = await ms.receive_mux_payload(header, buf, SALT)
            got.append((kind, bytes(payload), header.rank))

    _run_reader(chunks, read)
    assert got == [(r.kind, bytes(r.payload), r.rank) for r in want]


@FUZZ_SMALL
@given(st.lists(round_frames.map(lambda f: encode_round_frame(f, SALT)), min_size=1, max_size=3), st.data())
def test_valid_len_framed_stream_reads_back_intact(frames, data):
    chunks = data.draw(chunked(st.just(_len_framed(frames))))
    got = []

    async def read(ms: MessageStream):
        buf = ReceiveBuffer()
        while (body := await ms.receive_len_framed(buf)) is not None:
            got.append(bytes(body))

    _run_reader(chunks, read)
    assert got == frames


# -- allocation bounds --------------------------------------------------------------------------


def _peak_during(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _frame_header_claiming(nbytes: int) -> bytes:
    # magic, count 1, Model, weight 1.0, f32 tensor of shape [4], nbytes claimed
    return struct.pack("<IIBd", 0xF10D17F1, 1, 0, 1.0) + struct.pack("<BBI", 0, 1, 4) + struct.pack("<Q", nbytes)


@pytest.mark.parametrize("claimed", [512 * MiB, 2**32 - 1, 2**63, 2**64 - 1])
def test_round_frame_huge_nbytes_over_ceiling_refused_without_allocation(claimed):
    body = _frame_header_claiming(claimed) + b"\0" * 16

    def run():
        with pytest.raises(FramingError, match="ceiling"):
            decode_round_frame(body, SALT, ceiling=MiB)

    assert _peak_during(run) < MiB


def test_round_frame_huge_nbytes_under_ceiling_does_not_allocate():
    body = _frame_header_claiming(512 * MiB) + b"\0" * 16

    def run():
        with pytest.raises(FramingError, match="ended inside"):
            decode_round_frame(body, SALT, ceiling=1 << 30)

    assert _peak_during(run) < MiB


def test_round_frame_max_count_with_tiny_body():
    body = struct.pack("<IIBd", 0xF10D17F1, 65536, 0, 1.0) + b"\0" * 40

    def run():
        with pytest.raises(FramingError, match="ended inside"):
            decode_round_frame(body, SALT)

    assert _peak_during(run) < MiB


def test_control_msg_huge_counts_refused_without_allocation():
    huge = b"\xfc\xff\xff\xff\xff"  # varint u32 0xFFFFFFFF
    for payload in [
        b"\x00" + huge,  # host length
        b"\x00\x00" + huge,  # rank count
        b"\x00\x00\x00" + huge,  # model signature count
        b"\x00\xfd" + b"\xff" * 8,  # u64 host length
    ]:
        def run(payload=payload):
            with pytest.raises(FramingError):
                decode_control_msg(payload)

        assert _peak_during(run) < MiB


def _stream_peak(prefix: bytes, tail: bytes, read) -> tuple[int, BaseException | None]:
    """Run ``read`` on an in-memory stream carrying ``prefix + tail`` then EOF; return the traced peak."""
    caught: list[BaseException] = []

    async def main():
        with trio.fail_after(20):
            a, b = trio.testing.memory_stream_pair()
            await a.send_all(prefix + tail)
            await a.send_stream.aclose()
            ms = MessageStream(b, peer="liar")
            tracemalloc.reset_peak()
            try:
                await read(ms)
            except FlodlError as exc:
                caught.append(exc)

    tracemalloc.start()
    try:
        trio.run(main)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, caught[0] if caught else None


def test_len_prefix_above_ceiling_refused_before_buffering():
    async def read(ms):
        await ms.receive_len_framed(ReceiveBuffer(), ceiling=1 << 30)

    peak, exc = _stream_peak(struct.pack("<I", 2**32 - 1), b"abc", read)
    assert isinstance(exc, FramingError) and not isinstance(exc, PeerClosedMidFrame)
    assert "ceiling" in str(exc) and "refused before buffering" in str(exc)
    assert peak < MiB


def test_len_prefix_under_ceiling_buffer_grows_only_as_bytes_arrive():
    """512 MiB declared, 1 GiB ceiling, 10 bytes arrive: the reader must not reserve the claim."""
    buf = ReceiveBuffer()

    async def read(ms):
        await ms.receive_len_framed(buf, ceiling=1 << 30)

    peak, exc = _stream_peak(struct.pack("<I", 512 * MiB), b"0123456789", read)
    assert isinstance(exc, PeerClosedMidFrame), exc
    assert "mid-frame" in str(exc)
    assert peak < MiB, f"traced peak {peak} bytes for 14 bytes received (buffer capacity {buf.capacity})"
    assert buf.capacity < MiB


def test_len_prefix_buffer_growth_is_proportional_to_arrived_bytes():
    """3 MiB of a declared 512 MiB message arrive: memory stays within a small multiple of that."""
    buf = ReceiveBuffer()

    async def read(ms):
        await ms.receive_len_framed(buf, ceiling=1 << 30)

    peak, exc = _stream_peak(struct.pack("<I", 512 * MiB), b"\x01" * (3 * MiB), read)
    assert isinstance(exc, PeerClosedMidFrame), exc
    # the in-memory stream itself holds the 3 MiB it carries; allow that plus a 2x growth buffer
    assert peak < 10 * MiB, f"traced peak {peak} bytes for 3 MiB received (buffer capacity {buf.capacity})"
    assert buf.capacity <= 2 * 3 * MiB


def test_mux_length_above_ceiling_refused_before_buffering():
    header = struct.pack("<IIBII", 0xF10D17D0, 1, 3, 0, 2**32 - 1) + b"\0" * 8

    async def read(ms):
        await ms.receive_mux_header(ceiling=1 << 30)

    peak, exc = _stream_peak(header, b"abc", read)
    assert isinstance(exc, FramingError) and not isinstance(exc, PeerClosedMidFrame)
    assert "ceiling" in str(exc)
    assert peak < MiB


def test_mux_payload_under_ceiling_buffer_grows_only_as_bytes_arrive():
    header = struct.pack("<IIBII", 0xF10D17D0, 1, 3, 0, 512 * MiB) + b"\0" * 8
    buf = ReceiveBuffer()

    async def read(ms):
        h = await ms.receive_mux_header(ceiling=1 << 30)
        assert h is not None and h.length == 512 * MiB
        await ms.receive_mux_payload(h, buf, SALT)

    peak, exc = _stream_peak(header, b"0123456789", read)
    assert isinstance(exc, PeerClosedMidFrame), exc
    assert peak < MiB, f"traced peak {peak} bytes for 35 bytes received (buffer capacity {buf.capacity})"


async def test_len_prefix_under_ceiling_over_socketpair_does_not_reserve_claim():
    s1, s2 = trio.socket.socketpair()
    left, right = trio.SocketStream(s1), trio.SocketStream(s2)
    await left.send_all(struct.pack("<I", 512 * MiB) + b"0123456789")
    await left.send_eof()
    buf = ReceiveBuffer()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(PeerClosedMidFrame, match="mid-frame"):
            await MessageStream(right).receive_len_framed(buf, ceiling=1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    await left.aclose()
    await right.aclose()
    assert peak < MiB, f"traced peak {peak} bytes for 14 bytes received (buffer capacity {buf.capacity})"


def test_receive_buffer_writable_never_exceeds_total():
    buf = ReceiveBuffer()
    view = buf.writable(0, 10)
    assert len(view) == 10
    assert buf.capacity >= 10
    view = buf.writable(10, 10)
    assert len(view) == 0


def test_receive_buffer_keeps_filled_bytes_when_growing():
    buf = ReceiveBuffer()
    total = 300 * 1024
    filled = 0
    while filled < total:
        view = buf.writable(filled, total)
        n = min(len(view), 1000)
        view[:n] = bytes([(filled + i) % 251 for i in range(n)])
        filled += n
    assert bytes(buf.view(total)) == bytes(i % 251 for i in range(total))
