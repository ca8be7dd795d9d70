"""``python -m flodl_trio.shard``: a reduction shard (docs/wire.md, "Shards").

It serves until the controller that set it up closes its connection."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import AsyncExitStack

import trio

from ..shard import ShardHandle, open_shard
from ..transport.settings import NetBounds, load_salt, timeout_scale
from ..wire.salt import SessionSalt
from .common import DaemonParser, add_common_flags, env_default, parse_or_exit, port_number, run_daemon, startup_step

log = logging.getLogger("flodl_trio.shard")


def build_parser() -> argparse.ArgumentParser:
    parser = DaemonParser(
        prog="python -m flodl_trio.shard",
        description="A reduction shard: sums the lanes of each round the controller places on it.",
        epilog="Every flag can also come from the environment variable named in its help. "
        "The salt is read from a file or FLODL_SALT_HEX, never from the command line.",
    )
    parser.add_argument("--host", default=env_default("FLODL_SHARD_HOST", "0.0.0.0"),
                        help="address to listen on [env FLODL_SHARD_HOST; default 0.0.0.0]")
    parser.add_argument("--port", type=port_number, default=env_default("FLODL_SHARD_PORT", 1338),
                        help="port for the controller and the relays (0: a free one, which the start line says) "
                        "[env FLODL_SHARD_PORT; default 1338]")
    parser.add_argument("--with-parent", action="store_true",
                        help="leave once standard input closes: the process that started it (a relay daemon "
                        "serving its host's shard) is gone; standard output says 'listening PORT' once it "
                        "listens and 'set up INDEX' once a controller set it up")
    add_common_flags(parser, metrics=False)  # no metrics endpoint: a shard serves none
    return parser


async def _until_stdin_closes() -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    try:
        while await stdin.receive_some(4096):
            pass
    finally:
        await stdin.aclose()


def _tell_parent(line: str) -> None:
    """One line on standard output for the process that started it (whatever the log level)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _tell_parent_when_set_up(shard: ShardHandle) -> None:
    await shard.set_up.wait()
    _tell_parent(f"set up {shard.index}")


def shard_bounds() -> NetBounds:
    """The shard's bounds: FLODL_NET_TIMEOUT_SCALE only. How long it holds for a lost
    controller is what that controller tells it (``Outage``), so FLODL_CONTROLLER_OUTAGE
    is none of its settings: a value meant for the relays and ranks sharing its
    environment (or a bad one) must not stop it."""
    return NetBounds.scaled(timeout_scale(os.environ))


async def serve_shard_daemon(args: argparse.Namespace, salt: SessionSalt, bounds: NetBounds | None = None) -> None:
    async with AsyncExitStack() as stack:
        with startup_step(f"starting on {args.host}:{args.port}"):
            shard = await stack.enter_async_context(
                open_shard(args.host, args.port, salt=salt, ceiling=args.frame_ceiling,
                           bounds=bounds or shard_bounds())
            )
        log.info("shard started: listening on %s:%d", args.host, shard.port)
        async with trio.open_nursery() as nursery:
            if args.with_parent:
                async def parent_gone() -> None:
                    await _until_stdin_closes()
                    log.info("shard: the process that started it is gone; leaving")
                    nursery.cancel_scope.cancel()

                _tell_parent(f"listening {shard.port}")
                nursery.start_soon(_tell_parent_when_set_up, shard)
                nursery.start_soon(parent_gone)
            await shard.outcome.wait()
            nursery.cancel_scope.cancel()
        log.info("shard finished: %d rounds, %d lanes of delta rounds summed, %d pieces of hosts left out dropped, "
                 "%d lanes of its predecessors mirrored, %d lanes of a lost shard taken over from the mirror",
                 shard.rounds, shard.delta_lanes_summed, shard.pieces_dropped, shard.lanes_mirrored,
                 shard.lanes_taken_over)


def main(argv: list[str] | None = None) -> int:
    salts: list[SessionSalt] = []  # read before starting: a missing salt is a bad setting (exit 2)
    args = parse_or_exit(build_parser(), argv, lambda a: salts.append(load_salt(a.salt_file)))
    bounds = shard_bounds()
    return run_daemon("shard", lambda: serve_shard_daemon(args, salts[0], bounds))
