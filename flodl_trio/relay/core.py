"""The per-host relay: K local ranks in, one upstream connection out, per channel.

Task structure of one data channel (all in one nursery)::

    rank socket r0 --> rank_reader(r0) --\\
    rank socket r1 --> rank_reader(r1) ---+--[outbound channel]--> outbound_writer --> controller
    rank socket rk --> rank_reader(rk) --/                          (sole upstream writer)

    controller --> upstream_reader --> fan-out to every rank socket (sole rank-socket writer)

Rank readers verify each frame's MAC and fold it straight into one f32
accumulator (the fold never divides). The deposit, exit or controller-declared
death that completes the round ships one HostFrame. A host with a single rank
forwards that rank's frame byte for byte. Shutdown - upstream EOF, a fatal
error, or the last local rank leaving - cancels the nursery; writes in flight
are shielded so no frame is left half-written.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from ..errors import (
    ConfigError,
    HandshakeError,
    ProtocolError,
)
from ..settings import handshake_timeout
from ..transport.buffers import SMALL_MESSAGE, ReceiveBuffer
from ..transport.connect import connect_with_retry, peer_host, tune_socket
from ..transport.stream import MessageStream
from ..transport.tasks import service_nursery
from ..wire.constants import (
    DEFAULT_FRAME_CEILING,
)
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

log = logging.getLogger("flodl_trio.relay")

from .channels import ControlChannel, DataChannel
from .config import ChannelKind, RelayConfig, RelayStats


class RelayHandle:
    """A running relay: its bound port, counters, and how it ended."""

    def __init__(self, config: RelayConfig, port: int) -> None:
        self.config = config
        self.port = port
        self.stats = RelayStats()
        self.rejections: list[str] = []
        self._finished = trio.Event()
        self._error: BaseException | None = None
        self._error_seen = False

    @property
    def host_name(self) -> str:
        return self.config.host_name

    async def wait_finished(self) -> None:
        """Wait until the relay ends on its own (last rank gone, controller closed);
        raise the error that stopped it, if one did."""
        await self._finished.wait()
        if self._error is not None:
            self._error_seen = True
            raise self._error


def validate_config(config: RelayConfig) -> None:
    if config.world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {config.world_size}")
    if not config.ranks:
        raise ConfigError(f"relay {config.host_name}: the host's rank set is empty")
    if len(set(config.ranks)) != len(config.ranks):
        raise ConfigError(f"relay {config.host_name}: duplicate ranks in {list(config.ranks)}")
    outside = [r for r in config.ranks if not 0 <= r < config.world_size]
    if outside:
        raise ConfigError(f"relay {config.host_name}: ranks {outside} are outside world_size {config.world_size}")


@asynccontextmanager
async def open_relay(
    kind: ChannelKind,
    *,
    listen: tuple[str, int],
    upstream: tuple[str, int],
    host_name: str,
    ranks: Sequence[int],
    world_size: int,
    salt: SessionSalt | bytes,
    ceiling: int = DEFAULT_FRAME_CEILING,
    connect_attempts: int = 60,
    connect_interval: float | None = None,
) -> AsyncIterator[RelayHandle]:
    """Run a relay channel for one host while the block runs.

    ``handle.port`` is bound on entry (port 0 picks a free one). Leaving the
    block shuts the relay down; an error it hit that nobody awaited through
    ``wait_finished()`` is raised on exit.
    """
    config = RelayConfig(
        kind, listen, upstream, host_name, tuple(sorted(ranks)), world_size, SessionSalt.coerce(salt),
        ceiling, connect_attempts, connect_interval,
    )
    validate_config(config)
    async with service_nursery() as nursery:
        handle: RelayHandle = await nursery.start(_serve_relay, config)
        yield handle
    if handle._error is not None and not handle._error_seen:
        raise handle._error


async def _serve_relay(config: RelayConfig, *, task_status: trio.TaskStatus[RelayHandle]) -> None:
    listeners = await trio.open_tcp_listeners(config.listen[1], host=config.listen[0])
    handle = RelayHandle(config, listeners[0].socket.getsockname()[1])
    task_status.started(handle)
    relay = _Relay(config, handle, listeners)
    try:
        await relay.run()
    except Exception as exc:
        handle._error = exc
        log.error("relay %s: %s", config.host_name, exc)
    finally:
        for listener in listeners:
            await listener.aclose()
        relay.log_summary()
        handle._finished.set()


class _Relay:
    """Formation (accept the host's ranks, dial the controller) then the channel."""

    def __init__(self, config: RelayConfig, handle: RelayHandle, listeners: list[trio.SocketListener]) -> None:
        self.config = config
        self.handle = handle
        self.listeners = listeners
        self.joined: dict[int, MessageStream] = {}
        self.signatures: dict[int, bytes] = {}
        self.all_joined = trio.Event()

    async def run(self) -> None:
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            for listener in self.listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            try:
                await self.all_joined.wait()
                upstream = await self._dial_controller()
                channel_type = DataChannel if self.config.kind is ChannelKind.DATA else ControlChannel
                await channel_type(self.config, self.joined, upstream, self.handle.stats).run()
            except Exception as exc:  # raised below, outside the nursery, unwrapped
                error = exc
            finally:
                nursery.cancel_scope.cancel()
                await self._close_all()
        if error is not None:
            raise error

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                log.warning("relay %s: accept failed: %s", self.config.host_name, exc)
                await trio.sleep(0.1)
                continue
            tune_socket(stream)
            nursery.start_soon(self._admit, stream)

    async def _admit(self, stream: trio.SocketStream) -> None:
        """Terminate one rank's handshake, refusing (and logging) anything wrong."""
        conn = MessageStream(stream, f"rank connection from {peer_host(stream)}")
        try:
            with trio.fail_after(handshake_timeout()):
                rank = await self._handshake(conn)
                ack = encode_data_ack() if self.config.kind is ChannelKind.DATA else encode_control_ack(self.config.salt)
                await conn.send_chunks([ack])
        except (ProtocolError, OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = "no complete handshake within the deadline" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._refuse(f"relay {self.config.host_name}: refused {conn.peer}: {reason}")
            await conn.aclose()
            return
        conn.peer = f"rank {rank}"
        self.joined[rank] = conn
        if len(self.joined) == len(self.config.ranks):
            self.all_joined.set()

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
        stream = await connect_with_retry(
            host, port, f"relay {self.config.host_name} upstream",
            attempts=self.config.connect_attempts, interval=self.config.connect_interval,
        )
        upstream = MessageStream(stream, f"controller {host}:{port}")
        salt = self.config.salt
        sigs = [self.signatures[r] for r in self.config.ranks] if self.config.kind is ChannelKind.CONTROL else []
        hello = Hello(self.config.host_name, self.config.ranks, sigs)
        magic = self.config.kind.magic.to_bytes(4, "little")
        await upstream.send_chunks([magic, *encode_mux_record(MuxKind.CONTROL, encode_control_msg(hello), salt).chunks])
        with trio.fail_after(handshake_timeout()):
            header = await upstream.receive_mux_header(SMALL_MESSAGE)
            if header is None:
                raise HandshakeError(f"relay {self.config.host_name}: controller {host}:{port} closed before HelloAck")
            kind, payload = await upstream.receive_mux_payload(header, ReceiveBuffer(), salt)
        reply = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
        if not isinstance(reply, HelloAck):
            raise HandshakeError(f"relay {self.config.host_name}: expected HelloAck from controller, got {kind.name} {reply}")
        log.info("relay %s: joined controller %s:%d with ranks %s", self.config.host_name, host, port, list(self.config.ranks))
        return upstream

    async def _close_all(self) -> None:
        for conn in self.joined.values():
            await conn.aclose()

    def log_summary(self) -> None:
        s = self.handle.stats
        log.info(
            "relay %s %s summary: ranks=%d rounds=%d local=%.2fMB uplink=%.2fMB fold-ratio=%.2fx",
            self.config.host_name, self.config.kind.value, len(self.config.ranks), s.rounds,
            s.bytes_local / 1e6, s.bytes_up / 1e6, s.fold_ratio,
        )


__all__ = ["ChannelKind", "RelayConfig", "RelayHandle", "RelayStats", "open_relay", "validate_config"]
