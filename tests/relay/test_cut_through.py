"""The streaming paths of large rounds, through real clusters.

Cut-through fan-out: a relay forwards a large consensus to its ranks while it
arrives, and releases each frame's last 8 bytes only once the record's MAC
verified. Finishing ahead: the relay's HostFrame and the controller's consensus
are computed while the round's last frame arrives, and used only if it verifies.

Both are paths of whole frames (flodl's bytes): these clusters run with one lane.
Expected values are computed independently with numpy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import numpy as np
import pytest
import trio

from flodl_trio import (
    DTYPE_F32,
    FlodlError,
    MacError,
    RoundFrame,
    TensorPayload,
)
from flodl_trio.client import ReduceClient
from flodl_trio.testing import (
    BandwidthCap,
    CutAt,
    FlipBit,
    LocalCluster,
    Stall,
    open_fault_proxy,
    open_local_cluster,
)
from flodl_trio.testing.matrix.offsets import HELLO_ACK_RECORD_LEN, LENGTH_PREFIX, MUX_MAC, uplink_first_record
from flodl_trio.wire.constants import MAC_LEN, MUX_HEADER_LEN
from flodl_trio.wire.handshake import DATA_ACK_LEN, DATA_HANDSHAKE_LEN
from flodl_trio.wire.round_frame import schema_frame_len

# Two tensors, well above the relay's small-record threshold (64 KiB).
SHAPES = [(300, 101), (40_000,)]
FRAME_LEN = schema_frame_len([(DTYPE_F32, s) for s in SHAPES])
HELLO_ACK_RECORD = HELLO_ACK_RECORD_LEN
# Offset of the first Broadcast's payload in the controller -> relay byte stream.
BROADCAST_PAYLOAD_AT = HELLO_ACK_RECORD + MUX_HEADER_LEN


def values(rank: int, round_index: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * round_index + rank)
    return [rng.standard_normal(int(np.prod(s))).astype("<f4") for s in SHAPES]


def frame_of(arrays: list[np.ndarray]) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, s, a) for s, a in zip(SHAPES, arrays)], weight=1.0)


def expected(hosts: list[list[int]], round_index: int) -> list[np.ndarray]:
    """f32 fold per host, f32 sum over hosts, times f32(1 / mass)."""
    out = []
    for t in range(len(SHAPES)):
        total = None
        for ranks in hosts:
            host = values(ranks[0], round_index)[t].copy()
            for r in ranks[1:]:
                host = (host + values(r, round_index)[t]).astype(np.float32)
            total = host if total is None else (total + host).astype(np.float32)
        mass = sum(len(h) for h in hosts)
        out.append((total * np.float32(1.0 / mass)).astype(np.float32))
    return out


def arrays_of(reply: RoundFrame) -> list[np.ndarray]:
    return [np.frombuffer(t.data, dtype="<f4").copy() for t in reply.tensors]


async def bytes_to_ranks_during(
    cluster: LocalCluster, stall: Stall, after: float, rank_main: Callable[[int, ReduceClient], Awaitable[None]]
) -> dict[int, int]:
    """Run ``rank_main(rank, client)`` for ranks 0 and 1, each behind a tap on its
    loopback leg; return how many bytes each tap had passed on to its rank ``after``
    seconds into ``stall`` (on host 0's uplink)."""
    seen: dict[int, int] = {}
    async with open_fault_proxy(cluster.relay_address(0), []) as tap0, open_fault_proxy(
        cluster.relay_address(1), []
    ) as tap1:
        taps = {0: tap0, 1: tap1}

        async def observe() -> None:
            await cluster.upstream_proxies[0].wait_fired(stall)
            await trio.sleep(after)
            for rank, tap in taps.items():
                seen[rank] = tap.connections[0].down.bytes_out

        async with trio.open_nursery() as nursery:
            nursery.start_soon(observe)
            addresses = {rank: tap.address for rank, tap in taps.items()}
            nursery.start_soon(partial(cluster.run_ranks, rank_main, taps, addresses=addresses))
    return seen


async def test_large_consensus_is_exact_through_cut_through(salt):
    """Three rounds of a large model over two hosts. Host 1 sits behind a thinner
    uplink than rank 1's loopback, and rank 1 behind a thinner loopback than rank 0's,
    so their frames are each round's last: relay 0 computes and signs its HostFrame while rank 1's frame arrives, the
    controller the consensus while host 1's arrives, relay 0 streams the consensus
    to its ranks - and every rank gets the exact consensus."""
    world, hosts = 3, [[0, 1], [2]]
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    thin = {1: [BandwidthCap(1_500_000, direction="up")]}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, lanes=1, upstream_faults=thin) as cluster:
        async with open_fault_proxy(cluster.relay_address(1), [BandwidthCap(4_000_000, direction="up")]) as slow:

            async def rank_main(rank: int, client: ReduceClient) -> None:
                for k in range(3):
                    got[rank, k] = arrays_of(await client.all_reduce(frame_of(values(rank, k))))

            await cluster.run_ranks(rank_main, addresses={1: slow.address})
        assert cluster.relays[0].stats.broadcasts_streamed == 3
        assert cluster.relays[0].stats.rounds_finished_ahead == 3
        assert cluster.controller.stats.rounds_finished_ahead == 3
    for k in range(3):
        want = expected(hosts, k)
        for rank in range(world):
            for t in range(len(SHAPES)):
                np.testing.assert_array_equal(got[rank, k][t], want[t], err_msg=f"round {k} rank {rank} tensor {t}")


