"""Cases: membership - a rank that never comes, ranks and hosts that come back, a cluster
that forms without one, a state request with another salt.

The restart cases train with ``rank_worker --windows`` (join, then Local SGD
windows) and check every window against the exact mean of the ranks that were
in it. Survivors hold before window :data:`HOLD` until the restarted ranks have
asked back in, so how long a process takes to start decides nothing.
"""

from __future__ import annotations

import re
import tempfile
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from ...wire.salt import SessionSalt
from ...wire.state import STATE_CHALLENGE_LEN, encode_state_request, new_nonce
from ..processes import ProcessCluster, open_process_cluster
from .clusters import HEARTBEAT_TIMEOUT, SALT, daemon_cluster, diagnose, pause
from .hostile import answered_state_request, raw_data_rank, receive_exactly, wait_closed_by_peer
from .oracle import all_done, everyone, expect_consensus, mono, windows_exact
from .registry import MatrixFailure, Outcome, case

WINDOWS = 12
WINDOW_NUMEL = 256
HOLD = 8  # survivors of a restart hold before this window until the restarted ranks asked back in


@case("never-connected-declared-dead", fault="a rank never starts; the operator declares it dead", leg="formation (operator)")
async def never_connected_declared_dead() -> Outcome:
    """Rank 1 never connects (data or control). Its host's data relay is connected from
    the start, so once it is declared dead, rank 0's rounds complete, and the host's
    control relay joins the coordinator without it (rank 0 keeps its beacons)."""
    async with open_process_cluster(
        world_size=3, hosts=[[0, 1], [2]], salt=SALT, rounds=3, pause=HEARTBEAT_TIMEOUT / 2, backend="numpy",
        heartbeat_timeout=HEARTBEAT_TIMEOUT, external_ranks={1},
    ) as c:
        with diagnose(c):
            assert c.local is not None
            await c.wait_event(0, "sending", round=0)
            await trio.sleep(HEARTBEAT_TIMEOUT / 2)
            if c.ranks[0].rounds:
                raise MatrixFailure("round 0 completed without rank 1 before it was declared dead")
            t0 = mono()
            c.local.controller.dead_ranks.declare_dead(1)
            rounds = await expect_consensus(c, [0, 2], 3, lambda _k: {0, 2})
            seconds = rounds[0][0]["time"] - t0
    return Outcome("ranks 0,2 went on (3 rounds over 0,2; rank 0's control relay joined without rank 1)", seconds)


def windowed_cluster(
    windows: int = WINDOWS, *, extra: dict[int, list[str]] | None = None, **options: Any
) -> AbstractAsyncContextManager[ProcessCluster]:
    """A daemon cluster of Local SGD trainers (``rank_worker --windows``: join, then
    average_window) whose controller lets dead ranks back for 60 s."""
    args = {r: ["--windows", str(windows), *(extra or {}).get(r, [])] for r in range(4)}
    controller_args = ["--rejoin-timeout", "60", *options.pop("controller_args", [])]
    return daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], backend="torch", numel=WINDOW_NUMEL, pause=0.3, heartbeat_timeout=10.0,
        controller_args=controller_args, worker_args=args, **options,
    )


def held(survivors: tuple[int, ...]) -> dict[int, list[str]]:
    """Worker arguments that hold ``survivors`` before window :data:`HOLD` (see :func:`release_once_back`)."""
    return {r: ["--pause-before", f"{HOLD}:inf"] for r in survivors}


async def release_once_back(c: ProcessCluster, ranks: list[int], survivors: tuple[int, ...]) -> None:
    """The survivors go on once the restarted ``ranks`` have their state (primed): how
    long a process takes to start then decides nothing (they enter at window HOLD + 1)."""
    await c.wait_returns_primed(ranks)
    for rank in survivors:
        await c.resume(rank)


@case("rank-kill-restart", fault="rank SIGKILLed mid-training, restarted with the same command", leg="rank process", deadline=60)
async def rank_kill_restart() -> Outcome:
    async with windowed_cluster(extra=held((0, 1, 2))) as c:
        with diagnose(c):
            await c.wait_event(3, "window", window=2)
            t0 = mono()
            c.kill(3)
            await c.wait_exit(3)
            await c.restart(3)
            await release_once_back(c, [3], (0, 1, 2))
            joined = await c.wait_event(3, "joined")
            start = joined["start"]
            first = await c.wait_event(3, "window", window=start)
            await all_done(c)
    windows_exact(c, WINDOWS, WINDOW_NUMEL, {3: {3}})
    return Outcome(
        f"rank 3 came back at window {start} from the consensus of window {joined['state_window']}; every window "
        "exact; all 4 end bit-identical", first["time"] - t0,
    )


@case("controller-kill-during-join", fault="controller daemon SIGKILLed while a restarted rank waits to enter, "
      "then started again", leg="controller process", deadline=60)
