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
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..fold.outer import DiLoCoNesterov, SlowMo

WORLD = 4
HOSTS = [[0, 1], [2, 3]]
FEATURES = 16
# What the ranks' window trainer mirrors of the controller's --outer (default hyperparameters on both).
OUTERS: dict[str, Any] = {"none": lambda: None, "slowmo": SlowMo, "diloco": DiLoCoNesterov}


# ---------------------------------------------------------------------------
# A rank (runs in its own process: python -m flodl_trio.demo --worker)
# ---------------------------------------------------------------------------


def make_model(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)  # every rank starts from the same weights
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )


def make_data(rank: int, samples: int) -> tuple[Any, Any, Any, Any]:
    """A shared teacher function; each rank sees its own noisy, shifted shard."""
    import torch

    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 32, generator=teacher)
    w2 = torch.randn(32, 1, generator=teacher)

    def label(x: Any) -> Any:
        return torch.tanh(x @ w1) @ w2 / 4

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(samples, FEATURES, generator=gen) + 0.3 * (rank - 1.5)  # non-IID shards
    y = label(x) + 0.05 * torch.randn(samples, 1, generator=gen)
    val = torch.Generator().manual_seed(999)
    x_val = torch.randn(512, FEATURES, generator=val)
    return x, y, x_val, label(x_val)


async def worker(args: argparse.Namespace) -> None:
    import torch

    from flodl_trio.client import connect_control_client
    from flodl_trio.client.reduce import connect_reduce_client
    from flodl_trio.client.tensors import model_signature
    from flodl_trio.train.trainer import open_window_trainer
    from flodl_trio.wire.salt import SessionSalt

    torch.set_num_threads(1)
    rank, salt = args.rank, SessionSalt.from_hex(os.environ["FLODL_SALT_HEX"])
    model = make_model(args.seed)
    x, y, x_val, y_val = make_data(rank, 4096)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    params = list(model.parameters())
    buffers = [b for b in model.buffers() if b.dtype.is_floating_point]
    gen = torch.Generator().manual_seed(rank + 1000 * args.seed)  # minibatch order

    def emit(**fields: Any) -> None:
        print(json.dumps({"rank": rank, **fields}), flush=True)

    losses: list[float] = []

    def inner_step() -> None:
        model.train()
        idx = torch.randint(0, x.shape[0], (64,), generator=gen)
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        inner.zero_grad()
        loss.backward()
        inner.step()
        losses.append(loss.item())

    def validation_loss() -> float:
        with torch.no_grad():
            model.eval()
            return float(torch.nn.functional.mse_loss(model(x_val), y_val).item())

    async with connect_control_client(
        ("127.0.0.1", args.control_port), rank, WORLD, salt, model_signature(model), heartbeat_timeout=args.heartbeat_timeout
    ):
        async with connect_reduce_client(("127.0.0.1", args.data_port), rank, WORLD, salt) as client:
            client.bf16_wire = args.bf16
            # 0 at first start; after a restart the model is the cluster's consensus from here on.
            start = await client.join(params, buffers)
            # The window loop: every window's averages land in the model's own parameters
            # and buffers; with --overlap the round runs while the next window trains, with
            # --fragments the params go in staggered fragments (a cluster window each).
            async with open_window_trainer(
                client, params, buffers, rank=rank, world_size=WORLD, sync_every=args.inner_steps,
                # Steps before a consensus lands train from the boundary params, or with
                # --eager-stand-in from the rank's estimate of the controller's outer step.
                overlap=args.overlap, outer=OUTERS[args.outer]() if args.eager_stand_in else None,
                merge_after=args.merge_after, merge_by=args.merge_by, fragments=args.fragments, start_window=start,
            ) as trainer:
                # Where the cluster is (0 at first start): the step its window `start` begins at.
                step, total = trainer.schedule.boundary_step(start - 1), args.windows * args.inner_steps
                emit(joined=step / args.inner_steps, consensus_loss=validation_loss())
                while step < total:
                    todo = args.inner_steps - step % args.inner_steps
                    await trainer.run_steps(todo, inner_step)
                    step += todo
                    local_loss, losses[:] = sum(losses) / len(losses), []
                    emit(window=step // args.inner_steps - 1, local_loss=local_loss, consensus_loss=validation_loss(),
                         live=sum(1 for c in trainer.stats.last_counts if c > 0) if trainer.stats.last_counts else None,
                         waited=trainer.stats.waited_s)
            # Leaving the trainer's block brought the last window's round in (with --overlap).
            emit(final_loss=validation_loss(), waited=trainer.stats.waited_s, late_steps=trainer.stats.late_steps)


