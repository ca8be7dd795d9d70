"""A scripted rank in its own OS process, for fault tests with real signals.

    FLODL_SALT_HEX=... python -m flodl_trio.testing.rank_worker --rank 2 --world-size 4 \\
        --data 127.0.0.1:5001 [--control 127.0.0.1:5002] --rounds 10

Round k contributes a tensor filled with ``(rank + 1) * (k + 1)`` with mass 1,
so a test can compute the consensus of any set of survivors by hand. Every
event is one JSON line on stdout, with ``time`` (``time.monotonic()``, the
same clock in every process of the machine):

- ``ready``: both connections are up;
- ``paused`` / ``resumed`` (with ``round``): around a ``--pause-before`` hold;
- ``sending`` (with ``round``): the frame is about to go out;
- ``round``: the consensus came back: ``value`` (its first element), ``min`` and
  ``max`` over every element, and the accepted ``mass``;
- ``error``: a :class:`~flodl_trio.FlodlError` ended the rank (``type``, ``message``;
  exit status 3);
- ``crash``: any other exception (``type``, ``message``, ``traceback``; exit status 4);
- ``done``: every round completed (exit status 0).

``--windows N`` runs Local SGD instead, as a trainer would: ``joined``
(``start``: the window :meth:`ReduceClient.join` returned; ``state_window``: the
window whose consensus it loaded, with the loaded params' ``head`` and
``digest``), then per window a ``window`` event with the
gathered ``counts``, the consensus params' first values (``head``), the
buffers, and a ``digest`` of every byte. Window ``w`` adds
:func:`window_delta` to the params and reports :func:`window_steps` steps.

``--backend numpy`` builds the frames with numpy instead of torch: the same
bytes on the wire, and the process starts in a fraction of the time (no torch
import), which matters when a test starts dozens of ranks on a small machine.

``--pause-before ROUND:SECONDS`` holds the rank before it sends round ROUND,
for SECONDS or until a line ``go`` arrives on stdin (``ProcessCluster.resume``),
whichever comes first. The rank keeps heartbeating while it waits.

``--block-before ROUND:SECONDS`` instead blocks the whole event loop for
SECONDS (``time.sleep``), like a trainer doing synchronous work without
yielding to trio: no heartbeat goes out, no beacon is read (events
``blocking`` / ``unblocked``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import trio

from flodl_trio.transport.tasks import ChangeSignal

SALT_ENV = "FLODL_SALT_HEX"
EXIT_ERROR = 3
EXIT_CRASH = 4


def contribution(rank: int, round_index: int) -> float:
    """What rank ``rank`` sends in round ``round_index`` (shared with the tests)."""
    return float((rank + 1) * (round_index + 1))


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "time": time.monotonic(), **fields}), flush=True)


T = TypeVar("T", int, float)


def _round_and(text: str, what: str, convert: Callable[[str], T], valid: Callable[[T], bool]) -> tuple[int, T]:
    """``"ROUND:VALUE"`` -> (round, value), ``what`` naming VALUE in the error."""
    round_text, sep, value_text = text.partition(":")
    try:
        round_index, value = int(round_text), convert(value_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want ROUND:{what}, got {text!r}") from None
    if not sep or round_index < 0 or not valid(value):
        raise argparse.ArgumentTypeError(f"want ROUND:{what} with ROUND >= 0 and a valid {what}, got {text!r}")
    return round_index, value


def parse_pause(text: str) -> tuple[int, float]:
    """``"ROUND:SECONDS"`` -> (round, seconds); SECONDS may be ``inf``."""
    return _round_and(text, "SECONDS", float, lambda seconds: seconds >= 0)


def parse_numel_at(text: str) -> tuple[int, int]:
    """``"ROUND:NUMEL"`` -> (round, numel): that round's frame has another size."""
    return _round_and(text, "NUMEL", int, lambda numel: numel > 0)


