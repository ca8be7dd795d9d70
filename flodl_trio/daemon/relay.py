"""``python -m flodl_trio.relay``: the per-host relay daemon (data and control channels)."""

from __future__ import annotations

import argparse
import logging
import math
import socket
from contextlib import AsyncExitStack
from pathlib import Path

import attrs
import trio

from ..errors import ConfigError
from ..relay.config import ChannelKind, RelayConfig
from ..relay.core import open_relay
from ..relay.host_ranks import HostRanks
from ..transport.local_leg import NO_UNIX_ENV, UNIX_DIR_ENV, ensure_private_dir, local_leg_dir
from ..transport.settings import OUTAGE_ENV, NetBounds, load_salt
from ..wire.lanes import MAX_LANES
from ..wire.salt import SessionSalt
from .child_shard import ShardKeeper
from .common import (
    DaemonParser,
    add_common_flags,
    env_default,
    env_switch,
    host_port,
    net_bounds,
    parse_host_port,
    parse_or_exit,
    parse_rank_list,
    port_number,
    run_daemon,
    startup_step,
)
from .launch import (
    CONTROL_PORT_OFFSET,
    DATA_PORT_OFFSET,
    check_port,
    controller_address,
    host_ranks_from_env,
)

log = logging.getLogger("flodl_trio.relay")


def build_parser() -> argparse.ArgumentParser:
    parser = DaemonParser(
        prog="python -m flodl_trio.relay",
        description="Per-host relay: folds this host's ranks into one uplink per channel.",
        epilog="Every flag can also come from the environment variable named in its help. "
        "The salt is read from a file or FLODL_SALT_HEX, never from the command line.",
    )
    parser.add_argument(
        "--controller", type=host_port, default=env_default("FLODL_CONTROLLER"),
        help="controller host:port [env FLODL_CONTROLLER; else MASTER_ADDR:MASTER_PORT]",
    )
    parser.add_argument(
        "--ranks", default=env_default("FLODL_RANKS"),
        help="this host's global ranks, e.g. 0-3 or 0,2 [env FLODL_RANKS; else from "
        "GROUP_RANK/NODE_RANK x LOCAL_WORLD_SIZE or SLURM_NODEID x SLURM_NTASKS_PER_NODE]",
    )
    parser.add_argument(
        "--world-size", type=int, default=env_default(("FLODL_WORLD_SIZE", "WORLD_SIZE")),
        help="ranks in the whole cluster [env FLODL_WORLD_SIZE or WORLD_SIZE]",
    )
    parser.add_argument(
        "--host-name", default=env_default("FLODL_HOST_NAME", socket.gethostname()),
        help="name of this host in logs and errors [env FLODL_HOST_NAME; default the hostname]",
    )
    parser.add_argument(
        "--channels", default=env_default("FLODL_CHANNELS", "data,control"),
        help="which relay channels to run: data, control or both [env FLODL_CHANNELS; default data,control]",
    )
    parser.add_argument(
        "--listen-host", default=env_default("FLODL_LISTEN_HOST", "127.0.0.1"),
        help="address the ranks connect to [env FLODL_LISTEN_HOST; default 127.0.0.1]",
    )
    parser.add_argument(
        "--data-port", type=port_number, default=env_default("FLODL_DATA_PORT"),
        help="loopback port of the data channel [env FLODL_DATA_PORT; default controller port + 4]",
    )
    parser.add_argument(
        "--control-port", type=port_number, default=env_default("FLODL_CONTROL_PORT"),
        help="loopback port of the control channel [env FLODL_CONTROL_PORT; default controller port + 5]",
    )
    parser.add_argument(
        "--no-unix", action="store_true", default=env_switch(NO_UNIX_ENV),
        help="do not offer ranks on this machine the Unix-socket local leg (unsigned frames); "
        "they use TCP with MACs [env FLODL_NO_UNIX=1]",
    )
    parser.add_argument(
        "--unix-dir", default=env_default(UNIX_DIR_ENV),
        help="directory of the local leg's socket: created with mode 0700; an existing one must be this user's, "
        "with mode 0700 [env FLODL_UNIX_DIR; default /tmp/flodl_trio-<uid>]",
    )
    parser.add_argument(
        "--memory-budget", type=float, default=env_default("FLODL_RELAY_MEMORY_BUDGET"), metavar="MIB",
        help="resident MiB the data relay may grow to by receiving two frames at once "
        "[env FLODL_RELAY_MEMORY_BUDGET; default 2 x model + 150]",
    )
    parser.add_argument(
        "--controller-outage", type=float, default=None, metavar="SECONDS",
        help="hold the ranks this long for a controller that was lost (killed, restarted, its link cut) to "
        f"come back; 0 = give up at once [env {OUTAGE_ENV}; default: as long as the controller says, which "
        "is 300 s for one with --checkpoint-dir and 0 without]",
    )
    parser.add_argument(
        "--shard", default=env_default("FLODL_SHARD", "auto"), metavar="auto|off|HOST:PORT",
        help="also serve a reduction shard in this process, and offer it to the controller (which uses it with "
        "its default --shards auto; docs/wire.md, 'Shards by default'): auto listens on every address at a free "
        "port and offers the address this host reaches the controller from; HOST:PORT listens there (name it in "
        "a controller's --shards list, or let it be offered); off serves none [env FLODL_SHARD; default auto]",
    )
    add_common_flags(parser)
    return parser


