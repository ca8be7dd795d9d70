"""Round time as hosts are added: flodl_trio next to torch.distributed gloo on H simulated hosts.

Run from the repository root, as root (it builds network namespaces)::

    python benchmarks/scale.py                            # H = 2, 4, 8; 200 Mbit/s links; ~3 minutes
    python benchmarks/scale.py --hosts 2,4 --rate 1gbit --ranks-per-host 2
    python benchmarks/scale.py --lanes 1                  # every daemon without lanes
    python benchmarks/scale.py --codec int8:1024 --star   # coded deltas, the star (or through the shards)

Each host is a network namespace with one veth to a bridge in this namespace;
every host's link is shaped both ways with ``tc tbf`` (its egress in the
namespace, its ingress on the bridge side), so a host sends and receives at
``--rate`` at most, as a host on a switch does. The controller runs on host 0
(as docs/operations.md allows), one data relay per host, ``--ranks-per-host``
rank processes per host; gloo runs one process per rank, its ring over the
same links. Both systems reduce ``--mib`` (default 8 MiB for H <= 4, 4 MiB
beyond) of f32 in place; the rank workers, their timing and the table's
round time (the slowest rank's, median over the timed rounds) are
benchmarks/allreduce.py's.

Beside each pair the table prints two link floors for that round:

* the star's: host 0's link carries the frame of each of the H - 1 other
  hosts in and the consensus out to each of them, (H - 1) x frame / rate (the
  two directions overlap; flodl_trio's lanes overlap them within a round);
* the ring's: each link carries 2 (H - 1) / H x frame each way.

The star's floor grows with H and the ring's does not: that is the gap a
sharded reduction closes (issue 26). The last two columns are measured: the
bytes host 0 and the busiest other host received per round (the bridge-side
veth's tx counter, warm-up rounds included). This is a benchmark, not a test: pytest
never collects it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from _floor import parse_rate  # this script's folder is on sys.path
from allreduce import Bench, Host, RunResult, summarize_profiles

MiB = 1 << 20
SUBNET = "10.231.8"


class NetnsSwitch:
    """H namespaces on one bridge, every host's veth shaped to ``rate`` both ways."""

    def __init__(self, count: int, rate: str) -> None:
        tag = f"{os.getpid() % 10000}{secrets.token_hex(1)}"
        self.bridge = f"flsw{tag}"[:15]
        self.ns = [f"flscale-{tag}-{i}" for i in range(count)]
        self.inside = [f"fls{tag}i{i}"[:15] for i in range(count)]
        self.outside = [f"fls{tag}o{i}"[:15] for i in range(count)]
        self.ip = [f"{SUBNET}.{10 + i}" for i in range(count)]
        self.rate = rate
        self._undo: list[list[str]] = []

    @staticmethod
    def _run(*argv: str) -> None:
        r = subprocess.run(list(argv), capture_output=True, text=True)
        if r.returncode != 0:
            raise PermissionError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")

    def _shape(self, *where: str) -> None:
        self._run("tc", *where, "root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms")

    def __enter__(self) -> NetnsSwitch:
        try:
            self._run("ip", "link", "add", self.bridge, "type", "bridge")
            self._undo.append(["ip", "link", "del", self.bridge])
            self._run("ip", "link", "set", self.bridge, "up")
            for ns, inside, outside, ip in zip(self.ns, self.inside, self.outside, self.ip):
                self._run("ip", "netns", "add", ns)
                self._undo.append(["ip", "netns", "del", ns])
                self._run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
                self._undo.append(["ip", "link", "del", outside])
                self._run("ip", "link", "set", inside, "netns", ns)
                self._run("ip", "link", "set", outside, "master", self.bridge, "up")
                self._run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", inside)
                self._run("ip", "-n", ns, "link", "set", inside, "up")
                self._run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape("qdisc", "add", "dev", outside)  # what the host receives
                self._shape("-n", ns, "qdisc", "add", "dev", inside)  # what it sends
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for argv in reversed(self._undo):
            subprocess.run(argv, capture_output=True)
        self._undo.clear()

    def received(self) -> list[int]:
        """Bytes each host has received so far: what its bridge-side veth sent it."""
        out = []
        for dev in self.outside:
            r = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", dev], capture_output=True, text=True)
            out.append(int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"]))
        return out

    def hosts(self, ranks_per_host: int) -> list[Host]:
        return [
            Host(f"host{i}", list(range(i * ranks_per_host, (i + 1) * ranks_per_host)), ns, ip, dev)
            for i, (ns, ip, dev) in enumerate(zip(self.ns, self.ip, self.inside))
        ]


def frame_bytes(mib: float) -> float:
    return mib * MiB  # f32 payload; the headers and MACs are noise at this size


def star_floor_ms(hosts: int, mib: float, rate_bps: float) -> float:
    return 1e3 * (hosts - 1) * frame_bytes(mib) * 8 / rate_bps


def ring_floor_ms(hosts: int, mib: float, rate_bps: float) -> float:
    return 1e3 * 2 * (hosts - 1) / hosts * frame_bytes(mib) * 8 / rate_bps


def received(result: RunResult) -> str:
    """What host 0 and the busiest other host received per round, in MiB."""
    return " / ".join(f"{v / MiB:.1f}" for v in result.link_bytes.values()) + " MiB"


def peak_rss(result: RunResult) -> str:
    """The largest peak RSS of each kind of daemon, in MiB (a dash: none ran)."""
    return " / ".join(
        f"{max(result.rss_of(role)):.0f}" if result.rss_of(role) else "-" for role in ("relay", "shard", "controller")
    ) + " MiB"


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """What benchmarks/allreduce.py's Bench reads of its command line."""
    return argparse.Namespace(
        profile=args.profile, timing=False, deterministic=False, lanes=args.lanes, no_unix=False,
        rank_threads=1, shards=args.shards or args.relay_shards, relay_shards=args.relay_shards, star=args.star,
        outer=args.outer,
    )


def measure(
    bench: Bench, switch: NetnsSwitch, ranks_per_host: int, mib: float, warmup: int, rounds: int, dtype: str = "f32",
) -> tuple[RunResult, RunResult]:
    """Both systems on the switch's hosts (flodl_trio's rounds in ``dtype``: f32 or a
    delta codec; gloo's f32); each result's ``link_bytes`` holds what host 0 and the
    busiest other host received per round (warm-up rounds included)."""
    numel = int(mib * MiB) // 4
    hosts = switch.hosts(ranks_per_host)
    results = []
    for run in (lambda: bench.run_flodl(hosts, numel, dtype, warmup, rounds, f"scale-{len(hosts)}"),
                lambda: bench.run_gloo(hosts, numel, "f32", warmup, rounds)):
        before = switch.received()
        result = run()
        per_round = [(b - a) / (warmup + rounds) for a, b in zip(before, switch.received())]
        result.link_bytes = {"host 0": per_round[0], "others (max)": max(per_round[1:])}
        results.append(result)
    return results[0], results[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="2,4,8", help="host counts, comma-separated (default 2,4,8)")
    parser.add_argument("--rate", default="200mbit", help="every host link's rate, each way (tc syntax)")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--mib", type=float, default=None,
                        help="model size in MiB (default: 8 up to 4 hosts, 4 beyond)")
    parser.add_argument("--lanes", type=int, default=8, help="--lanes of the controller and relays (default 8)")
    parser.add_argument("--shards", action="store_true", help="a shard process on every host, named by --shards")
    parser.add_argument("--relay-shards", action="store_true",
                        help="a reduction shard on every host, served by its relay daemon and named by --shards")
    parser.add_argument("--star", action="store_true",
                        help="no shards: the controller sums every lane (default: the daemons' --shards auto, "
                             "each relay serving and offering its host's shard)")
    parser.add_argument("--outer", choices=["average", "diloco", "slowmo"],
                        help="the controller's --outer, each round a window (a Control round, then params): "
                        "with diloco or slowmo the shards step each and mirror it to their backup; average "
                        "steps nothing")
    parser.add_argument("--codec", metavar="CODE:BLOCK",
                        help="flodl_trio's rounds as coded deltas (int8:1024, fp4:256, ...; gloo stays f32): "
                        "through the shards, or with --star to the controller")
    parser.add_argument("--profile", metavar="DIR",
                        help="run every flodl_trio process under py-spy record (collapsed stacks in DIR, "
                        "summarized at the end)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("scale.py builds network namespaces: run it as root", file=sys.stderr)
        return 2
    rate_bps = parse_rate(args.rate)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="flodl-scale-") as tmp:
        bench = Bench(bench_args(args), Path(tmp))
        for count in (int(h) for h in args.hosts.split(",")):
            mib = args.mib if args.mib is not None else (8.0 if count <= 4 else 4.0)
            with NetnsSwitch(count, args.rate) as switch:
                flodl, gloo = measure(bench, switch, args.ranks_per_host, mib, args.warmup, args.rounds,
                                      args.codec or "f32")
            rows.append((count, mib, flodl, gloo))
            print(f"  {count} hosts: flodl_trio {flodl.median_ms:.0f} ms, gloo {gloo.median_ms:.0f} ms", flush=True)
    print(f"\n{args.ranks_per_host} rank(s) per host, every host link {args.rate} each way (tbf), "
          f"controller on host 0, --lanes {args.lanes}{f', --outer {args.outer}' if args.outer else ''}, "
          f"{f'flodl_trio {args.codec} deltas, gloo f32' if args.codec else 'f32 both sides'}, "
          f"median of {args.rounds} rounds (the floors are f32's):\n")
    print("| hosts | model | flodl_trio | gloo | ratio | star floor | ring floor | CPU floor (flodl_trio) "
          "| received per round, host 0 / busiest other: flodl_trio | gloo | peak RSS, largest relay / shard / controller |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count, mib, flodl, gloo in rows:
        cpu_floor = flodl.cpu_ms_per_round / (os.cpu_count() or 1)
        print(f"| {count} | {mib:g} MiB | {flodl.median_ms:.0f} ms | {gloo.median_ms:.0f} ms | "
              f"{flodl.median_ms / gloo.median_ms:.2f}x | {star_floor_ms(count, mib, rate_bps):.0f} ms | "
              f"{ring_floor_ms(count, mib, rate_bps):.0f} ms | {cpu_floor:.0f} ms | "
              f"{received(flodl)} | {received(gloo)} | {peak_rss(flodl)} |")
    print("\nCPU per round by role (all processes of the role, ms; a relay's child shard counts with it):\n")
    print("| hosts | flodl_trio ranks | relays | shards | controller | gloo ranks |")
    print("|---:|---:|---:|---:|---:|---:|")
    for count, _mib, flodl, gloo in rows:
        print(f"| {count} | " + " | ".join(f"{cpu_of_role(flodl, role):.0f}" for role in ("rank", "relay", "shard", "controller"))
              + f" | {cpu_of_role(gloo, 'rank'):.0f} |")
    if args.profile:
        print("\n" + summarize_profiles(Path(args.profile)))
    return 0


def cpu_of_role(result: RunResult, prefix: str) -> float:
    """CPU ms per timed round of every process whose name starts with ``prefix``."""
    return sum(ms for name, ms in result.cpu_ms.items() if name.startswith(prefix))


if __name__ == "__main__":
    sys.exit(main())
