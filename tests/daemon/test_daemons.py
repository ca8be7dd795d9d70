"""The daemons as users run them: real subprocesses, every flag exercised.

Each test starts ``python -m flodl_trio.controller`` / ``python -m flodl_trio.relay``
with real flags or environment variables and talks to them over TCP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import attrs
import numpy as np
import pytest
import torch
import trio

from flodl_trio import RoundKind, average_window, connect_reduce_client
from flodl_trio.client import connect_control_client
from flodl_trio.fold.outer import DiLoCoNesterov
from flodl_trio.wire import RoundFrame, TensorPayload
from flodl_trio.wire.checkpoint import load_checkpoint

SALT_HEX = "42" * 16
SIG = b"\x44" * 32
LOOP = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind((LOOP, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@attrs.define(eq=False)
class Daemon:
    """A daemon subprocess and everything it wrote to stderr."""

    process: trio.Process
    output: bytearray = attrs.field(factory=bytearray)
    _grew: trio.Event = attrs.field(factory=trio.Event)

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    async def wait_for(self, needle: str) -> str:
        """Wait until ``needle`` appears in the output; returns the whole output."""
        while needle not in self.text:
            if self.process.returncode is not None and not self._grew.is_set():
                raise AssertionError(f"daemon exited {self.process.returncode} before {needle!r}:\n{self.text}")
            self._grew = trio.Event()
            with trio.move_on_after(0.2):
                await self._grew.wait()
        return self.text

    async def guard(self) -> None:
        """Until the process exits; if the test ends first (it failed), kill it: no daemon
        outlives its test."""
        try:
            await self.process.wait()
        finally:
            if self.process.returncode is None:
                self.process.kill()

    async def pump(self) -> None:
        assert self.process.stderr is not None
        while chunk := await self.process.stderr.receive_some(65536):
            self.output += chunk
            self._grew.set()
        self._grew.set()


async def start_daemon(nursery: trio.Nursery, module: str, *args: str, env: dict[str, str] | None = None) -> Daemon:
    full_env = {**os.environ, "FLODL_SALT_HEX": SALT_HEX, **(env or {})}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=full_env
    )
    daemon = Daemon(process)
    nursery.start_soon(daemon.pump)
    nursery.start_soon(daemon.guard)
    return daemon


async def start_pair(
    nursery: trio.Nursery, world_size: int, ranks: str, *, controller_args: tuple[str, ...] = (),
    relay_args: tuple[str, ...] = (),
) -> tuple[Daemon, Daemon, int]:
    """A controller daemon and one data relay daemon (carrying ``ranks``) on free
    loopback ports; returns both and the relay's data port."""
    ctl_port, data_port = free_ports(2)
    controller = await start_daemon(nursery, "flodl_trio.controller", "--host", LOOP, "--port", str(ctl_port),
                                    "--world-size", str(world_size), *controller_args)
    relay = await start_daemon(nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks", ranks,
                               "--world-size", str(world_size), "--channels", "data", "--data-port", str(data_port),
                               *relay_args)
    return controller, relay, data_port


async def start_two_rank_host(
    nursery: trio.Nursery, relay_env: dict[str, str] | None = None,
) -> tuple[Daemon, Daemon, int, int]:
    """A controller daemon and one relay daemon carrying ranks 0 and 1 on both channels,
    each started once the one before said so; returns both and the data and control ports."""
    ctl_port, data, control = free_ports(3)
    controller = await start_daemon(nursery, "flodl_trio.controller", "--host", LOOP, "--port", str(ctl_port),
                                    "--world-size", "2", "--log-level", "INFO")
    await controller.wait_for("controller started")
    relay = await start_daemon(nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks", "0,1",
                               "--world-size", "2", "--host-name", "h", "--listen-host", LOOP,
                               "--data-port", str(data), "--control-port", str(control), env=relay_env)
    await relay.wait_for(" started: ranks=")
    return controller, relay, data, control


def run_cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=60)


