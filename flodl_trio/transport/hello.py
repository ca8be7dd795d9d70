"""The first record of a relay's connection to a controller or a shard: its Hello."""

from __future__ import annotations

import trio

from ..errors import HandshakeError
from ..wire.mux import Hello, MuxKind, decode_control_msg
from ..wire.salt import SessionSalt
from .buffers import SMALL_MESSAGE, ReceiveBuffer
from .settings import NetBounds
from .stream import MessageStream


async def receive_hello(conn: MessageStream, salt: SessionSalt, bounds: NetBounds) -> Hello:
    """The first record of a relay connection, which must be a MAC-valid Control(Hello)."""
    with trio.fail_after(bounds.handshake):
        header = await conn.receive_mux_header(SMALL_MESSAGE)
        if header is None:
            raise HandshakeError("closed before sending Hello")
        kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
    hello = decode_control_msg(payload) if kind is MuxKind.CONTROL else None
    if not isinstance(hello, Hello):
        raise HandshakeError(f"first record must be Control(Hello), got {kind.name} {hello or ''}")
    return hello


def check_ranks_listed(hello: Hello) -> None:
    """A relay's Hello names its ranks: at least one, sorted and unique (a controller and
    a shard both key the relay by its lowest rank)."""
    if not hello.ranks:
        raise HandshakeError(f"Hello from host {hello.host!r} announces no ranks")
    if list(hello.ranks) != sorted(set(hello.ranks)):
        raise HandshakeError(f"Hello from host {hello.host!r}: ranks {list(hello.ranks)} are not sorted and unique")


__all__ = ["check_ranks_listed", "receive_hello"]
