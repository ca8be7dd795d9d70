"""What the benchmark scripts print about the machine they ran on, and how they time a call."""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable
from pathlib import Path


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