def salt_bytes() -> bytes:
    return bytes.fromhex(SALT_HEX)


@pytest.mark.deadline(60)
async def test_a_rank_still_in_its_control_block_when_the_run_ends_leaves_it_normally():
    """The run ends once every rank finished: the controller daemon exits and the
    relay closes the ranks' control connections. A rank that is still inside its
    control block then (saving its model, say) was told the run is over first: its
    heartbeats stop, and the connection closing is the end, not CoordinatorLost."""
    async with trio.open_nursery() as nursery:
        controller, relay, data, control = await start_two_rank_host(nursery)
        over: dict[int, bool] = {}

        async def rank_main(rank: int) -> None:
            async with connect_control_client((LOOP, control), rank, 2, salt_bytes(), SIG) as coordinator:
                async with connect_reduce_client((LOOP, data), rank, 2, salt_bytes()) as client:
                    params = [torch.full((3,), float(rank))]
                    await client.join(params, [])
                    for _ in range(2):
                        await average_window(client, params, [], 1, rank=rank, world_size=2, in_place=True)
                # Finished (the block said so). The run ends while this rank lingers here.
                with trio.fail_after(20):
                    await controller.process.wait()
                    await relay.process.wait()
                await trio.sleep(0.2)
                over[rank] = coordinator.run_over

        async with trio.open_nursery() as ranks:
            for rank in range(2):
                ranks.start_soon(rank_main, rank)
        assert controller.process.returncode == 0 and relay.process.returncode == 0, controller.text + relay.text
    assert over == {0: True, 1: True}


@pytest.mark.deadline(60)
async def test_a_rank_whose_neighbour_starts_late_is_kept_alive_by_its_relay_daemon():
    """Rank 0 of a two-rank host connects alone and waits longer than its beacon
    timeout for rank 1: the host's control relay joins the coordinator only once
    both are in, so the beacons rank 0 hears meanwhile are the relay daemon's own,
    at its pace (FLODL_NET_TIMEOUT_SCALE=0.1: a 3 s heartbeat timeout). Rank 1 then
    comes and both average; neither raises CoordinatorLost."""
    rank_timeout = 2.0  # rank 0 waits up to this for each beacon: far less than the wait for rank 1
    async with trio.open_nursery() as nursery:
        controller, relay, data, control = await start_two_rank_host(nursery, {"FLODL_NET_TIMEOUT_SCALE": "0.1"})
        rank_1_may_start = trio.Event()
        means: dict[int, list[float]] = {}
        paces: list[int] = []

        async def rank_main(rank: int) -> None:
            if rank == 1:
                await rank_1_may_start.wait()
            async with connect_control_client((LOOP, control), rank, 2, salt_bytes(), SIG,
                                              heartbeat_timeout=rank_timeout) as coordinator:
                if rank == 0:
                    start = trio.current_time()
                    while coordinator.last_beacon is None or trio.current_time() - start < 2.5 * rank_timeout:
                        await trio.sleep(0.1)
                    paces.append(coordinator.last_beacon.heartbeat_timeout_ms)
                    rank_1_may_start.set()
                async with connect_reduce_client((LOOP, data), rank, 2, salt_bytes()) as client:
                    params = [torch.full((3,), float(rank))]
                    await client.join(params, [])
                    await average_window(client, params, [], 1, rank=rank, world_size=2, in_place=True)
                    means[rank] = params[0].tolist()

        async with trio.open_nursery() as ranks:
            for rank in range(2):
                ranks.start_soon(rank_main, rank)
        with trio.fail_after(20):
            await controller.process.wait()
            await relay.process.wait()
    assert paces == [3000]  # the relay daemon's beacons: FLODL_NET_TIMEOUT_SCALE=0.1 of 30 s
    assert means == {0: [0.5] * 3, 1: [0.5] * 3}
    assert controller.process.returncode == 0 and relay.process.returncode == 0, controller.text + relay.text