@attrs.frozen
class RelayDaemonSettings:
    controller: tuple[str, int]
    ranks: list[int]
    world_size: int
    host_name: str
    channels: dict[ChannelKind, int]
    listen_host: str
    salt: SessionSalt
    deterministic: bool = False
    local_leg: bool = True
    unix_dir: str | None = None
    memory_budget: int | None = None  # bytes
    lanes: int | None = None  # None: the controller's
    shard: tuple[str, int] | None = None  # a reduction shard served beside the channels
    bounds: NetBounds = attrs.field(factory=NetBounds.from_env)  # the environment, read once


def parse_shard(text: str | None) -> tuple[str, int] | None:
    """``--shard``: auto (every address, a free port), off, or HOST:PORT."""
    text = (text or "off").strip()
    if text == "auto":
        return ("0.0.0.0", 0)
    if text in ("", "off", "none"):
        return None
    return parse_host_port(text, "--shard")


def channel_port(args: argparse.Namespace, kind: ChannelKind, controller_port: int) -> int:
    """The channel's loopback port: its flag, else the controller's port + 4 (data) or + 5
    (control), which must still be a port."""
    given = args.data_port if kind is ChannelKind.DATA else args.control_port
    if given is not None:
        return int(given)
    offset = DATA_PORT_OFFSET if kind is ChannelKind.DATA else CONTROL_PORT_OFFSET
    return check_port(controller_port + offset, f"--{kind.value}-port (the controller's port + {offset})")


def memory_budget_bytes(mib: float | None) -> int | None:
    """``--memory-budget`` MiB in bytes; nan and inf are refused here, not cast."""
    if mib is None:
        return None
    if not (math.isfinite(mib) and mib > 0):
        raise ConfigError(f"--memory-budget must be a finite number of MiB > 0, got {mib}")
    return int(mib * (1 << 20))


def check_unix_dir(unix_dir: str | None) -> None:
    """Refuse, before starting, a local-leg directory that exists but is not this user's
    with mode 0700 (a bad setting, exit 2); one not there yet is created at start."""
    directory = Path(unix_dir) if unix_dir else local_leg_dir()
    if directory.exists() or directory.is_symlink():
        ensure_private_dir(directory)