async def test_ranks_receive_the_consensus_while_it_is_still_arriving(salt):
    """The controller -> relay leg stalls half-way through the Broadcast: by then the
    relay has already passed that half on to its ranks (store-and-forward would have
    passed nothing), and after the stall the round completes exactly."""
    world, hosts = 2, [[0, 1]]
    half = FRAME_LEN // 2
    stall = Stall(at_byte=BROADCAST_PAYLOAD_AT + half, seconds=1.0, direction="down")
    got: dict[int, list[np.ndarray]] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, lanes=1, upstream_faults={0: [stall]}) as cluster:

        async def rank_main(rank: int, client: ReduceClient) -> None:
            got[rank] = arrays_of(await client.all_reduce(frame_of(values(rank, 0))))

        # 0.5 s: well inside the 1 s stall.
        seen_during_stall = await bytes_to_ranks_during(cluster, stall, 0.5, rank_main)
    ack = DATA_ACK_LEN  # the data handshake ack precedes the consensus on the rank leg
    for rank in range(world):
        # Everything that had arrived (less whatever sat in socket buffers) was forwarded...
        assert seen_during_stall[rank] >= ack + LENGTH_PREFIX + half - (256 << 10), seen_during_stall
        # ...but never the frame's end.
        assert seen_during_stall[rank] < ack + LENGTH_PREFIX + FRAME_LEN - MAC_LEN
        for t, want in enumerate(expected(hosts, 0)):
            np.testing.assert_array_equal(got[rank][t], want)


