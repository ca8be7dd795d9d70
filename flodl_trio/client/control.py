"""The rank's control connection: heartbeats out, beacons in.

Rounds have no deadline, so a rank must learn on its own when the cluster is
gone or has declared it dead. :func:`connect_control_client` runs a heartbeat
task and a beacon watch beside the trainer's code; either one raising cancels
the trainer's block, including a reduce it is waiting on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from ..errors import (
    ConfigError,
    FlodlError,
    FramingError,
    MacError,
    PeerClosedMidFrame,
    PeerTimeout,
    RankDeadError,
)
from ..settings import CONNECT_RETRY_ATTEMPTS, handshake_timeout, timeout_scale
from ..transport.buffers import ReceiveBuffer
from ..transport.connect import connect_with_retry
from ..transport.stream import MessageStream
from ..transport.tasks import sole_exception
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
from ..wire.liveness import Beacon, Notice, decode_liveness, heartbeat_frame
from ..wire.salt import SessionSalt
from .reduce import Address, parse_address

BEACON_GRACE_S = 0.2


class CoordinatorLost(FlodlError):
    """The coordinator went silent, closed, or failed authentication: the cluster is gone."""


class ControlClient:
    """A rank's control connection. Its tasks live in the ``connect_control_client`` block."""

    def __init__(
        self, conn: MessageStream, rank: int, world_size: int, salt: SessionSalt,
        heartbeat_interval: float, beacon_timeout: float,
    ) -> None:
        self._conn = conn
        self.rank = rank
        self.world_size = world_size
        self._salt = salt
        self.heartbeat_interval = heartbeat_interval
        self.beacon_timeout = beacon_timeout
        self.heartbeats_sent = 0
        self.last_beacon: Beacon | None = None
        self.failure: FlodlError | None = None
        self._pace_changed = trio.Event()

    async def _watch(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop; its FlodlError becomes this client's verdict."""
        try:
            await loop()
        except FlodlError as exc:
            self.failure = self.failure or exc
            raise

    async def _heartbeat_loop(self) -> None:
        """Beat every interval; runs in the trainer's task tree, so it beats while a reduce waits."""
        while True:
            self.heartbeats_sent += 1
            blob = encode_control_frame(heartbeat_frame(self.rank, self.heartbeats_sent), self._salt)
            try:
                await self._conn.send_len_framed([blob], len(blob))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, PeerTimeout) as exc:
                raise CoordinatorLost(f"rank {self.rank}: heartbeat could not be sent to the control relay: {exc}") from None
            with trio.move_on_after(self.heartbeat_interval):
                await self._pace_changed.wait()
                self._pace_changed = trio.Event()

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
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, FramingError) as exc:
                raise CoordinatorLost(f"rank {self.rank}: control connection failed: {exc}") from None
            if blob is None:
                await inbox.send(None)
                await inbox.aclose()
                return
            try:
                frame = decode_control_frame(blob, self._salt, source="the coordinator")
            except MacError as exc:
                raise CoordinatorLost(f"rank {self.rank}: {exc}") from None
            await inbox.send(frame)

    async def _next_message(self, inbox: trio.MemoryReceiveChannel[ControlFrame | None]) -> ControlFrame | None:
        """The next message; CoordinatorLost if none comes within the beacon timeout."""
        with trio.move_on_after(self.beacon_timeout):
            return await inbox.receive()
        # A process thawed after SIGSTOP finds every timer expired: give the reader a
        # moment to deliver what is already queued (a death notice) before giving up.
        with trio.move_on_after(BEACON_GRACE_S):
            return await inbox.receive()
        raise CoordinatorLost(
            f"rank {self.rank}: no beacon from the coordinator for {self.beacon_timeout:.1f} s "
            "(coordinator, controller or this host's control relay is gone or frozen)"
        )

    def _follow_coordinator_pace(self, beacon: Beacon) -> None:
        """Beat at least 4x per the coordinator's heartbeat timeout, whatever we were told locally."""
        wanted = beacon.heartbeat_timeout_ms / 4000
        if 0 < wanted < self.heartbeat_interval:
            self.heartbeat_interval = wanted
            self.beacon_timeout = min(self.beacon_timeout, max(4 * wanted, 1e-3))
            self._pace_changed.set()

    async def _receive_loop(self) -> None:
        """Beacons keep us alive; silence, EOF, a bad MAC or a death notice raise a clear error."""
        send, inbox = trio.open_memory_channel[ControlFrame | None](16)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader, send)
                await self._watch_beacons(inbox)
        except BaseExceptionGroup as group:
            raise sole_exception(group) from None

    async def _watch_beacons(self, inbox: trio.MemoryReceiveChannel[ControlFrame | None]) -> None:
        while True:
            frame = await self._next_message(inbox)
            if frame is None:
                raise CoordinatorLost(f"rank {self.rank}: the control relay closed the connection (coordinator gone)")
            message = decode_liveness(frame)
            if isinstance(message, Notice):
                raise RankDeadError(message.reason)
            if isinstance(message, Beacon):
                self._check_world(message)
                self.last_beacon = message
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
    connect_attempts: int = CONNECT_RETRY_ATTEMPTS,
    connect_interval: float | None = None,
) -> AsyncIterator[ControlClient]:
    """Join the coordinator through this host's control relay for the block.

    The heartbeat and beacon watch run as tasks beside the block's body; if the
    coordinator is lost (no beacon for ``beacon_timeout``, EOF, bad MAC) or this
    rank is declared dead, the body is cancelled - including a reduce it awaits
    - and the block raises :class:`CoordinatorLost` / :class:`RankDeadError`.
    Defaults follow the cluster's: ``heartbeat_timeout`` 30 s x
    FLODL_NET_TIMEOUT_SCALE, beating 4x per timeout.
    """
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank_id {rank} must be < world_size {world_size}")
    session = SessionSalt.coerce(salt)
    timeout = heartbeat_timeout if heartbeat_timeout is not None else 30.0 * timeout_scale()
    host, port = parse_address(address)
    stream = await connect_with_retry(host, port, f"rank {rank} -> control relay", attempts=connect_attempts, interval=connect_interval)
    conn = MessageStream(stream, f"control relay {host}:{port}")
    try:
        await conn.send_chunks([encode_control_handshake(rank, world_size, model_signature, session)])
        with trio.fail_after(handshake_timeout()):
            ack = await conn.receive_exactly(CONTROL_ACK_LEN, "the control handshake ack")
        decode_control_ack(ack, session)
    except PeerClosedMidFrame:
        await conn.aclose()
        raise FramingError(
            f"rank {rank}: control relay {host}:{port} closed the connection before the handshake ack "
            f"(it refused rank {rank}: wrong session salt, wrong world size, rank not on this host, "
            "or rank already connected - see the relay's log)"
        ) from None
    except BaseException:
        await conn.aclose()
        raise
    client = ControlClient(conn, rank, world_size, session, heartbeat_interval or timeout / 4, beacon_timeout or timeout)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._watch, client._heartbeat_loop)
            nursery.start_soon(client._watch, client._receive_loop)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The cluster verdict (lost coordinator, declared dead) is the cause; a
        # reduce that failed in the body at the same moment is its consequence.
        raise client.failure or sole_exception(group) from None
    finally:
        await conn.aclose()
    if client.failure is not None:
        raise client.failure
