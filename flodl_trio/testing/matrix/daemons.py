"""Cases: relay and controller daemon processes killed or frozen mid-round (the
controller also started again: the run resumes from its record)."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..processes import ProcessCluster
from .clusters import daemon_cluster, diagnose, pause
from .oracle import after, all_done, expect_consensus, expect_error, last_outcome, mono, windows_exact
from .registry import MatrixFailure, Outcome, case, fmt_types

FOUR_RANKS: dict[str, Any] = {"world_size": 4, "hosts": [[0, 1], [2, 3]], "rounds": 3}
# What a rank whose daemon froze must raise: only the missing beacons can tell it.
NO_BEACON: dict[str, Any] = {"types": ("CoordinatorLost",), "fragments": ("no beacon",)}


async def _relay_fault(freeze: bool) -> Outcome:
    """Host 1's relay daemon is killed or frozen while its ranks wait in round 1."""
    async with daemon_cluster(**FOUR_RANKS, worker_args={2: pause(1), 3: pause(1)}) as c:
        with diagnose(c):
            await c.wait_event(2, "paused", round=1)
            await c.wait_event(3, "paused", round=1)
            t0 = mono()
            (c.freeze_relay if freeze else c.kill_relay)(1)
            who = after(1, range(4), [0, 1])
            rounds = await expect_consensus(c, [0, 1], 3, who)
            expect = NO_BEACON if freeze else {}  # killed: the sockets close at once
            errors = [await expect_error(c, r, before_round=1, contributors=who, **expect) for r in (2, 3)]
            seconds = last_outcome(rounds, 1, *(e["time"] for e in errors)) - t0
    if freeze:
        return Outcome("its ranks declared dead after the heartbeat timeout, host 0 went on; ranks 2,3 raised CoordinatorLost (no beacon)", seconds)
    return Outcome(f"host 0 went on with the 2-rank consensus; ranks 2,3 raised {errors[0]['type']}", seconds)


@case("relay-kill", fault="relay daemon SIGKILLed", leg="relay process")
async def relay_kill() -> Outcome:
    return await _relay_fault(freeze=False)


@case("relay-freeze", fault="relay daemon SIGSTOPped", leg="relay process")
async def relay_freeze() -> Outcome:
    return await _relay_fault(freeze=True)


# The controller rows: relays and ranks hold through its outage (FLODL_CONTROLLER_OUTAGE)
# and the controller keeps its resume record in its --checkpoint-dir.
RESTART_WINDOWS = 10
RESTART_NUMEL = 256
RESTART_HOLD = 5  # host 1's ranks hold before this window while the controller is down


@asynccontextmanager
async def held_run(outage: float, *controller_args: str, numel: int = RESTART_NUMEL) -> AsyncIterator[ProcessCluster]:
    """Local SGD trainers on 2 hosts x 2 ranks, every process holding ``outage`` seconds
    for a lost controller; host 1's ranks wait before window RESTART_HOLD until resumed,
    and the block opens once host 0's HostFrame of that window's first round is in."""
    env = {"FLODL_CONTROLLER_OUTAGE": f"{outage:g}"}
    held = ["--pause-before", f"{RESTART_HOLD}:inf"]
    with tempfile.TemporaryDirectory(prefix="flodl-matrix-") as tmp:
        async with daemon_cluster(
            world_size=4, hosts=[[0, 1], [2, 3]], backend="torch", numel=numel, pause=0.05,
            heartbeat_timeout=10.0, controller_args=["--checkpoint-dir", tmp, *controller_args],
            worker_args={r: ["--windows", str(RESTART_WINDOWS), *(held if r >= 2 else [])] for r in range(4)},
            worker_env={r: env for r in range(4)}, relay_env={h: env for h in range(2)},
        ) as c:
            with diagnose(c):
                for rank in (2, 3):
                    await c.wait_event(rank, "paused", round=RESTART_HOLD)
                while not any(r["host"] == "host0" and r["delivered"] for r in (await c.status())["relays"]):
                    await trio.sleep(0.02)
                yield c