async def test_a_broadcast_failing_its_record_mac_never_completes_at_a_rank(salt):
    """Corrupt only the Broadcast record's own MAC: the frame inside is intact and
    would pass the rank's check, so a rank that returned would prove the relay
    released the frame's end unverified. The leg also stalls 4 bytes before the
    record's end: by then a relay forwarding blindly would have passed on all but
    those 4 bytes; this one must hold back the last 8. Every rank then fails, and
    the relay stops with a MacError."""
    world, hosts = 2, [[0, 1]]
    flip = FlipBit(at_byte=HELLO_ACK_RECORD + MUX_MAC, bit=3, direction="down")
    stall = Stall(at_byte=BROADCAST_PAYLOAD_AT + FRAME_LEN - 4, seconds=0.6, direction="down")
    errors: dict[int, BaseException] = {}
    upstream_faults = {0: [flip, stall]}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, lanes=1, upstream_faults=upstream_faults) as cluster:

        async def rank_main(rank: int, client: ReduceClient) -> None:
            with pytest.raises(FlodlError) as info:
                await client.all_reduce(frame_of(values(rank, 0)))
            errors[rank] = info.value

        during_stall = await bytes_to_ranks_during(cluster, stall, 0.4, rank_main)
        with pytest.raises(MacError, match="MuxRecord"):
            await cluster.relays[0].wait_finished()
    assert sorted(errors) == [0, 1]
    ack = DATA_ACK_LEN
    for rank in range(world):
        assert during_stall[rank] == ack + LENGTH_PREFIX + FRAME_LEN - MAC_LEN, during_stall


def doubled(consensus: RoundFrame) -> RoundFrame:
    """A stand-in outer step that visibly transforms the params consensus."""
    return RoundFrame(
        [TensorPayload(t.dtype, t.shape, np.frombuffer(t.data, "<f4") * np.float32(2)) for t in consensus.tensors],
        consensus.kind, consensus.weight,
    )


async def test_a_params_round_goes_through_the_outer_step_not_ahead(salt):
    """With an outer optimizer, the Model round after a Control round (the params
    round) must be transformed before it is signed, so it is not finished ahead; the
    buffers round after it is. Both reach the ranks exactly."""
    world, hosts = 3, [[0, 1], [2]]
    thin = {1: [BandwidthCap(4_000_000, direction="up")]}
    got: dict[tuple[int, str], list[np.ndarray]] = {}
    async with open_local_cluster(
        world_size=world, hosts=hosts, salt=salt, lanes=1, upstream_faults=thin, outer_optimizer=doubled
    ) as cluster:

        async def rank_main(rank: int, client: ReduceClient) -> None:
            await client.all_reduce_per_rank_f64([float(r) for r in range(world)])
            got[rank, "params"] = arrays_of(await client.all_reduce(frame_of(values(rank, 0))))
            got[rank, "buffers"] = arrays_of(await client.all_reduce(frame_of(values(rank, 1))))

        await cluster.run_ranks(rank_main)
        assert cluster.controller.stats.rounds_finished_ahead == 1
    for rank in range(world):
        for t, want in enumerate(expected(hosts, 0)):
            np.testing.assert_array_equal(got[rank, "params"][t], want * np.float32(2))
        for t, want in enumerate(expected(hosts, 1)):
            np.testing.assert_array_equal(got[rank, "buffers"][t], want)


async def test_a_last_frame_failing_its_mac_while_finished_ahead_costs_only_its_relay(salt):
    """Host 1's HostFrame is the round's last and is corrupted mid-payload: the
    consensus computed beside it is thrown away, the controller drops relay host1
    (its rank 2 is dead and raises), and host 0's ranks get the exact consensus
    of their own frames - never one computed from the corrupted bytes."""
    world, hosts = 3, [[0, 1], [2]]
    flip = FlipBit(at_byte=uplink_first_record("host1", [2]) + MUX_HEADER_LEN + FRAME_LEN // 2, bit=2, direction="up")
    faults = {1: [BandwidthCap(4_000_000, direction="up"), flip]}
    outcomes: dict[int, BaseException | list[np.ndarray]] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, lanes=1, upstream_faults=faults) as cluster:

        async def rank_main(rank: int, client: ReduceClient) -> None:
            try:
                outcomes[rank] = arrays_of(await client.all_reduce(frame_of(values(rank, 0))))
            except FlodlError as exc:
                outcomes[rank] = exc

        await cluster.run_ranks(rank_main)
        await cluster.controller.wait_finished()  # every rank is dead or has exited: a clean end
        assert cluster.upstream_proxies[1].fired(flip)
        stats = cluster.controller.stats
        assert stats.rounds_finished_ahead == 0 and stats.mac_failures == 1 and stats.relays_dropped == 1
        assert cluster.controller.dead_ranks.is_dead(2)
    assert isinstance(outcomes[2], FlodlError), outcomes[2]
    for rank in (0, 1):
        for got, want in zip(outcomes[rank], expected([[0, 1]], 0)):  # type: ignore[arg-type]
            np.testing.assert_array_equal(got, want)


