"""Where the controller tells each peer its shards are (``ShardSet.address_for``).

A relay on the controller's own host reaches the controller over loopback, so the shard
it serves on every address is offered at a loopback address; a peer on another host must
be told the address its own connection to the controller has (the controller's host),
not its own loopback."""

from __future__ import annotations

import trio

from flodl_trio.controller.config import ControllerConfig
from flodl_trio.controller.shards import ShardSet
from flodl_trio.controller.stats import ControllerStats
from flodl_trio.transport.connect import is_loopback
from flodl_trio.transport.settings import NetBounds
from flodl_trio.transport.stream import MessageStream
from flodl_trio.wire.salt import SessionSalt


def test_is_loopback_names_this_machines_loopback_only() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "0.0.0.0", "example.org", "fe80::1"))


async def test_a_loopback_offer_is_told_at_the_address_each_connection_has_here() -> None:
    """Shard 0 offered at 127.0.0.1 (a relay beside the controller), shard 1 at 10.1.2.3:
    a peer whose connection to the controller arrives at 127.0.0.2 is told shard 0 is at
    127.0.0.2 (where it reaches the controller's host), shard 1 where it was offered."""
    config = ControllerConfig(2, SessionSalt.coerce(b"s" * 16), 1 << 30, NetBounds(), True, 8, 0)
    shards = ShardSet([("127.0.0.1", 4100), ("10.1.2.3", 4101)], config, lambda seat: True, lambda msg: None,
                      ControllerStats(), lambda rank, why: None)
    with trio.fail_after(10):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.2")
        async with listeners[0]:
            port = listeners[0].socket.getsockname()[1]
            peer = await trio.open_tcp_stream("127.0.0.2", port)
            here = await listeners[0].accept()
            async with peer, here:
                conn = MessageStream(here, "a peer")
                assert shards.addresses_for(conn) == [("127.0.0.2", 4100), ("10.1.2.3", 4101)]
                assert shards.address_for(1, conn) == ("10.1.2.3", 4101)
