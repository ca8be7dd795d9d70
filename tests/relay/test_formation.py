"""The control relay's formation: it waits until each of its host's ranks has
connected (or been declared dead). Nobody reads a connection that waits there,
so a rank that crashes meanwhile and is restarted must not be refused as a
duplicate of its own dead connection: its restart would fail, and the formation
would wait on a connection that is gone (a chaos run hung on this)."""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import connect_reduce_client
from flodl_trio.testing import open_local_cluster
from flodl_trio.testing.matrix.hostile import receive_exactly
from flodl_trio.wire.handshake import CONTROL_ACK_LEN, decode_control_ack, encode_control_handshake
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"formation-salt!!")
SIG = bytes(32)


async def control_handshake(address: tuple[str, int], rank: int) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(encode_control_handshake(rank, 2, SIG, SALT))
    decode_control_ack(await receive_exactly(stream, CONTROL_ACK_LEN), SALT)
    return stream


@pytest.mark.trio
async def test_a_rank_restarted_before_the_control_channel_formed_takes_its_dead_connections_place():
    with trio.fail_after(20):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, control=True) as cluster:
            address = cluster.control_address(0)
            first = await control_handshake(address, 0)  # rank 0 is here; the host waits for rank 1
            await first.aclose()  # rank 0 crashes while its connection waits
            second = await control_handshake(address, 0)  # restarted: accepted, not a duplicate
            assert not any("duplicate rank 0" in r for r in cluster.control_relays[0].rejections)
            other = await control_handshake(address, 1)  # the host is complete: the channel forms
            relay = cluster.control_relays[0]
            while relay.stats.live_ranks != 2:  # both live connections joined the formed channel
                await trio.sleep(0.02)
            await second.aclose()
            await other.aclose()


@pytest.mark.trio
async def test_a_second_control_handshake_for_a_rank_in_a_formed_channel_is_still_a_duplicate():
    with trio.fail_after(20):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, control=True) as cluster:
            address = cluster.control_address(0)
            zero, one = await control_handshake(address, 0), await control_handshake(address, 1)
            relay = cluster.control_relays[0]
            while relay.stats.live_ranks != 2:
                await trio.sleep(0.02)
            stream = await trio.open_tcp_stream(*address)
            await stream.send_all(encode_control_handshake(0, 2, SIG, SALT))
            assert await stream.receive_some(CONTROL_ACK_LEN) == b""  # refused: closed, no ack
            assert any("duplicate rank 0: already joined" in r for r in relay.rejections)
            for s in (stream, zero, one):
                await s.aclose()


@pytest.mark.trio
async def test_ranks_that_never_open_a_control_connection_let_the_control_channel_close_once_they_left():
    """Ranks that use only the data channel: once each has left it, the control channel
    has nobody to wait for and closes (a relay daemon with both channels then exits,
    instead of waiting in formation forever)."""
    with trio.fail_after(20):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, control=True) as cluster:
            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    await client.all_reduce_tensors([torch.ones(3)])

            async with trio.open_nursery() as nursery:
                for rank in range(2):
                    nursery.start_soon(rank_main, rank)
            await cluster.control_relays[0].wait_finished()
            assert cluster.control_relays[0].stats.live_ranks == 0


@pytest.mark.trio
async def test_a_control_channel_forms_with_the_ranks_present_once_the_others_left_the_data_channel():
    """Rank 0 opens a control connection, rank 1 only a data one and leaves: the control
    channel forms with rank 0 rather than waiting for rank 1."""
    with trio.fail_after(20):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, control=True) as cluster:
            zero = await control_handshake(cluster.control_address(0), 0)
            async with connect_reduce_client(cluster.relay_address(1), 1, 2, SALT):
                pass  # rank 1 connects to the data channel and leaves
            relay = cluster.control_relays[0]
            while relay.stats.live_ranks != 1:  # formed, carrying rank 0
                await trio.sleep(0.02)
            await zero.aclose()
            await relay.wait_finished()
