"""The clusters the cases start, and how a case watches them.

Every case uses the same salt, numpy workers and a short heartbeat timeout
(:func:`daemon_cluster`), holds ranks with ``--pause-before`` (:func:`pause`)
rather than sleeping, and attaches every process's log to a failure
(:func:`diagnose`). A daemon hit by a huge length is capped and measured
(:func:`cap_address_space`, :func:`check_memory_growth`).
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

import trio

from ...wire.salt import SessionSalt
from ..processes import ChildProcess, ProcessCluster, open_process_cluster
from .registry import MatrixFailure

SALT = SessionSalt(b"\x42" * 16)
OTHER_SALT = SessionSalt(b"\x24" * 16)
SIGNATURE = b"\x11" * 32  # rank_worker's default model signature
HEARTBEAT_TIMEOUT = 1.5  # heartbeat (and so beacon) timeout of the clusters that need one
SCALE = "0.1"  # FLODL_NET_TIMEOUT_SCALE where a socket bound is the point
BIG_NUMEL = 4_000_000  # 16 MB frames where size is the point
MiB = 1 << 20
# A daemon hit by a huge length must not grow by more than this.
MEMORY_SLACK = 64 * MiB


def daemon_cluster(**options: Any) -> AbstractAsyncContextManager[ProcessCluster]:
    """open_process_cluster with daemons, numpy workers and the matrix salt."""
    options.setdefault("heartbeat_timeout", HEARTBEAT_TIMEOUT)
    options.setdefault("backend", "numpy")
    return open_process_cluster(salt=SALT, daemons=True, **options)


def pause(round_index: int, seconds: float = 60.0) -> list[str]:
    """rank_worker flags: hold before round ``round_index`` until resumed (or ``seconds``)."""
    return ["--pause-before", f"{round_index}:{seconds:g}"]


@contextmanager
def diagnose(cluster: ProcessCluster) -> Iterator[None]:
    """Attach every process's log to a failure."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(cluster.logs())
        raise


async def wait_until(predicate: Callable[[], bool], poll: float = 0.01) -> None:
    while not predicate():
        await trio.sleep(poll)


async def formed(c: ProcessCluster) -> None:
    """Every relay channel of every host has joined the controller (ranks connect before that)."""
    for index, host_relays in enumerate(c.relays):
        want = 2 if c.control_ports[index] is not None else 1
        await wait_until(lambda: sum(p.text.count("joined controller") for p in host_relays) >= want, 0.02)


# ---------------------------------------------------------------------------
# Memory of a daemon under a huge length
# ---------------------------------------------------------------------------


def cap_address_space(proc: ChildProcess, headroom: int = 256 * MiB) -> int:
    """Limit a daemon's address space to its current size + ``headroom``: a large
    allocation then fails loudly (MemoryError) instead of passing unnoticed."""
    mem = proc.memory()
    assert mem is not None, f"{proc.name} is not running"
    cap = mem["VmSize"] + headroom
    resource.prlimit(proc.pid, resource.RLIMIT_AS, (cap, cap))
    return cap


def memory_growth(before: dict[str, int] | None, after: dict[str, int] | None) -> tuple[int, int]:
    assert before is not None and after is not None
    return after["VmPeak"] - before["VmPeak"], after["VmHWM"] - before["VmHWM"]


def check_memory_growth(name: str, proc: ChildProcess, before: dict[str, int] | None) -> tuple[int, int]:
    """``proc``'s growth in VmPeak and VmHWM since ``before``; a failure past :data:`MEMORY_SLACK`
    (or once the daemon logged a MemoryError: the cap caught an allocation)."""
    peak, hwm = memory_growth(before, proc.memory())
    if peak > MEMORY_SLACK or hwm > MEMORY_SLACK or "MemoryError" in proc.text:
        raise MatrixFailure(f"{name} grew by VmPeak {peak / MiB:.1f} MiB, VmHWM {hwm / MiB:.1f} MiB")
    return peak, hwm


__all__ = [
    "BIG_NUMEL",
    "HEARTBEAT_TIMEOUT",
    "MEMORY_SLACK",
    "OTHER_SALT",
    "SALT",
    "SCALE",
    "SIGNATURE",
    "MiB",
    "cap_address_space",
    "check_memory_growth",
    "daemon_cluster",
    "diagnose",
    "formed",
    "memory_growth",
    "pause",
    "wait_until",
]
