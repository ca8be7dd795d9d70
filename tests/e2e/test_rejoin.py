"""A rank that left comes back: it gets the consensus of the newest finished
window while the others train on, enters at the next boundary (its first window
carrying no work when windows finished meanwhile), and every round stays exact.

Real sockets, a real controller and relays in one trio run; ranks are
``average_window`` trainers. What a round contained is read back from the
window's gathered step counts (a rank outside the round counts 0), and each
round's consensus is checked against a numpy reference over exactly those
contributors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import torch
import trio

from flodl_trio import JoinRefused, ReduceClient, average_window, connect_reduce_client
from flodl_trio.client import connect_control_client, fetch_cluster_state
from flodl_trio.errors import ConfigError, FlodlError, SchemaError
from flodl_trio.testing import open_local_cluster, wait_until_primed
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire.salt import SessionSalt
from flodl_trio.wire.state import (
    STATE_CHALLENGE_LEN,
    STATE_REPLY_HEADER_LEN,
    decode_state_challenge,
    encode_state_answer,
    encode_state_request,
    new_nonce,
)

SALT = SessionSalt(b"rejoin-test-salt")
WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 12
DEADLINE_S = 30
PARAM_SHAPES = [(64, 33), (17,)]
BUFFER_SHAPES = [(5,)]
SIG = b"\x33" * 32


def steps_of(rank: int, window: int) -> int:
    return 1 + (rank + window) % 3


def trained(params: list[torch.Tensor], rank: int, window: int) -> None:
    """Local training, made up but reproducible: a rank- and window-specific move."""
    with torch.no_grad():
        for index, p in enumerate(params):
            rng = np.random.default_rng([rank, window, index])
            p.add_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)))


def fresh_model(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rng = np.random.default_rng([99, rank])
    params = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in PARAM_SHAPES]
    buffers = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in BUFFER_SHAPES]
    return params, buffers


class Record:
    """What every rank saw, by window: its inputs, the gathered counts, the consensus."""

    def __init__(self) -> None:
        self.inputs: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.counts: dict[tuple[int, int], list[float]] = {}
        self.outputs: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.windows_done: dict[int, int] = {}
        self.progress = trio.Event()  # set and replaced whenever a window ends somewhere

    def window_done(self, rank: int, window: int) -> None:
        self.windows_done[rank] = window
        self.progress.set()
        self.progress = trio.Event()

    async def wait_for(self, rank: int, window: int) -> None:
        while self.windows_done.get(rank, -1) < window:
            await self.progress.wait()


async def run_windows(
    client, rank: int, first: int, params, buffers, record: Record, *, pace: float = 0.02, last: int = WINDOWS
) -> None:
    for window in range(first, last):
        await trio.sleep(pace)  # "training" takes a little while
        trained(params, rank, window)
        record.inputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
        result = await average_window(
            client, params, buffers, steps_of(rank, window), rank=rank, world_size=WORLD, in_place=True
        )
        record.counts[rank, window] = list(result.counts)
        record.outputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
        record.window_done(rank, window)


async def run_with_survivors(cluster, record: Record, survivors, *others, pace: float = 0.02) -> None:
    """Ranks ``survivors`` train every window from a fresh model (no join); ``others``
    (coroutine functions) run beside them."""

    async def survivor(rank: int) -> None:
        params, buffers = fresh_model(rank)
        async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
            await run_windows(client, rank, 0, params, buffers, record, pace=pace)

    async with trio.open_nursery() as nursery:
        for rank in survivors:
            nursery.start_soon(survivor, rank)
        for other in others:
            nursery.start_soon(other)


def first_counted(client: ReduceClient, start: int) -> int:
    """The first window a rank that joined at ``start`` contributes to: ``start``, or the
    next one when it entered behind (its first window carries no work)."""
    state = client.last_state
    return start + 1 if state is not None and state.behind else start


def check_every_window(record: Record, ranks_at_end: set[int]) -> dict[int, set[int]]:
    """Each window's consensus against a numpy reference over its contributors (a rank
    catching up finishes a window with no work: it must end with the same bytes);
    returns them."""
    contributors_by_window = {}
    for window in range(WINDOWS):
        seen = {rank: counts for (rank, w), counts in record.counts.items() if w == window}
        assert seen, f"window {window}: no rank finished it"
        gathered = next(iter(seen.values()))
        for rank, counts in seen.items():
            assert counts == gathered, f"window {window}: rank {rank} gathered {counts}, another {gathered}"
        contributors = {rank for rank in range(WORLD) if gathered[rank] > 0}
        assert contributors <= set(seen), f"window {window}: counts say {contributors}, finished by {set(seen)}"
        contributors_by_window[window] = contributors
        mass = {rank: float(steps_of(rank, window)) for rank in contributors}
        for part in (0, 1):  # params (gamma mass), buffers (mover mass 1)
            weights = mass if part == 0 else {rank: 1.0 for rank in contributors}
            total = sum(weights.values())
            count = len(record.inputs[min(contributors), window][part])
            for index in range(count):
                want = sum(weights[r] * record.inputs[r, window][part][index].astype(np.float64) for r in contributors)
                want = want / total
                for rank in contributors:
                    got = record.outputs[rank, window][part][index]
                    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5,
                                               err_msg=f"window {window} part {part} tensor {index} rank {rank}")
        first = min(contributors)
        for rank in seen:  # every rank of a round holds the same bytes, catching up or not
            for a, b in zip(record.outputs[rank, window][0], record.outputs[first, window][0]):
                assert a.tobytes() == b.tobytes()
    last = WINDOWS - 1
    assert contributors_by_window[last] == ranks_at_end
    return contributors_by_window


@asynccontextmanager
async def heartbeats(cluster, rank: int, control: bool) -> AsyncIterator[None]:
    """The rank's control channel (heartbeats) beside its data connection, when the cluster has one."""
    if not control:
        yield
        return
    async with connect_control_client(cluster.control_address(rank), rank, WORLD, SALT, SIG, heartbeat_timeout=5.0):
        yield


