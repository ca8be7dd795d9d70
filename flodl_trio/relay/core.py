"""The per-host relay: formation, then one channel, as an async context manager.

Formation accepts the host's ranks (each handshake in its own handler task,
with a deadline, so a silent or slow client cannot block the others), and once
every local rank is in, dials the controller and sends ``Hello``. The channel
(:mod:`.channels`) then runs until it ends: upstream EOF, the last local rank
leaving, or an error, which travels out of the nurseries to
:func:`open_relay`'s boundary, where it is recorded for ``wait_finished``.

The relay serves whatever listeners it is given (``listeners=``; by default it
binds TCP on ``listen``, and a data relay also the Unix-socket local leg) and
dials the controller with ``connect`` (by default ``trio.open_tcp_stream``),
so a whole cluster can also run in memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import attrs
import trio

from ..errors import ConfigError, FlodlError, HandshakeError, ProtocolError
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import (
    Connector,
    Listeners,
    connect_with_retry,
    listener_port,
    local_host,
    peer_host,
    tune_socket,
    warn_if_public_peer,
)
from ..transport.local_leg import (
    local_leg_enabled,
    open_local_leg_listener,
    peer_credentials,
    trusted_uid,
    tune_local_stream,
)
from ..transport.refusals import Refusals
from ..transport.settings import NetBounds
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import RunOutcome, serving
from ..wire.constants import CHANNEL_MAGIC_STATE, DEFAULT_FRAME_CEILING
from ..wire.handshake import (
    CONTROL_HANDSHAKE_LEN,
    DATA_HANDSHAKE_LEN,
    LOCAL_HANDSHAKE_LEN,
    decode_control_handshake,
    decode_data_handshake,
    decode_local_handshake,
    encode_control_ack,
    encode_data_ack,
    encode_local_ack,
)
from ..wire.mux import (
    EXTENSIONS_MARK,
    Hello,
    HelloAck,
    Lanes,
    ShardOffer,
    Shards,
    MuxKind,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.control_frame import encode_control_frame
from ..wire.liveness import beacon_frame, timeout_ms
from ..wire.salt import SessionSalt
from ..wire.state import STATE_REQUEST_LEN, decode_state_request
from .channels import Channel
from .config import ChannelKind, RelayConfig, RelayStats
from .data_plane import DataPlane
from .host_ranks import HostRanks
from .router import ControlRouter

log = logging.getLogger("flodl_trio.relay")

_ANY_HOST = ("", "0.0.0.0", "::")  # a shard listening on every address: offered at the one the controller sees

# Bytes moved at a time when piping a joiner's state from the controller.
PIPE_CHUNK = 4 << 20


async def _pipe(source: MessageStream, sink: MessageStream, done: trio.CancelScope) -> None:
    """Copy bytes from ``source`` to ``sink`` until either closes, then end the pipe
    (one buffer, reused: a model-sized state costs no allocation per chunk)."""
    view = memoryview(bytearray(PIPE_CHUNK))
    try:
        while n := await source.receive_available(view):
            await sink.send_chunks([view[:n]])
    except CONNECTION_LOST:
        pass
    done.cancel()


class RelayHandle:
    """A running relay: its bound port, counters, and how it ended."""

    def __init__(self, config: RelayConfig, port: int, unix_path: Path | None = None) -> None:
        self.config = config
        self.port = port
        self.unix_path = unix_path  # the local leg's socket (a data relay's), if it listens on one
        self.stats = RelayStats()
        self.rejections = Refusals()
        self.outcome = RunOutcome()
        self._offer: Callable[[int], None] | None = None  # set once the data channel runs

    def offer_shard(self, port: int) -> bool:
        """Offer the controller this host's shard again, now listening on ``port`` (its
        process was started again): it goes up before the next HostFrame, and a
        controller with ``shards="auto"`` serves a lost shard with it (docs/wire.md, "A
        lost shard served again"). False when the data channel is not running."""
        if self._offer is None:
            return False
        self._offer(port)
        return True

    @property
    def host_name(self) -> str:
        return self.config.host_name

    async def wait_finished(self) -> None:
        """Wait until the relay ends on its own (last rank gone, controller closed);
        raise the error that stopped it, if one did."""
        await self.outcome.wait()


@asynccontextmanager
async def open_relay(
    kind: ChannelKind,
    *,
    listen: tuple[str, int] | None = None,
    upstream: tuple[str, int],
    host_name: str,
    ranks: Sequence[int],
    world_size: int,
    salt: SessionSalt | bytes,
    ceiling: int = DEFAULT_FRAME_CEILING,
    connect_attempts: int | None = None,
    connect_interval: float | None = None,
    bounds: NetBounds | None = None,
    listeners: Listeners | None = None,
    connect: Connector = trio.open_tcp_stream,
    host: HostRanks | None = None,
    deterministic: bool = False,
    local_leg: bool | None = None,
    unix_dir: str | os.PathLike[str] | None = None,
    memory_budget: int | None = None,
    lanes: int | None = None,
    shard_offer: tuple[str, int] | None = None,
) -> AsyncIterator[RelayHandle]:
    """Run a relay channel for one host while the block runs.

    Ranks connect to ``listen`` (``(host, port)``; port 0 picks a free one),
    or to the given ``listeners``; ``handle.port`` is bound on entry.
    ``bounds`` defaults to :meth:`NetBounds.from_env`; ``connect_attempts``
    and ``connect_interval`` override its dialing budget. A host's data and
    control channels should share one ``host`` (:class:`HostRanks`): then a
    rank the cluster declares dead before it ever connected does not hold up
    the control channel's formation. ``deterministic``: fold the ranks in rank
    order, whatever order their frames arrive in (a rank's frame waits in its
    socket until the ranks before it are folded). ``local_leg``: a data relay
    that binds ``listen`` itself also listens on a Unix socket for ranks on
    this machine, whose frames are not signed (docs/wire.md, "The local leg");
    None (the default) means on unless ``FLODL_NO_UNIX`` is set. ``unix_dir``
    overrides the socket's directory (default ``FLODL_UNIX_DIR`` or
    ``/tmp/flodl_trio-<uid>``); ``handle.unix_path`` is the socket.
    ``memory_budget`` (bytes; default 2 x the model's frame + 150 MiB): a data
    relay takes its second model-sized receive buffer only if it stays within it.
    ``lanes``: None (the default) takes the controller's lane count, which it says
    before HelloAck; a count must be the controller's (ConfigError naming both). The
    data relay then ships each HostFrame as that many lane frames (docs/wire.md,
    "Lanes").
    ``shard_offer``: a data relay serving a reduction shard (an ``open_shard``)
    offers it to the controller, which uses it if it takes the relays' shards
    (``shards="auto"``); a host of ``""``, ``0.0.0.0`` or ``::`` offers the
    address this relay reaches the controller from (docs/wire.md, "Shards by
    default").
    Leaving the block shuts the relay down; an error it hit that nobody
    awaited through ``wait_finished()`` is raised on exit.
    """
    net = bounds if bounds is not None else NetBounds.from_env()
    if connect_attempts is not None:
        net = attrs.evolve(net, connect_attempts=connect_attempts)
    if connect_interval is not None:
        net = attrs.evolve(net, connect_interval=connect_interval)
    config = RelayConfig(
        kind, upstream, host_name, tuple(sorted(ranks)), world_size, SessionSalt.coerce(salt), ceiling, net,
        deterministic, memory_budget, lanes, connect=connect, shard_offer=shard_offer,
    )
    config.validate()
    unix_path = None
    if listeners is None:
        if listen is None:
            raise ConfigError(f"relay {host_name}: give listen=(host, port) or listeners=")
        listeners = await trio.open_tcp_listeners(listen[1], host=listen[0])
        wants_unix = local_leg if local_leg is not None else local_leg_enabled()
        if wants_unix and kind is ChannelKind.DATA:
            unix = await open_local_leg_listener(listener_port(listeners[0]), Path(unix_dir) if unix_dir else None)
            if unix is not None:
                listeners, unix_path = [*listeners, unix], unix.path
    handle = RelayHandle(config, listener_port(listeners[0]), unix_path)
    relay = _Relay(config, handle, listeners, connect, host if host is not None else HostRanks(config.ranks))
    async with serving(relay.run, handle.outcome, log, f"relay {host_name}"):
        yield handle


class _Relay:
    """Formation (dial the controller; accept the host's ranks) then the channel.

    The data relay dials the controller at once, so the controller knows who
    carries the host's ranks before they all arrive (a rank that never
    connects can be declared dead and the others go on); ranks join the
    running channel as their handshakes complete. The control relay waits
    until each of its ranks has connected or been declared dead (the data
    channel hears of that, through the :class:`HostRanks` both share): its
    Hello carries the connected ranks' model signatures.
    """

    def __init__(
        self, config: RelayConfig, handle: RelayHandle, listeners: Listeners, connect: Connector, host: HostRanks
    ) -> None:
        self.config = config
        self.handle = handle
        self.listeners = listeners
        self.connect = connect
        self.host = host
        self.claimed: set[int] = set()  # ranks with a handshake under way or done: a second is a duplicate
        self.waiting: dict[int, MessageStream] = {}  # handshaken before the channel started
        self.signatures: dict[int, bytes] = {}
        self.announced: dict[int, bytes] = {}  # signatures the control Hello gave each rank
        self.channel: Channel | None = None
        self._shards_said: tuple[tuple[str, int], ...] = ()  # the reduction shards the controller named
        self._offered_host: str | None = None  # the host this relay's shard was offered at

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._serve_rank_connection, self.listeners)
                if self.config.kind is ChannelKind.DATA:
                    upstream, lanes = await self._dial_controller(self.config.ranks)
                    config = attrs.evolve(self.config.with_controllers_lanes(lanes), shards=self._shards_said)
                    self.channel = Channel(
                        config, upstream, self.handle.stats, self.host, self._released, DataPlane,
                        redial=partial(self._redial_data, config),
                    )
                    if self._offered_host is not None:
                        plane = self.channel.role
                        assert isinstance(plane, DataPlane)
                        self.handle._offer = partial(plane.offer_shard, self._offered_host)
                else:
                    ranks, away = await self._form_control_channel()
                    if not ranks:
                        log.info("relay %s: no rank of the host connected to the control channel before it "
                                 "left or was declared dead; the channel closes", self.config.host_name)
                        nursery.cancel_scope.cancel()  # (its listeners too)
                        return
                    upstream, _ = await self._dial_controller(ranks)
                    self.channel = Channel(
                        self.config, upstream, self.handle.stats, self.host, self._released, ControlRouter, ranks, away,
                        redial=partial(self._redial_control, ranks),
                    )
                waiting, self.waiting = self.waiting, {}
                for rank, conn in waiting.items():
                    await self._hand_over(rank, conn)
                await self.channel.run()
                nursery.cancel_scope.cancel()
        finally:
            for conn in self.waiting.values():
                await conn.aclose()
            if self.channel is not None:
                for conn in self.channel.conns.values():
                    await conn.aclose()
            self._log_summary()

    async def _serve_rank_connection(self, stream: trio.abc.Stream) -> None:
        """One rank connection's handler: the handshake, then hold the connection
        until the channel is done with it (when this returns, the stream closes).
        A joining rank's state request (data port) is piped to the controller instead."""
        conn = self._accept_stream(stream)
        if conn is None:
            return
        # One deadline for the whole handshake (or state request), however its bytes trickle in.
        deadline = trio.current_time() + self.config.bounds.handshake
        try:
            with trio.fail_at(deadline):
                magic = await conn.receive_exactly(4, "the first 4 bytes")
        except (*CONNECTION_LOST, trio.TooSlowError) as exc:
            reason = "no complete handshake within the deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"relay {self.config.host_name}: refused {conn.peer}: {reason}")
            return
        if self.config.kind is ChannelKind.DATA and int.from_bytes(magic, "little") == CHANNEL_MAGIC_STATE:
            await self._pipe_state(conn, magic, deadline)
            return
        rank = await self._admit(conn, magic, deadline)
        if rank is None:
            return
        if self.channel is None:
            superseded = self.waiting.get(rank)
            self.waiting[rank] = conn
            self.host.changed.notify()
            if superseded is not None:
                await superseded.aclose()
        else:
            await self._hand_over(rank, conn)
        await conn.wait_closed()

    def _accept_stream(self, stream: trio.abc.Stream) -> MessageStream | None:
        """Wrap a new rank connection; one on the local leg only from this user or root
        (checked before a byte is read), and its frames are then unsigned."""
        peer = peer_credentials(stream)
        if peer is None:
            tune_socket(stream)
            host = peer_host(stream)
            warn_if_public_peer(f"relay {self.config.host_name}", host)  # ranks off this machine, in cleartext
            return MessageStream(stream, f"rank connection from {host}", self.config.bounds)
        if not trusted_uid(peer.uid):
            self._refuse(
                f"relay {self.config.host_name}: refused a local-leg connection from uid {peer.uid} (pid {peer.pid}): "
                f"only uid {os.getuid()} (this relay's user) or root may use it"
            )
            return None
        tune_local_stream(stream)
        conn = MessageStream(stream, f"local-leg connection from pid {peer.pid}", self.config.bounds)
        conn.signed_frames = False
        return conn

    async def _form_control_channel(self) -> tuple[tuple[int, ...], frozenset[int]]:
        """The control channel's formation, beaconing the ranks that wait for it."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._beacon_waiting_ranks)
            formed = await self._control_formation()
            nursery.cancel_scope.cancel()
        return formed

    async def _beacon_waiting_ranks(self) -> None:
        """Keep the ranks that wait for the control channel to form alive: the relay joins
        the coordinator only once every rank of the host is in, and a rank that hears
        nothing for its beacon timeout takes the cluster for lost. So a host whose ranks
        start minutes apart (one loads a large checkpoint) must not lose the early ones.
        The relay beacons each rank the moment it is in, then at its own heartbeat pace
        (docs/liveness.md); the coordinator's beacons take over once the channel runs."""
        period = self.config.bounds.heartbeat_timeout / 4
        beaconed: set[MessageStream] = set()
        lost: set[MessageStream] = set()  # connections a beacon could not be written to (closed)
        seq = 0
        due = trio.current_time()
        while True:
            change = self.host.changed.next_change()  # a rank in while we write is beaconed at once
            now = trio.current_time()
            every = now >= due
            fresh = [(rank, conn) for rank, conn in self.waiting.items()
                     if conn not in lost and (every or conn not in beaconed)]
            if fresh:
                seq += 1
                await self._beacon(fresh, seq, beaconed, lost)
            if every:
                due = now + period
            with trio.move_on_at(due):
                await change.wait()

    async def _beacon(self, ranks: list[tuple[int, MessageStream]], seq: int, beaconed: set[MessageStream],
                      lost: set[MessageStream]) -> None:
        """One beacon, signed with the session salt, to each of ``ranks``; a connection it
        cannot be written to is closed (its rank is gone) and skipped from then on."""
        beacon = beacon_frame(seq, self.config.world_size, 0, timeout_ms(self.config.bounds.heartbeat_timeout))
        blob = encode_control_frame(beacon, self.config.salt)
        for rank, conn in ranks:
            try:
                await conn.send_len_framed([blob], len(blob))
                beaconed.add(conn)
            except (*CONNECTION_LOST, FlodlError) as exc:
                log.info("relay %s: rank %d, waiting for the control channel to form, is gone: %s",
                         self.config.host_name, rank, exc)
                lost.add(conn)
                await conn.aclose()

    async def _control_formation(self) -> tuple[tuple[int, ...], frozenset[int]]:
        """The control channel's ranks, and those of them away: once every rank of the
        host has either completed its handshake, been declared dead (heard through
        the data channel) or left the data channel for good (ranks that never open a
        control connection; one that called join() may come back, and is waited for).
        Dead ranks that may come back are carried too (as away, under the host's model
        signature), so they can connect later; at least one rank must be here to give
        that signature."""
        while True:
            present = set(self.waiting)
            away = set(self.host.may_return(self.host.dead))
            left = self.host.left_data - set(self.host.may_return(self.host.left_data))
            formed = self.host.ranks <= present | self.host.dead | left
            if formed and (present or not away):
                break
            await self.host.changed.wait()
        return tuple(sorted((present - self.host.dead) | away)), frozenset(away)

    async def _hand_over(self, rank: int, conn: MessageStream) -> None:
        """Give a handshaken rank to the channel (as a rank coming back if it had left);
        close it if the channel does not take it."""
        channel = self.channel
        assert channel is not None
        taken = channel.rejoin(rank, conn) if rank in channel.gone else channel.join(rank, conn)
        if not taken:
            log.info("relay %s: rank %d is not part of this %s channel any more; closed",
                     self.config.host_name, rank, self.config.kind.value)
            if rank not in channel.conns:  # else the claim is the connection the channel holds
                self.claimed.discard(rank)
            await conn.aclose()

    def _released(self, rank: int) -> None:
        """The channel is done with ``rank``'s connection: the rank may connect again."""
        self.claimed.discard(rank)

    async def _admit(self, conn: MessageStream, magic: bytes, deadline: float) -> int | None:
        """Terminate one rank's handshake by ``deadline``; refuse (and log) anything wrong."""
        rank: int | None = None
        try:
            with trio.fail_at(deadline):
                rank, handshake = await self._handshake(conn, magic)
                await conn.send_chunks([self._ack(conn, handshake)])
        except (ProtocolError, *CONNECTION_LOST, trio.TooSlowError) as exc:
            if rank is not None:
                self.claimed.discard(rank)  # its handshake failed: the rank may try again
            reason = "no complete handshake within the deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"relay {self.config.host_name}: refused {conn.peer}: {reason}")
            return None
        conn.peer = f"rank {rank}"
        if not conn.signed_frames:
            self.handle.stats.local_connections += 1
        return rank

    def _ack(self, conn: MessageStream, handshake: bytes) -> bytes:
        """The answer to an accepted handshake (on the local leg, signed: see _handshake)."""
        if self.config.kind is ChannelKind.CONTROL:
            return encode_control_ack(self.config.salt)
        return encode_data_ack() if conn.signed_frames else encode_local_ack(handshake, self.config.salt)

    async def _handshake(self, conn: MessageStream, magic: bytes) -> tuple[int, bytes]:
        """Read and check the handshake, then claim the rank (before any other await,
        so of two simultaneous handshakes for one rank the second is refused).
        On the local leg, whose frames are not signed, the data handshake carries a
        tag: a rank of another run (another salt) is refused here, not folded."""
        if self.config.kind is ChannelKind.DATA and not conn.signed_frames:
            raw = magic + await conn.receive_exactly(LOCAL_HANDSHAKE_LEN - 4, "the local-leg handshake")
            hello = decode_local_handshake(raw, self.config.world_size, self.config.salt)
        elif self.config.kind is ChannelKind.DATA:
            raw = magic + await conn.receive_exactly(DATA_HANDSHAKE_LEN - 4, "the data handshake")
            hello = decode_data_handshake(raw, self.config.world_size)
        else:
            raw = magic + await conn.receive_exactly(CONTROL_HANDSHAKE_LEN - 4, "the control handshake")
            hello = decode_control_handshake(raw, self.config.world_size, self.config.salt)
        if hello.rank not in self.config.ranks:
            raise HandshakeError(
                f"rank {hello.rank} is not in host {self.config.host_name}'s rank set {list(self.config.ranks)}"
            )
        if hello.rank in self.claimed and not self._supersedes_waiting(hello.rank, conn):
            raise HandshakeError(f"duplicate rank {hello.rank}: {self._claim_state(hello.rank)}")
        announced = self.announced.get(hello.rank)
        if announced is not None and hello.model_signature != announced:
            raise HandshakeError(
                f"model signature mismatch: rank {hello.rank} has {hello.model_signature.hex()[:16]}..., "
                f"the rest of host {self.config.host_name} {announced.hex()[:16]}... (different models or dtypes)"
            )
        self.claimed.add(hello.rank)
        self.signatures[hello.rank] = hello.model_signature
        return hello.rank, raw

    async def _pipe_state(self, conn: MessageStream, magic: bytes, deadline: float) -> None:
        """Pass a joining rank's state request to the controller and its reply back, as
        bytes (both ends authenticate them with the salt; the relay only moves them).
        The reply may wait for a window boundary, so the pipe has no deadline of its
        own: either end closing closes the other; the request itself is due by ``deadline``."""
        bounds = self.config.bounds
        try:
            with trio.fail_at(deadline):
                request = magic + await conn.receive_exactly(STATE_REQUEST_LEN - 4, "the state request")
            rank = self._note_joiner(request)
            if rank is not None and self.channel is not None:
                await self._controller_back(rank)
                await self.channel.goodbyes_written(rank)  # its last connection's end goes first
            host, port = self.config.upstream
            stream = await connect_with_retry(host, port, f"relay {self.config.host_name} state pipe", bounds, self.connect)
            upstream = MessageStream(stream, f"controller {host}:{port} (state)", bounds)
            try:
                await upstream.send_chunks([request])
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_pipe, upstream, conn, nursery.cancel_scope)
                    nursery.start_soon(_pipe, conn, upstream, nursery.cancel_scope)
            finally:
                await upstream.aclose()
        except (FlodlError, *CONNECTION_LOST, trio.TooSlowError) as exc:
            log.info("relay %s: state request from %s ended early: %s", self.config.host_name, conn.peer, exc or "timed out")

    async def _controller_back(self, rank: int) -> None:
        """Until a lost controller is back (at once when it is not lost): a verified state
        request taken while it is away holds, as the rank's other connections do, up to
        the outage bound (then the channel ends, and this connection with it). Dialed at
        once, it was given up after the connect budget, failing the rank's join."""
        assert self.channel is not None
        if self.channel.controller_away:
            log.info("relay %s: rank %d asks for its state while the controller is away; the request waits for it",
                     self.config.host_name, rank)
        await self.channel.controller_back()

    def _note_joiner(self, request: bytes) -> int | None:
        """A rank of this host that asks for its state called join(): it may come back
        after a crash, so the relay stays up for it; its rank (None: not one of ours, or
        a request that does not verify, which is still piped: the controller refuses it
        and says so in its log)."""
        try:
            rank = decode_state_request(request, self.config.world_size, self.config.salt).rank
        except ProtocolError:
            return None
        if rank not in self.config.ranks:
            return None
        self.host.elastic.add(rank)
        return rank

    def _supersedes_waiting(self, rank: int, conn: MessageStream) -> bool:
        """Whether a verified handshake for ``rank`` takes the place of its connection
        that waits for the channel to form. Nobody reads a waiting connection, so
        its rank's death goes unnoticed there; a rank restarted meanwhile must not
        be refused as a duplicate (its restart would fail, and the formation would
        wait on a dead connection). Only a handshake as strong as the first may
        replace it: on the control channel and the local leg the handshake is
        MACed with the salt; a plain TCP data handshake is not, and is refused."""
        if self.channel is not None or rank not in self.waiting:
            return False
        if self.config.kind is ChannelKind.DATA and conn.signed_frames:
            return False
        log.info("relay %s: rank %d connected again before the %s channel formed; its earlier connection is closed",
                 self.config.host_name, rank, self.config.kind.value)
        return True

    def _claim_state(self, rank: int) -> str:
        """Why a rank already claimed cannot connect again, in words."""
        if self.channel is not None and rank in self.channel.gone:
            return "it left the cluster; rejoin is not supported"
        if self.channel is not None and rank in self.channel.conns:
            return "already joined"
        return "already connected"

    def _refuse(self, message: str) -> None:
        log.warning("%s", message)
        self.handle.rejections.add(message)
        self.handle.stats.rejected += 1

    async def _redial_data(self, config: RelayConfig) -> MessageStream:
        """The data channel's new connection to a controller that came back: it must
        reduce in the lanes the channel does (ConfigError otherwise: the channel ends)."""
        upstream, said = await self._dial_controller(self.config.ranks)
        count, min_bytes = said if said is not None else (1, 0)
        if (count, min_bytes) != (config.lanes, config.lane_min_bytes):
            await upstream.aclose()
            raise ConfigError(
                f"relay {self.config.host_name}: the controller came back reducing in {count} lane(s) of "
                f"{min_bytes} bytes, the channel in {config.lanes} of {config.lane_min_bytes}: start it as it was started"
            )
        plane = None if self.channel is None else self.channel.role
        if self._shards_said and isinstance(plane, DataPlane):
            plane.shards_said_again(self._shards_said)
        return upstream

    async def _redial_control(self, ranks: tuple[int, ...]) -> MessageStream:
        upstream, _ = await self._dial_controller(ranks)
        return upstream

    async def _dial_controller(self, ranks: tuple[int, ...]) -> tuple[MessageStream, tuple[int, int] | None]:
        """Connect upstream and announce ``ranks`` (with their model signatures on the
        control channel); return once the controller acknowledged, with the lane count
        and bytes a data relay was told before HelloAck (None: none, one lane)."""
        host, port = self.config.upstream
        bounds = self.config.bounds
        stream = await connect_with_retry(host, port, f"relay {self.config.host_name} upstream", bounds, self.connect)
        upstream = MessageStream(stream, f"controller {host}:{port}", bounds)
        try:
            return await self._say_hello(upstream, ranks)
        except BaseException:
            # Never left open: a controller that reads this Hello late (from its listen
            # backlog, while it started) would seat a relay that is gone.
            await upstream.aclose()
            raise

    async def _say_hello(
        self, upstream: MessageStream, ranks: tuple[int, ...]
    ) -> tuple[MessageStream, tuple[int, int] | None]:
        """Hello, then what the controller says up to its HelloAck (and this relay's shard offer)."""
        host, port = self.config.upstream
        bounds = self.config.bounds
        salt = self.config.salt
        if self.config.kind is ChannelKind.CONTROL:
            sigs = [self._announced_signature(r) for r in ranks]
        else:  # flodl's data Hello carries none: this relay's says it takes flodl_trio's control messages
            sigs = [EXTENSIONS_MARK]
        hello = Hello(self.config.host_name, ranks, sigs)
        magic = self.config.kind.magic.to_bytes(4, "little")
        await upstream.send_chunks([magic, *encode_mux_record(MuxKind.CONTROL, encode_control_msg(hello), salt).chunks])
        lanes: tuple[int, int] | None = None
        with trio.fail_after(bounds.handshake):
            while True:
                header = await upstream.receive_mux_header(SMALL_MESSAGE)
                if header is None:
                    raise HandshakeError(f"relay {self.config.host_name}: controller {host}:{port} closed before HelloAck")
                kind, payload = await upstream.receive_mux_payload(header, ReceiveBuffer(), salt)
                reply = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
                if isinstance(reply, HelloAck):
                    break
                if isinstance(reply, Shards) and self.config.kind is ChannelKind.DATA and lanes is not None:
                    self._shards_said = reply.addresses  # the shards extension: said before HelloAck
                    continue
                if not (isinstance(reply, Lanes) and self.config.kind is ChannelKind.DATA and lanes is None):
                    raise HandshakeError(
                        f"relay {self.config.host_name}: expected HelloAck from controller, got {kind.name} {reply}"
                    )
                lanes = (reply.count, reply.min_bytes)  # the lanes extension: said before HelloAck
        log.info("relay %s: joined controller %s:%d with ranks %s%s", self.config.host_name, host, port, list(ranks),
                 f" in {lanes[0]} lanes" if lanes else "")
        offer = self.config.shard_offer
        if offer is not None and lanes is not None and self.config.kind is ChannelKind.DATA:
            offered = ShardOffer(offer[0] if offer[0] not in _ANY_HOST else local_host(upstream.stream) or host, offer[1])
            self._offered_host = offered.host
            await upstream.send_chunks(encode_mux_record(MuxKind.CONTROL, encode_control_msg(offered), salt).chunks)
        return upstream, lanes

    def _announced_signature(self, rank: int) -> bytes:
        """A rank's model signature for the control Hello: its own, or - for a rank away
        when the channel formed - the host's. A rank that connects again later must
        match it (see _handshake): the coordinator checked it against the cluster."""
        self.announced[rank] = self.signatures.get(rank) or next(iter(self.signatures.values()))
        return self.announced[rank]

    def _log_summary(self) -> None:
        s = self.handle.stats
        folding = f" fold-ratio={s.fold_ratio:.2f}x" if self.config.kind is ChannelKind.DATA else ""
        log.info(
            "relay %s %s summary: ranks=%d rounds=%d local=%.2fMB uplink=%.2fMB%s",
            self.config.host_name, self.config.kind.value, len(self.config.ranks), s.rounds,
            s.bytes_local / 1e6, s.bytes_up / 1e6, folding,
        )


__all__ = ["RelayHandle", "open_relay"]
