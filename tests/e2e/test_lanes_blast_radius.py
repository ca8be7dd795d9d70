"""Reducing in lanes, a relay whose frame cannot be folded costs only itself.

Each lane of a round is its own fold at the controller, and each relay takes a
round's consensus lanes in order. A relay found wrong by its lane 0 - another
schema than the cluster's completed rounds had, from a rank holding the salt - is
dropped; its later lanes must not have been added to its neighbours' sums, and the
death must not let a later lane's round finish before lane 0's (the relays would
then get lane 1 where lane 0 is due and stop: every rank of the cluster lost).
"""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import FlodlError, connect_reduce_client
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"lanes-blast-salt")
NUMEL = 64


@pytest.mark.parametrize("attempt", range(4))  # (which lane 0 comes first varies from run to run)
async def test_a_relay_whose_lane_0_has_another_schema_costs_only_itself(attempt):
    """Three single-rank hosts in 4 lanes; after a good round, rank 2 sends a tensor of
    another shape (its lanes 1.. fit the others' pieces). Ranks 0 and 1 get that round
    and the next as the mean of their own values, exactly; rank 2 alone is lost."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    failed: dict[int, str] = {}
    with trio.fail_after(30):
        async with open_local_cluster(world_size=3, hosts=[[0], [1], [2]], salt=SALT, lanes=4,
                                      lane_min_bytes=0) as cluster:
            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, SALT) as client:
                    try:
                        await client.all_reduce_tensors([torch.ones(NUMEL)])
                        for round_ in range(2):
                            if rank == 2:
                                tensor = torch.full((NUMEL + 1,), 100.0)
                            else:
                                tensor = torch.arange(NUMEL, dtype=torch.float32) + 10 * rank + round_
                            got[rank, round_] = (await client.all_reduce_tensors([tensor]))[0]
                    except FlodlError as exc:
                        failed[rank] = type(exc).__name__

            async with trio.open_nursery() as nursery:
                for rank in range(3):
                    nursery.start_soon(rank_main, rank)
            assert cluster.controller.stats.relays_dropped == 1
    assert list(failed) == [2], failed
    for round_ in range(2):
        mean = torch.arange(NUMEL, dtype=torch.float32) + 5 + round_  # ranks 0 and 1, equal weights
        for rank in (0, 1):
            assert torch.equal(got[rank, round_], mean), (rank, round_)


async def test_the_lanes_of_a_relay_whose_lane_0_came_first_and_proved_wrong_are_not_in_the_sums():
    """Rank 2's frame of another shape goes up first (the others send once its relay has
    taken it in), so its lane 0 is, as a rule, folded before anyone's and only the
    honest lane 0s prove it wrong. Its lanes 1.. wait for that lane 0 (their schema is
    one no completed round had), so none of its values reach ranks 0 and 1 (whichever
    lane 0 came first)."""
    got: dict[int, torch.Tensor] = {}
    with trio.fail_after(30):
        async with open_local_cluster(world_size=3, hosts=[[0], [1], [2]], salt=SALT, lanes=4,
                                      lane_min_bytes=0) as cluster:
            shipped = trio.Event()

            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, SALT) as client:
                    await client.all_reduce_tensors([torch.ones(NUMEL)])
                    if rank == 2:
                        with pytest.raises(FlodlError):
                            await client.all_reduce_tensors([torch.full((NUMEL + 1,), 100.0)])
                        return
                    await shipped.wait()
                    got[rank] = (await client.all_reduce_tensors([torch.full((NUMEL,), float(rank))]))[0]

            async def watch_host_2() -> None:
                while cluster.relays[2].stats.bytes_local < 2 * NUMEL * 4 + 4:  # its second frame is in
                    await trio.sleep(0.01)
                await trio.sleep(0.05)  # (only how often rank 2 comes first hangs on this: not the outcome)
                shipped.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_host_2)
                for rank in range(3):
                    nursery.start_soon(rank_main, rank)
    for rank in (0, 1):
        assert torch.equal(got[rank], torch.full((NUMEL,), 0.5)), got[rank]
