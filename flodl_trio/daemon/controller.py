"""``python -m flodl_trio.controller``: the controller daemon (data + coordinator on one port)."""

from __future__ import annotations

import argparse
import logging
import math
from typing import Literal
from contextlib import AsyncExitStack

import attrs
import trio

from ..controller.checkpointer import ConsensusCheckpointer
from ..controller.config import check_lanes, check_shards, lanes_or_default, membership_policy
from ..controller.core import open_controller
from ..errors import ConfigError
from ..fold.outer import DiLoCoNesterov, PlainAverage, SlowMo
from ..shard import shard_server
from ..transport.settings import DEFAULT_CONTROLLER_OUTAGE, OUTAGE_ENV, NetBounds, load_salt
from ..wire.salt import SessionSalt
from .common import (
    DaemonParser,
    add_common_flags,
    env_default,
    env_switch,
    finite_positive,
    net_bounds,
    parse_host_port,
    parse_or_exit,
    port_number,
    run_daemon,
    startup_step,
)
from .launch import DEFAULT_CONTROLLER_PORT

log = logging.getLogger("flodl_trio.controller")

OUTER_CHOICES = ("none", "average", "slowmo", "diloco")


# Generous: a preempted machine may take many minutes to come back. Only ranks
# whose trainer called join() are waited for, and only until they say they finished.
DEFAULT_REJOIN_TIMEOUT_S = 1800.0


def build_parser() -> argparse.ArgumentParser:
    parser = DaemonParser(
        prog="python -m flodl_trio.controller",
        description="The cluster's controller: sums the hosts' frames each round and divides once by "
        "the realized-work mass; the same port serves the coordinator (heartbeats).",
        epilog="Every flag can also come from the environment variable named in its help. "
        "The salt is read from a file or FLODL_SALT_HEX, never from the command line.",
    )
    parser.add_argument("--host", default=env_default("FLODL_CONTROLLER_HOST", "0.0.0.0"),
                        help="address to listen on [env FLODL_CONTROLLER_HOST; default 0.0.0.0]")
    parser.add_argument("--port", type=port_number,
                        default=env_default(("FLODL_CONTROLLER_PORT", "MASTER_PORT"), DEFAULT_CONTROLLER_PORT),
                        help="port for relays (data and control) [env FLODL_CONTROLLER_PORT or MASTER_PORT; default 1337]")
    parser.add_argument("--world-size", type=int, default=env_default(("FLODL_WORLD_SIZE", "WORLD_SIZE")),
                        help="ranks in the whole cluster [env FLODL_WORLD_SIZE or WORLD_SIZE]")
    parser.add_argument("--heartbeat-timeout", type=float, default=env_default("FLODL_HEARTBEAT_TIMEOUT"),
                        help="declare a rank dead after this many seconds without a heartbeat "
                        "[env FLODL_HEARTBEAT_TIMEOUT; default 30 x FLODL_NET_TIMEOUT_SCALE]")
    parser.add_argument("--outer", default=env_default("FLODL_OUTER", "none"), choices=OUTER_CHOICES,
                        help="outer optimizer applied to each window's params consensus: none, average "
                        "(same as none), slowmo or diloco [env FLODL_OUTER; default none]")
    parser.add_argument("--outer-lr", type=float, default=env_default("FLODL_OUTER_LR"),
                        help="outer learning rate [env FLODL_OUTER_LR; default 1.0 slowmo, 0.7 diloco]")
    parser.add_argument("--outer-momentum", type=float, default=env_default("FLODL_OUTER_MOMENTUM"),
                        help="outer momentum [env FLODL_OUTER_MOMENTUM; default 0.5 slowmo, 0.9 diloco]")
    parser.add_argument("--shards", default=env_default("FLODL_SHARDS", "auto"),
                        help="reduction shards that reduce lanes 1.. of each round in lanes: auto (the shards the "
                        "relays offer, once three or more have; none with --lanes 1; they step --outer and hold "
                        "through a restart with --checkpoint-dir), "
                        "off or 1 (this controller reduces every lane), or host:port,... "
                        "[env FLODL_SHARDS; default auto]")
    parser.add_argument("--checkpoint-dir", default=env_default("FLODL_CHECKPOINT_DIR"),
                        help="write each window's consensus here as safetensors, and the run's resume record: a controller "
                        "started again with it takes the run on [env FLODL_CHECKPOINT_DIR; default off]")
    parser.add_argument("--checkpoint-every", type=int, default=env_default("FLODL_CHECKPOINT_EVERY", 1),
                        help="checkpoint every Nth window [env FLODL_CHECKPOINT_EVERY; default 1]")
    parser.add_argument("--checkpoint-keep", type=int, default=env_default("FLODL_CHECKPOINT_KEEP", 3),
                        help="newest checkpoints to keep [env FLODL_CHECKPOINT_KEEP; default 3]")
    parser.add_argument("--rejoin-timeout", type=float,
                        default=env_default("FLODL_REJOIN_TIMEOUT", DEFAULT_REJOIN_TIMEOUT_S),
                        help="seconds a crashed rank whose trainer calls join() may come back (restart it with the "
                        "same command); 0: dead is final [env FLODL_REJOIN_TIMEOUT; default "
                        f"{DEFAULT_REJOIN_TIMEOUT_S:g}]")
    parser.add_argument("--min-ranks", type=int, default=env_default("FLODL_MIN_RANKS"),
                        help="start once this many ranks are present after --formation-timeout; the others join "
                        "later (their trainers call join()) [env FLODL_MIN_RANKS; default: every rank]")
    parser.add_argument("--formation-timeout", type=float, default=env_default("FLODL_FORMATION_TIMEOUT"),
                        help="seconds to wait for every rank before starting with --min-ranks "
                        "[env FLODL_FORMATION_TIMEOUT; default: wait for every rank]")
    parser.add_argument("--keep-serving", action="store_true", default=env_switch("FLODL_KEEP_SERVING"),
                        help="keep running after every rank has finished [env FLODL_KEEP_SERVING=1; default: exit 0]")
    parser.add_argument("--controller-outage", type=float, default=None, metavar="SECONDS",
                        help="with --checkpoint-dir: how long relays and ranks hold for this controller if it is "
                        "lost, to be started again and resume (they are told; their own setting wins) "
                        f"[env {OUTAGE_ENV}; default {DEFAULT_CONTROLLER_OUTAGE:g}]")
    add_common_flags(parser)
    return parser


