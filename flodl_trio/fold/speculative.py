"""A round's outgoing frame, computed speculatively while its last contribution
arrives; the incoming frame's MAC check keeps it or throws it away.

When the controller waits only for the last host's HostFrame, everything it
will send next - the consensus, its frame MAC, the Broadcast record's MAC -
depends on that frame's bytes alone. A record's MAC precedes its payload on
the wire, so done afterwards this costs a fold and two hash passes over the
model after the last byte lands. :class:`SpeculativeFrame` instead computes the
outgoing frame block by block as the bytes land, into a buffer of its own,
and feeds both MACs as it goes; once the incoming record's MAC verifies, the
outgoing record is ready at once.

Nothing computed here is used unless the incoming bytes verify: the fold
accumulator (verified frames only) is only read, the output buffer is private,
and a frame that fails its MAC, or does not match the round's schema, is
simply abandoned - the caller then takes the ordinary path, which reports
the error. The result is byte-identical to folding, finishing and signing
the verified frame the ordinary way (the same f32 operations in the same
order; tests compare them).

Sans-IO core (:meth:`SpeculativeFrame.consume`), one async driver
(:meth:`SpeculativeFrame.follow`) that runs beside a receive, and
:func:`receive_speculating`, the one way the relay and the controller wire
the two to a receive.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import trio

from ..transport.arrival import ArrivalWatch, receive_with_followers
from ..transport.buffers import ReceiveBuffer
from ..transport.hashing import RunningMac, mac_feeder
from ..transport.tasks import ChangeSignal
from ..wire.bf16 import BLOCK, DTYPE_NAMES, F32, U16, U32, f32_to_bf16, itemsize
from ..wire.constants import (
    DTYPE_BF16,
    MAC_LEN,
    MAX_TENSORS,
    MUX_HEADER_LEN,
    ROUND_FRAME_MAGIC,
)
from ..wire.mux import MuxKind, mux_signed_header
from ..wire.round_frame import (
    EncodedFrame,
    RoundFrame,
    RoundKind,
    decode_round_frame,
    schema_frame_len,
)
from ..wire.salt import SessionSalt
from .accumulator import FoldAccumulator

T = TypeVar("T")
_FRAME_HEADER = struct.Struct("<IIBd")
# Incoming bytes processed between two checkpoints of the event loop.
FOLLOW_SLICE = 4 << 20
_U64 = struct.Struct("<Q")


class _Unfit(Exception):
    """The incoming frame leaves the fast path (the ordinary path will judge it)."""


class _Tensor:
    """One tensor position: where its payload sits in the incoming and the outgoing
    frame, the folded sum it adds to, and how many elements are done."""

    __slots__ = ("done", "dtype", "in_nbytes", "in_start", "numel", "out_start", "sum")

    def __init__(self, dtype: int, numel: int, in_start: int, in_nbytes: int, out_start: int,
                 total: npt.NDArray[np.float32]) -> None:
        self.dtype = dtype
        self.numel = numel
        self.in_start = in_start
        self.in_nbytes = in_nbytes
        self.out_start = out_start
        self.sum = total
        self.done = 0  # elements written to the output


class SpeculativeFrame:
    """The outgoing frame of a round, computed from ``acc`` plus one incoming frame as it arrives.

    ``divide``: the controller's consensus (multiply by f32(1 / total mass) for
    a Model round with mass > 0); otherwise a relay's plain sum. Feed the
    arriving bytes with :meth:`consume`; when :attr:`complete`, the output
    holds every byte but the frame's MAC. ``out`` is where the output goes
    (reserved to the planned length); by default a buffer of its own.
    """

    def __init__(
        self, acc: FoldAccumulator, *, divide: bool, in_length: int, out: ReceiveBuffer | None = None
    ) -> None:
        self.acc = acc
        self.divide = divide
        self.in_length = in_length
        self.abandoned: str | None = None
        self.complete = False
        self.pos = 0  # incoming bytes consumed
        self.out_pos = 0  # outgoing bytes final (handed to the MACs)
        self._layout = acc.layout()
        self._count: int | None = None
        self._scale: np.float32 | None = None
        self._tensor: _Tensor | None = None
        self._tensors_seen = 0
        self._wide = np.empty(BLOCK, dtype=U32)
        self.out_len: int | None = self._planned_length()
        # The output: a buffer of the caller's (a relay lends one of its receive
        # buffers) or a fresh one, sized once from the verified schema.
        self._out = out if out is not None else ReceiveBuffer()
        self._out.reserve(self.out_len or 0)

    # -- planning ------------------------------------------------------------

    def _planned_length(self) -> int | None:
        """The outgoing frame's length, from verified frames alone (None: not this path).

        Every tensor goes out whole, so the length follows from the folded
        frames' schema and the output is allocated once, at a size no unverified
        byte chose. Without a folded frame (the round's only contribution), or
        with a tensor every folded frame elided, the size would depend on the
        incoming bytes: those rounds take the ordinary path, and so do delta
        rounds (docs/wire.md, "Delta rounds").
        """
        if self.acc.count == 0 or any(total is None for _dtype, _shape, total in self._layout):
            return None
        if any(dtype not in DTYPE_NAMES for dtype, _shape, _total in self._layout):
            return None  # a delta round: decoded and re-encoded, never summed as it streams
        return schema_frame_len((dtype, shape) for dtype, shape, _ in self._layout)

    @property
    def supported(self) -> bool:
        return self.out_len is not None

    # -- consuming -----------------------------------------------------------

    def consume(self, data: memoryview) -> list[tuple[memoryview, int]]:
        """Process the incoming bytes ``data[self.pos:]`` (``data`` is everything arrived so
        far); return the newly final output pieces as (view, offset), in order."""
        start = self.out_pos
        try:
            while not self.complete and self.abandoned is None and self._step(data):
                pass
        except _Unfit as exc:
            self.abandoned = str(exc)
            return []
        if self.out_pos == start:
            return []
        return [(self._out.view(self.out_pos)[start:], start)]

    def _step(self, data: memoryview) -> bool:
        """One parsing step; False when it needs more bytes."""
        if self._count is None:
            return self._frame_header(data)
        if self._tensor is not None:
            return self._payload(data)
        if self._tensors_seen < self._count:
            return self._tensor_header(data)
        if self.pos + MAC_LEN != self.in_length:
            raise _Unfit(f"the frame ends at {self.pos + MAC_LEN}, its record holds {self.in_length} bytes")
        self.complete = True
        return False

    def _take(self, data: memoryview, n: int) -> memoryview | None:
        if len(data) < self.pos + n:
            return None
        piece = data[self.pos:self.pos + n]
        self.pos += n
        return piece

    def _frame_header(self, data: memoryview) -> bool:
        raw = self._take(data, _FRAME_HEADER.size)
        if raw is None:
            return False
        magic, count, kind, weight = _FRAME_HEADER.unpack(raw)
        if magic != ROUND_FRAME_MAGIC or count > MAX_TENSORS or kind not in (0, 1):
            raise _Unfit("not a well-formed RoundFrame header")
        if not (math.isfinite(weight) and weight >= 0):
            raise _Unfit(f"weight {weight!r}")
        if count != len(self._layout) or kind != self.acc.kind:
            raise _Unfit("schema differs from the folded frames")
        total = self.acc.weight + weight
        if not math.isfinite(total):
            raise _Unfit(f"weight {weight!r} would make the mass {total!r}")
        if self.divide and kind == RoundKind.MODEL and total > 0:
            self._scale = np.float32(1.0 / total)
        self._count = count
        self._emit(_FRAME_HEADER.pack(ROUND_FRAME_MAGIC, count, kind, total))
        return True

    def _tensor_header(self, data: memoryview) -> bool:
        head = data[self.pos:self.pos + 2]
        if len(head) < 2:
            return False
        ndim = head[1]
        raw = self._take(data, 2 + 4 * ndim + 8)
        if raw is None:
            return False
        dtype = raw[0]
        shape = struct.unpack_from(f"<{ndim}I", raw, 2)
        (nbytes,) = _U64.unpack_from(raw, 2 + 4 * ndim)
        index = self._tensors_seen
        if dtype not in DTYPE_NAMES:
            raise _Unfit(f"tensor {index}: dtype {dtype}")
        numel = math.prod(shape)
        if nbytes not in (0, numel * itemsize(dtype)):
            raise _Unfit(f"tensor {index}: {nbytes} bytes for {numel} elements")
        want_dtype, want_shape, total = self._layout[index]
        if (dtype, tuple(shape)) != (want_dtype, want_shape) or total is None:
            raise _Unfit(f"tensor {index}: schema differs from the folded frames")
        self._emit(bytes(raw[:2 + 4 * ndim]) + _U64.pack(numel * itemsize(dtype)))
        self._tensors_seen += 1
        tensor = _Tensor(dtype, numel, self.pos, nbytes, self.out_pos, total)
        if nbytes == 0:
            self._write_elided(tensor)  # all zeros: the folded sum alone
        else:
            self._tensor = tensor
        return True

    def _payload(self, data: memoryview) -> bool:
        t = self._tensor
        assert t is not None
        size = itemsize(t.dtype)
        arrived = min(len(data), t.in_start + t.in_nbytes) - t.in_start
        ready = arrived // size
        if ready <= t.done:
            return False
        for start in range(t.done, ready, BLOCK):
            stop = min(start + BLOCK, ready)
            self._write_block(t, data[t.in_start + start * size:t.in_start + stop * size], start, stop)
        t.done = ready
        self.pos = t.in_start + ready * size
        if ready == t.numel:
            self._tensor = None
        return True

    # -- producing -----------------------------------------------------------

    def _reserve(self, end: int) -> memoryview:
        """The output up to ``end`` (allocated whole, at the planned length)."""
        assert self.out_len is not None and end <= self.out_len
        return self._out.view(end)

    def _emit(self, piece: bytes) -> None:
        end = self.out_pos + len(piece)
        self._reserve(end)[self.out_pos:end] = piece
        self.out_pos = end

    def _values(self, t: _Tensor, raw: memoryview | None, start: int, stop: int) -> npt.NDArray[np.float32]:
        """f32 values of elements [start, stop): folded sum + incoming, scaled (a scratch block)."""
        n = stop - start
        wide = self._wide[:n]
        values = wide.view(F32)
        if raw is None:  # the incoming tensor is elided (all zeros)
            np.copyto(values, t.sum[start:stop])
        else:
            if t.dtype == DTYPE_BF16:
                np.left_shift(np.frombuffer(raw, dtype=U16), 16, out=wide, dtype=U32, casting="unsafe")
            else:
                np.copyto(values, np.frombuffer(raw, dtype=F32))
            np.add(t.sum[start:stop], values, out=values)
        if self._scale is not None:
            np.multiply(values, self._scale, out=values)
        return values

    def _write_block(self, t: _Tensor, raw: memoryview | None, start: int, stop: int) -> None:
        size = itemsize(t.dtype)
        a, b = t.out_start + start * size, t.out_start + stop * size
        out = self._reserve(b)[a:b]
        with np.errstate(over="ignore", invalid="ignore"):
            values = self._values(t, raw, start, stop)
            if t.dtype == DTYPE_BF16:
                f32_to_bf16(values, out=np.frombuffer(out, dtype=U16))
            else:
                np.copyto(np.frombuffer(out, dtype=F32), values)
        self.out_pos = max(self.out_pos, b)

    def _write_elided(self, t: _Tensor) -> None:
        for start in range(0, t.numel, BLOCK):
            self._write_block(t, None, start, min(start + BLOCK, t.numel))

    # -- results -------------------------------------------------------------

    @property
    def buffer(self) -> ReceiveBuffer:
        """Where the output is written (the caller's ``out``, or a buffer of its own)."""
        return self._out

    def output(self) -> memoryview:
        """Every outgoing byte (the frame's MAC last, once :meth:`follow` wrote it)."""
        assert self.out_len is not None
        return self._reserve(self.out_len)

    async def follow(
        self, buf: ReceiveBuffer, watch: ArrivalWatch, kind: MuxKind, salt: SessionSalt
    ) -> EncodedFrame | None:
        """Run beside the receive that ``watch`` follows; the signed outgoing record once
        the incoming bytes verified, None if they did not or the path was abandoned."""
        assert self.out_len is not None
        body_len = self.out_len - MAC_LEN
        signed = mux_signed_header(kind, self.out_len)
        record = salt.hmac()
        record.update(signed)
        frame_mac, record_mac = RunningMac(salt.hmac(), body_len), RunningMac(record, body_len)
        async with mac_feeder(frame_mac, body_len) as feed_frame, mac_feeder(record_mac, body_len) as feed_record:
            assert feed_frame is not None and feed_record is not None
            upto = 0
            while not self.complete and self.abandoned is None:
                # A slice at a time, so a burst of arrived bytes never holds the event loop long.
                landed = await watch.next_stretch(upto, step=FOLLOW_SLICE)
                if landed is None:
                    break  # everything that will ever arrive has been consumed
                upto = landed
                for piece, offset in self.consume(buf.view(upto)):
                    await feed_frame(piece, offset)
                    await feed_record(piece, offset)
        if not self.complete:
            return None
        await watch.wait_done()
        if not (watch.ok and self.complete):
            return None
        tag = frame_mac.tag()
        self.output()[body_len:] = tag
        record_mac.mac.update(tag)
        header = signed + record_mac.tag()
        return EncodedFrame([header, self.output()], MUX_HEADER_LEN + self.out_len)

    def frame(self) -> RoundFrame:
        """The outgoing frame as a RoundFrame over the output buffer (zero-copy; built
        here, so trusted), once it is :attr:`complete`."""
        assert self.complete, "the outgoing frame is not complete yet"
        return decode_round_frame(self.output(), None, authenticated=True)


@attrs.frozen
class Speculation:
    """What speculating beside one receive got to: the frame (None if the incoming
    frame never became the round's last, or could not be speculated on) and its
    signed record (None unless the incoming bytes verified and it completed)."""

    frame: SpeculativeFrame | None = None
    record: EncodedFrame | None = None


async def receive_speculating(
    watch: ArrivalWatch,
    receive: Callable[[], Awaitable[T]],
    *,
    is_last: Callable[[], bool],
    begin: Callable[[], SpeculativeFrame | None],
    changes: ChangeSignal,
    buf: ReceiveBuffer,
    kind: MuxKind,
    salt: SessionSalt,
) -> tuple[T, Speculation]:
    """Run ``receive`` into ``buf``; as soon as its frame is the one the round still
    waits for (``is_last()``, re-checked at every ``changes``), start the outgoing
    frame (``begin()``; None: not possible this time) and compute it beside the
    arrival.

    The caller keeps the result only if the round is still exactly the one the
    speculation assumed once the receive has returned (nothing folded meanwhile);
    otherwise it takes the ordinary path and gives back ``frame``'s buffer.
    """
    waiting = trio.CancelScope()

    async def speculate() -> Speculation:
        frame = None
        with waiting:
            while not is_last():
                await changes.wait()
            frame = begin()
        if frame is None:
            return Speculation(frame)
        return Speculation(frame, await frame.follow(buf, watch, kind, salt))

    async def receive_then_stop_waiting() -> T:
        try:
            return await receive()
        finally:
            waiting.cancel()  # not the last frame by now: too late to help

    received, (speculation,) = await receive_with_followers(watch, receive_then_stop_waiting, speculate)
    return received, speculation


__all__ = ["Speculation", "SpeculativeFrame", "receive_speculating"]
