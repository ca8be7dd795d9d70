"""One rank of the demo, in its own process (``python -m flodl_trio.demo --worker``).

It trains the model with Local SGD through :func:`open_window_trainer` and
reports one JSON line per event on stdout, which the orchestrator follows:
``joined`` (the window it starts at: 0, or after a restart the cluster's
window), one ``window`` line per averaging window, and ``final_loss``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..fold.outer import DiLoCoNesterov, SlowMo
from ..wire.quant import DeltaCodec

WORLD = 4
HOSTS = [[0, 1], [2, 3]]
BATCH = 64
SAMPLES = 4096
# What the ranks' window trainer mirrors of the controller's --outer (default hyperparameters on both).
OUTERS: dict[str, Any] = {"none": lambda: None, "slowmo": SlowMo, "diloco": DiLoCoNesterov}


def emit(rank: int, **fields: Any) -> None:
    """One event for the orchestrator: a JSON line on stdout, flushed at once."""
    print(json.dumps({"rank": rank, **fields}), flush=True)


async def worker(args: argparse.Namespace) -> None:
    import torch

    from ..client import connect_control_client
    from ..client.reduce import connect_reduce_client
    from ..client.tensors import model_signature
    from ..train.trainer import open_window_trainer
    from ..transport.settings import load_salt
    from .model import make_data, make_model, validation_loss

    torch.set_num_threads(1)
    rank, salt = args.rank, load_salt()
    model = make_model(args.seed)
    shard = make_data(rank, SAMPLES)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    params = list(model.parameters())
    buffers = [b for b in model.buffers() if b.dtype.is_floating_point]
    gen = torch.Generator().manual_seed(rank + 1000 * args.seed)  # minibatch order
    losses: list[float] = []

    def inner_step() -> None:
        model.train()
        idx = torch.randint(0, shard.x.shape[0], (BATCH,), generator=gen)
        loss = torch.nn.functional.mse_loss(model(shard.x[idx]), shard.y[idx])
        inner.zero_grad()
        loss.backward()
        inner.step()
        losses.append(loss.item())

    async with connect_control_client(
        ("127.0.0.1", args.control_port), rank, WORLD, salt, model_signature(model), heartbeat_timeout=args.heartbeat_timeout
    ):
        async with connect_reduce_client(("127.0.0.1", args.data_port), rank, WORLD, salt) as client:
            client.bf16_wire = args.bf16
            client.delta_codec = None if args.codec is None else DeltaCodec.parse(args.codec)  # before join()
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
                emit(rank, joined=step / args.inner_steps, consensus_loss=validation_loss(model, shard))
                while step < total:
                    todo = args.inner_steps - step % args.inner_steps
                    await trainer.run_steps(todo, inner_step)
                    step += todo
                    local_loss, losses[:] = sum(losses) / len(losses), []
                    emit(rank, window=step // args.inner_steps - 1, local_loss=local_loss,
                         consensus_loss=validation_loss(model, shard),
                         live=sum(1 for c in trainer.stats.last_counts if c > 0) if trainer.stats.last_counts else None,
                         waited=trainer.stats.waited_s)
            # Leaving the trainer's block brought the last window's round in (with --overlap).
            emit(rank, final_loss=validation_loss(model, shard), waited=trainer.stats.waited_s,
                 late_steps=trainer.stats.late_steps)


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The training flags a rank process is started with: the orchestrator's own."""
    flags = ["--windows", str(args.windows), "--inner-steps", str(args.inner_steps),
             "--heartbeat-timeout", str(args.heartbeat_timeout), "--overlap", str(args.overlap),
             "--fragments", str(args.fragments), "--seed", str(args.seed), "--outer", args.outer,
             "--inner-lr", str(args.inner_lr)]
    if args.merge_after is not None:
        flags += ["--merge-after", str(args.merge_after)]
    if args.merge_by is not None:
        flags += ["--merge-by", str(args.merge_by)]
    if args.eager_stand_in:
        flags.append("--eager-stand-in")
    if args.bf16:
        flags.append("--bf16")
    if args.codec is not None:
        flags += ["--codec", args.codec]
    return flags
