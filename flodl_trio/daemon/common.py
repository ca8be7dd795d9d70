"""What the relay and controller daemons share: settings from flags or the
environment, the session salt (never from the command line), structured
logging, and signal handling that turns SIGINT/SIGTERM into a cancellation.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import attrs
import trio

from ..errors import ConfigError, FlodlError
from ..transport.settings import OUTAGE_ENV, SALT_FILE_ENV, SALT_HEX_ENV, NetBounds, switch_value
from ..transport.tasks import leaves
from .launch import MAX_PORT, check_port

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


@attrs.frozen
class EnvValue:
    """A flag's default as the environment gave it, not yet converted: the parser converts
    and checks it as it would the flag, only when the flag is not given (so ``--help``
    works and a flag overrides a bad variable)."""

    name: str
    raw: str


def env_default(names: str | Sequence[str], default: Any = None) -> Any:
    """A flag's default: the first of ``names`` set (and not empty) in the environment, as
    an :class:`EnvValue` for :class:`DaemonParser` to convert, else ``default``."""
    for name in (names,) if isinstance(names, str) else names:
        raw = os.environ.get(name, "")
        if raw.strip():
            return EnvValue(name, raw.strip())
    return default


def env_switch(name: str) -> Any:
    """A switch's default (a ``store_true`` flag): its variable, if set, for
    :class:`DaemonParser` to read as a switch (1/true/yes/on or 0/false/no/off; anything
    else exits 2 naming it), else off."""
    return env_default(name, False)


class DaemonParser(argparse.ArgumentParser):
    """argparse held to operations.md's contract: a bad flag or environment variable is one
    line on stderr and exit 2 (not the usage block); ``--help`` still prints the whole help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        self.from_env: list[tuple[argparse.Action, EnvValue]] = []
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if isinstance(value, EnvValue):  # the flag was not given: its variable stands for it
                setattr(parsed, action.dest, self._from_env(action, value))
                self.from_env.append((action, value))
        return parsed, extras

    def variables_named_in(self, message: str) -> str:
        """The variables that stood for the flags a settings check's ``message`` names
        (``--min-ranks``, or a setting's own name as the library says it, ``min_ranks``),
        with their values: checks that run after parsing (a range, settings that cannot
        work together) speak of flags, and an operator who set only the variable must
        still be told which one it is. A one-word name (``host``, ``lanes``) is too
        common a word to count: those checks name the flag."""
        named = []
        for action, found in getattr(self, "from_env", []):
            words = [*action.option_strings, *([action.dest] if "_" in action.dest else [])]
            if any(re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", message) for word in words):
                named.append(f"{found.name}={found.raw!r}")
        return f" (from {', '.join(named)})" if named else ""

    def _from_env(self, action: argparse.Action, found: EnvValue) -> Any:
        """Convert and check a variable exactly as the flag's own value would be."""
        flag = action.option_strings[0] if action.option_strings else action.dest
        where = f"{found.name}={found.raw!r} (for {flag})"
        convert: Callable[[str], Any] = action.type if callable(action.type) else str
        if isinstance(action, argparse._StoreTrueAction):  # a switch: its variable says on or off
            convert = switch_value
        try:
            value = convert(found.raw)
        except argparse.ArgumentTypeError as exc:
            self.error(f"{where}: {exc}")
        except ValueError as exc:
            self.error(f"{where}: {exc}" if convert is switch_value else
                       f"{where}: invalid {getattr(convert, '__name__', 'value')} value")
        except TypeError:
            self.error(f"{where}: invalid {getattr(convert, '__name__', 'value')} value")
        if action.choices is not None and value not in action.choices:
            self.error(f"{where}: invalid choice (choose from {', '.join(map(str, action.choices))})")
        return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: a free one): argparse's int would take 70000 and the
    socket layer would wrap it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: give a number 0..{MAX_PORT}") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0..{MAX_PORT}")
    return value


def positive_int(text: str) -> int:
    """An integer > 0 (a frame ceiling of 0 would refuse every frame)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {value}")
    return value


def finite_positive(value: float | None, flag: str) -> float | None:
    """Seconds that must be a finite number > 0 when given (nan and inf are bad settings)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a finite number > 0, got {value}")
    return value


def net_bounds(controller_outage: float | None) -> NetBounds:
    """The environment's NetBounds, with ``--controller-outage`` (when given) in place of
    FLODL_CONTROLLER_OUTAGE, which is then not read: the flag wins, even over a bad value."""
    if controller_outage is None:
        return NetBounds.from_env()
    if not (math.isfinite(controller_outage) and controller_outage >= 0):
        raise ConfigError(f"--controller-outage must be a finite number of seconds >= 0, got {controller_outage}")
    environ = {name: value for name, value in os.environ.items() if name != OUTAGE_ENV}
    return attrs.evolve(NetBounds.from_env(environ), controller_outage=controller_outage)


