"""The controller's settings, checked once where the controller is opened.

:class:`ControllerConfig` is what every part of the controller reads;
:func:`check_lanes` and :func:`membership_policy` turn user arguments into it
(and into the :class:`~.membership.Membership` policy) or a ``ConfigError``
that says which argument is wrong.
"""

from __future__ import annotations

import math

import attrs

from ..errors import ConfigError
from ..fold.outer import shard_outer_config
from ..transport.settings import NetBounds
from ..wire.constants import DEFAULT_FRAME_CEILING
from ..wire.lanes import DEFAULT_LANE_MIN_BYTES, MAX_LANES
from ..wire.salt import SessionSalt
from .membership import Membership


@attrs.frozen
class ControllerConfig:
    """What the controller was opened with (bounds already scaled, salt coerced)."""

    world_size: int
    salt: SessionSalt
    ceiling: int = DEFAULT_FRAME_CEILING
    bounds: NetBounds = attrs.field(factory=NetBounds)
    deterministic: bool = False  # fold hosts in a fixed order (by their lowest rank)
    lanes: int = 1  # each round reduced in up to this many lanes (docs/wire.md, "Lanes")
    lane_min_bytes: int = DEFAULT_LANE_MIN_BYTES  # a lane per this many payload bytes (0: always ``lanes``)


# A controller given no lane count reduces in this many (a frame goes in one lane per
# ``lane_min_bytes`` of payload, so small frames still go as one); benchmarks/allreduce.py,
# 2 hosts x 2 ranks, 16 MiB: 0.82x gloo at 200 Mbit/s, where one lane takes 1.35x.
DEFAULT_LANES = 8

# shards="auto" uses the relays' shards from this many live relays on. With H hosts the
# single controller's link carries H - 1 frames each way and a shard's link a ring's
# 2 (H - 1) / H: the same at two hosts, where shards add only their processes' CPU
# (benchmarks/allreduce.py, 2 hosts x 2 ranks, 16 MiB, same run: the star 1.00x gloo at
# 1 Gbit/s and 0.80x at 200 Mbit/s, shards 1.17x and 0.85x).
AUTO_SHARDS_MIN_RELAYS = 3


def lanes_or_default(lanes: int | None, *, outer_optimizer: object) -> int:
    """The lane count given, or the default: :data:`DEFAULT_LANES`, or 1 with an outer
    optimizer that steps only whole frames (no ``step_lane``)."""
    if lanes is not None:
        return lanes
    if outer_optimizer is not None and not callable(getattr(outer_optimizer, "step_lane", None)):
        return 1
    return DEFAULT_LANES


def check_lanes(lanes: int, *, outer_optimizer: object) -> None:
    """Lanes need a count the relays share and, with an outer optimizer, one that can
    step a lane at a time (``step_lane``: the built-in ones can)."""
    if not 1 <= lanes <= MAX_LANES:
        raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
    if lanes > 1 and outer_optimizer is not None and not callable(getattr(outer_optimizer, "step_lane", None)):
        raise ConfigError(
            f"lanes={lanes} steps each lane of a params consensus as it finishes: the outer optimizer "
            f"{type(outer_optimizer).__name__} needs a step_lane(consensus, layout, lane, fragment) method "
            "(the built-in ones have it), or use lanes=1"
        )


def why_no_shards(*, lanes: int, outer_optimizer: object) -> str | None:
    """Why this controller cannot reduce with shards (None: it can). Shards reduce lanes
    1.. elsewhere, and step them with an outer optimizer they know (a checkpoint sink
    and a resume record can have them: the shards copy the rounds a checkpoint records,
    and hold through a controller started again; the state a resumed optimizer holds is
    seeded to them)."""
    if outer_optimizer is not None and shard_outer_config(outer_optimizer) is None:
        return (f"shards do not work yet with the outer optimizer {type(outer_optimizer).__name__} (shards step "
                "SlowMo and DiLoCoNesterov only)")
    if lanes < 2:
        return f"shards reduce lanes 1.. of a round: they need lanes >= 2, got {lanes}"
    return None


def check_shards(*, lanes: int, outer_optimizer: object) -> None:
    """ConfigError if this controller cannot reduce with the shards it was given."""
    why = why_no_shards(lanes=lanes, outer_optimizer=outer_optimizer)
    if why is not None:
        raise ConfigError(why)


def membership_policy(
    world_size: int, rejoin_timeout: float, min_ranks: int | None, formation_timeout: float | None
) -> Membership:
    """The membership policy, its arguments checked."""
    if not (math.isfinite(rejoin_timeout) and rejoin_timeout >= 0):
        raise ConfigError(f"rejoin_timeout must be a finite number >= 0, got {rejoin_timeout!r}")
    if formation_timeout is not None and not (math.isfinite(formation_timeout) and formation_timeout > 0):
        raise ConfigError(f"formation_timeout must be a finite number of seconds > 0, got {formation_timeout!r}")
    if min_ranks is not None and not 1 <= min_ranks <= world_size:
        raise ConfigError(f"min_ranks must be between 1 and world_size {world_size}, got {min_ranks}")
    if min_ranks is not None and min_ranks < world_size:
        if formation_timeout is None:
            raise ConfigError(f"min_ranks {min_ranks} < world_size {world_size} needs a formation_timeout")
        if rejoin_timeout <= 0:
            raise ConfigError("min_ranks below world_size needs rejoin_timeout > 0: the late ranks join by rejoining")
    return Membership(world_size, rejoin_timeout, min_ranks=min_ranks, formation_timeout=formation_timeout)


__all__ = [
    "AUTO_SHARDS_MIN_RELAYS", "DEFAULT_LANES", "ControllerConfig", "check_lanes", "check_shards", "lanes_or_default",
    "membership_policy",
    "why_no_shards",
]
