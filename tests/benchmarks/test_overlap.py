"""The loss half of benchmarks/overlap.py: which demo runs it makes and what it checks.

The demo runs themselves are replaced by a table of losses, so these tests
check the bookkeeping (each distinct schedule trained once, the staleness
sweep, the 2% checks at each link rate's measured staleness), not the model.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_overlap():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(_BENCH))  # overlap.py imports allreduce.py from its own folder
    try:
        spec = importlib.util.spec_from_file_location("overlap_bench", _BENCH / "overlap.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(_BENCH))


overlap = _load_overlap()


def _throughput(late: dict[str, int]) -> dict[str, dict[str, dict[str, float | None]]]:
    """What the throughput half hands on: per rate, the steps (d) and (e) merged after."""
    systems = ("none", "gloo", "flodl sync")
    return {
        rate: {
            **{s: {"steps_per_s": 1.0 if rate == "1gbit" else 0.5, "late_steps": None} for s in systems},
            "flodl overlap": {"steps_per_s": 1.0, "late_steps": float(d)},
            "flodl fragments": {"steps_per_s": 1.0, "late_steps": 3.0},
        }
        for rate, d in late.items()
    }


def _fake_demo(losses: dict[int | None, float], calls: list[tuple[str, ...]]):  # type: ignore[no-untyped-def]
    """A demo whose DiLoCo loss depends only on the merge point (None: synchronous)."""

    def demo_loss(args: argparse.Namespace, options: list[str], seed: int) -> tuple[float, int | None]:
        calls.append(tuple(options))
        after = int(options[options.index("--merge-after") + 1]) if "--merge-after" in options else None
        return losses.get(after, 1.0) + seed * 1e-4, after

    return demo_loss


def _args(staleness: str) -> argparse.Namespace:
    return argparse.Namespace(convergence_windows=40, sync_every=20, seeds=2, staleness=staleness)


async def test_every_distinct_schedule_trains_once_and_the_sweep_reuses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(overlap, "demo_loss", _fake_demo({None: 1.0, 4: 1.01, 9: 1.01}, calls))
    text, _ = overlap.convergence(_args("4,9,14"), _throughput({"1gbit": 4, "200mbit": 9}))
    assert len(calls) == 2 * len(set(calls))  # 2 seeds of each distinct option list, nothing twice
    # (d) at 1 Gbit/s and the sweep's 4 are the same options: trained once.
    assert calls.count(("--overlap", "1", "--merge-after", "4")) == 2
    assert ("--overlap", "1", "--merge-after", "14") in calls
    sweep = text.split("| DiLoCo, whole model, merged after", 1)[1]
    assert [row.split("|")[1].strip() for row in sweep.splitlines()[2:]] == ["4", "9", "14"]


async def test_the_loss_checks_use_each_rates_measured_staleness(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(overlap, "demo_loss", _fake_demo({None: 1.0, 4: 1.015, 15: 1.13}, calls))
    _, checks = overlap.convergence(_args(""), _throughput({"1gbit": 4, "200mbit": 15}))
    by_rate = {c.split(" at ")[1].split("'s")[0]: c for c in checks if c.split(": ", 1)[1].startswith("(d)")}
    assert by_rate["1gbit"].startswith("PASS") and "1.015x" in by_rate["1gbit"]
    assert by_rate["200mbit"].startswith("FAIL") and "1.130x" in by_rate["200mbit"]
    assert not any("merged after" in c and c.startswith("FAIL") and "(e)" in c for c in checks)


async def test_a_merge_point_outside_the_window_is_refused() -> None:
    with pytest.raises(SystemExit, match="1..20"):
        overlap._staleness_sweep(_args("5,21"))
    assert overlap._staleness_sweep(_args("")) == []