@pytest.mark.deadline(90)
async def test_full_cluster_of_daemons_with_every_flag(tmp_path):
    ctl_port, metrics_port, relay_metrics, d0, c0, d1, c1 = free_ports(7)
    salt_file = tmp_path / "salt"
    salt_file.write_text(SALT_HEX + "\n")
    ckpt = tmp_path / "ckpt"
    async with trio.open_nursery() as nursery:
        controller = await start_daemon(
            nursery, "flodl_trio.controller",
            "--host", LOOP, "--port", str(ctl_port), "--world-size", "4", "--heartbeat-timeout", "3",
            "--outer", "diloco", "--outer-lr", "0.5", "--outer-momentum", "0.8",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--checkpoint-keep", "2",
            "--salt-file", str(salt_file), "--frame-ceiling", str(1 << 20),
            "--metrics-port", str(metrics_port), "--metrics-host", LOOP, "--log-level", "INFO", "--log-format", "json",
            env={"FLODL_SALT_HEX": ""},
        )
        await controller.wait_for("controller started")
        relays = [
            await start_daemon(
                nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks", "0,1",
                "--world-size", "4", "--host-name", "alpha", "--channels", "data,control", "--listen-host", LOOP,
                "--data-port", str(d0), "--control-port", str(c0), "--metrics-port", str(relay_metrics),
                "--log-format", "logfmt", "--frame-ceiling", str(1 << 20), "--log-level", "DEBUG",
            ),
            # the second relay takes everything from the environment
            await start_daemon(
                nursery, "flodl_trio.relay",
                env={"FLODL_CONTROLLER": f"{LOOP}:{ctl_port}", "FLODL_RANKS": "2-3", "FLODL_WORLD_SIZE": "4",
                     "FLODL_HOST_NAME": "beta", "FLODL_DATA_PORT": str(d1), "FLODL_CONTROL_PORT": str(c1)},
            ),
        ]
        for relay in relays:
            await relay.wait_for(" started: ranks=")
        assert "data=127.0.0.1:%d" % d0 in relays[0].text and "control=127.0.0.1:%d" % c0 in relays[0].text

        ports = {0: (d0, c0), 1: (d0, c0), 2: (d1, c1), 3: (d1, c1)}
        received: dict[int, list[float]] = {}

        async def rank_main(rank: int) -> None:
            data, control = ports[rank]
            async with connect_control_client((LOOP, control), rank, 4, salt_bytes(), SIG):
                async with connect_reduce_client((LOOP, data), rank, 4, salt_bytes()) as client:
                    values = []
                    for window in range(3):
                        p = torch.full((3,), float(rank + 1) * (window + 1))
                        result = await average_window(client, [p], [], 1, rank=rank, world_size=4)
                        values.append(result.params[0][0].item())
                    received[rank] = values
                    # the metrics endpoints answer while the cluster runs
                    if rank == 0:
                        received[-1] = [await scrape(metrics_port), await scrape(relay_metrics)]

        async with trio.open_nursery() as ranks:
            for rank in range(4):
                ranks.start_soon(rank_main, rank)

        # every daemon exits 0 on its own once the ranks are done
        for daemon in (controller, *relays):
            with trio.fail_after(20):
                assert await daemon.process.wait() == 0, daemon.text

    # the outer optimizer ran with the flags' settings: compare with the same optimizer in-process
    outer = DiLoCoNesterov(lr=0.5, momentum=0.8)
    expected = []
    for window in range(3):
        mean = np.full(3, sum((r + 1) * (window + 1) for r in range(4)) / 4, np.float32)
        out = outer(RoundFrame([TensorPayload(0, (3,), mean)], RoundKind.MODEL, 4.0))
        expected.append(float(np.frombuffer(out.tensors[0].data, np.float32)[0]))
    for rank in range(4):
        assert received[rank] == pytest.approx(expected, rel=1e-6), rank

    controller_metrics, relay_metrics_text = received[-1]
    assert "flodl_controller_rounds_total" in controller_metrics and "flodl_controller_round_seconds_bucket" in controller_metrics
    assert 'flodl_relay_bytes_total{channel="data",direction="up",host="alpha"}' in relay_metrics_text
    # structured logs: JSON lines from the controller, logfmt (with DEBUG) from relay alpha
    lines = [json.loads(line) for line in controller.text.splitlines() if line.startswith("{")]
    assert any(l["msg"].startswith("controller finished: ") for l in lines), controller.text
    assert all({"ts", "level", "logger", "msg"} <= set(l) for l in lines)
    assert any(line.startswith("ts=") and "level=info" in line for line in relays[0].text.splitlines())
    assert "relay beta started" in relays[1].text
    # checkpoints: --checkpoint-keep 2 keeps the newest two windows
    files = sorted(ckpt.glob("*.safetensors"))
    assert len(files) == 2, files
    latest = load_checkpoint(files[-1])
    assert latest.params[0][0] == pytest.approx(expected[-1], rel=1e-6)