class _Go:
    """Lines ``go`` on stdin, counted; a pause consumes one."""

    def __init__(self) -> None:
        self.available = 0
        self.changed = ChangeSignal()

    async def read_stdin(self) -> None:
        stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        pending = b""
        async with stream:
            while chunk := await stream.receive_some(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip() == b"go":
                        self.available += 1
                        self.changed.notify()

    async def wait(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            while not self.available:
                await self.changed.wait()
            self.available -= 1


async def _reduce_numpy(client: Any, rank: int, k: int, numel: int) -> tuple[Any, float]:
    import numpy as np

    from flodl_trio.wire.constants import DTYPE_F32
    from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload

    local = np.full(numel, contribution(rank, k), dtype="<f4")
    reply = await client.all_reduce(RoundFrame([TensorPayload(DTYPE_F32, (numel,), local)], RoundKind.MODEL, 1.0))
    payload = reply.tensors[0]
    values = np.frombuffer(payload.data, dtype="<f4") if not payload.elided else np.zeros(numel, dtype="<f4")
    return values, float(reply.weight)


async def _reduce_torch(client: Any, rank: int, k: int, numel: int) -> tuple[Any, float]:
    import torch

    from flodl_trio.wire.round_frame import RoundKind

    local = torch.full((numel,), contribution(rank, k))
    out, mass = await client.all_reduce_scaled([local], 1.0, RoundKind.MODEL, 1.0)
    return out[0].numpy(), float(mass)


async def _rounds(args: argparse.Namespace, client: Any, go: _Go) -> None:
    reduce = _reduce_numpy if args.backend == "numpy" else _reduce_torch
    pauses = dict(args.pause_before or [])
    blocks = dict(args.block_before or [])
    numels = dict(args.numel_at or [])
    for k in range(args.rounds):
        if k in blocks:
            emit("blocking", rank=args.rank, round=k)
            time.sleep(blocks[k])  # on purpose: the event loop stalls
            emit("unblocked", rank=args.rank, round=k)
        if k in pauses:
            emit("paused", rank=args.rank, round=k)
            await go.wait(pauses[k])
            emit("resumed", rank=args.rank, round=k)
        emit("sending", rank=args.rank, round=k)
        values, mass = await reduce(client, args.rank, k, numels.get(k, args.numel))
        emit(
            "round", rank=args.rank, round=k, value=float(values[0]), min=float(values.min()),
            max=float(values.max()), mass=mass,
        )
        await trio.sleep(args.pause)


def window_steps(rank: int) -> int:
    """Local steps rank ``rank`` reports each window: 2**rank, so the params round's
    accepted mass (a sum of distinct powers of two) names exactly who made it in."""
    return 1 << rank


def window_delta(rank: int, window: int, numel: int) -> Any:
    """What rank ``rank``'s "training" adds to its params in ``window`` (shared with the tests)."""
    import numpy as np

    return np.random.default_rng([rank, window]).standard_normal(numel).astype(np.float32)


def _digest(tensors: list[Any]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:32]


async def _windows(args: argparse.Namespace, client: Any, go: _Go) -> None:
    """Local SGD as a trainer writes it: join (a no-op at first start, the consensus after
    a restart), then ``average_window`` once per window, from the window join returns."""
    import torch

    from flodl_trio.train.realized_work import average_window

    params = [torch.zeros(args.numel)]
    buffers = [torch.zeros(2)]
    start = await client.join(params, buffers)
    state = client.last_state
    emit(
        "joined", rank=args.rank, start=start, state_window=state.window, head=params[0][:8].tolist(),
        digest=_digest(params + buffers), state_bytes=state.nbytes, transfer_seconds=state.transfer_seconds,
    )
    pauses = dict(args.pause_before or [])
    for window in range(start, args.windows):
        if window in pauses:
            emit("paused", rank=args.rank, round=window)
            await go.wait(pauses[window])
        with torch.no_grad():
            params[0].add_(torch.from_numpy(window_delta(args.rank, window, args.numel)))
            buffers[0].add_(float(args.rank + 1))
        emit("sending", rank=args.rank, round=window)
        result = await average_window(
            client, params, buffers, window_steps(args.rank), rank=args.rank, world_size=args.world_size, in_place=True
        )
        emit(
            "window", rank=args.rank, window=window, counts=result.counts, head=params[0][:8].tolist(),
            buffers=buffers[0].tolist(), digest=_digest(params + buffers),
        )
        await trio.sleep(args.pause)


async def _trainer(args: argparse.Namespace, client: Any, go: _Go) -> None:
    """The window loop run by :func:`open_window_trainer`: ``--train-windows`` windows of
    ``--sync-every`` inner steps, each a ``--step-time`` wait (accelerator time) then
    a made-up update, the round overlapped with ``--overlap 1``, the params
    (``--fragments`` tensors of ``--numel``) synced in ``--fragments`` fragments;
    ``last_fragment`` digests the last fragment's elements (synced at the last step)."""
    import time

    import torch

    from flodl_trio.client.tensors import fragment_pieces
    from flodl_trio.train.trainer import open_window_trainer

    params = [torch.zeros(args.numel) for _ in range(args.fragments)]
    step = 0

    def inner_step() -> None:
        nonlocal step
        time.sleep(args.step_time)
        for index, p in enumerate(params):
            p.add_(torch.from_numpy(window_delta(args.rank + index, step, args.numel)))
        step += 1

    async with open_window_trainer(
        client, params, rank=args.rank, world_size=args.world_size, sync_every=args.sync_every, overlap=args.overlap,
        fragments=args.fragments,
    ) as trainer:
        for window in range(args.train_windows):
            await trainer.run_steps(args.sync_every, inner_step)
            emit("window", rank=args.rank, window=window, merged=trainer.stats.windows, counts=trainer.stats.last_counts)
    last_fragment = fragment_pieces(params, args.fragments)[-1]
    emit(
        "trained", rank=args.rank, windows=trainer.stats.windows, waited=trainer.stats.waited_s,
        digest=_digest(params), head=params[0][:4].tolist(), last_fragment=_digest(last_fragment),
    )


async def run(args: argparse.Namespace) -> None:
    from flodl_trio.client import connect_control_client
    from flodl_trio.client.reduce import connect_reduce_client
    from flodl_trio.errors import FlodlError
    from flodl_trio.wire.salt import SessionSalt

    if args.backend == "torch":
        # Import torch (and the tensor bridge) before the control channel is up: an
        # import inside the first round would stall the event loop for seconds on a
        # busy machine, and with it the heartbeats.
        import flodl_trio.client.tensors  # noqa: F401

    salt = SessionSalt.from_hex(os.environ[SALT_ENV])
    data_salt = SessionSalt.from_hex(args.data_salt) if args.data_salt else salt
    control_salt = SessionSalt.from_hex(args.control_salt) if args.control_salt else salt
    connect = {"connect_attempts": args.connect_attempts, "connect_interval": args.connect_interval}
    go = _Go()
    await trio.sleep(args.start_delay)  # a rank that comes late (formation without it)
    try:
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            if args.pause_before:
                nursery.start_soon(go.read_stdin)
            if args.control:
                signature = bytes.fromhex(args.model_signature) if args.model_signature else b"\x11" * 32
                await stack.enter_async_context(
                    connect_control_client(
                        args.control, args.rank, args.world_size, control_salt, signature,
                        heartbeat_timeout=args.heartbeat_timeout, **connect,
                    )
                )
            client = await stack.enter_async_context(
                connect_reduce_client(
                    args.data, args.rank, args.world_size, data_salt, local_leg=False if args.tcp else None, **connect
                )
            )
            client.bf16_wire = args.bf16
            if args.codec:
                from flodl_trio.wire.quant import DeltaCodec

                client.delta_codec = DeltaCodec.parse(args.codec)
            emit("ready", rank=args.rank)
            loop = _trainer if args.train_windows is not None else _windows if args.windows is not None else _rounds
            await loop(args, client, go)
            nursery.cancel_scope.cancel()
        emit("done", rank=args.rank)
    except BaseExceptionGroup as group:
        from flodl_trio.transport.tasks import unwrap_group

        _report(args.rank, unwrap_group(group), FlodlError)
    except Exception as exc:
        _report(args.rank, exc, FlodlError)


def _report(rank: int, exc: BaseException, flodl_error: type[Exception]) -> None:
    if isinstance(exc, flodl_error):
        emit("error", rank=rank, type=type(exc).__name__, message=str(exc))
        sys.exit(EXIT_ERROR)
    emit(
        "crash", rank=rank, type=type(exc).__name__, message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
    )
    sys.exit(EXIT_CRASH)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flodl_trio.testing.rank_worker", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--data", required=True, help="host:port of this host's data relay")
    parser.add_argument("--control", help="host:port of this host's control relay")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--windows", type=int, default=None,
        help="run Local SGD windows instead of rounds: join, then average_window per window (torch backend)",
    )
    parser.add_argument("--numel", type=int, default=4)
    parser.add_argument(
        "--numel-at", type=parse_numel_at, action="append", metavar="ROUND:NUMEL",
        help="send round ROUND with NUMEL elements instead of --numel (a rank whose schema changes; repeatable)",
    )
    parser.add_argument("--start-delay", type=float, default=0.0, help="seconds to wait before connecting")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between rounds")
    parser.add_argument(
        "--pause-before", type=parse_pause, action="append", metavar="ROUND:SECONDS",
        help="hold before sending round ROUND for SECONDS, or until 'go' on stdin (repeatable)",
    )
    parser.add_argument(
        "--block-before", type=parse_pause, action="append", metavar="ROUND:SECONDS",
        help="block the event loop (time.sleep) for SECONDS before sending round ROUND (repeatable)",
    )
    parser.add_argument("--heartbeat-timeout", type=float, default=None)
    parser.add_argument("--model-signature", help="64 hex chars (default: a fixed signature)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--codec", help="params rounds as coded deltas (int8:1024, fp4:256, ...)")
    parser.add_argument("--backend", choices=("torch", "numpy"), default="torch",
                        help="build frames with torch (default) or numpy (starts faster)")
    parser.add_argument("--train-windows", type=int, default=None,
                        help="run the WindowTrainer loop for this many windows (see --sync-every, --overlap)")
    parser.add_argument("--sync-every", type=int, default=4, help="inner steps per window (--train-windows)")
    parser.add_argument("--overlap", type=int, default=0, choices=(0, 1), help="overlap each window's round (--train-windows)")
    parser.add_argument("--step-time", type=float, default=0.01, help="seconds one inner step waits (--train-windows)")
    parser.add_argument("--fragments", type=int, default=1, help="sync the params in this many fragments (--train-windows)")
    parser.add_argument("--tcp", action="store_true",
                        help="reach the data relay over TCP with MACs even where the local leg is offered")
    parser.add_argument("--data-salt", help=f"salt hex for the data connection (default ${SALT_ENV})")
    parser.add_argument("--control-salt", help=f"salt hex for the control connection (default ${SALT_ENV})")
    parser.add_argument("--connect-attempts", type=int, default=60)
    parser.add_argument("--connect-interval", type=float, default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.bf16 and args.backend == "numpy":
        build_parser().error("--bf16 needs --backend torch")
    if args.windows is not None and (args.backend == "numpy" or not 0 <= args.rank < 30):
        build_parser().error("--windows needs --backend torch and a rank below 30")
    if args.numel <= 0 or not math.isfinite(args.pause) or not 0 <= args.start_delay < math.inf:
        build_parser().error("--numel must be > 0, --pause finite and --start-delay finite and >= 0")
    trio.run(run, args)


if __name__ == "__main__":
    main()