# ---------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def spawn(cmd: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")
    return subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE if "--worker" in cmd else out, stderr=out)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    workdir = Path(tempfile.mkdtemp(prefix="flodl-demo-"))
    salt_hex = os.urandom(16).hex()
    env = {**os.environ, "FLODL_SALT_HEX": salt_hex, "PYTHONUNBUFFERED": "1"}
    ctl_port, *relay_ports = free_ports(1 + 2 * len(HOSTS))
    py = [sys.executable, "-m"]
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        controller_cmd = py + ["flodl_trio.controller", "--host", "127.0.0.1", "--port", str(ctl_port),
                               "--world-size", str(WORLD), "--heartbeat-timeout", str(args.heartbeat_timeout),
                               "--outer", args.outer, "--checkpoint-dir", str(workdir / "checkpoints"),
                               "--rejoin-timeout", "60", "--keep-serving"]
        procs.append(spawn(controller_cmd, env, workdir / "controller.log"))
        ports = {}
        for index, host_ranks in enumerate(HOSTS):
            data_port, control_port = relay_ports[2 * index], relay_ports[2 * index + 1]
            for r in host_ranks:
                ports[r] = (data_port, control_port)
            relay_cmd = py + ["flodl_trio.relay", "--controller", f"127.0.0.1:{ctl_port}",
                              "--ranks", ",".join(map(str, host_ranks)), "--world-size", str(WORLD),
                              "--host-name", f"host{index}", "--data-port", str(data_port),
                              "--control-port", str(control_port)]
            procs.append(spawn(relay_cmd, env, workdir / f"relay{index}.log"))
        commands: dict[int, list[str]] = {}
        for r in range(WORLD):
            commands[r] = py + ["flodl_trio.demo", "--worker", "--rank", str(r), "--data-port", str(ports[r][0]),
                                "--control-port", str(ports[r][1]), "--windows", str(args.windows),
                                "--inner-steps", str(args.inner_steps), "--heartbeat-timeout", str(args.heartbeat_timeout),
                                "--overlap", str(args.overlap), "--fragments", str(args.fragments),
                                "--seed", str(args.seed), "--outer", args.outer]
            if args.merge_after is not None:
                commands[r] += ["--merge-after", str(args.merge_after)]
            if args.merge_by is not None:
                commands[r] += ["--merge-by", str(args.merge_by)]
            if args.eager_stand_in:
                commands[r] += ["--eager-stand-in"]
            if args.bf16:
                commands[r].append("--bf16")

        def start_rank(r: int) -> subprocess.Popen[bytes]:
            proc = spawn(commands[r], env, workdir / f"rank{r}-{sum(p.args == commands[r] for p in procs)}.log")
            procs.append(proc)
            return proc

        ranks = {r: start_rank(r) for r in range(WORLD)}
        history, events = follow_training(ranks, start_rank, args, tqdm)
        for p in procs[1 + len(HOSTS):]:
            p.wait(timeout=60)
        status = controller_status(ctl_port)
        procs[0].send_signal(signal.SIGTERM)  # the daemon shuts down cleanly on SIGTERM
        for p in procs[: 1 + len(HOSTS)]:
            p.wait(timeout=30)
        elapsed = time.monotonic() - started
        failed = [p for p in procs[1 + len(HOSTS):] if p.returncode not in (0, -signal.SIGKILL)]
        if failed:  # a rank that crashed must not leave a summary that looks like a result
            print(f"a rank process failed (exit {failed[0].returncode}); see the rank logs in {workdir}",
                  file=sys.stderr)
            return 1
        print_summary(history, events, status, workdir, elapsed, args)
        plot(history, events, Path(args.plot))
        print(f"plot: {args.plot}   logs and checkpoints: {workdir}")
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def follow_training(
    ranks: dict[int, subprocess.Popen[bytes]], start_rank: Any, args: argparse.Namespace, tqdm: Any
) -> tuple[dict[int, list[dict[str, Any]]], dict[str, int]]:
    """Read every rank's JSON lines (both lives of the victim); kill the victim after
    ``--kill-at``, start it again after ``--rejoin-at``; drive the progress bar."""
    import selectors

    history: dict[int, list[dict[str, Any]]] = {r: [] for r in ranks}
    sel = selectors.DefaultSelector()
    buffers: dict[int, bytes] = {}

    def watch(r: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        sel.register(proc.stdout, selectors.EVENT_READ, r)
        buffers[r] = b""

    for r, proc in ranks.items():
        watch(r, proc)
    events: dict[str, int] = {}
    bar = tqdm(total=args.windows, desc="windows", unit="win")
    while sel.get_map():
        for key, _ in sel.select(timeout=1.0):
            r = key.data
            chunk = key.fileobj.read()  # type: ignore[union-attr]  # we registered the pipe itself, not its fd
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buffers[r] += chunk
            *lines, buffers[r] = buffers[r].split(b"\n")
            for line in lines:
                event = json.loads(line)
                history[r].append(event)
                if "joined" in event:
                    if event["joined"] > 0:
                        events["rejoined"] = event["joined"]
                        bar.write(f"window {event['joined']:g}: rank {r} is back, from the consensus "
                                  f"(validation loss {event['consensus_loss']:.4f})")
                    continue
                if "final_loss" in event:
                    continue
                if r == 0:
                    bar.update(1)
                    bar.set_postfix(loss=f"{event['consensus_loss']:.4f}", live=event["live"] if event["live"] is not None else "-")
                    if "killed" not in events and event["window"] + 1 == args.kill_at:
                        ranks[args.victim].send_signal(signal.SIGKILL)
                        events["killed"] = args.kill_at
                        bar.write(f"window {args.kill_at}: killed rank {args.victim} (SIGKILL); survivors carry on")
                    if "killed" in events and "restarted" not in events and event["window"] + 1 == args.rejoin_at:
                        ranks[args.victim].wait()
                        watch(args.victim, start_rank(args.victim))
                        events["restarted"] = args.rejoin_at
                        bar.write(f"window {args.rejoin_at}: restarted rank {args.victim} with the same command")
    bar.close()
    return history, events


def windows_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if "window" in e]