@attrs.frozen
class ControllerDaemonSettings:
    host: str
    port: int
    world_size: int
    salt: SessionSalt
    heartbeat_timeout: float | None
    outer: BuiltInOuter | None
    checkpoint_dir: str | None
    checkpoint_every: int
    checkpoint_keep: int
    rejoin_timeout: float = 0.0
    min_ranks: int | None = None
    formation_timeout: float | None = None
    deterministic: bool = False
    lanes: int | None = None  # None: the controller's default
    bounds: NetBounds = attrs.field(factory=NetBounds.from_env)  # the environment, read once
    shards: tuple[tuple[str, int], ...] | Literal["auto"] = ()


def parse_shards(text: str) -> tuple[tuple[str, int], ...] | Literal["auto"]:
    """``--shards``: auto, off (or empty, none, 1: one reducer, this controller - the
    star, flodl's bytes), or host:port,..."""
    text = text.strip()
    if text == "auto":
        return "auto"
    if text in ("", "off", "none", "1"):
        return ()
    if text.isdigit():
        raise ConfigError(f"--shards {text}: a count other than 1 names no shard; give auto, off (or 1), or "
                          "host:port,... (each a flodl_trio.shard daemon, or a relay daemon's --shard)")
    return tuple(parse_host_port(part.strip(), "--shards") for part in text.split(",") if part.strip())


# What --outer names: each is both an OuterOptimizer and checkpointable (StatefulOuter).
BuiltInOuter = PlainAverage | SlowMo | DiLoCoNesterov


def make_outer(name: str, lr: float | None, momentum: float | None) -> BuiltInOuter | None:
    """The optimizer ``--outer`` names; any other name is refused (never a silent default)."""
    options = {k: v for k, v in (("lr", lr), ("momentum", momentum)) if v is not None}
    if options and name in ("none", "average"):  # a hyperparameter nothing would use: --outer forgotten, surely
        flags = " and ".join(f"--outer-{key}" for key in options)
        raise ConfigError(f"{flags} given with --outer {name}, which has no such setting: "
                          "give --outer slowmo or --outer diloco, or leave them out")
    if name == "none":
        return None
    if name == "average":
        return PlainAverage()
    kinds: dict[str, type[SlowMo] | type[DiLoCoNesterov]] = {"slowmo": SlowMo, "diloco": DiLoCoNesterov}
    if name not in kinds:
        raise ConfigError(f"--outer must be one of {', '.join(OUTER_CHOICES)}; got {name!r}")
    for key, value in options.items():  # each checked alone, so the error names its own flag
        try:
            kinds[name](**{key: value})
        except ConfigError as exc:
            raise ConfigError(f"--outer-{key}: {exc}") from None
    return kinds[name](**options)


