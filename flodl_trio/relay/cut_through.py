"""Cut-through fan-out: a large whole consensus goes to the ranks while it arrives.

Every waiting rank gets the frame's bytes as they land, except its last 8
(the frame's own MAC), which go out only once the record's MAC has verified:
a rank cannot complete a frame the relay has not authenticated. If
verification fails the error leaves here and the relay's channel stops,
closing every rank connection mid-frame.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

from ..transport.arrival import ArrivalWatch, receive_with_followers
from ..transport.buffers import ReceiveBuffer
from ..transport.stream import CONNECTION_LOST, WRITE_PIECE, MessageStream
from ..wire.constants import MAC_LEN
from ..wire.mux import MuxHeader
from ..wire.salt import SessionSalt

_U32 = struct.Struct("<I")

# Told when a rank could not take its share: (rank, why).
RankFailed = Callable[[int, str], Awaitable[None]]


async def stream_consensus(
    upstream: MessageStream, header: MuxHeader, buf: ReceiveBuffer, salt: SessionSalt,
    conns: Mapping[int, MessageStream], targets: list[int], rank_failed: RankFailed,
) -> None:
    """Receive the Broadcast record of ``header`` into ``buf``, verifying it, while
    each of ``targets`` is sent the frame it carries (see the module docstring)."""
    watch = ArrivalWatch(header.length)
    await receive_with_followers(
        watch,
        partial(upstream.receive_mux_payload, header, buf, salt, watch),
        *(partial(_forward, rank, conns[rank], buf, watch, rank_failed) for rank in targets),
    )


async def _forward(rank: int, conn: MessageStream, buf: ReceiveBuffer, watch: ArrivalWatch, rank_failed: RankFailed) -> None:
    """One rank's share: a length prefix, the bytes so far, the tag last."""
    gate = watch.length - MAC_LEN
    sent = 0
    try:
        await conn.send_piece(_U32.pack(watch.length))
        while (end := await watch.next_stretch(sent, step=WRITE_PIECE, stop=gate)) is not None:
            await conn.send_piece(buf.view(end)[sent:])
            sent = end
        await watch.wait_done()
        if watch.ok:
            await conn.send_piece(buf.view(watch.length)[gate:])
    except CONNECTION_LOST as exc:
        await rank_failed(rank, f"could not take the consensus: {exc}")


__all__ = ["stream_consensus"]