def controller_status(port: int) -> dict[str, Any]:
    """The controller's JSON status page, served on its own port."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def relay_fold_ratios(workdir: Path) -> list[str]:
    out = []
    for log in sorted(workdir.glob("relay*.log")):
        for line in log.read_text().splitlines():
            if "data summary" in line and "fold-ratio" in line:
                host = line.split("relay ", 2)[-1].split(" ", 1)[0]
                out.append(f"{host}: {line.rsplit('fold-ratio=', 1)[1].split()[0].strip(chr(34))}")
    return out


def live_path(events: list[dict[str, Any]]) -> str:
    """How many ranks each window had, as the changes: "4 -> 3 -> 4"."""
    counts: list[int] = []
    for event in windows_of(events):
        if event["live"] is None:  # overlapped: no window's consensus has landed yet
            continue
        if not counts or counts[-1] != event["live"]:
            counts.append(event["live"])
    return " -> ".join(map(str, counts))


def late_text(late: list[int]) -> str:
    """How far into the next window the overlapped rounds landed (rank 0)."""
    ordered = sorted(late)
    return f"median {ordered[len(ordered) // 2]}, max {ordered[-1]} (of {len(ordered)} windows)"


def cluster_model_loss(directory: Path) -> float | None:
    """Validation loss of the cluster's model: the newest checkpoint (every fragment's newest
    consensus, after the outer step) loaded into a fresh model. Unlike a rank's own
    params it holds no local steps taken since a fragment's last sync."""
    import torch

    from flodl_trio.train.checkpoint import restore_module
    from flodl_trio.wire.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    if path is None:
        return None
    model = make_model()
    restore_module(model, load_checkpoint(path))
    _, _, x_val, y_val = make_data(0, 1)
    with torch.no_grad():
        model.eval()
        return float(torch.nn.functional.mse_loss(model(x_val), y_val).item())


