"""The per-host relay: formation, then one channel, as an async context manager.

Formation accepts the host's ranks (each handshake in its own handler task,
with a deadline, so a silent or slow client cannot block the others), and once
every local rank is in, dials the controller and sends ``Hello``. The channel
(:mod:`.channels`) then runs until it ends: upstream EOF, the last local rank
leaving, or an error, which travels out of the nurseries to
:func:`open_relay`'s boundary, where it is recorded for ``wait_finished``.

The relay serves whatever listeners it is given (``listeners=``; by default it
binds TCP on ``listen``) and dials the controller with ``connect`` (by
default ``trio.open_tcp_stream``), so a whole cluster can also run in memory.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from ..errors import ConfigError, HandshakeError, ProtocolError
from ..settings import NetBounds
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import (
    Connector,
    connect_with_retry,
    listener_port,
    peer_host,
    tune_socket,
)
from ..transport.stream import CONNECTION_LOST, MessageStream
from ..transport.tasks import RunOutcome, run_service, service_nursery
from ..wire.constants import DEFAULT_FRAME_CEILING
from ..wire.handshake import (
    CONTROL_HANDSHAKE_LEN,
    DATA_HANDSHAKE_LEN,
    decode_control_handshake,
    decode_data_handshake,
    encode_control_ack,
    encode_data_ack,
)
from ..wire.mux import (
    Hello,
    HelloAck,
    MuxKind,
    decode_control_msg,
    encode_control_msg,
    encode_mux_record,
)
from ..wire.salt import SessionSalt
from .channels import ControlChannel, DataChannel
from .config import ChannelKind, RelayConfig, RelayStats

log = logging.getLogger("flodl_trio.relay")

Listeners = Sequence[trio.abc.Listener[trio.abc.Stream]]


class RelayHandle:
    """A running relay: its bound port, counters, and how it ended."""

    def __init__(self, config: RelayConfig, port: int) -> None:
        self.config = config
        self.port = port
        self.stats = RelayStats()
        self.rejections: list[str] = []
        self.outcome = RunOutcome()

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
) -> AsyncIterator[RelayHandle]:
    """Run a relay channel for one host while the block runs.

    Ranks connect to ``listen`` (``(host, port)``; port 0 picks a free one),
    or to the given ``listeners``; ``handle.port`` is bound on entry.
    ``bounds`` defaults to :meth:`NetBounds.from_env`; ``connect_attempts``
    and ``connect_interval`` override its dialing budget. Leaving the block
    shuts the relay down; an error it hit that nobody awaited through
    ``wait_finished()`` is raised on exit.
    """
    net = bounds if bounds is not None else NetBounds.from_env()
    if connect_attempts is not None:
        net = attrs.evolve(net, connect_attempts=connect_attempts)
    if connect_interval is not None:
        net = attrs.evolve(net, connect_interval=connect_interval)
    config = RelayConfig(
        kind, upstream, host_name, tuple(sorted(ranks)), world_size, SessionSalt.coerce(salt), ceiling, net
    )
    config.validate()
    if listeners is None:
        if listen is None:
            raise ConfigError(f"relay {host_name}: give listen=(host, port) or listeners=")
        listeners = await trio.open_tcp_listeners(listen[1], host=listen[0])
    handle = RelayHandle(config, listener_port(listeners[0]))
    relay = _Relay(config, handle, listeners, connect)
    async with service_nursery() as nursery:
        nursery.start_soon(run_service, relay.run, handle.outcome, log, f"relay {host_name}")
        yield handle
    if (error := handle.outcome.unreported_error()) is not None:
        raise error


class _Relay:
    """Formation (accept the host's ranks, dial the controller) then the channel."""

    def __init__(self, config: RelayConfig, handle: RelayHandle, listeners: Listeners, connect: Connector) -> None:
        self.config = config
        self.handle = handle
        self.listeners = listeners
        self.connect = connect
        self.joined: dict[int, MessageStream] = {}
        self.signatures: dict[int, bytes] = {}
        self.all_joined = trio.Event()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._serve_rank_connection, self.listeners)
                await self.all_joined.wait()
                upstream = await self._dial_controller()
                channel_type = DataChannel if self.config.kind is ChannelKind.DATA else ControlChannel
                await channel_type(self.config, self.joined, upstream, self.handle.stats).run()
                nursery.cancel_scope.cancel()
        finally:
            for conn in self.joined.values():
                await conn.aclose()
            self._log_summary()

    async def _serve_rank_connection(self, stream: trio.abc.Stream) -> None:
        """One rank connection's handler: the handshake, then hold the connection
        until the channel is done with it (when this returns, the stream closes)."""
        tune_socket(stream)
        conn = MessageStream(stream, f"rank connection from {peer_host(stream)}", self.config.bounds)
        if await self._admit(conn):
            await conn.wait_closed()

    async def _admit(self, conn: MessageStream) -> bool:
        """Terminate one rank's handshake; refuse (and log) anything wrong."""
        try:
            with trio.fail_after(self.config.bounds.handshake):
                rank = await self._handshake(conn)
                ack = encode_data_ack() if self.config.kind is ChannelKind.DATA else encode_control_ack(self.config.salt)
                await conn.send_chunks([ack])
        except (ProtocolError, *CONNECTION_LOST, trio.TooSlowError) as exc:
            reason = "no complete handshake within the deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"relay {self.config.host_name}: refused {conn.peer}: {reason}")
            return False
        conn.peer = f"rank {rank}"
        self.joined[rank] = conn
        if len(self.joined) == len(self.config.ranks):
            self.all_joined.set()
        return True

    async def _handshake(self, conn: MessageStream) -> int:
        if self.config.kind is ChannelKind.DATA:
            raw = await conn.receive_exactly(DATA_HANDSHAKE_LEN, "the data handshake")
            hello = decode_data_handshake(raw, self.config.world_size)
        else:
            raw = await conn.receive_exactly(CONTROL_HANDSHAKE_LEN, "the control handshake")
            hello = decode_control_handshake(raw, self.config.world_size, self.config.salt)
        if hello.rank not in self.config.ranks:
            raise HandshakeError(
                f"rank {hello.rank} is not in host {self.config.host_name}'s rank set {list(self.config.ranks)}"
            )
        if hello.rank in self.joined:
            state = "already connected" if not self.all_joined.is_set() else "already joined; rejoin is not supported"
            raise HandshakeError(f"duplicate rank {hello.rank}: {state}")
        self.signatures[hello.rank] = hello.model_signature
        return hello.rank

    def _refuse(self, message: str) -> None:
        log.warning("%s", message)
        self.handle.rejections.append(message)
        self.handle.stats.rejected += 1

    async def _dial_controller(self) -> MessageStream:
        host, port = self.config.upstream
        bounds = self.config.bounds
        stream = await connect_with_retry(host, port, f"relay {self.config.host_name} upstream", bounds, self.connect)
        upstream = MessageStream(stream, f"controller {host}:{port}", bounds)
        salt = self.config.salt
        sigs = [self.signatures[r] for r in self.config.ranks] if self.config.kind is ChannelKind.CONTROL else []
        hello = Hello(self.config.host_name, self.config.ranks, sigs)
        magic = self.config.kind.magic.to_bytes(4, "little")
        await upstream.send_chunks([magic, *encode_mux_record(MuxKind.CONTROL, encode_control_msg(hello), salt).chunks])
        with trio.fail_after(bounds.handshake):
            header = await upstream.receive_mux_header(SMALL_MESSAGE)
            if header is None:
                raise HandshakeError(f"relay {self.config.host_name}: controller {host}:{port} closed before HelloAck")
            kind, payload = await upstream.receive_mux_payload(header, ReceiveBuffer(), salt)
        reply = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
        if not isinstance(reply, HelloAck):
            raise HandshakeError(f"relay {self.config.host_name}: expected HelloAck from controller, got {kind.name} {reply}")
        log.info("relay %s: joined controller %s:%d with ranks %s", self.config.host_name, host, port, list(self.config.ranks))
        return upstream

    def _log_summary(self) -> None:
        s = self.handle.stats
        folding = f" fold-ratio={s.fold_ratio:.2f}x" if self.config.kind is ChannelKind.DATA else ""
        log.info(
            "relay %s %s summary: ranks=%d rounds=%d local=%.2fMB uplink=%.2fMB%s",
            self.config.host_name, self.config.kind.value, len(self.config.ranks), s.rounds,
            s.bytes_local / 1e6, s.bytes_up / 1e6, folding,
        )


__all__ = ["RelayHandle", "open_relay"]
