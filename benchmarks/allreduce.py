"""All-reduce round time and memory: flodl_trio next to torch.distributed gloo.

Run from the repository root (root is needed only for the two-host workload)::

    python benchmarks/allreduce.py                     # everything, ~2-3 minutes on 2 cores
    python benchmarks/allreduce.py --quick             # a ~1 minute subset
    python benchmarks/allreduce.py --workloads small,memory --out /tmp/chart.png
    python benchmarks/allreduce.py --wait-quiet 60 --retries 2   # on a shared machine
    python benchmarks/allreduce.py --timing            # + where each flodl_trio process spends its round
    python benchmarks/allreduce.py --workloads twohost --also-link-rates 500mbit,200mbit   # slower links too
    python benchmarks/allreduce.py --workloads twohost --also-ranks-per-host 4   # + 4 ranks per host (INFO lines)
    python benchmarks/allreduce.py --profile /tmp/prof # py-spy every flodl_trio process

Every role is its own OS process, on both sides: flodl_trio runs a
controller, one data relay per host and one process per rank (``--worker
flodl``); gloo runs one process per rank (``--worker gloo``). Rank processes
of both systems run with OMP_NUM_THREADS=1 (``--rank-threads``), as torchrun
sets it for multi-process jobs. Both systems reduce in place, into the
rank's own f32 tensor: gloo with ``all_reduce`` then a divide, flodl_trio with
``all_reduce_tensors(..., in_place=True)``. Each rank times every round with
``time.perf_counter`` after the warm-up rounds; a round's time is the slowest
rank's, and the table shows the median over the timed rounds. Peak RSS is
each process's ``ru_maxrss`` as returned by ``os.wait4`` when it exits (the
kernel's high-water mark, as VmHWM; Linux carries the parent's mark over
fork+exec, so this orchestrator stays small and torch-free and prints its own
peak as the floor).

Workloads (``--workloads``, comma-separated; default all):

* ``loopback``: one host, 2 and 4 ranks x 1, 16 and 64 MiB of f32
  (flodl_trio: one relay carrying every rank, controller on the same host);
* ``twohost``: two Linux network namespaces joined by a veth pair shaped to
  1 Gbit/s with ``tc tbf`` on both ends, 2 ranks per namespace, 16 MiB of f32
  parameters, f32 and bf16 wire on both systems, the controller on host A.
  The namespaces are created and deleted by this script; without the
  privilege (CAP_NET_ADMIN) the workload is skipped with a message;
* ``small``: 4 KiB, 4 ranks, rounds per second;
* ``memory``: relay and controller peak RSS at 2, 4 and 8 local ranks x 64 MiB
  (flodl_trio only; the 2- and 4-rank runs of ``loopback`` are reused), and at
  2 ranks x 512 MiB (where the relay's memory budget keeps it to one receive
  buffer).

The table's "other load" column is the average number of cores processes
outside the benchmark used during each run (/proc/stat busy time minus the
benchmark's own CPU time); runs above 0.15 cores are flagged, and
``--wait-quiet``/``--retries`` wait for idle CPUs and rerun disturbed runs.

The table's bytes-per-round column is computed from the frame layout for
flodl_trio (docs/wire.md) and estimated from gloo's ring algorithm
(2 (N-1)/N x S sent and received per rank) on loopback; on the two-host
workload both systems are also *measured* from the veth's byte counters
(``ip -s link``), divided by the rounds run (warm-up included).

Targets (PASS/FAIL lines at the end; the exit code is 1 when one fails):

* two hosts, same wire dtype on both sides: flodl_trio <= 1.4 x gloo;
* two hosts, flodl_trio bf16 wire vs gloo f32: <= 0.75 x gloo;
* one host, 4 ranks x 64 MiB: flodl_trio <= 4 x gloo;
* 4 KiB, 4 ranks: flodl_trio rounds/s >= 2 x gloo;
* relay peak RSS <= 2 x model bytes + 150 MiB, and flat in the number of local
  ranks (max - min over 2, 4 and 8 ranks <= 0.25 x model bytes);
  controller peak RSS <= 3 x model bytes + 150 MiB.

Each speed target's line also shows two floors. The *CPU floor* is
flodl_trio's measured CPU time per round divided by the cores: what this
implementation's work costs however well it overlaps. The *protocol floor*
(benchmarks/_floor.py) prices only the work flodl's wire protocol makes
mandatory - the hash passes every hop must do, the loopback copies, and the
link time that cannot overlap - at this machine's measured HMAC and loopback
speeds, spread perfectly over every core: when it is above a target, no
implementation of the protocol meets that target on this machine.

``--timing`` runs every flodl_trio process with wall-time counters on its hot
functions (MAC verify/sign, fold, bf16 codec; whichever of TIMED_FUNCTIONS the
code has) and prints, per process, the milliseconds per round spent in each:
for a synchronous function that is time the trio thread was blocked, for an
async one wall time, and RunningMac.feed counts hashing in any thread (the
bootstrap adds a few MiB to every flodl_trio process's RSS).
``--profile DIR`` runs every flodl_trio process under ``py-spy record``
(collapsed stacks in DIR, a top-functions summary printed at the end); the
RSS column is then py-spy's, not the measured process's, and times include
sampling overhead. This is a benchmark, not a test: pytest never collects it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _floor import (  # this script's folder is on sys.path
    Floor,
    MachineCosts,
    frame_len,
    measure_costs,
    one_host_floor,
    parse_rate,
    two_host_floor,
)
from _machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flodl_trio.controller.config import DEFAULT_LANES  # noqa: E402  (the repository root, just added)

MiB = 1 << 20
KiB = 1 << 10
SALT_ENV = "FLODL_SALT_HEX"
MARKS_ENV = "FLODL_BENCH_MARKS"  # where rank workers drop a file when their warm-up ends
PROCESS_TIMEOUT_S = 300.0

# Targets
TWOHOST_SAME_DTYPE = 1.4
TWOHOST_BF16_VS_F32 = 0.75
LOOPBACK_4X64 = 4.0
SMALL_RATE = 2.0
RELAY_RSS_MODELS = 2
CONTROLLER_RSS_MODELS = 3
RSS_HEADROOM_MIB = 150
LARGE_MODEL_MIB = 512  # the memory workload's large-model row
TWOHOST_NUMEL = 16 * MiB // 4  # f32 parameters of the two-host workload
TWOHOST_RANKS_PER_HOST = 2
FOREIGN_LOAD_WARN = 0.15  # cores used by others during a run before its numbers are flagged
RELAY_FLAT_FRACTION = 0.25


# ---------------------------------------------------------------------------
# Rank workers (run as `python benchmarks/allreduce.py --worker flodl|gloo ...`)
# ---------------------------------------------------------------------------


def _cpu_seconds() -> float:
    """This process's user + system CPU time so far, all threads."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _mark_warm(rank: int) -> None:
    """Tell the orchestrator this rank finished its warm-up (it then samples the daemons' CPU)."""
    marks = os.environ.get(MARKS_ENV)
    if marks:
        Path(marks, f"rank{rank}").touch()


