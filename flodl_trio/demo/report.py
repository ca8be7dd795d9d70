"""The demo's summary table and its plot of each rank's loss and the consensus loss."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..testing.processes import Event
from .cluster import DemoRun, Milestones


def windows_of(events: list[Event]) -> list[Event]:
    return [e for e in events if "window" in e]


def relay_fold_ratios(relay_logs: list[str]) -> list[str]:
    """Each relay's fold ratio, from the data summary it logs on its way out ("host0: 1.00")."""
    out = []
    for log in relay_logs:
        for line in log.splitlines():
            if "data summary" in line and "fold-ratio" in line:
                host = line.split("relay ", 2)[-1].split(" ", 1)[0]
                out.append(f"{host}: {line.rsplit('fold-ratio=', 1)[1].split()[0].strip(chr(34))}")
    return out


def live_path(events: list[Event]) -> str:
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
    from ..train.checkpoint import restore_module
    from ..wire.checkpoint import latest_checkpoint, load_checkpoint
    from .model import make_data, make_model, validation_loss

    path = latest_checkpoint(directory)
    if path is None:
        return None
    model = make_model()
    restore_module(model, load_checkpoint(path))
    return validation_loss(model, make_data(0, 1))


def checkpoints_text(controller_log: str, directory: Path) -> str:
    """How many checkpoints the controller wrote, and how many it kept (--checkpoint-keep)."""
    written = sum("checkpoint: wrote" in line for line in controller_log.splitlines())
    return f"{written} (the newest {len(list(directory.glob('*.safetensors')))} kept)"


def deaths_text(milestones: Milestones, victim: int) -> str:
    if milestones.killed is None:
        return "none"
    text = f"rank {victim} killed after window {milestones.killed}"
    if milestones.rejoined is not None:
        text += f"; restarted, back at window {milestones.rejoined:g} from the consensus"
    return text


def summary_rows(run: DemoRun, args: argparse.Namespace) -> list[tuple[str, str]]:
    stats, rank0 = run.status["stats"], run.history[0]
    first, last = windows_of(rank0)[0], windows_of(rank0)[-1]
    final = next((e for e in rank0 if "final_loss" in e), {"final_loss": last["consensus_loss"], "waited": last["waited"]})
    checkpoints = run.workdir / "checkpoints"
    cluster_loss = cluster_model_loss(checkpoints)
    return [
        ("windows trained", str(len(windows_of(rank0)))),
        ("live ranks", live_path(rank0)),
        ("averaging rounds", str(stats["rounds"])),
        ("outer optimizer", args.outer),
        ("wire", f"{args.codec} deltas" if args.codec else "bf16" if args.bf16 else "f32"),
        ("consensus loss, first window -> end", f"{first['consensus_loss']:.4f} -> {final['final_loss']:.4f} (rank 0)"),
        ("cluster model's validation loss", "n/a" if cluster_loss is None else f"{cluster_loss:.4f} (newest checkpoint)"),
        ("trainer time waiting on the network",
         f"{final['waited']:.2f} s of {run.elapsed:.1f} s (rank 0; --overlap {args.overlap}, --fragments {args.fragments})"),
        *([("inner steps before each consensus was merged", late_text(final["late_steps"]))] if final.get("late_steps") else []),
        ("bytes into controller", f"{stats['bytes_in'] / 1e6:.2f} MB"),
        ("bytes out of controller", f"{stats['bytes_out'] / 1e6:.2f} MB"),
        ("relay fold ratio", ", ".join(relay_fold_ratios(run.relay_logs)) or "n/a"),
        ("deaths and returns", deaths_text(run.milestones, args.victim)),
        ("rejoins", str(stats.get("rejoins", 0))),
        ("checkpoints written", checkpoints_text(run.controller_log, checkpoints)),
        ("wall time", f"{run.elapsed:.1f} s"),
    ]


def print_summary(run: DemoRun, args: argparse.Namespace) -> None:
    rows = summary_rows(run, args)
    width = max(len(k) for k, _ in rows)
    print("\n| " + "what".ljust(width) + " | value |")
    print("|" + "-" * (width + 2) + "|-------|")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")


def lives(events: list[Event]) -> list[list[Event]]:
    """A rank's window events split at each restart (a ``joined`` event after windows)."""
    out: list[list[Event]] = [[]]
    for event in events:
        if "joined" in event and out[-1]:
            out.append([])
        elif "window" in event:
            out[-1].append(event)
    return [life for life in out if life]


def plot(run: DemoRun, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, milestones = run.history, run.milestones
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rank, events in sorted(history.items()):
        for index, life in enumerate(lives(events)):  # a restarted rank's line breaks while it is away
            ax.plot([e["window"] for e in life], [e["local_loss"] for e in life], alpha=0.7,
                    color=f"C{rank}", label=None if index else f"rank {rank} (local)")
    consensus = windows_of(history[0])
    ax.plot([e["window"] for e in consensus], [e["consensus_loss"] for e in consensus], "k-", lw=2.5,
            label="consensus (validation)")
    if milestones.killed is not None:
        ax.axvline(milestones.killed - 0.5, color="red", ls="--", label="rank killed")
    if milestones.rejoined is not None:
        ax.axvline(milestones.rejoined - 0.5, color="green", ls="--", label="rank rejoined")
        for rank, events in history.items():  # where the rejoined rank starts: the consensus
            for e in events:
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
