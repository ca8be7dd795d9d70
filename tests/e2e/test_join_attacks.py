"""The join path under attack (issue 29): a joiner that never reads its state, and a
join replayed by a peer without the salt. Each costs only its own connections: the
others' windows go on at their pace, exact over their contributors, and the rank
can still come back for real afterwards.

Real sockets (TCP, no local leg), a real controller and relays in one trio run;
the hostile peers speak raw bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.testing import fetch_status, open_local_cluster, wait_until_primed
from flodl_trio.testing.matrix.hostile import answered_state_request
from flodl_trio.transport.settings import NetBounds
from flodl_trio.wire.handshake import DATA_ACK_LEN, encode_data_handshake
from flodl_trio.wire.salt import SessionSalt
from flodl_trio.wire.state import STATE_CHALLENGE_LEN

SALT = SessionSalt(b"join-attack-salt")
WORLD, HOSTS = 3, [[0, 1], [2]]
HEAD = 32  # the params the windows move
STATE = 4 << 20  # f32 elements of a second tensor that stays 1.0: a 16 MiB state for joiners
DEADLINE_S = 60


def delta(rank: int, window: int) -> np.ndarray:
    return np.random.default_rng([rank, window]).standard_normal(HEAD).astype(np.float32)


def steps_of(rank: int, window: int) -> int:
    return 1 + (rank + window) % 3


@attrs.define
class Windows:
    """What each rank saw per window: the gathered counts and the consensus head."""

    seen: dict[tuple[int, int], tuple[list[float], np.ndarray]] = attrs.field(factory=dict)
    done: dict[int, int] = attrs.field(factory=dict)
    progress: trio.Event = attrs.field(factory=trio.Event)

    def record(self, rank: int, window: int, counts: list[float], head: np.ndarray) -> None:
        self.seen[rank, window] = (counts, head.copy())
        self.done[rank] = window
        self.progress.set()
        self.progress = trio.Event()

    async def wait_for(self, rank: int, window: int) -> None:
        while self.done.get(rank, -1) < window:
            await self.progress.wait()

    def check_exact(self, windows: int) -> dict[int, set[int]]:
        """Every window's consensus against numpy over exactly the ranks its counts name."""
        consensus = np.zeros(HEAD, np.float64)
        contributors: dict[int, set[int]] = {}
        for window in range(windows):
            seen = {rank: v for (rank, w), v in self.seen.items() if w == window}
            counts = next(iter(seen.values()))[0]
            assert all(c == counts for c, _ in seen.values()), f"window {window}: ranks gathered different counts"
            ranks = {r for r in range(WORLD) if counts[r] > 0}
            mass = {r: float(steps_of(r, window)) for r in ranks}
            want = consensus + sum(mass[r] * delta(r, window) for r in ranks) / sum(mass.values())
            for rank, (_, head) in seen.items():
                np.testing.assert_allclose(head, want, rtol=1e-5, atol=1e-5, err_msg=f"window {window} rank {rank}")
            consensus, contributors[window] = want, ranks
        return contributors


def model() -> list[torch.Tensor]:
    return [torch.zeros(HEAD), torch.ones(STATE)]


async def train(client, rank: int, params: Sequence[torch.Tensor], first: int, last: int, windows: Windows) -> None:
    for window in range(first, last):
        with torch.no_grad():
            params[0].add_(torch.from_numpy(delta(rank, window)))
        result = await average_window(client, params, [], steps_of(rank, window), rank=rank, world_size=WORLD,
                                      in_place=True)
        windows.record(rank, window, list(result.counts), params[0].numpy())


async def receive_exactly(stream: trio.abc.Stream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


async def closed_by_peer(stream: trio.abc.Stream) -> bytes:
    """Everything the peer still sends, until it closes."""
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


@pytest.mark.trio
async def test_a_joiner_that_never_reads_its_state_costs_the_others_nothing():
    """Rank 1 comes back (its data connection and a signed, answered state request), then
    never reads the 16 MiB state. It is in no barrier until it says it has its state,
    so ranks 0 and 2 train on, window after window; a write stall of a minute (longer
    than this test's deadline) never comes into it."""
    windows = Windows()
    total = 10
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, local_leg=False,
            bounds=NetBounds(write_stall=120.0),
        ) as cluster:
            host, port = cluster.relay_address(1)
            stalled = trio.Event()

            async def survivor(rank: int) -> None:
                params = model()
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await client.join(params)
                    await train(client, rank, params, 0, 3, windows)
                    await stalled.wait()  # from here on rank 1's state sits unread
                    await train(client, rank, params, 3, total, windows)

            async def rank_1_stalls() -> None:
                params = model()
                async with connect_reduce_client((host, port), 1, WORLD, SALT) as client:
                    await client.join(params)
                    await train(client, 1, params, 0, 2, windows)
                    await client.aclose()  # a crash: it may come back
                await windows.wait_for(0, 2)  # a window without it: it is gone
                async with connect_reduce_client((host, port), 1, WORLD, SALT):  # its relay asks it back in
                    state, _sent = await answered_state_request((host, port), 1, WORLD, SALT)
                    while 1 not in (await fetch_status(cluster.controller_address))["joining"]:
                        await trio.sleep(0.02)
                    stalled.set()
                    await windows.wait_for(0, total - 1)  # reads nothing meanwhile
                    status = await fetch_status(cluster.controller_address)
                    assert 1 in status["joining"] and 1 not in status["primed"], status
                    await state.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor, 0)
                nursery.start_soon(survivor, 2)
                nursery.start_soon(rank_1_stalls)
            assert cluster.controller.stats.rejoins == 0
    contributors = windows.check_exact(total)
    assert all(contributors[w] == {0, 2} for w in range(2, total)), contributors


