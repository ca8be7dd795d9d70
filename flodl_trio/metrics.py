"""Prometheus metrics for the daemons, read from their counters at scrape time.

Nothing here sits on the round's path: the controller and relays only bump
plain integers; a collector turns them into metric families when Prometheus
scrapes. prometheus-client serves the endpoint from its own thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .controller import ControllerHandle
    from .relay import ChannelKind, RelayHandle


class ControllerCollector(Collector):
    def __init__(self, handle: ControllerHandle) -> None:
        self.handle = handle

    def collect(self) -> Iterator[Any]:
        stats, dead = self.handle.stats, self.handle.dead_ranks
        yield _counter("flodl_controller_rounds", "Rounds completed", stats.rounds)
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
        yield _gauge("flodl_controller_live_ranks", "Ranks not dead", dead.world_size - dead.dead_count())
        yield _gauge("flodl_controller_dead_ranks", "Ranks dead or exited", dead.dead_count())
        yield _gauge("flodl_controller_relays", "Data relays accepted so far", stats.relays)
        yield _gauge("flodl_controller_accepted_mass", "Realized-work mass of the last round", stats.last_mass)
        yield _counter("flodl_controller_mac_failures", "Records whose MAC did not verify", stats.mac_failures)
        yield _counter(
            "flodl_controller_relays_dropped", "Relay connections dropped for bytes that broke the protocol",
            stats.relays_dropped,
        )
        yield _counter("flodl_controller_rejoins", "Dead ranks let back in at a window boundary", stats.rejoins)
        yield _counter("flodl_controller_late_joins", "Ranks the cluster formed without, let in later", stats.late_joins)
        yield _counter(
            "flodl_controller_rejoins_refused",
            "State requests refused (a rank still live, one that finished, rejoining off, too late)",
            stats.rejoins_refused,
        )
        yield _counter("flodl_controller_states_served", "Window states sent to joining ranks", stats.states_served)
        ignored = CounterMetricFamily(
            "flodl_controller_control_frames_ignored",
            "Rank control frames the coordinator ignored (anything but a valid, fresh heartbeat)", labels=["reason"],
        )
        for reason, count in sorted(self.handle.coordinator.ignored.items()):
            ignored.add_metric([reason], count)
        yield ignored
        yield _counter("flodl_controller_rejected_connections", "Connections refused", stats.rejected)
        yield _counter(
            "flodl_controller_coordinator_rejections",
            "Control-channel relays or ranks the coordinator refused (bad Hello, signature mismatch, ...)",
            self.handle.coordinator.rejections.total,
        )
        yield _counter(
            "flodl_controller_rounds_finished_ahead",
            "Rounds whose consensus was computed and signed while the last host frame arrived",
            stats.rounds_finished_ahead,
        )
        yield _counter(
            "flodl_controller_fold_images_reused",
            "Rounds folded into the f32 sum images of an earlier round instead of new ones",
            stats.fold_images_reused,
        )


class RelayCollector(Collector):
    def __init__(self, handles: Mapping[ChannelKind, RelayHandle]) -> None:
        self.handles = handles

    def collect(self) -> Iterator[Any]:
        labels = ["host", "channel"]
        rounds = CounterMetricFamily("flodl_relay_rounds", "Host frames shipped upstream", labels=labels)
        traffic = CounterMetricFamily("flodl_relay_bytes", "Bytes through the relay", labels=[*labels, "direction"])
        live = GaugeMetricFamily("flodl_relay_live_ranks", "Local ranks still in the barrier", labels=labels)
        rejected = CounterMetricFamily("flodl_relay_rejected_connections", "Rank connections refused", labels=labels)
        ratio = GaugeMetricFamily("flodl_relay_fold_ratio", "Local bytes in per uplink byte", labels=labels)
        macs = CounterMetricFamily("flodl_relay_mac_failures", "Rank frames whose MAC did not verify", labels=labels)
        ahead = CounterMetricFamily(
            "flodl_relay_rounds_finished_ahead", "Host frames computed and signed while the last rank frame arrived",
            labels=labels,
        )
        streamed = CounterMetricFamily(
            "flodl_relay_broadcasts_streamed", "Consensus frames fanned out while still arriving", labels=labels
        )
        reused = CounterMetricFamily(
            "flodl_relay_fold_images_reused",
            "Rounds folded into the f32 images of an earlier round instead of new ones",
            labels=labels,
        )
        local = CounterMetricFamily(
            "flodl_relay_local_connections", "Rank connections accepted on the Unix-socket local leg", labels=labels
        )
        buffers = GaugeMetricFamily(
            "flodl_relay_receive_buffers", "Model-sized receive buffers (2 only within the memory budget)", labels=labels
        )
        for kind, handle in self.handles.items():
            key = [handle.host_name, kind.value]
            s = handle.stats
            rounds.add_metric(key, s.rounds)
            for direction, value in (("local", s.bytes_local), ("up", s.bytes_up), ("down", s.bytes_down)):
                traffic.add_metric([*key, direction], value)
            live.add_metric(key, s.live_ranks)
            rejected.add_metric(key, s.rejected)
            ratio.add_metric(key, s.fold_ratio)
            macs.add_metric(key, s.mac_failures)
            ahead.add_metric(key, s.rounds_finished_ahead)
            streamed.add_metric(key, s.broadcasts_streamed)
            reused.add_metric(key, s.fold_images_reused)
            local.add_metric(key, s.local_connections)
            buffers.add_metric(key, s.receive_buffers)
        yield from (rounds, traffic, live, rejected, ratio, macs, ahead, streamed, reused, local, buffers)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


@contextmanager
def _serve(address: tuple[str, int], collector: Collector) -> Iterator[int]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    server, thread = start_http_server(address[1], addr=address[0], registry=registry)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def serve_controller_metrics(address: tuple[str, int], handle: ControllerHandle) -> Any:
    """Serve the controller's metrics on ``address`` for the ``with`` block; yields the bound port."""
    return _serve(address, ControllerCollector(handle))


def serve_relay_metrics(address: tuple[str, int], handles: Mapping[ChannelKind, RelayHandle]) -> Any:
    """Serve a relay daemon's metrics (all its channels) for the ``with`` block."""
    return _serve(address, RelayCollector(handles))
