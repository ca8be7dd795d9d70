"""The oracle: the right answer for every round, computed without the library.

Rank r contributes ``(r + 1) * (k + 1)`` with mass 1 in round k, so the
consensus of a set S is the plain mean over S with mass ``len(S)``: a stale
round never passes for a later one. Each rank must reach one of two outcomes:

(a) the correct consensus for every round it reports, then ``done``
    (:func:`expect_consensus`);
(b) a clear :class:`~flodl_trio.FlodlError`, by type and message fragment, with
    every round before it correct and none after (:func:`expect_error`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Sequence

import trio

from ..processes import ChildProcess, Event, ProcessCluster
from ..proxy import DuplicateRecord, FaultProxy
from ..windows import WindowMismatch, check_final_and_joins, check_windows
from .registry import MatrixFailure

# Which ranks contributed to round k.
Contributors = Callable[[int], Iterable[int]]

DEATH_TYPES = ("RankDeadError", "CoordinatorLost")
LOST = ("closed the connection", "connection failed", "declared dead", "no beacon")


def mono() -> float:
    """``time.monotonic()``: one clock for every process of the machine (the workers' ``time``)."""
    return time.monotonic()


def trio_to_mono(t: float) -> float:
    """A trio clock reading (FaultEvent.time) on the ``time.monotonic()`` clock."""
    return t + (time.monotonic() - trio.current_time())


def expected(contributors: Iterable[int], round_index: int) -> tuple[float, float]:
    """The consensus value and mass of a round, computed from scratch (not via the library)."""
    values = [float((r + 1) * (round_index + 1)) for r in contributors]
    assert values, "a round with no contributors has no consensus"
    return math.fsum(values) / len(values), float(len(values))


def everyone(world: int) -> Callable[[int], set[int]]:
    return lambda _k: set(range(world))


def after(round_index: int, before: Iterable[int], later: Iterable[int]) -> Callable[[int], set[int]]:
    """Contributors: ``before`` for rounds < ``round_index``, ``later`` from it on."""
    first, second = set(before), set(later)
    return lambda k: first if k < round_index else second


# ---------------------------------------------------------------------------
# Rounds
# ---------------------------------------------------------------------------


def check_round(event: Event, contributors: Iterable[int]) -> None:
    """One ``round`` event against the consensus of ``contributors``."""
    group = sorted(contributors)
    want, mass = expected(group, event["round"])
    got = (event["value"], event["min"], event["max"])
    if not (all(math.isclose(v, want, rel_tol=1e-6) for v in got) and event["mass"] == mass):
        raise MatrixFailure(
            f"WRONG OR STALE VALUE: rank {event['rank']} round {event['round']} got value {event['value']} "
            f"(min {event['min']}, max {event['max']}) mass {event['mass']}; the consensus of ranks {group} "
            f"is {want} with mass {mass}"
        )


def check_rounds(cluster: ProcessCluster, rank: int, contributors: Contributors, upto: int | None = None) -> dict[int, Event]:
    """Every round a rank reported is correct, each reported once (and, with ``upto``, none at or past it)."""
    rounds: dict[int, Event] = {}
    for event in cluster.ranks[rank].rounds:
        k = event["round"]
        if k in rounds:
            raise MatrixFailure(f"rank {rank} reported round {k} twice")
        if upto is not None and k >= upto:
            raise MatrixFailure(f"rank {rank} returned round {k} ({event['value']}) although it should have raised before it")
        check_round(event, contributors(k))
        rounds[k] = event
    return rounds


async def expect_consensus(
    cluster: ProcessCluster, ranks: Iterable[int], rounds: int, contributors: Contributors
) -> dict[int, dict[int, Event]]:
    """Outcome (a) for each of ``ranks``: every round correct, then ``done``."""
    out: dict[int, dict[int, Event]] = {}
    for rank in ranks:
        final = await cluster.wait_outcome(rank)
        seen = check_rounds(cluster, rank, contributors)
        if final["event"] != "done":
            raise MatrixFailure(f"rank {rank} should have completed every round, but: {final}")
        if sorted(seen) != list(range(rounds)):
            raise MatrixFailure(f"rank {rank} finished with rounds {sorted(seen)}, want 0..{rounds - 1}")
        out[rank] = seen
    return out


def last_outcome(rounds: dict[int, dict[int, Event]], round_index: int, *also: float) -> float:
    """When the last of the ranks in ``rounds`` (from :func:`expect_consensus`) got round
    ``round_index``, or the latest of ``also`` (another rank's error, a refusal) if later."""
    return max([seen[round_index]["time"] for seen in rounds.values()] + list(also))


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def check_error(event: Event, types: Sequence[str], fragments: Sequence[str]) -> None:
    if event["event"] != "error":
        raise MatrixFailure(f"rank {event.get('rank')} should have raised one of {list(types)}, but: {event}")
    if event["type"] not in types or not any(f in event["message"] for f in fragments):
        raise MatrixFailure(
            f"rank {event.get('rank')} raised {event['type']}: {event['message']!r}; want one of {list(types)} "
            f"naming one of {list(fragments)}"
        )


async def expect_error(
    cluster: ProcessCluster, rank: int, *, before_round: int, contributors: Contributors,
    types: Sequence[str] = DEATH_TYPES, fragments: Sequence[str] = LOST,
) -> Event:
    """Outcome (b) for ``rank``: a clear error, no round at or after ``before_round``, earlier rounds correct."""
    final = await cluster.wait_outcome(rank)
    check_rounds(cluster, rank, contributors, upto=before_round)
    check_error(final, types, fragments)
    return final


def killed(cluster: ProcessCluster, rank: int, *, before_round: int, contributors: Contributors) -> None:
    """A SIGKILLed rank: no result at or after ``before_round``; what it got before was right."""
    check_rounds(cluster, rank, contributors, upto=before_round)


async def expect_replay_costs_its_sender(
    c: ProcessCluster, proxy: FaultProxy, drop_log: ChildProcess, drop_line: re.Pattern[str], *,
    sender: int, survivors: Sequence[int],
) -> tuple[Event, float]:
    """A record delivered twice by ``proxy`` while rank 0 holds round 0 open (``--pause-before 0``):
    once ``drop_log`` names the drop, rank 0 is let go. Round 0 keeps the sender's first frame
    (folded before its copy arrived: realized work), round 1 is the survivors' alone, and rank
    ``sender`` raises. Returns its error and the seconds from the replay to the last outcome."""
    events = await proxy.wait_fired(DuplicateRecord)
    t0 = trio_to_mono(events[0].time)
    await drop_log.wait_log(drop_line)
    await c.resume(0)
    first, later = {*survivors, sender}, set(survivors)
    rounds = await expect_consensus(c, survivors, 2, after(1, first, later))
    error = await expect_error(c, sender, before_round=0, contributors=lambda _k: first)
    return error, last_outcome(rounds, 1, error["time"]) - t0


# ---------------------------------------------------------------------------
# Local SGD windows (rank_worker --windows)
# ---------------------------------------------------------------------------


async def all_done(c: ProcessCluster) -> None:
    for rank in range(c.world_size):
        outcome = await c.wait_outcome(rank)
        if outcome["event"] != "done":
            raise MatrixFailure(f"rank {rank} did not finish: {outcome}")


def windows_exact(c: ProcessCluster, windows: int, numel: int, maybe_in: dict[int, set[int]]) -> dict[int, set[int]]:
    """Every window's consensus is the exact mean of the ranks that were in it (see :mod:`..windows`)."""
    try:
        contributors = check_windows(c, windows, numel, maybe_in)
        check_final_and_joins(c, windows, contributors)
    except WindowMismatch as exc:
        raise MatrixFailure(f"WRONG OR STALE VALUE: {exc}") from exc
    return contributors


__all__ = [
    "DEATH_TYPES",
    "LOST",
    "Contributors",
    "after",
    "all_done",
    "check_error",
    "check_round",
    "check_rounds",
    "everyone",
    "expect_consensus",
    "expect_error",
    "expect_replay_costs_its_sender",
    "expected",
    "killed",
    "last_outcome",
    "mono",
    "trio_to_mono",
    "windows_exact",
]
