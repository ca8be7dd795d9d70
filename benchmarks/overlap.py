"""Training throughput when the network is in the way: inner steps per second.

Run from the repository root, as root (the two hosts are network namespaces)::

    python benchmarks/overlap.py                        # 1 Gbit/s and 200 Mbit/s, the loss runs: ~15 minutes
    python benchmarks/overlap.py --convergence-windows 0  # the throughput table alone, ~3 minutes
    python benchmarks/overlap.py --rates 200mbit --windows 6 --out /tmp/overlap.png

Two network namespaces joined by a veth pair shaped with ``tc tbf`` (the
setup of ``benchmarks/allreduce.py``), 2 ranks in each, a 16 MiB f32 model,
flodl_trio's daemons with ``--lanes 8`` (``--lanes``; docs/operations.md's
setting for a link-bound cluster of several hosts),
``--sync-every`` (H) inner steps per window. An inner step is a fixed wait
(``--step-time``): a stand-in for accelerator time that leaves the CPU free,
as a GPU kernel does, so the table shows what the network costs a GPU
trainer rather than how CPU-bound torch steps compete with the data plane
for this machine's two cores. Each rank reports its inner steps per second
between the end of its first window and the end of its last (start-up, the
first window and the drain of the last round left out: a long run amortizes
them), and the time it was held up by rounds. Systems:

* (a) ``none``: no communication at all, the ceiling;
* (b) ``gloo``: ``torch.distributed`` gloo, a synchronous ``all_reduce``
  (then a divide) every H steps;
* (c) ``flodl sync``: flodl_trio's :class:`~flodl_trio.train.trainer.WindowTrainer`,
  ``overlap=0`` (every window's counts, params and buffers rounds waited for);
* (d) ``flodl overlap``: the same with ``overlap=1``;
* (e) ``flodl fragments``: overlapped, the params in P = 4 fragments (a
  quarter of the tensor's elements each, one synced every H/4 steps).

Peak bandwidth: the veth's byte counters are read every ~20 ms during each
run (``/proc/<pid>/net/dev`` of a rank in host A: no process started per
sample); the table shows, per run, the most bytes one direction carried in
any interval of H/8 inner steps (half the sync gap of (e), so that one
interval holds at most one fragment round), as MB/s. Where a whole-model
round cannot cross within that interval (200 Mbit/s: 1.3 s per direction)
both schedules run the link at its rate and the peak is the link's; the
P = 4 target is checked at the fastest rate, where the link does not cap it.

Convergence (``--convergence-windows``, 0 to skip): the demo's model (an MLP
on synthetic data, AdamW inner steps, DiLoCo outer steps; ``python -m
flodl_trio.demo``, no rank killed) trained with H inner steps per window,
``--seeds`` seeds per schedule; the loss is the cluster model's (the newest
checkpoint: every fragment's newest consensus). On this machine the demo's
inner steps take about a millisecond of CPU, so a round lands many more steps
late than on a GPU host; the overlapped schedules are therefore also run with
``merge_after`` set to the steps (d) and (e) actually merged after in the
throughput run at each rate (a fixed merge point reproduces that staleness
exactly, whatever this machine's timing). The ranks train the steps before a
consensus lands from their boundary params; one row uses the eager stand-in
instead (the demo's ``--eager-stand-in``). A second table sweeps the merge
point of the whole model (``--staleness``): how late a DiLoCo round may land.

Targets (PASS/FAIL lines): (d) >= 0.95 x (a) at every rate; (d) >= 1.5 x (b)
at 200 Mbit/s; (e)'s peak bandwidth at most 1/3 of (d)'s at the fastest
rate; (d)'s and (e)'s
mean final loss within 2% of (c)'s at each rate's measured staleness. Prints
markdown tables and draws a chart (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import allreduce as ar  # noqa: E402  (the netns pair and process launcher)

NUMEL = 4 * 1024 * 1024  # 16 MiB of f32
SYSTEMS = ("none", "gloo", "flodl sync", "flodl overlap", "flodl fragments")
FRAGMENTS = 4
OVERLAP_VS_NONE = 0.95
PEAK_FRAGMENTS_VS_WHOLE = 1 / 3
OVERLAP_VS_GLOO_AT_200 = 1.5
LOSS_TOLERANCE = 0.02
CLUSTER_LOSS = re.compile(r"cluster model's validation loss\s*\|\s*([0-9.]+)")
MERGED_AFTER = re.compile(r"inner steps before each consensus was merged\s*\|\s*median (\d+)")
TIMEOUT_S = 300


# -- rank processes ---------------------------------------------------------------


def _report(boundaries: list[float], sync_every: int, waited: float, late_steps: list[int] | None = None) -> None:
    """Steps/s between the first and the last window boundary."""
    span = boundaries[-1] - boundaries[0]
    steps = sync_every * (len(boundaries) - 1)
    late = statistics.median(late_steps) if late_steps else None
    print(json.dumps({"steps_per_s": steps / span if span > 0 else 0.0, "waited_s": waited, "late_steps": late}),
          flush=True)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    params = [torch.full((args.numel,), float(args.rank))]  # one tensor: a fragment is a run of its elements
    boundaries: list[float] = []
    if args.system == "none":
        for _window in range(args.windows):
            for _ in range(args.sync_every):
                time.sleep(args.step_time)
            boundaries.append(time.perf_counter())
        _report(boundaries, args.sync_every, 0.0)
    elif args.system == "gloo":
        _gloo_worker(args, params[0], boundaries)
    else:
        import trio

        trio.run(_flodl_worker, args, params, boundaries)


def _gloo_worker(args: argparse.Namespace, t: object, boundaries: list[float]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=120))
    waited = 0.0
    for window in range(args.windows):
        for _ in range(args.sync_every):
            time.sleep(args.step_time)
        started = time.perf_counter()
        dist.all_reduce(t)  # type: ignore[arg-type]
        t /= args.world  # type: ignore[operator]
        now = time.perf_counter()
        if window > 0:
            waited += now - started
        boundaries.append(now)
    dist.destroy_process_group()
    _report(boundaries, args.sync_every, waited)


async def _flodl_worker(args: argparse.Namespace, params: list[object], boundaries: list[float]) -> None:
    from flodl_trio import connect_reduce_client
    from flodl_trio.train.trainer import open_window_trainer

    host, _, port = args.addr.rpartition(":")
    salt = bytes.fromhex(os.environ["FLODL_SALT_HEX"])

    def inner_step() -> None:
        time.sleep(args.step_time)

    held: list[float] = []  # time held up by rounds, at each boundary
    async with connect_reduce_client((host, int(port)), args.rank, args.world, salt) as client:
        async with open_window_trainer(
            client, params, rank=args.rank, world_size=args.world, sync_every=args.sync_every,  # type: ignore[arg-type]
            overlap=0 if args.system == "flodl sync" else 1,
            fragments=FRAGMENTS if args.system == "flodl fragments" else 1,
        ) as trainer:
            for _window in range(args.windows):
                await trainer.run_steps(args.sync_every, inner_step)
                boundaries.append(time.perf_counter())
                held.append(trainer.stats.waited_s)
    _report(boundaries, args.sync_every, held[-1] - held[0], trainer.stats.late_steps[1:-1])


# -- the orchestrator ----------------------------------------------------------------


def peak_interval(args: argparse.Namespace) -> float:
    """Half the sync gap of the fragmented schedule, in seconds."""
    return args.sync_every / FRAGMENTS / 2 * args.step_time


class VethSampler:
    """Byte counters of host A's veth end, read from ``/proc/<pid>/net/dev`` of a process
    inside host A's namespace (tx: A->B, rx: B->A)."""

    def __init__(self, pid: int, dev: str) -> None:
        self.path, self.dev = Path(f"/proc/{pid}/net/dev"), dev
        self.samples: list[tuple[float, int, int]] = []

    def poll(self) -> None:
        try:
            text = self.path.read_text()
        except OSError:
            return  # the process is gone
        for line in text.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == self.dev:
                fields = counters.split()
                self.samples.append((time.monotonic(), int(fields[8]), int(fields[0])))

    def peak_rate(self, interval: float) -> float:
        """The most bytes either direction carried in any ``interval`` seconds, per second."""
        best = 0
        start = 0
        for end, (t, tx, rx) in enumerate(self.samples):
            while t - self.samples[start][0] > interval:
                start += 1
            _, tx0, rx0 = self.samples[start]
            best = max(best, tx - tx0, rx - rx0)
            del end
        return best / interval


