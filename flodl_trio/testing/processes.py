"""A cluster whose ranks - and optionally daemons - are real OS processes.

Each rank is a ``python -m flodl_trio.testing.rank_worker`` process reporting
JSON events. By default the controller and relays run in the test's trio
nursery; with ``daemons=True`` they are real ``python -m flodl_trio.controller``
and ``python -m flodl_trio.relay`` processes too. ``kill`` sends SIGKILL,
``freeze`` SIGSTOP, ``thaw`` SIGCONT - the real thing, not a simulation::

    async with open_process_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt,
                                    rounds=8, heartbeat_timeout=1.5, daemons=True) as cluster:
        await cluster.wait_round(3, 1)
        cluster.freeze(3)
        event = await cluster.wait_round(0, 2)   # completes once rank 3 is declared dead
        cluster.kill_relay(1)                    # host 1's relay daemon: SIGKILL

Fault proxies go on any leg: ``proxy_faults={rank: [faults]}`` (that rank's
data connection), ``control_proxy_faults`` (its control connection) and
``upstream_faults={host_index: [faults]}`` (that host's data relay ->
controller connection); they run in the test process and are exposed as
``cluster.proxies[rank]``, ``cluster.control_proxies[rank]`` and
``cluster.upstream_proxies[host_index]``.

With ``log_dir=`` (created if missing) every process's stderr also goes to a
file there, one per process life (``controller.log``, ``relay-host0.log``,
``rank-3.log``, ``rank-3-2.log`` after a restart). ``external_ranks`` start no
worker; a test that plays them with processes of its own starts those with
:meth:`ProcessCluster.launch_rank` (the demo's ranks run that way) and reads
their JSON lines with :meth:`RankProcess.follow`.

Leaving the block reaps every process it started, with its process group (what
it started itself goes too): frozen ones are thawed first, anything still
running gets SIGKILL, and every exit is waited for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from pathlib import Path
from typing import IO, Any

import attrs
import trio

from ..transport.tasks import ChangeSignal, service_nursery
from ..wire.salt import SessionSalt
from .local import LOOPBACK, LocalCluster, fetch_status, open_local_cluster
from .proxy import Fault, FaultProxy

SALT_ENV = "FLODL_SALT_HEX"  # the same variable rank_worker reads (not imported: see rank_worker)

Event = dict[str, Any]

# How long leaving the block waits for killed processes to be reaped.
REAP_TIMEOUT_S = 10.0
# How long a wait for returns gives the controller's status page to answer, each time it asks.
STATUS_TIMEOUT_S = 1.0


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


def memory_of(pid: int) -> dict[str, int] | None:
    """``VmPeak``, ``VmHWM``, ``VmRSS`` and ``VmSize`` of a live process in bytes (Linux), else None.

    ``VmPeak`` (peak address space) also moves for memory that was reserved but
    never touched, which ``VmHWM`` (peak resident set) does not see.
    """
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = status.read().splitlines()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmPeak", "VmHWM", "VmRSS", "VmSize"):
            out[key] = int(value.split()[0]) * 1024
    return out or None


@attrs.define(eq=False)
class ChildProcess:
    """A process the harness started, with what it wrote to stderr."""

    name: str
    process: trio.Process
    output: bytearray = attrs.field(factory=bytearray)
    _changed: ChangeSignal = attrs.field(factory=ChangeSignal)
    _stderr_done: bool = False
    log_path: Path | None = None  # where stderr is also written, if anywhere

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def text(self) -> str:
        """Everything written to stderr so far (the daemons' log)."""
        return self.output.decode(errors="replace")

    def _notify(self) -> None:
        self._changed.notify()

    def signal(self, sig: signal.Signals) -> None:
        if self.process.returncode is None:
            self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (thawing first is unnecessary: SIGKILL also ends a stopped process)."""
        self.signal(signal.SIGKILL)

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    async def wait(self) -> int:
        return await self.process.wait()

    def memory(self) -> dict[str, int] | None:
        """See :func:`memory_of`; None once the process has exited."""
        return memory_of(self.pid) if self.process.returncode is None else None

    async def wait_log(self, pattern: str | re.Pattern[str]) -> re.Match[str]:
        """Wait until stderr matches ``pattern`` (a plain string is matched literally)."""
        regex = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        while True:
            match = regex.search(self.text)
            if match is not None:
                return match
            if self._stderr_done:
                raise RuntimeError(
                    f"{self.name} ended (exit {self.process.returncode}) without logging {regex.pattern!r}:\n"
                    f"{self.text[-4000:]}"
                )
            await self._changed.wait()

    def _open_log(self) -> AbstractContextManager[IO[bytes] | None]:
        return open(self.log_path, "ab") if self.log_path is not None else nullcontext()

    async def _pump_stderr(self) -> None:
        assert self.process.stderr is not None
        with self._open_log() as log:
            async with self.process.stderr:
                while chunk := await self.process.stderr.receive_some(65536):
                    self.output += chunk
                    if log is not None:
                        log.write(chunk)
                        log.flush()  # the file is for reading while the process runs
                    self._notify()
        self._stderr_done = True
        self._notify()


@attrs.define(eq=False)
class DaemonProcess(ChildProcess):
    """A controller or relay daemon process."""


@attrs.define(eq=False)
class RankProcess(ChildProcess):
    """One rank process and the events it has reported so far."""

    rank: int = -1
    events: list[Event] = attrs.field(factory=list)
    _stdout_done: bool = False

    @property
    def stderr(self) -> bytearray:
        return self.output

    @property
    def _reader_done(self) -> bool:
        return self._stdout_done

    def _record(self, event: Event) -> None:
        self.events.append(event)
        self._notify()

    async def wait_event(self, predicate: Callable[[Event], bool]) -> Event:
        """The first event (past or future) matching ``predicate``; the caller bounds the wait."""
        while True:
            for event in self.events:
                if predicate(event):
                    return event
            if self._stdout_done:
                await self.process.wait()
                raise RuntimeError(
                    f"rank {self.rank} exited ({self.process.returncode}) without such an event; "
                    f"events={self.events} stderr={self.text[-2000:]}"
                )
            await self._changed.wait()

    async def follow(self) -> AsyncIterator[Event]:
        """Every event in order - those already reported, then each as it comes - until
        the process closes its stdout (it exited)."""
        seen = 0
        while True:
            while seen < len(self.events):
                seen += 1
                yield self.events[seen - 1]
            if self._stdout_done:
                return
            await self._changed.wait()

    @property
    def rounds(self) -> list[Event]:
        return [e for e in self.events if e.get("event") == "round"]

    @property
    def error(self) -> Event | None:
        return next((e for e in self.events if e.get("event") in ("error", "crash")), None)

    async def _pump_events(self) -> None:
        assert self.process.stdout is not None
        pending = b""
        async with self.process.stdout:
            while chunk := await self.process.stdout.receive_some(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._record(_parse_event(line))
        self._stdout_done = True
        self._notify()


def _parse_event(line: bytes) -> Event:
    """One stdout line as an event: a JSON object as it is (a launched process may name its
    events otherwise, as the demo's workers do; the waits read ``event.get("event")``), and
    anything else - plain text, a bare JSON number or list - as a ``text`` event holding
    the line, so every event is a dict."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if isinstance(event, dict):
        return event
    return {"event": "text", "time": time.monotonic(), "line": line.decode(errors="replace").rstrip("\r")}


# ---------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------


@attrs.define(eq=False)
class ProcessCluster:
    """Rank processes plus the controller and relays (in-process, or daemons)."""

    world_size: int
    hosts: list[list[int]]
    salt: SessionSalt
    ranks: dict[int, RankProcess]
    local: LocalCluster | None = None
    controller: DaemonProcess | None = None
    relays: list[list[DaemonProcess]] = attrs.field(factory=list)
    shards: list[DaemonProcess] = attrs.field(factory=list)  # reduction shard daemons (``shards=N``)
    proxies: dict[int, FaultProxy] = attrs.field(factory=dict)
    control_proxies: dict[int, FaultProxy] = attrs.field(factory=dict)
    upstream_proxies: dict[int, FaultProxy] = attrs.field(factory=dict)
    controller_port: int = 0
    # Where the controller daemon listens and relays reach it, and what its command is
    # run under (``["ip", "netns", "exec", NAME]``: on another simulated machine).
    controller_host: str = LOOPBACK
    controller_wrap: tuple[str, ...] = ()
    # The host whose relay and ranks run beside the controller (under its wrap), the
    # relay reaching it over loopback, as on a training host that also runs it.
    beside_controller: int | None = None
    data_ports: list[int] = attrs.field(factory=list)
    control_ports: list[int | None] = attrs.field(factory=list)
    # Earlier lives of restarted ranks, oldest first; how each rank was started (to start it again).
    past_lives: dict[int, list[RankProcess]] = attrs.field(factory=dict)
    past_relays: dict[int, list[DaemonProcess]] = attrs.field(factory=dict)
    log_dir: Path | None = None  # each process's stderr also goes to a file there
    _relay_launches: dict[int, list[tuple[str, list[str], dict[str, str]]]] = attrs.field(factory=dict)
    _controller_launch: tuple[list[str], dict[str, str]] | None = None
    past_controllers: list[DaemonProcess] = attrs.field(factory=list)
    _launches: dict[int, tuple[list[str], dict[str, str]]] = attrs.field(factory=dict)
    _base_env: dict[str, str] = attrs.field(factory=dict)
    _nursery: trio.Nursery | None = None
    _started: list[ChildProcess] = attrs.field(factory=list)

    # -- where ---------------------------------------------------------------

    @property
    def daemons(self) -> bool:
        return self.controller is not None

    @property
    def controller_address(self) -> tuple[str, int]:
        return (self.controller_host, self.controller_port)

    def host_of(self, rank: int) -> int:
        for index, ranks in enumerate(self.hosts):
            if rank in ranks:
                return index
        raise KeyError(f"rank {rank} is on no host of this cluster")

    def relay_address(self, rank: int) -> tuple[str, int]:
        """The data relay rank ``rank`` belongs to (the relay itself, not a proxy in front of it)."""
        return (LOOPBACK, self.data_ports[self.host_of(rank)])

    def control_address(self, rank: int) -> tuple[str, int]:
        port = self.control_ports[self.host_of(rank)]
        if port is None:
            raise KeyError(f"rank {rank}'s host runs no control relay (open the cluster with control=True)")
        return (LOOPBACK, port)

    def log_path(self, name: str) -> Path | None:
        """A new log file in :attr:`log_dir` for the process ``name`` ("rank 3" ->
        ``rank-3.log``, then ``rank-3-2.log`` for its next life); None without a log_dir.
        The folder (and its parents) is created if it does not exist."""
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
        life = 1
        while True:
            path = self.log_dir / (f"{stem}.log" if life == 1 else f"{stem}-{life}.log")
            try:
                path.touch(exist_ok=False)  # claimed now, so two lives never share a file
                return path
            except FileExistsError:
                life += 1

    # -- rank processes ------------------------------------------------------

    def _life(self, rank: int) -> RankProcess:
        """Rank ``rank``'s current process; a KeyError that says why when it has none."""
        try:
            return self.ranks[rank]
        except KeyError:
            pass
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise KeyError(f"rank {rank!r} is not a rank of this cluster (world_size {self.world_size})") from None
        raise KeyError(
            f"rank {rank} has no process: it is one of external_ranks or on no host "
            "(start one with launch_rank)"
        ) from None

    def kill(self, rank: int) -> None:
        self._life(rank).kill()

    def freeze(self, rank: int) -> None:
        self._life(rank).freeze()

    def thaw(self, rank: int) -> None:
        self._life(rank).thaw()

    async def resume(self, rank: int) -> None:
        """End rank ``rank``'s current (or next) ``--pause-before`` hold."""
        stdin = self._life(rank).process.stdin
        assert stdin is not None
        try:
            await stdin.send_all(b"go\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the rank has already exited (a fault ended it): nothing left to release

    async def launch_rank(self, rank: int, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> RankProcess:
        """Start a process of your own for rank ``rank`` (one of ``external_ranks``): it
        reports JSON lines on stdout as rank_worker does, its environment defaults to the
        cluster's (the salt included), and :meth:`restart` starts it again the same way."""
        if rank in self.ranks:
            raise RuntimeError(f"rank {rank} already has a process (pid {self.ranks[rank].pid})")
        self._launches[rank] = (list(cmd), dict(self._base_env if env is None else env))
        return await self._start_life(rank)

    async def restart(self, rank: int) -> RankProcess:
        """Start rank ``rank`` again with the command line and environment it first
        had (as a launcher restarts a failed worker). Its last process must have
        exited (kill it first); it stays in :attr:`past_lives`."""
        old = self._life(rank)
        if old.process.returncode is None:
            raise RuntimeError(f"rank {rank} (pid {old.pid}) is still running: kill it before restarting it")
        self.past_lives.setdefault(rank, []).append(old)
        return await self._start_life(rank)

    async def _start_life(self, rank: int) -> RankProcess:
        assert self._nursery is not None
        cmd, env = self._launches[rank]
        proc = await _launch_rank(self._nursery, rank, cmd, env, self._started, self.log_path(f"rank {rank}"))
        self.ranks[rank] = proc
        return proc

    async def wait_event(self, rank: int, event: str, **fields: object) -> Event:
        """The first event named ``event`` whose fields match ``fields``."""
        return await self._life(rank).wait_event(
            lambda e: e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
        )

    async def wait_round(self, rank: int, round_index: int) -> Event:
        return await self.wait_event(rank, "round", round=round_index)

    async def wait_outcome(self, rank: int) -> Event:
        """The rank's final event: ``done``, ``error`` or ``crash``."""
        return await self._life(rank).wait_event(lambda e: e.get("event") in ("done", "error", "crash"))

    async def wait_exit(self, rank: int) -> int:
        return await self._life(rank).process.wait()

    async def wait_returns_primed(self, ranks: Iterable[int], poll: float = 0.05) -> None:
        """Until every rank of ``ranks`` has its state for coming back (its relay asked,
        its state went out and it said it has it: the status page lists it as
        ``primed``) or has already rejoined (its current life reported ``joined``). A
        test that holds the survivors (``--pause-before W:inf``) until then knows the
        window the ranks enter by, however long their processes took to start.
        Only a rank whose trainer calls ``join`` comes back (``rank_worker --windows``);
        a rank whose current life ends first (a refused join, say) raises RuntimeError."""
        await self._wait_returns(ranks, "primed", poll)

    async def wait_returns_joining(self, ranks: Iterable[int], poll: float = 0.05) -> None:
        """Until every rank of ``ranks`` has asked back in full (its relay's ask and its
        state request: the status page lists it as ``joining``, primed ones included)
        or has rejoined. With shards a return's state is a window that ends after this.
        A rank whose current life ends first raises RuntimeError."""
        await self._wait_returns(ranks, "joining", poll)

    async def _wait_returns(self, ranks: Iterable[int], listed_as: str, poll: float) -> None:
        pending = set(ranks)
        while True:
            pending -= {rank for rank in pending if any(e.get("event") == "joined" for e in self._life(rank).events)}
            for rank in sorted(pending):
                life = self._life(rank)
                if life._stdout_done:  # it exited without coming back: it never will
                    raise RuntimeError(
                        f"rank {rank} ended before it came back ({life.error or 'no error event'}); "
                        f"stderr: {life.text[-2000:]}"
                    )
            if pending:
                pending -= await self._listed(listed_as)
            if not pending:
                return
            await trio.sleep(poll)

    async def _listed(self, listed_as: str) -> set[int]:
        """The ranks the status page lists as ``listed_as``; none while the controller does
        not answer within :data:`STATUS_TIMEOUT_S` (down, restarting, frozen): a wait for
        returns goes on through that, and still sees a rank's process end meanwhile."""
        with trio.move_on_after(STATUS_TIMEOUT_S):
            try:
                return set((await self.status())[listed_as])
            except (OSError, ValueError, KeyError):  # no controller, or cut off mid-answer
                pass
        return set()

    # -- daemons -------------------------------------------------------------

    def _daemons(self) -> None:
        if not self.daemons:
            raise RuntimeError("the controller and relays run in-process; open the cluster with daemons=True")

    def relay_processes(self, host_index: int) -> list[DaemonProcess]:
        """Host ``host_index``'s relay processes (one, or data + control when its uplink is proxied)."""
        self._daemons()
        return self.relays[host_index]

    def kill_relay(self, host_index: int) -> None:
        for relay in self.relay_processes(host_index):
            relay.kill()

    async def restart_relay(self, host_index: int) -> list[DaemonProcess]:
        """Start host ``host_index``'s relay daemon(s) again, on the same ports, as an
        operator restarts a crashed relay (kill it first). The old processes stay in
        :attr:`past_relays`; returns the new ones once they listen."""
        old = self.relay_processes(host_index)
        if any(proc.process.returncode is None for proc in old):
            raise RuntimeError(f"host {host_index}'s relay is still running: kill it before restarting it")
        assert self._nursery is not None
        self.past_relays.setdefault(host_index, []).extend(old)
        fixed = {"--data-port": self.data_ports[host_index], "--control-port": self.control_ports[host_index]}
        new = []
        for name, argv, env in self._relay_launches[host_index]:
            argv = [str(fixed[argv[i - 1]]) if i and argv[i - 1] in fixed else arg for i, arg in enumerate(argv)]
            new.append(await _start_daemon(self._nursery, name, "flodl_trio.relay", argv, env, self._started,
                                           self.log_path(name)))
        self.relays[host_index] = new
        for relay in new:
            await relay.wait_log(re.compile(rf"relay host{host_index} started"))
        return new

    def freeze_relay(self, host_index: int) -> None:
        for relay in self.relay_processes(host_index):
            relay.freeze()

    def thaw_relay(self, host_index: int) -> None:
        for relay in self.relay_processes(host_index):
            relay.thaw()

    def _controller(self) -> DaemonProcess:
        self._daemons()
        assert self.controller is not None
        return self.controller

    def kill_controller(self) -> None:
        self._controller().kill()

    async def restart_controller(self, wrap: Sequence[str] | None = None) -> DaemonProcess:
        """Start the controller daemon again with its first command line, on the same port,
        as an operator restarts one that died (kill it first); returns it once it listens.
        ``wrap``: run it under this instead (another machine: another network namespace
        that now has the controller's address)."""
        old = self._controller()
        if old.process.returncode is None:
            raise RuntimeError("the controller is still running: kill it before restarting it")
        assert self._nursery is not None and self._controller_launch is not None
        self.past_controllers.append(old)
        argv, env = self._controller_launch
        argv = [str(self.controller_port) if i and argv[i - 1] == "--port" else a for i, a in enumerate(argv)]
        if wrap is not None:
            self.controller_wrap = tuple(wrap)
        self.controller = await _start_daemon(self._nursery, "controller", "flodl_trio.controller", argv, env,
                                              self._started, self.log_path("controller"), self.controller_wrap)
        await self.controller.wait_log(re.compile(r"controller started: listening on \S+:(\d+)"))
        return self.controller

    def kill_shard(self, index: int) -> None:
        self.shards[index].kill()

    def freeze_shard(self, index: int) -> None:
        self.shards[index].freeze()

    def thaw_shard(self, index: int) -> None:
        self.shards[index].thaw()

    def freeze_controller(self) -> None:
        self._controller().freeze()

    def thaw_controller(self) -> None:
        self._controller().thaw()

    def processes(self) -> list[ChildProcess]:
        """Every process of the cluster: ranks (earlier lives first), relays, controller."""
        out: list[ChildProcess] = [proc for lives in self.past_lives.values() for proc in lives]
        out += [proc for lives in self.past_relays.values() for proc in lives]
        out += self.ranks.values()
        out += self.past_controllers
        out += self.shards
        for host in self.relays:
            out.extend(host)
        if self.controller is not None:
            out.append(self.controller)
        return out

    def logs(self) -> str:
        """Every daemon's and rank's stderr, labelled (for failure messages)."""
        parts = []
        for proc in self.processes():
            if proc.output:
                parts.append(f"--- {proc.name} (exit {proc.returncode}) ---\n{proc.text[-3000:]}")
        return "\n".join(parts)

    async def status(self) -> dict[str, Any]:
        """The controller's JSON status page (dead ranks, returns, relays, counters)."""
        return await fetch_status(self.controller_address)


def worker_command(
    cluster: LocalCluster | ProcessCluster, rank: int, *, rounds: int, pause: float, heartbeat_timeout: float | None,
    extra: Sequence[str] = (), data: tuple[str, int] | None = None, control: tuple[str, int] | None = None,
) -> list[str]:
    """The rank_worker command line for ``rank`` (``data``/``control`` override the addresses)."""
    host, port = data or cluster.relay_address(rank)
    cmd = [
        sys.executable, "-m", "flodl_trio.testing.rank_worker",
        "--rank", str(rank), "--world-size", str(cluster.world_size),
        "--data", f"{host}:{port}", "--rounds", str(rounds), "--pause", str(pause),
    ]
    if control is None:
        try:
            control = cluster.control_address(rank)
        except KeyError:
            control = None
    if control is not None:
        cmd += ["--control", f"{control[0]}:{control[1]}"]
    if heartbeat_timeout is not None:
        cmd += ["--heartbeat-timeout", str(heartbeat_timeout)]
    return cmd + list(extra)


async def _spawn(cmd: list[str], env: Mapping[str, str]) -> trio.Process:
    # A process group of its own: what it starts (torchrun's workers) goes with it in reap.
    return await trio.lowlevel.open_process(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env), process_group=0,
    )


async def _launch_rank(
    nursery: trio.Nursery, rank: int, cmd: list[str], env: Mapping[str, str], started: list[ChildProcess],
    log_path: Path | None = None,
) -> RankProcess:
    proc = RankProcess(f"rank {rank}", await _spawn(cmd, env), rank=rank, log_path=log_path)
    started.append(proc)
    nursery.start_soon(proc._pump_events)
    nursery.start_soon(proc._pump_stderr)
    return proc


async def _start_daemon(
    nursery: trio.Nursery, name: str, module: str, args: Sequence[str], env: Mapping[str, str], started: list[ChildProcess],
    log_path: Path | None = None, wrap: Sequence[str] = (),
) -> DaemonProcess:
    process = await trio.lowlevel.open_process(
        [*wrap, sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, env=dict(env), process_group=0,  # its children (a relay's shard) share its group
    )
    daemon = DaemonProcess(name, process, log_path=log_path)
    started.append(daemon)
    nursery.start_soon(daemon._pump_stderr)
    return daemon


async def _start_shards(
    nursery: trio.Nursery, cluster: ProcessCluster, started: list[ChildProcess], count: int, env: Mapping[str, str],
) -> list[str]:
    """``count`` shard daemons on loopback; their addresses, as ``--shards`` takes them."""
    addresses = []
    for index in range(count):
        name = f"shard {index}"
        shard = await _start_daemon(nursery, name, "flodl_trio.shard",
                                    ["--host", LOOPBACK, "--port", "0", "--log-level", "INFO"], env, started,
                                    cluster.log_path(name))
        cluster.shards.append(shard)
        match = await shard.wait_log(re.compile(r"shard started: listening on (\S+:\d+)"))
        addresses.append(match.group(1))
    return addresses


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc (empty elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for entry in entries:
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def _own_group(proc: ChildProcess) -> bool:
    """Whether ``proc``'s process group (its id: the leader's pid) is still the one it led.

    Once the leader has been reaped its pid may be a new process's - but only when its
    old group is empty (the kernel keeps a pid that is a group's id from being reused),
    and then there is nothing of ours left in it.
    """
    return proc.process.returncode is None or _proc_stat(proc.pid) is None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _wait_gone(pid: int) -> None:
    """Until ``pid`` (not our child: it cannot be waited for) has exited; on its pidfd where there is one."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds here: look again now and then
        while (fields := _proc_stat(pid)) is not None and fields[0] != "Z":
            await trio.sleep(0.01)
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def reap(procs: Iterable[ChildProcess], timeout: float = REAP_TIMEOUT_S) -> None:
    """Thaw and SIGKILL whatever is still running - each process with whatever it started
    (its process group: a relay daemon's shard, torchrun's workers) - then wait for every
    exit, theirs included."""
    procs = list(procs)
    groups = [proc.pid for proc in procs if _own_group(proc)]
    for pgid in groups:
        _signal_group(pgid, signal.SIGCONT)
        _signal_group(pgid, signal.SIGKILL)
    for proc in procs:
        proc.thaw()
        proc.kill()
    with trio.move_on_after(timeout):
        for proc in procs:
            await proc.process.wait()
        for pgid in groups:
            for pid in _group_members(pgid):
                await _wait_gone(pid)


def _flag_list(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


async def _start_daemons(
    nursery: trio.Nursery, cluster: ProcessCluster, started: list[ChildProcess], *,
    control: bool, heartbeat_timeout: float | None, upstream_faults: Mapping[int, Sequence[Fault]],
    base_env: Mapping[str, str], controller_env: Mapping[str, str], relay_env: Mapping[int, Mapping[str, str]],
    controller_args: Sequence[str], relay_args: Mapping[int, Sequence[str]], shards: int,
) -> None:
    """Shard daemons, the controller daemon, then every relay daemon; ports are read from
    their start lines."""
    # INFO at least: the harness reads the bound ports from the start lines.
    # A relay beside the controller reaches it over loopback: it listens on every address then.
    host = cluster.controller_host if cluster.beside_controller is None else "0.0.0.0"
    args = ["--host", host, "--port", "0", "--world-size", str(cluster.world_size), "--log-level", "INFO"]
    if shards:
        args += ["--shards", ",".join(await _start_shards(nursery, cluster, started, shards, base_env))]
    if heartbeat_timeout is not None:
        args += ["--heartbeat-timeout", str(heartbeat_timeout)]
    cluster._controller_launch = ([*args, *controller_args], {**base_env, **controller_env})
    cluster.controller = await _start_daemon(
        nursery, "controller", "flodl_trio.controller", *cluster._controller_launch, started, cluster.log_path("controller"),
        cluster.controller_wrap,
    )
    match = await cluster.controller.wait_log(re.compile(r"controller started: listening on \S+:(\d+)"))
    cluster.controller_port = int(match.group(1))
    for index in upstream_faults:
        if not 0 <= index < len(cluster.hosts):
            raise ValueError(f"upstream_faults names host {index}; the cluster has {len(cluster.hosts)} hosts")
        proxy = FaultProxy(cluster.controller_address, upstream_faults[index])
        await nursery.start(proxy.serve)
        cluster.upstream_proxies[index] = proxy
    # Each host: one relay with both channels; a proxied uplink splits it in two
    # processes (data through the proxy, control straight to the controller).
    plans: list[list[tuple[str, tuple[str, int]]]] = []
    for index in range(len(cluster.hosts)):
        direct = cluster.controller_address
        if index in cluster.upstream_proxies:
            plan = [("data", cluster.upstream_proxies[index].address)]
            if control:
                plan.append(("control", direct))
        else:
            if index == cluster.beside_controller:
                direct = (LOOPBACK, cluster.controller_port)
            plan = [("data,control" if control else "data", direct)]
        plans.append(plan)
    for index, (ranks, plan) in enumerate(zip(cluster.hosts, plans)):
        host_relays = []
        for channels, (chost, cport) in plan:
            args = [
                "--controller", f"{chost}:{cport}", "--ranks", _flag_list(ranks), "--world-size", str(cluster.world_size),
                "--host-name", f"host{index}", "--channels", channels, "--listen-host", LOOPBACK, "--log-level", "INFO",
            ]
            args += ["--data-port", "0"] if "data" in channels else []
            args += ["--control-port", "0"] if "control" in channels else []
            name = f"relay host{index}" + ("" if len(plan) == 1 else f" ({channels})")
            env = {**base_env, **relay_env.get(index, {})}
            argv = [*args, *relay_args.get(index, ())]
            cluster._relay_launches.setdefault(index, []).append((name, argv, env))
            wrap = cluster.controller_wrap if index == cluster.beside_controller else ()
            host_relays.append(await _start_daemon(nursery, name, "flodl_trio.relay", argv, env, started,
                                                   cluster.log_path(name), wrap))
        cluster.relays.append(host_relays)
    cluster.data_ports = [0] * len(cluster.hosts)
    cluster.control_ports = [None] * len(cluster.hosts)
    for index, host_relays in enumerate(cluster.relays):
        for relay in host_relays:
            match = await relay.wait_log(re.compile(rf"relay host{index} started: .*"))
            if data := re.search(r"data=\S+?:(\d+)", match.group(0)):
                cluster.data_ports[index] = int(data.group(1))
            if ctl := re.search(r"control=\S+?:(\d+)", match.group(0)):
                cluster.control_ports[index] = int(ctl.group(1))


def _refuse_daemon_options(**options: object) -> None:
    """Daemon flags, environment and placement given to an in-process cluster: there is no
    daemon to give them to, and ignoring them would leave the test running another cluster
    than it asked for (a controller that lets no dead rank back, say)."""
    given = sorted(name for name, value in options.items() if value is not None and value not in ((), [], {}))
    if given:
        raise TypeError(
            f"{', '.join(given)}: options of the daemons, which only run with daemons=True "
            "(the in-process controller takes keyword arguments of open_controller instead, e.g. rejoin_timeout=60)"
        )


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
    daemons: bool = False,
    backend: str = "torch",
    numel: int | None = None,
    external_ranks: Iterable[int] = (),
    proxy_faults: Mapping[int, Sequence[Fault]] | None = None,
    control_proxy_faults: Mapping[int, Sequence[Fault]] | None = None,
    upstream_faults: Mapping[int, Sequence[Fault]] | None = None,
    worker_env: Mapping[int, Mapping[str, str]] | None = None,
    controller_env: Mapping[str, str] | None = None,
    relay_env: Mapping[int, Mapping[str, str]] | None = None,
    controller_args: Sequence[str] = (),
    relay_args: Mapping[int, Sequence[str]] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    controller_host: str = LOOPBACK,
    controller_wrap: Sequence[str] = (),
    beside_controller: int | None = None,
    shards: int = 0,
    **cluster_options: Any,
) -> AsyncIterator[ProcessCluster]:
    """Start the cluster and one worker process per rank; reap every process on exit.

    - ``daemons``: run the controller and one relay per host as daemon
      processes (``controller_env``/``controller_args``, ``relay_env``/
      ``relay_args`` per host index) instead of in this process.
    - ``backend``/``numel``: the workers' ``--backend`` and ``--numel``.
    - ``external_ranks``: start no worker for these ranks (the test plays them).
    - ``proxy_faults`` / ``control_proxy_faults`` / ``upstream_faults``: fault
      proxies on a rank's data or control leg, or a host's data uplink.
    - ``worker_args`` / ``worker_env``: extra flags and environment per rank.
    - ``log_dir``: a folder (created, parents too, if missing); every process's stderr
      also goes to a file there.
    - ``controller_host`` / ``controller_wrap`` (daemons only): the controller daemon
      listens on that address and runs under that command prefix (``ip netns exec
      NAME``: on a simulated machine of its own); ``beside_controller``: the host index
      whose relay and ranks run under that prefix too, the relay reaching the controller
      over loopback (a training host that also runs the controller).
    - ``shards`` (daemons only): start that many ``python -m flodl_trio.shard`` daemons
      first and name them in the controller's ``--shards``;
      :meth:`ProcessCluster.kill_shard` / ``freeze_shard`` / ``thaw_shard`` reach them.
    - ``cluster_options``: passed to :func:`open_local_cluster` (in-process only).
    """
    session = SessionSalt.coerce(salt)
    base_env = {**os.environ, SALT_ENV: session.hex()}
    host_lists = [list(h) for h in hosts]
    external = set(external_ranks)
    started: list[ChildProcess] = []
    if shards and not daemons:
        raise TypeError("shards=N starts shard daemons: it needs daemons=True")
    if not daemons:
        _refuse_daemon_options(
            controller_args=controller_args, controller_env=controller_env, relay_args=relay_args,
            relay_env=relay_env, controller_wrap=controller_wrap, beside_controller=beside_controller,
            controller_host=None if controller_host == LOOPBACK else controller_host,
        )
    if daemons and cluster_options:
        raise TypeError(f"daemons=True takes controller_args/relay_args, not {sorted(cluster_options)}")
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(service_nursery())
        cluster = ProcessCluster(world_size, host_lists, session, {}, log_dir=None if log_dir is None else Path(log_dir),
                                 controller_host=controller_host, controller_wrap=tuple(controller_wrap),
                                 beside_controller=beside_controller)
        cluster._base_env, cluster._nursery, cluster._started = base_env, nursery, started
        try:
            if daemons:
                await _start_daemons(
                    nursery, cluster, started, control=control, heartbeat_timeout=heartbeat_timeout,
                    upstream_faults=upstream_faults or {}, base_env=base_env, controller_env=controller_env or {},
                    relay_env=relay_env or {}, controller_args=controller_args, relay_args=relay_args or {},
                    shards=shards,
                )
            else:
                if heartbeat_timeout is not None:
                    cluster_options["heartbeat_timeout"] = heartbeat_timeout
                local = await stack.enter_async_context(
                    open_local_cluster(
                        world_size=world_size, hosts=host_lists, salt=session, control=control,
                        upstream_faults=upstream_faults, **cluster_options,
                    )
                )
                cluster.local = local
                cluster.controller_port = local.controller.port
                cluster.data_ports = [relay.port for relay in local.relays]
                cluster.control_ports = [relay.port for relay in local.control_relays] or [None] * len(host_lists)
                cluster.upstream_proxies = dict(local.upstream_proxies)
            for table, faults_by_rank, address in (
                (cluster.proxies, proxy_faults, cluster.relay_address),
                (cluster.control_proxies, control_proxy_faults, cluster.control_address),
            ):
                for rank, faults in (faults_by_rank or {}).items():
                    table[rank] = FaultProxy(address(rank), faults)
                    await nursery.start(table[rank].serve)
            for rank in range(world_size):
                if rank in external or not any(rank in h for h in host_lists):
                    continue
                extra = list((worker_args or {}).get(rank, ()))
                extra += ["--backend", backend] + (["--numel", str(numel)] if numel is not None else [])
                cmd = worker_command(
                    cluster, rank, rounds=rounds, pause=pause, heartbeat_timeout=heartbeat_timeout, extra=extra,
                    data=cluster.proxies[rank].address if rank in cluster.proxies else None,
                    control=cluster.control_proxies[rank].address if rank in cluster.control_proxies else None,
                )
                if beside_controller is not None and cluster.host_of(rank) == beside_controller:
                    cmd = [*controller_wrap, *cmd]
                await cluster.launch_rank(rank, cmd, {**base_env, **(worker_env or {}).get(rank, {})})
            yield cluster
        finally:
            with trio.CancelScope(shield=True):
                ranks_first = sorted(started, key=lambda p: not isinstance(p, RankProcess))
                await reap(ranks_first)


__all__ = [
    "ChildProcess",
    "DaemonProcess",
    "ProcessCluster",
    "RankProcess",
    "memory_of",
    "open_process_cluster",
    "reap",
    "worker_command",
]