@pytest.mark.trio
async def test_a_state_write_that_stalls_calls_the_return_off_and_frees_the_seat():
    """The same joiner with a write-stall bound of 1 s: the controller gives up on the
    transfer, tells the relay (which drops the joiner's data connection), and the
    rank, restarted for real, comes back."""
    windows = Windows()
    total = 12
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, local_leg=False,
            bounds=NetBounds(write_stall=1.0),
        ) as cluster:
            host, port = cluster.relay_address(1)
            back = trio.Event()

            async def survivor(rank: int) -> None:
                params = model()
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await client.join(params)
                    await train(client, rank, params, 0, 5, windows)
                    await wait_until_primed(cluster.controller_address, [1])  # its second try has its state
                    await train(client, rank, params, 5, total, windows)

            async def rank_1() -> None:
                params = model()
                async with connect_reduce_client((host, port), 1, WORLD, SALT) as client:
                    await client.join(params)
                    await train(client, 1, params, 0, 2, windows)
                    await client.aclose()
                await windows.wait_for(0, 2)  # a window without it: it is gone
                data = await trio.open_tcp_stream(host, port)
                await data.send_all(encode_data_handshake(1, WORLD))
                assert len(await receive_exactly(data, DATA_ACK_LEN)) == DATA_ACK_LEN
                state, _sent = await answered_state_request((host, port), 1, WORLD, SALT)
                await closed_by_peer(data)  # the relay drops it once the controller called the return off
                await state.aclose()
                params = model()
                async with connect_reduce_client((host, port), 1, WORLD, SALT) as client:
                    start = await client.join(params)
                    back.set()
                    await train(client, 1, params, start, total, windows)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor, 0)
                nursery.start_soon(survivor, 2)
                nursery.start_soon(rank_1)
            assert back.is_set()
            assert cluster.controller.stats.rejoins == 1
    windows.check_exact(total)
    assert 1 in windows.check_exact(total)[total - 1]


class Recording(trio.abc.Stream):
    """A TCP stream that keeps a copy of every byte its owner sends (a wiretap)."""

    def __init__(self, inner: trio.abc.Stream, sent: bytearray) -> None:
        self.inner, self.sent = inner, sent

    async def send_all(self, data) -> None:
        self.sent += bytes(data)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # setsockopt and friends, for the client's socket tuning


@pytest.mark.trio
async def test_a_join_replayed_without_the_salt_gets_no_seat_and_its_frames_are_never_folded(caplog):
    """Everything rank 1 sent in its first life is recorded: its data handshake and
    frames, its state request and its answer. Once it has died, a peer without the
    salt replays both connections. The state connection gets a fresh challenge that
    the recorded answer does not answer (closed, nothing more); the replayed data
    connection is held, never folded, and dropped after the handshake bound; then
    rank 1, restarted for real, comes back. Every window stays exact."""
    windows = Windows()
    total = 14
    recorded: dict[str, bytearray] = {}

    async def wiretap(host: str, port: int) -> trio.abc.Stream:
        sent = recorded.setdefault(f"connection {len(recorded)}", bytearray())
        return Recording(await trio.open_tcp_stream(host, port), sent)

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, rejoin_timeout=60, local_leg=False,
            bounds=NetBounds(handshake=1.0),
        ) as cluster:
            host, port = cluster.relay_address(1)
            replayed = trio.Event()

            async def survivor(rank: int) -> None:
                params = model()
                async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, SALT) as client:
                    await client.join(params)
                    await train(client, rank, params, 0, 5, windows)
                    await replayed.wait()  # the replay is over before window 5
                    await train(client, rank, params, 5, total, windows)

            async def replay_rank_1() -> None:
                params = model()
                async with connect_reduce_client((host, port), 1, WORLD, SALT, connect=wiretap) as client:
                    await client.join(params)
                    await train(client, 1, params, 0, 2, windows)
                    await client.aclose()
                data_bytes, state_bytes = recorded["connection 0"], recorded["connection 1"]
                assert len(state_bytes) == 40 + 16  # the request and the answer
                await windows.wait_for(0, 4)
                rejoins = cluster.controller.stats.rejoins
                # The replay: no salt, only the recorded bytes.
                state = await trio.open_tcp_stream(host, port)
                await state.send_all(bytes(state_bytes))
                challenge_and_rest = await closed_by_peer(state)
                assert len(challenge_and_rest) == STATE_CHALLENGE_LEN  # a fresh challenge, then nothing
                # The handshake and the first old frame (a Control frame: what a window
                # opens with); the relay holds it for the controller's word.
                first = 16 + 4 + int.from_bytes(data_bytes[16:20], "little")
                data = await trio.open_tcp_stream(host, port)
                await data.send_all(bytes(data_bytes[:first]))
                assert len(await receive_exactly(data, DATA_ACK_LEN)) == DATA_ACK_LEN
                await closed_by_peer(data)  # never folded; dropped once the handshake bound passed
                assert cluster.controller.stats.rejoins == rejoins
                replayed.set()
                params = model()
                async with connect_reduce_client((host, port), 1, WORLD, SALT) as client:
                    start = await client.join(params)
                    await train(client, 1, params, start, total, windows)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor, 0)
                nursery.start_soon(survivor, 2)
                nursery.start_soon(replay_rank_1)
            assert cluster.controller.stats.rejoins == 1
    contributors = windows.check_exact(total)
    assert all(contributors[w] == {0, 2} for w in range(2, 6)), contributors
    assert contributors[total - 1] == {0, 1, 2}
    assert "a replayed join?" in caplog.text
    assert "sent no verified state request within 1 s" in caplog.text
