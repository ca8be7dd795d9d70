"""Test helpers: a whole cluster (controller + one relay per host) in one trio nursery.

Usage in a pytest-trio test::

    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt) as cluster:
        async with connect_reduce_client(cluster.relay_address(rank), rank, 4, salt) as client:
            ...

Every address is exposed so a test can put a fault proxy on any leg;
``upstream_faults={host_index: [faults]}`` puts one on a host's data relay ->
controller leg for you (``cluster.upstream_proxies[host_index]``).
"""

from __future__ import annotations

import json
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Literal, TypeVar

import attrs
import trio

from ..client import ReduceClient, connect_reduce_client
from ..controller import ControllerHandle, open_controller
from ..controller.dead_ranks import DeadRanks
from ..errors import ConfigError, FlodlError
from ..relay import ChannelKind, HostRanks, RelayHandle, open_relay
from ..shard import ShardHandle, open_shard, shard_server
from ..transport.connect import Connector
from ..transport.settings import NetBounds
from ..transport.tasks import service_nursery
from ..wire.salt import SessionSalt
from .memory import MEMORY_HOST, MemoryNetwork
from .proxy import LOOPBACK, Fault, FaultProxy


async def fetch_status(address: tuple[str, int]) -> dict[str, Any]:
    """The controller's JSON status page at ``address`` (dead ranks, returns, relays, counters)."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(b"GET / HTTP/1.0\r\nHost: flodl\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    _head, _, body = data.partition(b"\r\n\r\n")
    status: dict[str, Any] = json.loads(body)
    return status


async def wait_until_primed(address: tuple[str, int], ranks: Iterable[int], poll: float = 0.02) -> None:
    """Until the controller at ``address`` lists every rank of ``ranks`` as ``primed``: it
    has its state, and enters at the next window boundary. Survivors held until then
    know the window the ranks enter, however long their joins took."""
    want = set(ranks)
    while not want <= set((await fetch_status(address))["primed"]):
        await trio.sleep(poll)


@attrs.define
class LocalCluster:
    """Handles of a running in-process cluster."""

    controller: ControllerHandle
    relays: list[RelayHandle]
    hosts: list[list[int]]
    world_size: int
    salt: SessionSalt
    control_relays: list[RelayHandle] = attrs.field(factory=list)
    upstream_proxies: dict[int, FaultProxy] = attrs.field(factory=dict)
    network: MemoryNetwork | None = None
    shards: list[ShardHandle] = attrs.field(factory=list)  # reduction shards (``shards=N``)
    shard_scopes: list[trio.CancelScope] = attrs.field(factory=list)
    relay_scopes: list[list[trio.CancelScope]] = attrs.field(factory=list)  # per host: its data and control relays

    def close_shard(self, index: int) -> None:
        """Stop shard ``index`` serving (its connections close): a lost shard host, in-process."""
        self.shard_scopes[index].cancel()

    def close_relay(self, index: int) -> None:
        """Stop host ``index``'s relays (data, and control with ``control=True``): every
        connection they hold closes, as a killed relay daemon's do. Its ranks' clients
        raise ``RankDeadError``; its shard (``shards="auto"``) serves on, as a shard
        process outlives its relay's."""
        for scope in self.relay_scopes[index]:
            scope.cancel()

    @property
    def host(self) -> str:
        """Where every role listens: loopback, or the memory network's host."""
        return LOOPBACK if self.network is None else MEMORY_HOST

    @property
    def connect(self) -> Connector:
        """How a client reaches this cluster's relays (pass it as ``connect=``)."""
        return trio.open_tcp_stream if self.network is None else self.network.connect

    @property
    def controller_address(self) -> tuple[str, int]:
        return (self.host, self.controller.port)

    def relay_for(self, rank: int) -> RelayHandle:
        for relay, ranks in zip(self.relays, self.hosts):
            if rank in ranks:
                return relay
        raise KeyError(f"rank {rank} is on no host of this cluster")

    def relay_address(self, rank: int) -> tuple[str, int]:
        """The address rank ``rank`` connects to (through :attr:`connect`)."""
        return (self.host, self.relay_for(rank).port)

    async def run_ranks(
        self,
        rank_main: Callable[[int, ReduceClient], Awaitable[None]],
        ranks: Iterable[int] | None = None,
        *,
        addresses: Mapping[int, tuple[str, int]] | None = None,
    ) -> None:
        """Connect a client for each of ``ranks`` (default: every rank) and run
        ``rank_main(rank, client)`` for all of them at once; return when all are done.

        A rank connects to its host's relay, or to ``addresses[rank]`` (a fault
        proxy in front of it, say). The client is closed when its ``rank_main`` ends.
        """

        async def run_one(rank: int) -> None:
            address = addresses[rank] if addresses and rank in addresses else self.relay_address(rank)
            async with connect_reduce_client(address, rank, self.world_size, self.salt, connect=self.connect) as client:
                await rank_main(rank, client)

        async with trio.open_nursery() as nursery:
            for rank in range(self.world_size) if ranks is None else ranks:
                nursery.start_soon(run_one, rank)

    def control_address(self, rank: int) -> tuple[str, int]:
        """The address of rank ``rank``'s control relay (``control=True`` clusters)."""
        for relay, ranks in zip(self.control_relays, self.hosts):
            if rank in ranks:
                return (self.host, relay.port)
        raise KeyError(f"rank {rank} has no control relay (open the cluster with control=True)")


