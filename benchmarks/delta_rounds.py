"""Delta rounds on the wire: two netns hosts x 2 ranks, 16 MiB of f32 params, every
host link shaped with tc tbf, flodl_trio's params rounds in f32 and as int8 / fp4
deltas against torch.distributed gloo's f32 ring in the same run (docs/wire.md,
"Delta rounds"). Prints one table: median round time, the ratio to gloo f32, and
the two floors - the link's one-way time for one frame, and this machine's codec
CPU time for one encode and one decode of it (benchmarks/quant.py measures the
codes alone).

    python benchmarks/delta_rounds.py                 # 200mbit and 1gbit, lanes 1 and 8
    python benchmarks/delta_rounds.py --rates 200mbit --rounds 8 --lanes 8
    python benchmarks/delta_rounds.py --wires fp4 --lanes 8 --profile /tmp/prof  # where the CPU went

Needs root (network namespaces). A round here is one delta exchange (no step-count
round), timed at the rank from send to the consensus applied.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import allreduce  # noqa: E402  (the harness: namespaces, launcher, workers)

from flodl_trio.wire.quant import F32, DeltaCodec, decode, encode  # noqa: E402

NUMEL = allreduce.TWOHOST_NUMEL
WIRES = ("f32", "int8", "fp4")
RATE_BITS = {"200mbit": 200e6, "1gbit": 1e9, "500mbit": 500e6, "100mbit": 100e6}


def frame_bytes(wire: str) -> int:
    return 4 * NUMEL if wire == "f32" else DeltaCodec.parse(wire).payload_bytes(NUMEL)


def codec_cpu_ms(wire: str) -> float:
    """One encode and one decode of the frame on one core (best of 3)."""
    if wire == "f32":
        return 0.0
    codec = DeltaCodec.parse(wire)
    values = np.random.default_rng(0).standard_normal(NUMEL).astype(F32)
    payload, out = bytearray(codec.payload_bytes(NUMEL)), np.empty(NUMEL, F32)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        encode(values, payload, codec.code, codec.block)
        decode(payload, codec.code, codec.block, NUMEL, out)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def bench_args(lanes: int, profile: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(profile=profile, timing=False, deterministic=False, lanes=lanes, no_unix=False,
                              rank_threads=1)


def median_ms(result: allreduce.RunResult) -> float:
    return result.median_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="200mbit,1gbit")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lanes", default="1,8", help="comma-separated lane counts to run flodl_trio with")
    ap.add_argument("--wires", default=",".join(WIRES), help="comma-separated wires to run (f32, int8, fp4, ...)")
    ap.add_argument("--profile", metavar="DIR",
                    help="run the flodl_trio processes under py-spy record and print where their CPU went")
    args = ap.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="delta-bench-"))
    rows = []
    for rate in args.rates.split(","):
        with allreduce.NetnsPair(rate) as pair:
            hosts = pair.hosts(2)
            gloo = allreduce.Bench(bench_args(1), workdir).run_gloo(hosts, NUMEL, "f32", args.warmup, args.rounds)
            for lanes in (int(n) for n in args.lanes.split(",")):
                bench = allreduce.Bench(bench_args(lanes, args.profile), workdir)
                for wire in args.wires.split(","):
                    flodl = bench.run_flodl(hosts, NUMEL, wire, args.warmup, args.rounds, f"delta_{wire}_{rate}_l{lanes}")
                    link_ms = 1e3 * 8 * frame_bytes(wire) / RATE_BITS.get(rate, 1e9)
                    rows.append((rate, lanes, wire, median_ms(flodl), median_ms(gloo), link_ms, codec_cpu_ms(wire)))
    print(f"2 hosts x 2 ranks, {NUMEL * 4 >> 20} MiB f32 params, every link tbf-shaped, {args.rounds} rounds "
          f"after {args.warmup} warm-up; medians")
    print("| link | lanes | flodl_trio wire | round ms | gloo f32 ms | ratio | link floor ms (one frame, one way) "
          "| codec CPU ms (encode + decode) | codec GB/s (f32 in, one core) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for rate, lanes, wire, ms, gloo_ms, link_ms, cpu in rows:
        rate_gbs = f"{4 * NUMEL / cpu / 1e6:.2f}" if cpu else "-"
        print(f"| {rate} | {lanes} | {wire} | {ms:.0f} | {gloo_ms:.0f} | {ms / gloo_ms:.2f}x | {link_ms:.0f} "
              f"| {cpu:.0f} | {rate_gbs} |")
    if args.profile:
        print(allreduce.summarize_profiles(Path(args.profile)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