@asynccontextmanager
async def rank_client(cluster, rank: int, control: bool) -> AsyncIterator[ReduceClient]:
    """A rank's data connection, with its heartbeats beside it when the cluster has a control channel."""
    async with heartbeats(cluster, rank, control), connect_reduce_client(
        cluster.relay_address(rank), rank, WORLD, SALT
    ) as client:
        yield client


@pytest.mark.trio
@pytest.mark.parametrize("control", [False, True], ids=["data-only", "with-heartbeats"])
async def test_a_rank_that_left_rejoins_with_the_consensus_and_every_round_is_exact(control):
    record = Record()
    joined_at: dict[str, int] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, control=control, heartbeat_timeout=5.0
        ) as cluster:

            async def survivor(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with rank_client(cluster, rank, control) as client:
                    assert await client.join(params, buffers) == 0  # a fresh cluster: nothing to load
                    await run_windows(client, rank, 0, params, buffers, record)

            async def leaves_and_returns() -> None:
                rank = 3
                params, buffers = fresh_model(rank)
                async with rank_client(cluster, rank, control) as client:
                    assert await client.join(params, buffers) == 0
                    for window in range(3):
                        trained(params, rank, window)
                        record.inputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
                        result = await average_window(client, params, buffers, steps_of(rank, window),
                                                      rank=rank, world_size=WORLD, in_place=True)
                        record.counts[rank, window] = list(result.counts)
                        record.outputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
                    await client.aclose()  # a crash: gone without saying it finished
                # Gone (its connection closed between windows); back once the others are at window 6.
                await record.wait_for(0, 6)
                params, buffers = fresh_model(rank + 100)  # a restarted process: nothing of the old state
                async with rank_client(cluster, rank, control) as client:
                    start = await client.join(params, buffers)
                    loaded = client.last_state.window
                    joined_at.update(start=start, counted=first_counted(client, start), loaded=loaded)
                    await record.wait_for(0, loaded)
                    want_params, want_buffers = record.outputs[0, loaded]
                    assert [p.numpy().tobytes() for p in params] == [p.tobytes() for p in want_params]
                    assert [b.numpy().tobytes() for b in buffers] == [b.tobytes() for b in want_buffers]
                    await run_windows(client, rank, start, params, buffers, record)

            async with trio.open_nursery() as nursery:
                for rank in (0, 1, 2):
                    nursery.start_soon(survivor, rank)
                nursery.start_soon(leaves_and_returns)

            stats = cluster.controller.stats
            assert stats.rejoins == 1
            assert stats.states_served == 1
    start, counted, loaded = joined_at["start"], joined_at["counted"], joined_at["loaded"]
    assert 6 <= loaded < start <= 9, f"rank 3 came back after window 6: loaded window {loaded}, entered {start}"
    contributors = check_every_window(record, {0, 1, 2, 3})
    for window in range(WINDOWS):
        want = {0, 1, 2, 3} if window < 3 or window >= counted else {0, 1, 2}
        assert contributors[window] == want, f"window {window}"


@pytest.mark.trio
@pytest.mark.parametrize(
    ("params_shapes", "buffer_shapes", "message"),
    [
        ([(33, 64), (17,)], BUFFER_SHAPES, r"parameter 0 of shape \[64, 33\], this model's parameter 0 has shape \[33, 64\]"),
        ([(64, 33), (18,)], BUFFER_SHAPES, r"parameter 1 of shape \[17\], this model's parameter 1 has shape \[18\]"),
        (PARAM_SHAPES, [(6,)], r"float buffer 0 of shape \[5\], this model's float buffer 0 has shape \[6\]"),
    ],
    ids=["transposed", "other-numel", "other-buffer"],
)
async def test_a_join_into_a_model_with_one_other_shape_names_it_and_copies_nothing(params_shapes, buffer_shapes, message):
    """The counts agree, one shape does not: the error names the tensor and both shapes,
    the rank's tensors are untouched (every shape is checked before a copy), and the
    others train on."""
    record = Record()
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60) as cluster:

            async def returns_with_another_model() -> None:
                rank = 3
                async with rank_client(cluster, rank, False) as client:
                    params, buffers = fresh_model(rank)
                    assert await client.join(params, buffers) == 0
                    await run_windows_until(client, rank, params, buffers, record, last=1)
                    await client.aclose()  # a crash
                await record.wait_for(0, 3)
                params = [torch.full(shape, 7.0) for shape in params_shapes]
                buffers = [torch.full(shape, 7.0) for shape in buffer_shapes]
                async with rank_client(cluster, rank, False) as client:
                    with pytest.raises(SchemaError, match=message):
                        await client.join(params, buffers)
                assert all((t == 7.0).all() for t in [*params, *buffers])  # nothing was copied

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_with_survivors, cluster, record, (0, 1, 2), returns_with_another_model)
    contributors = check_every_window(record, {0, 1, 2})
    assert all(contributors[w] == {0, 1, 2, 3} for w in range(2))


