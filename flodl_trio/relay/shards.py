"""A data relay's side of the reduction shards (docs/wire.md, "Shards" and "A lost shard").

A round in lanes goes up as: lane 0 to the controller, which decides the
round's contributors from the lane 0s and tells the shards; ``Pieces{round}``
and lanes k >= 1 to their shards (all shards at once), meanwhile; each shard
marks the decision (``Decided{d}``) and sends a lane's consensus as soon as
every decided host's piece of it is in; once every lane of the latest decision
is in, ``LanesIn{d}`` to the controller, whose consensus lane 0 then commits
the round. Until that commit the channel's writer stays here: a shard
the controller says is lost has its lanes sent again to their new owner, and
lanes of a decision that a newer one replaced are taken back out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from ..errors import ConnectFailed, FlodlError, ProtocolError
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import connect_with_retry
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal, Turns
from ..wire.constants import CHANNEL_MAGIC_DATA
from ..wire.lanes import lane_owner, read_lane_tag
from ..wire.mux import (
    EXTENSIONS_MARK,
    Decided,
    Hello,
    LanesIn,
    MuxHeader,
    MuxKind,
    Pieces,
    RelayControlMsg,
    ShardAck,
    ShardAlive,
    ShardLost,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.round_frame import EncodedFrame, RoundFrame, decode_round_frame
from .config import RelayConfig

# How long one lane's write holds the host's link for the next lanes (ShardLinks._turns):
# a shard that stops reading delays the others' lanes this long at most.
LANE_TURN_PATIENCE_S = 1.0

log = logging.getLogger("flodl_trio.relay")

# Each shard's consensus lanes land in a buffer of their own (so they are received at
# once) while these buffers total at most this; above it (a large model: 4 shards of a
# 64 MiB model would take 32 MiB), they share the channel's one lane buffer, which keeps
# the relay within 2 x model + 150 MiB (measured: 320 MiB, then 244, at 64 MiB of f32).
OWN_LANE_BUFFERS_MAX = 16 << 20


def _nothing(nbytes: int) -> None:
    pass


class ShardLanes(Protocol):
    """What the shard links need of the consensus being joined (the channel's LaneFrames)."""

    lane_buffer: ReceiveBuffer  # where a consensus lane lands (room for the largest, once)

    async def join(self, lane: RoundFrame, index: int) -> None: ...

    def drop(self, index: int) -> None: ...

    def has(self, index: int) -> bool: ...


class SignedLanes(Protocol):
    """A HostFrame's lane records, each signed when first asked for (a LaneUplink)."""

    count: int

    async def record(self, index: int) -> EncodedFrame: ...


class _NoLanes:
    count = 0

    async def record(self, index: int) -> EncodedFrame:
        raise IndexError(f"lane {index}: no round is in progress")


class ShardLinks:
    """The channel's connections to the shards, and where its round stands with them."""

    def __init__(self, config: RelayConfig, start_task: Callable[..., None], lanes: ShardLanes) -> None:
        self._config = config
        self._start_task = start_task
        self._lanes = lanes
        self.conns: dict[int, MessageStream] = {}  # live shards' connections, by index
        self.lost: set[int] = set()  # shards the controller said are lost
        self._told: dict[int, set[int]] = {}  # per shard: the lost shards it was told of
        self.changed = ChangeSignal()  # an ack, a lane, a mark, a lost shard, the commit
        self._round = 0  # this relay's rounds sent to the shards (Pieces)
        self._sent_to: dict[int, int] = {}  # lane -> the shard it went to this round
        self._decision: dict[int, int] = {}  # shard -> the decision its lanes now are
        self.want = -1  # the latest decision any shard marked
        self._lane_decision: dict[int, int] = {}  # lane joined -> its decision
        self._count = 0  # lanes this round
        self.committed = False
        self._connected = False
        # With large lanes, one consensus lane is received at a time, into the lane buffer,
        # whichever shard sends it: a buffer per shard would cost a lane's size per shard.
        self._receiving = trio.Lock()
        self._failed: set[int] = set()  # shards whose connection failed here, not yet said lost
        self._told_controller: set[int] = set()  # ... and told to the controller
        self._back: dict[int, tuple[str, int]] = {}  # lost shards served again from the next round, and where
        self._uplink: SignedLanes = _NoLanes()  # the round's lanes
        # This relay's place among the hosts (ranks are numbered host by host): where its
        # turns start (see _turns).
        self._place = min(config.ranks) // len(config.ranks)
        self._sent: Callable[[int], None] = _nothing  # counts the bytes each one took
        self._reported = -1  # the newest decision whose LanesIn went to the controller
        self._retell = False  # a new controller connection: say again every shard lost here
        self._upstream_down = False  # the controller's connection is lost, the next not up yet

    @property
    def count(self) -> int:
        return len(self._config.shards)

    def owner(self, lane: int) -> int:
        owner = lane_owner(lane, self.count, self.lost)
        assert owner is not None
        return owner

    def _record(self, msg: RelayControlMsg) -> EncodedFrame:
        return encode_mux_record(MuxKind.CONTROL, encode_control_msg(msg), self._config.salt)

    # -- the uplink, until the round commits ----------------------------------

    async def send_round(self, uplink: SignedLanes, upstream: MessageStream, sent: Callable[[int], None]) -> None:
        """Lane 0 to the controller, then lanes 1.. to their shards, and ``LanesIn`` once
        the latest decision's lanes are all in; until the commit. Lane 0 goes first so the
        round is decided while the pieces go up, and each shard sends a lane down as soon
        as every host's piece of it is in. Each lane is signed just before its turn."""
        await self._connect()
        await self._take_back_served_again()
        self._round += 1
        self._count = uplink.count
        self._uplink, self._sent = uplink, sent
        self._sent_to.clear()
        self._lane_decision.clear()
        self.want, self.committed, self._reported = -1, False, -1
        await self._tell_failed(upstream)
        first = await uplink.record(0)
        await upstream.send_chunks(first.chunks)
        sent(first.nbytes)
        await self.finish_round(upstream)

    async def finish_round(self, upstream: MessageStream) -> None:
        """The round's pieces to their owners, and ``LanesIn`` to the controller on
        ``upstream`` for each newer decision whose lanes are all in; until the commit.
        ClosedResourceError once ``upstream`` is lost: the round goes on over the next
        connection (the pieces stay on the shards, which hold for a controller that keeps
        a record; docs/wire.md, "Shards through a lost controller")."""
        while True:
            change = self.changed.next_change()  # (a shard lost while this writes is not missed)
            await self._send_missing(self._uplink, self._sent)
            if self.committed:
                return
            if upstream.closed:
                raise trio.ClosedResourceError("the controller's connection was lost before the round's commit")
            await self._tell_failed(upstream)
            if self.want > self._reported and self._all_in():
                self._reported = self.want
                await upstream.send_chunks(self._record(LanesIn(self.want)).chunks)
            await change.wait()

    def upstream_lost(self) -> None:
        """The controller's connection broke: the one that replaces it is told again which
        shards are lost here, and which decision's lanes are in."""
        self._reported, self._retell, self._upstream_down = -1, True, True
        self.changed.notify()

    def upstream_back(self) -> None:
        """A new connection to the controller is up (and resumed)."""
        self._upstream_down = False
        self.changed.notify()

    async def _tell_failed(self, upstream: MessageStream) -> None:
        """Shards whose connection failed here, told to the controller once each; after a
        new connection, every shard lost here (a controller started again may not know)."""
        if self._retell:
            self._retell, self._told_controller = False, set()
            news = sorted(self._failed | self.lost)
        else:
            news = sorted(self._failed - self._told_controller - self.lost)
        for shard in news:
            self._told_controller.add(shard)
            await upstream.send_chunks(self._record(ShardLost(shard)).chunks)

    def _all_in(self) -> bool:
        return all(self._lanes.has(lane) and self._lane_decision.get(lane) == self.want for lane in range(1, self._count))

    async def _send_missing(self, uplink: SignedLanes, sent: Callable[[int], None]) -> None:
        """Each lane not yet sent to its owner now (every lane at first; a lost shard's
        later), in turns on this host's link (see :meth:`_turns`)."""
        by_shard: dict[int, list[int]] = {}
        for lane in range(1, uplink.count):
            owner = self.owner(lane)
            if self._sent_to.get(lane) != owner:
                by_shard.setdefault(owner, []).append(lane)
                self._sent_to[lane] = owner
        if not by_shard:
            return
        schedule = self._turns(by_shard)
        turns = Turns(schedule, LANE_TURN_PATIENCE_S)
        async with trio.open_nursery() as nursery:
            for shard, lanes in by_shard.items():
                tickets = [ticket for ticket, writer in enumerate(schedule) if writer == shard]
                nursery.start_soon(self._send_lanes, shard, uplink, lanes, sent, turns, tickets)

    def _turns(self, by_shard: dict[int, list[int]]) -> list[int]:
        """The shard of each turn on this host's link: a lane to each shard in turn,
        starting with the shard after this relay's place among the hosts, then each
        one's next lane, and so on. Every relay starting at a different shard, at each
        moment the relays send to different shards, so every host's link receives about
        one lane at a time, and every shard has its first lane from every host after
        1/n of the upload and can fan it out while the rest goes up. (All lanes at once,
        every relay's first lanes crowded the same links, and the shards' fan-out began
        late: docs/performance.md, "Lanes in turns".)"""
        order = sorted(by_shard, key=lambda shard: (shard - self._place - 1) % max(self.count, 1))
        return [shard for slot in range(max(len(lanes) for lanes in by_shard.values()))
                for shard in order if slot < len(by_shard[shard])]

    async def _send_lanes(
        self, shard: int, uplink: SignedLanes, lanes: list[int], sent: Callable[[int], None], turns: Turns,
        tickets: list[int],
    ) -> None:
        """A shard's lanes after the round's mark (and the lost shards it has not heard of
        from us: it takes their lanes), each in its turn. A write that fails (the
        connection broke, or stalled past the write bound) closes the connection: its
        reader then tells the controller, and waits (bounded) for its word."""
        try:
            conn = self.conns.get(shard)
            if conn is None:
                return
            told = self._told.setdefault(shard, set())
            head = [self._record(ShardLost(lost)) for lost in sorted(self.lost - told)]
            told |= self.lost
            try:
                for record in [*head, self._record(Pieces(self._round))]:
                    await conn.send_chunks(record.chunks)
                    sent(record.nbytes)
                for lane, ticket in zip(lanes, tickets):
                    record = await uplink.record(lane)  # signed before its turn, not while holding it
                    async with turns.turn(ticket):
                        await conn.send_chunks(record.chunks)
                    sent(record.nbytes)
            except (*CONNECTION_LOST, trio.ClosedResourceError):
                if shard not in self.lost:
                    await conn.aclose()  # its reader ends with it
        finally:
            turns.give_up(*tickets)  # (those it did not take: its link is gone)

    # -- what the controller says ---------------------------------------------

    async def shard_lost(self, shard: int) -> None:
        """The controller says ``shard`` is lost: nothing more is taken from it, and its
        lanes of a round not yet committed go to their new owner."""
        if not 0 <= shard < self.count:
            raise ProtocolError(f"relay {self._config.host_name}: ShardLost for shard {shard} of {self.count}")
        self._back.pop(shard, None)  # served again and lost again before this relay took it back
        if shard in self.lost:
            return
        self.lost.add(shard)
        if len(self.lost) == self.count:
            raise ProtocolError(f"relay {self._config.host_name}: every one of the {self.count} shards is lost")
        log.warning("relay %s: shard %d is lost; its lanes go to the next live shard", self._config.host_name, shard)
        conn = self.conns.pop(shard, None)
        if conn is not None:
            await conn.aclose()  # a write to it in progress ends; its reader ends
        self.changed.notify()

    def shard_back(self, shard: int, address: tuple[str, int]) -> None:
        """The controller says lost ``shard`` is served again at ``address``: from this
        relay's next round (the one in progress keeps the owners it began with)."""
        if not 0 <= shard < self.count or shard not in self.lost:
            raise ProtocolError(f"relay {self._config.host_name}: ShardBack for shard {shard} of {self.count}, "
                                f"which is not lost (lost: {sorted(self.lost)})")
        self._back[shard] = address

    async def shard_moved(self, shard: int, address: tuple[str, int]) -> None:
        """The controller serves ``shard`` itself now, at ``address`` (every other shard was
        lost, or it is the one this relay knew lost and the controller started again): at
        once, its lanes of the round in progress go there, dialed now (docs/wire.md, "When
        every shard is lost")."""
        if not 0 <= shard < self.count:
            raise ProtocolError(f"relay {self._config.host_name}: ShardMoved for shard {shard} of {self.count}")
        self._back.pop(shard, None)
        self._readdress(shard, address)
        log.warning("relay %s: shard %d is served by the controller now, at %s:%d", self._config.host_name, shard,
                    *address)
        if not self._connected:
            return  # dialed with the others before this relay's first round
        old = self.conns.get(shard)
        await self._dial_or_report(shard)  # (its connection replaces the old one: the old one's reader ends quietly)
        if old is not None:
            await old.aclose()
        for lane, owner in list(self._sent_to.items()):
            if owner == shard:
                del self._sent_to[lane]  # sent again, to it
        self.changed.notify()

    def _readdress(self, shard: int, address: tuple[str, int]) -> None:
        """Shard ``shard`` is a new process at ``address``: live, and told nothing yet."""
        self.lost.discard(shard)
        self._failed.discard(shard)
        self._told_controller.discard(shard)
        self._told.pop(shard, None)  # it hears of the lost ones with its first lanes
        for told in self._told.values():
            told.discard(shard)
        self._decision.pop(shard, None)
        shards = list(self._config.shards)
        shards[shard] = address
        self._config = attrs.evolve(self._config, shards=tuple(shards))

    async def _dial_or_report(self, shard: int) -> None:
        """Dial ``shard``; one that cannot be reached is told to the controller (which loses it)."""
        try:
            await self._dial(shard)
        except (ConnectFailed, *CONNECTION_LOST) as exc:
            log.warning("relay %s: shard %d could not be reached (%s)", self._config.host_name, shard, exc)
            self.conns.pop(shard, None)
            self._failed.add(shard)

    async def _take_back_served_again(self) -> None:
        """Between rounds: each shard served again owns its lanes again, at its new address."""
        back, self._back = self._back, {}
        for shard, address in sorted(back.items()):
            self._readdress(shard, address)
            log.info("relay %s: shard %d is served again, at %s:%d", self._config.host_name, shard, *address)
            await self._dial_or_report(shard)

    def commit(self) -> None:
        """The controller's lane 0 came: the round is over."""
        self.committed = True
        self.changed.notify()

    # -- the shards' connections ----------------------------------------------

    async def _connect(self) -> None:
        """Dial every shard once, with this relay's Hello, and start each one's reader. A
        shard this relay cannot reach is told to the controller, as one whose connection
        fails later is: a shard out of this relay's reach costs that shard, not the relay."""
        if self._connected:
            return
        self._connected = True
        for index in range(self.count):
            if index not in self.lost:
                await self._dial_or_report(index)

    async def _dial(self, index: int) -> None:
        """Dial shard ``index`` with this relay's Hello, and start its reader."""
        config = self._config
        host, port = config.shards[index]
        hello = self._record(Hello(config.host_name, config.ranks, [EXTENSIONS_MARK]))
        stream = await connect_with_retry(host, port, f"relay {config.host_name} shard {index}", config.bounds,
                                          config.connect)
        conn = MessageStream(stream, f"shard {index} {host}:{port}", config.bounds)
        await conn.send_chunks([CHANNEL_MAGIC_DATA.to_bytes(4, "little"), *hello.chunks])
        self.conns[index] = conn
        self._start_task(self._read, index, conn)

    async def _read(self, index: int, conn: MessageStream) -> None:
        """A shard's acks, marks and consensus lanes. Its connection ending, or bytes from
        it that break the protocol, are told to the controller (``ShardLost``), and are
        the end of the channel unless the controller says within the handshake bound
        that the shard is lost (it then has its lanes reduced elsewhere)."""
        try:
            await self._read_records(index, conn, ReceiveBuffer())
        except (*CONNECTION_LOST, trio.ClosedResourceError, FlodlError) as exc:
            why: BaseException | str = exc
        else:
            why = "it closed its connection"
        finally:
            await conn.aclose()
        if index in self.lost or self.conns.get(index, conn) is not conn:
            return  # lost, or moved (its new connection has its own reader)
        # Told to the controller (which then loses the shard for everyone): bad bytes from a
        # shard cost that shard, not this relay.
        log.warning("relay %s: shard %d failed (%s); telling the controller", self._config.host_name, index, why)
        self.conns.pop(index, None)
        self._failed.add(index)
        self.changed.notify()
        await self._until_said_lost(index, why)

    async def _until_said_lost(self, index: int, why: BaseException | str) -> None:
        """Until the controller says shard ``index`` is lost (or moved it: it has a new
        connection); ProtocolError if it has not within the handshake bound of its
        connection being up (a controller that is lost meanwhile is waited for as the
        channel waits for it: the new one hears of it)."""
        bound = self._config.bounds.handshake
        deadline: float | None = None  # (counted from when a connection is up)
        while index not in self.lost and index not in self.conns:
            if self._upstream_down:
                deadline = None
            elif deadline is None:
                deadline = trio.current_time() + bound
            elif trio.current_time() >= deadline:
                raise ProtocolError(f"relay {self._config.host_name}: lost shard {index} ({why}), and the controller "
                                    f"did not say so within {bound:g} s")
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self.changed.wait()

    async def _read_records(self, index: int, conn: MessageStream, buf: ReceiveBuffer) -> None:
        """Until the shard is lost or its connection ends. A shard that says nothing (not
        even ``ShardAlive``, which it sends at least every second) for the heartbeat
        timeout is cut off from this relay: ProtocolError, told to the controller."""
        silence = self._config.bounds.heartbeat_timeout
        while index not in self.lost:
            header = None
            with trio.move_on_after(silence) as waited:
                header = await conn.receive_mux_header(self._config.ceiling)
            if waited.cancelled_caught:
                raise ProtocolError(f"{conn.peer} said nothing for {silence:g} s (the heartbeat timeout)")
            if header is None:
                return
            if header.length <= SMALL_MESSAGE or self._own_buffers_fit():
                await self._on_record(index, conn, header, buf)
                continue
            async with self._receiving:
                await self._on_record(index, conn, header, self._lanes.lane_buffer)

    def _own_buffers_fit(self) -> bool:
        """Whether each shard's lanes may land in a buffer of their own (received at once):
        while those buffers together stay small next to the relay's budget headroom."""
        return len(self.conns) * self._lanes.lane_buffer.capacity <= OWN_LANE_BUFFERS_MAX

    async def _on_record(self, index: int, conn: MessageStream, header: MuxHeader, buf: ReceiveBuffer) -> None:
        kind, payload = await conn.receive_mux_payload(header, buf, self._config.salt)
        if index in self.lost:
            return  # read before it was lost, taken after: void
        if kind is MuxKind.BROADCAST:
            await self._on_lane(index, conn, payload)
        elif kind is MuxKind.CONTROL:
            self._on_control(index, conn, decode_control_msg(payload))
        else:
            raise ProtocolError(f"{conn.peer} sent a {kind.name} record")

    def _on_control(self, index: int, conn: MessageStream, msg: RelayControlMsg) -> None:
        if isinstance(msg, ShardAlive | ShardAck):  # a shard's keepalive; a lane kept (nothing waits on it)
            return
        if isinstance(msg, Decided):
            self._decision[index] = msg.decision
            if msg.decision > self.want:  # a newer decision: the older's lanes come again
                self.want = msg.decision
                for lane, decision in list(self._lane_decision.items()):
                    if decision < msg.decision:
                        self._lanes.drop(lane)
                        del self._lane_decision[lane]
        else:
            raise ProtocolError(f"{conn.peer} sent {type(msg).__name__}")
        self.changed.notify()

    async def _on_lane(self, index: int, conn: MessageStream, payload: memoryview) -> None:
        """A consensus lane, verified; joined if it is of the latest decision."""
        lane = decode_round_frame(payload, self._config.salt, ceiling=self._config.ceiling, source=conn.peer,
                                  authenticated=True)
        tag = read_lane_tag(lane)
        if tag is None or tag.index == 0:
            raise ProtocolError(f"{conn.peer} sent a consensus lane tagged {tag}")
        decision = self._decision.get(index)
        if decision is None:
            raise ProtocolError(f"{conn.peer} sent a consensus lane before saying which decision it is (Decided)")
        if decision < self.want:
            return  # a decision a newer one replaced
        owner = self.owner(tag.index)
        if owner != index:  # (every decided host heard of a loss before the new owner could sum its lanes)
            raise ProtocolError(f"{conn.peer} sent consensus lane {tag.index}, which shard {owner} reduces "
                                f"(lost: {sorted(self.lost)})")
        await self._lanes.join(lane, tag.index)
        if decision < self.want:  # replaced while it was being joined (another shard's mark)
            self._lanes.drop(tag.index)
            return
        self._lane_decision[tag.index] = decision
        self.changed.notify()


__all__ = ["ShardLanes", "ShardLinks"]