async def run_with_a_victim(
    cluster: LocalCluster, *, victim: int, rounds: int, got: dict[tuple[int, int], list[np.ndarray]],
    addresses: dict[int, tuple[str, int]] | None = None,
) -> None:
    """Every rank runs ``rounds`` rounds into ``got``, except ``victim``, whose first
    round must fail with a FlodlError."""

    async def rank_main(rank: int, client: ReduceClient) -> None:
        if rank == victim:
            with pytest.raises(FlodlError):
                await client.all_reduce(frame_of(values(rank, 0)))
            return
        for k in range(rounds):
            got[rank, k] = arrays_of(await client.all_reduce(frame_of(values(rank, k))))

    await cluster.run_ranks(rank_main, addresses=addresses)


@pytest.mark.parametrize("fault", ["flip", "cut"])
async def test_a_last_rank_frame_that_fails_midway_is_dropped_and_the_host_carries_on(salt, fault):
    """Rank 1's frame is its host's last; half-way through, a bit flips (the MAC
    fails at the end) or the connection is cut, while relay 0 computes the
    HostFrame beside it. That work is thrown away, rank 1 is dropped, and this
    round and the next complete exactly from ranks 0 and 2."""
    world, hosts = 3, [[0, 1], [2]]
    at = DATA_HANDSHAKE_LEN + LENGTH_PREFIX + FRAME_LEN // 2
    broken = FlipBit(at_byte=at, bit=6, direction="up") if fault == "flip" else CutAt(at_byte=at, direction="up")
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, lanes=1) as cluster:
        async with open_fault_proxy(cluster.relay_address(1), [BandwidthCap(4_000_000, direction="up"), broken]) as slow:
            await run_with_a_victim(cluster, victim=1, rounds=2, got=got, addresses={1: slow.address})
            assert slow.fired(broken)
        stats = cluster.relays[0].stats
        assert (stats.mac_failures, stats.rounds_finished_ahead) == (1 if fault == "flip" else 0, 0)
    for k in range(2):
        for rank in (0, 2):
            for t, want in enumerate(expected([[0], [2]], k)):
                np.testing.assert_array_equal(got[rank, k][t], want)


async def test_a_relay_cut_mid_frame_while_finished_ahead_leaves_the_other_host_its_rounds(salt):
    """Host 1's HostFrame is the round's last and its uplink is cut half-way while the
    controller computes the consensus beside it: host 1's ranks are dead, the work is
    dropped, and host 0 gets both rounds exactly from its own two ranks."""
    world, hosts = 3, [[0, 1], [2]]
    cut = CutAt(at_byte=uplink_first_record("host1", [2]) + MUX_HEADER_LEN + FRAME_LEN // 2, direction="up")
    faults = {1: [BandwidthCap(4_000_000, direction="up"), cut]}
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt, lanes=1, upstream_faults=faults) as cluster:
        await run_with_a_victim(cluster, victim=2, rounds=2, got=got)
        assert cluster.upstream_proxies[1].fired(cut)
        assert cluster.controller.stats.rounds_finished_ahead == 0
        assert cluster.controller.dead_ranks.is_dead(2)
        with pytest.raises(FlodlError, match="relay host1: connection to the controller failed"):
            await cluster.relays[1].wait_finished()
    for k in range(2):
        for rank in (0, 1):
            for t, want in enumerate(expected([[0, 1]], k)):
                np.testing.assert_array_equal(got[rank, k][t], want)
