"""docs/wire.md, "Validation order, and the errors you see" and the join section's
"flodl's bytes" promise, checked against real components speaking raw bytes."""

from __future__ import annotations

import struct
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.controller import open_controller
from flodl_trio.errors import FramingError
from flodl_trio.relay import ChannelKind, open_relay
from flodl_trio.testing import hold_open, open_local_cluster
from flodl_trio.transport.local_leg import NO_UNIX_ENV, UNIX_DIR_ENV
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire import DTYPE_F32
from flodl_trio.wire.round_frame import RoundFrame, TensorPayload, decode_round_frame, encode_round_frame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"wire-audit-order")
OTHER = SessionSalt(b"another-run-salt")


def local_handshake(rank: int, world: int, salt: SessionSalt) -> bytes:
    body = struct.pack("<IIII", 0xF10D17C0, 3, rank, world)
    return body + salt.mac8(body)


async def closed_unanswered(stream: trio.abc.Stream) -> bool:
    """True when the peer closes having sent nothing."""
    return await stream.receive_some(64) == b""


def test_a_round_frame_that_does_not_fill_its_prefix_is_a_framing_error_before_its_mac():
    frame = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (4,), np.ones(4, "<f4"))]), OTHER)
    with pytest.raises(FramingError, match="fewer than its length prefix declared"):
        decode_round_frame(bytearray(frame + b"\0"), SALT, source="rank 1")


async def test_the_local_leg_handshake_checks_the_mac_before_the_rank(tmp_path: Path, monkeypatch):
    """A handshake of another salt naming a rank of another host, or a rank already
    connected, is refused for its MAC: a peer without the salt learns nothing of the
    host's ranks. With the salt, the rank checks follow (as on TCP)."""
    monkeypatch.setenv(UNIX_DIR_ENV, str(tmp_path / "legs"))
    monkeypatch.delenv(NO_UNIX_ENV, raising=False)
    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=SALT,
                                  bounds=NetBounds(handshake=5.0)) as cluster:
        relay = cluster.relays[0]
        assert relay.unix_path is not None
        async with connect_reduce_client(cluster.relay_address(0), 0, 4, SALT) as honest:
            assert honest.local_leg
            for hello, named in [(local_handshake(2, 4, OTHER), "local-leg handshake of rank 2: MAC mismatch"),
                                 (local_handshake(0, 4, OTHER), "local-leg handshake of rank 0: MAC mismatch"),
                                 (local_handshake(2, 4, SALT), "not in host host0's rank set"),
                                 (local_handshake(0, 4, SALT), "duplicate rank 0")]:
                stream = await trio.open_unix_socket(str(relay.unix_path))
                async with stream:
                    await stream.send_all(hello)
                    assert await closed_unanswered(stream)
                assert named in relay.rejections[-1], relay.rejections[-1]


async def _pipe(source: trio.abc.Stream, sink: trio.abc.Stream, seen: bytearray) -> None:
    try:
        while chunk := await source.receive_some(65536):
            seen += chunk
            await sink.send_all(chunk)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await sink.aclose()


def control_variants(data: bytes) -> list[int]:
    """The RelayControlMsg variant of every Control record in a relay's upstream bytes."""
    variants, pos = [], 4  # past the channel magic
    while pos + 25 <= len(data):
        kind, length = data[pos + 8], int.from_bytes(data[pos + 13:pos + 17], "little")
        if kind == 2:
            variants.append(data[pos + 25])  # every variant here is below 251: one byte
        pos += 25 + length
    return variants


@pytest.mark.parametrize("joins", [False, True], ids=["no-join", "join-on-a-fresh-cluster"])
async def test_only_ranks_that_call_join_say_finished_on_a_clean_exit(joins):
    """Without join() a clean exit is flodl's RankExit (2); a rank that called join() on a
    fresh cluster (nobody comes back) leaves with the 0 length, reported as RankFinished (201)."""
    upstream: list[bytearray] = []  # what each connection the relay opened carried up
    async with open_controller("127.0.0.1", 0, world_size=2, salt=SALT, lanes=1) as ctl, \
            trio.open_nursery() as nursery:
        async def proxy(stream: trio.SocketStream) -> None:
            to_controller = await trio.open_tcp_stream("127.0.0.1", ctl.port)
            upstream.append(bytearray())
            async with trio.open_nursery() as pipes:
                pipes.start_soon(_pipe, stream, to_controller, upstream[-1])
                pipes.start_soon(_pipe, to_controller, stream, bytearray())

        listeners = await nursery.start(partial(trio.serve_tcp, proxy, 0, host="127.0.0.1"))
        relay = await nursery.start(hold_open, open_relay(
            ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", listeners[0].socket.getsockname()[1]),
            host_name="h0", ranks=[0, 1], world_size=2, salt=SALT, local_leg=False, lanes=1,
        ))

        async def rank(r: int) -> None:
            params = [torch.zeros(4)]
            async with connect_reduce_client(("127.0.0.1", relay.port), r, 2, SALT, local_leg=False) as client:
                if joins:
                    assert await client.join(params) == 0
                await average_window(client, params, [], 1, rank=r, world_size=2, in_place=True)

        async with trio.open_nursery() as ranks:
            ranks.start_soon(rank, 0)
            ranks.start_soon(rank, 1)
        await ctl.wait_finished()
        nursery.cancel_scope.cancel()
    data_channel = [bytes(seen) for seen in upstream if seen[:4] == (0xF10D17E1).to_bytes(4, "little")]
    assert len(data_channel) == 1
    assert control_variants(data_channel[0]) == ([0, 201, 201] if joins else [0, 2, 2])
    # join() on a fresh cluster: one state exchange per rank, each on a connection of its own
    assert sum(seen[:4] == (0xF10D17E8).to_bytes(4, "little") for seen in upstream) == (2 if joins else 0)