async def run_windows_until(client, rank: int, params, buffers, record: Record, *, last: int) -> None:
    """Windows 0..last of rank ``rank``, recorded like every other rank's."""
    for window in range(last + 1):
        trained(params, rank, window)
        record.inputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
        result = await average_window(client, params, buffers, steps_of(rank, window), rank=rank, world_size=WORLD,
                                      in_place=True)
        record.counts[rank, window] = list(result.counts)
        record.outputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
        record.window_done(rank, window)


@pytest.mark.trio
async def test_a_fresh_cluster_answers_join_at_once_and_a_live_rank_may_not_join_again():
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:
            host, port = cluster.relay_address(0)
            state = await fetch_cluster_state(host, port, 0, 2, SALT, bounds=NetBounds())
            assert state.window == -1 and state.frames == ()

            async def rank_main(rank: int, client) -> None:
                params, buffers = fresh_model(rank)
                for window in range(2):
                    await average_window(client, params[:1], buffers, 1, rank=rank, world_size=2, in_place=True)
                if rank == 0:
                    with pytest.raises(JoinRefused, match="rank 0 is live"):
                        await client.fetch_state()

            await cluster.run_ranks(rank_main)
            assert cluster.controller.stats.rejoins_refused == 1


@pytest.mark.trio
async def test_a_state_request_with_another_salt_gets_nothing():
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:
            host, port = cluster.relay_address(0)
            with pytest.raises(FlodlError, match="refused unread"):
                await fetch_cluster_state(host, port, 0, 2, SessionSalt(b"another salt...."), bounds=NetBounds())
            assert any("state request" in r and "MAC" in r for r in cluster.controller.rejections)
            assert cluster.controller.stats.mac_failures == 1


