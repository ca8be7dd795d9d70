"""What a rank coming back costs: the state transfer, the joiner's time to its
first window, and the survivors' window while it joins. Prints a table.

    python benchmarks/rejoin.py                 # 64 MiB model, 4 ranks on 2 hosts, loopback
    python benchmarks/rejoin.py --mib 16 --windows 10

Four rank processes (``rank_worker --windows``: join, then average_window with a
"training" pause) on two in-process relays and the controller. Rank 3 is
SIGKILLed after window 2 and started again with the same command after window
4. Measured:

- state transfer rate: the consensus frames' bytes over the time from the state
  reply's header to its last byte, as the joiner saw them (target >= 500 MB/s);
- joiner process start -> state loaded, and -> its first window done;
- the survivors' window in which the joiner entered, against the median of
  the survivors' later windows (target: within 10%). The joiner trains that
  window like everyone (the same pause) after its state arrived, so what the
  survivors can lose there is the state transfer not hidden behind their own
  training.

This is a benchmark, not a test: pytest never collects it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flodl_trio.testing import open_process_cluster  # noqa: E402
from flodl_trio.testing.windows import (  # noqa: E402
    check_final_and_joins,
    check_windows,
    joined_event,
    windows_of,
)

TRANSFER_TARGET_MBPS = 500.0
JOIN_WINDOW_TARGET = 0.10


async def run(mib: int, windows: int, pause: float) -> dict[str, float]:
    numel = mib * (1 << 20) // 4
    async with open_process_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], salt=b"benchmark-rejoin", control=True, heartbeat_timeout=60.0,
        rejoin_timeout=120.0, numel=numel, pause=pause,
        worker_args={r: ["--windows", str(windows)] for r in range(4)},
    ) as cluster:
        await cluster.wait_event(3, "window", window=2)
        cluster.kill(3)
        await cluster.wait_exit(3)
        await cluster.wait_event(0, "window", window=4)
        spawned = time.monotonic()
        await cluster.restart(3)
        joined = await cluster.wait_event(3, "joined")
        start = joined["start"]
        first = await cluster.wait_event(3, "window", window=start)
        for rank in range(4):
            outcome = await cluster.wait_outcome(rank)
            if outcome["event"] != "done":
                raise SystemExit(f"rank {rank} did not finish: {outcome}")
    contributors = check_windows(cluster, windows, numel, {3: {3}})
    check_final_and_joins(cluster, windows, contributors)  # every window exact, everyone identical
    done = {w: e["time"] for w, e in windows_of(cluster, 0).items()}
    durations = {w: done[w] - done[w - 1] for w in done if w - 1 in done}
    normal = [durations[w] for w in durations if w > start + 1]
    state = joined_event(cluster, 3)
    return {
        "mib": mib,
        "start": start,
        "state_bytes": state["state_bytes"],
        "transfer_s": state["transfer_seconds"],
        "rate_mbps": state["state_bytes"] / state["transfer_seconds"] / 1e6,
        "to_loaded_s": joined["time"] - spawned,
        "to_first_window_s": first["time"] - spawned,
        "join_window_s": durations[start],
        "boundary_window_s": durations[start - 1],
        "normal_window_s": statistics.median(normal),
    }


def table(r: dict[str, float]) -> str:
    join_ratio = r["join_window_s"] / r["normal_window_s"] - 1
    boundary_ratio = r["boundary_window_s"] / r["normal_window_s"] - 1
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    rows = [
        ("state transfer (consensus of one window)",
         f"{r['state_bytes'] / 1e6:.1f} MB in {r['transfer_s'] * 1e3:.0f} ms = {r['rate_mbps']:.0f} MB/s",
         f">= {TRANSFER_TARGET_MBPS:.0f} MB/s: {verdict(r['rate_mbps'] >= TRANSFER_TARGET_MBPS)}"),
        ("joiner: process start -> state loaded", f"{r['to_loaded_s']:.2f} s", "(includes python + torch import)"),
        ("joiner: process start -> first window done", f"{r['to_first_window_s']:.2f} s", f"entered window {r['start']:.0f}"),
        ("survivors: window the state went out in", f"{r['boundary_window_s'] * 1e3:.0f} ms ({boundary_ratio:+.1%})", ""),
        ("survivors: window the joiner entered", f"{r['join_window_s'] * 1e3:.0f} ms ({join_ratio:+.1%})",
         f"within {JOIN_WINDOW_TARGET:.0%}: {verdict(join_ratio <= JOIN_WINDOW_TARGET)}"),
        ("survivors: median later window", f"{r['normal_window_s'] * 1e3:.0f} ms", ""),
    ]
    width = max(len(row[0]) for row in rows)
    lines = [f"rejoin, {r['mib']:.0f} MiB model, 4 ranks on 2 hosts (loopback):"]
    lines += [f"  {name:<{width}}  {value:<40} {target}" for name, value, target in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="model size in MiB (default 64)")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--pause", type=float, default=1.0, help="each rank's 'training' per window, seconds")
    args = parser.parse_args()
    print(table(trio.run(run, args.mib, args.windows, args.pause)))


if __name__ == "__main__":
    main()
