"""What a running controller counts (read by the status page and the metrics endpoint)."""

from __future__ import annotations

import attrs

ROUND_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@attrs.define
class LatencyHistogram:
    """Cumulative-bucket histogram of round latencies (exported as a Prometheus histogram)."""

    bounds: tuple[float, ...] = ROUND_SECONDS_BUCKETS
    counts: list[int] = attrs.field(factory=lambda: [0] * (len(ROUND_SECONDS_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if seconds <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += seconds


@attrs.define
class ControllerStats:
    """Counters of a running controller (read by the metrics endpoint)."""

    round_seconds: LatencyHistogram = attrs.field(factory=LatencyHistogram)
    rounds: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    last_mass: float = 0.0
    relays: int = 0
    rejected: int = 0
    mac_failures: int = 0
    relays_dropped: int = 0  # relay connections ended for bytes that broke the protocol
    rejoins: int = 0  # dead ranks let back in
    late_joins: int = 0  # ranks the cluster formed without, let in later
    rejoins_refused: int = 0  # returns refused (a live rank, rejoining off, too late)
    resumed_runs: int = 0  # 1 when this controller took on a run from its resume record
    relays_resumed: int = 0  # relays that came back after losing their connection and said Resume
    resumptions_refused: int = 0  # relays that resumed where this controller never was: their ranks are dead
    stale_host_frames: int = 0  # HostFrames sent again for a round already finished, dropped
    states_served: int = 0  # window states sent to joining ranks
    rounds_finished_ahead: int = 0  # consensus computed and signed while the last frame arrived
    fold_images_reused: int = 0  # rounds folded into an earlier round's f32 images instead of new ones
    shards_lost: int = 0  # reduction shards lost (closed, or silent for a heartbeat timeout)
    decisions_again: int = 0  # rounds decided again for the shards (one was lost before the round committed)
    rounds_copied: int = 0  # sharded rounds the shards also sent here whole (a rank rejoining, a checkpoint)
    delta_rounds_sharded: int = 0  # delta rounds whose means the shards sent here (stepped here, fanned out there)
    shards_served_again: int = 0  # lost shards a relay's offer served again (a host brought back)
    shards_served_here: int = 0  # shards the controller served itself (every other one lost)
    lanes_seeded: int = 0  # lane states of its optimizer sent to the shards (Seed: a resumed run's state)


__all__ = ["ControllerStats", "LatencyHistogram"]
