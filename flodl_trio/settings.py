"""Socket-level bounds and network hygiene shared by every role.

All bounds scale with ``FLODL_NET_TIMEOUT_SCALE`` (finite, >= 0.1, default 1),
so a slow CI box or a congested WAN can stretch them without code changes.
The mid-frame starvation bound is deliberately not scaled: a peer that sends
nothing for a minute in the middle of a frame is broken, not slow.
"""

from __future__ import annotations

import logging
import math
import os

log = logging.getLogger("flodl_trio.net")

TIMEOUT_SCALE_ENV = "FLODL_NET_TIMEOUT_SCALE"
MIN_TIMEOUT_SCALE = 0.1

_warned_scale_values: set[str] = set()


def timeout_scale() -> float:
    """Current multiplier for socket-level bounds; a bad value warns once and reads as 1."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV)
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
        log.warning(
            "%s=%r is not a finite number >= %s; using 1.0",
            TIMEOUT_SCALE_ENV, raw, MIN_TIMEOUT_SCALE,
        )
    return 1.0


def handshake_timeout() -> float:
    """Bound on a rank's handshake (flodl has none; a silent rank would wedge a relay)."""
    return 10.0 * timeout_scale()


def channel_magic_timeout() -> float:
    """Bound on the controller's peek at a new connection's channel magic."""
    return 5.0 * timeout_scale()


def write_stall_timeout() -> float:
    """A write that makes no progress this long means the reader is wedged."""
    return 30.0 * timeout_scale()


def connect_retry_interval() -> float:
    return 0.5 * timeout_scale()


CONNECT_RETRY_ATTEMPTS = 60
MID_FRAME_STARVATION_S = 60.0
