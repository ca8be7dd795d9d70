"""A relay daemon's Prometheus collector: every channel's counters, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .config import ChannelKind
from .core import RelayHandle


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
        outages = CounterMetricFamily(
            "flodl_relay_controller_outages", "Times the controller's connection was lost and held through", labels=labels
        )
        resumed = CounterMetricFamily(
            "flodl_relay_controller_resumed", "Of those, times a new connection to the controller resumed the channel",
            labels=labels,
        )
        lanes_up = CounterMetricFamily(
            "flodl_relay_lanes_up", "HostFrame lane records sent (the lanes extension)", labels=labels
        )
        lanes = CounterMetricFamily(
            "flodl_relay_consensus_lanes", "Consensus lane records taken (the lanes extension)", labels=labels
        )
        abandoned = CounterMetricFamily(
            "flodl_relay_consensus_lanes_abandoned",
            "Consensus lanes that came in before the controller was lost, void since it sends them all again",
            labels=labels,
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
            outages.add_metric(key, s.outages)
            resumed.add_metric(key, s.resumed)
            lanes_up.add_metric(key, s.lanes_up)
            lanes.add_metric(key, s.consensus_lanes)
            abandoned.add_metric(key, s.consensus_lanes_abandoned)
        yield from (
            rounds, traffic, live, rejected, ratio, macs, ahead, streamed, reused, local, buffers, outages, resumed,
            lanes_up, lanes, abandoned,
        )


__all__ = ["RelayCollector"]