@pytest.mark.trio
async def test_with_rejoining_off_a_returning_rank_is_refused_and_the_others_carry_on():
    record = Record()
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT) as cluster:

            async def returns_too_soon() -> None:
                params, buffers = fresh_model(3)
                async with connect_reduce_client(cluster.relay_address(3), 3, WORLD, SALT) as client:
                    await average_window(client, params, buffers, 1, rank=3, world_size=WORLD, in_place=True)
                await record.wait_for(0, 3)
                async with connect_reduce_client(cluster.relay_address(3), 3, WORLD, SALT) as client:
                    with pytest.raises(JoinRefused, match="rejoining is switched off"):
                        await client.join(params, buffers)

            await run_with_survivors(cluster, record, (0, 1, 2), returns_too_soon)
            assert cluster.controller.stats.rejoins_refused == 1  # its state request
            assert cluster.controller.stats.rejoins == 0
    assert all(record.counts[0, w][3] == 0 for w in range(1, WINDOWS))
    assert record.windows_done == {0: WINDOWS - 1, 1: WINDOWS - 1, 2: WINDOWS - 1}


async def run_until_gone(client, rank: int, windows: int, params, buffers, record: Record) -> None:
    """A rank's first life: ``windows`` windows, then it leaves (its connection closes)."""
    for window in range(windows):
        trained(params, rank, window)
        record.inputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
        result = await average_window(client, params, buffers, steps_of(rank, window), rank=rank, world_size=WORLD,
                                      in_place=True)
        record.counts[rank, window] = list(result.counts)
        record.outputs[rank, window] = ([p.numpy().copy() for p in params], [b.numpy().copy() for b in buffers])
    await client.aclose()  # a crash: gone without saying it finished


