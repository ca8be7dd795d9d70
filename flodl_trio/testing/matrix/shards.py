"""Cases: reduction shard daemons (``--shards``) killed or frozen mid-round, alone or
with the host they run beside, all of them (the controller then serves one itself), a
host brought back serving its lost shard again, and the controller killed and started
again while the shards hold; and a shard lost under DiLoCo, whose backup steps its
lanes on from its mirror. A lost shard's lanes go to the next live shard, and
a round that was decided but not yet committed is decided again (docs/wire.md,
"A lost shard"): every rank gets one exact consensus."""

from __future__ import annotations

import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..processes import ProcessCluster
from ..windows import windows_of
from .clusters import daemon_cluster, diagnose, pause
from .oracle import all_done, after, check_rounds, expect_consensus, expected, last_outcome, mono, windows_exact
from .registry import MatrixFailure, Outcome, case

# 1.2 MB frames: 4 lanes of at least 256 KiB, so every round goes through the shards.
SHARDED: dict[str, Any] = {"world_size": 4, "hosts": [[0, 1], [2, 3]], "rounds": 4, "numel": 300_000}
HELD = 2  # every rank holds before this round until the fault is in place


async def _hold_everyone(c: ProcessCluster) -> None:
    for rank in range(4):
        await c.wait_event(rank, "paused", round=HELD)


@asynccontextmanager
async def _held_cluster(shards: int) -> AsyncIterator[ProcessCluster]:
    """The SHARDED cluster on ``shards`` shard daemons, every rank holding before round HELD."""
    async with daemon_cluster(**SHARDED, shards=shards, worker_args={r: pause(HELD) for r in range(4)}) as c:
        with diagnose(c):
            await _hold_everyone(c)
            yield c


async def _let_go(c: ProcessCluster) -> None:
    for rank in range(4):
        await c.resume(rank)


async def _shard_fault(kill: bool) -> Outcome:
    """Shard 1 of 3 stops answering as round HELD begins (SIGSTOP); then it is SIGKILLed,
    or left frozen for the heartbeat timeout to tell."""
    async with _held_cluster(shards=3) as c:
        t0 = mono()
        c.freeze_shard(1)
        await _let_go(c)
        if kill:
            c.kill_shard(1)
        rounds = await expect_consensus(c, range(4), SHARDED["rounds"], lambda _k: range(4))
        assert c.controller is not None  # the run may be over: its log says what was lost
        await c.controller.wait_log("controller: shard 1 lost (")
        if "shard 0 lost" in c.controller.text or "shard 2 lost" in c.controller.text:
            raise MatrixFailure("the controller lost a shard other than shard 1")
        seconds = last_outcome(rounds, HELD) - t0
    how = "its connections closed at once" if kill else "silent past the heartbeat timeout"
    return Outcome(f"shard 1 lost ({how}); its lanes went to shard 2; every rank got every 4-rank consensus", seconds)


@case("shard-kill-mid-round", fault="shard daemon (1 of 3) SIGSTOPped as a round began, then SIGKILLed",
      leg="shard process")
async def shard_kill_mid_round() -> Outcome:
    return await _shard_fault(kill=True)


@case("shard-freeze", fault="shard daemon (1 of 3) SIGSTOPped mid-run and left frozen", leg="shard process")
async def shard_freeze() -> Outcome:
    return await _shard_fault(kill=False)


@case("shard-all-killed", fault="every shard daemon (3 of 3) SIGKILLed as a round began", leg="shard process")
async def shard_all_killed() -> Outcome:
    """No shard left: the controller serves the last one lost itself (docs/wire.md, "When
    every shard is lost"); the round in progress is decided again and every rank gets
    every 4-rank consensus."""
    async with _held_cluster(shards=3) as c:
        t0 = mono()
        for shard in range(3):
            c.kill_shard(shard)
        await _let_go(c)
        rounds = await expect_consensus(c, range(4), SHARDED["rounds"], lambda _k: range(4))
        assert c.controller is not None
        await c.controller.wait_log("the controller serves it itself")
        seconds = last_outcome(rounds, HELD) - t0
    return Outcome("the controller served the last shard lost itself; every rank got every 4-rank consensus", seconds)


@case("shard-host-kill-mid-round",
      fault="a whole host SIGKILLed as a round began: its relay, its ranks and the shard beside it",
      leg="host (relay + shard + ranks)")
