"""torchrun's own answer to a failing worker - stop the node's workers and start
them again (``--max-restarts``) - works against the two daemons.

Real processes end to end: the controller and relay daemons as an operator
starts them (plus ``--rejoin-timeout``), and ``python -m torch.distributed.run
--nproc-per-node 2 --max-restarts 1`` running a trainer that calls ``join``.
Rank 1 raises at window 3 of its first attempt; torchrun stops rank 0 and
starts both again; they rejoin from the consensus and finish the run; every
process exits 0. Rank 0's first attempt parks after window 3 until torchrun
stops it, so the restart always lands mid-run however slowly torchrun reacts
(alone, rank 0 would otherwise race through the remaining windows). In the
second attempt each rank waits, before it joins, for the other's ready file, so
neither trains alone through the run while the other is still starting.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys

import pytest
import trio

from tests.daemon.test_daemons import LOOP, SALT_HEX, free_ports, start_daemon

WINDOWS = 10
FAIL_AT = 3

TRAINER = f"""\
import json, os, sys
from pathlib import Path

import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.client import connect_control_client
from flodl_trio import load_salt, rank_from_env

WINDOWS, FAIL_AT = {WINDOWS}, {FAIL_AT}


async def main():
    me = rank_from_env()
    salt = load_salt(None)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    params, buffers = [torch.zeros(64)], [torch.zeros(2)]
    out_dir = Path(sys.argv[1])
    async with connect_control_client(me.control_relay, me.rank, me.world_size, salt, b"\\x11" * 32):
        async with connect_reduce_client(me.data_relay, me.rank, me.world_size, salt) as client:
            if attempt == 1:  # both restarted workers are up before either joins
                (out_dir / f"ready-{{me.rank}}").touch()
                with trio.fail_after(60):
                    while not all((out_dir / f"ready-{{r}}").exists() for r in range(me.world_size)):
                        await trio.sleep(0.02)
            start = await client.join(params, buffers)
            print(json.dumps({{"rank": me.rank, "attempt": attempt, "start": start}}), flush=True)
            for window in range(start, WINDOWS):
                if me.rank == 1 and attempt == 0 and window == FAIL_AT:
                    raise RuntimeError("rank 1 fails on purpose")
                if me.rank == 0 and attempt == 0 and window == FAIL_AT + 1:
                    await trio.sleep_forever()  # until torchrun stops this attempt
                await trio.sleep(0.2)  # "inner steps"
                with torch.no_grad():
                    gen = torch.Generator().manual_seed(1000 * me.rank + window)
                    params[0].add_(torch.randn(64, generator=gen))
                    buffers[0].add_(1.0 + me.rank)
                await average_window(client, params, buffers, 1 + me.rank, rank=me.rank,
                                     world_size=me.world_size, in_place=True)
    out = out_dir / f"rank-{{me.rank}}-attempt-{{attempt}}.json"
    out.write_text(json.dumps({{"start": start, "params": params[0].tolist(), "buffers": buffers[0].tolist()}}))


trio.run(main)
"""


def port_with_free_relay_ports() -> int:
    """A free controller port whose relay ports (+4 data, +5 control, the daemons' defaults
    this test relies on) are free too when it is picked."""
    for _ in range(100):
        (port,) = free_ports(1)
        try:
            with socket.socket() as data, socket.socket() as control:
                data.bind((LOOP, port + 4))
                control.bind((LOOP, port + 5))
        except OSError:
            continue
        return port
    raise RuntimeError("no free controller port with free +4 and +5 ports")


@pytest.mark.deadline(150)
async def test_torchrun_max_restarts_brings_a_failed_node_back_and_the_run_completes(tmp_path):
    train_py, out = tmp_path / "train.py", tmp_path / "out"
    train_py.write_text(TRAINER)
    out.mkdir()
    ctl_port, master_port = port_with_free_relay_ports(), free_ports(1)[0]
    env = {
        **os.environ, "FLODL_SALT_HEX": SALT_HEX, "FLODL_CONTROLLER": f"{LOOP}:{ctl_port}",
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    async with trio.open_nursery() as nursery:
        controller = await start_daemon(
            nursery, "flodl_trio.controller", "--host", LOOP, "--port", str(ctl_port), "--world-size", "2",
            "--rejoin-timeout", "60", "--heartbeat-timeout", "10", "--log-level", "INFO",
        )
        await controller.wait_for("controller started")
        relay = await start_daemon(
            nursery, "flodl_trio.relay", "--ranks", "0,1", "--world-size", "2", "--host-name", "node0",
            "--listen-host", LOOP, "--log-level", "INFO", env={"FLODL_CONTROLLER": f"{LOOP}:{ctl_port}"},
        )
        await relay.wait_for("relay node0 started")
        torchrun = await trio.run_process(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
             "--monitor-interval", "0.2", "--master-addr", LOOP, "--master-port", str(master_port),
             str(train_py), str(out)],
            env=env, capture_stdout=True, capture_stderr=True, check=False, cwd=tmp_path,
        )
        log = torchrun.stdout.decode() + torchrun.stderr.decode()
        assert torchrun.returncode == 0, f"{log}\n--- relay ---\n{relay.text}\n--- controller ---\n{controller.text}"
        with trio.fail_after(30):
            assert await relay.process.wait() == 0, relay.text
            assert await controller.process.wait() == 0, controller.text

    # Two workers share torchrun's stdout: find the records wherever a line break fell.
    starts = [json.loads(m) for m in re.findall(r'\{"rank": \d+, "attempt": \d+, "start": \d+\}', torchrun.stdout.decode())]
    assert sorted((s["rank"], s["attempt"]) for s in starts) == [(0, 0), (0, 1), (1, 0), (1, 1)], log
    restarted = {s["rank"]: s["start"] for s in starts if s["attempt"] == 1}
    assert all(FAIL_AT <= start < WINDOWS for start in restarted.values()), restarted  # from the consensus, not 0
    finals = {rank: json.loads((out / f"rank-{rank}-attempt-1.json").read_text()) for rank in (0, 1)}
    assert finals[0] == {**finals[1], "start": finals[0]["start"]}, "both ranks end on one consensus"
    assert not (out / "rank-1-attempt-0.json").exists()
    assert "rejoins" in controller.text and "restarting at window" in controller.text, controller.text
    assert "staying up for ranks [0, 1]" in relay.text, relay.text
    assert "controller finished" in controller.text

