"""A model whose schema changes between windows: the outer optimizer's check refuses the
params consensus, that error stops the controller, and ``wait_finished()`` (and the
controller's block) raises it as a ``SchemaError`` - without lanes, in lanes, and with
the shards stepping the lanes (docs/outer-and-checkpoints.md, "Guards")."""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import (
    ChannelKind,
    DiLoCoNesterov,
    SchemaError,
    average_window,
    connect_reduce_client,
    open_controller,
    open_relay,
)
from flodl_trio.errors import FlodlError
from flodl_trio.testing import hold_open, open_local_cluster

WORLD = 2
MESSAGE = r"tensor 1 has shape \[6\] this window, the outer state holds shape \[5\]"


async def _changing_model(address: tuple[str, int], rank: int, world: int, salt, width: int = 10) -> None:
    """Windows 0 and 1 with tensor 1 of 5 elements, window 2 with 6 (the rank's own
    failure, once the controller stops, is not what the test is about)."""
    try:
        async with connect_reduce_client(address, rank, world, salt) as client:
            for window in range(3):
                params = [torch.ones(width) * rank, torch.ones(5 if window < 2 else 6)]
                await average_window(client, params, [], 1, rank=rank, world_size=world)
    except FlodlError:
        pass


@pytest.mark.parametrize("lanes", [None, 1, 4], ids=["default-lanes", "whole-frames", "4-lanes"])
async def test_a_schema_change_stops_the_controller_and_wait_finished_raises_a_schema_error(salt, lanes):
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            with pytest.raises(SchemaError, match=MESSAGE) as raised:
                async with open_controller("127.0.0.1", 0, world_size=WORLD, salt=salt,
                                           outer_optimizer=DiLoCoNesterov(), lanes=lanes, lane_min_bytes=0) as handle:
                    relay = await nursery.start(hold_open, open_relay(
                        ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", handle.port), host_name="h",
                        ranks=[0, 1], world_size=WORLD, salt=salt))
                    async with trio.open_nursery() as ranks:
                        for rank in range(WORLD):
                            ranks.start_soon(_changing_model, ("127.0.0.1", relay.port), rank, WORLD, salt)
                    await handle.wait_finished()
            assert "the outer optimizer refused" in str(raised.value)
            assert isinstance(raised.value.__cause__, SchemaError)  # the optimizer's own
            nursery.cancel_scope.cancel()


async def test_with_shards_the_controller_checks_the_schema_before_they_step(salt):
    world = 4
    with trio.fail_after(30), pytest.raises(SchemaError, match=MESSAGE):
        async with open_local_cluster(world_size=world, hosts=[[0, 1], [2], [3]], salt=salt, shards=3,
                                      lane_min_bytes=0, outer_optimizer=DiLoCoNesterov()) as cluster:
            async with trio.open_nursery() as ranks:
                for rank in range(world):
                    ranks.start_soon(_changing_model, cluster.relay_address(rank), rank, world, cluster.salt, 1000)
            await cluster.controller.wait_finished()