async def scrape(port: int) -> str:
    stream = await trio.open_tcp_stream(LOOP, port)
    await stream.send_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data.decode()


@pytest.mark.deadline(40)
async def test_sigterm_and_sigint_stop_cleanly_without_traceback():
    async with trio.open_nursery() as nursery:
        controller, relay, _port = await start_pair(nursery, 2, "0", controller_args=("--keep-serving",))
        await controller.wait_for("controller started")
        await relay.wait_for(" started: ranks=")
        # One after the other: signalled together, the controller may be gone before
        # the relay handles its signal, and a relay whose controller left is an error.
        relay.process.send_signal(signal.SIGINT)
        with trio.fail_after(15):
            assert await relay.process.wait() == 0
        controller.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            assert await controller.process.wait() == 0
    assert "stopped by SIGTERM" in controller.text and "stopped by SIGINT" in relay.text
    assert "Traceback" not in controller.text + relay.text


@pytest.mark.deadline(40)
async def test_keep_serving_outlives_the_ranks():
    async with trio.open_nursery() as nursery:
        controller, relay, data_port = await start_pair(nursery, 1, "0", controller_args=("--keep-serving",))
        await relay.wait_for(" started: ranks=")
        async with connect_reduce_client((LOOP, data_port), 0, 1, salt_bytes()) as client:
            assert (await client.all_reduce_tensors([torch.ones(2)]))[0].tolist() == [1.0, 1.0]
        await controller.wait_for("controller finished")
        with trio.fail_after(15):
            assert await relay.process.wait() == 0
        await trio.sleep(0.5)
        assert controller.process.returncode is None  # still serving
        controller.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            assert await controller.process.wait() == 0


@pytest.mark.deadline(40)
async def test_frame_ceiling_refuses_an_oversize_frame():
    async with trio.open_nursery() as nursery:
        _controller, relay, data_port = await start_pair(nursery, 2, "0,1", relay_args=("--frame-ceiling", "4096"))
        await relay.wait_for(" started: ranks=")
        outcome = {}

        async def rank_main(rank: int, numel: int) -> None:
            async with connect_reduce_client((LOOP, data_port), rank, 2, salt_bytes()) as client:
                try:
                    outcome[rank] = (await client.all_reduce_tensors([torch.ones(numel)]))[0].shape[0]
                except Exception as exc:
                    outcome[rank] = exc

        async with trio.open_nursery() as ranks:
            ranks.start_soon(rank_main, 0, 4)
            ranks.start_soon(rank_main, 1, 100_000)  # 400 KB frame > 4096-byte ceiling
        await relay.wait_for("exceeds the frame ceiling 4096")
    assert outcome[0] == 4  # the survivor's round completed without the oversize rank
    assert isinstance(outcome[1], Exception) and "closed the connection" in str(outcome[1])


