"""``python -m flodl_trio.demo``: a whole local cluster training a small model.

It starts the real daemons - one controller, two relays (two simulated
hosts) - and four rank processes that train a small MLP with Local SGD /
DiLoCo on data they generate. Partway through, one rank is killed with
SIGKILL; the survivors carry on without it, and a few windows later it is
started again with the same command: it rejoins from the cluster's
consensus. At the end it prints a summary table and writes a PNG plot of
each rank's loss and the consensus loss.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import trio


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flodl_trio.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=40, help="averaging windows to train (default 40)")
    p.add_argument("--inner-steps", type=int, default=150, help="local steps per window (default 150)")
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--kill-at", type=int, default=8, help="kill the victim after this window (default 8)")
    p.add_argument("--victim", type=int, default=3, help="rank to kill (default 3)")
    p.add_argument("--rejoin-at", type=int, default=10,
                   help="start the victim again after this window (default 10; 0: never)")
    p.add_argument("--outer", default="diloco", choices=["none", "slowmo", "diloco"], help="outer optimizer on the controller")
    p.add_argument("--bf16", action="store_true", help="bf16 wire for the parameter rounds")
    p.add_argument("--codec", default=None,
                   help="the params rounds as coded deltas with error feedback: int8, fp4 or int4, "
                        "optionally :BLOCK (docs/wire.md, 'Delta rounds')")
    p.add_argument("--overlap", type=int, default=0, choices=(0, 1),
                   help="1: each window's round runs while the next window trains (default 0: wait for it)")
    p.add_argument("--merge-after", type=int, default=None,
                   help="with --overlap 1: merge each consensus after exactly this many steps of the next window")
    p.add_argument("--merge-by", type=int, default=None,
                   help="with --overlap 1: merge each consensus when it lands, at the latest after this many "
                        "steps of the next window")
    p.add_argument("--eager-stand-in", action="store_true",
                   help="with --overlap 1: train the steps before a consensus lands from the rank's estimate of "
                        "the outer step (eager update) instead of from its boundary params")
    p.add_argument("--fragments", type=int, default=1,
                   help="sync the params in this many staggered fragments, one every inner-steps/fragments "
                        "steps (default 1: the whole model each window)")
    p.add_argument("--seed", type=int, default=0, help="model initialization and minibatch order (default 0)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--plot", default="flodl_demo.png", help="where to write the PNG (default flodl_demo.png)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--control-port", type=int, help=argparse.SUPPRESS)
    return p


def run(args: argparse.Namespace) -> int:
    """The orchestrator: the cluster's whole run, then its summary and plot."""
    from .cluster import run_cluster
    from .report import plot, print_summary

    workdir = Path(tempfile.mkdtemp(prefix="flodl-demo-"))
    result = trio.run(run_cluster, args, workdir)
    if result.failed:  # a rank that crashed must not leave a summary that looks like a result
        print(f"a rank process failed (exit {result.failed[0].returncode}); see the rank logs in {workdir}",
              file=sys.stderr)
        return 1
    print_summary(result, args)
    plot(result, Path(args.plot))
    print(f"plot: {args.plot}   logs and checkpoints: {workdir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    from .worker import WORLD

    if not 1 <= args.victim < WORLD:  # rank 0 paces the run (the kill, the restart) and is the summary's trainer
        p.error(f"--victim must be a rank 1..{WORLD - 1} (rank 0 paces the demo), got {args.victim}")
    if args.codec is not None:
        from ..errors import SchemaError
        from ..wire.quant import DeltaCodec

        try:
            DeltaCodec.parse(args.codec)
        except SchemaError as exc:
            p.error(f"--codec: {exc}")
    if args.worker:
        from .worker import worker

        trio.run(worker, args)
        return 0
    return run(args)