def _worker_report(times: list[float], total: float, checksum: float, cpu: float) -> None:
    import resource

    print(
        json.dumps(
            {
                "times": times,
                "total": total,
                "checksum": checksum,
                "cpu": cpu,
                "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        ),
        flush=True,
    )


def _make_tensor(numel: int, rank: int, dtype: str) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1234 + rank)
    t = torch.randn(numel, generator=gen, dtype=torch.float32)
    return t.to(torch.bfloat16) if dtype == "bf16" else t


def worker_flodl(args: argparse.Namespace) -> None:
    import torch
    import trio

    import flodl_trio
    import flodl_trio.wire.quant
    from flodl_trio.train.realized_work import delta_reduce

    async def main() -> None:
        salt = bytes.fromhex(os.environ[SALT_ENV])
        host, _, port = args.addr.rpartition(":")
        t = _make_tensor(args.numel, args.rank, "f32")
        times: list[float] = []
        codec = None if args.dtype in ("f32", "bf16") else flodl_trio.wire.quant.DeltaCodec.parse(args.dtype)
        # A window's change, drawn once: drawing 4M normals a round (~25 ms of CPU a rank)
        # competed with the other ranks' rounds on a small machine, which a GPU's training does not.
        drift = None if codec is None else torch.randn(t.shape, generator=torch.Generator().manual_seed(99 + args.rank))
        async with flodl_trio.connect_reduce_client((host, int(port)), args.rank, args.world, salt) as client:
            client.bf16_wire = args.dtype == "bf16"
            client.delta_codec = codec
            out = [t]
            for i in range(args.warmup + args.rounds):
                if i == args.warmup:
                    _mark_warm(args.rank)
                    start, cpu0 = time.perf_counter(), _cpu_seconds()
                if drift is not None:  # a window's change, so every delta round codes real values
                    t.add_(drift, alpha=1e-3 * (1 + i % 4) / 2)
                t0 = time.perf_counter()
                if args.windows:  # a window's Control round first: the params round after it is stepped
                    await client.all_reduce_weighted([torch.tensor([float(i)])], flodl_trio.RoundKind.CONTROL, 1.0)
                if codec is None:
                    out = await client.all_reduce_tensors([t], in_place=True)
                else:  # a delta round (the first, in the warm-up, starts the lineage in f32)
                    out = await delta_reduce(client, [t], 1.0, in_place=True)
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times.append(dt)
            total, cpu = time.perf_counter() - start, _cpu_seconds() - cpu0
        _worker_report(times, total, float(out[0][:16].double().sum()), cpu)

    if args.cprofile:
        import cProfile

        cProfile.runctx("trio.run(main)", globals(), {"trio": trio, "main": main}, args.cprofile)
    else:
        trio.run(main)


def worker_gloo(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.addr}", rank=args.rank, world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    t = _make_tensor(args.numel, args.rank, args.dtype)
    times: list[float] = []
    for i in range(args.warmup + args.rounds):
        if i == args.warmup:
            start, cpu0 = time.perf_counter(), _cpu_seconds()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        t /= args.world
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
    total, cpu = time.perf_counter() - start, _cpu_seconds() - cpu0
    dist.destroy_process_group()
    _worker_report(times, total, float(t[:16].double().sum()), cpu)


# ---------------------------------------------------------------------------
# --timing: run a flodl_trio process with wall-time counters on its hot,
# synchronous functions (time the single trio thread spends blocked in them)
# ---------------------------------------------------------------------------

# (module, attribute) pairs wrapped when present; the names are looked up where
# they are *used*, since the roles import them with `from ... import`.
TIMED_FUNCTIONS = [
    (mod, name)
    for mod in ("flodl_trio.relay.channels", "flodl_trio.controller.core", "flodl_trio.controller.round", "flodl_trio.transport.hashing",
                "flodl_trio.client.reduce")
    for name in ("decode_round_frame", "encode_round_frame_chunks", "encode_mux_record", "finish_consensus",
                 "encode_enveloped_frame")
] + [
    ("flodl_trio.transport.stream", "verify_mux_payload"),
    ("flodl_trio.transport.hashing", "RunningMac.feed"),
    ("flodl_trio.fold.accumulator", "FoldAccumulator.add"),
    ("flodl_trio.fold.accumulator", "FoldAccumulator.result"),
    ("flodl_trio.client.tensors", "tensors_to_round_frame"),
    ("flodl_trio.client.tensors", "round_frame_to_tensors"),
    # Delta rounds (docs/wire.md): each hop's coding and the controller's lanes.
    ("flodl_trio.client.delta", "RankDelta.frame"),
    ("flodl_trio.client.delta", "RankDelta.take"),
    ("flodl_trio.client.delta", "RankDelta.verify"),
    ("flodl_trio.client.tensors", "f32_copies"),
    ("flodl_trio.client.tensors", "copy_arrays_into"),
    ("flodl_trio.fold.delta", "PendingHostDelta.lane"),
    ("flodl_trio.fold.delta", "PendingHostDelta.whole"),
    ("flodl_trio.controller.lane_windows", "LaneWindows.take"),
    ("flodl_trio.wire.lanes", "LaneAssembler.add"),
    ("flodl_trio.wire.lanes", "LaneAssembler.finish"),
]
TIMING_PREFIX = "FLODL_BENCH_TIMING "


def timed_exec(argv: list[str]) -> None:
    """``--timed-exec -m MODULE ARGS`` / ``-c CODE ARGS`` / ``SCRIPT ARGS`` with counters installed."""
    import atexit
    import functools
    import importlib
    import runpy

    totals: dict[str, list[float]] = {}

    def count(label: str, t0: float) -> None:
        entry = totals.setdefault(label, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - t0

    def wrap(owner: Any, attr: str, label: str) -> None:
        import inspect

        original = getattr(owner, attr)
        if getattr(original, "_bench_timed", False):
            return
        if inspect.iscoroutinefunction(original):
            label += " (async: wall time)"

            @functools.wraps(original)
            async def timed_async(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await original(*a, **k)
                finally:
                    count(label, t0)

            timed_async._bench_timed = True  # type: ignore[attr-defined]
            setattr(owner, attr, timed_async)
            return

        @functools.wraps(original)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                count(label, t0)

        timed._bench_timed = True  # type: ignore[attr-defined]
        setattr(owner, attr, timed)

    is_rank = "--worker" in argv
    for mod_name, dotted in TIMED_FUNCTIONS:
        if mod_name == "flodl_trio.client.tensors" and not is_rank:
            continue  # it imports torch: the daemons must not pay for it
        try:
            owner: Any = importlib.import_module(mod_name)
        except ImportError:
            continue
        *path, attr = dotted.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and callable(getattr(owner, attr, None)):
            wrap(owner, attr, dotted)
    atexit.register(lambda: sys.stderr.write(TIMING_PREFIX + json.dumps(totals) + "\n"))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------
# Process management: every process is reaped with os.wait4 for its peak RSS
# ---------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    role: str  # rank | relay | controller
    maxrss_mib: float | None = None
    cpu_s: float = 0.0  # user + system CPU time, from wait4
    returncode: int | None = None

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr_tail(self, n: int = 3000) -> str:
        return self.stderr_path.read_text(errors="replace")[-n:]


class Launcher:
    """Starts processes (optionally inside a netns), reaps them with wait4, kills leftovers."""

    def __init__(self, workdir: Path, profile_dir: Path | None, timing: bool = False) -> None:
        self.workdir = workdir
        self.profile_dir = profile_dir
        self.timing = timing
        self.live: list[Proc] = []
        self._seq = 0

    def spawn(self, name: str, role: str, cmd: list[str], env: dict[str, str], netns: str | None = None,
              profile_tag: str | None = None) -> Proc:
        self._seq += 1
        out = self.workdir / f"{self._seq:03d}-{name}.out"
        err = self.workdir / f"{self._seq:03d}-{name}.err"
        if self.timing and profile_tag is not None and cmd[0] == sys.executable:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--timed-exec", *cmd[1:]]
        if self.profile_dir is not None and profile_tag is not None:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            target = self.profile_dir / f"{profile_tag}-{name}.txt"
            cmd = [spy, "record", "--nonblocking", "--subprocesses", "--rate", "200", "--format", "raw",
                   "-o", str(target), "--", *cmd]  # (--subprocesses: a relay daemon's child shard too)
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, cwd=ROOT)
        proc = Proc(name, popen, out, err, role)
        self.live.append(proc)
        return proc

    def wait(self, procs: list[Proc], timeout: float, poll: Callable[[], None] | None = None) -> None:
        """Reap ``procs`` (wait4 gives each one's ru_maxrss); kill what outlives ``timeout``.

        ``poll`` runs on every pass of the wait loop (every 20 ms)."""
        deadline = time.monotonic() + timeout
        pending = [p for p in procs if p.returncode is None]
        while pending:
            if poll is not None:
                poll()
            for p in list(pending):
                pid, status, usage = os.wait4(p.popen.pid, os.WNOHANG)
                if pid == 0:
                    continue
                p.returncode = os.waitstatus_to_exitcode(status)
                p.popen.returncode = p.returncode
                p.maxrss_mib = usage.ru_maxrss / 1024  # Linux: KiB
                p.cpu_s = usage.ru_utime + usage.ru_stime
                pending.remove(p)
                self.live.remove(p)
            if not pending:
                break
            if time.monotonic() > deadline:
                for p in pending:
                    self.kill(p)
                self.wait(pending, 10)
                names = ", ".join(p.name for p in pending)
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {names}")
            time.sleep(0.02)

    def kill(self, p: Proc) -> None:
        if p.returncode is None:
            try:
                os.kill(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for p in list(self.live):
            self.kill(p)
        try:
            self.wait(list(self.live), 10)
        except RuntimeError:
            pass


class ForeignLoad:
    """CPU time the rest of the machine used while a run was going on.

    Busy time from /proc/stat (user + nice + system) minus this process's and
    its reaped children's CPU time: what other processes took from the cores
    the measured processes were sharing. Kernel threads working for our own
    sockets count as foreign too, so a quiet machine reads a little above 0.
    """

    def __init__(self) -> None:
        self.wall0 = time.monotonic()
        self.busy0 = self._busy()
        self.own0 = self._own()

    @staticmethod
    def _busy() -> float:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return 0.0
        user, nice, system = (int(x) for x in fields[:3])
        return (user + nice + system) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        import resource

        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            total += usage.ru_utime + usage.ru_stime
        return total

    def cores(self) -> float:
        """Average number of cores used by others during the interval."""
        wall = time.monotonic() - self.wall0
        foreign = (self._busy() - self.busy0) - (self._own() - self.own0)
        return max(foreign, 0.0) / wall if wall > 0 else 0.0


def wait_quiet(max_wait: float, window: float = 1.0, needed: int = 2) -> tuple[float, float]:
    """Wait (up to ``max_wait`` s) until ``needed`` consecutive windows show others using
    under FOREIGN_LOAD_WARN cores; returns (seconds waited, last load seen)."""
    start = time.monotonic()
    quiet = 0
    load = 0.0
    while time.monotonic() - start < max_wait:
        sample = ForeignLoad()
        time.sleep(window)
        load = sample.cores()
        quiet = quiet + 1 if load < FOREIGN_LOAD_WARN else 0
        if quiet >= needed:
            break
    return time.monotonic() - start, load


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, all threads (from /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """:func:`proc_cpu_seconds` of a process and every live descendant (a relay daemon's child
    shard): what the process's wait4 rusage counts at its end, its reaped children included."""
    total = proc_cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(tree_cpu_seconds(int(child)) for child in children)
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------
# Cluster runs
# ---------------------------------------------------------------------------


@dataclass
class Host:
    name: str
    ranks: list[int]
    netns: str | None = None  # None = this network namespace
    ip: str = "127.0.0.1"  # address other hosts reach it by
    ifname: str = "lo"  # gloo's interface on this host


@dataclass
class RunResult:
    system: str
    round_s: list[float]  # per timed round: the slowest rank's time
    rates: list[float]  # per rank: timed rounds / timed seconds
    rss: dict[str, float]  # process name -> peak RSS MiB
    link_bytes: dict[str, float] = field(default_factory=dict)  # measured veth bytes per round
    rounds_run: int = 0
    profiled: bool = False
    foreign_cores: float = 0.0  # average cores used by other processes during the run
    timing: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # process -> fn -> [calls, s]
    cpu_ms: dict[str, float] = field(default_factory=dict)  # process -> CPU ms per round
    daemon_cpu_s: dict[str, float] = field(default_factory=dict)  # relay/controller -> lifetime CPU s

    @property
    def cpu_ms_per_round(self) -> float:
        return sum(self.cpu_ms.values())

    @property
    def median_ms(self) -> float:
        return statistics.median(self.round_s) * 1e3

    @property
    def rounds_per_s(self) -> float:
        return min(self.rates)

    def rss_of(self, role: str) -> list[float]:
        return [v for k, v in self.rss.items() if k.startswith(role)]


def _collect(system: str, ranks: list[Proc], others: list[Proc]) -> RunResult:
    reports = []
    for p in ranks:
        if p.returncode != 0:
            raise RuntimeError(f"{p.name} exited {p.returncode}: {p.stderr_tail()}")
        lines = [line for line in p.stdout().splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"{p.name} reported nothing: {p.stderr_tail()}")
        reports.append(json.loads(lines[-1]))
    for p in others:
        if p.returncode != 0:
            raise RuntimeError(f"{p.name} exited {p.returncode}: {p.stderr_tail()}")
    per_round = [max(r["times"][i] for r in reports) for i in range(len(reports[0]["times"]))]
    rates = [len(r["times"]) / r["total"] for r in reports]
    rss = {p.name: p.maxrss_mib or 0.0 for p in [*others, *ranks]}
    rounds = len(reports[0]["times"])
    # Ranks measure their own timed rounds; the caller adds the daemons (sampled at warm-up end).
    cpu_ms = {p.name: 1e3 * r["cpu"] / max(rounds, 1) for p, r in zip(ranks, reports)}
    timing = {}
    for p in [*others, *ranks]:
        for line in p.stderr_path.read_text(errors="replace").splitlines():
            if line.startswith(TIMING_PREFIX):
                timing[p.name] = json.loads(line[len(TIMING_PREFIX):])
    result = RunResult(system, per_round, rates, rss, timing=timing)
    result.cpu_ms = cpu_ms
    result.daemon_cpu_s = {p.name: p.cpu_s for p in others}
    return result


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.launcher = Launcher(workdir, Path(args.profile) if args.profile else None, args.timing)
        self.salt_hex = secrets.token_hex(16)
        self.env = {**os.environ, SALT_ENV: self.salt_hex, "PYTHONUNBUFFERED": "1"}
        self.env.pop("FLODL_SALT_FILE", None)
        if args.deterministic:  # the controller and every relay add contributions in a fixed order
            self.env["FLODL_DETERMINISTIC"] = "1"
        if args.lanes is not None:  # else the daemons' default (the controller's 8, taken by the relays)
            self.env["FLODL_LANES"] = str(args.lanes)
        if getattr(args, "outer", None):  # the controller's outer optimizer (with shards: stepped, and mirrored, there)
            self.env["FLODL_OUTER"] = args.outer
        if getattr(args, "star", False):  # no shards: the controller sums every lane (else the daemons' auto)
            self.env["FLODL_SHARDS"] = self.env["FLODL_SHARD"] = "off"
        # Ranks reach their relay over the Unix-socket local leg (no MACs) unless turned off.
        self.local_leg = not args.no_unix
        if args.no_unix:
            self.env["FLODL_NO_UNIX"] = "1"
        # Rank processes of both systems get the same intra-op thread count;
        # torchrun sets OMP_NUM_THREADS=1 for multi-process jobs for the same reason
        # (K ranks x N OpenMP threads on a few cores spin against each other).
        self.rank_env = dict(self.env)
        if args.rank_threads > 0:
            self.rank_env["OMP_NUM_THREADS"] = str(args.rank_threads)
        self.controller_cli = self._detect_controller_cli()

    def _detect_controller_cli(self) -> bool:
        """Use ``python -m flodl_trio.controller`` if it has a CLI; else an inline launcher."""
        try:
            r = subprocess.run(
                [sys.executable, "-m", "flodl_trio.controller", "--help"],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        text = r.stdout + r.stderr
        return r.returncode == 0 and "--world-size" in text and "--port" in text

    def controller_cmd(self, host: str, port: int, world: int) -> list[str]:
        if self.controller_cli:
            return [
                sys.executable, "-m", "flodl_trio.controller", "--host", host, "--port", str(port),
                "--world-size", str(world), "--log-level", "WARNING",
            ]
        code = (
            "import os, sys, trio, flodl_trio\n"
            "async def main():\n"
            "    async with flodl_trio.open_controller(sys.argv[1], int(sys.argv[2]), world_size=int(sys.argv[3]),\n"
            "            salt=bytes.fromhex(os.environ['FLODL_SALT_HEX'])) as c:\n"
            "        await c.wait_finished()\n"
            "trio.run(main)\n"
        )
        return [sys.executable, "-c", code, host, str(port), str(world)]

    def worker_cmd(self, system: str, rank: int, world: int, addr: str, numel: int, dtype: str,
                   warmup: int, rounds: int) -> list[str]:
        return [
            sys.executable, str(Path(__file__).resolve()), "--worker", system,
            "--rank", str(rank), "--world", str(world), "--addr", addr, "--numel", str(numel),
            "--dtype", dtype, "--warmup", str(warmup), "--rounds", str(rounds),
            *(["--windows"] if getattr(self.args, "outer", None) and system == "flodl" else []),
        ]

    def run_flodl(self, hosts: list[Host], numel: int, dtype: str, warmup: int, rounds: int, tag: str) -> RunResult:
        world = sum(len(h.ranks) for h in hosts)
        load = ForeignLoad()
        ctl_host = hosts[0]
        ctl_port = free_port() if ctl_host.netns is None else 29400
        L = self.launcher
        shards = []
        ctl_cmd = self.controller_cmd(ctl_host.ip, ctl_port, world)
        in_relays = getattr(self.args, "relay_shards", False)  # each relay daemon serves its host's shard
        if getattr(self.args, "shards", False):  # a reduction shard on every host
            for h in hosts if not in_relays else ():
                shards.append(L.spawn(
                    f"shard-{h.name}", "shard",
                    [sys.executable, "-m", "flodl_trio.shard", "--host", h.ip, "--port", "29410", "--log-level", "WARNING"],
                    self.env, h.netns, tag,
                ))
            ctl_cmd += ["--shards", ",".join(f"{h.ip}:29410" for h in hosts)]
        ctl = L.spawn("controller", "controller", ctl_cmd, self.env, ctl_host.netns, tag)
        relays, ranks = [], []
        marks = Path(tempfile.mkdtemp(prefix="marks-", dir=self.launcher.workdir))
        rank_env = {**self.rank_env, MARKS_ENV: str(marks)}
        for h in hosts:
            data_port = free_port() if h.netns is None else 29404
            relays.append(L.spawn(
                f"relay-{h.name}", "relay",
                [sys.executable, "-m", "flodl_trio.relay", "--controller", f"{ctl_host.ip}:{ctl_port}",
                 "--ranks", ",".join(map(str, h.ranks)), "--world-size", str(world), "--host-name", h.name,
                 "--channels", "data", "--data-port", str(data_port), "--log-level", "WARNING",
                 *(["--shard", f"{h.ip}:29410" if in_relays else "off"] if getattr(self.args, "shards", False) else [])],
                self.env, h.netns, tag,
            ))
            for r in h.ranks:
                ranks.append(L.spawn(
                    f"rank{r}", "rank",
                    self.worker_cmd("flodl", r, world, f"127.0.0.1:{data_port}", numel, dtype, warmup, rounds),
                    rank_env, h.netns, tag,
                ))
        # The daemons' CPU time when the first rank ends its warm-up, so their CPU per
        # round covers the timed rounds only (not start-up and warm-up).
        warm_cpu: dict[str, float] = {}

        def sample_daemons() -> None:
            if not warm_cpu and any(marks.iterdir()):
                warm_cpu.update({p.name: tree_cpu_seconds(p.popen.pid) for p in (ctl, *relays, *shards)})

        try:
            L.wait(ranks, PROCESS_TIMEOUT_S, poll=sample_daemons)
            L.wait([*relays, ctl, *shards], 60)
        except BaseException:
            for p in [*ranks, *relays, ctl, *shards]:
                sys.stderr.write(f"--- {p.name} stderr ---\n{p.stderr_tail(1500)}\n")
            L.kill_all()
            raise
        result = _collect("flodl_trio", ranks, [ctl, *relays, *shards])
        result.foreign_cores = load.cores()
        result.rounds_run = warmup + rounds
        result.profiled = L.profile_dir is not None
        for name, seconds in result.daemon_cpu_s.items():
            result.cpu_ms[name] = 1e3 * (seconds - warm_cpu.get(name, 0.0)) / rounds
        return result

    def run_gloo(self, hosts: list[Host], numel: int, dtype: str, warmup: int, rounds: int) -> RunResult:
        world = sum(len(h.ranks) for h in hosts)
        load = ForeignLoad()
        master = hosts[0]
        port = free_port() if master.netns is None else 29500
        ranks = []
        for h in hosts:
            env = {**self.rank_env, "GLOO_SOCKET_IFNAME": h.ifname}
            for r in h.ranks:
                ranks.append(self.launcher.spawn(
                    f"rank{r}", "rank",
                    self.worker_cmd("gloo", r, world, f"{master.ip}:{port}", numel, dtype, warmup, rounds),
                    env, h.netns,
                ))
        try:
            self.launcher.wait(ranks, PROCESS_TIMEOUT_S)
        except BaseException:
            for p in ranks:
                sys.stderr.write(f"--- {p.name} stderr ---\n{p.stderr_tail(1500)}\n")
            self.launcher.kill_all()
            raise
        result = _collect("gloo", ranks, [])
        result.foreign_cores = load.cores()
        result.rounds_run = warmup + rounds
        return result


# ---------------------------------------------------------------------------
# Two simulated hosts: network namespaces + a shaped veth pair
# ---------------------------------------------------------------------------


class NetnsPair:
    """Two namespaces joined by a veth pair, each end shaped to ``rate`` with tbf."""

    def __init__(self, rate: str) -> None:
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.ns = (f"flbench-{tag}-a", f"flbench-{tag}-b")
        self.dev = (f"flba{tag}"[:15], f"flbb{tag}"[:15])
        self.ip = ("10.231.7.1", "10.231.7.2")
        self.rate = rate
        self.created: list[str] = []

    @staticmethod
    def _ip(*argv: str) -> None:
        r = subprocess.run(list(argv), capture_output=True, text=True)
        if r.returncode != 0:
            raise PermissionError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")

    def __enter__(self) -> NetnsPair:
        try:
            for ns in self.ns:
                self._ip("ip", "netns", "add", ns)
                self.created.append(ns)
            self._ip("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, ip in zip(self.ns, self.dev, self.ip):
                self._ip("ip", "link", "set", dev, "netns", ns)
                self._ip("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._ip("ip", "-n", ns, "link", "set", dev, "up")
                self._ip("ip", "-n", ns, "link", "set", "lo", "up")
                self._ip("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", self.rate, "burst", "256kb", "latency", "50ms")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self.created):  # deleting a namespace deletes its veth end (and the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()

    def counters(self) -> dict[str, int]:
        """tx bytes of each end: A->B and B->A."""
        out = {}
        for ns, dev, label in zip(self.ns, self.dev, ("A->B", "B->A")):
            r = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], capture_output=True, text=True)
            out[label] = int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])
        return out

    def hosts(self, ranks_per_host: int) -> list[Host]:
        return [
            Host("hostA", list(range(0, ranks_per_host)), self.ns[0], self.ip[0], self.dev[0]),
            Host("hostB", list(range(ranks_per_host, 2 * ranks_per_host)), self.ns[1], self.ip[1], self.dev[1]),
        ]


# ---------------------------------------------------------------------------
# Workloads, table, targets, chart
# ---------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n:.0f} B"


@dataclass
class Row:
    workload: str
    key: str  # groups the flodl_trio and gloo rows of one workload
    result: RunResult
    links: str
    show_rate: bool = False
    vs: RunResult | None = None  # the gloo result the ratio is against
    model_bytes: int = 0


def flodl_links(hosts: list[Host], numel: int, dtype: str) -> str:
    f = frame_len(numel, dtype)
    rank_leg = f + 4
    up = 25 + f
    return f"rank<->relay {fmt_bytes(rank_leg)} up + {fmt_bytes(rank_leg)} down; relay<->ctl {fmt_bytes(up)} up + {fmt_bytes(up)} down (computed)"


def gloo_links(world: int, numel: int, dtype: str) -> str:
    s = numel * (2 if dtype == "bf16" else 4)
    per = 2 * (world - 1) / world * s
    return f"each rank {fmt_bytes(per)} sent + {fmt_bytes(per)} received (ring estimate)"


def cpu_floor(fl: RunResult, gl: RunResult) -> str:
    """What flodl_trio's measured CPU time alone costs per round on this machine's cores.

    A round cannot be shorter than its CPU time divided by the cores that run
    it, however well the processes overlap; when this floor already exceeds a
    target, the target is out of reach at this CPU cost on this machine.
    """
    floor = fl.cpu_ms_per_round / (os.cpu_count() or 1)
    return f"; CPU floor {fl.cpu_ms_per_round:,.0f} ms CPU / {os.cpu_count()} cores = {floor:.0f} ms = {floor / gl.median_ms:.2f}x gloo"


def protocol_floor(floor: Floor | None, costs: MachineCosts | None, gl: RunResult, target: float) -> str:
    """The protocol floor (benchmarks/_floor.py) as a ratio to gloo, and whether it leaves the target reachable.

    Unlike the CPU floor, which prices flodl_trio's own CPU time, this prices
    only the work the wire protocol makes mandatory: above the target, no
    implementation of the protocol meets the target on this machine.
    """
    if floor is None or costs is None:
        return ""
    ratio = floor.ms / gl.median_ms
    verdict = "out of reach on this machine" if ratio > target else "within reach"
    # three decimals: a floor of 1.4005x must not print as the 1.40x it is out of reach of
    return f"; protocol floor {floor.ms:.0f} ms = {ratio:.3f}x gloo ({floor.describe(costs)}): {verdict}"


def rss_text(r: RunResult) -> str:
    if r.profiled:
        return "not measured (processes ran under py-spy)"
    parts = []
    ranks = r.rss_of("rank")
    if ranks:
        parts.append("ranks " + "/".join(f"{v:.0f}" for v in ranks))
    relays = r.rss_of("relay")
    if relays:
        parts.append(("relay " if len(relays) == 1 else "relays ") + "/".join(f"{v:.0f}" for v in relays))
    ctl = r.rss_of("controller")
    if ctl:
        parts.append(f"ctl {ctl[0]:.0f}")
    return "; ".join(parts)


class Suite:
    def __init__(self, bench: Bench, args: argparse.Namespace) -> None:
        self.bench = bench
        self.args = args
        self.rows: list[Row] = []
        self.memory: dict[int, RunResult] = {}
        self.large_memory: RunResult | None = None
        self.loopback_cache: dict[tuple[int, int], RunResult] = {}
        self.notes: list[str] = []
        self.checks: list[tuple[str, bool | None, str]] = []
        self.sweep: list[str] = []  # the two-host targets at --also-link-rates (not judged)
        self.costs: MachineCosts | None = None  # this machine's price of the protocol's mandatory work

    def measure(self, run: Any) -> RunResult:
        """One run; on a shared machine, wait for quiet first and retry runs others disturbed."""
        best: RunResult | None = None
        for attempt in range(self.args.retries + 1):
            if self.args.wait_quiet > 0:
                waited, load = wait_quiet(self.args.wait_quiet)
                if waited > 1:
                    self.log(f"  waited {waited:.0f} s for a quiet machine (others use {load:.2f} cores)")
            result: RunResult = run()
            if best is None or result.foreign_cores < best.foreign_cores:
                best = result
            if result.foreign_cores <= FOREIGN_LOAD_WARN:
                break
            self.log(f"  others used {result.foreign_cores:.2f} cores during that run"
                     + ("; running it again" if attempt < self.args.retries else ""))
        assert best is not None
        return best

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def pair(self, workload: str, hosts: list[Host], numel: int, dtype_flodl: str, dtype_gloo: str,
             warmup: int, rounds: int, show_rate: bool = False) -> tuple[RunResult, RunResult]:
        world = sum(len(h.ranks) for h in hosts)
        tag = workload.replace(" ", "_").replace(",", "").replace("/", "")
        self.log(f"{workload}: flodl_trio ({dtype_flodl} wire)")
        fl = self.measure(lambda: self.bench.run_flodl(hosts, numel, dtype_flodl, warmup, rounds, tag))
        self.log(f"{workload}: gloo ({dtype_gloo})")
        gl = self.measure(lambda: self.bench.run_gloo(hosts, numel, dtype_gloo, warmup, rounds))
        self.rows.append(Row(workload, workload, fl, flodl_links(hosts, numel, dtype_flodl), show_rate, gl, numel * 4))
        self.rows.append(Row(workload, workload, gl, gloo_links(world, numel, dtype_gloo), show_rate, None, numel * 4))
        return fl, gl

    def loopback(self) -> None:
        q = self.args.quick
        configs = [(4, 64)] if q else [(2, 1), (2, 16), (2, 64), (4, 1), (4, 16), (4, 64)]
        for world, mib in configs:
            rounds = {1: 20, 16: 8, 64: 5}[mib] if not q else 3
            warmup = 2 if not q else 1
            hosts = [Host("host0", list(range(world)))]
            fl, gl = self.pair(f"loopback {world}x{mib} MiB", hosts, mib * MiB // 4, "f32", "f32", warmup, rounds)
            self.loopback_cache[(world, mib)] = fl
            if world == 4 and mib == 64:
                ratio = fl.median_ms / gl.median_ms
                floor = (one_host_floor(self.costs, frame_len(mib * MiB // 4, "f32"), world, self.bench.local_leg)
                         if self.costs else None)
                self.checks.append((f"one host, 4 ranks x 64 MiB: flodl_trio <= {LOOPBACK_4X64:g} x gloo",
                                    ratio <= LOOPBACK_4X64,
                                    f"{ratio:.2f}x{cpu_floor(fl, gl)}"
                                    f"{protocol_floor(floor, self.costs, gl, LOOPBACK_4X64)}"))

    def twohost(self) -> None:
        results = self._twohost_at(self.args.link_rate, "")
        if results is None:
            self.checks.append(("two hosts (all three targets)", None, "skipped: no privilege for netns"))
            return
        for name, ok, got in self._twohost_ratios(results, self.args.link_rate):
            self.checks.append((name, ok, got))
        rates = list(filter(None, self.args.also_link_rates.split(",")))
        for rate in rates:
            self._twohost_info(rate, TWOHOST_RANKS_PER_HOST, f"at {rate}")
        for per_host in sorted({int(k) for k in filter(None, self.args.also_ranks_per_host.split(","))}):
            for rate in [self.args.link_rate, *rates]:
                self._twohost_info(rate, per_host, f"at {rate}, {per_host} ranks per host")

    def _twohost_info(self, rate: str, per_host: int, where: str) -> None:
        """The two-host workload at another link rate or host size: its ratios become INFO lines."""
        more = self._twohost_at(rate, f" @ {rate}", per_host)
        for name, ok, got in self._twohost_ratios(more, rate, per_host) if more is not None else []:
            self.sweep.append(f"{where}: {name}: {'met' if ok else 'not met'} (got {got})")

    def _twohost_ratios(
        self, results: dict[tuple[str, str], RunResult], rate: str, per_host: int = TWOHOST_RANKS_PER_HOST
    ) -> list[tuple[str, bool, str]]:
        """The three two-host targets as (name, met, detail) for one link rate's runs."""
        out = []
        floors = {dtype: self._twohost_floor(dtype, rate, per_host) for dtype in ("f32", "bf16")}
        for dtype in ("f32", "bf16"):
            fl, gl = results[("flodl_trio", dtype)], results[("gloo", dtype)]
            ratio = fl.median_ms / gl.median_ms
            out.append((f"two hosts, {dtype} wire both sides: flodl_trio <= {TWOHOST_SAME_DTYPE:g} x gloo",
                        ratio <= TWOHOST_SAME_DTYPE,
                        f"{ratio:.2f}x{cpu_floor(fl, gl)}"
                        f"{protocol_floor(floors[dtype], self.costs, gl, TWOHOST_SAME_DTYPE)}"))
        fl_bf16, gl_f32 = results[("flodl_trio", "bf16")], results[("gloo", "f32")]
        ratio = fl_bf16.median_ms / gl_f32.median_ms
        out.append((f"two hosts, flodl_trio bf16 wire vs gloo f32: <= {TWOHOST_BF16_VS_F32:g} x gloo",
                    ratio <= TWOHOST_BF16_VS_F32,
                    f"{ratio:.2f}x ({fl_bf16.median_ms:.0f} ms vs {gl_f32.median_ms:.0f} ms){cpu_floor(fl_bf16, gl_f32)}"
                    f"{protocol_floor(floors['bf16'], self.costs, gl_f32, TWOHOST_BF16_VS_F32)}"))
        return out

    def _twohost_floor(self, dtype: str, rate: str, per_host: int = TWOHOST_RANKS_PER_HOST) -> Floor | None:
        if self.costs is None:
            return None
        return two_host_floor(self.costs, frame_len(TWOHOST_NUMEL, dtype), rate, per_host, self.bench.local_leg,
                              DEFAULT_LANES if self.bench.args.lanes is None else self.bench.args.lanes)

    def _twohost_at(
        self, rate: str, suffix: str, per_host: int = TWOHOST_RANKS_PER_HOST
    ) -> dict[tuple[str, str], RunResult] | None:
        """Both systems, both wire dtypes, ``per_host`` ranks in each of two namespaces
        joined by a veth pair shaped to ``rate``; None without the privilege."""
        q = self.args.quick
        warmup, rounds = (1, 5) if q else (2, 12)
        numel = TWOHOST_NUMEL
        try:
            pair = NetnsPair(rate)
            pair.__enter__()
        except PermissionError as exc:
            msg = (f"SKIPPED two-host workload: creating network namespaces needs root / CAP_NET_ADMIN "
                   f"and iproute2 ({exc})")
            self.log(msg)
            self.notes.append(msg)
            return None
        results: dict[tuple[str, str], RunResult] = {}
        try:
            self.notes.append(
                f"two-host: namespaces {pair.ns[0]} / {pair.ns[1]}, veth {pair.dev[0]} <-> {pair.dev[1]}, "
                f"tc tbf rate {rate} burst 256kb latency 50ms on both ends; created and deleted by this run"
            )
            hosts = pair.hosts(per_host)
            for dtype in ("f32", "bf16"):
                name = f"2 hosts x {per_host} ranks, 16 MiB, {dtype} wire{suffix}"
                for system in ("flodl_trio", "gloo"):
                    self.log(f"{name}: {system}")
                    def once(system: str = system, dtype: str = dtype) -> RunResult:
                        before = pair.counters()
                        if system == "flodl_trio":
                            r = self.bench.run_flodl(hosts, numel, dtype, warmup, rounds, f"twohost{per_host}_{dtype}")
                        else:
                            r = self.bench.run_gloo(hosts, numel, dtype, warmup, rounds)
                        after = pair.counters()
                        r.link_bytes = {k: (after[k] - before[k]) / r.rounds_run for k in after}
                        return r

                    results[(system, dtype)] = self.measure(once)
                fl, gl = results[("flodl_trio", dtype)], results[("gloo", dtype)]
                for res, computed in ((fl, flodl_links(hosts, numel, dtype)), (gl, gloo_links(2 * per_host, numel, dtype))):
                    veth = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in res.link_bytes.items())
                    self.rows.append(Row(name, name, res, f"veth {veth} (measured); {computed}",
                                         vs=gl if res is fl else None))
        finally:
            pair.__exit__(None, None, None)
        return results

    def small(self) -> None:
        rounds = 300 if self.args.quick else 2000
        hosts = [Host("host0", [0, 1, 2, 3])]
        fl, gl = self.pair("small 4 KiB, 4 ranks", hosts, 4 * KiB // 4, "f32", "f32", 50, rounds, show_rate=True)
        ratio = fl.rounds_per_s / gl.rounds_per_s
        self.checks.append((f"4 KiB, 4 ranks: flodl_trio rounds/s >= {SMALL_RATE:g} x gloo", ratio >= SMALL_RATE,
                            f"{ratio:.2f}x ({fl.rounds_per_s:,.0f} vs {gl.rounds_per_s:,.0f} rounds/s)"))

    def memory_workload(self) -> None:
        mib = 64
        numel = mib * MiB // 4
        counts = [4, 8] if self.args.quick else [2, 4, 8]
        for world in counts:
            cached = self.loopback_cache.get((world, mib))
            if cached is not None:
                self.memory[world] = cached
                continue
            self.log(f"memory: flodl_trio {world} ranks x {mib} MiB")
            r = self.measure(lambda: self.bench.run_flodl(
                [Host("host0", list(range(world)))], numel, "f32", 1, 2 if self.args.quick else 3, f"memory_{world}"))
            self.memory[world] = r
            self.rows.append(Row(f"memory {world}x{mib} MiB", f"memory {world}", r,
                                 flodl_links([Host("host0", list(range(world)))], numel, "f32")))
        if self.bench.launcher.profile_dir is not None:
            self.checks.append(("relay and controller peak RSS targets", None, "skipped: processes ran under py-spy"))
            return
        model = mib * MiB
        relay_cap = (RELAY_RSS_MODELS * model + RSS_HEADROOM_MIB * MiB) / MiB
        ctl_cap = (CONTROLLER_RSS_MODELS * model + RSS_HEADROOM_MIB * MiB) / MiB
        relay = {w: r.rss_of("relay")[0] for w, r in self.memory.items()}
        ctl = {w: r.rss_of("controller")[0] for w, r in self.memory.items()}
        got = ", ".join(f"{w} ranks {v:.0f} MiB" for w, v in relay.items())
        self.checks.append((f"relay peak RSS <= 2 x model + 150 MiB = {relay_cap:.0f} MiB", max(relay.values()) <= relay_cap, got))
        spread = max(relay.values()) - min(relay.values())
        flat_cap = RELAY_FLAT_FRACTION * model / MiB
        self.checks.append((f"relay RSS flat in local ranks (max - min <= {flat_cap:.0f} MiB)", spread <= flat_cap,
                            f"spread {spread:.0f} MiB"))
        got = ", ".join(f"{w} ranks {v:.0f} MiB" for w, v in ctl.items())
        self.checks.append((f"controller peak RSS <= 3 x model + 150 MiB = {ctl_cap:.0f} MiB", max(ctl.values()) <= ctl_cap, got))
        self._large_model_memory()

    def _large_model_memory(self) -> None:
        """2 ranks x 512 MiB: the RSS targets must hold at every model size, not only 64 MiB."""
        mib, world = LARGE_MODEL_MIB, 2
        numel = mib * MiB // 4
        hosts = [Host("host0", list(range(world)))]
        self.log(f"memory: flodl_trio {world} ranks x {mib} MiB")
        r = self.measure(lambda: self.bench.run_flodl(hosts, numel, "f32", 1, 2, f"memory_{world}x{mib}"))
        self.large_memory = r
        self.rows.append(Row(f"memory {world}x{mib} MiB", f"memory {world}x{mib}", r, flodl_links(hosts, numel, "f32")))
        model = mib * MiB
        relay, ctl = r.rss_of("relay")[0], r.rss_of("controller")[0]
        relay_cap = (RELAY_RSS_MODELS * model + RSS_HEADROOM_MIB * MiB) / MiB
        ctl_cap = (CONTROLLER_RSS_MODELS * model + RSS_HEADROOM_MIB * MiB) / MiB
        self.checks.append((f"relay peak RSS at {world} x {mib} MiB <= 2 x model + 150 MiB = {relay_cap:.0f} MiB",
                            relay <= relay_cap, f"{relay:.0f} MiB"))
        self.checks.append((f"controller peak RSS at {world} x {mib} MiB <= 3 x model + 150 MiB = {ctl_cap:.0f} MiB",
                            ctl <= ctl_cap, f"{ctl:.0f} MiB"))

    # -- output --------------------------------------------------------------

    def table(self) -> str:
        lines = [
            "| workload | system | median round ms | rounds/s | flodl_trio/gloo | CPU ms per round | bytes per round on each link | peak RSS MB (MiB) | other load (cores) |",
            "|---|---|---:|---:|---:|---:|---|---|---:|",
        ]
        for row in self.rows:
            r = row.result
            ratio = ""
            if row.vs is not None:
                if row.show_rate:
                    ratio = f"{r.rounds_per_s / row.vs.rounds_per_s:.2f}x rate"
                else:
                    ratio = f"{r.median_ms / row.vs.median_ms:.2f}x"
            ms = f"{r.median_ms:.3f}" if r.median_ms < 10 else f"{r.median_ms:.1f}"
            lines.append(
                f"| {row.workload} | {r.system} | {ms} | {r.rounds_per_s:,.1f} | {ratio} | {r.cpu_ms_per_round:,.0f} "
                f"| {row.links} | {rss_text(r)} "
                f"| {r.foreign_cores:.2f} |"
            )
        if self.memory:
            lines += ["", "| flodl_trio local ranks x 64 MiB | relay peak RSS MiB | controller peak RSS MiB | median round ms |",
                      "|---:|---:|---:|---:|"]
            for w, r in sorted(self.memory.items()):
                lines.append(f"| {w} | {r.rss_of('relay')[0]:.0f} | {r.rss_of('controller')[0]:.0f} | {r.median_ms:.0f} |")
            if self.large_memory is not None:
                r = self.large_memory
                lines.append(f"| 2 (x {LARGE_MODEL_MIB} MiB) | {r.rss_of('relay')[0]:.0f} | {r.rss_of('controller')[0]:.0f} "
                             f"| {r.median_ms:.0f} |")
        return "\n".join(lines)

    def _mark_twohost_target_and_floor(self, ax: Any, rows: list[Row], width: float) -> None:
        """Across each flodl_trio bar of the two-host panel: the same-dtype target and the protocol floor."""
        labels = list(dict.fromkeys(r.workload for r in rows))
        for i, label in enumerate(labels):
            gloo = [r for r in rows if r.workload == label and r.result.system == "gloo"]
            if not gloo:
                continue
            x0, x1 = i - width, i  # the flodl_trio bar's extent
            target = TWOHOST_SAME_DTYPE * gloo[0].result.median_ms
            ax.hlines(target, x0, x1, colors="red", linestyles=":", lw=1.5,
                      label=f"target ({TWOHOST_SAME_DTYPE:g}x gloo)" if i == 0 else None)
            floor = self._twohost_floor("bf16" if "bf16" in label else "f32", self.args.link_rate)
            if floor is not None:
                ax.hlines(floor.ms, x0, x1, colors="black", linestyles="--", lw=1.5,
                          label="protocol floor (this machine)" if i == 0 else None)
        ax.legend(fontsize=8)

    def chart(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(3, 2, figsize=(13, 13))
        panels: dict[str, list[Row]] = defaultdict(list)
        for row in self.rows:
            if " @ " in row.workload:
                continue  # the chart shows the two-host workload at --link-rate only
            kind = ("loopback" if row.workload.startswith("loopback") else "twohost" if row.workload.startswith("2 hosts")
                    else "small" if row.workload.startswith("small") else "memory")
            panels[kind].append(row)
        colors = {"flodl_trio": "#1f77b4", "gloo": "#ff7f0e"}

        def bars(ax: Any, rows: list[Row], title: str, metric: str) -> None:
            if not rows:
                ax.set_title(f"{title} (not run)")
                ax.axis("off")
                return
            labels = list(dict.fromkeys(r.workload for r in rows))
            width = 0.38

            def value(r: Row) -> float:
                if metric == "rate":
                    return r.result.rounds_per_s
                if metric == "mbps":
                    return r.model_bytes / (r.result.median_ms / 1e3) / 1e6
                if metric == "cpu":
                    return r.result.cpu_ms_per_round
                return r.result.median_ms

            for j, system in enumerate(("flodl_trio", "gloo")):
                vals = []
                for label in labels:
                    match = [r for r in rows if r.workload == label and r.result.system == system]
                    vals.append(value(match[0]) if match else 0)
                xs = [i + (j - 0.5) * width for i in range(len(labels))]
                ax.bar(xs, vals, width, label=system, color=colors[system])
                for x, v in zip(xs, vals):
                    ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels([l.replace("loopback ", "").replace("2 hosts x 2 ranks, 16 MiB, ", "") for l in labels],
                               rotation=20, fontsize=8)
            ax.set_ylabel({"rate": "rounds/s (higher is better)",
                           "mbps": "model MB / median round s (higher is better)",
                           "cpu": "CPU ms per round, all processes",
                           "ms": "median round ms (lower is better)"}[metric])
            ax.set_title(title)
            ax.legend(fontsize=8)

        bars(axes[0][0], panels["loopback"], "one host, loopback (ranks x MiB of f32)", "mbps")
        bars(axes[0][1], panels["twohost"], f"two namespaces, veth shaped to {self.args.link_rate}, 2+2 ranks, 16 MiB", "ms")
        self._mark_twohost_target_and_floor(axes[0][1], panels["twohost"], width=0.38)
        bars(axes[1][0], panels["small"], "4 KiB, 4 ranks, one host", "rate")
        bars(axes[2][0], panels["loopback"], "CPU per round, one host", "cpu")
        bars(axes[2][1], panels["twohost"], f"CPU per round, two hosts ({os.cpu_count()} cores shared)", "cpu")
        ax = axes[1][1]
        if self.memory:
            ws = sorted(self.memory)
            ax.plot(ws, [self.memory[w].rss_of("relay")[0] for w in ws], "o-", label="relay peak RSS")
            ax.plot(ws, [self.memory[w].rss_of("controller")[0] for w in ws], "s-", label="controller peak RSS")
            ax.axhline(RELAY_RSS_MODELS * 64 + RSS_HEADROOM_MIB, ls="--", color="C0", lw=0.8, label="relay target")
            ax.axhline(CONTROLLER_RSS_MODELS * 64 + RSS_HEADROOM_MIB, ls="--", color="C1", lw=0.8, label="controller target")
            ax.set_xticks(ws)
            ax.set_xlabel("local ranks (64 MiB f32 each)")
            ax.set_ylabel("MiB")
            ax.set_ylim(bottom=0)
            ax.set_title("flodl_trio daemon memory, one host")
            ax.legend(fontsize=8)
        else:
            ax.set_title("memory (not run)")
            ax.axis("off")
        fig.suptitle(f"flodl_trio vs torch.distributed gloo - {cpu_model()}, {os.cpu_count()} cores")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)


def machine_costs(suite: Suite) -> MachineCosts | None:
    """This machine's HMAC and loopback prices, measured in a child process.

    A child, so that this orchestrator's peak RSS (a floor under every
    process it starts) stays small; after waiting for a quiet machine when
    asked to, so that the prices are not inflated by other load.
    """
    if suite.args.wait_quiet > 0:
        wait_quiet(suite.args.wait_quiet)
    suite.log("measuring this machine's HMAC and loopback prices (the protocol floor)")
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure-costs"],
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        suite.notes.append("protocol floor not computed: measuring machine costs took over 120 s")
        return None
    if r.returncode != 0:
        suite.notes.append(f"protocol floor not computed: measuring machine costs failed: {r.stderr.strip()[-300:]}")
        return None
    return MachineCosts(**json.loads(r.stdout))


def code_version() -> str:
    """The flodl_trio source measured: git commit, and whether flodl_trio/ has local changes."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "flodl_trio"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    if not head:
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in flodl_trio/" if dirty else "")



def summarize_profiles(directory: Path, top: int = 12) -> str:
    """Top functions by self samples and by inclusive samples, per collapsed-stack file."""
    out = []
    for path in sorted(directory.glob("*.txt")):
        self_c: Counter[str] = Counter()
        incl: Counter[str] = Counter()
        total = 0
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit() or "importlib._bootstrap" in stack:
                continue  # start-up imports are not the round's cost
            n = int(count)
            total += n
            frames = stack.split(";")
            if frames:
                self_c[frames[-1]] += n
            for f in set(frames):
                if "flodl_trio" in f or "hashlib" in f or "hmac" in f or "numpy" in f or "torch" in f:
                    incl[f] += n
        if not total:
            continue
        out.append(f"== {path.name}: {total} samples (active threads, start-up imports excluded)")
        out.append("  self:")
        for f, n in self_c.most_common(top):
            out.append(f"    {100 * n / total:5.1f}%  {f}")
        out.append("  inclusive (flodl_trio / hashlib / numpy / torch frames):")
        for f, n in incl.most_common(top):
            out.append(f"    {100 * n / total:5.1f}%  {f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--timed-exec"]:
        timed_exec(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="loopback,twohost,small,memory",
                    help="comma-separated subset of loopback,twohost,small,memory (default: all)")
    ap.add_argument("--quick", action="store_true", help="a ~1 minute subset (fewer sizes and rounds)")
    ap.add_argument("--no-unix", action="store_true",
                    help="flodl_trio ranks reach their relay over TCP with MACs, not the Unix-socket local leg")
    ap.add_argument("--deterministic", action="store_true",
                    help="run flodl_trio's daemons with --deterministic (a fixed order of addition)")
    ap.add_argument("--star", action="store_true",
                    help="no reduction shards (--shards off, --shard off): the controller sums every lane "
                         "[default: the daemons' --shards auto]")
    ap.add_argument("--lanes", type=int, default=None,
                    help="run flodl_trio's daemons with --lanes N (each round reduced in up to N lanes; "
                    "1: whole frames; default: the daemons' own, 8)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "allreduce.png"), help="chart path (PNG)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--link-rate", default="1gbit", help="tc rate of the two-host veth (default 1gbit)")
    ap.add_argument("--also-link-rates", default="", metavar="RATES",
                    help="comma-separated tc rates (e.g. 500mbit,200mbit) to run the two-host workload at as "
                         "well; their ratios are printed as INFO lines, the targets are judged at --link-rate")
    ap.add_argument("--also-ranks-per-host", default="", metavar="COUNTS",
                    help="comma-separated rank counts per host (e.g. 4) to run the two-host workload with as well, "
                         "at --link-rate and every --also-link-rates; their ratios are printed as INFO lines")
    ap.add_argument("--rank-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for every rank process of both systems, as torchrun sets it "
                    "(default 1; 0 = inherit the environment)")
    ap.add_argument("--timing", action="store_true",
                    help="print ms per round each flodl_trio process spends in its hot functions (MAC, fold, codec)")
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                    help="before each run, wait up to SECONDS for other processes to leave the CPUs idle "
                    "(for shared machines; default 0 = do not wait)")
    ap.add_argument("--retries", type=int, default=0,
                    help="rerun a run during which other processes used more than "
                    f"{FOREIGN_LOAD_WARN} cores, up to this many times, keeping the least disturbed (default 0)")
    ap.add_argument("--profile", help="run flodl_trio processes under py-spy record; collapsed stacks go here")
    # internal: one rank process
    ap.add_argument("--worker", choices=["flodl", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="f32", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--cprofile", help=argparse.SUPPRESS)
    ap.add_argument("--windows", action="store_true", help=argparse.SUPPRESS)  # a Control round before each
    ap.add_argument("--measure-costs", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.measure_costs:
        print(json.dumps(asdict(measure_costs())))
        return 0

    if args.worker == "flodl":
        worker_flodl(args)
        return 0
    if args.worker == "gloo":
        worker_gloo(args)
        return 0

    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(wanted) - {"loopback", "twohost", "small", "memory"}
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}")
    for rate in [args.link_rate, *filter(None, args.also_link_rates.split(","))]:
        try:
            parse_rate(rate)  # tc would fail later, and look like a missing privilege
        except ValueError as exc:
            ap.error(str(exc))
    for count in filter(None, args.also_ranks_per_host.split(",")):
        if not count.strip().isdigit() or int(count) < 1:
            ap.error(f"--also-ranks-per-host takes positive rank counts, got {count!r}")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    # Keep this process small and torch-free: a child's ru_maxrss (from wait4) can
    # never be below its parent's peak RSS at fork time (Linux carries the
    # pre-exec mm's high-water mark over execve), so a heavy parent would
    # inflate every measured process.
    started = time.monotonic()
    version_at_start = code_version()
    with tempfile.TemporaryDirectory(prefix="flodl-bench-") as tmp:
        bench = Bench(args, Path(tmp))
        suite = Suite(bench, args)
        if {"loopback", "twohost"} & set(wanted):
            suite.costs = machine_costs(suite)
        try:
            for name, fn in (("loopback", suite.loopback), ("twohost", suite.twohost),
                             ("small", suite.small), ("memory", suite.memory_workload)):
                if name not in wanted:
                    continue
                try:
                    fn()
                except Exception as exc:  # report it, keep measuring the other workloads
                    suite.log(f"{name} workload failed: {exc}")
                    suite.notes.append(f"{name} workload FAILED to run: {type(exc).__name__}: {str(exc)[:500]}")
                    suite.checks.append((f"{name} workload ran", False, f"{type(exc).__name__}"))
                    bench.launcher.kill_all()
        finally:
            bench.launcher.kill_all()
    elapsed = time.monotonic() - started

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical cores, {mem:.0f} GiB RAM, {platform.machine()}, "
          f"Linux {platform.release()}")
    import resource
    from importlib.metadata import version

    print(f"python {platform.python_version()}, torch {version('torch')} (gloo), flodl_trio "
          f"{version('flodl_trio')}; controller launched via "
          f"{'python -m flodl_trio.controller' if bench.controller_cli else 'inline open_controller() launcher'}")
    version_at_end = code_version()
    print(f"flodl_trio source: {version_at_start}" + ("" if version_at_end == version_at_start else
          f" at the start, {version_at_end} at the end: the code changed during the run, results mix versions"))
    print(f"mode: {'quick' if args.quick else 'full'}, workloads: {','.join(wanted)}, wall time {elapsed:.0f} s, "
          f"rank processes OMP_NUM_THREADS={args.rank_threads if args.rank_threads > 0 else 'inherited'}")
    print("round time = slowest rank's perf_counter time per timed round (after warm-up), median over rounds; "
          "rounds/s = timed rounds / timed seconds (slowest rank); peak RSS = ru_maxrss from wait4, MiB")
    print(f"orchestrator peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          "(a lower bound of every ru_maxrss below)")
    busy = [r.result for r in suite.rows if r.result.foreign_cores > FOREIGN_LOAD_WARN]
    print(f"other load = average cores used by processes outside this benchmark during each run "
          f"(/proc/stat busy time minus this benchmark's CPU time); {len(busy)} of {len(suite.rows)} runs "
          f"above {FOREIGN_LOAD_WARN} cores" + (": their times are suspect, rerun on a quiet machine" if busy else ""))
    if suite.costs is not None:
        print(f"protocol floor = the shortest round any implementation of flodl's protocol could reach here: "
              f"only its mandatory hash passes and loopback copies, perfectly spread over every core, plus the "
              f"link time that cannot overlap (benchmarks/_floor.py); machine costs: {suite.costs.describe()}")
    for note in suite.notes:
        print(f"note: {note}")
    print()
    print(suite.table())
    print()
    failed = 0
    for name, ok, got in suite.checks:
        label = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{label}: {name} (got {got})")
        failed += ok is False
    for line in suite.sweep:
        print(f"INFO (not a target): {line}")
    if suite.rows or suite.memory:
        suite.chart(Path(args.out))
        print(f"\nchart: {args.out}")
    if args.json:
        raw = [
            {"workload": r.workload, "system": r.result.system, "median_ms": r.result.median_ms,
             "rounds_per_s": r.result.rounds_per_s, "round_s": r.result.round_s, "rss_mib": r.result.rss,
             "link_bytes_per_round": r.result.link_bytes, "links": r.links,
             "foreign_cores": r.result.foreign_cores}
            for r in suite.rows
        ]
        costs = asdict(suite.costs) if suite.costs is not None else None
        Path(args.json).write_text(json.dumps({"rows": raw, "checks": suite.checks, "sweep": suite.sweep,
                                               "machine_costs": costs}, indent=1))
    if args.timing:
        print("\ntiming: ms per round (warm-up included) each process spent inside each function "
              "(sync: trio thread blocked; async: wall; RunningMac.feed: any thread)")
        for row in suite.rows:
            r = row.result
            if not r.timing:
                continue
            print(f"\n{row.workload} ({r.system}, median round {r.median_ms:.0f} ms):")
            print("  CPU ms per round: " + ", ".join(f"{k} {v:.0f}" for k, v in r.cpu_ms.items()))
            for proc, fns in r.timing.items():
                parts = sorted(fns.items(), key=lambda kv: -kv[1][1])
                text = ", ".join(f"{fn} {t * 1e3 / r.rounds_run:.1f} ({n / r.rounds_run:.3g} calls)"
                                 for fn, (n, t) in parts if t * 1e3 / r.rounds_run >= 0.05)
                print(f"  {proc}: {text}")
    if args.profile:
        print("\nprofile (py-spy, collapsed stacks in " + args.profile + "):")
        print(summarize_profiles(Path(args.profile)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
