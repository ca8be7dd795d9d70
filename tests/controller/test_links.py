"""Relay links' outboxes: a record's ``on_written`` runs only once it is fully written.

The controller reuses a consensus's memory only after every relay it went to has
been sent all of it; these tests pin down when that signal fires.
"""

from __future__ import annotations

import trio
import trio.testing

from flodl_trio.controller.links import AfterAllWrites, RelayLink
from flodl_trio.transport import MessageStream
from flodl_trio.wire import MuxKind, SessionSalt, encode_mux_record
from flodl_trio.wire.mux import Hello

SALT = SessionSalt(b"\x42" * 16)
RECORD = encode_mux_record(MuxKind.BROADCAST, bytes(range(256)) * 1024, SALT)


def lockstep_link(host: str) -> tuple[RelayLink, trio.testing.MemoryReceiveStream]:
    """A link whose writes complete only as fast as the returned peer end is read."""
    writer, reader = trio.testing.lockstep_stream_pair()
    return RelayLink.accept(Hello(host, (0,)), MessageStream(writer, host), depth=4), reader


async def read_exactly(reader, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        got += await reader.receive_some(n - len(got))
    return bytes(got)


async def no_failure(why: str) -> None:
    raise AssertionError(f"unexpected write failure: {why}")


async def test_on_written_waits_for_the_last_byte():
    link, reader = lockstep_link("h0")
    calls: list[str] = []
    link.queue(RECORD, on_written=lambda: calls.append("written"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.drain_outbox, no_failure)
        assert await read_exactly(reader, RECORD.nbytes - 1) == b"".join(bytes(c) for c in RECORD.chunks)[:-1]
        await trio.testing.wait_all_tasks_blocked()
        assert calls == []  # one byte still unsent
        await read_exactly(reader, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == ["written"]
        nursery.cancel_scope.cancel()


async def test_on_written_never_runs_for_a_failed_write():
    link, reader = lockstep_link("h0")
    calls: list[str] = []
    failures: list[str] = []

    async def failed(why: str) -> None:
        failures.append(why)

    link.queue(RECORD, on_written=lambda: calls.append("written"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.drain_outbox, failed)
        await read_exactly(reader, 1000)
        await reader.aclose()
    assert failures and calls == []


async def test_after_all_writes_waits_for_the_slowest_link():
    fast, fast_peer = lockstep_link("fast")
    slow, slow_peer = lockstep_link("slow")
    done: list[str] = []
    after = AfterAllWrites(2, lambda: done.append("both"))
    for link in (fast, slow):
        link.queue(RECORD, on_written=after.one)
    async with trio.open_nursery() as nursery:
        for link in (fast, slow):
            nursery.start_soon(link.drain_outbox, no_failure)
        await read_exactly(fast_peer, RECORD.nbytes)
        await read_exactly(slow_peer, RECORD.nbytes // 2)
        await trio.testing.wait_all_tasks_blocked()
        assert done == []  # the slow relay has half of it
        await read_exactly(slow_peer, RECORD.nbytes - RECORD.nbytes // 2)
        await trio.testing.wait_all_tasks_blocked()
        assert done == ["both"]
        nursery.cancel_scope.cancel()