def print_summary(history: dict[int, list[dict[str, Any]]], events: dict[str, int], status: dict[str, Any],
                  workdir: Path, elapsed: float, args: argparse.Namespace) -> None:
    stats = status["stats"]
    first, last = windows_of(history[0])[0], windows_of(history[0])[-1]
    final = next((e for e in history[0] if "final_loss" in e), {"final_loss": last["consensus_loss"], "waited": last["waited"]})
    cluster_loss = cluster_model_loss(workdir / "checkpoints")
    deaths = "none"
    if "killed" in events:
        deaths = f"rank {args.victim} killed after window {events['killed']}"
        if "rejoined" in events:
            deaths += f"; restarted, back at window {events['rejoined']:g} from the consensus"
    rows = [
        ("windows trained", str(len(windows_of(history[0])))),
        ("live ranks", live_path(history[0])),
        ("averaging rounds", str(stats["rounds"])),
        ("outer optimizer", args.outer),
        ("wire", "bf16" if args.bf16 else "f32"),
        ("consensus loss, first window -> end", f"{first['consensus_loss']:.4f} -> {final['final_loss']:.4f} (rank 0)"),
        ("cluster model's validation loss", "n/a" if cluster_loss is None else f"{cluster_loss:.4f} (newest checkpoint)"),
        ("trainer time waiting on the network",
         f"{final['waited']:.2f} s of {elapsed:.1f} s (rank 0; --overlap {args.overlap}, --fragments {args.fragments})"),
        *([("inner steps before each consensus was merged", late_text(final["late_steps"]))] if final.get("late_steps") else []),
        ("bytes into controller", f"{stats['bytes_in'] / 1e6:.2f} MB"),
        ("bytes out of controller", f"{stats['bytes_out'] / 1e6:.2f} MB"),
        ("relay fold ratio", ", ".join(relay_fold_ratios(workdir)) or "n/a"),
        ("deaths and returns", deaths),
        ("rejoins", str(stats.get("rejoins", 0))),
        ("checkpoints written", str(len(list((workdir / "checkpoints").glob("*.safetensors"))))),
        ("wall time", f"{elapsed:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n| " + "what".ljust(width) + " | value |")
    print("|" + "-" * (width + 2) + "|-------|")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")


def plot(history: dict[int, list[dict[str, Any]]], events: dict[str, int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rank, lines in sorted(history.items()):
        for index, life in enumerate(_lives(lines)):  # a restarted rank's line breaks while it is away
            ax.plot([e["window"] for e in life], [e["local_loss"] for e in life], alpha=0.7,
                    color=f"C{rank}", label=None if index else f"rank {rank} (local)")
    consensus = windows_of(history[0])
    ax.plot([e["window"] for e in consensus], [e["consensus_loss"] for e in consensus], "k-", lw=2.5,
            label="consensus (validation)")
    if "killed" in events:
        ax.axvline(events["killed"] - 0.5, color="red", ls="--", label="rank killed")
    if "rejoined" in events:
        ax.axvline(events["rejoined"] - 0.5, color="green", ls="--", label="rank rejoined")
        for rank, lines in history.items():  # where the rejoined rank starts: the consensus
            for e in lines:
                if e.get("joined", 0) > 0:
                    ax.plot([e["joined"] - 0.5], [e["consensus_loss"]], "o", color=f"C{rank}", ms=7,
                            label=f"rank {rank} back: its loss starts at the consensus")
    ax.set_xlabel("averaging window")
    ax.set_ylabel("MSE loss")
    ax.set_yscale("log")
    ax.set_title("flodl_trio demo: Local SGD across 2 hosts x 2 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _lives(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A rank's window events split at each restart (a ``joined`` event after windows)."""
    lives: list[list[dict[str, Any]]] = [[]]
    for event in events:
        if "joined" in event and lives[-1]:
            lives.append([])
        elif "window" in event:
            lives[-1].append(event)
    return [life for life in lives if life]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flodl_trio.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40, help="averaging windows to train (default 40)")
    parser.add_argument("--inner-steps", type=int, default=150, help="local steps per window (default 150)")
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--kill-at", type=int, default=8, help="kill the victim after this window (default 8)")
    parser.add_argument("--victim", type=int, default=3, help="rank to kill (default 3)")
    parser.add_argument("--rejoin-at", type=int, default=10,
                        help="start the victim again after this window (default 10; 0: never)")
    parser.add_argument("--outer", default="diloco", choices=["none", "slowmo", "diloco"], help="outer optimizer on the controller")
    parser.add_argument("--bf16", action="store_true", help="bf16 wire for the parameter rounds")
    parser.add_argument("--overlap", type=int, default=0, choices=(0, 1),
                        help="1: each window's round runs while the next window trains (default 0: wait for it)")
    parser.add_argument("--merge-after", type=int, default=None,
                        help="with --overlap 1: merge each consensus after exactly this many steps of the next window")
    parser.add_argument("--merge-by", type=int, default=None,
                        help="with --overlap 1: merge each consensus when it lands, at the latest after this many "
                             "steps of the next window")
    parser.add_argument("--eager-stand-in", action="store_true",
                        help="with --overlap 1: train the steps before a consensus lands from the rank's estimate of "
                             "the outer step (eager update) instead of from its boundary params")
    parser.add_argument("--fragments", type=int, default=1,
                        help="sync the params in this many staggered fragments, one every inner-steps/fragments "
                             "steps (default 1: the whole model each window)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and minibatch order (default 0)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument("--plot", default="flodl_demo.png", help="where to write the PNG (default flodl_demo.png)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--control-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import trio

        trio.run(worker, args)
        return 0
    return run(args)

