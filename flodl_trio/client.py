"""The rank client: what a trio trainer awaits to average with the cluster.

A :class:`ReduceClient` holds one loopback connection to its host's data
relay. Every call is one round: send this rank's frame, wait for the
consensus. That wait has no deadline on purpose (a slow host must not make
Local SGD silently drop a round); death detection ends it instead - the
relay closes a dead rank's connection, and the control client (another task
in the trainer's nursery) raises when the coordinator is lost. Pass
``reply_timeout`` to bound it anyway when running without a control channel.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .errors import (
    ConfigError,
    FlodlError,
    FramingError,
    MacError,
    PeerClosedMidFrame,
    PeerTimeout,
    RankDeadError,
    SchemaError,
)
from .realized_work import DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS
from .wire.constants import (
    CONTROL_FRAME_HEADER_LEN,
    CONTROL_FRAME_MAX_PAYLOAD,
    DTYPE_BF16,
    DTYPE_F32,
)
from .wire.control_frame import ControlFrame, decode_control_frame, encode_control_frame
from .wire.handshake import (
    CONTROL_ACK_LEN,
    DATA_ACK_LEN,
    decode_control_ack,
    decode_data_ack,
    encode_control_handshake,
    encode_data_handshake,
)
from .wire.liveness import Beacon, Notice, decode_liveness, heartbeat_frame
from .wire.netenv import CONNECT_RETRY_ATTEMPTS, handshake_timeout, timeout_scale
from .wire.round_frame import (
    RoundFrame,
    RoundKind,
    TensorPayload,
    decode_round_frame,
    frame_body_chunks,
)
from .wire.salt import SessionSalt
from .wire.stream import MessageStream, ReceiveBuffer, RunningMac, connect_with_retry
from .wire.tasks import sole_exception

if TYPE_CHECKING:
    import torch

    from .tensors import SendStaging

Address = tuple[str, int] | str


def parse_address(address: Address) -> tuple[str, int]:
    """``(host, port)`` or ``"host:port"`` (IPv6 as ``[::1]:port``)."""
    if isinstance(address, tuple):
        return str(address[0]), int(address[1])
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port_text)


def max_reply_len(frame: RoundFrame) -> int:
    """Largest consensus frame a reply to ``frame`` can be: same schema, nothing elided."""
    total = 25
    for t in frame.tensors:
        total += 10 + 4 * len(t.shape) + t.numel * (2 if t.dtype == DTYPE_BF16 else 4)
    return total


class ReduceClient:
    """One rank's connection to its relay. Not safe for concurrent rounds."""

    def __init__(self, conn: MessageStream, rank: int, world_size: int, salt: SessionSalt, *, reply_timeout: float | None) -> None:
        self._conn = conn
        self.rank = rank
        self.world_size = world_size
        self._salt = salt
        self.reply_timeout = reply_timeout
        self.bf16_wire = False
        self.pinned_decode = False
        self._armed_slot: int | None = None
        self._staging: dict[int, list[torch.Tensor]] = {}
        # Replies that are decoded by copy land here, round after round.
        self._reply_buffer = ReceiveBuffer()
        # Converted (scaled, bf16, off-GPU) copies of this rank's tensors, round after round.
        self._send_staging: SendStaging | None = None
        self._busy = False
        self._broken: str | None = None
        self.rounds = 0

    # -- lifecycle -----------------------------------------------------------

    async def aclose(self) -> None:
        """Leave the cluster: the relay sees EOF and folds the survivors without us."""
        self._broken = self._broken or "client closed"
        await self._conn.aclose()

    async def __aenter__(self) -> ReduceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- frame level ---------------------------------------------------------

    async def all_reduce(self, frame: RoundFrame) -> RoundFrame:
        """Contribute ``frame`` and return the round's consensus (owning its bytes)."""
        return await self._exchange(frame, reuse_reply_buffer=False)

    def _check_ready(self) -> None:
        """Refuse a round while another is in flight (its frame may sit in our staging)
        or after the client broke."""
        if self._busy:
            raise trio.BusyResourceError(f"rank {self.rank}: another round is already in flight on this client")
        if self._broken is not None:
            raise FlodlError(f"rank {self.rank}: client unusable ({self._broken})")

    async def _exchange(self, frame: RoundFrame, *, reuse_reply_buffer: bool) -> RoundFrame:
        """One round; with ``reuse_reply_buffer`` the consensus lands in the client's
        reply buffer, valid until the next round (for callers that copy it out)."""
        self._check_ready()
        self._busy = True
        try:
            reply = await self._round_trip(frame, self._reply_buffer if reuse_reply_buffer else None)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._broken = f"the connection to the relay broke: {exc}"
            raise RankDeadError(
                f"rank {self.rank}: the relay closed the connection during round {self.rounds} ({exc}); "
                "the relay refused this rank's frame, or relay or controller went away"
            ) from None
        except BaseException as exc:
            # A round interrupted half-way leaves the ping-pong out of step for good.
            self._broken = f"a round ended abnormally: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._busy = False
        self.rounds += 1
        return reply

    async def _round_trip(self, frame: RoundFrame, into: ReceiveBuffer | None) -> RoundFrame:
        await self._conn.send_signed_frame(frame_body_chunks(frame), self._salt)
        bound = max_reply_len(frame)
        with trio.fail_after(math.inf if self.reply_timeout is None else self.reply_timeout):
            try:
                length = await self._conn.receive_length_prefix(ceiling=bound)
            except FramingError as exc:
                raise FramingError(
                    f"rank {self.rank}: consensus is larger than this round's schema allows "
                    f"({bound} bytes): {exc}"
                ) from None
        if length is None:
            raise RankDeadError(
                f"rank {self.rank}: the relay closed the connection while this rank waited for "
                f"round {self.rounds}'s consensus (relay or controller gone, or this rank was declared dead)"
            )
        # The bound is our own schema, so this allocation is trusted.
        if into is None:
            body = np.empty(length, dtype=np.uint8).data  # the reply owns it
        else:
            into.reserve(length)
            body = into.view(length)
        mac = RunningMac(self._salt.hmac(), max(length - 8, 0))
        await self._conn.receive_into(body, "the consensus frame", mac)
        reply = decode_round_frame(
            body, self._salt, source=f"relay (rank {self.rank}'s consensus)", mac_of_body=mac.tag()
        )
        self._check_reply_schema(frame, reply)
        return reply

    def _check_reply_schema(self, sent: RoundFrame, reply: RoundFrame) -> None:
        """The consensus must have the schema this rank sent (anything else is a desync)."""
        if reply.kind != sent.kind or len(reply.tensors) != len(sent.tensors):
            raise SchemaError(
                f"rank {self.rank}: consensus is a {reply.kind.name} frame of {len(reply.tensors)} tensors, "
                f"this rank sent {sent.kind.name} with {len(sent.tensors)}"
            )
        for i, (mine, theirs) in enumerate(zip(sent.tensors, reply.tensors)):
            if (mine.dtype, mine.shape) != (theirs.dtype, theirs.shape):
                raise SchemaError(
                    f"rank {self.rank}: consensus tensor {i} is dtype {theirs.dtype} shape {list(theirs.shape)}, "
                    f"this rank sent dtype {mine.dtype} shape {list(mine.shape)}"
                )

    # -- tensor level --------------------------------------------------------

    def arm_pinned_decode(self, slot: int) -> None:
        """Decode the next reply into ``slot``'s reusable staging (when pinned_decode is on).

        The returned tensors alias the staging: the next decode into the same
        slot overwrites them. Slots are caller-tagged so a buffers frame with
        the params frame's exact schema never lands in the params staging.
        """
        if slot not in (DECODE_SLOT_PARAMS, DECODE_SLOT_BUFFERS):
            raise ConfigError(f"unknown decode slot {slot}")
        self._armed_slot = slot

    def _wire_dtype(self, kind: RoundKind) -> int:
        # Control rounds carry counts and sums: always f32 (bf16 is exact only to 256).
        return DTYPE_BF16 if self.bf16_wire and kind == RoundKind.MODEL else DTYPE_F32

    def _pinned_destinations(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The armed pinned-decode slot's reusable tensors, shaped like ``tensors``
        (the reply's schema), or None when no slot is armed."""
        from .tensors import staging_like

        slot, self._armed_slot = self._armed_slot, None
        if not self.pinned_decode or slot is None:
            return None
        staging = self._staging.get(slot)
        if staging is None or [t.shape for t in staging] != [t.shape for t in tensors]:
            staging = self._staging[slot] = staging_like(tensors)
        return staging

    def _decode(self, reply: RoundFrame, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        from .tensors import round_frame_to_tensors

        return round_frame_to_tensors(reply, out=out)

    async def all_reduce_scaled(
        self, tensors: Sequence[torch.Tensor], scale: float, kind: RoundKind, weight: float, *, in_place: bool = False
    ) -> tuple[list[torch.Tensor], float]:
        """Send ``scale * tensors`` with mass ``weight`` (scaled on the wire bytes, no
        caller-visible copy); return (consensus, accepted mass).

        ``in_place``: write the consensus into ``tensors`` themselves (f32; the
        way ``torch.distributed.all_reduce`` works) and return them; a round whose
        accepted mass is 0 leaves them as they were. Steady-state rounds then
        allocate nothing model-sized.
        """
        from .tensors import SendStaging, check_destinations, tensors_to_round_frame

        self._check_ready()  # before the frame is built into staging a round in flight may be sending
        if in_place:
            check_destinations(tensors)  # before the round: a refusal costs nothing
        wire = self._wire_dtype(kind)
        out = list(tensors) if in_place else self._pinned_destinations(tensors)
        if self._send_staging is None:
            self._send_staging = SendStaging()
        frame = tensors_to_round_frame(tensors, wire, kind=kind, weight=weight, scale=scale, staging=self._send_staging)
        # Decoded by copy (into ``out``, or widened from bf16): the reply may live in our buffer.
        reply = await self._exchange(frame, reuse_reply_buffer=out is not None or wire == DTYPE_BF16)
        if in_place and kind == RoundKind.MODEL and not reply.weight > 0:
            return list(tensors), reply.weight
        return self._decode(reply, out), reply.weight

    async def all_reduce_weighted(
        self, tensors: Sequence[torch.Tensor], kind: RoundKind, weight: float, *, in_place: bool = False
    ) -> tuple[list[torch.Tensor], float]:
        """Send already-scaled ``tensors`` with mass ``weight``; return (consensus, accepted mass)."""
        return await self.all_reduce_scaled(tensors, 1.0, kind, weight, in_place=in_place)

    async def all_reduce_tensors(self, tensors: Sequence[torch.Tensor], *, in_place: bool = False) -> list[torch.Tensor]:
        """Plain mean over the live ranks (every rank counts 1); ``in_place`` writes
        it into ``tensors`` (see :meth:`all_reduce_scaled`)."""
        result, _mass = await self.all_reduce_scaled(tensors, 1.0, RoundKind.MODEL, 1.0, in_place=in_place)
        return result

    async def all_reduce_per_rank_f64(self, values: Sequence[float]) -> list[float]:
        """Gather one number per rank: this rank's ``values[rank]`` lands in its slot.

        Dead ranks' slots come back 0. Carried as f32 (flodl's wire format):
        exact for integers up to 2**24.
        """
        if len(values) != self.world_size:
            raise ConfigError(f"rank {self.rank}: per-rank gather needs {self.world_size} values, got {len(values)}")
        slots = np.zeros(self.world_size, dtype="<f4")
        slots[self.rank] = values[self.rank]
        frame = RoundFrame([TensorPayload(DTYPE_F32, (self.world_size,), slots)], RoundKind.CONTROL, 0.0)
        reply = await self.all_reduce(frame)
        payload = reply.tensors[0]
        if payload.elided:
            return [0.0] * self.world_size
        return [float(v) for v in np.frombuffer(payload.data, dtype="<f4")]

    async def broadcast_from_root(self, tensors: Sequence[torch.Tensor], root: int) -> list[torch.Tensor]:
        """Every rank gets ``root``'s tensors; the others send only shapes (elided zeros)."""
        from .tensors import elided_like, tensors_to_round_frame

        if not 0 <= root < self.world_size:
            raise ConfigError(f"broadcast root {root} must be < world_size {self.world_size}")
        if self.rank == root:
            frame = tensors_to_round_frame(tensors, DTYPE_F32, kind=RoundKind.CONTROL, weight=0.0)
        else:
            frame = RoundFrame(elided_like(tensors), RoundKind.CONTROL, 0.0)
        out = self._pinned_destinations(tensors)
        return self._decode(await self._exchange(frame, reuse_reply_buffer=out is not None), out)


class _Connect:
    """``await connect_reduce_client(...)`` or ``async with connect_reduce_client(...) as c``."""

    def __init__(self, coro_factory: Any) -> None:
        self._factory = coro_factory
        self._client: ReduceClient | None = None

    def __await__(self) -> Generator[Any, None, ReduceClient]:
        return self._factory().__await__()

    async def __aenter__(self) -> ReduceClient:
        self._client = await self._factory()
        return self._client

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._client is not None
        await self._client.aclose()


def connect_reduce_client(
    address: Address,
    rank: int,
    world_size: int,
    salt: SessionSalt | bytes,
    *,
    connect_attempts: int = CONNECT_RETRY_ATTEMPTS,
    connect_interval: float | None = None,
    reply_timeout: float | None = None,
) -> _Connect:
    """Connect rank ``rank`` to its host's data relay at ``address``.

    Argument errors are raised before any network traffic. The relay refuses a
    wrong world size, a rank outside its host set or a duplicate rank by
    closing before the ack; that surfaces here as a handshake error.
    """
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank_id {rank} must be < world_size {world_size}")
    session = SessionSalt.coerce(salt)
    host, port = parse_address(address)

    async def connect() -> ReduceClient:
        stream = await connect_with_retry(
            host, port, f"rank {rank} -> data relay", attempts=connect_attempts, interval=connect_interval
        )
        conn = MessageStream(stream, f"data relay {host}:{port}")
        try:
            await conn.send_chunks([encode_data_handshake(rank, world_size)])
            with trio.fail_after(handshake_timeout()):
                ack = await conn.receive_exactly(DATA_ACK_LEN, "the data handshake ack")
            decode_data_ack(ack)
        except PeerClosedMidFrame:
            await conn.aclose()
            raise FramingError(
                f"rank {rank}: data relay {host}:{port} closed the connection before the handshake ack "
                f"(it refused rank {rank} / world_size {world_size}: wrong world size, rank not on this "
                "host, or rank already connected - see the relay's log)"
            ) from None
        except trio.TooSlowError:
            await conn.aclose()
            raise PeerTimeout(f"rank {rank}: no handshake ack from data relay {host}:{port} within {handshake_timeout():.0f} s") from None
        except BaseException:
            await conn.aclose()
            raise
        return ReduceClient(conn, rank, world_size, session, reply_timeout=reply_timeout)

    return _Connect(connect)


# ---------------------------------------------------------------------------
# Control channel: heartbeats out, beacons in
# ---------------------------------------------------------------------------


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
