"""Prometheus exporters: the values they serve follow the daemons' counters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from flodl_trio import ChannelKind, connect_reduce_client
from flodl_trio.client import ReduceClient
from flodl_trio.daemon.metrics import serve_controller_metrics, serve_relay_metrics
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport import MessageStream
from flodl_trio.wire import (
    RoundFrame,
    TensorPayload,
    encode_data_handshake,
    encode_round_frame,
)
from flodl_trio.wire.salt import SessionSalt


async def scrape(port: int) -> dict[str, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    values = {}
    for line in data.decode().split("\r\n\r\n", 1)[1].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def test_metrics_track_rounds_bytes_deaths_and_mac_failures(salt):
    async with open_local_cluster(world_size=3, hosts=[[0, 1, 2]], salt=salt) as cluster:
        relay = cluster.relays[0]
        with serve_controller_metrics(("127.0.0.1", 0), cluster.controller) as ctl_port, \
                serve_relay_metrics(("127.0.0.1", 0), {ChannelKind.DATA: relay}) as relay_port:
            # rank 2 sends a frame signed with the wrong salt: dropped, counted
            bad = MessageStream(await trio.open_tcp_stream(*cluster.relay_address(2)))
            await bad.send_chunks([encode_data_handshake(2, 3)])
            await bad.receive_exactly(8, "ack")

            async def rank_main(r: int) -> None:
                async with connect_reduce_client(cluster.relay_address(r), r, 3, salt) as client:
                    for _ in range(3):
                        await client.all_reduce_tensors([torch.ones(256)])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(rank_main, 0)
                nursery.start_soon(rank_main, 1)
                await trio.sleep(0.1)
                body = encode_round_frame(RoundFrame([TensorPayload(0, (256,), np.ones(256, "<f4"))]), SessionSalt(b"\x01" * 16))
                await bad.send_len_framed([body], len(body))
            ctl = await scrape(ctl_port)
            rel = await scrape(relay_port)
    assert ctl["flodl_controller_rounds_total"] == 3
    assert ctl["flodl_controller_round_seconds_count"] == 3
    assert ctl["flodl_controller_dead_ranks"] >= 1  # rank 2, dropped
    assert ctl["flodl_controller_bytes_total{direction=\"in\"}"] > 3 * 1024
    key = '{channel="data",host="host0"}'
    assert rel[f"flodl_relay_rounds_total{key}"] == 3
    assert rel[f"flodl_relay_mac_failures_total{key}"] == 1
    assert 1.9 <= rel[f"flodl_relay_fold_ratio{key}"] <= 2.1  # two live ranks folded into one uplink


async def test_metrics_count_the_streaming_paths(salt):
    """Large rounds over two hosts: every consensus reaches host 0's ranks by
    cut-through, and the finishing-ahead and memory-reuse counters served are the
    daemons' own."""
    async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt) as cluster:
        relay = cluster.relays[0]
        with serve_controller_metrics(("127.0.0.1", 0), cluster.controller) as ctl_port, \
                serve_relay_metrics(("127.0.0.1", 0), {ChannelKind.DATA: relay}) as relay_port:

            async def rank_main(r: int, client: ReduceClient) -> None:
                for _ in range(3):
                    await client.all_reduce_tensors([torch.full((100_000,), float(r))])

            await cluster.run_ranks(rank_main)
            ctl = await scrape(ctl_port)
            rel = await scrape(relay_port)
    key = '{channel="data",host="host0"}'
    assert rel[f"flodl_relay_broadcasts_streamed_total{key}"] == 3
    assert rel[f"flodl_relay_rounds_finished_ahead_total{key}"] == relay.stats.rounds_finished_ahead
    assert ctl["flodl_controller_rounds_finished_ahead_total"] == cluster.controller.stats.rounds_finished_ahead
    # Rounds after the first fold into the memory of an earlier one.
    assert rel[f"flodl_relay_fold_images_reused_total{key}"] == relay.stats.fold_images_reused >= 1
    assert ctl["flodl_controller_fold_images_reused_total"] == cluster.controller.stats.fold_images_reused >= 1
    # Both of host 0's ranks came over the local leg; a 400 kB model fits two receive buffers.
    assert rel[f"flodl_relay_local_connections_total{key}"] == 2
    assert rel[f"flodl_relay_receive_buffers{key}"] == 2


async def test_metrics_count_rejoins_refusals_and_states_served(salt):
    """A rank comes back once (let in: a rejoin and a state served) and a live rank
    asks for its state (refused)."""
    from flodl_trio import JoinRefused, average_window

    async with open_local_cluster(world_size=3, hosts=[[0, 1, 2]], salt=salt, rejoin_timeout=60) as cluster:
        with serve_controller_metrics(("127.0.0.1", 0), cluster.controller) as ctl_port:
            done = trio.Event()

            async def survivor(r: int) -> None:
                params = [torch.zeros(8)]
                async with connect_reduce_client(cluster.relay_address(r), r, 3, salt) as client:
                    await client.join(params)
                    for window in range(8):
                        await trio.sleep(0.02)
                        await average_window(client, params, [], 1, rank=r, world_size=3, in_place=True)
                        if r == 0 and window == 2:
                            with pytest.raises(JoinRefused):
                                await client.fetch_state()  # rank 0 is live
                done.set()

            async def returns() -> None:
                params = [torch.zeros(8)]
                async with connect_reduce_client(cluster.relay_address(2), 2, 3, salt) as client:
                    await client.join(params)
                    await average_window(client, params, [], 1, rank=2, world_size=3, in_place=True)
                    await client.aclose()  # a crash
                async with connect_reduce_client(cluster.relay_address(2), 2, 3, salt) as client:
                    start = await client.join(params)
                    for _ in range(start, 8):
                        await average_window(client, params, [], 1, rank=2, world_size=3, in_place=True)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor, 0)
                nursery.start_soon(survivor, 1)
                nursery.start_soon(returns)
            ctl = await scrape(ctl_port)
    assert ctl["flodl_controller_rejoins_total"] == 1
    assert ctl["flodl_controller_states_served_total"] == 1
    assert ctl["flodl_controller_rejoins_refused_total"] == 1
