"""The data channel's role: K local frames in, one HostFrame up, the consensus fanned out.

Its round state is the :class:`~.host_fold.HostFold`, which does no I/O; this
role moves the bytes and tells the fold what happened. A rank frame's path:
:meth:`DataPlane.read_rank` receives and verifies it into a buffer lent from
the channel's pool, folds it (or, a single rank's, forwards it byte for byte),
and queues the host's frame once the fold is complete; the channel's sole
upstream writer hands it back to :meth:`DataPlane.write`, which sends it the
channel's way (:mod:`.lanes`: whole, or in lanes) and gives the buffer back.
The consensus comes down through :meth:`DataPlane.on_upstream`: cut through to
the ranks as it lands (:mod:`.cut_through`) or fanned out once it is in.

Who owns a pooled buffer, at every moment: the task that acquired it, until
it queues an item holding it (``RawHostFrame``, ``SealedHostFrame``); then the
item, until the writer has written it; the channel's ``record_buffer`` scope,
for a consensus record; :class:`~.lanes.LaneFrames`, for a joined consensus.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from functools import partial

import attrs
import trio

from ..errors import ProtocolError
from ..fold.speculative import Speculation, SpeculativeFrame, receive_speculating
from ..transport.arrival import ArrivalWatch, receive_with_followers
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.hashing import RunningMac, hash_as_it_lands
from ..transport.stream import MessageStream
from ..transport.tasks import ChangeSignal, nothing
from ..wire.constants import FINISHED_LENGTH, MAC_LEN, MUX_HEADER_LEN
from ..wire.mux import (
    NO_BROADCAST,
    MuxHeader,
    MuxKind,
    RankAway,
    RankExit,
    RankFinished,
    RankJoin,
    RelayControlMsg,
    Resume,
    ShardBack,
    ShardMoved,
    ShardLost,
    ShardOffer,
    Shards,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
    mux_signed_header,
)
from ..wire.round_frame import EncodedFrame, RoundFrame, check_payloads, decode_round_frame
from .channels import Channel
from .cut_through import stream_consensus
from .host_fold import FoldedHostFrame, HostFold
from .lanes import LaneFrames, LaneUplink, frames_for
from .outbound import DataRecord, Outbound, Outbox, RankNotice, RawHostFrame, SealedHostFrame

log = logging.getLogger("flodl_trio.relay")

MiB = 1 << 20
# What a data relay holds besides its model-sized buffers (the interpreter, numpy,
# trio, small buffers): a relay daemon with 4 KiB frames is ~42 MiB resident.
RELAY_BASELINE = 48 * MiB


@attrs.define
class InFlight:
    """The HostFrame written last whose consensus has not come back, kept (with what
    owns its memory) so a new connection can carry it again: its one record, or its
    lanes (kept until the consensus's last lane is in: a lane's consensus may come
    down while the next lane still goes up)."""

    record: EncodedFrame | LaneUplink
    release: Callable[[], None] = nothing


class DataPlane:
    """The data channel's :class:`~.channels.ChannelRole` (see the module docstring)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.config = channel.config
        self.stats = channel.stats
        self.host = channel.host
        self.pool = channel.pool  # the channel's model-sized buffers (ownership: the module docstring)
        self.fold_changed = ChangeSignal()
        self.fold = HostFold(self.config.host_name, self.config.ranks, on_change=self.fold_changed.notify)
        # Whole records each way, or lanes (:mod:`.lanes`): chosen once, here.
        self.frames = frames_for(self.config, channel.pool, channel.start_side_task)
        # A single rank's frame goes up as it is, unless it must be cut into lanes.
        self.single_rank = len(self.config.ranks) == 1
        self._budget_refused = False
        # What a new connection to a controller that came back needs (Channel.holds only).
        self._in_flight: InFlight | None = None
        self._offer: ShardOffer | None = None  # a new shard offer, sent before the next HostFrame
        self.last_broadcast = NO_BROADCAST  # the MAC of the last Broadcast record taken whole

    # -- the role's side of the channel ---------------------------------------

    async def read_rank(self, rank: int, conn: MessageStream, out: Outbox) -> None:
        """Take the rank's frames until it closes or says it finished."""
        while True:
            length = await conn.receive_length_prefix(self.config.ceiling)
            if length is None:
                return
            if length == FINISHED_LENGTH:  # flodl_trio: "I finished my training" (no frame is empty)
                self.host.finished.add(rank)
                return
            await self._take_frame(rank, length, out)

    async def rank_left(self, rank: int, out: Outbox) -> RankExit | RankFinished:
        """The fold shrinks (which may complete the host's round); a rank that said it
        finished leaves as finished."""
        folded = self.fold.mark_dead(rank)
        if folded is not None:
            await out.send(folded)
        return RankFinished(rank) if rank in self.host.finished else RankExit(rank)

    async def rank_back(self, rank: int, out: Outbox) -> None:
        """Ask the controller to let the rank back in; it stays out of the fold until then."""
        self.fold.rejoin(rank)
        await out.send(RankJoin(rank))

    def shards_said_again(self, addresses: tuple[tuple[str, int], ...]) -> None:
        """A controller started again names the shards its record has: a channel that
        never heard of them (the old controller was lost as it fixed them) takes them
        from its next round; one that has them keeps its own view (it is as new)."""
        if isinstance(self.frames, LaneFrames) and self.frames.shards is None:
            log.info("relay %s: the controller started again names %d reduction shards; rounds go through them "
                     "from the next", self.config.host_name, len(addresses))
            self.frames.use_shards(addresses)

    def offer_shard(self, host: str, port: int) -> None:
        """This host's shard listens again (on ``port``): the offer goes up before the next
        HostFrame, from the writer (the only writer upstream)."""
        self._offer = ShardOffer(host, port)

    async def write(self, item: Outbound) -> None:
        """The host's frame for this round, as the channel's way of moving frames has it
        (after a new shard offer, if one waits)."""
        if isinstance(item, DataRecord | RankNotice):
            raise TypeError(f"the data channel cannot send {type(item).__name__}")
        offer, self._offer = self._offer, None
        if offer is not None:
            record = encode_mux_record(MuxKind.CONTROL, encode_control_msg(offer), self.config.salt)
            await self.channel.upstream.send_chunks(record.chunks)
        self.fold.host_frame_sent()  # before the write: the answer may beat our resumption
        self._let_go_in_flight()
        frames = self.frames
        if isinstance(item, FoldedHostFrame):
            if frames.goes_in_lanes(item.frame):
                assert isinstance(frames, LaneFrames)
                return await self._write_lanes(frames, item)
            record = await frames.record(item.frame)
            release = partial(self.fold.images.give, item.images)
        else:
            if isinstance(frames, LaneFrames):
                frames.going_whole()
            record = item.record if isinstance(item, SealedHostFrame) else encode_mux_record(
                MuxKind.HOST_FRAME, item.body, self.config.salt
            )
            release = partial(self.pool.release, item.buffer)  # the item owned it until written
        # Kept until written; while the channel holds, until its consensus begins to come
        # (a connection that breaks first has it sent again).
        self._in_flight = InFlight(record, release)
        try:
            await self.channel.upstream.send_chunks(record.chunks)
        finally:
            if not self.channel.holds:
                self._let_go_in_flight()
        self._count_round(record.nbytes)

    async def _write_lanes(self, frames: LaneFrames, item: FoldedHostFrame) -> None:
        """The HostFrame as its lanes; the fold images they are cut from are free once
        written, or - while the channel holds - once the whole consensus is in."""
        uplink = await frames.uplink(item.frame)
        self._in_flight = InFlight(uplink, partial(self.fold.images.give, item.images))
        try:
            await frames.send(uplink, self.channel.upstream, self._count_lane)
        finally:
            if not self.channel.holds:
                self._let_go_in_flight()
        self._count_round(0)

    def _count_lane(self, nbytes: int) -> None:
        self.stats.lanes_up += 1
        self.stats.bytes_up += nbytes

    def _let_go_in_flight(self) -> None:
        """The HostFrame's consensus is coming: nothing will send it again."""
        held, self._in_flight = self._in_flight, None
        if held is not None:
            held.release()

    def resume_notice(self) -> RelayControlMsg | None:
        return Resume(self.last_broadcast, awaiting=self.fold.host_frame_up, resends=self._in_flight is not None)

    def asks_again(self) -> list[RelayControlMsg]:
        """The returns the controller has not answered: one that comes back may not know of them."""
        return [RankJoin(rank) for rank in sorted(self.fold.joining)]

    async def in_flight(self) -> EncodedFrame | None:
        held = self._in_flight
        if held is None:
            return None
        if isinstance(held.record, LaneUplink):
            assert isinstance(self.frames, LaneFrames)
            return await self.frames.sent_again(held.record)
        return held.record

    def write_goes_on(self) -> bool:
        """A round through the shards whose commit has not come: its pieces stay on the
        shards, lane 0 went again with the resumption, and the writer waits for the commit
        on the new connection (docs/wire.md, "Shards through a lost controller")."""
        return isinstance(self.frames, LaneFrames) and self.frames.round_goes_on()

    async def go_on_writing(self) -> None:
        assert isinstance(self.frames, LaneFrames) and self.frames.shards is not None
        try:
            await self.frames.shards.finish_round(self.channel.upstream)
        finally:
            if not self.channel.holds:
                self._let_go_in_flight()
        self._count_round(0)

    def upstream_lost(self) -> None:
        """The writer stops waiting for consensus lanes on the lost connection."""
        self.frames.connection_lost()

    def upstream_replaced(self) -> None:
        """Lanes of a consensus that came in on the lost connection are void: a
        controller that resumes sends all of them again."""
        self.stats.consensus_lanes_abandoned += self.frames.abandon_partial()

    async def on_upstream(self, header: MuxHeader, out: Outbox) -> None:
        """A record from the controller: a consensus (cut through to the ranks as it lands
        when it is large and whole) or a control message."""
        # The kind byte is not authenticated yet: it only picks the path. A record
        # that is not what it claims fails its MAC before any rank sees its end.
        if header.kind == MuxKind.BROADCAST and self.frames.whole:
            self._let_go_in_flight()  # (its buffer may be the one this record lands in)
        # Cut through only when the controller's connection is the end of the channel if
        # it breaks: a consensus half fanned out could not be taken back for a resumption.
        if (
            header.kind == MuxKind.BROADCAST and self.frames.whole and self.fold.host_frame_up
            and header.length > SMALL_MESSAGE and not self.channel.holds
        ):
            async with self.channel.record_buffer(header) as buf:
                return await self._cut_through_broadcast(header, buf, out)
        lane_buffer = self.frames.downlink_buffer(header.length)
        if lane_buffer is not None:
            return await self._on_record(header, lane_buffer, out)
        async with self.channel.record_buffer(header) as buf:
            await self._on_record(header, buf, out)

    # -- frames in -------------------------------------------------------------

    async def _take_frame(self, rank: int, length: int, out: Outbox) -> None:
        """Receive, verify and fold (or forward) one frame of ``rank``'s.

        A function of its own so nothing model-sized it touched (the fold a
        HostFrame was finished ahead from, say) outlives it while the reader
        waits for the rank's next frame. Pool buffers go back on the way out
        unless a queued item took them over.
        """
        if rank in self.fold.joining and rank not in self.host.elastic:
            raise ProtocolError(
                f"relay {self.config.host_name}: rank {rank} came back and sent a frame without calling join() "
                "first (a restarted trainer must call client.join(params, buffers) before its first window)"
            )
        single = self._forwards(length)
        if self.config.deterministic and not single:
            await self._wait_for_turn(rank)
        with contextlib.ExitStack() as owned:
            buf = await self.pool.acquire()
            owned.callback(self.pool.release, buf)
            if single and not self.fold.waiting_to_enter(rank):
                item, frame = await self._receive_single(rank, buf, length)
                if not self.frames.must_cut(frame):
                    self.fold.forward(rank)
                    self._count_frame(length)
                    self.stats.rounds_finished_ahead += isinstance(item, SealedHostFrame)
                    owned.pop_all()  # the queued item owns the buffer now
                    await self._queue_owning(out, item)
                    return
                # Small on the wire only because its tensors are elided (a non-root's
                # broadcast_from_root): its schema goes in lanes, so it is folded.
                speculation = Speculation()
            else:
                frame, speculation = await self._receive_folding(rank, buf, length)
            if speculation.frame is not None:
                owned.callback(self.pool.release, speculation.frame.buffer)
            if speculation.record is not None and speculation.frame is not None and self.fold.complete_ahead(rank, speculation.frame.acc):
                self._count_frame(length, frame)
                self.stats.rounds_finished_ahead += 1
                owned.pop_all()
                self.pool.release(buf)
                await self._queue_owning(out, SealedHostFrame(speculation.record, speculation.frame.buffer))
                return
            folded = self.fold.deposit(rank, frame)
            self._count_frame(length, frame)
            if folded is not None:
                await out.send(folded)
            await self._drop_expelled(out)

    def _forwards(self, length: int) -> bool:
        """Whether a frame of ``length`` bytes goes up as it is: a single rank's, unless it
        may have to be cut into lanes."""
        return self.single_rank and self.frames.small(length)

    async def _wait_for_turn(self, rank: int) -> None:
        """Deterministic mode: leave the frame in its socket until the ranks before
        ``rank`` are folded (or gone), so the host's sum is taken in rank order."""
        while not self.fold.may_fold_now(rank):
            await self.fold_changed.wait()

    def _count_frame(self, length: int, frame: RoundFrame | None = None) -> None:
        self.stats.bytes_local += length + 4
        # Once a verified frame proved the model's size, let frames arrive two at a
        # time (a single rank has nothing to overlap), if memory allows.
        if frame is not None and self.pool.size < self.pool.limit and not self._forwards(length) and not self._budget_refused:
            self._lend_second_buffer(length, frame)

    def _lend_second_buffer(self, length: int, frame: RoundFrame) -> None:
        """Add a receive buffer of ``length`` bytes if the relay's model-sized memory
        (two receive buffers and the f32 fold) plus its baseline fits its budget;
        decided once, from the first verified frame."""
        budget = self.config.memory_budget_for(length)
        fold = 4 * sum(math.prod(t.shape) for t in frame.tensors)
        lane = self.frames.extra_bytes(length)
        needed = 2 * length + fold + lane + RELAY_BASELINE
        if needed > budget:
            self._budget_refused = True
            log.info(
                "relay %s: one receive buffer: with a second, %.0f MiB each, and the %.0f MiB f32 fold%s the relay "
                "would need %.0f MiB, over its memory budget of %.0f MiB (frames are received one at a time)",
                self.config.host_name, length / MiB, fold / MiB, " (and a consensus lane's buffer)" if lane else "",
                needed / MiB, budget / MiB,
            )
            return
        self.pool.add(ReceiveBuffer(length))
        self.stats.receive_buffers = self.pool.size

    async def _queue_owning(self, out: Outbox, item: RawHostFrame | SealedHostFrame) -> None:
        """Queue an item that owns a pool buffer; the buffer comes back if it never gets queued."""
        try:
            await out.send(item)
        except BaseException:
            self.pool.release(item.buffer)
            raise

    async def _receive_verified(
        self, rank: int, buf: ReceiveBuffer, length: int, watch: ArrivalWatch | None = None, *, forwarded: bool = False
    ) -> tuple[memoryview, RoundFrame]:
        """``rank``'s frame, its MAC computed as the bytes land and checked at the end.

        On the local leg the frame is not signed: it is taken as it is, unless it
        is ``forwarded`` upstream byte for byte - then the relay computes its MAC
        the same way and writes it where the rank left zeros.
        """
        conn = self.channel.conns[rank]
        salt = self.config.salt
        what = f"rank {rank}'s {length}-byte frame"
        source = f"rank {rank} on host {self.config.host_name}"
        mac: bytes | None = None
        if conn.signed_frames or forwarded:  # the MAC, to check or to write in, hashed as the bytes land
            body, mac = await conn.receive_round_frame_body(buf, length, salt, what, watch)
        else:
            body = await conn.receive_into_buffer(buf, length, what, None, watch)
        unsigned = not conn.signed_frames
        frame = decode_round_frame(
            body, salt, ceiling=self.config.ceiling, source=source, mac_of_body=mac, authenticated=unsigned
        )
        if unsigned and mac is not None:
            body[-MAC_LEN:] = mac
        # Its bytes are authentic; now they must also make sense (checked here, at
        # the first hop, so a single rank's frame is not forwarded unchecked).
        check_payloads(frame, source)
        return body, frame

    async def _receive_folding(self, rank: int, buf: ReceiveBuffer, length: int) -> tuple[RoundFrame, Speculation]:
        """Receive and verify ``rank``'s frame; a large one that is the last the host
        waits for has its HostFrame computed and signed beside it (not with lanes:
        the HostFrame goes up as lane frames, signed as they are cut)."""
        if length <= SMALL_MESSAGE or not self.frames.small(length):
            return (await self._receive_verified(rank, buf, length))[1], Speculation()
        watch = ArrivalWatch(length)

        def begin() -> SpeculativeFrame | None:
            # Nothing else arrives now: the pool's other buffer is free to hold the output.
            out = self.pool.try_acquire()
            if out is None:
                return None
            frame = SpeculativeFrame(self.fold.acc, divide=False, in_length=length, out=out)
            if not frame.supported:
                self.pool.release(out)
                return None
            return frame

        (_body, frame), speculation = await receive_speculating(
            watch, partial(self._receive_verified, rank, buf, length, watch),
            is_last=partial(self.fold.only_missing, rank), begin=begin, changes=self.fold_changed,
            buf=buf, kind=MuxKind.HOST_FRAME, salt=self.config.salt,
        )
        return frame, speculation

    async def _receive_single(
        self, rank: int, buf: ReceiveBuffer, length: int
    ) -> tuple[RawHostFrame | SealedHostFrame, RoundFrame]:
        """A single rank's frame goes up byte for byte as the host's frame. A large one
        has its HostFrame record's MAC computed over the same bytes as they land
        (all but the frame's own tag, fed last: on the local leg the relay only
        knows it once the frame is in), so the record is ready the moment the
        frame is."""
        receive = partial(self._receive_verified, rank, buf, length, forwarded=True)
        if length <= SMALL_MESSAGE:
            body, frame = await receive()
            return RawHostFrame(body, buf), frame
        watch = ArrivalWatch(length)
        signed = mux_signed_header(MuxKind.HOST_FRAME, length)
        record_mac = self.config.salt.hmac()
        record_mac.update(signed)
        running = RunningMac(record_mac, length - MAC_LEN)
        (body, frame), (hashed_all,) = await receive_with_followers(
            watch, partial(receive, watch), partial(hash_as_it_lands, buf, watch, running)
        )
        if not hashed_all:
            return RawHostFrame(body, buf), frame
        record_mac.update(body[-MAC_LEN:])
        return SealedHostFrame(EncodedFrame([signed + running.tag(), body], MUX_HEADER_LEN + length), buf), frame

    # -- records from the controller -------------------------------------------

    async def _on_control(self, msg: RelayControlMsg, out: Outbox) -> None:
        if isinstance(msg, Shards):
            if not isinstance(self.frames, LaneFrames):
                raise ProtocolError(f"relay {self.config.host_name}: Shards, and the controller said one lane")
            log.info("relay %s: the controller fixed %d reduction shards; rounds go through them from the next",
                     self.config.host_name, len(msg.addresses))
            return self.frames.use_shards(msg.addresses)
        if isinstance(msg, ShardLost | ShardBack | ShardMoved):
            shards = self.frames.shards if isinstance(self.frames, LaneFrames) else None
            if shards is None:
                raise ProtocolError(f"relay {self.config.host_name}: {type(msg).__name__}, and the controller named "
                                    "no shards")
            if isinstance(msg, ShardBack):
                return shards.shard_back(msg.shard, (msg.host, msg.port))
            if isinstance(msg, ShardMoved):
                return await shards.shard_moved(msg.shard, (msg.host, msg.port))
            return await shards.shard_lost(msg.shard)
        if isinstance(msg, RankAway):
            return await self._on_away(msg.rank, out)
        if not isinstance(msg, RankJoin):
            return await self.channel.on_control(msg, out)
        if self.fold.approve(msg.rank):
            self.host.revive(msg.rank)
            log.info("relay %s: rank %d is let back in; it enters at the next window start", self.config.host_name, msg.rank)
            if self.fold.idle and msg.rank in self.fold.held:  # its first frame beat this answer: in now
                await self._enter_approved(out)

    def _count_round(self, nbytes: int) -> None:
        self.stats.rounds += 1
        self.stats.fold_images_reused = self.fold.images.reused
        self.stats.bytes_up += nbytes

    async def _cut_through_broadcast(self, header: MuxHeader, buf: ReceiveBuffer, out: Outbox) -> None:
        """Fan a large whole consensus out while it arrives, instead of after (:mod:`.cut_through`)."""
        targets = self.fold.consensus_arrived()
        await self._enter_approved(out)

        async def rank_failed(rank: int, why: str) -> None:
            await self.channel.drop(rank, out, why)

        await stream_consensus(self.channel.upstream, header, buf, self.config.salt, self.channel.conns, targets, rank_failed)
        self.fold.learn_base(buf.view(header.length))  # verified whole by now
        self.stats.bytes_down += header.length
        self.stats.broadcasts_streamed += 1

    async def _on_record(self, header: MuxHeader, buf: ReceiveBuffer, out: Outbox) -> None:
        kind, payload = await self.channel.receive_record(header, buf)
        if kind is MuxKind.CONTROL:
            return await self._on_control(decode_control_msg(payload), out)
        if kind is not MuxKind.BROADCAST:
            raise self.channel.unexpected_record(kind)
        if not self.frames.whole:
            self.stats.consensus_lanes += 1
        async with self.frames.consensus(payload, self.fold.host_frame_up, self._a_waiting_rank_reads_macs) as consensus:
            if consensus is not None:  # None: more lanes to come
                # A consensus in lanes is where a resumption starts from once its last lane is in.
                self.last_broadcast = header.tag
                self._let_go_in_flight()
                await self._fan_out(consensus, out)

    def _a_waiting_rank_reads_macs(self) -> bool:
        """Ranks on the local leg take frames unsigned: a joined consensus is signed only for one on TCP."""
        return any(self.channel.conns[r].signed_frames for r in self.fold.awaiting_reply if r in self.channel.conns)

    async def _fan_out(self, payload: memoryview, out: Outbox) -> None:
        """Send the consensus to every rank waiting for it, concurrently."""
        targets = self.fold.consensus_arrived()
        self.fold.learn_base(payload)
        await self._enter_approved(out)
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(self.channel.send_to_rank, target, [payload], len(payload), out)

    async def _on_away(self, rank: int, out: Outbox) -> None:
        """The controller says ``rank`` is dead but may come back (this relay was
        restarted, or the cluster formed without it). If it already connected here,
        it is a rank coming back: out of the barrier, and the controller is asked."""
        if rank not in self.channel.ranks:
            raise ProtocolError(f"relay {self.config.host_name}: RankAway for rank {rank}, not one of ours")
        self.host.declare_away(rank)
        if rank in self.fold.entering or rank in self.fold.fresh:
            # Let back in by a controller that was lost before its record said so: the
            # one now in charge has it dead, and it will not ask for its state again.
            return await self.channel.drop(
                rank, out, "dropped: its return was let in by a controller that was lost before it recorded that; "
                "start it again to come back", report=False,
            )
        if rank in self.channel.conns and rank not in self.channel.gone:
            self.fold.mark_dead(rank)  # it has sent nothing: it waits for its state first
            self.fold.rejoin(rank)
            log.info("relay %s: rank %d connected before the controller said it was away; asking it back in",
                     self.config.host_name, rank)
            await out.send(RankJoin(rank))
        else:
            await self.channel.drop(rank, out, "is away (it may come back)", report=False)

    async def _enter_approved(self, out: Outbox) -> None:
        """Ranks let back in join the barrier of the round this consensus opens."""
        folded = self.fold.enter_approved()
        if folded is not None:
            await out.send(folded)
        await self._drop_expelled(out)

    async def _drop_expelled(self, out: Outbox) -> None:
        """Drop the ranks whose folded frames a later one proved wrong (their part of
        the round's sum is gone already; the round may complete without them now)."""
        for rank, why in self.fold.take_expelled().items():
            await self.channel.drop(rank, out, f"dropped: {why}")




__all__ = ["DataPlane", "RELAY_BASELINE"]