async def shard_host_kill_mid_round() -> Outcome:
    """Host 1 dies with some of its pieces on its own shard and some on the others: the
    round is the survivors' alone or everyone's (if host 1 committed in time), the same
    for every survivor, and the rounds after are the survivors'."""
    async with _held_cluster(shards=2) as c:
        t0 = mono()
        await _let_go(c)
        for rank in (2, 3):
            c.kill(rank)
        c.kill_relay(1)
        c.kill_shard(1)
        final = [await c.wait_outcome(rank) for rank in (0, 1)]
        if any(f["event"] != "done" for f in final):
            raise MatrixFailure(f"survivors 0,1 should have finished: {final}")
        held = _contributors_of(next(e for e in c.ranks[0].rounds if e["round"] == HELD))
        contributors = after(HELD + 1, range(4), [0, 1])
        rounds = {r: check_rounds(c, r, lambda k: held if k == HELD else contributors(k)) for r in (0, 1)}
        if any(sorted(seen) != list(range(SHARDED["rounds"])) for seen in rounds.values()):
            raise MatrixFailure(f"survivors reported rounds {[sorted(s) for s in rounds.values()]}")
        seconds = last_outcome(rounds, HELD) - t0
    which = ",".join(map(str, sorted(held)))
    return Outcome(f"round {HELD} was ranks {which}'s (what reached a commit), the same for both survivors; "
                   "later rounds ranks 0,1's, exact", seconds)


def _contributors_of(event: dict[str, Any]) -> set[int]:
    """Which of the sets a dying host leaves possible (the survivors, with none, either or
    both of its ranks) rank 0's consensus of the round is; every survivor is then checked
    against it."""
    for extra in ((), (2,), (3,), (2, 3)):
        group = {0, 1, *extra}
        value, mass = expected(group, event["round"])
        if event["mass"] == mass and abs(event["value"] - value) <= 1e-6 * abs(value):
            return group
    raise MatrixFailure(f"rank 0's round {event['round']} ({event['value']}, mass {event['mass']}) is the consensus "
                        "of no set of ranks that includes both survivors")


@case("shard-relay-freeze", fault="relay daemon SIGSTOPped as a sharded round began", leg="relay process")
async def shard_relay_freeze() -> Outcome:
    """Host 1's relay freezes with its lane 0 in or not and its pieces anywhere between
    nowhere and every shard: its ranks are declared dead after the heartbeat timeout,
    the round is decided (again) without it, and host 0 goes on exactly."""
    async with _held_cluster(shards=2) as c:
        t0 = mono()
        c.freeze_relay(1)
        await _let_go(c)
        final = [await c.wait_outcome(rank) for rank in (0, 1)]
        if any(f["event"] != "done" for f in final):
            raise MatrixFailure(f"host 0's ranks should have finished: {final}")
        rounds = {r: check_rounds(c, r, after(HELD, range(4), [0, 1])) for r in (0, 1)}
        if any(sorted(seen) != list(range(SHARDED["rounds"])) for seen in rounds.values()):
            raise MatrixFailure(f"host 0's ranks reported rounds {[sorted(s) for s in rounds.values()]}")
        seconds = last_outcome(rounds, HELD) - t0
    return Outcome(f"host 1's ranks declared dead after the heartbeat timeout; round {HELD} and later were "
                   "ranks 0,1's, exact", seconds)


HOST_BACK_WINDOWS, HOST_BACK_HOLD = 16, 10


@case("shard-host-restart",
      fault="a host of 3 (its rank, its relay daemon and the shard that relay serves) SIGKILLed, then restarted",
      leg="host (relay + shard + rank)", deadline=60)
