"""torchrun-launched trainers hold through a controller SIGKILLed and started again.

Two ``torchrun`` launches (one per host, 2 workers each, a static two-node
rendezvous as docs/operations.md launches them) run a small Local SGD trainer
against the relay and controller daemons; the controller (``--checkpoint-dir``,
so it tells everyone to hold for it) is SIGKILLed once every rank finished
window 2 and started again with its first command line. torchrun restarts
nothing (``--max-restarts 0``): every worker finishes every window on the same
params, and each window's consensus is the exact mean.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import trio

from flodl_trio.testing import open_process_cluster
from flodl_trio.testing.matrix import diagnose

SALT = b"restart-torchrun"
WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 8
NUMEL = 64

TRAINER = """\
import json, os
from pathlib import Path

import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.client import connect_control_client
from flodl_trio.daemon.launch import rank_from_env
from flodl_trio.transport.settings import load_salt

WINDOWS, NUMEL = int(os.environ["TRAIN_WINDOWS"]), int(os.environ["TRAIN_NUMEL"])


async def main() -> None:
    me = rank_from_env()
    salt = load_salt()
    data = ("127.0.0.1", int(os.environ["TRAIN_DATA_PORT"]))
    control = ("127.0.0.1", int(os.environ["TRAIN_CONTROL_PORT"]))
    params, buffers = [torch.zeros(NUMEL)], [torch.zeros(2)]
    log = Path(os.environ["TRAIN_OUT"]) / f"rank-{me.rank}.jsonl"
    async with connect_control_client(control, me.rank, me.world_size, salt, b"\\x11" * 32):
        async with connect_reduce_client(data, me.rank, me.world_size, salt) as client:
            for window in range(WINDOWS):
                params[0].add_(float(me.rank + 1) * (window + 1))
                await trio.sleep(0.05)
                result = await average_window(
                    client, params, buffers, 1, rank=me.rank, world_size=me.world_size, in_place=True
                )
                with log.open("a") as f:
                    f.write(json.dumps({"window": window, "params": params[0].tolist(), "counts": result.counts}) + "\\n")


trio.run(main)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def windows_done(out: Path) -> dict[int, list[dict]]:
    done = {}
    for rank in range(WORLD):
        path = out / f"rank-{rank}.jsonl"
        done[rank] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return done


@pytest.mark.trio
@pytest.mark.deadline(150)
async def test_torchrun_trainers_hold_through_a_controller_restart_and_every_window_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    master_port = free_port()
    with trio.fail_after(140):
        async with open_process_cluster(
            world_size=WORLD, hosts=HOSTS, salt=SALT, control=True, heartbeat_timeout=10.0, daemons=True,
            external_ranks=range(WORLD), controller_args=["--checkpoint-dir", str(tmp_path / "ckpt")],
        ) as cluster:
            with diagnose(cluster):
                torchruns = []
                async with trio.open_nursery() as nursery:
                    for node, ranks in enumerate(HOSTS):
                        env = {
                            **os.environ, "FLODL_SALT_HEX": cluster.salt.hex(), "TRAIN_WINDOWS": str(WINDOWS),
                            "TRAIN_NUMEL": str(NUMEL), "TRAIN_OUT": str(out),
                            "TRAIN_DATA_PORT": str(cluster.data_ports[node]),
                            "TRAIN_CONTROL_PORT": str(cluster.control_ports[node]),
                        }
                        env.pop("FLODL_CONTROLLER_OUTAGE", None)  # the controller says how long to hold
                        argv = [
                            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                            "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                            "--max-restarts", "0", str(script),
                        ]
                        torchruns.append(await nursery.start(partial(trio.run_process, argv, env=env)))
                    while not all(len(w) >= 3 for w in windows_done(out).values()):
                        await trio.sleep(0.05)  # every rank finished window 2
                    cluster.kill_controller()
                    await cluster.controller.wait()
                    await cluster.restart_controller()
                for proc in torchruns:
                    assert proc.returncode == 0, proc
    assert "resuming the run from" in cluster.controller.text
    done = windows_done(out)
    for window in range(WINDOWS):
        records = [done[rank][window] for rank in range(WORLD)]
        assert all(r["window"] == window and r["counts"] == [1.0] * WORLD for r in records), records
        assert all(r["params"] == records[0]["params"] for r in records), window
    # Each window every rank adds (rank + 1) * (window + 1) to the consensus before; the mean adds 2.5 (window + 1).
    want = np.cumsum([2.5 * (w + 1) for w in range(WINDOWS)])
    got = [done[0][w]["params"][0] for w in range(WINDOWS)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
