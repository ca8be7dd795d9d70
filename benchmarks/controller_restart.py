"""What a controller restart costs: the time from starting it again to the first
completed round and window, and what the resume record costs each round. Prints a table.

    python benchmarks/controller_restart.py              # 64 MiB model, 4 ranks on 2 hosts, loopback
    python benchmarks/controller_restart.py --mib 16 --windows 8
    python benchmarks/controller_restart.py --lanes 8    # every daemon with --lanes 8
    python benchmarks/controller_restart.py --codec int8:1024   # params rounds as int8 deltas
    python benchmarks/controller_restart.py --hosts 3 --lanes 8  # 3 hosts x 1 rank: the relays' shards
    python benchmarks/controller_restart.py --hosts 3 --lanes 8 --star  # the same without them

Daemons (the controller with ``--outer diloco --checkpoint-dir``, a relay per host)
and four rank processes (``rank_worker --windows``) holding through a lost
controller (``FLODL_CONTROLLER_OUTAGE``). Host 1's ranks hold before window
HOLD; once host 0's HostFrame of that window's first round is in, the controller
is SIGKILLed, host 1's ranks go on (their frames wait at their relay), and the
controller is started again with its first command line. Measured from the
restart: the new controller listening, every relay channel resumed, window
HOLD's three rounds done (the first of them the step-count gather that was
open, the second the 64 MiB params round); every rank must end bit-identical.
Separately, the record's write: one params round's record (the consensus and
DiLoCo's state) written and fsync'd, timed in this process.

This is a benchmark, not a test: pytest never collects it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flodl_trio.controller.resume import ResumeLog, RunRecord  # noqa: E402
from flodl_trio.testing import open_process_cluster  # noqa: E402
from flodl_trio.testing.windows import windows_of  # noqa: E402
from flodl_trio.wire.mux import NO_BROADCAST, MuxKind, encode_mux_record  # noqa: E402
from flodl_trio.wire.salt import SessionSalt  # noqa: E402

SALT = b"bench-ctl-restrt"
HOLD = 4


def layout(hosts: int) -> list[list[int]]:
    """Two hosts of two ranks, or ``hosts`` hosts of one (three or more: the relays' shards reduce)."""
    return [[0, 1], [2, 3]] if hosts == 2 else [[h] for h in range(hosts)]


async def until_host0_delivered(cluster) -> None:
    while not any(r["host"] == "host0" and r["delivered"] for r in (await cluster.status())["relays"]):
        await trio.sleep(0.02)


async def run(
    mib: int, windows: int, pause: float, checkpoint_dir: Path, lanes: int = 1, codec: str | None = None,
    hosts: int = 2, star: bool = False,
) -> dict[str, Any]:
    numel = mib * (1 << 20) // 4
    placed = layout(hosts)
    world = sum(len(ranks) for ranks in placed)
    held_ranks = placed[-1]
    env = {"FLODL_CONTROLLER_OUTAGE": "120"}
    held = ["--pause-before", f"{HOLD}:inf"]
    coded = ["--codec", codec] if codec else []
    async with open_process_cluster(
        world_size=world, hosts=placed, salt=SALT, control=True, heartbeat_timeout=60.0, daemons=True,
        numel=numel, pause=pause,
        controller_args=["--outer", "diloco", "--checkpoint-dir", str(checkpoint_dir), "--lanes", str(lanes),
                         *(["--shards", "off"] if star else [])],
        relay_args={h: ["--lanes", str(lanes)] for h in range(hosts)},
        worker_args={r: ["--windows", str(windows), *coded, *(held if r in held_ranks else [])] for r in range(world)},
        worker_env={r: env for r in range(world)}, relay_env={h: env for h in range(hosts)},
    ) as cluster:
        for rank in held_ranks:
            await cluster.wait_event(rank, "paused", round=HOLD)
        await until_host0_delivered(cluster)
        cluster.kill_controller()
        await cluster.controller.wait()
        sharded = "reducing with the" in cluster.controller.text
        for rank in held_ranks:
            await cluster.resume(rank)  # their frames wait at their relay for the new controller
        restarted = time.monotonic()
        await cluster.restart_controller()
        listening = time.monotonic()
        both_channels = re.compile(r"resumed with the controller(?s:.*)resumed with the controller")
        for host in cluster.relays:
            for relay in host:
                await relay.wait_log(both_channels)
        resumed = time.monotonic()
        first = await cluster.wait_event(0, "window", window=HOLD)
        for rank in range(world):
            outcome = await cluster.wait_outcome(rank)
            if outcome["event"] != "done":
                raise SystemExit(f"rank {rank} did not finish: {outcome}")
    finals = {windows_of(cluster, r)[windows - 1]["digest"] for r in range(world)}
    if len(finals) != 1:
        raise SystemExit("the ranks do not end bit-identical")
    done = {w: e["time"] for w, e in windows_of(cluster, 0).items()}
    normal = [done[w] - done[w - 1] for w in done if w - 1 in done and w not in (HOLD, HOLD + 1)]
    return {
        "mib": mib,
        "lanes": lanes,
        "codec": codec or "f32",
        "hosts": f"{world} ranks on {hosts} hosts" + (", through the relays' shards" if sharded else ""),
        "to_listening_s": listening - restarted,
        "to_resumed_s": resumed - restarted,
        "to_window_s": first["time"] - restarted,
        "normal_window_s": statistics.median(normal),
    }


def record_write_seconds(mib: int, reps: int = 3, delta: bool = False) -> float:
    """One params round's record: the consensus record and DiLoCo's x_prev and momentum
    (``delta``: and the delta lineage, the exact consensus and the ranks' base)."""
    numel = mib * (1 << 20) // 4
    salt = SessionSalt(SALT)
    payload = np.ones(numel, dtype=np.float32)
    broadcast = encode_mux_record(MuxKind.BROADCAST, payload.data.cast("B"), salt)
    outer = {"windows": np.array([3]), "x_prev.0": payload.copy(), "momentum.0": payload.copy()}
    lineage = {"model.x.0": payload.copy(), "model.base.0": payload.copy()} if delta else None
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        log = ResumeLog(tmp, salt, 4)
        for k in range(reps):
            run_ = RunRecord(rounds=k + 1, windows=1, model_rounds=1, previous_kind=1, fragment=None,
                             last_tag=bytes(8), previous_tag=NO_BROADCAST)
            start = time.perf_counter()
            log.write(run_, broadcast, outer, None, lineage)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(r: dict[str, Any], write_s: float) -> str:
    parts = "consensus, x_prev, momentum" + (", x and base of the delta lineage" if r["codec"] != "f32" else "")
    record_mib = (5 if r["codec"] != "f32" else 3) * r["mib"]
    rows = [
        ("restart -> new controller listening", f"{r['to_listening_s']:.2f} s", "(python start and imports)"),
        ("restart -> every relay channel resumed", f"{r['to_resumed_s']:.2f} s", ""),
        (f"restart -> window {HOLD} done (its 3 rounds)", f"{r['to_window_s']:.2f} s",
         f"a window takes {r['normal_window_s']:.2f} s uninterrupted"),
        ("resume record of a params round (write + fsync)", f"{write_s * 1e3:.0f} ms",
         f"{record_mib:.0f} MiB: {parts}"),
    ]
    width = max(len(row[0]) for row in rows)
    lines = [f"controller restart, {r['mib']:.0f} MiB model, DiLoCo, {r['codec']} params, lanes {r['lanes']}, "
             f"{r['hosts']} (loopback):"]
    lines += [f"  {name:<{width}}  {value:<10} {note}" for name, value, note in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="model size in MiB (default 64)")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.5, help="each rank's 'training' per window, seconds")
    parser.add_argument("--lanes", type=int, default=1, help="--lanes of the controller and relays (default 1)")
    parser.add_argument("--codec", default=None, help="the ranks' params rounds as coded deltas (int8:1024, fp4:256)")
    parser.add_argument("--hosts", type=int, default=2,
                        help="2: two hosts of two ranks (default); 3 or more: one rank a host, the relays' shards")
    parser.add_argument("--star", action="store_true", help="the controller without shards (--shards off)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flodl-restart-") as tmp:
        result = trio.run(run, args.mib, args.windows, args.pause, Path(tmp), args.lanes, args.codec, args.hosts,
                          args.star)
    print(table(result, record_write_seconds(args.mib, delta=args.codec is not None)))


if __name__ == "__main__":
    main()
