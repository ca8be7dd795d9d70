"""What a relay channel is told (its config) and what it counts (its stats)."""

from __future__ import annotations

import enum

import attrs

from ..errors import ConfigError
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
    # The controller reduces each round in this many lanes (it says so after HelloAck).
    lanes: int = 1

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
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"relay {self.host_name}: lanes must be 1..{MAX_LANES}, got {self.lanes}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"relay {self.host_name}: duplicate ranks in {list(self.ranks)}")
        outside = [r for r in self.ranks if not 0 <= r < self.world_size]
        if outside:
            raise ConfigError(f"relay {self.host_name}: ranks {outside} are outside world_size {self.world_size}")


__all__ = ["ChannelKind", "RelayConfig", "RelayStats"]
