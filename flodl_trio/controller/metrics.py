"""The controller's Prometheus collector: its counters, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..transport.metric_families import counter, gauge
from .core import ControllerHandle


class ControllerCollector(Collector):
    def __init__(self, handle: ControllerHandle) -> None:
        self.handle = handle

    def collect(self) -> Iterator[Any]:
        stats, dead = self.handle.stats, self.handle.dead_ranks
        yield counter("flodl_controller_rounds", "Rounds completed", stats.rounds)
        hist = stats.round_seconds
        buckets, running = [], 0
        for bound, count in zip([*map(str, hist.bounds), "+Inf"], hist.counts):
            running += count
            buckets.append((bound, running))
        yield HistogramMetricFamily(
            "flodl_controller_round_seconds", "From a round's first host frame to its consensus",
            buckets=buckets, sum_value=hist.total,
        )
        traffic = CounterMetricFamily("flodl_controller_bytes", "Bytes on relay links", labels=["direction"])
        traffic.add_metric(["in"], stats.bytes_in)
        traffic.add_metric(["out"], stats.bytes_out)
        yield traffic
        yield gauge("flodl_controller_live_ranks", "Ranks not dead", dead.world_size - dead.dead_count())
        yield gauge("flodl_controller_dead_ranks", "Ranks dead or exited", dead.dead_count())
        yield gauge("flodl_controller_relays", "Data relays accepted so far", stats.relays)
        yield gauge("flodl_controller_accepted_mass", "Realized-work mass of the last round", stats.last_mass)
        yield counter("flodl_controller_mac_failures", "Records whose MAC did not verify", stats.mac_failures)
        yield counter(
            "flodl_controller_relays_dropped", "Relay connections dropped for bytes that broke the protocol",
            stats.relays_dropped,
        )
        yield counter("flodl_controller_rejoins", "Dead ranks let back in at a window boundary", stats.rejoins)
        yield counter("flodl_controller_late_joins", "Ranks the cluster formed without, let in later", stats.late_joins)
        yield counter(
            "flodl_controller_rejoins_refused",
            "State requests refused (a rank still live, one that finished, rejoining off, too late)",
            stats.rejoins_refused,
        )
        yield counter("flodl_controller_states_served", "Window states sent to joining ranks", stats.states_served)
        yield counter(
            "flodl_controller_resumed_runs", "1 when this controller took the run on from its resume record",
            stats.resumed_runs,
        )
        yield counter(
            "flodl_controller_relays_resumed", "Relays that came back after losing their connection and resumed",
            stats.relays_resumed,
        )
        yield counter(
            "flodl_controller_resumptions_refused", "Relays that resumed a run this controller cannot take on",
            stats.resumptions_refused,
        )
        yield counter(
            "flodl_controller_stale_host_frames", "HostFrames sent again for a round already finished, dropped",
            stats.stale_host_frames,
        )
        ignored = CounterMetricFamily(
            "flodl_controller_control_frames_ignored",
            "Rank control frames the coordinator ignored (anything but a valid, fresh heartbeat)", labels=["reason"],
        )
        for reason, count in sorted(self.handle.coordinator.ignored.items()):
            ignored.add_metric([reason], count)
        yield ignored
        yield counter("flodl_controller_rejected_connections", "Connections refused", stats.rejected)
        yield counter(
            "flodl_controller_coordinator_rejections",
            "Control-channel relays or ranks the coordinator refused (bad Hello, signature mismatch, ...)",
            self.handle.coordinator.rejections.total,
        )
        yield counter(
            "flodl_controller_rounds_finished_ahead",
            "Rounds whose consensus was computed and signed while the last host frame arrived",
            stats.rounds_finished_ahead,
        )
        yield counter(
            "flodl_controller_fold_images_reused",
            "Rounds folded into the f32 sum images of an earlier round instead of new ones",
            stats.fold_images_reused,
        )
        yield counter("flodl_controller_shards_lost", "Reduction shards lost (closed, or silent)", stats.shards_lost)
        yield counter(
            "flodl_controller_decisions_again",
            "Rounds decided again for the shards: one was lost before the round committed",
            stats.decisions_again,
        )
        yield counter(
            "flodl_controller_rounds_copied",
            "Sharded rounds whose lanes the shards also sent the controller (a rank rejoining, a checkpoint)",
            stats.rounds_copied,
        )
        yield counter(
            "flodl_controller_delta_rounds_sharded",
            "Delta rounds the shards summed (their means stepped here, their coded lanes fanned out there)",
            stats.delta_rounds_sharded,
        )
        yield counter(
            "flodl_controller_shards_served_again",
            "Lost reduction shards served again by a shard a relay offered (a host brought back)",
            stats.shards_served_again,
        )
        yield counter(
            "flodl_controller_shards_served_here",
            "Reduction shards the controller served itself, every other one being lost",
            stats.shards_served_here,
        )
        yield counter(
            "flodl_controller_lanes_seeded",
            "Lane states of the controller's outer optimizer sent to the shards to start from (Seed)",
            stats.lanes_seeded,
        )


__all__ = ["ControllerCollector"]
