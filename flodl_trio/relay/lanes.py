"""How a data relay's HostFrame goes up and its consensus comes down: whole, or in lanes.

Chosen once per channel (:func:`frames_for`), so the channel's tasks run one
code path whatever the lane count:

- :class:`WholeFrames` (``lanes == 1``, flodl's bytes): the HostFrame goes up
  as one signed record and the consensus comes down as one. Being whole, a
  single rank's frame can be forwarded byte for byte, a HostFrame can be
  signed while its last rank frame lands, and the consensus can be cut
  through to the ranks while it arrives.
- :class:`LaneFrames` (the lanes extension, docs/wire.md): the HostFrame goes
  up as its lane frames, each its own signed record, in as many lanes as the
  controller said before its HelloAck; the consensus lanes are joined back
  into one frame in the model's shapes before it is fanned out. That joined
  frame lives in a buffer lent from the channel's pool, which this object owns
  from the round's first consensus lane until the whole frame has gone out.
  A HostFrame's lanes are a :class:`LaneUplink`: cut and signed one at a time
  as they go, and kept, so a controller that is lost before the whole
  consensus came back can be sent every lane again (docs/wire.md, "Resuming").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import attrs
import trio

from ..errors import DesyncError
from ..fold.delta import PendingHostDelta
from ..transport.buffers import SMALL_MESSAGE, BufferPool, ReceiveBuffer
from ..transport.hashing import encode_enveloped_frame
from ..transport.stream import MessageStream
from ..transport.tasks import ChangeSignal
from ..wire.lanes import LaneAssembler, LaneLayout, goes_through_shards, lanes_for
from ..wire.mux import MuxKind
from ..wire.round_frame import EncodedFrame, RoundFrame, decode_round_frame
from ..wire.salt import SessionSalt
from .config import RelayConfig
from .shards import ShardLinks


# Lane frames a relay has up ahead of the consensus lanes that came down: the controller
# finishes lane i only once every relay's lane i is in, so on a shared link a relay that
# ran ahead only takes bandwidth from the lane everyone waits for.
# (benchmarks/scale.py, 4 hosts at 200 Mbit/s: 1.6 s a round without a bound, 1.35 s
# with 2 or 3; at 1 Gbit/s, where the round is CPU-bound, 3 costs nothing and 2 some.)
LANES_AHEAD = 3


class LaneUplink:
    """One HostFrame's lane records: each cut and signed just before it goes (a delta
    round's coded then too), and kept, so all of them can be sent again."""

    def __init__(self, parts: Iterator[RoundFrame], count: int, salt: SessionSalt) -> None:
        self._parts = parts
        self.count = count  # lanes
        self._salt = salt
        self.records: list[EncodedFrame] = []
        self._cut_all = False
        self._cutting = trio.Lock()  # one cut at a time: the lanes are cut in lane order

    async def next_record(self) -> EncodedFrame | None:
        """The next lane's signed record (None: every lane has been cut)."""
        async with self._cutting:
            return await self._cut_next()

    async def record(self, index: int) -> EncodedFrame:
        """Lane ``index``'s signed record, cut now (with the lanes before it) if it was not:
        each lane is signed as its turn nears, so the first goes up while later ones are
        still to sign."""
        async with self._cutting:
            while len(self.records) <= index:
                if await self._cut_next() is None:
                    raise IndexError(f"lane {index} of a HostFrame in {self.count} lanes")
        return self.records[index]

    async def _cut_next(self) -> EncodedFrame | None:
        part = next(self._parts, None)
        if part is None:
            self._cut_all = True
            return None
        record = await encode_enveloped_frame(MuxKind.HOST_FRAME, part, self._salt, frame_mac=False)
        self.records.append(record)
        return record

    async def first_record(self) -> EncodedFrame:
        """Lane 0's record (cut now if it was not): all a round through the shards sends
        the controller."""
        if not self.records:
            await self.next_record()
        return self.records[0]

    async def every_record(self) -> EncodedFrame:
        """All the HostFrame's lane records back to back, as one (the lanes not cut yet
        are cut now): what a new connection sends again."""
        while not self._cut_all:
            await self.next_record()
        chunks = [chunk for record in self.records for chunk in record.chunks]
        return EncodedFrame(chunks, sum(record.nbytes for record in self.records))


