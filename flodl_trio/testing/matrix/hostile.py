"""Raw peers: sockets the cases drive by hand to say what no honest client would.

An attacker, a port scanner or a half-written client is played here with the
wire's own encoders (so its bytes are valid exactly where the case wants them
to be) and a plain trio socket: a rank that completes the handshake and then
sends a length of 2**32 - 1, a relay whose Hello is accepted and whose next
record is a lie, a slow-loris that stops half-way through a handshake.
"""

from __future__ import annotations

import re

import numpy as np
import trio

from ...wire.constants import DTYPE_F32, MAC_LEN
from ...wire.handshake import CONTROL_ACK_LEN, DATA_ACK_LEN, encode_control_handshake, encode_data_handshake
from ...wire.mux import Hello, MuxKind, encode_control_record, mux_signed_header
from ...wire.round_frame import FRAME_HEADER_LEN, RoundFrame, RoundKind, TensorPayload, encode_round_frame
from ...wire.salt import SessionSalt
from ...wire.state import STATE_CHALLENGE_LEN, decode_state_challenge, encode_state_answer, encode_state_request, new_nonce
from ..processes import ChildProcess
from .clusters import SALT, SIGNATURE
from .offsets import HELLO_ACK_RECORD_LEN, U32
from .oracle import mono
from .registry import MatrixFailure

Address = tuple[str, int]
UNKNOWN_DTYPE = 9  # no such dtype tag
HUGE_LENGTH = 0xFFFFFFFF  # 2**32 - 1, the largest length a u32 can declare


# ---------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------


def channel_magic(magic: int) -> bytes:
    """The u32 a relay opens its controller connection with."""
    return U32.pack(magic)


def length_prefixed(blob: bytes) -> bytes:
    """``blob`` as a message on a rank leg: its u32 length, then the bytes."""
    return U32.pack(len(blob)) + blob


def huge_length_prefix() -> bytes:
    """A rank-leg length prefix of 2**32 - 1."""
    return U32.pack(HUGE_LENGTH)


def forged_mux_header(kind: MuxKind, length: int, rank: int = 0) -> bytes:
    """A MuxRecord header declaring ``length`` payload bytes, with a MAC of zeros."""
    return mux_signed_header(kind, length, rank=rank) + bytes(MAC_LEN)


def contribution_frame(rank: int, round_index: int, numel: int = 4, *, weight: float = 1.0) -> RoundFrame:
    """What rank_worker sends in round ``round_index`` (value (rank + 1) * (k + 1), mass 1)."""
    values = np.full(numel, float((rank + 1) * (round_index + 1)), dtype="<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, (numel,), values)], RoundKind.MODEL, weight)


def with_unknown_dtype(frame: RoundFrame, salt: SessionSalt = SALT) -> bytes:
    """``frame`` signed correctly, its first tensor's dtype tag set to one that does not exist."""
    body = bytearray(encode_round_frame(frame, salt)[:-MAC_LEN])
    body[FRAME_HEADER_LEN] = UNKNOWN_DTYPE
    return bytes(body) + salt.mac8(bytes(body))


# ---------------------------------------------------------------------------
# Reading from whatever answers
# ---------------------------------------------------------------------------


async def wait_closed_by_peer(stream: trio.SocketStream) -> None:
    """Read until the peer closes (EOF or reset)."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, OSError):
        pass


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            raise MatrixFailure(f"peer closed after {len(data)} of {n} bytes")
        data += chunk
    return data


# ---------------------------------------------------------------------------
# Peers that get in, then misbehave
# ---------------------------------------------------------------------------


async def raw_data_rank(address: Address, rank: int, world: int) -> trio.SocketStream:
    """A rank's data connection past its handshake, to write anything on."""
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(encode_data_handshake(rank, world))
    await receive_exactly(stream, DATA_ACK_LEN)
    return stream


async def answered_state_request(address: Address, rank: int, world: int, salt: SessionSalt = SALT) -> tuple[trio.SocketStream, bytes]:
    """A join exchange taken as far as the answer to the controller's challenge, and
    the bytes it sent (request then answer: what a wiretap would have recorded).
    Nothing of the reply is read."""
    stream = await trio.open_tcp_stream(*address)
    nonce = new_nonce()
    request = encode_state_request(rank, world, nonce, salt)
    await stream.send_all(request)
    challenge = await receive_exactly(stream, STATE_CHALLENGE_LEN)
    answer = encode_state_answer(rank, decode_state_challenge(challenge, nonce, salt), salt)
    await stream.send_all(answer)
    return stream, request + answer


async def raw_control_rank(address: Address, rank: int, world: int) -> trio.SocketStream:
    """A rank's control connection past its handshake (signed with the matrix salt)."""
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(encode_control_handshake(rank, world, SIGNATURE, SALT))
    await receive_exactly(stream, CONTROL_ACK_LEN)
    return stream


async def raw_relay(address: Address, magic: int, hello: Hello) -> trio.SocketStream:
    """A relay connection to the controller whose Hello was accepted (its HelloAck read)."""
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(channel_magic(magic) + encode_control_record(hello, SALT))
    await receive_exactly(stream, HELLO_ACK_RECORD_LEN)
    return stream


async def slowloris(
    address: Address, prefix: bytes, deadline: float, log: ChildProcess, log_line: str | re.Pattern[str],
) -> float:
    """Send ``prefix`` then nothing; return how long until the listener hung up (which must be
    about ``deadline``), once ``log`` has named the refusal."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(prefix)
        t0 = mono()
        with trio.move_on_after(deadline + 5.0):
            await wait_closed_by_peer(stream)
        held = mono() - t0
    if not deadline * 0.8 <= held <= deadline + 2.0:
        raise MatrixFailure(f"slow-loris {prefix.hex()} held for {held:.2f} s; the deadline is {deadline:.1f} s")
    await log.wait_log(log_line)
    return held


__all__ = [
    "HUGE_LENGTH",
    "UNKNOWN_DTYPE",
    "Address",
    "answered_state_request",
    "channel_magic",
    "contribution_frame",
    "forged_mux_header",
    "huge_length_prefix",
    "length_prefixed",
    "raw_control_rank",
    "raw_data_rank",
    "raw_relay",
    "receive_exactly",
    "slowloris",
    "wait_closed_by_peer",
    "with_unknown_dtype",
]
