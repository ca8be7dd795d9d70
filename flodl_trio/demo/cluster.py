"""Starting the demo's cluster and following its training.

The processes are started by the testing toolkit's process harness
(:func:`~flodl_trio.testing.open_process_cluster`): the controller and one
relay per host as real daemons, on ports the OS picks (read from their start
lines), every process's log in the run's folder. The four ranks are the demo's
own worker processes, started with :meth:`~flodl_trio.testing.ProcessCluster.launch_rank`;
the victim is killed with SIGKILL after ``--kill-at`` and started again with
the same command after ``--rejoin-at``, as a launcher would.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from ..testing.processes import ChildProcess, Event, ProcessCluster, RankProcess, open_process_cluster
from ..wire.salt import SessionSalt
from .worker import HOSTS, WORLD, worker_flags

RANK_EXIT_TIMEOUT_S = 60.0
DAEMON_EXIT_TIMEOUT_S = 30.0


@attrs.define
class Milestones:
    """The windows at which the demo's fault happened, as they happened."""

    killed: int | None = None  # the victim was killed after this window
    restarted: int | None = None  # ... and started again after this one
    rejoined: float | None = None  # the window its second life came back at


@attrs.frozen
class DemoRun:
    """What a finished demo run leaves to report."""

    history: dict[int, list[Event]]  # each rank's events, every life in order
    milestones: Milestones
    status: dict[str, Any]  # the controller's status page at the end
    relay_logs: list[str]
    controller_log: str
    workdir: Path
    elapsed: float
    failed: list[ChildProcess]  # rank processes that ended other than cleanly or killed


def controller_args(args: argparse.Namespace, workdir: Path) -> list[str]:
    """The controller's flags beyond the harness's own (address, world size, heartbeat timeout)."""
    return ["--outer", args.outer, "--checkpoint-dir", str(workdir / "checkpoints"),
            "--rejoin-timeout", "60", "--keep-serving"]  # the status page outlives the ranks


def worker_command(cluster: ProcessCluster, rank: int, args: argparse.Namespace) -> list[str]:
    """``python -m flodl_trio.demo --worker`` for ``rank``, at its host's relay ports."""
    (_, data_port), (_, control_port) = cluster.relay_address(rank), cluster.control_address(rank)
    return [sys.executable, "-m", "flodl_trio.demo", "--worker", "--rank", str(rank), "--data-port", str(data_port),
            "--control-port", str(control_port), *worker_flags(args)]


@attrs.define(eq=False)
class TrainingFollower:
    """Reads every rank's events (both lives of the victim) as they come: rank 0's windows
    drive the progress bar, the kill and the restart; the victim's return is announced."""

    cluster: ProcessCluster
    args: argparse.Namespace
    bar: Any  # a tqdm progress bar
    nursery: trio.Nursery
    milestones: Milestones = attrs.field(factory=Milestones)

    def follow(self, rank: int, life: RankProcess) -> None:
        self.nursery.start_soon(self._read, rank, life)

    async def _read(self, rank: int, life: RankProcess) -> None:
        async for event in life.follow():
            if "joined" in event:
                self._joined(rank, event)
            elif "window" in event and rank == 0:
                await self._window(event)

    def _joined(self, rank: int, event: Event) -> None:
        if event["joined"] > 0:
            self.milestones.rejoined = event["joined"]
            self.bar.write(f"window {event['joined']:g}: rank {rank} is back, from the consensus "
                           f"(validation loss {event['consensus_loss']:.4f})")

    async def _window(self, event: Event) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{event['consensus_loss']:.4f}", live=event["live"] if event["live"] is not None else "-")
        finished, victim = event["window"] + 1, self.args.victim
        if self.milestones.killed is None and finished == self.args.kill_at:
            self.cluster.kill(victim)
            self.milestones.killed = self.args.kill_at
            self.bar.write(f"window {self.args.kill_at}: killed rank {victim} (SIGKILL); survivors carry on")
        if self.milestones.killed is not None and self.milestones.restarted is None and finished == self.args.rejoin_at:
            await self.cluster.wait_exit(victim)
            self.follow(victim, await self.cluster.restart(victim))
            self.milestones.restarted = self.args.rejoin_at
            self.bar.write(f"window {self.args.rejoin_at}: restarted rank {victim} with the same command")


def rank_lives(cluster: ProcessCluster, rank: int) -> list[RankProcess]:
    return [*cluster.past_lives.get(rank, []), cluster.ranks[rank]]


async def stop_daemons(cluster: ProcessCluster) -> None:
    """SIGTERM to each daemon still running, the relays first, then the controller, as an
    operator stops a cluster. A relay does not always leave by itself: one whose rank
    was killed and not started again (``--rejoin-at 0``) stays up for it, and a relay
    that outlives its controller holds for it (the demo keeps checkpoints, so the
    controller says it may come back) for minutes."""
    assert cluster.controller is not None
    with trio.fail_after(DAEMON_EXIT_TIMEOUT_S):
        for daemon in [*(relay for host in cluster.relays for relay in host), cluster.controller]:
            if daemon.returncode is None:
                daemon.signal(signal.SIGTERM)
            await daemon.wait()


async def run_cluster(args: argparse.Namespace, workdir: Path) -> DemoRun:
    """Start the daemons and the ranks, follow the training to its end, stop the daemons."""
    from tqdm import tqdm

    started = time.monotonic()
    async with open_process_cluster(
        world_size=WORLD, hosts=HOSTS, salt=SessionSalt.generate(), daemons=True, external_ranks=range(WORLD),
        heartbeat_timeout=args.heartbeat_timeout, controller_args=controller_args(args, workdir), log_dir=workdir,
    ) as cluster:
        bar = tqdm(total=args.windows, desc="windows", unit="win")
        async with trio.open_nursery() as nursery:
            follower = TrainingFollower(cluster, args, bar, nursery)
            for rank in range(WORLD):
                follower.follow(rank, await cluster.launch_rank(rank, worker_command(cluster, rank, args)))
        bar.close()
        lives = {rank: rank_lives(cluster, rank) for rank in range(WORLD)}
        with trio.fail_after(RANK_EXIT_TIMEOUT_S):
            for life in (life for ranks in lives.values() for life in ranks):
                await life.wait()
        status = await cluster.status()
        await stop_daemons(cluster)
        return DemoRun(
            history={rank: [event for life in ranks for event in life.events] for rank, ranks in lives.items()},
            milestones=follower.milestones, status=status,
            relay_logs=[relay.text for host in cluster.relays for relay in host],
            controller_log=cluster.controller.text if cluster.controller is not None else "", workdir=workdir,
            elapsed=time.monotonic() - started,
            # a rank that crashed must not leave a summary that looks like a result
            failed=[life for ranks in lives.values() for life in ranks if life.returncode not in (0, -signal.SIGKILL)],
        )