async def shard_host_restart() -> Outcome:
    """Default daemons: every relay serves a shard (``--shard auto``), so host 2 is shard 2.
    It dies whole: shard 2 is lost, its lanes go to shard 0. Brought back (relay daemon,
    then its rank, which rejoins), its relay offers a new shard, which the controller
    sets up as shard 2 between two rounds; every relay sends it shard 2's lanes from
    its next round. The survivors hold before window HOLD until the rank asked back in,
    and before HOLD + 2 until it has its state (with shards, a window that ended after
    it asked)."""
    holds = ["--pause-before", f"{HOST_BACK_HOLD}:inf", "--pause-before", f"{HOST_BACK_HOLD + 2}:inf"]
    args = {r: ["--windows", str(HOST_BACK_WINDOWS), *(holds if r < 2 else [])] for r in range(3)}
    async with daemon_cluster(world_size=3, hosts=[[0], [1], [2]], backend="torch", numel=SHARDED["numel"],
                              pause=0.3, heartbeat_timeout=10.0, worker_args=args) as c:
        with diagnose(c):
            assert c.controller is not None
            await c.controller.wait_log("reducing with the 3 shards the relays offered")
            await c.wait_event(2, "window", window=3)
            t0 = mono()
            c.kill(2)
            c.kill_relay(2)
            await c.wait_exit(2)
            await c.controller.wait_log("controller: shard 2 lost (")
            await c.restart_relay(2)
            await c.restart(2)
            await c.wait_returns_joining([2])
            for rank in (0, 1):
                await c.resume(rank)
            await c.wait_returns_primed([2])
            for rank in (0, 1):
                await c.resume(rank)
            start = (await c.wait_event(2, "joined"))["start"]
            first = await c.wait_event(2, "window", window=start)
            await all_done(c)
            await c.controller.wait_log("controller: shard 2 is served again, at ")
            for relay in c.relay_processes(2):  # the run over, it exits with its new shard's count
                with trio.fail_after(20):
                    await relay.wait()
            summed = [int(m) for relay in c.relay_processes(2)
                      for m in re.findall(r"shard finished: (\d+) rounds", relay.text)]
            if not summed or summed[0] == 0:
                raise MatrixFailure(f"host 2's new shard summed no lanes ({summed})")
    windows_exact(c, HOST_BACK_WINDOWS, SHARDED["numel"], {4: {2}})
    return Outcome(f"shard 2 lost with its host; back at window {start}, its relay's new shard served shard 2 again "
                   f"({summed[0]} rounds); every window exact; all 3 end bit-identical", first["time"] - t0)


CTL_RESTART_WINDOWS, CTL_RESTART_HOLD = 8, 4


@case("shard-controller-restart",
      fault="controller daemon (default --shards auto, --checkpoint-dir) SIGKILLed while a host's round is up, "
      "started again with the same command", leg="controller process", deadline=60)
async def shard_controller_restart() -> Outcome:
    """Default daemons on 3 hosts: the controller takes the relays' shards. It is
    SIGKILLed while host 2's rank holds before window CTL_RESTART_HOLD and the others'
    round is up; the shards hold their relays, pieces and outer state, and the controller
    started again takes them on from its record (docs/wire.md, "Shards through a lost
    controller")."""
    held = ["--pause-before", f"{CTL_RESTART_HOLD}:inf"]
    args = {r: ["--windows", str(CTL_RESTART_WINDOWS), *(held if r == 2 else [])] for r in range(3)}
    with tempfile.TemporaryDirectory(prefix="flodl-matrix-") as tmp:
        async with daemon_cluster(world_size=3, hosts=[[0], [1], [2]], backend="torch", numel=SHARDED["numel"],
                                  pause=0.05, heartbeat_timeout=10.0, worker_args=args,
                                  controller_args=["--checkpoint-dir", tmp]) as c:
            with diagnose(c):
                assert c.controller is not None
                await c.controller.wait_log("reducing with the 3 shards the relays offered")
                await c.wait_event(2, "paused", round=CTL_RESTART_HOLD)
                t0 = mono()
                c.kill_controller()
                await c.controller.wait()
                await c.restart_controller()
                await c.resume(2)
                first = await c.wait_event(0, "window", window=CTL_RESTART_HOLD)
                await all_done(c)
                if "resuming with the record's 3 shards" not in c.controller.text:
                    raise MatrixFailure("the restarted controller did not take the record's shards on")
                taken = sum("a controller took it on again" in relay.text for h in range(3)
                            for relay in c.relay_processes(h))
                if taken != 3:
                    raise MatrixFailure(f"{taken} of the 3 shards were taken on again by the new controller")
    contributors = windows_exact(c, CTL_RESTART_WINDOWS, SHARDED["numel"], {})
    if any(contributors[w] != {0, 1, 2} for w in range(CTL_RESTART_WINDOWS)):
        raise MatrixFailure(f"a window lost a contributor over the restart: {contributors}")
    return Outcome("the shards held for the controller, which took all 3 on again from its record; every window "
                   "exact over all 3 ranks, all end bit-identical, nothing else restarted", first["time"] - t0)