async def _resumed_after(c: ProcessCluster, t0: float, numel: int = RESTART_NUMEL) -> float:
    """Host 1 goes on; every rank finishes every window, each exact; the seconds from
    ``t0`` to the first window finished after the restart."""
    for rank in (2, 3):
        await c.resume(rank)
    first = await c.wait_event(0, "window", window=RESTART_HOLD)
    await all_done(c)
    if "resuming the run from" not in c.controller.text:  # type: ignore[union-attr]
        raise MatrixFailure("the restarted controller did not take the run on from its record")
    contributors = windows_exact(c, RESTART_WINDOWS, numel, {})
    if any(contributors[w] != set(range(4)) for w in range(RESTART_WINDOWS)):
        raise MatrixFailure(f"a window lost a contributor over the restart: {contributors}")
    return first["time"] - t0


@case("controller-kill-restart", fault="controller daemon SIGKILLed mid-round, started again with the same command",
      leg="controller process", deadline=60)
async def controller_kill_restart() -> Outcome:
    async with held_run(60) as c:
        t0 = mono()
        c.kill_controller()
        await c.controller.wait()  # type: ignore[union-attr]
        await c.restart_controller()
        seconds = await _resumed_after(c, t0)
    return Outcome(
        f"relays and ranks held; the new controller resumed from its record and ran window {RESTART_HOLD}'s round "
        "again; every window exact over all 4 ranks, all end bit-identical, nothing else restarted", seconds,
    )


# Four lanes of the default 256 KiB each: a model of 1 MiB of f32.
LANES_NUMEL = 4 * (256 << 10) // 4


@case("controller-kill-restart-lanes", fault="controller daemon (--lanes 4, a 1 MiB model) SIGKILLed mid-round, "
      "started again with the same command", leg="controller process", deadline=60)
async def controller_kill_restart_lanes() -> Outcome:
    async with held_run(60, "--lanes", "4", numel=LANES_NUMEL) as c:
        t0 = mono()
        c.kill_controller()
        await c.controller.wait()  # type: ignore[union-attr]
        await c.restart_controller()
        seconds = await _resumed_after(c, t0, LANES_NUMEL)
    if "in 4 lanes" not in c.relays[0][0].text:
        raise MatrixFailure("the relays did not take the controller's 4 lanes")
    return Outcome(
        "relays (given no lane count) took the controller's 4 lanes, held, and sent every lane of their HostFrame "
        "again; every window exact over all 4 ranks, all end bit-identical", seconds,
    )


@case("controller-freeze-kill-restart", fault="controller daemon SIGSTOPped past the beacon timeout, then SIGKILLed "
      "and started again", leg="controller process", deadline=60)
async def controller_freeze_kill_restart() -> Outcome:
    async with held_run(60, "--heartbeat-timeout", "2") as c:
        t0 = mono()
        c.freeze_controller()
        for rank in range(4):
            await c.ranks[rank].wait_log("holding up to")  # past the beacon timeout: they wait on
        c.kill_controller()
        await c.controller.wait()  # type: ignore[union-attr]
        await c.restart_controller()
        seconds = await _resumed_after(c, t0)
    return Outcome(
        "ranks held past their beacon timeout; the new controller resumed from its record; every window exact over "
        "all 4 ranks, all end bit-identical", seconds,
    )


@case("controller-gone", fault="controller daemon SIGKILLed mid-round and never started again (outage bound 2 s)",
      leg="controller process")
async def controller_gone() -> Outcome:
    async with held_run(2) as c:
        t0 = mono()
        c.kill_controller()
        for rank in (2, 3):
            await c.resume(rank)
        errors = []
        for rank in range(4):
            outcome = await c.wait_outcome(rank)
            if outcome["event"] != "error" or outcome["type"] not in ("CoordinatorLost", "RankDeadError"):
                raise MatrixFailure(f"rank {rank} did not raise a clear error: {outcome}")
            errors.append(outcome)
        seconds = max(e["time"] for e in errors) - t0
        for host in c.relays:
            for relay in host:
                await relay.wait_log("did not come back within the controller outage bound of 2 s")
    return Outcome(f"relays gave up at the 2 s outage bound; every rank raised ({fmt_types(errors)})", seconds)

