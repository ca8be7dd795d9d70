"""A reduction shard: some lanes of every round, summed where they land.

Task structure::

    serve_listeners --> route(conn) --peek channel magic--> data: a relay's pieces (one per relay)
                                                         \\-> shard: the controller's decisions (one)

    relay session:  reader  --lane frame, verified--> kept (per relay, per lane); ShardAck back
                    writer  <--ShardAck / consensus lanes-- outbox channel
    controller:     Decide{hosts, targets} --> each kept lane summed over ``hosts`` in host
                    order, divided once, signed, queued to every target relay

A shard folds nothing before the controller decides the round's contributors:
every shard then sums the same hosts' pieces in the same order, so the lanes
they send make one consensus, the bytes a deterministic controller would
compute (docs/wire.md, "Shards"). Pieces of hosts left out are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from ..errors import FlodlError, ProtocolError
from ..fold.accumulator import FoldAccumulator, finish_consensus
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import listener_port, peer_host, tune_socket
from ..transport.hashing import encode_enveloped_frame
from ..transport.hello import receive_hello
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import RunOutcome, serving
from ..wire.constants import CHANNEL_MAGIC_DATA, CHANNEL_MAGIC_SHARD, DEFAULT_FRAME_CEILING
from ..wire.lanes import read_lane_tag
from ..wire.mux import (
    Decide,
    MuxKind,
    ShardAck,
    ShardSetup,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.round_frame import EncodedFrame, RoundFrame, decode_round_frame, is_delta_dtype
from ..wire.salt import SessionSalt

log = logging.getLogger("flodl_trio.shard")


def lane_owner(lane: int, shards: int) -> int | None:
    """Which shard reduces lane ``lane`` (None: lane 0, the controller's)."""
    return None if lane == 0 else (lane - 1) % shards


@attrs.define(eq=False)
class _Relay:
    """One relay's connection to this shard, its outbox, and the pieces it sent this round."""

    host: str
    lowest_rank: int
    conn: MessageStream
    outbox: trio.MemorySendChannel[EncodedFrame]
    inbox: trio.MemoryReceiveChannel[EncodedFrame]
    pieces: dict[int, RoundFrame] = attrs.field(factory=dict)  # lane -> its verified frame
    gone: bool = False  # its connection ended

    @property
    def name(self) -> str:
        return f"relay {self.host} (lowest rank {self.lowest_rank})"

    def queue(self, record: EncodedFrame) -> None:
        if self.gone:
            return
        try:
            self.outbox.send_nowait(record)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # too far behind, or gone: its connection ends with it


class ShardHandle:
    """A running shard: its port, counters, and how it ended."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.outcome = RunOutcome()
        self.rounds = 0
        self.pieces_dropped = 0  # pieces of hosts a decision left out
        self.refused = 0  # connections refused at their first record (wrong salt, not a setup or Hello)


@asynccontextmanager
async def open_shard(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    salt: SessionSalt | bytes,
    ceiling: int = DEFAULT_FRAME_CEILING,
    bounds: NetBounds | None = None,
) -> AsyncIterator[ShardHandle]:
    """Serve one reduction shard on ``host:port`` (0: any free port) for the block. The
    controller that names it in ``shards=`` dials it and says which shard it is."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    handle = ShardHandle(listener_port(listeners[0]))
    shard = _Shard(SessionSalt.coerce(salt), ceiling, bounds or NetBounds.from_env(), handle)
    async with serving(lambda: trio.serve_listeners(shard.route, listeners), handle.outcome, log, "shard"):
        yield handle


class _Shard:
    def __init__(self, salt: SessionSalt, ceiling: int, bounds: NetBounds, handle: ShardHandle) -> None:
        self.salt = salt
        self.ceiling = ceiling
        self.bounds = bounds
        self.handle = handle
        self.index: int | None = None
        self.count = 0
        self.relays: dict[int, _Relay] = {}  # lowest rank -> relay

    async def route(self, stream: trio.abc.Stream) -> None:
        tune_socket(stream)
        conn = MessageStream(stream, f"connection from {peer_host(stream)}", self.bounds)
        try:
            with trio.fail_after(self.bounds.channel_magic):
                magic = int.from_bytes(await conn.receive_exactly(4, "the channel-select magic"), "little")
        except (trio.TooSlowError, *CONNECTION_LOST):
            await conn.aclose()
            return
        if magic == CHANNEL_MAGIC_SHARD:
            await self._serve_controller(conn)
        elif magic == CHANNEL_MAGIC_DATA:
            await self._serve_relay(conn)
        else:
            log.warning("shard: %s: unknown channel magic %08x; closed", conn.peer, magic)
            await conn.aclose()

    # -- the controller ------------------------------------------------------

    async def _serve_controller(self, conn: MessageStream) -> None:
        """Its setup, then its decisions, one per round in several lanes. A connection whose
        first record is not a signed ``ShardSetup`` is refused and costs nothing else."""
        try:
            with trio.fail_after(self.bounds.handshake):
                setup = await self._control_record(conn)
            if not isinstance(setup, ShardSetup) or not 0 <= setup.index < setup.count:
                raise ProtocolError(f"the first record must be a ShardSetup with index < count, got {setup}")
        except (FlodlError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            self._refuse(f"controller connection {conn.peer} refused: {exc or 'no ShardSetup in time'}")
            await conn.aclose()
            return
        self.index, self.count = setup.index, setup.count
        conn.peer = "the controller"
        try:
            while True:
                msg = await self._control_record(conn)
                if msg is None:
                    log.info("shard %s: the controller closed its connection", self.index)
                    return
                if isinstance(msg, Decide):
                    await self._decide(msg)
                else:
                    raise ProtocolError(f"the controller sent a shard {type(msg).__name__}")
        finally:
            await conn.aclose()
            self.handle.outcome.end()  # its controller is gone: the shard's work is over

    async def _control_record(self, conn: MessageStream) -> object | None:
        header = await conn.receive_mux_header(SMALL_MESSAGE)
        if header is None:
            return None
        kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), self.salt)
        if kind is not MuxKind.CONTROL:
            raise ProtocolError(f"{conn.peer} sent a {kind.name} record where a control message was due")
        return decode_control_msg(payload)

    async def _decide(self, msg: Decide) -> None:
        """Sum each lane's pieces over the decided hosts, in host order; send the lanes."""
        lanes = sorted({lane for rank in msg.hosts if rank in self.relays for lane in self.relays[rank].pieces})
        for lane in lanes:
            acc = FoldAccumulator()
            for rank in msg.hosts:
                relay = self.relays.get(rank)
                piece = None if relay is None else relay.pieces.get(lane)
                if piece is None:
                    raise ProtocolError(f"the controller decided host {rank} into a round whose lane {lane} "
                                        "it never sent this shard")
                acc.add(piece, relay.name)  # type: ignore[union-attr]
            record = await encode_enveloped_frame(MuxKind.BROADCAST, finish_consensus(acc), self.salt)
            for rank in msg.targets:
                if rank in self.relays:
                    self.relays[rank].queue(record)
        for relay in list(self.relays.values()):
            if relay.lowest_rank not in msg.hosts:
                self.handle.pieces_dropped += len(relay.pieces)
            relay.pieces.clear()
            if relay.gone:
                del self.relays[relay.lowest_rank]
        self.handle.rounds += 1

    # -- the relays ----------------------------------------------------------

    def _refuse(self, message: str) -> None:
        log.warning("shard %s: %s", self.index, message)
        self.handle.refused += 1

    async def _serve_relay(self, conn: MessageStream) -> None:
        try:
            hello = await receive_hello(conn, self.salt, self.bounds)
        except (FlodlError, trio.TooSlowError, *CONNECTION_LOST) as exc:
            self._refuse(f"relay connection {conn.peer} refused: {exc or 'no Hello in time'}")
            await conn.aclose()
            return
        send, receive = trio.open_memory_channel[EncodedFrame](64)
        relay = _Relay(hello.host, min(hello.ranks), conn, send, receive)
        conn.peer = relay.name
        self.relays[relay.lowest_rank] = relay
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._relay_writer, relay)
                await self._relay_reader(relay)
                nursery.cancel_scope.cancel()
        except (FlodlError, *CONNECTION_LOST) as exc:
            log.warning("shard %s: %s dropped: %s", self.index, relay.name, exc)
        finally:
            # Its pieces stay until the round is decided: a relay lost after its lane 0
            # reached the controller is in the round (realized work).
            relay.gone = True
            await conn.aclose()

    async def _relay_writer(self, relay: _Relay) -> None:
        async with relay.inbox:
            async for record in relay.inbox:
                await relay.conn.send_chunks(record.chunks)

    async def _relay_reader(self, relay: _Relay) -> None:
        """Each lane frame verified and kept (a copy: the buffer takes the next), then acknowledged."""
        buf = ReceiveBuffer()
        while True:
            header = await relay.conn.receive_mux_header(self.ceiling)
            if header is None:
                return
            kind, payload = await relay.conn.receive_mux_payload(header, buf, self.salt)
            if kind is not MuxKind.HOST_FRAME:
                raise ProtocolError(f"sent a {kind.name} record to a shard")
            frame = decode_round_frame(bytes(payload), self.salt, ceiling=self.ceiling, source=relay.name,
                                       authenticated=True)
            tag = read_lane_tag(frame)
            if tag is None or self.index is None or lane_owner(tag.index, self.count) != self.index:
                raise ProtocolError(f"sent lane {tag} to shard {self.index} of {self.count}, which does not reduce it")
            if any(is_delta_dtype(t.dtype) for t in frame.tensors):
                raise ProtocolError(f"sent lane {tag.index} of a delta round (coded pseudo-gradients): shards do "
                                    "not reduce delta rounds yet (run them without --shards)")
            if tag.index in relay.pieces:
                raise ProtocolError(f"sent lane {tag.index} twice before the round was decided")
            relay.pieces[tag.index] = frame
            relay.queue(encode_mux_record(MuxKind.CONTROL, encode_control_msg(ShardAck(tag.index)), self.salt))


__all__ = ["ShardHandle", "lane_owner", "open_shard"]
