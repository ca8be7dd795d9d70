"""Settings read from the environment, in one place: network bounds and the session salt.

Everything that waits on a peer takes its bound from a :class:`NetBounds`
that the caller owns and passes down (the way trio-websocket takes
``connect_timeout=``): nothing below the public APIs reads the environment.
The daemons and the in-process entry points (``open_relay``,
``open_controller``, the rank clients) build one with
:meth:`NetBounds.from_env` when they are not given one, so
``FLODL_NET_TIMEOUT_SCALE`` stretches every bound of a process at once.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path

import attrs

from ..errors import ConfigError
from ..wire.salt import SessionSalt

log = logging.getLogger("flodl_trio.net")

TIMEOUT_SCALE_ENV = "FLODL_NET_TIMEOUT_SCALE"
OUTAGE_ENV = "FLODL_CONTROLLER_OUTAGE"
# How long a controller that keeps a resume record tells relays and ranks to hold for it.
DEFAULT_CONTROLLER_OUTAGE = 300.0
MIN_TIMEOUT_SCALE = 0.1
SALT_HEX_ENV = "FLODL_SALT_HEX"
SALT_FILE_ENV = "FLODL_SALT_FILE"

_warned_scale_values: set[str] = set()


def _is_number(value: object) -> bool:
    """A real number (an int or a float, numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ConfigError(f"NetBounds.{attr.name} must be a finite number > 0, got {value!r}")


def _non_negative_or_none(_inst: object, attr: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"NetBounds.{attr.name} must be None or a finite number >= 0, got {value!r}")


def _at_least_one(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        raise ConfigError(f"NetBounds.{attr.name} must be a whole number >= 1 (an int), got {value!r}")


@attrs.frozen
class NetBounds:
    """How long a process waits on a peer before giving up on that peer (seconds).

    The round itself has no bound (a slow host must not make Local SGD drop
    work); these bound everything else, so a silent, slow or wedged peer costs
    only its own connection.
    """

    #: a rank's handshake at its relay, a relay's Hello at the controller, the acks back
    handshake: float = attrs.field(default=10.0, validator=_positive)
    #: the controller's peek at a new connection's channel magic
    channel_magic: float = attrs.field(default=5.0, validator=_positive)
    #: a write that makes no progress this long: the reader is wedged
    write_stall: float = attrs.field(default=30.0, validator=_positive)
    #: a message that stops arriving after its first byte (not scaled: a peer silent
    #: for a minute inside a frame is broken, not slow)
    mid_frame_starvation: float = attrs.field(default=60.0, validator=_positive)
    #: between two attempts to dial a peer that is not up yet
    connect_interval: float = attrs.field(default=0.5, validator=_positive)
    #: how many times to dial before ConnectFailed
    connect_attempts: int = attrs.field(default=60, validator=_at_least_one)
    #: a rank silent this long on the control channel is declared dead
    heartbeat_timeout: float = attrs.field(default=30.0, validator=_positive)
    #: how long relays and ranks hold through a lost controller (its connection broke,
    #: its beacon stopped) for it to come back before giving up; 0: they give up at once
    #: (flodl's behaviour); None: as long as the controller said it may be away (it says
    #: so only when it keeps a resume record; else 0). Not scaled: an operator's
    #: restart takes what it takes.
    controller_outage: float | None = attrs.field(default=None, validator=_non_negative_or_none)

    @classmethod
    def scaled(cls, scale: float) -> NetBounds:
        """The defaults with every time bound but mid-frame starvation (and the outage,
        left None) multiplied by ``scale``. A classmethod: it reads no environment and
        starts from the defaults, not from an instance's values."""
        base = cls()
        return attrs.evolve(
            base,
            handshake=base.handshake * scale,
            channel_magic=base.channel_magic * scale,
            write_stall=base.write_stall * scale,
            connect_interval=base.connect_interval * scale,
            heartbeat_timeout=base.heartbeat_timeout * scale,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NetBounds:
        """The defaults scaled by ``FLODL_NET_TIMEOUT_SCALE`` (finite, >= 0.1; default 1),
        with ``FLODL_CONTROLLER_OUTAGE`` seconds of controller outage (unset: None,
        as long as the controller says)."""
        env = os.environ if environ is None else environ
        return attrs.evolve(cls.scaled(timeout_scale(env)), controller_outage=controller_outage(env))


_SWITCH_ON, _SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch_value(text: str) -> bool:
    """An environment variable that stands for an on/off flag: 1, true, yes or on (any
    case) is on, 0, false, no or off is off; anything else is a ValueError, so a typo
    never silently means "off"."""
    word = text.strip().lower()
    if word in _SWITCH_ON or word in _SWITCH_OFF:
        return word in _SWITCH_ON
    raise ValueError(f"{text!r} is not a switch value: give 1 (on) or 0 (off)")


def timeout_scale(environ: Mapping[str, str]) -> float:
    """``FLODL_NET_TIMEOUT_SCALE`` from ``environ``; a bad value warns once and reads as 1."""
    raw = environ.get(TIMEOUT_SCALE_ENV)
    if raw is None or raw.strip() == "":
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value >= MIN_TIMEOUT_SCALE:
        return value
    if raw not in _warned_scale_values:
        _warned_scale_values.add(raw)
        log.warning("%s=%r is not a finite number >= %s; using 1.0", TIMEOUT_SCALE_ENV, raw, MIN_TIMEOUT_SCALE)
    return 1.0


def controller_outage(environ: Mapping[str, str]) -> float | None:
    """``FLODL_CONTROLLER_OUTAGE`` (seconds, finite, >= 0; unset: None) from ``environ``."""
    raw = environ.get(OUTAGE_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{OUTAGE_ENV}={raw!r}: give the seconds to hold through a lost controller (>= 0)")
    return value


def load_salt(salt_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> SessionSalt:
    """The session salt: from ``salt_file``, else the file named by ``FLODL_SALT_FILE``,
    else the hex in ``FLODL_SALT_HEX``.

    Never from a command-line value: argv is world-readable in /proc. Daemons
    and trainers call this the same way, so one environment serves both.
    """
    env = os.environ if environ is None else environ
    path = salt_file or env.get(SALT_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the salt file {path}: {exc.strerror}") from exc
        return SessionSalt.from_hex(text)
    hex_text = env.get(SALT_HEX_ENV)
    if hex_text:
        return SessionSalt.from_hex(hex_text)
    raise ConfigError(
        f"no session salt: pass a salt file, or set {SALT_FILE_ENV} or {SALT_HEX_ENV} "
        f"(generate one with: python -c 'import secrets; print(secrets.token_hex(16))')"
    )


__all__ = ["DEFAULT_CONTROLLER_OUTAGE", "OUTAGE_ENV", "SALT_FILE_ENV", "SALT_HEX_ENV", "TIMEOUT_SCALE_ENV", "NetBounds", "controller_outage", "load_salt", "switch_value", "timeout_scale"]
