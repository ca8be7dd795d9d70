"""Prometheus metric families from plain counters, for each role's collector.

Nothing here sits on a round's path: the roles bump integers, and a collector
turns them into families only when Prometheus scrapes.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


__all__ = ["counter", "gauge"]
