"""Delta codecs judged by a language model on real text (docs/performance.md,
"Delta codecs on real text").

A byte-level causal transformer (about 1.45 M parameters) learns to predict the
Python standard library's own source: every top-level ``*.py`` of this
interpreter's stdlib, every tenth file held out for validation, the rest cut
into four contiguous shards, one per rank. Four ranks on two hosts (real
controller and relay daemons, real rank processes) train it with AdamW inner
steps, and each configuration below is run for every seed:

- ``sync-f32``: synchronous data parallel (gradients averaged every step, f32);
- ``diloco-f32`` / ``diloco-bf16``: DiLoCo (Nesterov outer step on the
  controller) with the params on the wire in f32 / bf16;
- ``diloco-int8`` / ``diloco-fp4``: DiLoCo with delta rounds in that code, with
  error feedback, and ``-noef`` without it (ranks' uplinks drop what their code
  cannot carry; the relays' and the controller's hops keep theirs);
- ``diloco-int8-overlap``: int8 with each window's round overlapping the next
  window's first steps (merged after a quarter of them);
- ``single``: the same model on one rank, with as many steps as each rank takes,
  on the whole training split.

The table gives the held-out loss (nats per byte) after the last window, mean
and spread over seeds, and the ratio to DiLoCo f32; PASS/FAIL lines check the
targets (int8 within 1% of DiLoCo f32, 4-bit within 2%, both no worse than one
rank). Every rank of a cluster run must end with the same params (checked).

    python benchmarks/lm_codecs.py                          # everything, 3 seeds
    python benchmarks/lm_codecs.py --configs diloco-f32,diloco-int8 --seeds 0 --windows 4
    python benchmarks/lm_codecs.py --plot docs/lm_codecs.png --json lm.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio

WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 192, 3, 4, 64, 16
CURVE_SEQUENCES, FINAL_SEQUENCES = 64, 512  # held-out windows scored after each window / at the end
HEARTBEAT_TIMEOUT_S = 60.0  # four torch processes share two cores: generous
RUN_TIMEOUT_S = 3600.0


@attrs.frozen
class Config:
    """One way of training the model."""

    name: str
    outer: str = "diloco"  # the controller's --outer
    sync: bool = False  # gradients averaged every step instead of windows of local steps
    bf16: bool = False
    codec: str | None = None
    feedback: bool = True
    overlap: int = 0
    single: bool = False

    def wire_bytes(self, numel: int) -> float:
        """One rank's uplink bytes per window (per step for sync)."""
        if self.codec is not None:
            from flodl_trio.wire.quant import DeltaCodec

            return DeltaCodec.parse(self.codec).payload_bytes(numel)
        return (2 if self.bf16 else 4) * numel


CONFIGS = {c.name: c for c in [
    Config("sync-f32", outer="none", sync=True),
    Config("diloco-f32"),
    Config("diloco-bf16", bf16=True),
    Config("diloco-int8", codec="int8"),
    Config("diloco-int8-noef", codec="int8", feedback=False),
    Config("diloco-fp4", codec="fp4"),
    Config("diloco-fp4-noef", codec="fp4", feedback=False),
    Config("diloco-int8-overlap", codec="int8", overlap=1),
    Config("single", outer="none", single=True),
]}


# -- the corpus and the model ---------------------------------------------------