def test_help_documents_every_flag_and_its_environment_variable():
    for module in ("flodl_trio.controller", "flodl_trio.relay"):
        result = run_cli(module, "--help")
        assert result.returncode == 0
        options = [word for word in result.stdout.split() if word.startswith("--") and word != "--help"]
        assert len(options) >= 10, result.stdout
        flat = " ".join(result.stdout.split())
        for env in ("FLODL_LOG_LEVEL", "FLODL_METRICS_PORT", "FLODL_FRAME_CEILING", "FLODL_SALT_FILE", "FLODL_SALT_HEX"):
            assert env in flat, (module, env)


def test_configuration_errors_exit_2_with_one_clear_line(tmp_path):
    no_salt = run_cli("flodl_trio.controller", "--world-size", "2")
    assert no_salt.returncode == 2 and "no session salt" in no_salt.stderr and "Traceback" not in no_salt.stderr
    bad_salt = run_cli("flodl_trio.controller", "--world-size", "2", env={"FLODL_SALT_HEX": "abc"})
    assert bad_salt.returncode == 2 and "32 characters" in bad_salt.stderr
    no_world = run_cli("flodl_trio.controller", env={"FLODL_SALT_HEX": SALT_HEX})
    assert no_world.returncode == 2 and "--world-size" in no_world.stderr
    bad_ranks = run_cli("flodl_trio.relay", "--ranks", "0,x", "--world-size", "2", env={"FLODL_SALT_HEX": SALT_HEX})
    assert bad_ranks.returncode == 2 and "rank list" in bad_ranks.stderr
    outside = run_cli("flodl_trio.relay", "--ranks", "0-2", "--world-size", "2", env={"FLODL_SALT_HEX": SALT_HEX})
    assert outside.returncode == 2 and "outside world_size 2" in outside.stderr
    channels = run_cli("flodl_trio.relay", "--ranks", "0", "--world-size", "1", "--channels", "video", env={"FLODL_SALT_HEX": SALT_HEX})
    assert channels.returncode == 2 and "--channels" in channels.stderr
    missing_file = run_cli("flodl_trio.relay", "--ranks", "0", "--world-size", "1", "--salt-file", str(tmp_path / "nope"))
    assert missing_file.returncode == 2 and "cannot read the salt file" in missing_file.stderr
    salt = {"FLODL_SALT_HEX": SALT_HEX}
    no_formation = run_cli("flodl_trio.controller", "--world-size", "4", "--min-ranks", "3", env=salt)
    assert no_formation.returncode == 2 and "needs a formation_timeout" in no_formation.stderr
    no_rejoin = run_cli("flodl_trio.controller", "--world-size", "4", env={**salt, "FLODL_MIN_RANKS": "3",
                        "FLODL_FORMATION_TIMEOUT": "5", "FLODL_REJOIN_TIMEOUT": "0"})
    assert no_rejoin.returncode == 2 and "needs rejoin_timeout > 0" in no_rejoin.stderr
    bad_rejoin = run_cli("flodl_trio.controller", "--world-size", "4", "--rejoin-timeout", "nan", env=salt)
    assert bad_rejoin.returncode == 2 and "--rejoin-timeout must be" in bad_rejoin.stderr


@pytest.mark.deadline(40)
async def test_unreachable_controller_is_a_clear_failure(tmp_path):
    ctl_port, data_port = free_ports(2)  # no controller on ctl_port
    async with trio.open_nursery() as nursery:
        relay = await start_daemon(nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks", "0",
                                   "--world-size", "1", "--channels", "data", "--data-port", str(data_port),
                                   env={"FLODL_NET_TIMEOUT_SCALE": "0.1"})
        await relay.wait_for(" started: ranks=")
        with pytest.raises(Exception):
            async with connect_reduce_client((LOOP, data_port), 0, 1, salt_bytes()) as client:
                await client.all_reduce_tensors([torch.ones(1)])
        with trio.fail_after(20):
            assert await relay.process.wait() == 1
    assert f"connect to {LOOP}:{ctl_port} failed after 60 attempts" in relay.text
    assert "Traceback" not in relay.text