def settings_from_args(args: argparse.Namespace) -> RelayDaemonSettings:
    controller = args.controller if args.controller else controller_address()
    try:
        ranks = parse_rank_list(args.ranks) if args.ranks else host_ranks_from_env()
    except ConfigError as exc:
        raise ConfigError(f"--ranks: {exc}") from None
    if ranks is None:
        raise ConfigError("which ranks live on this host? pass --ranks (or set FLODL_RANKS)")
    if args.world_size is None:
        raise ConfigError("pass --world-size (or set FLODL_WORLD_SIZE / WORLD_SIZE)")
    wanted = {name.strip() for name in args.channels.split(",") if name.strip()}
    unknown = wanted - {"data", "control"}
    if unknown or not wanted:
        raise ConfigError(f"--channels takes data, control or both; got {args.channels!r}")
    channels = {kind: channel_port(args, kind, controller[1]) for kind in ChannelKind if kind.value in wanted}
    if args.lanes is not None and not 1 <= int(args.lanes) <= MAX_LANES:
        raise ConfigError(f"--lanes must be 1..{MAX_LANES}, got {args.lanes}")
    if not args.no_unix:
        check_unix_dir(args.unix_dir)
    settings = RelayDaemonSettings(
        controller, ranks, int(args.world_size), args.host_name, channels, args.listen_host, load_salt(args.salt_file),
        bool(args.deterministic), not args.no_unix, args.unix_dir, memory_budget_bytes(args.memory_budget),
        None if args.lanes is None else int(args.lanes),
        parse_shard(args.shard), net_bounds(args.controller_outage),
    )
    RelayConfig(
        ChannelKind.DATA, controller, settings.host_name, tuple(ranks), settings.world_size, settings.salt,
        memory_budget=settings.memory_budget, lanes=settings.lanes,
    ).validate()
    return settings


async def serve_relay_daemon(
    settings: RelayDaemonSettings, *, ceiling: int, metrics: tuple[str, int] | None = None,
    log_level: str = "INFO", log_format: str = "logfmt",
) -> None:
    """Run the host's relay channels (and its shard, a child process, if it serves one)
    until they finish; raise the first failure."""
    async with AsyncExitStack() as stack:
        offer = None
        keeper = None
        if settings.shard is not None:  # first: a controller naming it dials it before it serves the relays
            keeper = ShardKeeper(*settings.shard, settings.salt, ceiling, settings.bounds, log_level, log_format)
            shard_tasks = await stack.enter_async_context(trio.open_nursery())
            offer = (settings.shard[0], await shard_tasks.start(keeper.run))
        handles = {}
        host = HostRanks(settings.ranks)  # shared by the host's channels
        for kind, port in settings.channels.items():
            with startup_step(f"starting the {kind.value} channel on {settings.listen_host}:{port}"):
                handles[kind] = await stack.enter_async_context(open_relay(
                    kind, listen=(settings.listen_host, port), upstream=settings.controller,
                    host_name=settings.host_name, ranks=settings.ranks, world_size=settings.world_size,
                    salt=settings.salt, ceiling=ceiling, bounds=settings.bounds, host=host,
                    deterministic=settings.deterministic, local_leg=settings.local_leg, unix_dir=settings.unix_dir,
                    memory_budget=settings.memory_budget,
                    lanes=settings.lanes if kind is ChannelKind.DATA else None,
                    shard_offer=offer if kind is ChannelKind.DATA else None,
                ))
        if keeper is not None and ChannelKind.DATA in handles:
            keeper.offer = handles[ChannelKind.DATA].offer_shard  # a shard started again is offered again
        if metrics is not None:
            from .metrics import serve_relay_metrics

            with startup_step(f"serving metrics on {metrics[0]}:{metrics[1]}"):
                stack.enter_context(serve_relay_metrics(metrics, handles))
        ports = " ".join(f"{kind.value}={settings.listen_host}:{h.port}" for kind, h in handles.items())
        data = handles.get(ChannelKind.DATA)
        if data is not None and data.unix_path is not None:
            ports += f" local-leg={data.unix_path}"
        log.info(
            "relay %s started: ranks=%s world_size=%d %s controller=%s:%d",
            settings.host_name, settings.ranks, settings.world_size, ports, *settings.controller,
        )
        for handle in handles.values():
            await handle.wait_finished()
        log.info("relay %s finished: every channel closed", settings.host_name)
        if keeper is not None:
            keeper.stop()  # its shard then ends as before (once its controller lets go)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    settings: list[RelayDaemonSettings] = []
    args = parse_or_exit(parser, argv, lambda a: settings.append(settings_from_args(a)))
    metrics = (args.metrics_host, args.metrics_port) if args.metrics_port else None
    return run_daemon("relay", lambda: serve_relay_daemon(
        settings[0], ceiling=args.frame_ceiling, metrics=metrics, log_level=args.log_level, log_format=args.log_format,
    ))

