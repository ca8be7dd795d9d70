"""What the relay and controller daemons share: settings from flags or the
environment, the session salt (never from the command line), structured
logging, and signal handling that turns SIGINT/SIGTERM into a cancellation.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..errors import ConfigError, FlodlError
from ..transport.settings import SALT_FILE_ENV, SALT_HEX_ENV

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def env_default(name: str, default: Any = None) -> Any:
    """A flag's default from the environment (flags override the environment)."""
    return os.environ.get(name, default)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--salt-file", default=env_default(SALT_FILE_ENV),
        help=f"file holding the 32-hex-char session salt [env {SALT_FILE_ENV}; "
        f"or put the hex itself in {SALT_HEX_ENV}]",
    )
    parser.add_argument(
        "--frame-ceiling", type=int, default=int(env_default("FLODL_FRAME_CEILING", 1 << 30)),
        help="largest frame accepted, in bytes; set it to max(2 x model bytes, 64 MiB) [env FLODL_FRAME_CEILING; default 1 GiB]",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=int(env_default("FLODL_METRICS_PORT", 0)),
        help="serve Prometheus metrics on this port, 0 = off [env FLODL_METRICS_PORT]",
    )
    parser.add_argument(
        "--metrics-host", default=env_default("FLODL_METRICS_HOST", "127.0.0.1"),
        help="address for the metrics endpoint [env FLODL_METRICS_HOST; default 127.0.0.1]",
    )
    parser.add_argument(
        "--deterministic", action="store_true", default=env_default("FLODL_DETERMINISTIC") == "1",
        help="add contributions in a fixed order (ranks in rank order, hosts by their lowest rank): the same "
        "frames give the same bytes whatever their arrival order; give it to the controller and every relay "
        "[env FLODL_DETERMINISTIC=1; default off]",
    )
    parser.add_argument(
        "--lanes", type=int, default=None if env_default("FLODL_LANES") is None else int(env_default("FLODL_LANES")),
        help="reduce each round in this many lanes, so one lane's consensus comes down while the next goes up: "
        "set it on the controller; a data relay takes the controller's count, or checks it against its own "
        "[env FLODL_LANES; default: the controller 8 (1 lane per 256 KiB of a frame, so small frames go whole), "
        "a relay the controller's; 1 on the controller: flodl's whole frames]",
    )
    parser.add_argument(
        "--log-level", default=env_default("FLODL_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
        help="log verbosity [env FLODL_LOG_LEVEL; default INFO]",
    )
    parser.add_argument(
        "--log-format", default=env_default("FLODL_LOG_FORMAT", "logfmt"), choices=["logfmt", "json"],
        help="structured log line format [env FLODL_LOG_FORMAT; default logfmt]",
    )


class StructuredFormatter(logging.Formatter):
    """One line per event: ``ts=... level=... logger=... msg="..."`` (or JSON)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style_name = style

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self.style_name == "json":
            import json

            return json.dumps(fields)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' "=\n'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def configure_logging(level: str, style: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(style))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


async def _cancel_on_signals(scope: trio.CancelScope, received: list[int]) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            received.append(signum)
            scope.cancel()
            return


def run_daemon(name: str, main: Callable[[], Awaitable[None]]) -> int:
    """Run a daemon's main coroutine; SIGINT/SIGTERM cancel it cleanly.

    Returns the process exit code: 0 on a clean finish or a signal, 1 with the
    reason logged on a FlodlError.
    """
    log = logging.getLogger(f"flodl_trio.{name}")
    received: list[int] = []

    async def supervised() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signals, nursery.cancel_scope, received)
            await main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(supervised)
    except FlodlError as exc:
        log.error("%s failed: %s", name, exc)
        return EXIT_FAILURE
    except BaseExceptionGroup as group:
        from ..transport.tasks import unwrap_group

        cause = unwrap_group(group)
        if isinstance(cause, FlodlError):
            log.error("%s failed: %s", name, cause)
            return EXIT_FAILURE
        raise
    if received:
        log.info("%s stopped by %s", name, signal.Signals(received[0]).name)
    return EXIT_OK


def parse_or_exit(parser: argparse.ArgumentParser, argv: list[str] | None, check: Callable[[argparse.Namespace], None]) -> argparse.Namespace:
    """Parse flags, then validate them; a bad setting exits 2 with one clear line."""
    args = parser.parse_args(argv)
    try:
        check(args)
    except ConfigError as exc:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {exc}\n")
    return args


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what} must be host:port, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_rank_list(text: str) -> list[int]:
    """``"0,1,4-7"`` -> [0, 1, 4, 5, 6, 7]."""
    ranks: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                ranks.extend(range(lo, hi + 1))
            else:
                ranks.append(int(part))
    except ValueError:
        raise ConfigError(f"rank list must look like 0,1,4-7; got {text!r}") from None
    if not ranks:
        raise ConfigError("the rank list is empty")
    return ranks