async def _three_rounds_of_ranks(*ports: int) -> dict[tuple[int, int], list[float]]:
    """Rank i on the relay at ``ports[i]``, 3 rounds of 1.2 MB frames (3 lanes at 256 KiB
    a lane); (rank, round) -> the distinct values of its consensus."""
    got: dict[tuple[int, int], list[float]] = {}

    async def rank_main(rank: int, port: int) -> None:
        async with connect_reduce_client((LOOP, port), rank, len(ports), salt_bytes()) as client:
            for k in range(3):
                out = await client.all_reduce_tensors([torch.full((300_000,), float(rank + 10 * k))])
                got[rank, k] = sorted(set(out[0].tolist()))

    async with trio.open_nursery() as ranks:
        for rank, port in enumerate(ports):
            ranks.start_soon(rank_main, rank, port)
    return got


async def _three_exact_rounds_then_clean_exits(ports: list[int], daemons: list) -> None:
    """Three rounds of a rank on each relay are exact, and then every daemon exits 0."""
    got = await _three_rounds_of_ranks(*ports)
    with trio.fail_after(20):
        for daemon in daemons:
            await daemon.process.wait()
    mean = (len(ports) - 1) / 2
    assert all(got[rank, k] == [mean + 10 * k] for rank in range(len(ports)) for k in range(3)), got
    assert [d.process.returncode for d in daemons] == [0] * len(daemons), [d.text[-2000:] for d in daemons]


@pytest.mark.deadline(60)
async def test_shard_daemons_reduce_a_controller_daemons_lanes_and_exit_with_it():
    """Two ``python -m flodl_trio.shard`` processes named by a controller daemon's --shards:
    two hosts' rounds of 3 lanes are exact, and the shards exit 0 once the controller
    closes (every rank finished)."""
    ctl_port, shard_a, shard_b, data0, data1 = free_ports(5)
    async with trio.open_nursery() as nursery:
        shards = [await start_daemon(nursery, "flodl_trio.shard", "--host", LOOP, "--port", str(port),
                                     "--log-level", "INFO") for port in (shard_a, shard_b)]
        for shard in shards:
            await shard.wait_for("shard started")
        controller = await start_daemon(
            nursery, "flodl_trio.controller", "--host", LOOP, "--port", str(ctl_port), "--world-size", "2",
            "--lanes", "3", "--rejoin-timeout", "0", "--shards", f"{LOOP}:{shard_a},{LOOP}:{shard_b}",
        )  # 1.2 MB frames: 3 lanes at 256 KiB a lane
        relays = [await start_daemon(nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks",
                                     str(rank), "--world-size", "2", "--host-name", f"h{rank}", "--channels", "data",
                                     "--data-port", str(port)) for rank, port in ((0, data0), (1, data1))]
        got = await _three_rounds_of_ranks(data0, data1)
        with trio.fail_after(20):
            for daemon in (controller, *relays, *shards):
                await daemon.process.wait()
    assert all(got[rank, k] == [0.5 + 10 * k] for rank in (0, 1) for k in range(3))
    assert [d.process.returncode for d in (controller, *relays, *shards)] == [0, 0, 0, 0, 0], [
        d.text[-2000:] for d in (controller, *relays, *shards)
    ]
    assert "shard finished: 3 rounds" in shards[0].text


@pytest.mark.deadline(60)
async def test_relay_daemons_serving_the_shards_reduce_and_exit_with_the_controller():
    """Each relay daemon also serves a shard (``--shard``), named in the controller
    daemon's --shards: one process a host, rounds exact, every daemon exits 0."""
    ctl_port, shard_a, shard_b, data0, data1 = free_ports(5)
    async with trio.open_nursery() as nursery:
        controller = await start_daemon(
            nursery, "flodl_trio.controller", "--host", LOOP, "--port", str(ctl_port), "--world-size", "2",
            "--lanes", "3", "--rejoin-timeout", "0", "--shards", f"{LOOP}:{shard_a},{LOOP}:{shard_b}",
        )  # it dials the shards until the relays serve them
        relays = [await start_daemon(nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks",
                                     str(rank), "--world-size", "2", "--host-name", f"h{rank}", "--channels", "data",
                                     "--data-port", str(port), "--shard", f"{LOOP}:{shard}", "--log-level", "INFO")
                  for rank, port, shard in ((0, data0, shard_a), (1, data1, shard_b))]
        for relay, shard in zip(relays, (shard_a, shard_b)):
            await relay.wait_for(f"shard started: listening on {LOOP}:{shard}")
        await _three_exact_rounds_then_clean_exits([data0, data1], [controller, *relays])
    assert "shard finished: 3 rounds" in relays[0].text


