"""The rank's control connection: heartbeats out, beacons in.

Rounds have no deadline, so a rank must learn on its own when the cluster is
gone or has declared it dead. :func:`connect_control_client` runs a heartbeat
task and a beacon watch beside the trainer's code; either one raising cancels
the trainer's block, including a reduce it is waiting on.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ..errors import (
    ConfigError,
    FlodlError,
    FramingError,
    MacError,
    RankDeadError,
)
from ..transport.buffers import ReceiveBuffer
from ..transport.connect import Connector
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import ChangeSignal, one_error
from ..wire.constants import CONTROL_FRAME_HEADER_LEN, CONTROL_FRAME_MAX_PAYLOAD
from ..wire.control_frame import (
    ControlFrame,
    decode_control_frame,
    encode_control_frame,
)
from ..wire.handshake import (
    CONTROL_ACK_LEN,
    decode_control_ack,
    encode_control_handshake,
)
from ..wire.liveness import Beacon, Notice, RunOver, decode_liveness, heartbeat_frame
from ..wire.salt import SessionSalt
from .reduce import Address, check_rank, dialing_bounds, open_handshaken

log = logging.getLogger("flodl_trio.client")

BEACON_GRACE_S = 0.2


class CoordinatorLost(FlodlError):
    """The coordinator went silent, closed, or failed authentication: the cluster is gone."""


# The cluster's verdicts (the coordinator is gone; this rank is dead): when one
# arrives together with another error from the block's body, it is the cause.
_VERDICTS = (CoordinatorLost, RankDeadError)


class ControlClient:
    """A rank's control connection. Its tasks live in the ``connect_control_client`` block."""

    def __init__(
        self, conn: MessageStream, rank: int, world_size: int, salt: SessionSalt,
        heartbeat_interval: float, beacon_timeout: float, outage: float | None = 0.0,
    ) -> None:
        self._conn = conn
        self.rank = rank
        self.world_size = world_size
        self._salt = salt
        self.heartbeat_interval = heartbeat_interval
        self.beacon_timeout = beacon_timeout
        # How much longer than beacon_timeout to wait for a controller that may come back
        # (None: as long as its beacons say, 0 until one does).
        self._outage = outage
        self._announced_outage = 0.0
        self.outages = 0  # times the beacon stopped for longer than beacon_timeout and came back
        self.heartbeats_sent = 0
        self.last_beacon: Beacon | None = None
        # The coordinator said the run is over (every rank finished or exited): the
        # heartbeats stop, and the connection closing next is the end, not a loss.
        self.run_over = False
        self._beating = trio.CancelScope()
        self._pace_changed = ChangeSignal()

    async def _heartbeat_loop(self) -> None:
        """Beat every interval; runs in the trainer's task tree, so it beats while a reduce waits."""
        with self._beating:
            while True:
                self.heartbeats_sent += 1
                blob = encode_control_frame(heartbeat_frame(self.rank, self.heartbeats_sent), self._salt)
                try:
                    await self._conn.send_len_framed([blob], len(blob))
                except CONNECTION_LOST as exc:
                    if self.run_over:
                        return
                    raise CoordinatorLost(
                        f"rank {self.rank}: heartbeat could not be sent to the control relay: {exc}"
                    ) from exc
                with trio.move_on_after(self.heartbeat_interval):
                    await self._pace_changed.wait()

    async def _reader(self, inbox: trio.MemorySendChannel[ControlFrame | None]) -> None:
        """Read whole messages with no deadline (a timeout must never cut one in half)
        and hand them to the beacon watch; None marks the relay closing the connection.

        On a failure the channel is left open: closing it would wake the watch
        with EndOfChannel, a second error beside the real one, instead of letting
        the nursery cancel it.
        """
        buf = ReceiveBuffer()
        while True:
            try:
                blob = await self._conn.receive_len_framed(buf, CONTROL_FRAME_HEADER_LEN + CONTROL_FRAME_MAX_PAYLOAD)
            except (*CONNECTION_LOST, FramingError) as exc:
                raise CoordinatorLost(f"rank {self.rank}: control connection failed: {exc}") from exc
            if blob is None:
                await inbox.send(None)
                await inbox.aclose()
                return
            try:
                frame = decode_control_frame(blob, self._salt, source="the coordinator")
            except MacError as exc:
                raise CoordinatorLost(f"rank {self.rank}: {exc}") from exc
            await inbox.send(frame)

    async def _next_message(self, inbox: trio.MemoryReceiveChannel[ControlFrame | None]) -> ControlFrame | None:
        """The next message; CoordinatorLost if none comes within the beacon timeout
        (plus the controller outage bound: the controller may be coming back)."""
        with trio.move_on_after(self.beacon_timeout):
            return await inbox.receive()
        if self.outage > 0:
            log.warning("rank %d: no beacon from the coordinator for %.1f s; holding up to %g s more for it to come back",
                        self.rank, self.beacon_timeout, self.outage)
            with trio.move_on_after(self.outage):
                message = await inbox.receive()
                self.outages += 1
                log.info("rank %d: the coordinator is back", self.rank)
                return message
        # A process thawed after SIGSTOP finds every timer expired: give the reader a
        # moment to deliver what is already queued (a death notice) before giving up.
        with trio.move_on_after(BEACON_GRACE_S):
            return await inbox.receive()
        waited = self.beacon_timeout + self.outage
        raise CoordinatorLost(
            f"rank {self.rank}: no beacon from the coordinator for {waited:.1f} s "
            "(coordinator, controller or this host's control relay is gone or frozen)"
        )

    @property
    def outage(self) -> float:
        """How long to hold for a lost coordinator past ``beacon_timeout`` (seconds)."""
        return self._announced_outage if self._outage is None else self._outage

    def _follow_coordinator_pace(self, beacon: Beacon) -> None:
        """Beat at least 4x per the coordinator's heartbeat timeout, and wait for its beacons
        at least that timeout (it beacons 4x per it), whatever we were told locally: a
        rank and a coordinator configured differently see no false death either way."""
        wanted = beacon.heartbeat_timeout_ms / 4000
        if 0 < wanted < self.heartbeat_interval:
            self.heartbeat_interval = wanted
            self.beacon_timeout = min(self.beacon_timeout, max(4 * wanted, 1e-3))
            self._pace_changed.notify()
        self.beacon_timeout = max(self.beacon_timeout, 4 * wanted)

    async def _receive_loop(self) -> None:
        """Beacons keep us alive; silence, EOF, a bad MAC or a death notice raise a clear error."""
        send, inbox = trio.open_memory_channel[ControlFrame | None](16)
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader, send)
                await self._watch_beacons(inbox)
                nursery.cancel_scope.cancel()  # the run is over: what the connection does next is no news

    async def _watch_beacons(self, inbox: trio.MemoryReceiveChannel[ControlFrame | None]) -> None:
        """Until the run is over: beacons keep the rank going; anything else ends it."""
        while True:
            frame = await self._next_message(inbox)
            if frame is None:
                raise CoordinatorLost(f"rank {self.rank}: the control relay closed the connection (coordinator gone)")
            message = decode_liveness(frame)
            if isinstance(message, RunOver):
                self.run_over = True
                self._beating.cancel()
                return
            if isinstance(message, Notice):
                raise RankDeadError(message.reason)
            if isinstance(message, Beacon):
                self._check_world(message)
                self.last_beacon = message
                self._announced_outage = message.outage_ms / 1000
                self._follow_coordinator_pace(message)

    def _check_world(self, beacon: Beacon) -> None:
        if beacon.world_size != self.world_size:
            raise ConfigError(
                f"rank {self.rank}: this rank was started with world_size {self.world_size}, "
                f"the coordinator with {beacon.world_size}"
            )