async def controller_kill_during_join() -> Outcome:
    """Rank 3 is killed and started again once the survivors hold before window HOLD; once
    it has its state and waits for the next window boundary (which cannot come while
    they hold), the controller is killed and started again. Its relay asks for it
    again, its join asks for its state again, the new controller serves it the state it
    recorded, and it enters when the survivors go on."""
    env = {"FLODL_CONTROLLER_OUTAGE": "60"}
    with tempfile.TemporaryDirectory(prefix="flodl-matrix-") as tmp:
        async with windowed_cluster(
            extra=held((0, 1, 2)), controller_args=["--checkpoint-dir", tmp],
            worker_env={r: env for r in range(4)}, relay_env={h: env for h in range(2)},
        ) as c:
            with diagnose(c):
                await c.wait_event(3, "window", window=2)
                c.kill(3)
                await c.wait_exit(3)
                for rank in (0, 1, 2):  # the last boundary before the hold has passed: no window can end now
                    await c.wait_event(rank, "paused", round=HOLD)
                await c.restart(3)
                await c.wait_returns_primed([3])  # it has its state and waits for a boundary that cannot come
                t0 = mono()
                c.kill_controller()
                await c.controller.wait()  # type: ignore[union-attr]
                await c.restart_controller()
                await release_once_back(c, [3], (0, 1, 2))
                joined = await c.wait_event(3, "joined")
                first = await c.wait_event(3, "window", window=joined["start"])
                await all_done(c)
    windows_exact(c, WINDOWS, WINDOW_NUMEL, {3: {3}})
    if "asking again" not in c.ranks[3].text:
        raise MatrixFailure("rank 3's join did not ask again after the controller was lost")
    return Outcome(
        f"rank 3's join asked again and the new controller served it the recorded state; it entered window "
        f"{joined['start']}; every window exact, all 4 end bit-identical, no survivor restarted", first["time"] - t0,
    )


@case("host-restart", fault="host 1's relay and ranks SIGKILLed, then restarted", leg="relay + rank processes", deadline=60)
async def host_restart() -> Outcome:
    async with windowed_cluster(extra=held((0, 1))) as c:
        with diagnose(c):
            await c.wait_event(2, "window", window=2)
            t0 = mono()
            for rank in (2, 3):
                c.kill(rank)
            c.kill_relay(1)
            for rank in (2, 3):
                await c.wait_exit(rank)
            await c.restart_relay(1)
            for rank in (2, 3):
                await c.restart(rank)
            await release_once_back(c, [2, 3], (0, 1))
            start = max([(await c.wait_event(rank, "joined"))["start"] for rank in (2, 3)])
            first = await c.wait_event(2, "window", window=start)
            await all_done(c)
    windows_exact(c, WINDOWS, WINDOW_NUMEL, {3: {2, 3}})
    return Outcome(
        f"host 0 trained on alone; host 1 came back at window {start}; every window exact; all 4 end bit-identical",
        first["time"] - t0,
    )


@case("formation-missing-rank", fault="rank 3 starts 3 s late (--min-ranks 3 --formation-timeout 1)", leg="formation", deadline=60)
async def formation_missing_rank() -> Outcome:
    windows = 24
    async with windowed_cluster(
        windows, controller_args=["--min-ranks", "3", "--formation-timeout", "1"],
        extra={3: ["--start-delay", "3"], **held((0, 1, 2))},
    ) as c:
        with diagnose(c):
            assert c.controller is not None
            await c.controller.wait_log("starting without ranks [3]")
            t0 = mono()
            await release_once_back(c, [3], (0, 1, 2))
            start = (await c.wait_event(3, "joined"))["start"]
            first = await c.wait_event(3, "window", window=start)
            await all_done(c)
    contributors = windows_exact(c, windows, WINDOW_NUMEL, {})
    if start == 0 or any(contributors[w] != {0, 1, 2} for w in range(start)):
        raise MatrixFailure(f"the cluster did not start without rank 3 (it entered window {start}): {contributors}")
    return Outcome(f"ranks 0-2 started after 1 s; rank 3 joined at window {start} from the consensus", first["time"] - t0)


@case("rejoin-wrong-salt", fault="a state request signed with another salt", leg="rank -> relay -> controller (state)")
async def rejoin_wrong_salt() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=4, worker_args={0: pause(2, 2.0)}) as c:
        with diagnose(c):
            assert c.controller is not None
            await c.wait_event(0, "paused", round=2)
            t0 = mono()
            stream = await trio.open_tcp_stream(*c.relay_address(3))
            await stream.send_all(encode_state_request(3, 4, new_nonce(), SessionSalt(b"\x17" * 16)))
            with trio.fail_after(10):
                reply = await stream.receive_some(1024)
            await stream.aclose()
            if reply:
                raise MatrixFailure(f"a request with another salt got {len(reply)} bytes back")
            line = (await c.controller.wait_log(re.compile(r"state request from .*"))).group(0)
            seconds = mono() - t0
            await c.resume(0)
            await expect_consensus(c, [0, 1, 2, 3], 4, everyone(4))
    if "MAC mismatch" not in line:
        raise MatrixFailure(f"the refusal does not say why: {line}")
    return Outcome("no byte back; the controller logged the refused request (MAC mismatch); every round exact", seconds)