def run_system(launcher: ar.Launcher, pair: ar.NetnsPair, system: str, args: argparse.Namespace,
               env: dict[str, str]) -> list[dict[str, float]]:
    hosts = pair.hosts(2)
    world = sum(len(h.ranks) for h in hosts)
    daemons, ranks = [], []
    common = ["--windows", str(args.windows), "--sync-every", str(args.sync_every), "--step-time",
              str(args.step_time), "--numel", str(NUMEL), "--world", str(world), "--system", system]
    if system.startswith("flodl"):
        ctl = hosts[0]
        daemons.append(launcher.spawn(
            "controller", "controller",
            [sys.executable, "-m", "flodl_trio.controller", "--host", ctl.ip, "--port", "29400", "--world-size",
             str(world), "--log-level", "WARNING"], env, ctl.netns))
        for h in hosts:
            daemons.append(launcher.spawn(
                f"relay-{h.name}", "relay",
                [sys.executable, "-m", "flodl_trio.relay", "--controller", f"{ctl.ip}:29400", "--ranks",
                 ",".join(map(str, h.ranks)), "--world-size", str(world), "--host-name", h.name, "--channels", "data",
                 "--data-port", "29404", "--log-level", "WARNING"], env, h.netns))
    for h in hosts:
        addr = f"{hosts[0].ip}:29500" if system == "gloo" else "127.0.0.1:29404"
        rank_env = {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": h.ifname}
        for r in h.ranks:
            ranks.append(launcher.spawn(
                f"rank{r}", "rank",
                [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(r), "--addr", addr, *common],
                rank_env, h.netns))
    sampler = VethSampler(ranks[0].popen.pid, hosts[0].ifname)
    try:
        launcher.wait(ranks, TIMEOUT_S, poll=sampler.poll)
        launcher.wait(daemons, 60)
    except BaseException:
        for p in [*ranks, *daemons]:
            sys.stderr.write(f"--- {p.name} ---\n{p.stderr_tail(1500)}\n")
        launcher.kill_all()
        raise
    failed = [p for p in ranks if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{system}: {', '.join(p.name for p in failed)} failed: {failed[0].stderr_tail(1500)}")
    reports = [json.loads(p.stdout().strip().splitlines()[-1]) for p in ranks]
    peak = sampler.peak_rate(peak_interval(args))
    return [{**r, "peak_bytes_per_s": peak} for r in reports]


def measure(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    workdir = Path(tempfile.mkdtemp(prefix="flodl-overlap-"))
    launcher = ar.Launcher(workdir, None)
    env = {**os.environ, "FLODL_SALT_HEX": secrets.token_hex(16), "PYTHONUNBUFFERED": "1"}
    env["FLODL_LANES"] = str(args.lanes)  # the controller's, which both relays take (1: whole frames)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for rate in args.rates.split(","):
        results[rate] = {}
        for system in SYSTEMS:
            with ar.NetnsPair(rate) as pair:
                print(f"[{time.strftime('%H:%M:%S')}] {rate}: {system}", file=sys.stderr, flush=True)
                per_rank = run_system(launcher, pair, system, args, env)
            late = [r["late_steps"] for r in per_rank if r.get("late_steps") is not None]
            results[rate][system] = {
                "steps_per_s": min(r["steps_per_s"] for r in per_rank),  # the job moves at its slowest rank
                "waited_s": statistics.mean(r["waited_s"] for r in per_rank),
                "peak_bytes_per_s": per_rank[0]["peak_bytes_per_s"],
                "late_steps": max(late) if late else None,
            }
    return results


def table(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> tuple[str, list[str]]:
    lines = [
        "| link | system | inner steps/s | vs no communication | vs gloo | held up by rounds per window "
        "| merged after (steps) | peak MB/s over H/8 steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    checks = []
    fastest = max(results, key=lambda rate: results[rate]["gloo"]["steps_per_s"])
    for rate, by_system in results.items():
        none, gloo = by_system["none"]["steps_per_s"], by_system["gloo"]["steps_per_s"]
        for system, r in by_system.items():
            rate_s = r["steps_per_s"]
            held = r["waited_s"] / max(args.windows - 1, 1)
            late = "" if r.get("late_steps") is None else f"{r['late_steps']:g}"
            lines.append(f"| {rate} | {system} | {rate_s:.2f} | {rate_s / none:.3f}x | {rate_s / gloo:.2f}x "
                         f"| {held * 1e3:.0f} ms | {late} | {r['peak_bytes_per_s'] / 1e6:.1f} |")
        overlap = by_system["flodl overlap"]["steps_per_s"]
        whole, fragments = by_system["flodl overlap"]["peak_bytes_per_s"], by_system["flodl fragments"]["peak_bytes_per_s"]
        if rate == fastest:
            checks.append(f"{'PASS' if fragments <= PEAK_FRAGMENTS_VS_WHOLE * whole else 'FAIL'}: {rate}: "
                          f"P = {FRAGMENTS} peak bandwidth <= 1/3 of P = 1 (got {fragments / whole:.2f})")
        checks.append(f"{'PASS' if overlap >= OVERLAP_VS_NONE * none else 'FAIL'}: {rate}: flodl overlap >= "
                      f"{OVERLAP_VS_NONE} x no communication (got {overlap / none:.3f}x)")
        if rate.lower().startswith("200m"):
            checks.append(f"{'PASS' if overlap >= OVERLAP_VS_GLOO_AT_200 * gloo else 'FAIL'}: {rate}: flodl overlap >= "
                          f"{OVERLAP_VS_GLOO_AT_200} x gloo (got {overlap / gloo:.2f}x)")
    return "\n".join(lines), checks


def chart(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.16
    for i, system in enumerate(SYSTEMS):
        values = [results[rate][system]["steps_per_s"] for rate in rates]
        ax.bar([x + (i - 2) * width for x in range(len(rates))], values, width, label=system)
    ax.set_xticks(range(len(rates)), rates)
    ax.set_ylabel("inner steps per second (slowest rank)")
    ax.set_title("2 hosts x 2 ranks, 16 MiB model: what the network costs the trainer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def demo_loss(args: argparse.Namespace, options: list[str], seed: int) -> tuple[float, int | None]:
    """One demo training run: the cluster model's final validation loss, and the median
    number of steps each consensus was merged after (overlapped runs)."""
    out = subprocess.run(
        [sys.executable, "-m", "flodl_trio.demo", "--kill-at", "0", "--windows", str(args.convergence_windows),
         "--inner-steps", str(args.sync_every), "--seed", str(seed), *options, "--plot",
         str(Path(tempfile.mkdtemp(prefix="flodl-overlap-demo-")) / "demo.png")],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=True,
    )
    loss, merged = CLUSTER_LOSS.search(out.stdout), MERGED_AFTER.search(out.stdout)
    if loss is None:
        raise RuntimeError(f"demo {' '.join(options)}: no cluster loss in its summary:\n{out.stdout[-2000:]}")
    return float(loss.group(1)), None if merged is None else int(merged.group(1))


def _staleness_sweep(args: argparse.Namespace) -> list[int]:
    """The merge points of the staleness sweep (``--staleness``), within the window."""
    steps = [int(k) for k in args.staleness.split(",") if k.strip()]
    bad = [k for k in steps if not 1 <= k <= args.sync_every]
    if bad:
        raise SystemExit(f"--staleness: merge points must be 1..{args.sync_every} (H), got {bad}")
    return steps


def convergence(args: argparse.Namespace, results: dict[str, dict[str, dict[str, float]]]) -> tuple[str, list[str]]:
    """The demo's training under each schedule, ``--seeds`` seeds each: mean final loss."""
    slowest = min(results, key=lambda rate: results[rate]["gloo"]["steps_per_s"])
    gap = args.sync_every // FRAGMENTS

    def stale(rate: str, system: str) -> int:
        """The steps (d) or (e) merged after in the throughput run at ``rate`` (at least 1)."""
        steps = max(1, int(round(results[rate][system]["late_steps"] or 1)))
        return min(gap, steps) if system == "flodl fragments" else steps

    staleness = {system: stale(slowest, system) for system in ("flodl overlap", "flodl fragments")}
    schedules = {"(c) flodl sync": ["--overlap", "0"]}
    checked = []  # the rows the 2% target is checked on: (d) and (e) at each rate's measured staleness
    for rate in results:
        d, e = stale(rate, "flodl overlap"), stale(rate, "flodl fragments")
        schedules[f"(d) flodl overlap, merged after {d} steps (as measured at {rate})"] = [
            "--overlap", "1", "--merge-after", str(d)]
        schedules[f"(e) P = {FRAGMENTS} fragments, merged after {e} steps (as measured at {rate})"] = [
            "--overlap", "1", "--fragments", str(FRAGMENTS), "--merge-after", str(e)]
        checked += list(schedules)[-2:]
    schedules |= {
        f"(d) with the eager stand-in (--eager-stand-in), merged after {staleness['flodl overlap']} steps":
            ["--overlap", "1", "--eager-stand-in", "--merge-after", str(staleness["flodl overlap"])],
        "(d) flodl overlap, merged when it lands on this CPU": ["--overlap", "1"],
        f"(e) P = {FRAGMENTS} fragments, merged when they land on this CPU":
            ["--overlap", "1", "--fragments", str(FRAGMENTS)],
        f"P = {FRAGMENTS} fragments, synchronous": ["--overlap", "0", "--fragments", str(FRAGMENTS)],
        "plain averaging (--outer none), synchronous": ["--outer", "none", "--overlap", "0"],
        f"plain averaging, overlap merged after {staleness['flodl overlap']} steps":
            ["--outer", "none", "--overlap", "1", "--merge-after", str(staleness["flodl overlap"])],
        f"plain averaging, P = {FRAGMENTS} fragments, synchronous":
            ["--outer", "none", "--overlap", "0", "--fragments", str(FRAGMENTS)],
        f"plain averaging, P = {FRAGMENTS} fragments merged after {staleness['flodl fragments']} steps":
            ["--outer", "none", "--overlap", "1", "--fragments", str(FRAGMENTS), "--merge-after",
             str(staleness["flodl fragments"])],
    }
    sweep = {k: f"(d) merged after {k} steps" for k in _staleness_sweep(args)}
    schedules |= {name: ["--overlap", "1", "--merge-after", str(k)] for k, name in sweep.items()}
    runs: dict[tuple[str, ...], tuple[list[float], list[int]]] = {}  # by options: a schedule listed twice runs once
    for name, options in schedules.items():
        if tuple(options) in runs:
            continue
        losses_, merged_ = runs[tuple(options)] = ([], [])
        for seed in range(args.seeds):
            print(f"[{time.strftime('%H:%M:%S')}] convergence: {name}, seed {seed}", file=sys.stderr, flush=True)
            loss, after = demo_loss(args, options, seed)
            losses_.append(loss)
            if after is not None:
                merged_.append(after)
    losses = {name: runs[tuple(options)][0] for name, options in schedules.items() if name not in sweep.values()}
    merged = {name: runs[tuple(options)][1] for name, options in schedules.items() if runs[tuple(options)][1]}
    base = statistics.mean(losses["(c) flodl sync"])
    lines = [
        f"| schedule ({args.convergence_windows} windows x H = {args.sync_every}, DiLoCo unless said, {args.seeds} seeds) "
        "| mean final loss | vs synchronous, same outer | spread over seeds | merged after (median steps) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in losses.items():
        mean = statistics.mean(values)
        after = f"{statistics.median(merged[name]):g}" if name in merged else ""
        reference = statistics.mean(losses["plain averaging (--outer none), synchronous"]) if "plain" in name else base
        lines.append(f"| {name} | {mean:.4f} | {mean / reference:.3f}x | {min(values):.4f}-{max(values):.4f} | {after} |")
    if sweep:
        lines += ["", "| DiLoCo, whole model, merged after (steps of H = "
                  f"{args.sync_every}) | mean final loss | vs synchronous | spread over seeds |", "|---:|---:|---:|---:|"]
        for k, name in sweep.items():
            values = runs[tuple(schedules[name])][0]
            mean = statistics.mean(values)
            lines.append(f"| {k} | {mean:.4f} | {mean / base:.3f}x | {min(values):.4f}-{max(values):.4f} |")
    checks = []
    for name in checked:
        ratio = statistics.mean(losses[name]) / base
        ok = ratio <= 1 + LOSS_TOLERANCE
        where = name.rsplit("(as measured at ", 1)[-1].rstrip(")")
        checks.append(f"{'PASS' if ok else 'FAIL'}: {name.split(',')[0]} at {where}'s staleness: mean final loss "
                      f"within {LOSS_TOLERANCE:.0%} of (c)'s (got {ratio:.3f}x)")
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,200mbit", help="tc rates of the veth (comma-separated)")
    parser.add_argument("--lanes", type=int, default=8,
                        help="flodl_trio's daemons reduce each round in this many lanes (1: none)")
    parser.add_argument("--windows", type=int, default=6, help="windows per run (the first is warm-up)")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps per window (H)")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds one inner step waits")
    parser.add_argument("--convergence-windows", type=int, default=40,
                        help="windows of the demo's training per schedule (0: skip the convergence runs)")
    parser.add_argument("--staleness", default="5,9,12,13,14,15,17",
                        help="merge points (steps) of the whole-model staleness sweep, comma-separated ('' to skip)")
    parser.add_argument("--seeds", type=int, default=3, help="convergence runs per schedule")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "overlap.png"), help="chart path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, default=NUMEL, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    started = time.monotonic()
    results = measure(args)
    text, checks = table(results, args)
    if args.convergence_windows > 0:
        loss_text, loss_checks = convergence(args, results)
        text += "\n\n" + loss_text
        checks += loss_checks
    print(f"2 hosts x 2 ranks, 16 MiB f32 (one tensor), H = {args.sync_every} inner steps of {args.step_time * 1e3:.0f} ms, "
          f"{args.windows} windows per run (the first left out); wall time {time.monotonic() - started:.0f} s\n")
    print(text)
    print()
    print("\n".join(checks))
    chart(results, Path(args.out))
    print(f"\nchart: {args.out}")
    return 0 if all(c.startswith("PASS") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