@pytest.mark.trio
async def test_two_ranks_coming_back_together_enter_the_same_window():
    record = Record()
    starts: dict[int, int] = {}
    counted: dict[int, int] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60) as cluster:
            both_back = trio.Event()
            both_primed = trio.Event()

            async def survivor(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await run_windows(client, rank, 0, params, buffers, record, pace=0.1, last=5)
                    await both_primed.wait()  # no boundary passes until both have their state
                    await run_windows(client, rank, 5, params, buffers, record, pace=0.1)

            async def watch_returns() -> None:
                await wait_until_primed(cluster.controller_address, (1, 3))
                both_primed.set()

            async def leaves_and_returns(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await client.join(params, buffers)
                    await run_until_gone(client, rank, 2, params, buffers, record)
                await record.wait_for(0, 4)
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    starts[rank] = -1
                    if len(starts) == 2:
                        both_back.set()
                    await both_back.wait()
                    starts[rank] = await client.join(params, buffers)
                    counted[rank] = first_counted(client, starts[rank])
                    await run_windows(client, rank, starts[rank], params, buffers, record, pace=0.1)

            async with trio.open_nursery() as nursery:
                for rank in (0, 2):
                    nursery.start_soon(survivor, rank)
                for rank in (1, 3):
                    nursery.start_soon(leaves_and_returns, rank)
                nursery.start_soon(watch_returns)
            assert cluster.controller.stats.rejoins == 2
    # Both loaded window 4 while the others waited before window 5, and entered at its
    # boundary: window 6 carries no work of theirs (they were behind), window 7 does.
    assert starts[1] == starts[3] == 6, starts
    assert counted[1] == counted[3] == 7, counted
    contributors = check_every_window(record, {0, 1, 2, 3})
    assert contributors[6] == {0, 2} and contributors[7] == {0, 1, 2, 3}


@pytest.mark.trio
async def test_a_rank_that_dies_while_it_waits_or_mid_transfer_costs_the_cluster_nothing():
    """Rank 3 comes back twice and dies each time (once waiting for the boundary, once
    with half of its state read); the third time it gets in. Every round stays exact."""
    record = Record()
    big = [(256, 1024)]  # 1 MiB of params: the transfer takes more than one read
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60) as cluster:
            host, port = cluster.relay_address(3)

            async def survivor(rank: int) -> None:
                params, buffers = fresh_model(rank)
                params += [torch.zeros(big[0])]
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await run_windows(client, rank, 0, params, buffers, record, pace=0.05)

            async def dies_waiting() -> None:
                async with connect_reduce_client((host, port), 3, WORLD, SALT) as client:
                    with trio.move_on_after(0.01):  # the state is not there before the next boundary
                        await client.fetch_state()
                    await client.aclose()  # dies: gone without saying it finished

            async def dies_mid_transfer() -> None:
                async with connect_reduce_client((host, port), 3, WORLD, SALT):
                    stream = await trio.open_tcp_stream(host, port)
                    nonce = new_nonce()
                    await stream.send_all(encode_state_request(3, WORLD, nonce, SALT))
                    challenge = b""
                    while len(challenge) < STATE_CHALLENGE_LEN:
                        challenge += await stream.receive_some(STATE_CHALLENGE_LEN - len(challenge))
                    await stream.send_all(encode_state_answer(3, decode_state_challenge(challenge, nonce, SALT), SALT))
                    got = 0
                    while got < STATE_REPLY_HEADER_LEN + 8 + 100_000:
                        got += len(await stream.receive_some(65536))
                    await stream.aclose()

            async def comes_back() -> None:
                params, buffers = fresh_model(3)
                params += [torch.zeros(big[0])]
                async with connect_reduce_client((host, port), 3, WORLD, SALT) as client:
                    await client.join(params, buffers)
                    await run_until_gone(client, 3, 2, params, buffers, record)
                await record.wait_for(0, 3)
                await dies_waiting()
                await record.wait_for(0, 5)
                await dies_mid_transfer()
                await record.wait_for(0, 7)
                async with connect_reduce_client((host, port), 3, WORLD, SALT) as client:
                    start = await client.join(params, buffers)
                    await run_windows(client, 3, start, params, buffers, record, pace=0.05)

            async with trio.open_nursery() as nursery:
                for rank in (0, 1, 2):
                    nursery.start_soon(survivor, rank)
                nursery.start_soon(comes_back)
            stats = cluster.controller.stats
            assert stats.rejoins == 1  # neither the one that died waiting nor the one mid-transfer got in
    contributors = check_every_window(record, {0, 1, 2, 3})
    assert all(contributors[w] == {0, 1, 2} for w in range(2, 8))


@pytest.mark.trio
async def test_a_rank_that_said_it_finished_is_not_waited_for_and_may_not_return():
    record = Record()
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=600) as cluster:

            async def rank_main(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await client.join(params, buffers)
                    if rank == 3:
                        await run_until_gone(client, rank, 2, params, buffers, record)
                        return  # gone already (run_until_gone closed it): not a clean finish
                    await run_windows(client, rank, 0, params, buffers, record)

            async def finishes_early() -> None:
                params, buffers = fresh_model(1)
                async with connect_reduce_client(cluster.relay_address(1), 1, WORLD, SALT) as client:
                    await client.join(params, buffers)
                    for window in range(2):
                        await average_window(client, params, buffers, 1, rank=1, world_size=WORLD, in_place=True)
                # Left the block normally: "finished". Coming back is refused.
                async with connect_reduce_client(cluster.relay_address(1), 1, WORLD, SALT) as client:
                    with pytest.raises(JoinRefused, match="rank 1 finished its training"):
                        await client.join(params, buffers)
                    await client.aclose()

            async with trio.open_nursery() as nursery:
                for rank in (0, 2, 3):
                    nursery.start_soon(rank_main, rank)
                nursery.start_soon(finishes_early)
            # Rank 3 crashed (it may come back for 600 s); ranks 0 and 2 finished; rank 1 finished.
            with trio.fail_after(5):
                while cluster.controller.dead_ranks.snapshot() != {0, 1, 2, 3}:
                    await trio.sleep(0.01)
            with trio.move_on_after(1):
                await cluster.controller.wait_finished()
                raise AssertionError("the controller finished although rank 3 may still come back")
            params, buffers = fresh_model(3)
            async with connect_reduce_client(cluster.relay_address(3), 3, WORLD, SALT) as client:
                start = await client.join(params, buffers)  # every rank is dead: let in at once
                assert start == WINDOWS
                want_params, _ = record.outputs[0, WINDOWS - 1]
                assert [p.numpy().tobytes() for p in params] == [p.tobytes() for p in want_params]
            with trio.fail_after(5):  # rank 3 finished too: nobody may come back, the run ends now
                await cluster.controller.wait_finished()
            assert cluster.controller.stats.rejoins_refused == 1


@pytest.mark.trio
async def test_when_every_rank_died_the_first_to_return_restarts_the_run_from_the_last_window():
    finals: dict[int, list[bytes]] = {}
    starts: dict[int, int] = {}
    last_window = 6
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:

            async def life(rank: int, first: bool) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    start = await client.join(params, buffers)
                    starts[rank] = start
                    for window in range(start, 3 if first else last_window):
                        trained(params, rank, window)
                        await average_window(client, params, buffers, 1 + rank, rank=rank, world_size=2, in_place=True)
                    if first:
                        await client.aclose()  # both crash after window 2
                        return
                finals[rank] = [p.numpy().tobytes() for p in params + buffers]

            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(life, rank, True)
            assert starts == {0: 0, 1: 0}
            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(life, rank, False)
            with trio.fail_after(5):
                await cluster.controller.wait_finished()
    assert sorted(starts.values())[0] == 3  # the first back restarts the run at the window after the last one
    assert all(3 <= s < last_window for s in starts.values()), starts
    assert finals[0] == finals[1]


@pytest.mark.trio
async def test_a_restarted_rank_that_does_not_call_join_is_dropped_with_a_clear_error(caplog):
    record = Record()
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60) as cluster:

            async def returns_without_join() -> None:
                params, buffers = fresh_model(3)
                async with connect_reduce_client(cluster.relay_address(3), 3, WORLD, SALT) as client:
                    await run_until_gone(client, 3, 2, params, buffers, record)
                await record.wait_for(0, 4)
                async with connect_reduce_client(cluster.relay_address(3), 3, WORLD, SALT) as client:
                    with pytest.raises(FlodlError):
                        await average_window(client, params, buffers, 1, rank=3, world_size=WORLD, in_place=True)

            await run_with_survivors(cluster, record, (0, 1, 2), returns_without_join)
    assert "rank 3 came back and sent a frame without calling join() first" in caplog.text
    check_every_window(record, {0, 1, 2})


