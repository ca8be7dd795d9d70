"""HMACs computed while bytes move: fed chunk by chunk as a message lands or
leaves, on a worker thread for big messages, so authentication overlaps the
socket instead of adding a pass after it.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..wire.constants import MAC_LEN, MUX_HEADER_LEN, UNSIGNED_TAG
from ..wire.mux import MuxKind, encode_mux_record, mux_signed_header
from ..wire.round_frame import (
    EncodedFrame,
    RoundFrame,
    encode_round_frame_chunks,
    frame_body_chunks,
)
from ..wire.salt import Buffer, SessionSalt
from .arrival import ArrivalWatch
from .buffers import ReceiveBuffer
from .tasks import one_error


class RunningMac:
    """An HMAC over bytes ``[0, end)`` of a message, fed chunk by chunk as they arrive,
    so verifying a frame costs no second pass over it (and overlaps the network)."""

    __slots__ = ("end", "mac")

    def __init__(self, mac: hmac.HMAC, end: int) -> None:
        self.mac = mac
        self.end = end

    def feed(self, chunk: memoryview, offset: int) -> None:
        stop = min(offset + len(chunk), self.end)
        if stop > offset:
            self.mac.update(chunk[: stop - offset])

    def tag(self) -> bytes:
        return self.mac.digest()[:MAC_LEN]


async def hash_as_it_lands(buf: ReceiveBuffer, watch: ArrivalWatch, mac: RunningMac) -> bool:
    """Feed ``mac`` the message ``watch`` follows, as its bytes land in ``buf``
    (a follower for :func:`receive_with_followers`); True once every byte was fed and
    the receive verified, False if it failed."""
    fed = 0
    async with mac_feeder(mac, watch.length) as feed:
        assert feed is not None
        while (upto := await watch.next_stretch(fed)) is not None:
            await feed(buf.view(upto)[fed:], fed)
            fed = upto
    await watch.wait_done()
    return watch.ok and fed == watch.length


OnBytes = Callable[[memoryview, int], Awaitable[None]]
# Messages at least this big are hashed by a worker thread while the event loop
# keeps moving bytes (hashlib releases the GIL), in slices of HASH_SLICE.
THREADED_HASH_MIN = 4 << 20
HASH_SLICE = 1 << 20
HASH_BACKLOG = 4


@asynccontextmanager
async def mac_feeder(mac: RunningMac | None, length: int) -> AsyncIterator[OnBytes | None]:
    """How a receive or send feeds ``mac``: inline for small messages, through a
    worker thread for big ones (so hashing overlaps the socket on another core)."""
    if mac is None or length < THREADED_HASH_MIN:
        if mac is None:
            yield None
            return
        inline = mac.feed

        async def feed_inline(chunk: memoryview, offset: int) -> None:
            inline(chunk, offset)

        yield feed_inline
        return
    # A short queue: a reader that outruns the hash waits for it, so the views
    # held in the queue (which pin a receive buffer that has since grown) stay few.
    send, receive = trio.open_memory_channel[list[tuple[memoryview, int]]](HASH_BACKLOG)
    batch: list[tuple[memoryview, int]] = []
    batched = 0

    async def feed(chunk: memoryview, offset: int) -> None:
        nonlocal batch, batched
        batch.append((chunk, offset))
        batched += len(chunk)
        if batched >= HASH_SLICE:
            ready, batch, batched = batch, [], 0
            await send.send(ready)

    def hash_batch(items: list[tuple[memoryview, int]]) -> None:
        for chunk, offset in items:
            mac.feed(chunk, offset)

    async def worker() -> None:
        async for items in receive:
            await trio.to_thread.run_sync(hash_batch, items)

    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker)
            try:
                yield feed
                if batch:
                    await send.send(batch)
            finally:
                send.close()


# Below this, two worker threads cost more than the hashing they would split.
PARALLEL_SIGN_MIN = 1 << 20


async def encode_enveloped_frame(
    kind: MuxKind, frame: RoundFrame, salt: SessionSalt, *, frame_mac: bool = True
) -> EncodedFrame:
    """A RoundFrame signed and wrapped in a MuxRecord (HostFrame or Broadcast).

    The frame's MAC and the record's MAC cover the same bytes; for a large
    frame the two passes run in two worker threads at once (hashlib releases
    the GIL), halving the time this step holds the round up. ``frame_mac=False``
    (a lane frame, which no receiver takes out of its record: docs/wire.md, "One
    MAC a lane") leaves zeros in the frame's MAC field and makes one pass, the
    record's, which covers every byte of the frame.
    """
    body = frame_body_chunks(frame)
    if not frame_mac:
        return await _record_signed_only(kind, body.chunks, body.nbytes, salt)
    if body.nbytes < PARALLEL_SIGN_MIN:
        return encode_mux_record(kind, encode_round_frame_chunks(frame, salt), salt)
    signed = mux_signed_header(kind, body.nbytes + MAC_LEN)
    frame_hmac, record_hmac = salt.hmac(), salt.hmac()
    record_hmac.update(signed)

    def hash_body(mac: Any) -> None:
        for chunk in body.chunks:
            mac.update(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, hash_body, frame_hmac)
        nursery.start_soon(trio.to_thread.run_sync, hash_body, record_hmac)
    tag = frame_hmac.digest()[:MAC_LEN]
    record_hmac.update(tag)
    header = signed + record_hmac.digest()[:MAC_LEN]
    return EncodedFrame([header, *body.chunks, tag], MUX_HEADER_LEN + body.nbytes + MAC_LEN)


async def _record_signed_only(kind: MuxKind, chunks: Sequence[Buffer], nbytes: int, salt: SessionSalt) -> EncodedFrame:
    """The record of a frame whose own MAC field holds zeros: the record's one pass, on
    a worker thread for a large frame (the event loop keeps moving bytes meanwhile)."""
    payload = EncodedFrame([*chunks, UNSIGNED_TAG], nbytes + MAC_LEN)
    if nbytes < PARALLEL_SIGN_MIN:
        return encode_mux_record(kind, payload, salt)
    return await trio.to_thread.run_sync(encode_mux_record, kind, payload, salt)
