"""The blocking facade reads and sets the trio client's settings through (docs/api.md,
``BlockingReduceClient``): a codec set on it really codes the rounds."""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import BlockingReduceClient, ConfigError, SessionSalt
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.fragment import FragmentTag
from flodl_trio.wire.quant import DeltaCodec

SALT = SessionSalt(b"blocking-setting")
N = 1 << 16  # elements: 256 KiB of f32 per params round
WINDOWS = 3


def train(cluster, rank: int, codec: DeltaCodec | None, seen: dict) -> None:
    """One synchronous rank: set the codec (if any) before join, then a window loop."""
    params = [torch.zeros(N)]
    with BlockingReduceClient(cluster.relay_address(rank), rank, 2, SALT) as client:
        assert client.delta_codec is None and client.delta_error_feedback is True
        if codec is not None:
            client.delta_codec = codec
            client.delta_error_feedback = False
        start = client.join(params)
        trainer = client.window_trainer(params, sync_every=1, start_window=start)
        for _ in range(WINDOWS):
            with torch.no_grad():
                params[0].add_(0.125 * (rank + 1))
            trainer.step()
        trainer.finish()
        seen[rank] = {
            "codec": client.delta_codec,
            "trio codec": client._client.delta_codec,
            "feedback": client._client.delta_error_feedback,
            "catching_up": client.catching_up,
            "local_leg": client.local_leg,
            "params": params[0][:4].tolist(),
        }


async def run(codec: DeltaCodec | None) -> tuple[int, dict]:
    seen: dict = {}
    async with open_local_cluster(world_size=2, hosts=[[0], [1]], salt=SALT) as cluster:
        async with trio.open_nursery() as nursery:
            for rank in (0, 1):
                nursery.start_soon(trio.to_thread.run_sync, train, cluster, rank, codec, seen)
        return cluster.controller.stats.bytes_in, seen


async def test_a_codec_set_on_the_blocking_client_codes_its_rounds():
    plain_bytes, plain = await run(None)
    codec = DeltaCodec.parse("int8")
    coded_bytes, coded = await run(codec)
    for rank in (0, 1):
        assert coded[rank]["codec"] == coded[rank]["trio codec"] == codec
        assert coded[rank]["feedback"] is False
        assert plain[rank]["codec"] is None
        assert coded[rank]["catching_up"] == set() and isinstance(coded[rank]["local_leg"], bool)
    # Every window's mean of 0.125 and 0.25 (exact in int8 codes too: one block scale).
    assert plain[0]["params"] == plain[1]["params"] == [0.1875 * WINDOWS] * 4
    assert coded[0]["params"] == coded[1]["params"]
    assert coded[0]["params"] == pytest.approx([0.1875 * WINDOWS] * 4, abs=1e-3)
    # int8 codes are a quarter of the f32 bytes: the controller got far fewer.
    assert coded_bytes < 0.6 * plain_bytes, (coded_bytes, plain_bytes)


async def test_the_blocking_per_rank_gather_carries_a_fragment_tag():
    got: dict[int, list[float]] = {}

    def rank_thread(cluster, rank: int) -> None:
        with BlockingReduceClient(cluster.relay_address(rank), rank, 2, SALT) as client:
            got[rank] = client.all_reduce_per_rank_f64(
                [3.0 if rank == 0 else 0.0, 5.0 if rank == 1 else 0.0], fragment=FragmentTag(1, 2)
            )

    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT) as cluster:
        async with trio.open_nursery() as nursery:
            for rank in (0, 1):
                nursery.start_soon(trio.to_thread.run_sync, rank_thread, cluster, rank)
    assert got == {0: [3.0, 5.0], 1: [3.0, 5.0]}


def test_a_control_address_without_model_signature_is_a_config_error_before_any_traffic():
    with pytest.raises(ConfigError, match="model_signature"):
        BlockingReduceClient(("127.0.0.1", 1), 0, 1, SALT, control_address=("127.0.0.1", 1))