@pytest.mark.trio
@pytest.mark.parametrize("control", [False, True], ids=["data-only", "with-heartbeats"])
async def test_a_cluster_forms_without_a_missing_rank_which_joins_later(control):
    """min_ranks=3, formation_timeout=1 s: ranks 0-2 start; rank 3 is not there. After
    1 s the cluster starts without it; rank 3 starts later and joins from the consensus."""
    record = Record()
    starts: dict[int, int] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, min_ranks=3, formation_timeout=1.0,
            control=control, heartbeat_timeout=5.0,
        ) as cluster:

            async def rank_main(rank: int) -> None:
                if rank == 3:
                    await record.wait_for(0, 3)  # late: the others have trained a while
                params, buffers = fresh_model(rank)
                async with rank_client(cluster, rank, control) as client:
                    starts[rank] = await client.join(params, buffers)
                    await run_windows(client, rank, starts[rank], params, buffers, record, pace=0.05)

            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(rank_main, rank)
            assert cluster.controller.stats.late_joins == 1 and cluster.controller.stats.rejoins == 0
    assert starts[0] == starts[1] == starts[2] == 0
    assert 4 <= starts[3] < WINDOWS
    contributors = check_every_window(record, {0, 1, 2, 3})
    assert all(contributors[w] == {0, 1, 2} for w in range(starts[3]))


