"""The case registry: what a case is, how it is registered and run, what it returns.

A case is an async function that injects one fault and returns an
:class:`Outcome` (one line, plus the seconds from injection to outcome); the
:func:`case` decorator adds it to :data:`MATRIX` with the fault and the leg it
hits, which the benchmark prints as they are. :func:`run_case` runs one under
its deadline, so a hang is a failure like any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import attrs
import trio

CaseFunc = Callable[[], Awaitable["Outcome"]]


class MatrixFailure(AssertionError):
    """A case saw an outcome outside (a) and (b): a wrong value, a wrong error, a missing refusal."""


@attrs.frozen
class CaseRecord:
    """One case's result, as docs/fault-matrix.md prints it."""

    name: str
    fault: str
    leg: str
    outcome: str
    seconds: float


@attrs.frozen
class Outcome:
    """What a case function returns: the outcome in one line, and the time from injection to it."""

    text: str
    seconds: float


@attrs.frozen
class Case:
    """A registered case: its name, the fault, the leg it hits, and its deadline (seconds)."""

    name: str
    fault: str
    leg: str
    func: CaseFunc
    deadline: float

    def __repr__(self) -> str:
        return f"Case({self.name})"


MATRIX: list[Case] = []


def case(name: str, *, fault: str, leg: str, deadline: float = 40.0) -> Callable[[CaseFunc], CaseFunc]:
    """Register the decorated function in :data:`MATRIX` (in the order the modules define them)."""

    def register(func: CaseFunc) -> CaseFunc:
        MATRIX.append(Case(name, fault, leg, func, deadline))
        return func

    return register


async def run_case(entry: Case) -> CaseRecord:
    """Run one case under its deadline; a hang raises ``trio.TooSlowError``."""
    with trio.fail_after(entry.deadline):
        outcome = await entry.func()
    return CaseRecord(entry.name, entry.fault, entry.leg, outcome.text, outcome.seconds)


def case_by_name(name: str) -> Case:
    return next(c for c in MATRIX if c.name == name)


# ---------------------------------------------------------------------------
# Outcome text
# ---------------------------------------------------------------------------


def fmt_ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def fmt_types(errors: Sequence[dict[str, Any]]) -> str:
    """The error types that ``error`` events name, e.g. ``CoordinatorLost/RankDeadError``."""
    return "/".join(sorted({e["type"] for e in errors}))


def short(message: str, limit: int = 70) -> str:
    """A message on one line, cut to ``limit`` characters (an outcome is one table cell)."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


__all__ = [
    "MATRIX",
    "Case",
    "CaseFunc",
    "CaseRecord",
    "MatrixFailure",
    "Outcome",
    "case",
    "case_by_name",
    "fmt_ranks",
    "fmt_types",
    "run_case",
    "short",
]
