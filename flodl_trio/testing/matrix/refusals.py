"""Cases: connections that must be refused - wrong salts, duplicate and misplaced ranks,
a world size that disagrees, two handshakes racing for one rank, nothing to connect to."""

from __future__ import annotations

import re
import socket
from collections.abc import Awaitable, Callable

import trio

from ...client import connect_control_client, connect_reduce_client
from ...errors import ConnectFailed, FlodlError, FramingError
from ...wire.handshake import DATA_ACK_LEN, encode_data_handshake
from ...wire.salt import SessionSalt
from ..processes import ChildProcess, ProcessCluster
from .clusters import OTHER_SALT, SALT, SIGNATURE, daemon_cluster, diagnose
from .hostile import Address
from .oracle import everyone, expect_consensus, expect_error, last_outcome, mono
from .registry import MatrixFailure, Outcome, case


@case("wrong-salt-data", fault="a rank with the wrong session salt on its data connection (TCP)", leg="rank -> relay (data)")
async def wrong_salt_data() -> Outcome:
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={1: ["--data-salt", OTHER_SALT.hex(), "--tcp"]},
    ) as c:
        with diagnose(c):
            sending = await c.wait_event(1, "sending", round=0)
            rounds = await expect_consensus(c, [0, 2], 2, lambda _k: {0, 2})
            error = await expect_error(c, 1, before_round=0, contributors=everyone(3))
            await c.relay_processes(0)[0].wait_log(re.compile(r"rank 1 dropped: RoundFrame from rank 1 .*MAC mismatch"))
            seconds = last_outcome(rounds, 0, error["time"]) - sending["time"]
    return Outcome(f"its first frame failed the MAC at the relay: dropped, raised {error['type']}; ranks 0,2 correct", seconds)


@case("wrong-salt-local-leg", fault="a rank with the wrong session salt on the Unix-socket local leg",
      leg="rank -> relay (local leg)")
async def wrong_salt_local_leg() -> Outcome:
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=2,
        worker_args={1: ["--data-salt", OTHER_SALT.hex(), "--connect-attempts", "1"]},
    ) as c:
        with diagnose(c):
            t0 = mono()
            error = await expect_error(
                c, 1, before_round=0, contributors=everyone(3), types=("FramingError",),
                fragments=("another session salt (local leg)",),
            )
            rounds = await expect_consensus(c, [0, 2], 2, lambda _k: {0, 2})
            await c.relay_processes(0)[0].wait_log(re.compile(r"refused .*local-leg handshake of rank 1: MAC mismatch"))
            seconds = last_outcome(rounds, 0, error["time"]) - t0
    return Outcome(
        f"refused at the handshake (the salt is proven once there; frames go unsigned): raised {error['type']}; "
        "ranks 0,2 correct", seconds,
    )


# ---------------------------------------------------------------------------
# Imposters beside a running cluster
# ---------------------------------------------------------------------------


async def _imposter(
    attempt: Callable[[], Awaitable[object]], log: ChildProcess, log_line: str,
    fragment: str = "closed the connection before the handshake ack",
) -> tuple[str, float]:
    """A refused connection attempt: its error (type and fragment) and the relay's log line."""
    t0 = mono()
    try:
        await attempt()
    except FlodlError as exc:
        seconds = mono() - t0
        if not isinstance(exc, FramingError) or fragment not in str(exc):
            raise MatrixFailure(f"imposter got {type(exc).__name__}: {exc}; want FramingError naming {fragment!r}") from exc
        kind = type(exc).__name__
    else:
        raise MatrixFailure("the imposter was accepted")
    await log.wait_log(log_line)
    return kind, seconds


async def _refused_rank(connect: Callable[[ProcessCluster], Awaitable[object]], log_line: str) -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=6, pause=0.2) as c:
        with diagnose(c):
            await c.wait_round(0, 0)
            kind, seconds = await _imposter(lambda: connect(c), c.relay_processes(0)[0], log_line)
            await expect_consensus(c, range(3), 6, everyone(3))
    return Outcome(f"refused ({kind} at the client; relay logged '{log_line}'); the cluster's rounds stayed correct", seconds)


async def _reduce_once(address: Address, rank: int, world: int, salt: SessionSalt) -> None:
    async with connect_reduce_client(address, rank, world, salt, connect_attempts=1) as client:
        await client.all_reduce_per_rank_f64([0.0] * world)


