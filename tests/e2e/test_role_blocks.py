"""One behaviour for every role's ``open_*`` block (docs/api.md, "How a role's block ends"):
a FlodlError that stops the role cancels the block's body and leaves the block as
itself, not as an ExceptionGroup; a clean end leaves the body running."""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import FlodlError, RankDeadError, connect_reduce_client
from flodl_trio.controller import open_controller
from flodl_trio.controller.metrics import ControllerCollector
from flodl_trio.relay import ChannelKind, open_relay
from flodl_trio.relay.metrics import RelayCollector
from flodl_trio.testing import MemoryNetwork
from flodl_trio.transport.refusals import RECENT_REFUSALS
from flodl_trio.transport.settings import NetBounds

BOUNDS = NetBounds()


class DiskFull(FlodlError):
    pass


def failing_sink(round_index: int, consensus: object) -> None:
    raise DiskFull("checkpoint disk is full")


async def test_a_controller_that_stops_cancels_its_block_and_raises_its_error(autojump_clock, salt):
    network = MemoryNetwork()
    body_cancelled = False
    with pytest.raises(DiskFull, match="checkpoint disk is full"):
        async with open_controller(world_size=1, salt=salt, listeners=[network.listen()], checkpoint=failing_sink,
                                   bounds=BOUNDS) as ctl:
            async with open_relay(ChannelKind.DATA, upstream=("memory", ctl.port), host_name="h0", ranks=[0],
                                  world_size=1, salt=salt, connect=network.connect, listeners=[network.listen()],
                                  bounds=BOUNDS) as relay:
                try:
                    async with connect_reduce_client(("memory", relay.port), 0, 1, salt, connect=network.connect,
                                                     bounds=BOUNDS) as client:
                        await client.all_reduce_tensors([torch.ones(4)])  # the sink fails on this round
                        await trio.sleep_forever()
                except trio.Cancelled:
                    body_cancelled = True
                    raise
                except RankDeadError:
                    body_cancelled = True  # the rank heard first: its relay closed as the controller stopped
                    await trio.sleep_forever()  # and the controller's stop cancels this too
    assert body_cancelled


async def test_a_relay_that_stops_cancels_its_block_and_raises_its_error(autojump_clock, salt):
    """The "controller" answers the relay's Hello with bytes that are no HelloAck."""
    network = MemoryNetwork()
    fake = network.listen()

    async def garbage_controller() -> None:
        stream = await fake.accept()
        await stream.receive_some(4096)
        await stream.send_all(b"\xff" * 64)
        await trio.sleep_forever()

    cancelled = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(garbage_controller)
        with pytest.raises(FlodlError, match="from controller memory:.*bad magic") as info:
            async with open_relay(ChannelKind.DATA, upstream=("memory", fake.port), host_name="h0", ranks=[0],
                                  world_size=1, salt=salt, connect=network.connect, listeners=[network.listen()],
                                  bounds=BOUNDS):
                try:
                    await trio.sleep_forever()
                finally:
                    cancelled.set()
        nursery.cancel_scope.cancel()
    assert cancelled.is_set()
    assert not isinstance(info.value, BaseExceptionGroup)


async def test_a_relay_that_ends_cleanly_leaves_its_block_running(autojump_clock, salt):
    """Every rank finished: the relay's service ends, the body goes on."""
    network = MemoryNetwork()
    async with open_controller(world_size=1, salt=salt, listeners=[network.listen()], bounds=BOUNDS) as ctl:
        async with open_relay(ChannelKind.DATA, upstream=("memory", ctl.port), host_name="h0", ranks=[0],
                              world_size=1, salt=salt, connect=network.connect, listeners=[network.listen()],
                              bounds=BOUNDS) as relay:
            async with connect_reduce_client(("memory", relay.port), 0, 1, salt, connect=network.connect,
                                             bounds=BOUNDS) as client:
                await client.all_reduce_tensors([torch.ones(4)])
            await relay.wait_finished()
            await ctl.wait_finished()
            with trio.move_on_after(1.0) as still_running:
                await trio.sleep_forever()
            assert still_running.cancelled_caught  # our own deadline ended it: nothing cancelled the body



def metric_value(collector: object, name: str, labels: dict[str, str] | None = None) -> float:
    for family in collector.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value
    raise KeyError(name)


async def test_a_port_scanner_leaves_a_bounded_record_and_is_counted(autojump_clock, salt):
    """Every refused connection is counted; only the last RECENT_REFUSALS reasons are kept,
    on the controller and on a relay alike."""
    probes = RECENT_REFUSALS + 44
    network = MemoryNetwork()
    async with open_controller(world_size=2, salt=salt, listeners=[network.listen()], bounds=BOUNDS) as ctl:
        async with open_relay(ChannelKind.DATA, upstream=("memory", ctl.port), host_name="h0", ranks=[0, 1],
                              world_size=2, salt=salt, connect=network.connect, listeners=[network.listen()],
                              bounds=BOUNDS) as relay:
            for port in (ctl.port, relay.port):
                for probe in range(probes):
                    stream = await network.connect("memory", port)
                    await stream.send_all(b"SCAN" + probe.to_bytes(28, "little"))
                    with trio.fail_after(BOUNDS.handshake + 1):
                        while await stream.receive_some(4096):
                            pass  # refused: the role closes it
                    await stream.aclose()
            assert len(ctl.rejections) == RECENT_REFUSALS and ctl.rejections.total == probes
            assert ctl.stats.rejected == probes
            assert "unknown channel magic" in ctl.rejections[-1]
            assert len(relay.rejections) == RECENT_REFUSALS and relay.rejections.total == probes
            assert metric_value(ControllerCollector(ctl), "flodl_controller_rejected_connections_total") == probes
            relay_metric = metric_value(
                RelayCollector({ChannelKind.DATA: relay}), "flodl_relay_rejected_connections_total",
                {"host": "h0", "channel": "data"},
            )
            assert relay_metric == probes


async def test_a_controller_opened_with_its_defaults_serves_on_every_interface(salt):
    """``open_controller(world_size=, salt=)``: host None listens as trio.open_tcp_listeners
    does, on a free port, and a relay reaches it on loopback."""
    with trio.fail_after(30):
        async with open_controller(world_size=1, salt=salt) as ctl:
            assert ctl.port > 0
            async with open_relay(ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", ctl.port),
                                  host_name="h0", ranks=[0], world_size=1, salt=salt) as relay:
                async with connect_reduce_client(("127.0.0.1", relay.port), 0, 1, salt) as client:
                    out = await client.all_reduce_tensors([torch.full((4,), 3.0)])
            assert out[0].tolist() == [3.0] * 4
