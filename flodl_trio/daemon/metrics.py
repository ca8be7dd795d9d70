"""Serving a daemon's Prometheus metrics: each role's collector on an HTTP port.

The collectors live with their roles (:mod:`flodl_trio.controller.metrics`,
:mod:`flodl_trio.relay.metrics`); prometheus-client serves them from its own thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import Collector

from ..controller import ControllerHandle
from ..controller.metrics import ControllerCollector
from ..relay import ChannelKind, RelayHandle
from ..relay.metrics import RelayCollector


@contextmanager
def serve_metrics(address: tuple[str, int], collector: Collector) -> Iterator[int]:
    """Serve ``collector`` over HTTP on ``address`` (prometheus-client's own thread) for the block; yields the port."""
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
    return serve_metrics(address, ControllerCollector(handle))


def serve_relay_metrics(address: tuple[str, int], handles: Mapping[ChannelKind, RelayHandle]) -> Any:
    """Serve a relay daemon's metrics (all its channels) for the ``with`` block."""
    return serve_metrics(address, RelayCollector(handles))


__all__ = ["serve_controller_metrics", "serve_metrics", "serve_relay_metrics"]