@pytest.mark.trio
async def test_formation_waits_for_min_ranks_even_after_the_timeout():
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, min_ranks=3, formation_timeout=0.2,
        ) as cluster:
            params, buffers = fresh_model(0)
            async with connect_reduce_client(cluster.relay_address(0), 0, WORLD, SALT) as client:
                assert await client.join(params, buffers) == 0
                await trio.sleep(0.5)  # past the timeout with one rank of the three needed
                assert cluster.controller.dead_ranks.snapshot() == set()
                await client.aclose()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_ranks": 3}, "needs a formation_timeout"),
        ({"min_ranks": 3, "formation_timeout": 1.0, "rejoin_timeout": 0}, "needs rejoin_timeout > 0"),
        ({"min_ranks": 0, "formation_timeout": 1.0}, "between 1 and world_size 4"),
        ({"min_ranks": 5, "formation_timeout": 1.0}, "between 1 and world_size 4"),
        ({"formation_timeout": -1.0}, "formation_timeout must be"),
        ({"rejoin_timeout": float("inf")}, "rejoin_timeout must be"),
    ],
)
def test_membership_settings_that_cannot_work_are_refused_up_front(options, message):
    from flodl_trio.controller.config import membership_policy

    settings = {"rejoin_timeout": 60.0, "min_ranks": None, "formation_timeout": None, **options}
    with pytest.raises(ConfigError, match=message):
        membership_policy(WORLD, settings["rejoin_timeout"], settings["min_ranks"], settings["formation_timeout"])


@pytest.mark.trio
async def test_a_rank_coming_back_with_another_model_is_refused_and_the_cluster_carries_on(caplog):
    record = Record()
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, control=True, heartbeat_timeout=5.0,
        ) as cluster:

            async def survivor(rank: int) -> None:
                params, buffers = fresh_model(rank)
                async with rank_client(cluster, rank, True) as client:
                    await run_windows(client, rank, 0, params, buffers, record)

            async def comes_back_with_another_model() -> None:
                params, buffers = fresh_model(3)
                async with rank_client(cluster, 3, True) as client:
                    await client.join(params, buffers)
                    await run_until_gone(client, 3, 2, params, buffers, record)
                await record.wait_for(0, 4)
                with pytest.raises(FlodlError, match="another model signature than before"):
                    async with connect_control_client(cluster.control_address(3), 3, WORLD, SALT, b"\x99" * 32):
                        pass

            async with trio.open_nursery() as nursery:
                for rank in (0, 1, 2):
                    nursery.start_soon(survivor, rank)
                nursery.start_soon(comes_back_with_another_model)
    assert "model signature mismatch: rank 3" in caplog.text
    check_every_window(record, {0, 1, 2})