def corpus() -> tuple[bytes, bytes]:
    """(training split, held-out split): this interpreter's top-level stdlib sources,
    every tenth file (in name order) held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = b"\n".join(f.read_bytes() for i, f in enumerate(files) if i % 10 != 9)
    held_out = b"\n".join(f.read_bytes() for i, f in enumerate(files) if i % 10 == 9)
    return train, held_out


def rank_shard(train: bytes, rank: int) -> bytes:
    """Rank ``rank``'s contiguous quarter of the training split."""
    n = len(train)
    return train[rank * n // WORLD:(rank + 1) * n // WORLD]


def make_model(seed: int) -> Any:
    import torch
    from torch import nn

    class ByteLM(nn.Module):
        """Bytes in, next-byte logits out: embeddings, pre-norm causal transformer blocks."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, WIDTH)
            self.position = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
            block = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(block, LAYERS, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, 256, bias=False)
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.position[: x.shape[1]]
            h = self.blocks(h, mask=self.causal[: x.shape[1], : x.shape[1]], is_causal=True)
            return self.head(self.norm(h))

    torch.manual_seed(seed)
    return ByteLM()


def as_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def sample_batch(data: Any, gen: Any) -> tuple[Any, Any]:
    import torch

    starts = torch.randint(0, data.numel() - CONTEXT - 1, (BATCH, 1), generator=gen)
    idx = starts + torch.arange(CONTEXT + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def held_out_loss(model: Any, data: Any, sequences: int) -> float:
    """Mean cross-entropy (nats per byte) over ``sequences`` evenly spaced windows."""
    import torch

    starts = torch.linspace(0, data.numel() - CONTEXT - 2, sequences).long()[:, None]
    chunk = data[starts + torch.arange(CONTEXT + 1)]
    total = 0.0
    with torch.no_grad():
        for x, y in zip(chunk[:, :-1].split(64), chunk[:, 1:].split(64)):
            logits = model(x)
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum"))
    return total / (sequences * CONTEXT)


def params_digest(model: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# -- one rank -------------------------------------------------------------------


async def rank_main(args: argparse.Namespace) -> None:
    import torch

    from flodl_trio.client import connect_control_client
    from flodl_trio.client.reduce import connect_reduce_client
    from flodl_trio.client.tensors import model_signature
    from flodl_trio.train.trainer import open_window_trainer
    from flodl_trio.transport.settings import load_salt
    from flodl_trio.wire.quant import DeltaCodec

    torch.set_num_threads(1)
    config, rank = CONFIGS[args.config], args.rank
    train, held_out = corpus()
    data, val = as_tensor(rank_shard(train, rank)), as_tensor(held_out)
    model = make_model(args.seed)
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=args.inner_lr)
    gen = torch.Generator().manual_seed(1000 * args.seed + rank)

    def loss_of_batch() -> Any:
        x, y = sample_batch(data, gen)
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    def inner_step() -> None:
        loss = loss_of_batch()
        inner.zero_grad()
        loss.backward()
        inner.step()

    def report(window: int) -> None:
        emit(rank=rank, window=window, loss=held_out_loss(model, val, CURVE_SEQUENCES) if rank == 0 else None)

    salt = load_salt()
    async with connect_control_client(("127.0.0.1", args.control_port), rank, WORLD, salt, model_signature(model),
                                      heartbeat_timeout=HEARTBEAT_TIMEOUT_S):
        async with connect_reduce_client(("127.0.0.1", args.data_port), rank, WORLD, salt) as client:
            client.bf16_wire = config.bf16
            client.delta_codec = None if config.codec is None else DeltaCodec.parse(config.codec)
            client.delta_error_feedback = config.feedback
            await client.join(params, [])
            if config.sync:
                for window in range(args.windows):
                    for _ in range(args.inner_steps):
                        inner.zero_grad()
                        loss_of_batch().backward()
                        await client.all_reduce_tensors([p.grad for p in params], in_place=True)
                        inner.step()
                    report(window)
            else:
                async with open_window_trainer(
                    client, params, [], rank=rank, world_size=WORLD, sync_every=args.inner_steps,
                    overlap=config.overlap, merge_after=args.inner_steps // 4 if config.overlap else None,
                ) as trainer:
                    for window in range(args.windows):
                        await trainer.run_steps(args.inner_steps, inner_step)
                        report(window)
    emit(rank=rank, final=held_out_loss(model, val, FINAL_SEQUENCES) if rank == 0 else None,
         digest=params_digest(model))


def single_rank(args: argparse.Namespace, seed: int) -> tuple[list[float], float]:
    """The one-rank baseline in this process: (loss after each window, final loss)."""
    import torch

    torch.set_num_threads(1)
    train, held_out = corpus()
    data, val = as_tensor(train), as_tensor(held_out)
    model = make_model(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    gen = torch.Generator().manual_seed(1000 * seed)
    curve = []
    for _ in range(args.windows):
        for _ in range(args.inner_steps):
            x, y = sample_batch(data, gen)
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            inner.zero_grad()
            loss.backward()
            inner.step()
        curve.append(held_out_loss(model, val, CURVE_SEQUENCES))
    return curve, held_out_loss(model, val, FINAL_SEQUENCES)


# -- one cluster run ------------------------------------------------------------


def rank_command(args: argparse.Namespace, config: Config, seed: int, rank: int, cluster: Any) -> list[str]:
    (_, data_port), (_, control_port) = cluster.relay_address(rank), cluster.control_address(rank)
    return [sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--config", config.name,
            "--seed", str(seed), "--data-port", str(data_port), "--control-port", str(control_port),
            "--windows", str(args.windows), "--inner-steps", str(args.inner_steps), "--inner-lr", str(args.inner_lr)]


async def cluster_run(args: argparse.Namespace, config: Config, seed: int, workdir: Path) -> tuple[list[float], float]:
    """Daemons and four rank processes; (rank 0's loss after each window, its final loss)."""
    from flodl_trio.testing.processes import open_process_cluster
    from flodl_trio.wire.salt import SessionSalt

    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SessionSalt.generate(), daemons=True, external_ranks=range(WORLD),
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S, controller_args=["--outer", config.outer], log_dir=workdir,
        ) as cluster:
            lives = [await cluster.launch_rank(r, rank_command(args, config, seed, r, cluster)) for r in range(WORLD)]
            finals = [await life.wait_event(lambda e: "final" in e) for life in lives]
            for life in lives:
                await life.wait()
    if failed := [life.name for life in lives if life.returncode != 0]:
        raise RuntimeError(f"{config.name} seed {seed}: {failed} failed; logs in {workdir}")
    if len({f["digest"] for f in finals}) != 1:
        raise RuntimeError(f"{config.name} seed {seed}: the ranks ended with different params: {finals}")
    curve = [e["loss"] for e in lives[0].events if "window" in e]
    return curve, finals[0]["final"]


# -- the report -----------------------------------------------------------------


@attrs.frozen
class Result:
    config: str
    seed: int
    curve: list[float]
    final: float
    seconds: float


def summarize(results: list[Result], numel: int, args: argparse.Namespace) -> list[str]:
    finals: dict[str, list[float]] = {}
    for r in results:
        finals.setdefault(r.config, []).append(r.final)
    base = statistics.mean(finals["diloco-f32"]) if "diloco-f32" in finals else math.nan
    lines = [
        f"byte-level LM, {numel / 1e6:.2f} M params, 2 hosts x 2 ranks, {args.windows} windows x "
        f"{args.inner_steps} AdamW steps (lr {args.inner_lr}), batch {BATCH} x {CONTEXT} bytes; held-out loss "
        f"(nats/byte) over {FINAL_SEQUENCES} windows after the last window",
        "| config | wire MB / rank / round | mean | spread (max - min) | per seed | vs DiLoCo f32 |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for name, values in finals.items():
        mean = statistics.mean(values)
        per_seed = ", ".join(f"{v:.4f}" for v in values)
        wire = "-" if CONFIGS[name].single else f"{CONFIGS[name].wire_bytes(numel) / 1e6:.2f}"
        lines.append(f"| {name} | {wire} | {mean:.4f} | {max(values) - min(values):.4f} | {per_seed} | {mean / base:.4f} |")
    return lines


def verdicts(results: list[Result]) -> list[str]:
    means: dict[str, float] = {}
    for name in {r.config for r in results}:
        means[name] = statistics.mean(r.final for r in results if r.config == name)
    out = []
    for name, bound in (("diloco-int8", 1.01), ("diloco-fp4", 1.02)):
        if name in means and "diloco-f32" in means:
            ok = means[name] <= bound * means["diloco-f32"]
            out.append(f"{'PASS' if ok else 'FAIL'}: {name} {means[name]:.4f} <= {bound} x DiLoCo f32 {means['diloco-f32']:.4f}")
        if name in means and "single" in means:
            ok = means[name] <= means["single"]
            out.append(f"{'PASS' if ok else 'FAIL'}: {name} {means[name]:.4f} <= one rank {means['single']:.4f}")
    return out


def plot(results: list[Result], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r.config for r in results):
        curves = [r.curve for r in results if r.config == name]
        mean = [statistics.mean(step) for step in zip(*curves)]
        steps = [(i + 1) * args.inner_steps for i in range(len(mean))]
        ax.plot(steps, mean, marker="o", markersize=3, label=name, linestyle="--" if "noef" in name else "-")
    ax.set_xlabel("inner steps per rank")
    ax.set_ylabel(f"held-out loss, nats/byte ({CURVE_SEQUENCES} windows; mean over seeds)")
    ax.set_title("byte-level LM on the Python stdlib: 2 hosts x 2 ranks")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=16)
    ap.add_argument("--inner-lr", type=float, default=2e-3)
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    ap.add_argument("--json", default=None, help="write every run's results to this file")
    # A rank process (started by the benchmark itself):
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--data-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--control-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        trio.run(rank_main, args)
        return 0
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    numel = sum(p.numel() for p in make_model(0).parameters())
    workdir = Path(tempfile.mkdtemp(prefix="lm-codecs-"))
    results = []
    for name in names:
        for seed in seeds:
            t0 = time.monotonic()
            if CONFIGS[name].single:
                curve, final = single_rank(args, seed)
            else:
                run_dir = workdir / f"{name}-{seed}"
                run_dir.mkdir()
                curve, final = trio.run(cluster_run, args, CONFIGS[name], seed, run_dir)
            results.append(Result(name, seed, curve, final, time.monotonic() - t0))
            print(f"{name} seed {seed}: held-out loss {final:.4f} ({results[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
    print("\n".join(summarize(results, numel, args)))
    print("\n".join(verdicts(results)))
    if args.plot:
        plot(results, args.plot, args)
    if args.json:
        Path(args.json).write_text(json.dumps([attrs.asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
