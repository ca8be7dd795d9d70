"""The rank client: what a trio trainer awaits to average with the cluster.

A :class:`ReduceClient` holds one connection to its host's data relay: the
Unix-socket local leg when the relay offers one (frames unsigned there, see
docs/wire.md), TCP loopback otherwise. Every call is one round: send this rank's frame, wait for the
consensus. That wait has no deadline on purpose (a slow host must not make
Local SGD silently drop a round); death detection ends it instead - the
relay closes a dead rank's connection, and the control client (another task
in the trainer's nursery) raises when the coordinator is lost. Pass
``reply_timeout`` to bound it anyway when running without a control channel.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from ..errors import (
    ConfigError,
    FlodlError,
    FramingError,
    PeerClosedMidFrame,
    PeerTimeout,
    RankDeadError,
    SchemaError,
)
from ..transport.buffers import ReceiveBuffer
from ..transport.connect import Connector, connect_with_retry
from ..transport.hashing import RunningMac
from ..transport.local_leg import dial_local_leg, local_leg_enabled
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..wire.constants import DTYPE_BF16, DTYPE_F32, FINISHED_LENGTH
from ..wire.quant import DeltaCodec
from ..wire.fragment import FragmentTag
from ..wire.handshake import (
    DATA_ACK_LEN,
    LOCAL_ACK_LEN,
    decode_data_ack,
    decode_local_ack,
    encode_data_handshake,
    encode_local_handshake,
)
from ..wire.round_frame import (
    EncodedFrame,
    RoundFrame,
    RoundKind,
    TensorPayload,
    decode_round_frame,
    frame_body_chunks,
    schema_frame_len,
)
from ..wire.salt import SessionSalt
from .delta import RankDelta
from .state import ClusterState, fetch_cluster_state

if TYPE_CHECKING:
    import torch

    from .tensors import SendStaging

Address = tuple[str, int] | str
# The two reusable decode destinations a rank may arm (ReduceClient.arm_pinned_decode):
# a window's params round and its buffers round.
DECODE_SLOT_PARAMS = 0
DECODE_SLOT_BUFFERS = 1
log = logging.getLogger("flodl_trio.client")
_FINISHED = FINISHED_LENGTH.to_bytes(4, "little")  # "this rank finished", a flodl_trio extension


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
    return schema_frame_len((t.dtype, t.shape) for t in frame.tensors)



class ClientBusy(FlodlError, trio.BusyResourceError):
    """A round was started on a client while another is in flight: the ping-pong allows
    one at a time (the caller's bug; the round in flight goes on). Also a
    ``trio.BusyResourceError``, as trio's own streams say it."""


class ReduceClient:
    """One rank's connection to its relay. Not safe for concurrent rounds."""

    def __init__(
        self,
        conn: MessageStream,
        rank: int,
        world_size: int,
        salt: SessionSalt,
        *,
        reply_timeout: float | None,
        relay: tuple[str, int] = ("", 0),
        bounds: NetBounds | None = None,
        connect: Connector = trio.open_tcp_stream,
    ) -> None:
        self._conn = conn
        self.relay = relay  # where the relay listens (a joiner's state request goes there too)
        self._bounds = bounds if bounds is not None else NetBounds()
        self._connect = connect
        self.rank = rank
        self.world_size = world_size
        self._salt = salt
        self.reply_timeout = reply_timeout
        self.bf16_wire = False
        # Delta rounds (docs/wire.md): the params go as coded deltas; None: params in f32/bf16.
        self.delta_codec: DeltaCodec | None = None
        # Whether the rank carries what its code dropped into the next window's delta
        # (error feedback); off, each window's rounding error is lost for good.
        self.delta_error_feedback = True
        # One delta lineage per params set: the whole model (None), or each fragment (its index).
        self._deltas: dict[int | None, RankDelta] = {}
        self._joined_params: dict[int | None, list[np.ndarray]] = {}  # what join() loaded: each lineage's base
        self.pinned_decode = False
        self._armed_slot: int | None = None
        self._staging: dict[int, list[torch.Tensor]] = {}
        # Replies that are decoded by copy land here, round after round.
        self._reply_buffer = ReceiveBuffer()
        # Converted (scaled, bf16, off-GPU) copies of this rank's tensors, round after round.
        self._send_staging: SendStaging | None = None
        self._busy = False
        self._broken: str | None = None
        self.joined = False  # whether join()/fetch_state() was called: then leaving says finished or not
        self.last_state: ClusterState | None = None  # what join() loaded (its window, size, transfer time)
        # Fragments (0 for a whole model) whose next window carries no work: this rank
        # entered behind its host (see ClusterState.behind); average_window takes them out.
        self.catching_up: set[int] = set()
        self.rounds = 0

    @property
    def local_leg(self) -> bool:
        """Whether this rank reaches its relay over the Unix-socket local leg
        (frames unsigned) rather than TCP (frames signed)."""
        return not self._conn.signed_frames

    # -- lifecycle -----------------------------------------------------------

    async def aclose(self) -> None:
        """Leave the cluster: the relay sees EOF and folds the survivors without us.

        For a rank that called :meth:`join` this reads as a crash: the rank may
        come back. Use :meth:`finish` (or leave ``async with`` normally) once
        its training is done."""
        self._broken = self._broken or "client closed"
        await self._conn.aclose()

    async def finish(self) -> None:
        """Leave the cluster for good, saying so: training is done, this rank will not
        come back, so nobody waits ``rejoin_timeout`` for it. Only a rank that called
        :meth:`join` says it (a length prefix of 0, a flodl_trio extension); for any
        other rank this is :meth:`aclose`. A delta run's last digest check is waited
        for first (FlodlError, after leaving, if this rank's base differs)."""
        try:
            for delta in self._deltas.values():
                delta.verify()
        finally:
            await self._leave()

    async def _leave(self) -> None:
        if self.joined and self._broken is None:
            # Shielded from the caller's cancellation, bounded by our own deadline
            # (inside the shield, so it can fire): a relay that stopped reading costs
            # us the bound, not a hang. Cutting the 4 bytes short is harmless: the
            # connection closes right after.
            with trio.CancelScope(shield=True), trio.move_on_after(self._bounds.handshake) as sending:
                try:
                    await self._conn.send_piece(_FINISHED)
                except CONNECTION_LOST:
                    pass
            if sending.cancelled_caught:
                log.warning("rank %d: could not say it finished within %.0f s", self.rank, self._bounds.handshake)
        await self.aclose()

    async def __aenter__(self) -> ReduceClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await (self.finish() if exc_type is None else self.aclose())

    # -- frame level ---------------------------------------------------------

    async def all_reduce(self, frame: RoundFrame) -> RoundFrame:
        """Contribute ``frame`` and return the round's consensus (owning its bytes)."""
        return await self._exchange(frame, reuse_reply_buffer=False)

    def _check_ready(self) -> None:
        """Refuse a round while another is in flight (its frame may sit in our staging)
        or after the client broke."""
        if self._busy:
            raise ClientBusy(f"rank {self.rank}: another round is already in flight on this client "
                             "(one round at a time per client: await each before starting the next)")
        if self._broken is not None:
            raise FlodlError(f"rank {self.rank}: client unusable ({self._broken})")

    async def _exchange(self, frame: RoundFrame, *, reuse_reply_buffer: bool) -> RoundFrame:
        """One round; with ``reuse_reply_buffer`` the consensus lands in the client's
        reply buffer, valid until the next round (for callers that copy it out)."""
        self._check_ready()
        # The frame's own checks run before a byte goes out: a frame they refuse costs
        # nothing, and the client stays usable (only a round cut short spoils it).
        encoded, bound = frame_body_chunks(frame), max_reply_len(frame)
        self._busy = True
        try:
            reply = await self._round_trip(frame, encoded, bound, self._reply_buffer if reuse_reply_buffer else None)
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

    async def _round_trip(
        self, frame: RoundFrame, encoded: EncodedFrame, bound: int, into: ReceiveBuffer | None
    ) -> RoundFrame:
        """Send ``frame`` (``encoded``), then read its consensus of at most ``bound`` bytes."""
        await self._conn.send_frame(encoded, self._salt)
        with trio.move_on_after(math.inf if self.reply_timeout is None else self.reply_timeout) as waiting:
            try:
                length = await self._conn.receive_length_prefix(ceiling=bound)
            except FramingError as exc:
                raise FramingError(
                    f"rank {self.rank}: consensus is larger than this round's schema allows "
                    f"({bound} bytes): {exc}"
                ) from exc
        if waiting.cancelled_caught:
            raise PeerTimeout(
                f"rank {self.rank}: no consensus from {self._conn.peer} within reply_timeout "
                f"{self.reply_timeout:g} s (round {self.rounds})"
            )
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
        # On the local leg the relay verified the record that carried it (docs/wire.md).
        mac = RunningMac(self._salt.hmac(), max(length - 8, 0)) if self._conn.signed_frames else None
        await self._conn.receive_into(body, "the consensus frame", mac)
        reply = decode_round_frame(
            body, self._salt, source=f"relay (rank {self.rank}'s consensus)",
            mac_of_body=mac.tag() if mac is not None else None, authenticated=mac is None,
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

    # -- joining -------------------------------------------------------------

    async def fetch_state(self) -> ClusterState:
        """The state this rank starts from (see :meth:`join`, which loads it): window -1
        and no frames on a cluster that has not completed a window yet; for a rank
        coming back, the consensus of the window before the one it enters."""
        if self._broken is not None:  # (a closed client would dial the relay for nothing)
            raise FlodlError(f"rank {self.rank}: client unusable ({self._broken})")
        host, port = self.relay
        self.joined = True  # it takes part in elastic membership from now on
        return await fetch_cluster_state(
            host, port, self.rank, self.world_size, self._salt, bounds=self._bounds, connect=self._connect,
            reply_timeout=self.reply_timeout,
        )

    async def join(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor] = ()) -> int:
        """Start from the cluster's consensus: call it once, before the first window.

        On a fresh cluster nothing changes and it returns 0. A rank that was
        restarted (or comes late) waits for the next window boundary, where
        the controller lets it back into its host's barrier; the averaged
        ``params`` and float ``buffers`` of the window just completed are
        written into these tensors in place, and the index of the window it
        runs next is returned. A trainer calls it the same way at first start
        and after a restart. The inner optimizer's state is the trainer's
        own: a restarted rank starts it fresh. Raises :class:`JoinRefused`
        (with the controller's reason) if the rank may not come back.
        """
        from .tensors import check_destinations, f32_copies, fragment_pieces, round_frame_to_tensors

        check_destinations([*params, *buffers], "join destination")
        state = self.last_state = await self.fetch_state()
        if not state.frames:
            return 0
        # Every shape is checked before anything is copied: an error leaves the tensors as they were.
        params_frames, buffers_frame = state.split([tuple(t.shape) for t in params], [tuple(b.shape) for b in buffers])
        # One frame of whole tensors, or one per fragment, each a run of every tensor's elements.
        destinations = [list(params)] if len(params_frames) == 1 else fragment_pieces(params, len(params_frames))
        for frame, pieces in zip(params_frames, destinations):
            if frame.weight > 0:  # a window with no realized work kept everyone's own params
                round_frame_to_tensors(frame, out=pieces)
        if buffers_frame is not None and buffers_frame.weight > 0:
            round_frame_to_tensors(buffers_frame, out=list(buffers))
        if self.delta_codec is not None:  # a delta run's bases (set the codec first): the model's, or each fragment's
            fragmented = len(params_frames) > 1
            # (A weight-0 frame: a lineage whose first round had no mass, so no base yet.)
            self._joined_params = {(p if fragmented else None): f32_copies(pieces)
                                   for p, (frame, pieces) in enumerate(zip(params_frames, destinations)) if frame.weight > 0}
        if state.catch_up:
            self._catch_up(destinations, state)
        self.catching_up = set(range(len(params_frames))) if state.behind else set()
        return state.entry

    def _catch_up(self, destinations: Sequence[Sequence[torch.Tensor]], state: ClusterState) -> None:
        """A delta run's joiner: the state's params are the bases of window ``state.window``;
        the windows finished since came as the deltas the ranks were sent, which bring
        each base (and its ``destinations``: the model's params, or each fragment's
        pieces) up to its host's. With P fragments window ``w`` synced fragment ``w % P``."""
        from .tensors import copy_arrays_into

        if self.delta_codec is None:
            raise ConfigError(
                f"rank {self.rank}: the cluster runs delta rounds (a codec): set client.delta_codec before join()"
            )
        fragments = len(destinations)
        for offset, frame in enumerate(state.catch_up):
            fragment = (state.window + 1 + offset) % fragments if fragments > 1 else None
            base = self.delta_state(fragment).take(frame, self.rank)
            if base is not None:  # (None: a first round with zero mass, which every rank skipped)
                copy_arrays_into(destinations[fragment or 0], base)

    def delta_state(self, fragment: int | None = None) -> RankDelta:
        """This rank's delta-round state for :attr:`delta_codec` and one params set (the
        model, or fragment ``fragment``): made at its first delta round, from the state
        join() loaded if it loaded one."""
        if self.delta_codec is None:
            raise ConfigError(f"rank {self.rank}: no delta codec is set")
        delta = self._deltas.get(fragment)
        if delta is None or delta.codec != self.delta_codec or delta.error_feedback != self.delta_error_feedback:
            owner = f"rank {self.rank}" + ("" if fragment is None else f", fragment {fragment}")
            delta = self._deltas[fragment] = RankDelta(self.delta_codec, error_feedback=self.delta_error_feedback,
                                                       owner=owner)
            if fragment in self._joined_params:
                delta.start_from(self._joined_params[fragment])
        self._joined_params.pop(fragment, None)
        return delta

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

    async def all_reduce_per_rank_f64(self, values: Sequence[float], *, fragment: FragmentTag | None = None) -> list[float]:
        """Gather one number per rank: this rank's ``values[rank]`` lands in its slot.

        Dead ranks' slots come back 0. Carried as f32 (flodl's wire format):
        exact for integers up to 2**24. ``fragment``: the gather opens that
        fragment's window (the frame carries the fragment tag, docs/wire.md).
        """
        if len(values) != self.world_size:
            raise ConfigError(f"rank {self.rank}: per-rank gather needs {self.world_size} values, got {len(values)}")
        slots = np.zeros(self.world_size, dtype="<f4")
        slots[self.rank] = values[self.rank]
        tensors = [TensorPayload(DTYPE_F32, (self.world_size,), slots)]
        if fragment is not None:
            tensors += fragment.payloads()
        reply = await self.all_reduce(RoundFrame(tensors, RoundKind.CONTROL, 0.0))
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
        await self._client.__aexit__(exc_type, exc, tb)


async def open_handshaken(
    address: Address,
    who: str,
    relay_kind: str,
    handshake: bytes,
    ack_len: int,
    refusal: str,
    bounds: NetBounds,
    connect: Connector,
    stream: trio.abc.Stream | None = None,
) -> tuple[MessageStream, bytes]:
    """Dial ``who``'s ``relay_kind`` relay (unless ``stream`` is already connected to
    it), send the handshake and read the ack within ``bounds.handshake``.

    A relay refuses by closing before the ack; that becomes a FramingError
    saying why it might have (``refusal``). The connection is closed on any error.
    """
    host, port = parse_address(address)
    if stream is None:
        stream = await connect_with_retry(host, port, f"{who} -> {relay_kind}", bounds, connect)
    conn = MessageStream(stream, f"{relay_kind} {host}:{port}", bounds)
    try:
        await conn.send_chunks([handshake])
        with trio.fail_after(bounds.handshake):
            ack = await conn.receive_exactly(ack_len, f"the {relay_kind.split()[0]} handshake ack")
    except PeerClosedMidFrame as exc:
        await conn.aclose()
        raise FramingError(
            f"{who}: {relay_kind} {host}:{port} closed the connection before the handshake ack ({refusal})"
        ) from exc
    except trio.TooSlowError as exc:
        await conn.aclose()
        raise PeerTimeout(f"{who}: no handshake ack from {relay_kind} {host}:{port} within {bounds.handshake:.0f} s") from exc
    except BaseException:
        await conn.aclose()
        raise
    return conn, ack


_U32_MAX = 0xFFFFFFFF  # the handshakes carry rank and world size as u32


def check_rank(rank: int, world_size: int) -> None:
    """Argument errors, raised before any traffic (the handshake could not carry them)."""
    for name, value in (("world_size", world_size), ("rank_id", rank)):
        try:
            operator.index(value)  # an int, or an integer type such as numpy's
        except TypeError:
            raise ConfigError(f"{name} must be an int, got {value!r}") from None
    if world_size > _U32_MAX:
        raise ConfigError(f"world_size must be at most {_U32_MAX} (a u32 on the wire), got {world_size}")
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank_id {rank} must be < world_size {world_size}")


def connect_reduce_client(
    address: Address,
    rank: int,
    world_size: int,
    salt: SessionSalt | bytes,
    *,
    connect_attempts: int | None = None,
    connect_interval: float | None = None,
    reply_timeout: float | None = None,
    bounds: NetBounds | None = None,
    connect: Connector = trio.open_tcp_stream,
    local_leg: bool | None = None,
) -> _Connect:
    """Connect rank ``rank`` to its host's data relay at ``address``.

    Argument errors are raised before any network traffic. The relay refuses a
    wrong world size, a rank outside its host set or a duplicate rank by
    closing before the ack; that surfaces here as a handshake error.
    ``bounds`` defaults to :meth:`NetBounds.from_env`; ``connect_attempts`` and
    ``connect_interval`` override its dialing budget. ``local_leg``: when the
    address is a loopback one and the relay there offers the Unix-socket local
    leg (run by this user or root), use it; None (the default) means yes unless
    ``FLODL_NO_UNIX`` is set, and a custom ``connect`` always dials with it.
    """
    check_rank(rank, world_size)
    session = SessionSalt.coerce(salt)
    net = dialing_bounds(bounds, connect_attempts, connect_interval)
    parse_address(address)  # a malformed address is an argument error too

    wants_local = (local_leg if local_leg is not None else local_leg_enabled()) and connect is trio.open_tcp_stream

    async def open_client() -> ReduceClient:
        host, port = parse_address(address)
        local = await dial_local_leg(host, port, f"rank {rank}") if wants_local else None
        why = (f"it refused rank {rank} / world_size {world_size}: wrong world size, rank not on this host, "
               "or rank already connected")
        if local is None:
            handshake, ack_len = encode_data_handshake(rank, world_size), DATA_ACK_LEN
        else:  # the local leg: the handshake proves the salt once, frames go unsigned
            handshake, ack_len = encode_local_handshake(rank, world_size, session), LOCAL_ACK_LEN
            why += ", or another session salt (local leg)"
        conn, ack = await open_handshaken(
            address, f"rank {rank}", "data relay", handshake, ack_len, f"{why} - see the relay's log", net, connect, local,
        )
        conn.signed_frames = local is None
        try:
            if local is None:
                decode_data_ack(ack)
            else:
                decode_local_ack(ack, handshake, session)
        except BaseException:
            await conn.aclose()
            raise
        return ReduceClient(
            conn, rank, world_size, session, reply_timeout=reply_timeout, relay=parse_address(address),
            bounds=net, connect=connect,
        )

    return _Connect(open_client)


def dialing_bounds(bounds: NetBounds | None, attempts: int | None, interval: float | None) -> NetBounds:
    """``bounds`` (default: from the environment) with the dialing budget overridden where given."""
    net = bounds if bounds is not None else NetBounds.from_env()
    if attempts is not None:
        net = attrs.evolve(net, connect_attempts=attempts)
    if interval is not None:
        net = attrs.evolve(net, connect_interval=interval)
    return net