@case("wrong-salt-control", fault="a client with the wrong session salt on the control port", leg="rank -> relay (control)")
async def wrong_salt_control() -> Outcome:
    async def attempt(c: ProcessCluster) -> None:
        async with connect_control_client(c.control_address(0), 0, 3, OTHER_SALT, SIGNATURE, connect_attempts=1):
            await trio.sleep(1.0)

    return await _refused_rank(attempt, "control handshake of rank 0: MAC mismatch")


@case("duplicate-rank", fault="a second client claiming an already-joined rank", leg="rank -> relay (data)")
async def duplicate_rank() -> Outcome:
    return await _refused_rank(lambda c: _reduce_once(c.relay_address(0), 0, 3, SALT), "duplicate rank 0: already joined")


@case("rank-outside-host", fault="a client claiming a rank of another host", leg="rank -> relay (data)")
async def rank_outside_host() -> Outcome:
    return await _refused_rank(lambda c: _reduce_once(c.relay_address(0), 2, 3, SALT), "rank 2 is not in host host0's rank set")


@case("world-size-disagreement", fault="a client announcing world_size 5 to a world of 3", leg="rank -> relay (data)")
async def world_size_disagreement() -> Outcome:
    return await _refused_rank(
        lambda c: _reduce_once(c.relay_address(0), 0, 5, SALT), "announced world_size 5, this side was started with 3"
    )


# ---------------------------------------------------------------------------
# Two handshakes for one rank
# ---------------------------------------------------------------------------


async def acknowledged(stream: trio.SocketStream) -> bool:
    """Whether the relay answered this data handshake with a whole ack (within 10 s)."""
    got = b""
    with trio.move_on_after(10):
        while len(got) < DATA_ACK_LEN and (chunk := await stream.receive_some(DATA_ACK_LEN - len(got))):
            got += chunk
    return len(got) == DATA_ACK_LEN


@case("duplicate-handshake-race", fault="two clients claim the same rank at the same instant", leg="rank -> relay (data)")
async def duplicate_handshake_race() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, control=False, external_ranks={0}) as c:
        with diagnose(c):
            streams = [await trio.open_tcp_stream(*c.relay_address(0)) for _ in range(2)]
            t0 = mono()
            for stream in streams:  # both handshakes are in before either is answered
                await stream.send_all(encode_data_handshake(0, 3))
            acks = [await acknowledged(stream) for stream in streams]
            seconds = mono() - t0
            if sorted(acks) != [False, True]:
                raise MatrixFailure(f"acks {acks}: want exactly one of the two handshakes acknowledged")
            # "already connected" or, once the first joined the running channel, "already joined"
            await c.relay_processes(0)[0].wait_log("duplicate rank 0: already")
            for stream in streams:  # rank 0 leaves; the others go on without it
                await stream.aclose()
            await expect_consensus(c, [1, 2], 2, lambda _k: {1, 2})
    return Outcome("one acknowledged, the other refused (duplicate rank 0); ranks 1,2 went on", seconds)


# ---------------------------------------------------------------------------
# Connecting to nothing
# ---------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on (the OS's pick, released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _control_once(port: int) -> None:
    async with connect_control_client(("127.0.0.1", port), 0, 1, SALT, SIGNATURE, connect_attempts=3, connect_interval=0.05):
        pass


@case("connect-to-nothing", fault="nothing listens at the relay's address", leg="rank client (connect)")
async def connect_to_nothing() -> Outcome:
    port = free_port()
    want = f"connect to 127.0.0.1:{port} failed after 3 attempts"
    seconds = []
    for name, attempt in (
        ("data", lambda: connect_reduce_client(("127.0.0.1", port), 0, 1, SALT, connect_attempts=3, connect_interval=0.05)),
        ("control", lambda: _control_once(port)),
    ):
        t0 = mono()
        try:
            await attempt()
        except ConnectFailed as exc:
            seconds.append(mono() - t0)
            if want not in str(exc):
                raise MatrixFailure(f"{name} ConnectFailed does not name host, port and budget: {exc}") from exc
        else:
            raise MatrixFailure(f"{name} client connected to nothing")
    return Outcome("ConnectFailed after the 3-attempt budget naming 127.0.0.1:port (data and control clients)", max(seconds))