async def killed_after_window(c: ProcessCluster, rank: int, window: int) -> None:
    await c.wait_event(rank, "window", window=window)
    c.kill(rank)
    await c.wait_exit(rank)


async def back_for_real(c: ProcessCluster, rank: int, survivors: tuple[int, ...]) -> int:
    """Restart ``rank`` with its own command, release the held survivors once it has its
    state, let every rank finish; the window it entered."""
    await c.restart(rank)
    await release_once_back(c, [rank], survivors)
    start = int((await c.wait_event(rank, "joined"))["start"])
    await all_done(c)
    return start


@case("join-state-never-read", fault="a comeback of rank 3 answers its challenge, then never reads its state",
      leg="rank -> relay -> controller (state)", deadline=60)
async def join_state_never_read() -> Outcome:
    """Rank 3 is SIGKILLed; a raw peer holding the salt plays its comeback (data
    handshake, signed request, answered challenge) and reads nothing. A joiner is in
    no barrier before its receipt, so ranks 0-2 train on at their pace until the
    hold before window HOLD; only then does it give up, and rank 3, restarted, comes
    back."""
    async with windowed_cluster(extra=held((0, 1, 2))) as c:
        with diagnose(c):
            await killed_after_window(c, 3, 2)
            data = await raw_data_rank(c.relay_address(3), 3, 4)
            state, _sent = await answered_state_request(c.relay_address(3), 3, 4)
            while 3 not in (await c.status())["joining"]:
                await trio.sleep(0.02)
            t0 = mono()
            first = (await c.wait_event(0, "window", window=3))["time"]
            last = (await c.wait_event(0, "window", window=HOLD - 1))["time"]
            status = await c.status()
            if 3 not in status["joining"] or 3 in status["primed"] or status["stats"]["rejoins"]:
                raise MatrixFailure(f"the stalled joiner got further than its request: {status}")
            await state.aclose()
            await data.aclose()
            start = await back_for_real(c, 3, (0, 1, 2))
    contributors = windows_exact(c, WINDOWS, WINDOW_NUMEL, {3: {3}})
    if any(contributors[w] != {0, 1, 2} for w in range(3, HOLD)):
        raise MatrixFailure(f"windows 3..{HOLD - 1} were not the survivors' alone: {contributors}")
    pace = (last - first) / (HOLD - 4)
    return Outcome(
        f"ranks 0-2 ran windows 4-{HOLD - 1} at {pace:.2f} s each while rank 3's state sat unread; "
        f"rank 3, restarted, came back at window {start}; every window exact", last - t0,
    )


@case("join-replayed", fault="rank 3's recorded join (state request, answer, data handshake) replayed without the salt",
      leg="rank -> relay -> controller (state)", deadline=60)
async def join_replayed() -> Outcome:
    """Rank 3 is SIGKILLed. Bytes of a join of rank 3, as a wiretap recorded them, are
    replayed by a peer that does not know the salt: the state connection gets a fresh
    challenge its recorded answer does not answer, and the replayed data handshake
    is held, unfolded, and dropped once the handshake bound (1 s here) passes. Then
    rank 3, restarted, comes back."""
    scaled = {"FLODL_NET_TIMEOUT_SCALE": "0.1"}  # handshake bound 1 s
    async with windowed_cluster(extra=held((0, 1, 2)), controller_env=scaled) as c:
        with diagnose(c):
            assert c.controller is not None
            await killed_after_window(c, 3, 2)
            recording, recorded = await answered_state_request(c.relay_address(3), 3, 4)
            await recording.aclose()  # the recorded join withdrawn before it went anywhere
            t0 = mono()
            replay = await trio.open_tcp_stream(*c.relay_address(3))
            await replay.send_all(recorded)
            await receive_exactly(replay, STATE_CHALLENGE_LEN)
            with trio.fail_after(10):
                await wait_closed_by_peer(replay)
            refused = (await c.controller.wait_log(re.compile(r"state answer from rank 3 \(a replayed join\?\).*"))).group(0)
            data = await raw_data_rank(c.relay_address(3), 3, 4)
            with trio.fail_after(10):
                await wait_closed_by_peer(data)
            seconds = mono() - t0
            await c.controller.wait_log(re.compile(r"rank 3 may not rejoin: .*sent no verified state request"))
            if (await c.status())["stats"]["rejoins"]:
                raise MatrixFailure("a replayed join was counted as a rejoin")
            start = await back_for_real(c, 3, (0, 1, 2))
    windows_exact(c, WINDOWS, WINDOW_NUMEL, {3: {3}})
    if "MAC mismatch" not in refused:
        raise MatrixFailure(f"the refusal does not say why: {refused}")
    return Outcome(
        f"a challenge and nothing more; the replayed data connection dropped unfolded; rank 3 came back at window "
        f"{start}; every window exact", seconds,
    )
