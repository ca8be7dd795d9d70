"""A scripted rank in its own OS process, for fault tests with real signals.

    FLODL_SALT_HEX=... python -m flodl_trio.testing.rank_worker --rank 2 --world-size 4 \\
        --data 127.0.0.1:5001 [--control 127.0.0.1:5002] --rounds 10

Round k contributes a tensor filled with ``(rank + 1) * (k + 1)`` with mass 1,
so a test can compute the consensus of any set of survivors by hand. Every
event is one JSON line on stdout: ``ready``, ``round`` (with the consensus
value and accepted mass), ``error`` (type and message), ``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import AsyncExitStack

import trio

SALT_ENV = "FLODL_SALT_HEX"


def contribution(rank: int, round_index: int) -> float:
    """What rank ``rank`` sends in round ``round_index`` (shared with the tests)."""
    return float((rank + 1) * (round_index + 1))


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "time": time.monotonic(), **fields}), flush=True)


async def run(args: argparse.Namespace) -> None:
    import torch

    from flodl_trio import FlodlError, RoundKind, SessionSalt, connect_reduce_client
    from flodl_trio.client import connect_control_client

    salt = SessionSalt.from_hex(os.environ[SALT_ENV])
    try:
        async with AsyncExitStack() as stack:
            if args.control:
                signature = bytes.fromhex(args.model_signature) if args.model_signature else b"\x11" * 32
                await stack.enter_async_context(
                    connect_control_client(
                        args.control, args.rank, args.world_size, salt, signature,
                        heartbeat_timeout=args.heartbeat_timeout,
                    )
                )
            client = await stack.enter_async_context(
                connect_reduce_client(args.data, args.rank, args.world_size, salt)
            )
            client.bf16_wire = args.bf16
            emit("ready", rank=args.rank)
            for k in range(args.rounds):
                local = torch.full((args.numel,), contribution(args.rank, k))
                out, mass = await client.all_reduce_scaled([local], 1.0, RoundKind.MODEL, 1.0)
                emit("round", rank=args.rank, round=k, value=out[0][0].item(), mass=mass)
                await trio.sleep(args.pause)
        emit("done", rank=args.rank)
    except FlodlError as exc:
        emit("error", rank=args.rank, type=type(exc).__name__, message=str(exc))
        sys.exit(3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--data", required=True, help="host:port of this host's data relay")
    parser.add_argument("--control", help="host:port of this host's control relay")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--numel", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between rounds")
    parser.add_argument("--heartbeat-timeout", type=float, default=None)
    parser.add_argument("--model-signature", help="64 hex chars (default: a fixed signature)")
    parser.add_argument("--bf16", action="store_true")
    trio.run(run, parser.parse_args(argv))


if __name__ == "__main__":
    main()
