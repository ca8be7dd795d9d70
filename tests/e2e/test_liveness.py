"""Control channel and coordinator: a frozen rank never hangs the cluster.

Process faults use real processes and real signals (SIGSTOP / SIGCONT / SIGKILL).
"""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import (
    FlodlError,
    SessionSalt,
    connect_reduce_client,
)
from flodl_trio.client import CoordinatorLost, connect_control_client
from flodl_trio.testing import open_local_cluster, open_process_cluster
from flodl_trio.testing.rank_worker import contribution

SIG = b"\x11" * 32


def mean_of(ranks, round_index: int) -> float:
    return sum(contribution(r, round_index) for r in ranks) / len(ranks)


@pytest.mark.deadline(60)
async def test_sigstop_rank_is_declared_dead_and_survivors_continue(salt):
    timeout = 1.5
    async with open_process_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], salt=salt, rounds=6, pause=0.3, heartbeat_timeout=timeout
    ) as cluster:
        for rank in range(4):
            await cluster.wait_round(rank, 1)
        cluster.freeze(3)
        frozen_at = trio.current_time()
        # Rounds up to the freeze may include rank 3; the first round after it must not hang.
        survivors = [0, 1, 2]
        event = await cluster.wait_round(0, 3)
        assert event["time"] - frozen_at < timeout + 2.0 + 1.0  # +1: clock offset between processes
        for rank in survivors:
            outcome = await cluster.wait_outcome(rank)
            assert outcome["event"] == "done", outcome
            rounds = {e["round"]: e for e in cluster.ranks[rank].rounds}
            assert sorted(rounds) == list(range(6))
            for k in range(3, 6):
                assert rounds[k]["value"] == pytest.approx(mean_of(survivors, k)), (rank, k)
                assert rounds[k]["mass"] == 3.0
        assert cluster.local.controller.dead_ranks.is_dead(3)
        # Thawed, the frozen rank finds itself evicted: a clear error, no stale round.
        cluster.thaw(3)
        outcome = await cluster.wait_outcome(3)
        assert outcome["event"] == "error" and outcome["type"] in ("RankDeadError", "CoordinatorLost"), outcome
        assert "declared dead" in outcome["message"] or "closed" in outcome["message"], outcome
        assert all(e["round"] <= 2 for e in cluster.ranks[3].rounds)


async def _control_rank(cluster, rank: int, salt, signature: bytes = SIG, **kw):
    return connect_control_client(cluster.control_address(rank), rank, cluster.world_size, salt, signature, **kw)


async def test_control_handshake_refusals_are_distinct_and_harmless(salt):
    other = SessionSalt(b"\x07" * 16)
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt, control=True, heartbeat_timeout=2.0) as cluster:
        address = cluster.control_address(0)
        with pytest.raises(FlodlError, match="handshake ack"):
            async with connect_control_client(address, 0, 2, other, SIG):
                pass
        with pytest.raises(FlodlError, match="handshake ack"):
            async with connect_control_client(address, 0, 3, salt, SIG):
                pass
        reasons = "\n".join(cluster.control_relays[0].rejections)
        assert "MAC mismatch" in reasons and "world_size 3" in reasons, reasons
        # the cluster is unaffected: both real ranks join and average
        results = {}

        async def member(rank: int) -> None:
            async with connect_control_client(cluster.control_address(rank), rank, 2, salt, SIG):
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, salt) as c:
                    results[rank] = (await c.all_reduce_tensors([torch.tensor([float(rank)])]))[0].item()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0)
            nursery.start_soon(member, 1)
        assert results == {0: 0.5, 1: 0.5}


def test_model_signature_tracks_architecture_not_values():
    from flodl_trio.client.tensors import model_signature

    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with torch.no_grad():
        b.weight.add_(1.0)
    assert len(model_signature(a)) == 32
    assert model_signature(a) == model_signature(b)  # same architecture, other values
    assert model_signature(a) != model_signature(torch.nn.Linear(4, 2))  # shape
    assert model_signature(a) != model_signature(torch.nn.Linear(4, 3).double())  # dtype
    bn = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    assert model_signature(bn) != model_signature(torch.nn.Sequential(torch.nn.Linear(4, 3)))  # buffers count


async def test_control_connection_reset_raises_coordinator_lost_alone(salt):
    """The control relay accepts the rank, then resets the connection. The client's
    reader fails with CoordinatorLost; the beacon watch beside it must not add a
    second error of its own (it once saw its message channel closed and raised
    EndOfChannel, turning a clear error into an exception group). Repeated,
    because the two tasks race."""
    import functools
    import socket
    import struct

    from flodl_trio.wire.handshake import CONTROL_HANDSHAKE_LEN, encode_control_ack

    async def accept_then_reset(stream: trio.SocketStream) -> None:
        received = 0
        while received < CONTROL_HANDSHAKE_LEN:
            received += len(await stream.receive_some(CONTROL_HANDSHAKE_LEN - received))
        await stream.send_all(encode_control_ack(salt))
        await trio.sleep(0.05)  # the client is now waiting for beacons
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, accept_then_reset, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        for _ in range(10):
            with pytest.raises(CoordinatorLost, match="control connection failed"):
                async with connect_control_client(("127.0.0.1", port), 0, 1, salt, b"\0" * 32, beacon_timeout=30):
                    await trio.sleep_forever()
        nursery.cancel_scope.cancel()
