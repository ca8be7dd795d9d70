"""The fault matrix (flodl_trio.testing.matrix): every case, each under its trio deadline.

Each case builds its own cluster of real processes (controller and relay
daemons, rank workers), injects one fault and asserts that every rank either
gets the correct consensus or raises a clear error - never a hang, never a
wrong or stale value. ``python benchmarks/fault_matrix.py`` runs the same cases
and writes docs/fault-matrix.md.
"""

from __future__ import annotations

import pytest

from flodl_trio.testing.matrix import (
    MATRIX,
    Case,
    MatrixFailure,
    check_round,
    expected,
    run_case,
)
from flodl_trio.testing.rank_worker import contribution

# Slack on top of a case's own trio.fail_after, so that one reports the hang.
HARNESS_SLACK_S = 15.0

# The faults the matrix must cover (docs/fault-matrix.md lists what each does).
REQUIRED = {
    "rank-kill-before-frame", "rank-kill-mid-frame", "rank-kill-after-frame", "rank-freeze-thaw",
    "relay-kill", "uplink-write-stall",
    # a controller that dies comes back and the run goes on; one that never does costs a clear error
    "controller-kill-restart", "controller-kill-restart-lanes", "controller-freeze-kill-restart", "controller-gone",
    "controller-kill-during-join",
    "slowloris-controller", "slowloris-relay-data", "slowloris-relay-control",
    "rank-leg-huge-length", "controller-huge-record-after-hello",
    "rank-leg-flip-payload", "rank-leg-flip-header", "rank-leg-flip-mac",
    "uplink-flip-payload", "uplink-flip-header", "uplink-flip-mac",
    "wrong-salt-data", "wrong-salt-control", "duplicate-rank", "rank-outside-host", "world-size-disagreement",
    "port-scanner", "connect-to-nothing",
    # cases that found product bugs (since fixed) stay as regression guards
    "rank-loop-blocked", "uplink-replay",
    # elastic membership: ranks and hosts that come back, a cluster that forms without one
    "rank-kill-restart", "host-restart", "formation-missing-rank", "rejoin-wrong-salt",
    # the join path under attack: a joiner that never reads its state, a join replayed without the salt
    "join-state-never-read", "join-replayed",
    # the Unix-socket local leg: frames unsigned, the salt proven at the handshake
    "wrong-salt-local-leg",
    # a wrong schema folded first costs its sender, not the ranks folded after it
    "rank-schema-change-first",
    # reduction shards: lost alone, with their host or all of them, frozen, served again by a host
    # brought back, and holding for a controller started again
    "shard-kill-mid-round", "shard-freeze", "shard-host-kill-mid-round", "shard-relay-freeze", "shard-host-restart",
    "shard-controller-restart", "shard-all-killed", "shard-kill-diloco", "shard-kill-int8-deltas",
}


def test_matrix_covers_every_required_fault() -> None:
    names = [case.name for case in MATRIX]
    assert len(names) == len(set(names)), "case names must be unique"
    assert REQUIRED <= set(names), sorted(REQUIRED - set(names))
    for case in MATRIX:
        assert case.fault and case.leg and 0 < case.deadline <= 60, case


def test_expected_consensus_is_independent_and_agrees_with_the_workers() -> None:
    for k in range(5):
        for rank in range(4):
            assert expected([rank], k) == (contribution(rank, k), 1.0)
    assert expected([0, 1, 2], 1) == (4.0, 3.0)  # (2 + 4 + 6) / 3
    good = {"rank": 0, "round": 1, "value": 4.0, "min": 4.0, "max": 4.0, "mass": 3.0}
    check_round(good, [0, 1, 2])
    for bad in ({"value": 3.0, "min": 3.0, "max": 3.0}, {"max": 4.5}, {"mass": 4.0}):
        with pytest.raises(MatrixFailure, match="WRONG OR STALE VALUE"):
            check_round({**good, **bad}, [0, 1, 2])


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, id=case.name, marks=pytest.mark.deadline(case.deadline + HARNESS_SLACK_S)) for case in MATRIX],
)
async def test_fault_matrix(case: Case) -> None:
    record = await run_case(case)
    assert record.name == case.name and record.fault == case.fault and record.leg == case.leg
    assert record.outcome and "\n" not in record.outcome
    assert 0.0 <= record.seconds < case.deadline
