"""The relay's memory budget: a second model-sized receive buffer only where it fits."""

from __future__ import annotations

import logging

import pytest
import torch
import trio

from flodl_trio import connect_reduce_client
from flodl_trio.controller import open_controller
from flodl_trio.daemon.relay import build_parser, settings_from_args
from flodl_trio.relay import open_relay
from flodl_trio.relay.config import DEFAULT_BUDGET_HEADROOM, ChannelKind, RelayConfig

NUMEL = 256 << 10  # 1 MiB of f32: large enough for the pool, small enough for any budget


async def run_rounds(relay: tuple[str, int], salt, world: int, rounds: int) -> dict[int, list[float]]:
    got: dict[int, list[float]] = {r: [] for r in range(world)}

    async def rank_main(rank: int) -> None:
        async with connect_reduce_client(relay, rank, world, salt) as client:
            for k in range(rounds):
                consensus = await client.all_reduce_tensors([torch.full((NUMEL,), float(rank + k))])
                got[rank].append(float(consensus[0][0]))
                assert torch.equal(consensus[0], torch.full((NUMEL,), consensus[0][0].item()))

    async with trio.open_nursery() as nursery:
        for rank in range(world):
            nursery.start_soon(rank_main, rank)
    return got


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize(("budget", "buffers"), [(None, 2), (1 << 20, 1)], ids=["default-budget", "tight-budget"])
async def test_the_second_receive_buffer_is_lent_only_within_the_budget(salt, caplog, budget, buffers, lanes):
    """A 1 MiB model fits twice in the default budget (2 x model + 150 MiB: two
    buffers, the f32 fold and the relay's 48 MiB baseline); with a 1 MiB budget the
    relay keeps one buffer, says so, and every round is still exact. With lanes the
    consensus is joined in a pool buffer: with one, the ranks' next frames wait for
    it to have gone out."""
    caplog.set_level(logging.INFO, logger="flodl_trio.relay")
    async with open_controller("127.0.0.1", 0, world_size=3, salt=salt, lanes=lanes) as controller:
        async with open_relay(
            ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", controller.port), host_name="h0",
            ranks=[0, 1, 2], world_size=3, salt=salt, memory_budget=budget, lanes=lanes,
        ) as relay:
            got = await run_rounds(("127.0.0.1", relay.port), salt, 3, 4)
            assert relay.stats.receive_buffers == buffers
    assert all(got[r] == [1.0 + k for k in range(4)] for r in got)  # mean of rank + k over ranks 0..2
    refused = [r.getMessage() for r in caplog.records if "over its memory budget" in r.getMessage()]
    assert len(refused) == (1 if buffers == 1 else 0)
    if refused:
        assert "a second, 1 MiB each, and the 1 MiB f32 fold" in refused[0] and "budget of 1 MiB" in refused[0]


def test_default_budget_is_two_models_and_headroom(salt):
    config = RelayConfig(ChannelKind.DATA, ("h", 1), "h", (0,), 1, salt)
    assert config.memory_budget_for(512 << 20) == 1024 * (1 << 20) + DEFAULT_BUDGET_HEADROOM
    assert RelayConfig(ChannelKind.DATA, ("h", 1), "h", (0,), 1, salt, memory_budget=7).memory_budget_for(1 << 30) == 7


def test_memory_budget_flag(monkeypatch):
    monkeypatch.setenv("FLODL_SALT_HEX", "42" * 16)
    base = ["--controller", "127.0.0.1:29500", "--ranks", "0,1", "--world-size", "2"]
    assert settings_from_args(build_parser().parse_args(base)).memory_budget is None
    assert settings_from_args(build_parser().parse_args([*base, "--memory-budget", "1174"])).memory_budget == 1174 << 20
    monkeypatch.setenv("FLODL_RELAY_MEMORY_BUDGET", "300")
    assert settings_from_args(build_parser().parse_args(base)).memory_budget == 300 << 20
