"""What a relay channel is told (its config) and what it counts (its stats)."""

from __future__ import annotations

import enum

import attrs
import trio

from ..errors import ConfigError
from ..transport.connect import Connector
from ..transport.settings import NetBounds
from ..wire.constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    DEFAULT_FRAME_CEILING,
)
from ..wire.lanes import MAX_LANES
from ..wire.salt import SessionSalt

# The default memory budget's allowance above two model sizes: the interpreter,
# numpy, trio and the small buffers.
DEFAULT_BUDGET_HEADROOM = 150 << 20


class ChannelKind(enum.Enum):
    """Which protocol a relay channel terminates toward its local ranks."""

    DATA = "data"
    CONTROL = "control"

    @property
    def magic(self) -> int:
        return CHANNEL_MAGIC_DATA if self is ChannelKind.DATA else CHANNEL_MAGIC_CONTROL


@attrs.define
class RelayStats:
    """Counters a relay keeps; the fold ratio is local bytes over uplink bytes."""

    rounds: int = 0
    bytes_local: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: int = 0
    live_ranks: int = 0
    mac_failures: int = 0
    broadcasts_streamed: int = 0  # consensus frames fanned out while still arriving
    rounds_finished_ahead: int = 0  # HostFrames computed and signed while the last frame arrived
    fold_images_reused: int = 0  # rounds folded into an earlier round's f32 images instead of new ones
    local_connections: int = 0  # rank handshakes accepted on the Unix-socket local leg
    receive_buffers: int = 1  # model-sized receive buffers (a second only within the memory budget)
    outages: int = 0  # times the controller's connection was lost and held through
    resumed: int = 0  # of those, the times a new connection to it resumed the channel
    lanes_up: int = 0  # HostFrame lane records sent (lanes extension)
    consensus_lanes: int = 0  # consensus lane records taken (lanes extension)
    consensus_lanes_abandoned: int = 0  # of those, lanes of a consensus the lost controller sends again

    @property
    def fold_ratio(self) -> float:
        return self.bytes_local / self.bytes_up if self.bytes_up else 0.0


@attrs.frozen
class RelayConfig:
    """One relay channel's settings: which host it serves, where the controller is,
    and the bounds on waiting for peers."""

    kind: ChannelKind
    upstream: tuple[str, int]
    host_name: str
    ranks: tuple[int, ...]
    world_size: int
    salt: SessionSalt
    ceiling: int = DEFAULT_FRAME_CEILING
    bounds: NetBounds = attrs.field(factory=NetBounds)
    # Fold the host's ranks in rank order, whatever order their frames arrive in.
    deterministic: bool = False
    # Resident bytes the data relay may grow to by taking a second receive buffer
    # (None: 2 x the model's frame + DEFAULT_BUDGET_HEADROOM, see memory_budget_for).
    memory_budget: int | None = None
    # How many lanes the controller reduces each round in: as it says before HelloAck
    # (None), or this many, which it must say (a ConfigError names both counts).
    lanes: int | None = None
    # With lanes: a round goes in one lane per this many payload bytes (the controller's).
    lane_min_bytes: int = 0
    # The reduction shards the controller said before HelloAck (lanes 1.. of a round go there).
    shards: tuple[tuple[str, int], ...] = ()
    # A reduction shard this relay serves, offered to the controller after HelloAck.
    shard_offer: tuple[str, int] | None = None
    # How the relay dials (the controller, the shards): TCP, or a test's memory network.
    connect: Connector = attrs.field(default=trio.open_tcp_stream, eq=False, repr=False)

    def with_controllers_lanes(self, said: tuple[int, int] | None) -> RelayConfig:
        """This config with the lane count the controller said before HelloAck (``said``:
        count and min_bytes; None: it said nothing, one lane), which must be this relay's
        own if it was given one."""
        count, min_bytes = said if said is not None else (1, 0)
        if self.lanes is not None and self.lanes != count:
            raise ConfigError(
                f"relay {self.host_name}: the controller reduces each round in {count} lane(s), this relay was "
                f"started with lanes={self.lanes} (start it without --lanes to take the controller's, or give "
                "both the same)"
            )
        return attrs.evolve(self, lanes=count, lane_min_bytes=min_bytes)

    def memory_budget_for(self, frame_bytes: int) -> int:
        """The budget for a model of ``frame_bytes`` (what docs/operations.md promises)."""
        if self.memory_budget is not None:
            return self.memory_budget
        return 2 * frame_bytes + DEFAULT_BUDGET_HEADROOM

    def validate(self) -> None:
        """Refuse a rank set no cluster could use (ConfigError, naming the host)."""
        if self.world_size <= 0:
            raise ConfigError(f"world_size must be > 0, got {self.world_size}")
        if not self.ranks:
            raise ConfigError(f"relay {self.host_name}: the host's rank set is empty")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"relay {self.host_name}: memory budget must be > 0 bytes, got {self.memory_budget}")
        if self.lanes is not None and not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"relay {self.host_name}: lanes must be 1..{MAX_LANES}, got {self.lanes}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"relay {self.host_name}: duplicate ranks in {list(self.ranks)}")
        outside = [r for r in self.ranks if not 0 <= r < self.world_size]
        if outside:
            raise ConfigError(f"relay {self.host_name}: ranks {outside} are outside world_size {self.world_size}")


__all__ = ["ChannelKind", "RelayConfig", "RelayStats"]