class WholeFrames:
    """Without lanes: one record up, one record down, exactly flodl's bytes."""

    whole = True

    def __init__(self, config: RelayConfig) -> None:
        self._config = config

    def small(self, length: int) -> bool:
        """Whether a frame of ``length`` bytes surely goes whole: every frame does."""
        return True

    def must_cut(self, frame: RoundFrame) -> bool:
        return False

    def goes_in_lanes(self, frame: RoundFrame | PendingHostDelta) -> bool:
        return False

    def extra_bytes(self, length: int) -> int:
        """Model-sized memory besides the pool and the fold: none (the consensus lands in a pool buffer)."""
        return 0

    async def record(self, frame: RoundFrame | PendingHostDelta) -> EncodedFrame:
        """The HostFrame as its one signed record (the data plane writes it, and keeps it
        to write again should the controller be lost before it answers)."""
        if isinstance(frame, PendingHostDelta):
            frame = frame.whole()
        return await encode_enveloped_frame(MuxKind.HOST_FRAME, frame, self._config.salt)

    def downlink_buffer(self, length: int) -> ReceiveBuffer | None:
        return None  # a pool buffer, the channel's

    def abandon_partial(self) -> int:
        """Nothing is half received between two records: a whole consensus is one."""
        return 0

    def connection_lost(self) -> None:
        """Nothing waits on the connection between records."""

    @asynccontextmanager
    async def consensus(
        self, payload: memoryview, host_frame_up: bool, signed_for: Callable[[], bool]
    ) -> AsyncIterator[memoryview | None]:
        yield payload  # the record is the consensus, signed by the controller