DILOCO_WINDOWS, DILOCO_HOLD = 8, 4


async def _diloco_digests(lose_shard: bool, codec: str | None = None) -> tuple[dict[int, list[str]], float, str]:
    """Three shard daemons under DiLoCo, deterministic; rank 2 holds before window
    DILOCO_HOLD while the others' round goes up, and (``lose_shard``) shard 1 is SIGKILLed
    then. ``codec``: the params rounds as coded deltas (on a model four times as large:
    the same lanes), through eight shard daemons (int8 goes through them from eight on).
    Each rank's window digests, the seconds from the kill to rank 0's held window, and
    the shards' logs."""
    held = ["--pause-before", f"{DILOCO_HOLD}:inf"]
    coded = ["--codec", codec] if codec else []
    args = {r: ["--windows", str(DILOCO_WINDOWS), *coded, *(held if r == 2 else [])] for r in range(3)}
    numel = SHARDED["numel"] * (4 if codec else 1)
    async with daemon_cluster(world_size=3, hosts=[[0], [1], [2]], backend="torch", numel=numel,
                              pause=0.05, shards=8 if codec else 3, worker_args=args,
                              relay_args={h: ["--deterministic"] for h in range(3)},
                              controller_args=["--outer", "diloco", "--deterministic"]) as c:
        with diagnose(c):
            assert c.controller is not None
            await c.wait_event(2, "paused", round=DILOCO_HOLD)
            t0 = mono()
            if lose_shard:
                c.kill_shard(1)
                await c.controller.wait_log("controller: shard 1 lost (")
            await c.resume(2)
            first = await c.wait_event(0, "window", window=DILOCO_HOLD)
            await all_done(c)
    digests = {rank: [windows_of(c, rank)[w]["digest"] for w in range(DILOCO_WINDOWS)] for rank in range(3)}
    return digests, first["time"] - t0, "".join(shard.text for shard in c.shards)


@case("shard-kill-diloco",
      fault="shard daemon (1 of 3) SIGKILLed while a DiLoCo round is up (deterministic); the same run unfaulted",
      leg="shard process", deadline=60)
async def shard_kill_diloco() -> Outcome:
    """The outer state through a lost shard (docs/wire.md): shard 2, shard 1's backup,
    mirrored the state of shard 1's lanes and steps them on, so every window's params are
    bit-identical to the run with no shard lost."""
    seconds = await _lost_shard_changes_nothing(None, "goes on from its mirrored outer state",
                                                "no shard took shard 1's lanes over from its mirror")
    return Outcome(f"shard 2 stepped shard 1's lanes on from its mirror; all {DILOCO_WINDOWS} windows bit-identical "
                   "to the unfaulted run for every rank", seconds)


async def _lost_shard_changes_nothing(codec: str | None, logged: str, unlogged: str) -> float:
    """The DiLoCo run with shard 1 lost ends as the one without (MatrixFailure if not, or
    if no shard logged ``logged``: then ``unlogged`` says why); the seconds it took."""
    reference, _, _ = await _diloco_digests(lose_shard=False, codec=codec)
    lost, seconds, logs = await _diloco_digests(lose_shard=True, codec=codec)
    if lost != reference:
        raise MatrixFailure(f"the windows differ from the unfaulted run's: {lost} vs {reference}")
    if logged not in logs:
        raise MatrixFailure(unlogged)
    return seconds


@case("shard-kill-int8-deltas",
      fault="shard daemon (1 of 8) SIGKILLed while a round of int8 deltas under DiLoCo is up (deterministic); "
            "the same run unfaulted",
      leg="shard process", deadline=60)
async def shard_kill_int8_deltas() -> Outcome:
    """Delta rounds through the shards (docs/wire.md): the shards sum the coded pieces, the
    controller steps the means; shard 1's lanes go to shard 2, and every window's params
    are bit-identical to the run with no shard lost."""
    seconds = await _lost_shard_changes_nothing("int8:256", "sums delta rounds", "no shard summed a delta round")
    return Outcome(f"the shards summed the int8 deltas; all {DILOCO_WINDOWS} windows bit-identical to the "
                   "unfaulted run for every rank after shard 1 was lost", seconds)
