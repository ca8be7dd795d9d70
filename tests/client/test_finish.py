"""A rank that finishes says so within a bound, even to a relay that stopped reading."""

from __future__ import annotations

import logging

import trio
import trio.testing

from flodl_trio import connect_reduce_client
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire.constants import FINISHED_LENGTH
from flodl_trio.wire.handshake import DATA_HANDSHAKE_LEN, encode_data_ack

BOUNDS = NetBounds()  # the defaults: handshake 10 s, write stall 30 s


async def relay_that_acks_then_never_reads(stream: trio.abc.Stream, acked: trio.Event) -> None:
    """Takes the handshake, answers it, and from then on reads nothing."""
    got = b""
    while len(got) < DATA_HANDSHAKE_LEN:
        got += await stream.receive_some(DATA_HANDSHAKE_LEN - len(got))
    await stream.send_all(encode_data_ack())
    acked.set()
    await trio.sleep_forever()


async def test_finish_gives_up_on_a_relay_that_never_reads_after_the_handshake_bound(autojump_clock, salt, caplog):
    client_end, relay_end = trio.testing.lockstep_stream_pair()  # no buffer: a write waits for a read
    acked = trio.Event()

    async def connect(host: str, port: int) -> trio.abc.Stream:
        return client_end

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay_that_acks_then_never_reads, relay_end, acked)
        client = await connect_reduce_client(("127.0.0.1", 1), 0, 2, salt, connect=connect, bounds=BOUNDS)
        client.joined = True  # as after join(): leaving then says "finished"
        started = trio.current_time()
        with caplog.at_level(logging.WARNING, logger="flodl_trio.client"):
            await client.finish()  # neither hangs nor raises the write stall
        waited = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert acked.is_set()
    assert BOUNDS.handshake <= waited < BOUNDS.write_stall, waited
    assert any("could not say it finished within 10 s" in r.getMessage() for r in caplog.records), caplog.records


async def test_finish_is_not_cut_short_by_the_callers_cancellation(autojump_clock, salt):
    """The caller cancelling its scope does not stop the 4 bytes from going out."""
    client_end, relay_end = trio.testing.lockstep_stream_pair()
    acked = trio.Event()
    received = bytearray()

    async def relay(stream: trio.abc.Stream) -> None:
        got = b""
        while len(got) < DATA_HANDSHAKE_LEN:
            got += await stream.receive_some(DATA_HANDSHAKE_LEN - len(got))
        await stream.send_all(encode_data_ack())
        acked.set()
        await trio.sleep(1.0)  # reads only after the caller's scope was cancelled
        while chunk := await stream.receive_some(64):
            received.extend(chunk)

    async def connect(host: str, port: int) -> trio.abc.Stream:
        return client_end

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay, relay_end)
        client = await connect_reduce_client(("127.0.0.1", 1), 0, 2, salt, connect=connect, bounds=BOUNDS)
        client.joined = True
        with trio.CancelScope() as scope:
            scope.cancel()
            await client.finish()
    assert bytes(received) == FINISHED_LENGTH.to_bytes(4, "little"), received