@asynccontextmanager
async def connect_control_client(
    address: Address,
    rank: int,
    world_size: int,
    salt: SessionSalt | bytes,
    model_signature: bytes,
    *,
    heartbeat_timeout: float | None = None,
    heartbeat_interval: float | None = None,
    beacon_timeout: float | None = None,
    connect_attempts: int | None = None,
    connect_interval: float | None = None,
    bounds: NetBounds | None = None,
    connect: Connector = trio.open_tcp_stream,
) -> AsyncIterator[ControlClient]:
    """Join the coordinator through this host's control relay for the block.

    The heartbeat and beacon watch run as tasks beside the block's body; if the
    coordinator is lost (no beacon for ``beacon_timeout``, EOF, bad MAC) or this
    rank is declared dead, the body is cancelled - including a reduce it awaits
    - and the block raises :class:`CoordinatorLost` / :class:`~flodl_trio.RankDeadError`.
    When the coordinator says the run is over (every rank finished or exited),
    ``client.run_over`` becomes True and both tasks stop: the connection closing
    afterwards ends nothing, and the block goes on. Defaults follow the cluster's:
    ``heartbeat_timeout`` is ``bounds.heartbeat_timeout`` (30 s x
    FLODL_NET_TIMEOUT_SCALE), beating 4x per timeout. Beacons that stop are waited
    for ``bounds.controller_outage`` (``FLODL_CONTROLLER_OUTAGE``) longer before the
    coordinator counts as lost - or, when that is None, as long as the coordinator's
    last beacon said (a controller that keeps a resume record says; else 0).
    """
    check_rank(rank, world_size)
    session = SessionSalt.coerce(salt)
    net = dialing_bounds(bounds, connect_attempts, connect_interval)
    timeout = heartbeat_timeout if heartbeat_timeout is not None else net.heartbeat_timeout
    conn, ack = await open_handshaken(
        address, f"rank {rank}", "control relay", encode_control_handshake(rank, world_size, model_signature, session),
        CONTROL_ACK_LEN,
        f"it refused rank {rank}: wrong session salt, wrong world size, rank not on this host, "
        "rank already connected, or - coming back - another model signature than before; see the relay's log",
        net, connect,
    )
    try:
        decode_control_ack(ack, session)
        client = ControlClient(
            conn, rank, world_size, session, heartbeat_interval or timeout / 4, beacon_timeout or timeout,
            net.controller_outage,
        )
        with one_error(prefer=_VERDICTS):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._heartbeat_loop)
                nursery.start_soon(client._receive_loop)
                try:
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        await conn.aclose()
