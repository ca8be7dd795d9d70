"""The control channel's role: a byte router between rank blobs and rank-tagged Data records.

Each blob a rank sends (one ControlFrame: heartbeats, signatures, beacons'
answers) goes up tagged with its rank, never parsed; each Data record the
controller sends goes to the rank it names.
"""

from __future__ import annotations

from ..transport.buffers import ReceiveBuffer
from ..transport.stream import MessageStream
from ..wire.constants import CONTROL_FRAME_HEADER_LEN, CONTROL_FRAME_MAX_PAYLOAD
from ..wire.mux import (
    MuxHeader,
    MuxKind,
    RankExit,
    RankFinished,
    RelayControlMsg,
    decode_control_msg,
    encode_mux_record,
)
from ..wire.round_frame import EncodedFrame
from .channels import Channel
from .outbound import DataRecord, Outbound, Outbox

# A control-channel blob is one ControlFrame: 24-byte header + at most 16 MiB.
CONTROL_BLOB_CEILING = CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD


class ControlRouter:
    """The control channel's :class:`~.channels.ChannelRole`."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def read_rank(self, rank: int, conn: MessageStream, out: Outbox) -> None:
        buf = ReceiveBuffer()
        while True:
            blob = await conn.receive_len_framed(buf, CONTROL_BLOB_CEILING)
            if blob is None:
                return
            self.channel.stats.bytes_local += len(blob) + 4
            await out.send(DataRecord(rank, bytes(blob)))

    async def rank_left(self, rank: int, out: Outbox) -> RankExit | RankFinished:
        return RankExit(rank)

    async def rank_back(self, rank: int, out: Outbox) -> None:
        pass  # the data channel asks the controller; this one only routes again

    async def write(self, item: Outbound) -> None:
        if not isinstance(item, DataRecord):
            raise TypeError(f"the control channel cannot send {type(item).__name__}")
        record = encode_mux_record(MuxKind.DATA, item.payload, self.channel.config.salt, rank=item.rank)
        self.channel.stats.bytes_up += record.nbytes
        await self.channel.upstream.send_chunks(record.chunks)

    async def on_upstream(self, header: MuxHeader, out: Outbox) -> None:
        channel = self.channel
        async with channel.record_buffer(header) as buf:
            kind, payload = await channel.receive_record(header, buf)
            if kind is MuxKind.CONTROL:
                return await channel.on_control(decode_control_msg(payload), out)
            if kind is not MuxKind.DATA:
                raise channel.unexpected_record(kind)
            rank = header.rank
            if rank in channel.conns and rank not in channel.gone:
                await channel.send_to_rank(rank, [payload], len(payload), out)
            # else: the rank already left; its RankExit is on the way or delivered.

    def resume_notice(self) -> RelayControlMsg | None:
        return None  # the coordinator needs no more than the Hello: heartbeats carry on

    async def in_flight(self) -> EncodedFrame | None:
        return None  # a heartbeat lost with the connection is followed by the next

    def upstream_lost(self) -> None:
        """Nothing waits on the connection: the writer's blobs go when they come."""

    def upstream_replaced(self) -> None:
        """Nothing is half received: each record is a whole blob."""

    def asks_again(self) -> list[RelayControlMsg]:
        return []

    def write_goes_on(self) -> bool:
        return False  # a blob is sent again whole, or is stale

    async def go_on_writing(self) -> None:
        raise AssertionError("a control channel's write never goes on over a new connection")


__all__ = ["CONTROL_BLOB_CEILING", "ControlRouter"]