def settings_from_args(args: argparse.Namespace) -> ControllerDaemonSettings:
    if args.world_size is None:
        raise ConfigError("pass --world-size (or set FLODL_WORLD_SIZE / WORLD_SIZE)")
    world = int(args.world_size)
    if world <= 0:
        raise ConfigError(f"--world-size must be > 0, got {world}")
    timeout = finite_positive(args.heartbeat_timeout, "--heartbeat-timeout")
    if args.checkpoint_every < 1 or args.checkpoint_keep < 1:
        raise ConfigError("--checkpoint-every and --checkpoint-keep must be >= 1")
    lanes = None if args.lanes is None else int(args.lanes)
    rejoin = float(args.rejoin_timeout)
    if not (math.isfinite(rejoin) and rejoin >= 0):
        raise ConfigError(f"--rejoin-timeout must be a finite number of seconds >= 0, got {args.rejoin_timeout}")
    min_ranks = None if args.min_ranks is None else int(args.min_ranks)
    formation = None if args.formation_timeout is None else float(args.formation_timeout)
    membership_policy(world, rejoin, min_ranks, formation)  # refuses a policy that cannot work, before starting
    outer = make_outer(args.outer, args.outer_lr, args.outer_momentum)
    try:
        check_lanes(lanes_or_default(lanes, outer_optimizer=outer), outer_optimizer=outer)
    except ConfigError as exc:
        raise ConfigError(f"--lanes: {exc}") from None
    shards = parse_shards(args.shards)
    if shards and shards != "auto":  # shards named that cannot work with these settings: a bad setting, not a failure
        check_shards(lanes=lanes_or_default(lanes, outer_optimizer=outer), outer_optimizer=outer)
    return ControllerDaemonSettings(
        args.host, args.port, world, load_salt(args.salt_file), timeout, outer,
        args.checkpoint_dir, args.checkpoint_every, args.checkpoint_keep, rejoin, min_ranks, formation,
        bool(args.deterministic), lanes, bounds=net_bounds(args.controller_outage), shards=shards,
    )


def resume_dir_of(settings: ControllerDaemonSettings) -> str | None:
    """Where the run's resume record is kept: the checkpoint directory, unless relays and
    ranks are told not to hold for a lost controller (``--controller-outage 0``), when
    nobody would be left to resume with."""
    if settings.bounds.controller_outage == 0:
        return None
    return settings.checkpoint_dir or None


async def serve_controller_daemon(
    settings: ControllerDaemonSettings, *, ceiling: int, keep_serving: bool, metrics: tuple[str, int] | None = None
) -> None:
    async with AsyncExitStack() as stack:
        checkpoint = None
        if settings.checkpoint_dir:
            with startup_step(f"--checkpoint-dir {settings.checkpoint_dir}"):
                checkpoint = await stack.enter_async_context(
                    ConsensusCheckpointer(settings.checkpoint_dir, every=settings.checkpoint_every,
                                          keep=settings.checkpoint_keep, outer=settings.outer)
                )
        with startup_step(f"starting on {settings.host}:{settings.port}"):
            handle = await stack.enter_async_context(open_controller(
                settings.host, settings.port, world_size=settings.world_size, salt=settings.salt,
                outer_optimizer=settings.outer, checkpoint=checkpoint, ceiling=ceiling,
                heartbeat_timeout=settings.heartbeat_timeout, bounds=settings.bounds,
                rejoin_timeout=settings.rejoin_timeout, min_ranks=settings.min_ranks,
                formation_timeout=settings.formation_timeout, deterministic=settings.deterministic,
                lanes=settings.lanes, resume_dir=resume_dir_of(settings), shards=settings.shards,
                serve_shard=shard_server(salt=settings.salt, ceiling=ceiling, bounds=settings.bounds),
            ))
        if metrics is not None:
            from .metrics import serve_controller_metrics

            with startup_step(f"serving metrics on {metrics[0]}:{metrics[1]}"):
                port = stack.enter_context(serve_controller_metrics(metrics, handle))
            log.info("controller metrics on http://%s:%d/metrics", metrics[0], port)
        coordinator = handle.coordinator
        log.info(
            "controller started: listening on %s:%d world_size=%d heartbeat_timeout=%.1fs rejoin_timeout=%gs "
            "outer=%s checkpoints=%s resume_record=%s",
            settings.host, handle.port, settings.world_size,
            coordinator.heartbeat_timeout, settings.rejoin_timeout,
            type(settings.outer).__name__ if settings.outer else "none", settings.checkpoint_dir or "off",
            "on" if resume_dir_of(settings) else "off",
        )
        await handle.wait_finished()
        log.info(
            "controller finished: %d rounds, %d ranks dead or exited, %.2f MB in, %.2f MB out",
            handle.stats.rounds, handle.dead_ranks.dead_count(), handle.stats.bytes_in / 1e6, handle.stats.bytes_out / 1e6,
        )
        if keep_serving:
            await trio.sleep_forever()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    settings: list[ControllerDaemonSettings] = []
    args = parse_or_exit(parser, argv, lambda a: settings.append(settings_from_args(a)))
    metrics = (args.metrics_host, args.metrics_port) if args.metrics_port else None
    return run_daemon(
        "controller",
        lambda: serve_controller_daemon(settings[0], ceiling=args.frame_ceiling, keep_serving=args.keep_serving, metrics=metrics),
    )
