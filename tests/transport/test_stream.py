"""MessageStream on real loopback sockets: what the kernel-level tuning must never break."""

from __future__ import annotations

import socket

import pytest
import trio

from flodl_trio.transport.stream import RECEIVE_LOW_WATER, MessageStream

BIG = 4 * RECEIVE_LOW_WATER  # read with SO_RCVLOWAT raised for most of it


async def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        client = await trio.open_tcp_stream("127.0.0.1", port)
    await listener.aclose()
    return client, accepted[0]


@pytest.mark.trio
async def test_a_small_message_after_a_large_one_that_landed_in_one_read_is_not_held_back():
    """A large message whose tail arrives in one read used to leave SO_RCVLOWAT at
    RECEIVE_LOW_WATER: the kernel then held a small next message (a 72-byte
    Control HostFrame, say) until that many bytes were waiting - forever."""
    sender, receiver = await socket_pair()
    receiver.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * BIG)
    conn = MessageStream(receiver, "test peer")
    with trio.fail_after(10):
        await sender.send_all(bytes(BIG))
        await trio.sleep(0.2)  # all of it waits in the kernel: the read takes it at once
        await conn.receive_into(memoryview(bytearray(BIG)), "the large message")

    async def send_small_later() -> None:
        await trio.sleep(0.1)  # the reader is waiting on the kernel by then
        await sender.send_all(b"12345678")

    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_small_later)
            view = memoryview(bytearray(8))
            assert await conn.receive_first(view, "the next message's header")  # how every record starts
            assert bytes(view) == b"12345678"
    await sender.aclose()
    await receiver.aclose()