def add_common_flags(parser: argparse.ArgumentParser, *, metrics: bool = True) -> None:
    parser.add_argument(
        "--salt-file", default=env_default(SALT_FILE_ENV),
        help=f"file holding the 32-hex-char session salt [env {SALT_FILE_ENV}; "
        f"or put the hex itself in {SALT_HEX_ENV}]",
    )
    parser.add_argument(
        "--frame-ceiling", type=positive_int, default=env_default("FLODL_FRAME_CEILING", 1 << 30),
        help="largest frame accepted, in bytes; set it to max(2 x model bytes, 64 MiB) [env FLODL_FRAME_CEILING; default 1 GiB]",
    )
    if metrics:
        _add_metrics_flags(parser)
    parser.add_argument(
        "--deterministic", action="store_true", default=env_switch("FLODL_DETERMINISTIC"),
        help="add contributions in a fixed order (ranks in rank order, hosts by their lowest rank): the same "
        "frames give the same bytes whatever their arrival order; give it to the controller and every relay "
        "[env FLODL_DETERMINISTIC=1; default off]",
    )
    parser.add_argument(
        "--lanes", type=int, default=env_default("FLODL_LANES"),
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


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port", type=port_number, default=env_default("FLODL_METRICS_PORT", 0),
        help="serve Prometheus metrics on this port, 0 = off [env FLODL_METRICS_PORT]",
    )
    parser.add_argument(
        "--metrics-host", default=env_default("FLODL_METRICS_HOST", "127.0.0.1"),
        help="address for the metrics endpoint [env FLODL_METRICS_HOST; default 127.0.0.1]",
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


class StartupError(FlodlError):
    """The operating system refused a daemon's start-up step (a port in use, a host that
    does not resolve, a directory it cannot create), with the step named: OSError's own
    message seldom says which address or path."""


# What stops a daemon with a reason to log, not a traceback: flodl_trio's own errors and
# the operating system's (sockets, files).
REPORTED_FAILURES: tuple[type[BaseException], ...] = (FlodlError, OSError)


def reported_failure(error: BaseException) -> BaseException | None:
    """The one error to log for what escaped a daemon (exception groups from trio's
    nurseries unwrapped, the cancellations a failure causes left out), or None when it
    holds anything else (a bug: let its traceback show)."""
    real = [leaf for leaf in leaves(error) if not isinstance(leaf, trio.Cancelled)]
    if real and all(isinstance(leaf, REPORTED_FAILURES) for leaf in real):
        return real[0]
    return None


@contextmanager
def startup_step(what: str) -> Iterator[None]:
    """Re-raise an OS-level failure of the block as a StartupError that names ``what``."""
    try:
        yield
    except BaseException as error:
        failure = reported_failure(error)
        if isinstance(failure, OSError):
            raise StartupError(f"{what}: {failure}") from failure
        raise


def run_daemon(name: str, main: Callable[[], Awaitable[None]]) -> int:
    """Run a daemon's main coroutine; SIGINT/SIGTERM cancel it cleanly.

    Returns the process exit code: 0 on a clean finish or a signal, 1 on a
    FlodlError or an OSError (a port in use, an unknown host, a directory it
    cannot write), with one ``<name> failed: <reason>`` log line (and the
    traceback only at DEBUG): operations.md's "the last log line says why".
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
    except BaseException as error:
        failure = reported_failure(error)
        if failure is None:
            raise
        log.error("%s failed: %s", name, failure, exc_info=failure if log.isEnabledFor(logging.DEBUG) else None)
        return EXIT_FAILURE
    if received:
        log.info("%s stopped by %s", name, signal.Signals(received[0]).name)
    return EXIT_OK


def parse_or_exit(parser: argparse.ArgumentParser, argv: list[str] | None, check: Callable[[argparse.Namespace], None]) -> argparse.Namespace:
    """Parse flags, set up logging as they say, then validate them: a bad setting exits 2
    with one clear line. Logging comes first so that what the checks log (a bad
    FLODL_NET_TIMEOUT_SCALE's warning) has the chosen format and level."""
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        check(args)
    except ConfigError as exc:
        named = parser.variables_named_in(str(exc)) if isinstance(parser, DaemonParser) else ""
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {exc}{named}\n")
    return args


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what} must be host:port, got {text!r}")
    return host.strip("[]") or "127.0.0.1", check_port(int(port), f"{what} {text}")


def host_port(text: str) -> tuple[str, int]:
    """argparse's type for a host:port flag, so a bad value from its variable is named."""
    try:
        return parse_host_port(text, "address")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