H = TypeVar("H")


async def hold_open(
    role: AbstractAsyncContextManager[H], *, task_status: trio.TaskStatus[H] = trio.TASK_STATUS_IGNORED
) -> None:
    """Hold a role's ``open_*`` block open in a task of its own until cancelled;
    ``await nursery.start(hold_open, open_relay(...))`` returns its handle.

    A role that stops with an error cancels the block it runs in (docs/api.md):
    run that way, it cancels only this task, as a crashed daemon costs only its
    host, and the error stays on its handle (``wait_finished()`` raises it).
    """
    started = False
    try:
        async with role as handle:
            task_status.started(handle)
            started = True
            await trio.sleep_forever()
    except FlodlError:
        if not started:
            raise


async def _held_in(
    scope: trio.CancelScope, role: AbstractAsyncContextManager[H], *, task_status: trio.TaskStatus[H]
) -> None:
    """:func:`hold_open` inside ``scope``: cancelling it closes the role alone."""
    with scope:
        await hold_open(role, task_status=task_status)


@asynccontextmanager
async def open_local_cluster(
    *,
    world_size: int,
    hosts: Sequence[Sequence[int]],
    salt: SessionSalt | bytes,
    dead_ranks: DeadRanks | None = None,
    upstream: tuple[str, int] | None = None,
    control: bool = False,
    upstream_faults: Mapping[int, Sequence[Fault]] | None = None,
    network: MemoryNetwork | None = None,
    bounds: NetBounds | None = None,
    deterministic: bool = False,
    local_leg: bool | None = None,
    lanes: int | None = None,
    shards: int | Literal["auto"] = 0,
    **controller_options: Any,
) -> AsyncIterator[LocalCluster]:
    """Controller on a free loopback port, then one data relay per host
    (and one control relay per host with ``control=True``).

    ``upstream`` points the relays somewhere else than the controller (a
    fault proxy in front of it, say). ``upstream_faults`` starts a
    :class:`~flodl_trio.testing.FaultProxy` in front of the controller for
    the data relay of each host index it names. ``network``: run every role
    on a :class:`~flodl_trio.testing.MemoryNetwork` instead of TCP (for
    tests in virtual time; no fault proxies there). ``bounds`` and
    ``deterministic`` go to every role (default: each reads the environment;
    arrival-order folding); ``lanes`` to the controller (None: its default) and the
    data relays (None: they take the controller's);
    ``local_leg`` to the data relays (default: on
    unless ``FLODL_NO_UNIX`` is set). ``shards``: start that many reduction
    shards first (on the memory network too) and give them to the controller
    (which then takes no custom outer optimizer or resume record;
    ``close_shard(i)`` stops one);
    ``"auto"``: one per host, which its data relay offers to the controller,
    started with ``shards="auto"`` (the daemons' default).
    """
    if network is not None and (upstream_faults or upstream):
        raise ConfigError("a cluster on a memory network takes no TCP upstream or fault proxies")
    session = SessionSalt.coerce(salt)
    connect: Connector = trio.open_tcp_stream if network is None else network.connect

    def listeners() -> dict[str, Any]:
        return {"listeners": [network.listen()]} if network is not None else {}

    async with AsyncExitStack() as stack:
        shard_nursery = await stack.enter_async_context(service_nursery())
        offered = shards == "auto"
        shard_scopes = [trio.CancelScope() for _ in range(len(hosts) if offered else int(shards))]
        shard_handles: list[ShardHandle] = [
            await shard_nursery.start(_held_in, scope, open_shard(LOOPBACK, 0, salt=session, bounds=bounds,
                                                                  connect=connect, **listeners()))
            for scope in shard_scopes
        ]
        here = LOOPBACK if network is None else MEMORY_HOST
        if shards:
            controller_options = {**controller_options, "connect": connect,
                                  "shards": "auto" if offered else [(here, h.port) for h in shard_handles]}
            controller_options.setdefault("serve_shard", shard_server(salt=session, bounds=bounds))  # as the daemon
        controller = await stack.enter_async_context(
            open_controller(LOOPBACK, 0, world_size=world_size, salt=session, dead_ranks=dead_ranks, bounds=bounds,
                            deterministic=deterministic, lanes=lanes, **listeners(), **controller_options)
        )
        target = upstream or (LOOPBACK if network is None else MEMORY_HOST, controller.port)
        proxies: dict[int, FaultProxy] = {}
        if upstream_faults:
            nursery = await stack.enter_async_context(service_nursery())
            for index, faults in upstream_faults.items():
                if not 0 <= index < len(hosts):
                    raise ValueError(f"upstream_faults names host {index}; the cluster has {len(hosts)} hosts")
                proxies[index] = FaultProxy(target, faults)
                await nursery.start(proxies[index].serve)
        kinds = [ChannelKind.DATA, ChannelKind.CONTROL] if control else [ChannelKind.DATA]
        hosts_nursery = await stack.enter_async_context(service_nursery())
        relays: dict[ChannelKind, list[RelayHandle]] = {kind: [] for kind in kinds}
        shared = [HostRanks(ranks) for ranks in hosts]  # what each host's two channels share
        relay_scopes: list[list[trio.CancelScope]] = [[] for _ in hosts]
        for kind in kinds:
            for index, ranks in enumerate(hosts):
                proxy = proxies.get(index) if kind is ChannelKind.DATA else None
                relay = open_relay(
                    kind,
                    listen=(LOOPBACK, 0),
                    upstream=proxy.address if proxy is not None else target,
                    host_name=f"host{index}",
                    ranks=list(ranks),
                    world_size=world_size,
                    salt=session,
                    bounds=bounds,
                    connect=connect,
                    host=shared[index],
                    deterministic=deterministic,
                    local_leg=local_leg,
                    lanes=lanes if kind is ChannelKind.DATA else 1,
                    shard_offer=(here, shard_handles[index].port) if offered and kind is ChannelKind.DATA else None,
                    **listeners(),
                )
                relay_scopes[index].append(scope := trio.CancelScope())
                relays[kind].append(await hosts_nursery.start(_held_in, scope, relay))
        yield LocalCluster(
            controller, relays[ChannelKind.DATA], [list(r) for r in hosts], world_size, session,
            relays.get(ChannelKind.CONTROL, []), proxies, network, shard_handles, shard_scopes, relay_scopes,
        )
