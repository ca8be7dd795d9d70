"""Cases: relay and controller daemon processes killed or frozen mid-round."""

from __future__ import annotations

from typing import Any

from .clusters import HEARTBEAT_TIMEOUT, daemon_cluster, diagnose, pause
from .oracle import after, everyone, expect_consensus, expect_error, last_outcome, mono
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


async def _controller_fault(freeze: bool) -> tuple[list[dict[str, Any]], float]:
    """The controller daemon is killed or frozen while round 1 waits for rank 0: every
    rank must raise within the beacon timeout (frozen: CoordinatorLost, no beacon)."""
    async with daemon_cluster(**FOUR_RANKS, worker_args={0: pause(1)}) as c:
        with diagnose(c):
            await c.wait_event(0, "paused", round=1)
            for rank in (1, 2, 3):
                await c.wait_event(rank, "sending", round=1)
            t0 = mono()
            (c.freeze_controller if freeze else c.kill_controller)()
            expect = NO_BEACON if freeze else {}
            errors = [await expect_error(c, r, before_round=1, contributors=everyone(4), **expect) for r in range(4)]
            seconds = max(e["time"] for e in errors) - t0
            if seconds > HEARTBEAT_TIMEOUT + 1.0:
                raise MatrixFailure(f"ranks took {seconds:.2f} s to raise; the beacon timeout is {HEARTBEAT_TIMEOUT} s")
    return errors, seconds


@case("controller-kill", fault="controller daemon SIGKILLed mid-round", leg="controller process")
async def controller_kill() -> Outcome:
    errors, seconds = await _controller_fault(freeze=False)
    return Outcome(f"every rank raised ({fmt_types(errors)}) within the beacon timeout", seconds)


@case("controller-freeze", fault="controller daemon SIGSTOPped mid-round", leg="controller process")
async def controller_freeze() -> Outcome:
    _errors, seconds = await _controller_fault(freeze=True)
    return Outcome("every rank raised CoordinatorLost (no beacon) within the beacon timeout", seconds)
