"""Zero elision through real roles: an elided tensor stands for its whole shape.

A non-root's ``broadcast_from_root`` frame is a few header bytes on the wire yet
stands for the whole model, so a relay must cut it into lanes as the controller
would; and a frame (or a lane 0's schema) that declares more than the frame
ceiling is refused at the first hop, costing its sender alone, instead of
sizing somebody's buffers by it (docs/wire.md, "Zero elision").
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, connect_reduce_client
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport.stream import MessageStream
from flodl_trio.wire import DTYPE_F32, EXTENSIONS_MARK, Hello, MuxKind, RoundFrame, TensorPayload
from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA
from flodl_trio.wire.handshake import DATA_ACK_LEN, encode_data_handshake
from flodl_trio.wire.lanes import lane_tag
from flodl_trio.wire.mux import encode_control_record, encode_mux_record
from flodl_trio.wire.round_frame import encode_round_frame

LOOP = "127.0.0.1"
HUGE = (1 << 20, 1 << 20)  # 4 TiB of f32: far over any frame ceiling


@pytest.mark.parametrize("hosts", [[[0], [1], [2]], [[0], [1, 2]]], ids=["single-rank-hosts", "mixed"])
async def test_a_broadcast_of_a_model_that_goes_in_lanes_reaches_every_rank(salt, hosts):
    """Non-roots send the model's shapes elided (a tiny frame); alone on a host, such a
    frame is still cut into lanes, as the controller counts it, so nobody is dropped."""
    numel = 1_000_000  # 4 MB: more than two lanes' worth at the default lane size
    world = sum(len(h) for h in hosts)
    got: dict[tuple[int, int], list[float]] = {}
    with trio.fail_after(60):
        async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
            done = [trio.Event() for _ in range(world)]
            checked = trio.Event()

            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                    for round_ in range(2):
                        mine = torch.full((numel,), float(round_ + 7)) if rank == 0 else torch.zeros(numel)
                        out = await client.broadcast_from_root([mine], root=0)
                        got[rank, round_] = [out[0][0].item(), out[0][-1].item()]
                    done[rank].set()
                    await checked.wait()  # (leaving is an exit: checked while every rank is still in)

            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
                for event in done:
                    await event.wait()
                assert cluster.controller.dead_ranks.snapshot() == set()  # nobody was dropped
                checked.set()
    assert got == {(rank, r): [float(r + 7)] * 2 for rank in range(world) for r in range(2)}


def _elided_huge_frame(salt) -> bytes:
    return encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, HUGE)]), salt)


async def _closed_by_peer(stream: trio.abc.Stream) -> None:
    """Read (and drop) whatever comes until the peer hangs up."""
    with trio.fail_after(10):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass


async def _honest_rounds(cluster, ranks: list[int], world: int, salt) -> dict[int, list[float]]:
    got: dict[int, list[float]] = {}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
            for round_ in range(2):
                out = await client.all_reduce_tensors([torch.full((4,), float(rank * 10 + round_))])
                got.setdefault(rank, []).append(out[0][0].item())

    async with trio.open_nursery() as nursery:
        for rank in ranks:
            nursery.start_soon(rank_main, rank)
    return got


async def test_a_ranks_elided_frame_declaring_more_than_the_ceiling_costs_only_that_rank(salt, caplog):
    caplog.set_level(logging.WARNING, logger="flodl_trio.relay")
    with trio.fail_after(30):
        async with open_local_cluster(world_size=3, hosts=[[0], [1, 2]], salt=salt) as cluster:
            attacker = MessageStream(await trio.open_tcp_stream(*cluster.relay_address(0)), "attacker")
            await attacker.send_chunks([encode_data_handshake(0, 3)])
            await attacker.receive_exactly(DATA_ACK_LEN, "the data ack")
            frame = _elided_huge_frame(salt)
            await attacker.send_len_framed([frame], len(frame))
            await _closed_by_peer(attacker.stream)
            got = await _honest_rounds(cluster, [1, 2], 3, salt)
            assert cluster.controller.dead_ranks.snapshot() == {0}
    assert got == {1: [15.0, 16.0], 2: [15.0, 16.0]}
    refused = [r.getMessage() for r in caplog.records if "rank 0 dropped" in r.getMessage()]
    assert refused and "over the frame ceiling" in refused[0] and "tensor 0" in refused[0], refused


async def _raw_relay(port: int, salt, ranks: list[int], extensions: bool) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(LOOP, port)
    hello = Hello("evil", ranks, [EXTENSIONS_MARK] if extensions else [])
    await stream.send_all(CHANNEL_MAGIC_DATA.to_bytes(4, "little") + encode_control_record(hello, salt))
    return stream


def _lane0_declaring(shape: tuple[int, ...], salt) -> bytes:
    """A lane 0 of two lanes, its pieces empty, whose schema declares one f32 tensor of ``shape``."""
    empty = np.zeros(0, "<f4")
    lane0 = RoundFrame([TensorPayload(DTYPE_F32, (0,), empty), TensorPayload(DTYPE_F32, (0, *shape), empty),
                        lane_tag(0, 2, 1)], RoundKind.MODEL, 1.0)
    return encode_round_frame(lane0, salt)


@pytest.mark.parametrize("what", ["whole-frame", "lane-0-schema"])
async def test_a_relays_frame_declaring_more_than_the_ceiling_costs_only_that_relay(salt, caplog, what):
    """A flodl relay's whole frame (cut into lanes at the controller), or a flodl_trio relay's
    lane 0 whose schema declares the huge tensor: the relay is dropped, the others reduce."""
    caplog.set_level(logging.WARNING, logger="flodl_trio.controller")
    body = _elided_huge_frame(salt) if what == "whole-frame" else _lane0_declaring(HUGE, salt)
    with trio.fail_after(30):
        async with open_local_cluster(world_size=3, hosts=[[0, 1]], salt=salt) as cluster:
            evil = await _raw_relay(cluster.controller.port, salt, [2], extensions=what != "whole-frame")
            await evil.send_all(encode_mux_record(MuxKind.HOST_FRAME, body, salt).tobytes())
            await _closed_by_peer(evil)
            got = await _honest_rounds(cluster, [0, 1], 3, salt)
            assert cluster.controller.dead_ranks.snapshot() == {2}
            assert cluster.controller.stats.relays_dropped == 1
    assert got == {0: [5.0, 6.0], 1: [5.0, 6.0]}
    dropped = [r.getMessage() for r in caplog.records if "dropped for breaking the protocol" in r.getMessage()]
    assert len(dropped) == 1 and "relay evil" in dropped[0] and "over the frame ceiling" in dropped[0], dropped
