"""The control channel's role: a byte router between rank blobs and rank-tagged Data records.

Each blob a rank sends (one ControlFrame: heartbeats, signatures, beacons'
answers) goes up tagged with its rank, never parsed; each Data record the
controller sends goes to the rank it names - except the death notice of a rank's
earlier connection, which a quick restart of the rank may reach the relay after:
that one (and its DeclareDead) is not for the new connection.
"""

from __future__ import annotations

import logging

from ..errors import ProtocolError
from ..transport.buffers import ReceiveBuffer
from ..transport.stream import MessageStream
from ..wire.constants import CONTROL_FRAME_HEADER_LEN, CONTROL_FRAME_MAX_PAYLOAD
from ..wire.control_frame import decode_control_frame
from ..wire.liveness import Notice, decode_liveness
from ..wire.mux import (
    DeclareDead,
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

log = logging.getLogger("flodl_trio.relay")

# A control-channel blob is one ControlFrame: 24-byte header + at most 16 MiB.
CONTROL_BLOB_CEILING = CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD


class ControlRouter:
    """The control channel's :class:`~.channels.ChannelRole`."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        # Ranks whose control connection ended, and in which of their lives (HostRanks.life):
        # the coordinator's death notice of that life may still be on its way.
        self._ended: dict[int, int] = {}

    async def read_rank(self, rank: int, conn: MessageStream, out: Outbox) -> None:
        buf = ReceiveBuffer()
        while True:
            blob = await conn.receive_len_framed(buf, CONTROL_BLOB_CEILING)
            if blob is None:
                return
            self.channel.stats.bytes_local += len(blob) + 4
            await out.send(DataRecord(rank, bytes(blob)))

    async def rank_left(self, rank: int, out: Outbox) -> RankExit | RankFinished:
        self._ended[rank] = self.channel.host.life(rank)
        return RankExit(rank)

    def _for_an_ended_life(self, rank: int) -> bool:
        """Whether the coordinator's word on ``rank``'s death is about a connection that has
        ended: the rank connected again (a restarted process is quick) and the controller
        has not let this new life in yet. The coordinator counts a rank dead from its exit
        until it is let back in, so any death notice before that is the old life's, and
        must neither reach nor close the new connection."""
        ended = self._ended.get(rank)
        if ended is None:
            return False
        if self.channel.host.life(rank) > ended:  # let back in since: news from now on is of this life
            del self._ended[rank]
            return False
        return rank in self.channel.conns and rank not in self.channel.gone

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
                msg = decode_control_msg(payload)
                if isinstance(msg, DeclareDead) and self._for_an_ended_life(msg.rank):
                    return self._passed_over(msg.rank, "the controller's DeclareDead")
                return await channel.on_control(msg, out)
            if kind is not MuxKind.DATA:
                raise channel.unexpected_record(kind)
            rank = header.rank
            if self._for_an_ended_life(rank) and self._is_notice(rank, payload):
                return self._passed_over(rank, "the coordinator's death notice")
            if rank in channel.conns and rank not in channel.gone:
                await channel.send_to_rank(rank, [payload], len(payload), out)
            # else: the rank already left; its RankExit is on the way or delivered.

    def _is_notice(self, rank: int, payload: memoryview) -> bool:
        """Whether a coordinator's blob for ``rank`` is a death notice (the only one read:
        its MAC verified first; anything else passes untouched, as every blob does)."""
        try:
            frame = decode_control_frame(payload, self.channel.config.salt, source="the coordinator")
        except ProtocolError:
            return False  # not ours to judge: the rank's own check refuses it
        return isinstance(decode_liveness(frame), Notice)

    def _passed_over(self, rank: int, what: str) -> None:
        log.info("relay %s: %s for rank %d is about its earlier connection, which ended; the rank connected "
                 "again since, and its new connection is left alone", self.channel.config.host_name, what, rank)

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