@pytest.mark.parametrize("codec", [None, "fp4"], ids=["f32", "delta-fp4"])
@pytest.mark.trio
async def test_a_window_with_no_work_keeps_the_state_ranks_returning_after_every_death_load(codec):
    """A window in which no rank did any work (accepted mass 0) leaves every rank with
    the params it had (a delta run's ranks take its consensus, which moves the base).
    Ranks that return after the whole cluster died load what the ranks held after
    it, not their fresh initialisation (join skips a weight-0 frame), and train on
    together in step (in a delta run, from the base every rank holds)."""
    from flodl_trio.wire.quant import DeltaCodec

    held: dict[int, list[bytes]] = {}
    given: dict[int, list[bytes]] = {}  # the state the controller gave each returning rank
    loaded: dict[int, list[bytes]] = {}
    finals: dict[int, list[bytes]] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:

            async def life(rank: int, first: bool) -> None:
                params, buffers = fresh_model(rank)
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    client.delta_codec = None if codec is None else DeltaCodec.parse(codec)
                    start = await client.join(params, buffers)
                    if not first:
                        state = client.last_state
                        assert state.window == 2
                        given[rank] = [bytes(t.data) for frame in state.frames for t in frame.tensors]
                        if not state.catch_up:  # (one that enters later takes the windows since, too)
                            loaded[rank] = [t.numpy().tobytes() for t in params + buffers]
                    for window in range(start, 2 if first else 5):
                        trained(params, rank, window)
                        await average_window(client, params, buffers, 1 + rank, rank=rank, world_size=2, in_place=True)
                    if not first:
                        finals[rank] = [t.numpy().tobytes() for t in params + buffers]
                        return
                    # Window 2: no work anywhere.
                    await average_window(client, params, buffers, 0, rank=rank, world_size=2, in_place=True)
                    held[rank] = [t.numpy().tobytes() for t in params + buffers]
                    await client.aclose()  # every rank crashes after window 2

            for first in (True, False):
                async with trio.open_nursery() as nursery:
                    for rank in (0, 1):
                        nursery.start_soon(life, rank, first)
    assert held[0] == held[1]
    assert given[0] == given[1] == held[0]
    assert loaded and all(tensors == held[0] for tensors in loaded.values())
    assert finals[0] == finals[1]


@pytest.mark.parametrize("with_buffers", [True, False], ids=["buffers", "no-buffers"])
@pytest.mark.trio
async def test_ranks_returning_after_every_rank_died_after_the_first_window_load_its_consensus(with_buffers):
    """Every rank dies after the run's first window. The controller learns how many Model
    rounds a window has from the window before, so it could not name the first one
    finished at its last round; its rounds went out all the same, and the first rank
    back loads its consensus (not its fresh initialisation) and restarts the run at
    window 1; all train on in step."""
    held: dict[int, list[bytes]] = {}
    loaded: dict[int, list[bytes]] = {}
    starts: dict[int, int] = {}
    finals: dict[int, list[bytes]] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=SALT, rejoin_timeout=60) as cluster:

            async def life(rank: int, first: bool) -> None:
                params, buffers = fresh_model(rank if first else rank + 10)
                buffers = buffers if with_buffers else []
                async with connect_reduce_client(cluster.relay_address(rank), rank, 2, SALT) as client:
                    start = await client.join(params, buffers)
                    if not first:
                        starts[rank] = start
                        if not client.last_state.catch_up:
                            loaded[rank] = [t.numpy().tobytes() for t in params + buffers]
                    for window in range(start, 1 if first else 4):
                        trained(params, rank, window)
                        await average_window(client, params, buffers, 1 + rank, rank=rank, world_size=2, in_place=True)
                    if first:
                        held[rank] = [t.numpy().tobytes() for t in params + buffers]
                        await client.aclose()  # every rank crashes after window 0
                    else:
                        finals[rank] = [t.numpy().tobytes() for t in params + buffers]

            for first in (True, False):
                async with trio.open_nursery() as nursery:
                    for rank in (0, 1):
                        nursery.start_soon(life, rank, first)
    assert held[0] == held[1]
    assert min(starts.values()) == 1, starts  # the first back restarts the run after window 0
    assert loaded and all(tensors == held[0] for tensors in loaded.values())
    assert finals[0] == finals[1]