class LaneFrames:
    """The lanes extension on the relay's side (see the module docstring). A frame that
    goes in one lane goes whole, as flodl sends it, and its consensus comes back whole:
    :attr:`whole` says how the last HostFrame went."""

    def __init__(self, config: RelayConfig, pool: BufferPool, start_task: Callable[..., None] | None = None) -> None:
        self._config = config
        self._pool = pool
        self._start_task = start_task
        # Lanes 1.. of each round to the reduction shards, if the controller named any.
        self.shards = ShardLinks(config, start_task, self) if config.shards and start_task is not None else None
        self.sharded_round = False  # whether the round in progress goes through the shards
        self._joining = trio.Lock()  # the first consensus lane in (from any connection) begins the frame
        assert config.lanes is not None and config.lanes > 1, "the channel's config says the controller's lanes"
        self.count = config.lanes
        self._min_bytes = config.lane_min_bytes  # the controller's: every relay cuts a frame the same way
        self._assembler: LaneAssembler | None = None  # joins the consensus lanes (its layout is the round's)
        self.lane_buffer = ReceiveBuffer()  # a consensus lane lands here: a slice of the frame
        self._joined_in: ReceiveBuffer | None = None  # the pool buffer this round's consensus is joined in
        self._lane_down = ChangeSignal()  # a consensus lane came in, or the connection was lost
        self._lost = False  # the connection broke; until the next one is up
        self.whole = False  # whether the last HostFrame went whole (its consensus comes so)

    def small(self, length: int) -> bool:
        """Whether a frame of ``length`` bytes surely goes whole (its payload, which is
        less, is under two lanes' worth), so a single rank's may be forwarded as it is."""
        return length < 2 * self._min_bytes

    def must_cut(self, frame: RoundFrame) -> bool:
        """Whether a frame of ``frame``'s schema goes in more than one lane: by the bytes
        its shapes stand for, elided tensors counted whole (as the controller counts)."""
        return LaneLayout.of(frame, self.count, self._min_bytes).count > 1

    def goes_in_lanes(self, frame: RoundFrame | PendingHostDelta) -> bool:
        """Whether the HostFrame goes up in lanes (else whole: one lane's worth or less);
        the consensus then comes back the same way."""
        self.whole = not self.must_cut(frame.schema_frame() if isinstance(frame, PendingHostDelta) else frame)
        return not self.whole

    def going_whole(self) -> None:
        """A HostFrame goes up whole (forwarded, or finished ahead: a small one)."""
        self.whole = True

    async def record(self, frame: RoundFrame | PendingHostDelta) -> EncodedFrame:
        """A HostFrame that goes whole, as its one signed record."""
        self.whole = True
        if isinstance(frame, PendingHostDelta):
            frame = frame.whole()
        return await encode_enveloped_frame(MuxKind.HOST_FRAME, frame, self._config.salt)

    def extra_bytes(self, length: int) -> int:
        """About the largest consensus lane a frame of ``length`` bytes comes down in (the
        frame's schema is checked against the lane limits only when it is cut)."""
        return length // lanes_for(length, self.count, self._min_bytes) + SMALL_MESSAGE

    def use_shards(self, addresses: tuple[tuple[str, int], ...]) -> None:
        """The controller named reduction shards mid-session (it fixed them once the
        cluster formed): every round after the one in progress goes through them."""
        if self.shards is not None or self._start_task is None:
            raise DesyncError(f"relay {self._config.host_name}: the controller named shards twice")
        self._config = attrs.evolve(self._config, shards=addresses)
        self.shards = ShardLinks(self._config, self._start_task, self)

    async def uplink(self, frame: RoundFrame | PendingHostDelta) -> LaneUplink:
        """The HostFrame's lanes, to be cut as they go: with shards, lane 0 to the
        controller and the others to their shards (a delta round's lane 0 carrying its
        base digest, when it goes through them: docs/wire.md, "Delta rounds through the
        shards")."""
        schema = frame.schema_frame() if isinstance(frame, PendingHostDelta) else frame
        self.sharded_round = self.shards is not None and goes_through_shards(
            tuple((t.dtype, tuple(t.shape)) for t in schema.tensors), len(self._config.shards))
        if self.sharded_round:  # (it goes in lanes: goes_in_lanes said so with the cluster's count)
            layout = LaneLayout.through_shards(schema, self.count, len(self._config.shards), self._min_bytes)
        else:
            layout = LaneLayout.of(schema, self.count, self._min_bytes)
        if self._assembler is None or self._assembler.layout != layout:
            self._assembler = LaneAssembler(layout)
            # The consensus lanes come back the size these go up (at most): room for the largest, once.
            self.lane_buffer.reserve(layout.max_frame_bytes)
        parts = frame.lanes(layout) if isinstance(frame, PendingHostDelta) else iter(layout.split(frame))
        return LaneUplink(parts, layout.count, self._config.salt)

    async def send(self, uplink: LaneUplink, upstream: MessageStream, sent: Callable[[int], None]) -> None:
        """The HostFrame's lane frames, in lane order, each its own signed record (``sent``
        told each one's size), at most LANES_AHEAD of them ahead of the consensus lanes
        that came down."""
        if self.shards is not None and self.sharded_round:
            return await self.shards.send_round(uplink, upstream, sent)
        lanes = 0
        while lanes < uplink.count:
            await self._wait_for_consensus_lanes(lanes - LANES_AHEAD + 1)
            record = await uplink.next_record()  # None: all cut (a new connection may have taken them)
            if record is None:
                return
            await upstream.send_chunks(record.chunks)
            sent(record.nbytes)
            lanes += 1

    async def join(self, lane: RoundFrame, index: int) -> None:
        """A shard's consensus lane ``index`` (any order)."""
        await self._join(lane, index)

    def drop(self, index: int) -> None:
        """A shard's lane of a decision that a newer one replaced."""
        if self._assembler is not None and self._assembler.begun:
            self._assembler.drop(index)

    def has(self, index: int) -> bool:
        return self._assembler is not None and self._assembler.begun and self._assembler.has(index)

    async def _join(self, lane: RoundFrame, index: int | None = None) -> None:
        """Add a consensus lane to the round's frame (begun by the first lane in);
        ``index``: a shard's lane (they come in any order)."""
        assembler = self._assembler
        if assembler is None:
            raise DesyncError(f"relay {self._config.host_name}: a consensus lane came down with no HostFrame up")
        async with self._joining:
            if not assembler.begun:
                self._joined_in = await self._pool.acquire()
                self._joined_in.reserve(assembler.nbytes)
                assembler.begin(self._joined_in.array(assembler.nbytes))
        assembler.add(lane, index)
        self._lane_down.notify()

    async def _wait_for_consensus_lanes(self, count: int) -> None:
        """Until ``count`` of this round's consensus lanes are in; BrokenResourceError
        once the connection they would come on is lost (the writer then waits for the
        new one, which the lanes not sent yet go up on)."""
        while self._assembler is not None and self._assembler.lanes_in < count:
            if self._lost:
                raise trio.BrokenResourceError("the controller's connection was lost")
            await self._lane_down.wait()

    def connection_lost(self) -> None:
        """The controller's connection broke: a writer waiting for consensus lanes (or for
        the shards' commit) stops."""
        self._lost = True
        self._lane_down.notify()
        if self.shards is not None:
            self.shards.upstream_lost()

    def round_goes_on(self) -> bool:
        """Whether a round through the shards waits for its commit (it outlives a lost controller)."""
        return self.shards is not None and self.sharded_round and not self.shards.committed

    async def sent_again(self, uplink: LaneUplink) -> EncodedFrame:
        """What a new connection carries again of the HostFrame in flight: every lane, or
        with shards lane 0 alone (the shards hold the others)."""
        if self.round_goes_on():
            return await uplink.first_record()
        return await uplink.every_record()

    def downlink_buffer(self, length: int) -> ReceiveBuffer | None:
        """A large consensus lane lands in the lane buffer: the pool's are for frames and the joined consensus."""
        return self.lane_buffer if length > SMALL_MESSAGE else None

    def abandon_partial(self) -> int:
        """The controller's connection was lost with some of a consensus's lanes in: a
        controller that resumes sends every lane of it again (docs/wire.md, "Resuming").
        How many lanes were let go."""
        abandoned = 0
        self._lost = False
        if self.shards is not None:
            self.shards.upstream_back()
        if self.round_goes_on():
            return 0  # the shards' lanes stay: the commit (or a newer decision's lanes) comes
        if self._assembler is not None and self._assembler.begun:
            abandoned = self._assembler.lanes_in
            self._assembler.abandon()
        joined, self._joined_in = self._joined_in, None
        if joined is not None:
            self._pool.release(joined)
        return abandoned

    @asynccontextmanager
    async def consensus(
        self, payload: memoryview, host_frame_up: bool, signed_for: Callable[[], bool]
    ) -> AsyncIterator[memoryview | None]:
        """One consensus lane (its record verified) copied into the round's frame; the
        whole consensus, in the HostFrame's shapes, once every lane is in (None
        before), signed if ``signed_for()`` says a rank reads its MAC. The joined
        frame's pool buffer goes back when the last lane's scope ends.

        It is joined in a pool buffer: the ranks' frames of this round are folded
        already and their next ones come only after it has gone out, so the relay
        holds no model-sized buffer of its own for it (a rank's early frame waits
        for the buffer in its socket meanwhile)."""
        if self.whole:  # the HostFrame went whole: so does its consensus
            yield payload
            return
        assembler = self._assembler
        if assembler is None or not host_frame_up:
            raise DesyncError(f"relay {self._config.host_name}: a consensus lane came down with no HostFrame up")
        lane = decode_round_frame(
            payload, self._config.salt, ceiling=self._config.ceiling, source="the controller's consensus lane",
            authenticated=True,
        )
        if self.shards is not None and self.sharded_round:  # lane 0 commits the round: the shards' lanes are in
            await self._join(lane, 0)
            if not assembler.complete:
                raise DesyncError(f"relay {self._config.host_name}: the controller committed a round with "
                                  f"{assembler.lanes_in} of its {assembler.layout.count} lanes in")
            self.shards.commit()
        else:
            await self._join(lane)
        if not assembler.complete:
            yield None
            return
        try:
            yield await self._finish(assembler, self._config.salt if signed_for() else None)
        finally:
            joined, self._joined_in = self._joined_in, None
            if joined is not None:
                self._pool.release(joined)

    @staticmethod
    async def _finish(assembler: LaneAssembler, salt: SessionSalt | None) -> memoryview:
        if salt is None or assembler.nbytes <= SMALL_MESSAGE:
            return assembler.finish(salt)
        return await trio.to_thread.run_sync(assembler.finish, salt)  # the MAC, off the event loop


def frames_for(
    config: RelayConfig, pool: BufferPool, start_task: Callable[..., None] | None = None
) -> WholeFrames | LaneFrames:
    """The channel's way of moving frames, from the controller's lane count (the channel's
    config has it: :meth:`RelayConfig.with_controllers_lanes`); ``start_task`` runs a
    shard connection's reader beside the channel's tasks."""
    if config.lanes is not None and config.lanes > 1:
        return LaneFrames(config, pool, start_task)
    return WholeFrames(config)


__all__ = ["LaneFrames", "LaneUplink", "WholeFrames", "frames_for"]
