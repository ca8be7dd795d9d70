"""The fault matrix: one fault per case, one of two outcomes, never a hang.

Each case builds its own cluster (real daemon processes and rank processes
unless the case needs no cluster), injects exactly one fault and asserts one
of two outcomes for every rank:

(a) it receives the correct realized-work consensus for every round, checked
    against an independent computation (rank r contributes ``(r + 1) * (k + 1)``
    with mass 1 in round k, so the consensus of a set S is the plain mean over
    S with mass ``len(S)``), and finishes; or
(b) it raises a clear :class:`~flodl_trio.FlodlError`, checked by type and a
    message fragment (plus the daemon log line that names the fault).

A wrong or stale value is a failure whatever else happens, and every case runs
under ``trio.fail_after``. A case returns a :class:`CaseRecord`: the fault, the
leg it was injected on, the outcome in one line, and the time from injection
to that outcome (seconds, on ``time.monotonic()``, which is one clock for every
process of the machine).

Run one case with ``await run_case(case)``; ``MATRIX`` lists them all;
``benchmarks/fault_matrix.py`` runs the lot and writes docs/fault-matrix.md.

The package:

- :mod:`.registry`: ``case``, ``MATRIX``, ``Case``, ``run_case``, ``Outcome``;
- :mod:`.oracle`: the expected consensus and the checks of outcomes (a) and (b);
- :mod:`.offsets`: every byte offset a fault aims at, derived from the wire package;
- :mod:`.hostile`: raw peers - attackers, scanners, slow-loris clients;
- :mod:`.clusters`: the clusters the cases start, and how they watch them;
- the cases, by the leg they break, in the order of docs/fault-matrix.md:
  :mod:`.ranks`, :mod:`.daemons`, :mod:`.rank_leg`, :mod:`.control_channel`,
  :mod:`.uplink`, :mod:`.listeners`, :mod:`.refusals`, :mod:`.blast_radius`,
  :mod:`.membership`, :mod:`.shards`.
"""

from __future__ import annotations

# Importing a case module registers its cases: this order is MATRIX's order (and the
# order of docs/fault-matrix.md's rows), so keep it out of import sorting.
# isort: off
from . import ranks, daemons, rank_leg, control_channel, uplink  # noqa: F401
from . import listeners, refusals, blast_radius, membership, shards  # noqa: F401
# isort: on
from .clusters import diagnose
from .offsets import frame_len, rank_frame_start, uplink_first_record
from .oracle import check_round, expected, trio_to_mono
from .registry import MATRIX, Case, CaseRecord, MatrixFailure, Outcome, case, case_by_name, run_case

__all__ = [
    "MATRIX",
    "Case",
    "CaseRecord",
    "MatrixFailure",
    "Outcome",
    "case",
    "case_by_name",
    "check_round",
    "diagnose",
    "expected",
    "frame_len",
    "rank_frame_start",
    "run_case",
    "trio_to_mono",
    "uplink_first_record",
]
