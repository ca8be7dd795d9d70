"""A cluster whose ranks are real OS processes, for faults that are process faults.

The controller and relays run in the test's trio nursery; each rank is a
``python -m flodl_trio.testing.rank_worker`` process reporting JSON events.
``kill`` sends SIGKILL, ``freeze`` SIGSTOP, ``thaw`` SIGCONT - the real thing,
not a simulation::

    async with open_process_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt,
                                    rounds=8, heartbeat_timeout=1.5) as cluster:
        await cluster.wait_round(3, 1)
        cluster.freeze(3)
        event = await cluster.wait_round(0, 2)   # completes once rank 3 is declared dead
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..wire.salt import SessionSalt
from .local import LocalCluster, open_local_cluster
from .rank_worker import SALT_ENV

Event = dict[str, Any]


@attrs.define(eq=False)
class RankProcess:
    """One rank process and the events it has reported so far."""

    rank: int
    process: trio.Process
    events: list[Event] = attrs.field(factory=list)
    stderr: bytearray = attrs.field(factory=bytearray)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def _record(self, event: Event) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_event(self, predicate: Callable[[Event], bool]) -> Event:
        """The first event (past or future) matching ``predicate``; the caller bounds the wait."""
        while True:
            for event in self.events:
                if predicate(event):
                    return event
            if self.process.returncode is not None and self._reader_done:
                raise RuntimeError(
                    f"rank {self.rank} exited ({self.process.returncode}) without such an event; "
                    f"events={self.events} stderr={self.stderr.decode(errors='replace')[-2000:]}"
                )
            await self._changed.wait()

    _reader_done: bool = False

    @property
    def rounds(self) -> list[Event]:
        return [e for e in self.events if e["event"] == "round"]

    @property
    def error(self) -> Event | None:
        return next((e for e in self.events if e["event"] == "error"), None)


@attrs.define
class ProcessCluster:
    """In-process controller and relays, one OS process per rank."""

    local: LocalCluster
    ranks: dict[int, RankProcess]

    def kill(self, rank: int) -> None:
        self._signal(rank, signal.SIGKILL)

    def freeze(self, rank: int) -> None:
        self._signal(rank, signal.SIGSTOP)

    def thaw(self, rank: int) -> None:
        self._signal(rank, signal.SIGCONT)

    def _signal(self, rank: int, sig: signal.Signals) -> None:
        self.ranks[rank].process.send_signal(sig)

    async def wait_round(self, rank: int, round_index: int) -> Event:
        return await self.ranks[rank].wait_event(lambda e: e["event"] == "round" and e["round"] == round_index)

    async def wait_outcome(self, rank: int) -> Event:
        """The rank's final event: ``done`` or ``error``."""
        return await self.ranks[rank].wait_event(lambda e: e["event"] in ("done", "error"))

    async def wait_exit(self, rank: int) -> int:
        return await self.ranks[rank].process.wait()


def worker_command(
    cluster: LocalCluster, rank: int, *, rounds: int, pause: float, heartbeat_timeout: float | None,
    extra: Sequence[str] = (),
) -> list[str]:
    host, port = cluster.relay_address(rank)
    cmd = [
        sys.executable, "-m", "flodl_trio.testing.rank_worker",
        "--rank", str(rank), "--world-size", str(cluster.world_size),
        "--data", f"{host}:{port}", "--rounds", str(rounds), "--pause", str(pause),
    ]
    if cluster.control_relays:
        chost, cport = cluster.control_address(rank)
        cmd += ["--control", f"{chost}:{cport}"]
    if heartbeat_timeout is not None:
        cmd += ["--heartbeat-timeout", str(heartbeat_timeout)]
    return cmd + list(extra)


async def _pump_events(rank: RankProcess) -> None:
    assert rank.process.stdout is not None
    pending = b""
    async with rank.process.stdout:
        while chunk := await rank.process.stdout.receive_some(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    rank._record(json.loads(line))
    rank._reader_done = True
    rank._changed.set()


async def _pump_stderr(rank: RankProcess) -> None:
    assert rank.process.stderr is not None
    async with rank.process.stderr:
        while chunk := await rank.process.stderr.receive_some(65536):
            rank.stderr += chunk


@asynccontextmanager
async def open_process_cluster(
    *,
    world_size: int,
    hosts: Sequence[Sequence[int]],
    salt: SessionSalt | bytes,
    rounds: int = 5,
    pause: float = 0.0,
    control: bool = True,
    heartbeat_timeout: float | None = None,
    worker_args: Mapping[int, Sequence[str]] | None = None,
    **cluster_options: Any,
) -> AsyncIterator[ProcessCluster]:
    """Start the cluster and one worker process per rank; kill leftovers on exit."""
    session = SessionSalt.coerce(salt)
    env = {**os.environ, SALT_ENV: session.hex()}
    if heartbeat_timeout is not None:
        cluster_options["heartbeat_timeout"] = heartbeat_timeout
    async with open_local_cluster(
        world_size=world_size, hosts=hosts, salt=session, control=control, **cluster_options
    ) as local:
        procs: dict[int, RankProcess] = {}
        try:
            async with trio.open_nursery() as nursery:
                for rank in range(world_size):
                    if not any(rank in h for h in hosts):
                        continue
                    cmd = worker_command(
                        local, rank, rounds=rounds, pause=pause, heartbeat_timeout=heartbeat_timeout,
                        extra=(worker_args or {}).get(rank, ()),
                    )
                    process = await trio.lowlevel.open_process(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
                    )
                    procs[rank] = RankProcess(rank, process)
                    nursery.start_soon(_pump_events, procs[rank])
                    nursery.start_soon(_pump_stderr, procs[rank])
                try:
                    yield ProcessCluster(local, procs)
                finally:
                    with trio.CancelScope(shield=True):
                        await _reap(procs.values())
        finally:
            for proc in procs.values():
                if proc.process.returncode is None:
                    proc.process.kill()


async def _reap(procs: Any) -> None:
    """Kill what is still running (a frozen process too) and wait for every exit."""
    for proc in procs:
        if proc.process.returncode is None:
            proc.process.send_signal(signal.SIGCONT)
            proc.process.kill()
    with trio.move_on_after(10):
        for proc in procs:
            await proc.process.wait()


__all__ = ["ProcessCluster", "RankProcess", "open_process_cluster", "worker_command"]