@pytest.mark.deadline(60)
@pytest.mark.parametrize(("hosts", "controller_flags", "relay_b_flags", "sharded", "relay_log"), [
    (3, (), (), True, "INFO"),  # the defaults: each relay serves and offers a shard, the controller takes them
    (2, (), (), False, "INFO"),  # two hosts: the star (a shard's link would carry what the controller's does)
    (3, (), (), True, "WARNING"),  # quiet relays: the child shard's port does not depend on its log level
    (3, ("--outer", "diloco"), (), True, "INFO"),  # the shards step a built-in outer optimizer: still used
    (3, ("--shards", "off"), (), False, "INFO"),  # a star, whatever the relays offer
    (3, ("--shards", "1"), (), False, "INFO"),  # one reducer, the controller: the star too
    (3, (), ("--shard", "off"), False, "INFO"),  # one relay offers none: nothing is fixed
    # checkpoints go through the shards, and so does a run with a resume record (the
    # checkpoint directory's, kept unless nobody holds for a lost controller)
    (3, ("--outer", "diloco", "--checkpoint-dir", "{tmp}", "--controller-outage", "0"), (), True, "INFO"),
    (3, ("--checkpoint-dir", "{tmp}"), (), True, "INFO"),
], ids=["defaults", "two-hosts", "quiet-relays", "outer", "controller-off", "controller-one", "one-relay-off",
        "checkpoints", "resume-record"])
async def test_shards_by_default_and_both_ways_to_turn_them_off(hosts, controller_flags, relay_b_flags, sharded,
                                                                 relay_log, tmp_path):
    """One rank a host: rounds exact and every daemon exits 0 in each case; the
    controller's log says whether it took the relays' shards, and a relay's shard that
    was used says so."""
    controller_flags = [flag.replace("{tmp}", str(tmp_path)) for flag in controller_flags]
    ctl_port, *ports = free_ports(1 + hosts)
    async with trio.open_nursery() as nursery:
        controller = await start_daemon(
            nursery, "flodl_trio.controller", "--host", LOOP, "--port", str(ctl_port), "--world-size", str(hosts),
            "--lanes", "3", *controller_flags,
        )
        await controller.wait_for("controller started")
        relays = [await start_daemon(nursery, "flodl_trio.relay", "--controller", f"{LOOP}:{ctl_port}", "--ranks",
                                     str(rank), "--world-size", str(hosts), "--host-name", f"h{rank}", "--channels",
                                     "data", "--data-port", str(port), "--log-level", relay_log,
                                     *(relay_b_flags if rank == 1 else ()))
                  for rank, port in enumerate(ports)]
        if relay_log == "INFO":  # (quiet relays say nothing: the ranks' connects retry until they listen)
            for relay in relays:
                await relay.wait_for(" started: ranks=")
        await _three_exact_rounds_then_clean_exits(ports, [controller, *relays])
    assert ("reducing with the 3 shards the relays offered" in controller.text) == sharded, controller.text
    if "--checkpoint-dir" in controller_flags:
        assert f"resume_record={'off' if '--controller-outage' in controller_flags else 'on'}" in controller.text
    if relay_log == "INFO":
        assert ("shard finished: 2 rounds" in relays[0].text) == sharded, relays[0].text  # rounds 1 and 2
