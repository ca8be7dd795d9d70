import numpy as np
import trio

from flodl_trio import (
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    TensorPayload,
    connect_reduce_client,
)
from flodl_trio.testing import open_local_cluster


async def test_two_ranks_one_host_average(salt):
    results = {}
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        async def rank(r, values):
            async with connect_reduce_client(cluster.relay_address(r), r, 2, salt) as c:
                frame = RoundFrame([TensorPayload(DTYPE_F32, (3,), np.array(values, "<f4"))], RoundKind.MODEL, 1.0)
                results[r] = await c.all_reduce(frame)

        async with trio.open_nursery() as n:
            n.start_soon(rank, 0, [2, 4, 6])
            n.start_soon(rank, 1, [4, 8, 12])
        await cluster.controller.wait_finished()
    for r in (0, 1):
        assert np.frombuffer(results[r].tensors[0].data, "<f4").tolist() == [3, 6, 9]
