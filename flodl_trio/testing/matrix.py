"""The fault matrix: one fault per case, one of two outcomes, never a hang.

Each case builds its own cluster (real daemon processes and rank processes
unless the case needs no cluster), injects exactly one fault and asserts one
of two outcomes for every rank:

(a) it receives the correct realized-work consensus for every round, checked
    against an independent computation (rank r contributes ``(r + 1) * (k + 1)``
    with mass 1 in round k, so the consensus of a set S is the plain mean over
    S with mass ``len(S)``), and finishes; or
(b) it raises a clear :class:`~flodl_trio.FlodlError`, checked by type and a
    message fragment (plus the daemon log line that names the fault).

A wrong or stale value is a failure whatever else happens, and every case runs
under ``trio.fail_after``. A case returns a :class:`CaseRecord`: the fault, the
leg it was injected on, the outcome in one line, and the time from injection
to that outcome (seconds, on ``time.monotonic()``, which is one clock for every
process of the machine).

Run one case with ``await run_case(case)``; ``MATRIX`` lists them all;
``benchmarks/fault_matrix.py`` runs the lot and writes docs/fault-matrix.md.
"""

from __future__ import annotations

import math
import random
import re
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import numpy as np
import trio

from ..client import connect_control_client, connect_reduce_client
from ..errors import ConnectFailed, FlodlError, FramingError
from ..wire.constants import (
    CHANNEL_MAGIC_CONTROL,
    CHANNEL_MAGIC_DATA,
    DTYPE_F32,
    MUX_MAGIC,
    MUX_VERSION,
)
from ..wire.control_frame import ControlFrame, ControlKind, encode_control_frame
from ..wire.handshake import (
    CONTROL_ACK_LEN,
    DATA_ACK_LEN,
    DATA_HANDSHAKE_LEN,
    encode_control_handshake,
    encode_data_handshake,
)
from ..wire.liveness import HEARTBEAT_TAG, heartbeat_frame
from ..wire.mux import Hello, MuxKind, encode_control_msg, encode_mux_record
from ..wire.round_frame import (
    FRAME_HEADER_LEN,
    RoundFrame,
    RoundKind,
    TensorPayload,
    encode_round_frame,
    schema_frame_len,
)
from ..wire.salt import SessionSalt
from ..wire.state import encode_state_request, new_nonce
from .processes import ChildProcess, Event, ProcessCluster, open_process_cluster
from .proxy import BandwidthCap, CutAt, Delay, DuplicateRecord, FlipBit, Stall
from .windows import WindowMismatch, check_final_and_joins, check_windows

SALT = SessionSalt(b"\x42" * 16)
OTHER_SALT = SessionSalt(b"\x24" * 16)
SIGNATURE = b"\x11" * 32  # rank_worker's default model signature
HEARTBEAT_TIMEOUT = 1.5  # heartbeat (and so beacon) timeout of the clusters that need one
SCALE = "0.1"  # FLODL_NET_TIMEOUT_SCALE where a socket bound is the point
BIG_NUMEL = 4_000_000  # 16 MB frames where size is the point
MiB = 1 << 20
# A daemon hit by a huge length must not grow by more than this.
MEMORY_SLACK = 64 * MiB
DEATH_TYPES = ("RankDeadError", "CoordinatorLost")
LOST = ("closed the connection", "connection failed", "declared dead", "no beacon")

# Where things sit on the wire (PROTOCOL.md): a RoundFrame of one 1-d f32 tensor is
# header 17 (magic 4, count 4, kind 1, weight 8) + dtype/ndim 2 + dim 4 + nbytes 8
# + payload + MAC 8.
FRAME_WEIGHT_LOW_BYTE = 9  # the lowest mantissa byte of the f64 weight
FRAME_PAYLOAD = 31
MUX_HEADER = 25
MUX_MAC = 17


def frame_len(numel: int) -> int:
    """A rank's RoundFrame of one 1-d f32 tensor of ``numel`` elements."""
    return schema_frame_len([(DTYPE_F32, (numel,))])


def rank_frame_start(round_index: int, numel: int = 4) -> int:
    """Offset of round ``round_index``'s RoundFrame on a rank's data connection (after its length prefix)."""
    return DATA_HANDSHAKE_LEN + round_index * (4 + frame_len(numel)) + 4


def uplink_first_record(host: str, ranks: Sequence[int]) -> int:
    """Offset of the first record after the Hello on a data relay's uplink."""
    return 4 + MUX_HEADER + len(encode_control_msg(Hello(host, tuple(ranks), ())))


# ---------------------------------------------------------------------------
# Records and cases
# ---------------------------------------------------------------------------


class MatrixFailure(AssertionError):
    """A case saw an outcome outside (a) and (b): a wrong value, a wrong error, a missing refusal."""


@attrs.frozen
class CaseRecord:
    name: str
    fault: str
    leg: str
    outcome: str
    seconds: float


@attrs.frozen
class Outcome:
    text: str
    seconds: float


@attrs.frozen
class Case:
    name: str
    fault: str
    leg: str
    func: Callable[[], Awaitable[Outcome]]
    deadline: float

    def __repr__(self) -> str:
        return f"Case({self.name})"


MATRIX: list[Case] = []


def case(name: str, *, fault: str, leg: str, deadline: float = 40.0) -> Callable[[Callable[[], Awaitable[Outcome]]], Callable[[], Awaitable[Outcome]]]:
    def register(func: Callable[[], Awaitable[Outcome]]) -> Callable[[], Awaitable[Outcome]]:
        MATRIX.append(Case(name, fault, leg, func, deadline))
        return func

    return register


async def run_case(entry: Case) -> CaseRecord:
    """Run one case under its deadline; a hang raises ``trio.TooSlowError``."""
    with trio.fail_after(entry.deadline):
        outcome = await entry.func()
    return CaseRecord(entry.name, entry.fault, entry.leg, outcome.text, outcome.seconds)


def case_by_name(name: str) -> Case:
    return next(c for c in MATRIX if c.name == name)


# ---------------------------------------------------------------------------
# Checking outcomes
# ---------------------------------------------------------------------------


def mono() -> float:
    return time.monotonic()


def trio_to_mono(t: float) -> float:
    """A trio clock reading (FaultEvent.time) on the ``time.monotonic()`` clock."""
    return t + (time.monotonic() - trio.current_time())


def expected(contributors: Iterable[int], round_index: int) -> tuple[float, float]:
    """The consensus value and mass of a round, computed from scratch (not via the library)."""
    values = [float((r + 1) * (round_index + 1)) for r in contributors]
    assert values, "a round with no contributors has no consensus"
    return math.fsum(values) / len(values), float(len(values))


def check_round(event: Event, contributors: Iterable[int]) -> None:
    """One ``round`` event against the consensus of ``contributors``."""
    group = sorted(contributors)
    want, mass = expected(group, event["round"])
    got = (event["value"], event["min"], event["max"])
    if not (all(math.isclose(v, want, rel_tol=1e-6) for v in got) and event["mass"] == mass):
        raise MatrixFailure(
            f"WRONG OR STALE VALUE: rank {event['rank']} round {event['round']} got value {event['value']} "
            f"(min {event['min']}, max {event['max']}) mass {event['mass']}; the consensus of ranks {group} "
            f"is {want} with mass {mass}"
        )


def check_rounds(cluster: ProcessCluster, rank: int, contributors: Callable[[int], Iterable[int]], upto: int | None = None) -> dict[int, Event]:
    """Every round a rank reported is correct, each reported once (and, with ``upto``, none at or past it)."""
    rounds: dict[int, Event] = {}
    for event in cluster.ranks[rank].rounds:
        k = event["round"]
        if k in rounds:
            raise MatrixFailure(f"rank {rank} reported round {k} twice")
        if upto is not None and k >= upto:
            raise MatrixFailure(f"rank {rank} returned round {k} ({event['value']}) although it should have raised before it")
        check_round(event, contributors(k))
        rounds[k] = event
    return rounds


async def expect_consensus(
    cluster: ProcessCluster, ranks: Iterable[int], rounds: int, contributors: Callable[[int], Iterable[int]]
) -> dict[int, dict[int, Event]]:
    """Outcome (a) for each of ``ranks``: every round correct, then ``done``."""
    out: dict[int, dict[int, Event]] = {}
    for rank in ranks:
        final = await cluster.wait_outcome(rank)
        seen = check_rounds(cluster, rank, contributors)
        if final["event"] != "done":
            raise MatrixFailure(f"rank {rank} should have completed every round, but: {final}")
        if sorted(seen) != list(range(rounds)):
            raise MatrixFailure(f"rank {rank} finished with rounds {sorted(seen)}, want 0..{rounds - 1}")
        out[rank] = seen
    return out


def check_error(event: Event, types: Sequence[str], fragments: Sequence[str]) -> None:
    if event["event"] != "error":
        raise MatrixFailure(f"rank {event.get('rank')} should have raised one of {list(types)}, but: {event}")
    if event["type"] not in types or not any(f in event["message"] for f in fragments):
        raise MatrixFailure(
            f"rank {event.get('rank')} raised {event['type']}: {event['message']!r}; want one of {list(types)} "
            f"naming one of {list(fragments)}"
        )


async def expect_error(
    cluster: ProcessCluster, rank: int, *, before_round: int, contributors: Callable[[int], Iterable[int]],
    types: Sequence[str] = DEATH_TYPES, fragments: Sequence[str] = LOST,
) -> Event:
    """Outcome (b) for ``rank``: a clear error, no round at or after ``before_round``, earlier rounds correct."""
    final = await cluster.wait_outcome(rank)
    check_rounds(cluster, rank, contributors, upto=before_round)
    check_error(final, types, fragments)
    return final


def killed(cluster: ProcessCluster, rank: int, *, before_round: int, contributors: Callable[[int], Iterable[int]]) -> None:
    """A SIGKILLed rank: no result at or after ``before_round``; what it got before was right."""
    check_rounds(cluster, rank, contributors, upto=before_round)


def everyone(world: int) -> Callable[[int], set[int]]:
    return lambda _k: set(range(world))


def after(round_index: int, before: Iterable[int], later: Iterable[int]) -> Callable[[int], set[int]]:
    """Contributors: ``before`` for rounds < ``round_index``, ``later`` from it on."""
    first, second = set(before), set(later)
    return lambda k: first if k < round_index else second


def fmt_ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def short(message: str, limit: int = 70) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


@contextmanager
def diagnose(cluster: ProcessCluster) -> Iterator[None]:
    """Attach every process's log to a failure."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(cluster.logs())
        raise


async def wait_until(predicate: Callable[[], bool], poll: float = 0.01) -> None:
    while not predicate():
        await trio.sleep(poll)


async def formed(c: ProcessCluster) -> None:
    """Every relay channel of every host has joined the controller (ranks connect before that)."""
    for index, host_relays in enumerate(c.relays):
        want = 2 if c.control_ports[index] is not None else 1
        await wait_until(lambda: sum(p.text.count("joined controller") for p in host_relays) >= want, 0.02)


async def wait_closed_by_peer(stream: trio.SocketStream) -> None:
    """Read until the peer closes (EOF or reset)."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, OSError):
        pass


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            raise MatrixFailure(f"peer closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def cap_address_space(proc: ChildProcess, headroom: int = 256 * MiB) -> int:
    """Limit a daemon's address space to its current size + ``headroom``: a large
    allocation then fails loudly (MemoryError) instead of passing unnoticed."""
    mem = proc.memory()
    assert mem is not None, f"{proc.name} is not running"
    cap = mem["VmSize"] + headroom
    resource.prlimit(proc.pid, resource.RLIMIT_AS, (cap, cap))
    return cap


def memory_growth(before: dict[str, int] | None, after: dict[str, int] | None) -> tuple[int, int]:
    assert before is not None and after is not None
    return after["VmPeak"] - before["VmPeak"], after["VmHWM"] - before["VmHWM"]


def daemon_cluster(**options: Any) -> Any:
    """open_process_cluster with daemons, numpy workers and the matrix salt."""
    options.setdefault("heartbeat_timeout", HEARTBEAT_TIMEOUT)
    options.setdefault("backend", "numpy")
    return open_process_cluster(salt=SALT, daemons=True, **options)


def pause(round_index: int, seconds: float = 60.0) -> list[str]:
    return ["--pause-before", f"{round_index}:{seconds:g}"]


# ---------------------------------------------------------------------------
# Process faults
# ---------------------------------------------------------------------------


SURVIVORS_FROM_ROUND_2 = after(2, range(4), [0, 1, 2])


async def rank_3_lost_before_round_2(c: ProcessCluster, fault: Callable[[int], None]) -> float:
    """Hit rank 3 with ``fault`` while it holds before round 2; once ranks 0-2 have
    their rounds (all four before round 2, three from it on), the seconds from the
    fault to their round 2."""
    await c.wait_event(3, "paused", round=2)
    t0 = mono()
    fault(3)
    rounds = await expect_consensus(c, [0, 1, 2], 4, SURVIVORS_FROM_ROUND_2)
    return max(rounds[r][2]["time"] for r in rounds) - t0


@case("rank-kill-before-frame", fault="rank SIGKILLed before sending its round-2 frame", leg="rank process")
async def rank_kill_before_frame() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=4, worker_args={3: pause(2)}) as c:
        with diagnose(c):
            seconds = await rank_3_lost_before_round_2(c, c.kill)
            killed(c, 3, before_round=2, contributors=SURVIVORS_FROM_ROUND_2)
    return Outcome("survivors 0,1,2 got the 3-rank consensus (mass 3) from round 2 on; rounds 0-1 had all 4", seconds)


@case("rank-kill-mid-frame", fault="rank SIGKILLed mid-frame (16 MB frame on a 8 MB/s leg)", leg="rank process")
async def rank_kill_mid_frame() -> Outcome:
    total = DATA_HANDSHAKE_LEN + 4 + frame_len(BIG_NUMEL)
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=1, numel=BIG_NUMEL, proxy_faults={2: [BandwidthCap(8e6)]},
    ) as c:
        with diagnose(c):
            proxy = c.proxies[2]
            await wait_until(lambda: bool(proxy.connections) and proxy.connections[0].up.bytes_out > rank_frame_start(0) + MiB)
            t0 = mono()
            c.kill(2)
            rounds = await expect_consensus(c, [0, 1], 1, lambda _k: {0, 1})
            killed(c, 2, before_round=0, contributors=everyone(3))
            record = await proxy.wait_closed(0)
            if record.up.bytes_out >= total:
                raise MatrixFailure(f"the whole frame reached the relay ({record.up.bytes_out} bytes): no partial frame")
            # The data relay sees the truncated frame end, unless the death (via the control
            # channel) reaches it first: either way the partial frame never counts.
            await c.relay_processes(1)[0].wait_log(re.compile(r"rank 2 (dropped|declared dead)"))
            seconds = max(rounds[r][0]["time"] for r in rounds) - t0
    return Outcome(
        f"the partial frame ({record.up.bytes_out / 1e6:.1f} of {total / 1e6:.1f} MB) never counted; "
        "survivors 0,1 got the 2-rank consensus", seconds,
    )


@case("rank-kill-after-frame", fault="rank SIGKILLed after its round-1 frame was folded", leg="rank process")
async def rank_kill_after_frame() -> Outcome:
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={2: pause(1)}, proxy_faults={3: []},
    ) as c:
        with diagnose(c):
            proxy = c.proxies[3]
            await c.wait_event(2, "paused", round=1)
            sent = rank_frame_start(1) + frame_len(4)
            await wait_until(lambda: bool(proxy.connections) and proxy.connections[0].up.bytes_out >= sent)
            await trio.sleep(0.2)  # the relay folds it (held back: rank 2 has not sent round 1)
            t0 = mono()
            c.kill(3)
            # Data and control both see it go: as EOF, or as a reset if bytes were still unread.
            relay = c.relay_processes(1)[0]
            await wait_until(lambda: sum(map(relay.text.count, ("rank 3 closed its connection", "rank 3 dropped:"))) >= 2)
            await c.resume(2)
            who = lambda k: set(range(4)) if k < 2 else {0, 1, 2}
            rounds = await expect_consensus(c, [0, 1, 2], 3, who)
            killed(c, 3, before_round=2, contributors=who)
            seconds = max(rounds[r][1]["time"] for r in rounds) - t0
    return Outcome("round 1 kept the dead rank's folded frame (mass 4, realized work); 3-rank consensus after", seconds)


@case("rank-freeze-thaw", fault="rank SIGSTOPped before round 2, SIGCONT later", leg="rank process")
async def rank_freeze_thaw() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=4, worker_args={3: pause(2)}) as c:
        with diagnose(c):
            seconds = await rank_3_lost_before_round_2(c, c.freeze)
            if seconds < HEARTBEAT_TIMEOUT * 0.9:
                raise MatrixFailure(f"survivors moved on {seconds:.2f} s after the freeze, before the heartbeat timeout")
            c.thaw(3)
            error = await expect_error(
                c, 3, before_round=2, contributors=SURVIVORS_FROM_ROUND_2, fragments=("declared dead",)
            )
    return Outcome(
        f"declared dead after the heartbeat timeout, survivors 0,1,2 went on; thawed, it raised "
        f"{error['type']} ({short(error['message'], 60)})", seconds,
    )


@case("rank-loop-blocked", fault="rank's event loop blocked 3 s by synchronous work (no await)", leg="rank process")
async def rank_loop_blocked() -> Outcome:
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={3: ["--block-before", "1:3", *pause(1)]},
    ) as c:
        with diagnose(c):
            blocking = await c.wait_event(3, "blocking", round=1)
            t0 = blocking["time"]
            who = after(1, range(4), [0, 1, 2])
            rounds = await expect_consensus(c, [0, 1, 2], 3, who)
            # Unblocked, it has been declared dead: it must say so (or that the coordinator is
            # gone), not return a round and not blame the bytes on the wire.
            error = await expect_error(c, 3, before_round=1, contributors=who, fragments=("declared dead", "no beacon", "closed the connection"))
            seconds = max(rounds[r][1]["time"] for r in rounds) - t0
    return Outcome(
        f"declared dead after the heartbeat timeout, survivors 0,1,2 went on; unblocked, it raised {error['type']} "
        f"({short(error['message'], 60)})", seconds,
    )


async def _relay_fault(freeze: bool) -> Outcome:
    """Host 1's relay daemon is killed or frozen while its ranks wait in round 1."""
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={2: pause(1), 3: pause(1)}) as c:
        with diagnose(c):
            await c.wait_event(2, "paused", round=1)
            await c.wait_event(3, "paused", round=1)
            t0 = mono()
            (c.freeze_relay if freeze else c.kill_relay)(1)
            who = after(1, range(4), [0, 1])
            rounds = await expect_consensus(c, [0, 1], 3, who)
            # frozen: only the missing beacons can tell; killed: the sockets close at once
            expect = {"types": ("CoordinatorLost",), "fragments": ("no beacon",)} if freeze else {}
            errors = [await expect_error(c, r, before_round=1, contributors=who, **expect) for r in (2, 3)]
            seconds = max([rounds[r][1]["time"] for r in rounds] + [e["time"] for e in errors]) - t0
    if freeze:
        return Outcome("its ranks declared dead after the heartbeat timeout, host 0 went on; ranks 2,3 raised CoordinatorLost (no beacon)", seconds)
    return Outcome(f"host 0 went on with the 2-rank consensus; ranks 2,3 raised {errors[0]['type']}", seconds)


@case("relay-kill", fault="relay daemon SIGKILLed", leg="relay process")
async def relay_kill() -> Outcome:
    return await _relay_fault(freeze=False)


@case("relay-freeze", fault="relay daemon SIGSTOPped", leg="relay process")
async def relay_freeze() -> Outcome:
    return await _relay_fault(freeze=True)


@case("controller-kill", fault="controller daemon SIGKILLed mid-round", leg="controller process")
async def controller_kill() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={0: pause(1)}) as c:
        with diagnose(c):
            await c.wait_event(0, "paused", round=1)
            for rank in (1, 2, 3):
                await c.wait_event(rank, "sending", round=1)
            t0 = mono()
            c.kill_controller()
            errors = [await expect_error(c, r, before_round=1, contributors=everyone(4)) for r in range(4)]
            seconds = max(e["time"] for e in errors) - t0
            if seconds > HEARTBEAT_TIMEOUT + 1.0:
                raise MatrixFailure(f"ranks took {seconds:.2f} s to raise; the beacon timeout is {HEARTBEAT_TIMEOUT} s")
    return Outcome(f"every rank raised ({fmt_types(errors)}) within the beacon timeout", seconds)


@case("controller-freeze", fault="controller daemon SIGSTOPped mid-round", leg="controller process")
async def controller_freeze() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=3, worker_args={0: pause(1)}) as c:
        with diagnose(c):
            await c.wait_event(0, "paused", round=1)
            for rank in (1, 2, 3):
                await c.wait_event(rank, "sending", round=1)
            t0 = mono()
            c.freeze_controller()
            errors = [
                await expect_error(c, r, before_round=1, contributors=everyone(4), types=("CoordinatorLost",), fragments=("no beacon",))
                for r in range(4)
            ]
            seconds = max(e["time"] for e in errors) - t0
            if seconds > HEARTBEAT_TIMEOUT + 1.0:
                raise MatrixFailure(f"ranks took {seconds:.2f} s to raise; the beacon timeout is {HEARTBEAT_TIMEOUT} s")
    return Outcome("every rank raised CoordinatorLost (no beacon) within the beacon timeout", seconds)


def fmt_types(errors: Sequence[Event]) -> str:
    return "/".join(sorted({e["type"] for e in errors}))


# ---------------------------------------------------------------------------
# Rank -> relay leg
# ---------------------------------------------------------------------------


async def _rank_leg_drop(fault: Any, relay_log: str, *, numel: int | None = None) -> Outcome:
    """Rank 1's data leg carries ``fault``: rank 1 is dropped and raises, ranks 0 and 2 go on."""
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, numel=numel, proxy_faults={1: [fault]}) as c:
        with diagnose(c):
            events = await c.proxies[1].wait_fired(type(fault))
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 2], 2, lambda _k: {0, 2})
            error = await expect_error(c, 1, before_round=0, contributors=everyone(3))
            # A cut may reach the relay as the rank's death (via its control channel) first.
            pattern = r"rank 1 dropped: (.*?)\"?$" if relay_log else r"rank 1 (?:dropped: )?((?<=dropped: ).*?|declared dead.*?)\"?$"
            match = await c.relay_processes(0)[0].wait_log(re.compile(pattern, re.M))
            if relay_log not in match.group(1):
                raise MatrixFailure(f"the relay dropped rank 1 for another reason: {match.group(0)!r}, want {relay_log!r}")
            seconds = max([rounds[r][0]["time"] for r in rounds] + [error["time"]]) - t0
    reason = relay_log or short(match.group(1).split(": ", 1)[-1], 40)
    return Outcome(f"relay dropped rank 1 ({reason}), which raised {error['type']}; ranks 0,2 got their 2-rank consensus", seconds)


@case("rank-leg-flip-payload", fault="one bit flipped in a frame's tensor payload", leg="rank -> relay (data)")
async def rank_leg_flip_payload() -> Outcome:
    return await _rank_leg_drop(FlipBit(rank_frame_start(0) + FRAME_PAYLOAD + 2, bit=3), "MAC mismatch")


@case("rank-leg-flip-header", fault="one bit flipped in a frame header (the weight)", leg="rank -> relay (data)")
async def rank_leg_flip_header() -> Outcome:
    return await _rank_leg_drop(FlipBit(rank_frame_start(0) + FRAME_WEIGHT_LOW_BYTE, bit=0), "MAC mismatch")


@case("rank-leg-flip-mac", fault="one bit flipped in a frame's MAC", leg="rank -> relay (data)")
async def rank_leg_flip_mac() -> Outcome:
    return await _rank_leg_drop(FlipBit(rank_frame_start(0) + frame_len(4) - 1, bit=7), "MAC mismatch")


@case("rank-leg-cut", fault="connection reset mid-frame", leg="rank -> relay (data)")
async def rank_leg_cut() -> Outcome:
    return await _rank_leg_drop(CutAt(rank_frame_start(0) + 20), "")


@case("rank-leg-replay", fault="a rank's frame delivered twice (replay)", leg="rank -> relay (data)")
async def rank_leg_replay() -> Outcome:
    # Rank 0 holds its round-0 frame, so host 0's fold cannot ship before the copy arrives.
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=2, worker_args={0: pause(0)},
        proxy_faults={1: [DuplicateRecord(index=0)]},
    ) as c:
        with diagnose(c):
            events = await c.proxies[1].wait_fired(DuplicateRecord)
            t0 = trio_to_mono(events[0].time)
            relay = c.relay_processes(0)[0]
            await relay.wait_log(re.compile(r"rank 1 dropped: .*deposited twice in one round"))
            await c.resume(0)
            # Rank 1's first frame was folded before its copy arrived: realized work, round 0 keeps it.
            rounds = await expect_consensus(c, [0, 2, 3], 2, lambda k: {0, 1, 2, 3} if k == 0 else {0, 2, 3})
            error = await expect_error(c, 1, before_round=0, contributors=everyone(4))
            seconds = max([rounds[r][1]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(
        f"relay host0 dropped rank 1 (DesyncError: deposited twice), which raised {error['type']}; "
        "ranks 0,2,3 got round 0 with rank 1's first frame and round 1 without it", seconds,
    )


@case("rank-leg-slow", fault="slow link: every chunk held 0.2 s, both ways", leg="rank -> relay (data)")
async def rank_leg_slow() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=3, proxy_faults={1: [Delay(0.2, direction="both")]}) as c:
        with diagnose(c):
            events = await c.proxies[1].wait_fired(Delay)
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, range(3), 3, everyone(3))
            seconds = max(rounds[r][2]["time"] for r in rounds) - t0
    return Outcome("no false death: every rank got every 3-rank consensus, just later", seconds)


@case("rank-leg-huge-length", fault="length prefix 2**32-1 after a valid data handshake", leg="rank -> relay (data)")
async def rank_leg_huge_length() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, control=False, external_ranks={1}) as c:
        with diagnose(c):
            relay = c.relay_processes(0)[0]
            attacker = await trio.open_tcp_stream(*c.relay_address(1))
            async with attacker:
                await attacker.send_all(encode_data_handshake(1, 3))
                await receive_exactly(attacker, DATA_ACK_LEN)
                await formed(c)
                await c.wait_event(0, "sending", round=0)
                cap_address_space(relay)
                before = relay.memory()
                t0 = mono()
                await attacker.send_all(struct.pack("<I", 0xFFFFFFFF) + b"\x00" * 64)
                await wait_closed_by_peer(attacker)
                refused = mono() - t0
            rounds = await expect_consensus(c, [0, 2], 2, lambda _k: {0, 2})
            await relay.wait_log("length prefix 4294967295 exceeds the frame ceiling")
            peak, hwm = memory_growth(before, relay.memory())
            if peak > MEMORY_SLACK or hwm > MEMORY_SLACK:
                raise MatrixFailure(f"relay grew by VmPeak {peak / MiB:.1f} MiB, VmHWM {hwm / MiB:.1f} MiB")
            seconds = max([rounds[r][0]["time"] for r in rounds] + [t0 + refused]) - t0
    return Outcome(
        f"refused before buffering (relay VmPeak +{peak / MiB:.1f} MiB, VmHWM +{hwm / MiB:.1f} MiB); "
        "ranks 0,2 got their 2-rank consensus", seconds,
    )


# ---------------------------------------------------------------------------
# Rank -> relay control leg
# ---------------------------------------------------------------------------


@case("control-leg-stall", fault="a rank's heartbeats stop getting through (Stall after the handshake)", leg="rank -> relay (control)")
async def control_leg_stall() -> Outcome:
    async with daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], rounds=2, worker_args={3: pause(0)},
        control_proxy_faults={3: [Stall(56, 60.0)]},
    ) as c:
        with diagnose(c):
            events = await c.control_proxies[3].wait_fired(Stall)
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 1, 2], 2, lambda _k: {0, 1, 2})
            error = await expect_error(c, 3, before_round=0, contributors=everyone(4), types=("RankDeadError",), fragments=("no heartbeat",))
            seconds = max([rounds[r][0]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(f"declared dead after the heartbeat timeout; it raised RankDeadError ({short(error['message'], 60)}); 0,1,2 went on", seconds)


# ---------------------------------------------------------------------------
# Relay -> controller leg
# ---------------------------------------------------------------------------


UPLINK_HOST1 = uplink_first_record("host1", [2])


async def _uplink_dropped(fault: Any, controller_log: Sequence[str]) -> Outcome:
    """Host 1's uplink carries ``fault``: the controller drops relay host1 (naming it and
    the fault); its rank 2 raises; host 0's ranks get their 2-rank consensus."""
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={2: pause(0)}, upstream_faults={1: [fault]},
    ) as c:
        with diagnose(c):
            await c.wait_event(2, "paused", round=0)
            await formed(c)  # the whole cluster is up before host 1's first frame goes out
            await c.resume(2)
            events = await c.upstream_proxies[1].wait_fired(type(fault))
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 1], 2, lambda _k: {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            assert c.controller is not None
            match = await c.controller.wait_log(re.compile(r"relay host1 \(ranks \[2\]\) dropped for breaking the protocol .*"))
            line = match.group(0)
            if not any(f in line for f in controller_log):
                raise MatrixFailure(f"the controller dropped relay host1 for another reason: {line!r}, want {list(controller_log)}")
            seconds = max([rounds[r][1]["time"] for r in rounds] + [error["time"]]) - t0
    kind = re.search(r"(MAC mismatch|bad magic 0x[0-9A-F]+|HostFrame before the consensus)", line)
    return Outcome(
        f"controller dropped relay host1 ({kind.group(1) if kind else short(line)}); rank 2 raised {error['type']}; "
        "ranks 0,1 got their 2-rank consensus", seconds,
    )


@case("uplink-flip-payload", fault="one bit flipped in a HostFrame's payload", leg="relay -> controller (data)")
async def uplink_flip_payload() -> Outcome:
    return await _uplink_dropped(FlipBit(UPLINK_HOST1 + MUX_HEADER + FRAME_PAYLOAD + 3, bit=1), ["MAC mismatch"])


@case("uplink-flip-header", fault="one bit flipped in a MuxRecord header (its magic)", leg="relay -> controller (data)")
async def uplink_flip_header() -> Outcome:
    return await _uplink_dropped(FlipBit(UPLINK_HOST1, bit=0), ["bad magic"])


@case("uplink-flip-mac", fault="one bit flipped in a MuxRecord's MAC", leg="relay -> controller (data)")
async def uplink_flip_mac() -> Outcome:
    return await _uplink_dropped(FlipBit(UPLINK_HOST1 + MUX_MAC + 3, bit=5), ["MAC mismatch"])


@case("uplink-cut", fault="connection reset mid-HostFrame", leg="relay -> controller (data)")
async def uplink_cut() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, upstream_faults={1: [CutAt(UPLINK_HOST1 + 40)]}) as c:
        with diagnose(c):
            events = await c.upstream_proxies[1].wait_fired(CutAt)
            t0 = trio_to_mono(events[0].time)
            rounds = await expect_consensus(c, [0, 1], 2, lambda _k: {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            seconds = max([rounds[r][0]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(f"host 1's rank declared dead and raised {error['type']}; host 0 got its 2-rank consensus", seconds)


@case("uplink-replay", fault="a HostFrame delivered twice (replay) while its round is open", leg="relay -> controller (data)")
async def uplink_replay() -> Outcome:
    """Host 0 is held back, so host 1's frame and its copy both land while round 0 waits.

    A copy arriving after the round's consensus went out cannot be told from the
    next round's frame: the wire format has no sequence number (see wire.md,
    "Replays"); run the relay links in a tunnel with anti-replay when an
    attacker could sit on them.
    """
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={0: pause(0)},
        upstream_faults={1: [DuplicateRecord(index=1, framing="mux")]},
    ) as c:
        with diagnose(c):
            events = await c.upstream_proxies[1].wait_fired(DuplicateRecord)
            t0 = trio_to_mono(events[0].time)
            # The proxy has sent the copy; host 0 is let go only once the controller has
            # read it. Released earlier, host 0 could complete the round first, and the
            # copy would then be (undetectably) the next round's frame.
            assert c.controller is not None
            await c.controller.wait_log(re.compile(r"relay host1 .*dropped for breaking the protocol .*HostFrame before the consensus"))
            await c.resume(0)
            # Host 1's first frame was folded before its copy arrived: realized work, round 0 keeps it.
            rounds = await expect_consensus(c, [0, 1], 2, lambda k: {0, 1, 2} if k == 0 else {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            seconds = max([rounds[r][1]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(
        f"controller dropped relay host1 (DesyncError: a HostFrame before its consensus); rank 2 raised {error['type']}; "
        "ranks 0,1 got round 0 with host 1's first frame and round 1 without it", seconds,
    )


@case("uplink-write-stall", fault="relay's upstream write makes no progress (16 MB frame, Stall)", leg="relay -> controller (data)")
async def uplink_write_stall() -> Outcome:
    async with daemon_cluster(
        world_size=3, hosts=[[0, 1], [2]], rounds=1, numel=BIG_NUMEL,
        upstream_faults={1: [Stall(UPLINK_HOST1, 60.0)]}, relay_env={1: {"FLODL_NET_TIMEOUT_SCALE": SCALE}},
    ) as c:
        with diagnose(c):
            await c.upstream_proxies[1].wait_fired(Stall)
            sending = await c.wait_event(2, "sending", round=0)
            t0 = sending["time"]
            rounds = await expect_consensus(c, [0, 1], 1, lambda _k: {0, 1})
            error = await expect_error(c, 2, before_round=0, contributors=everyone(3))
            data_relay = c.relay_processes(1)[0]
            await data_relay.wait_log(re.compile(r"relay failed: .*write stalled for 3 s"))
            if await data_relay.wait() != 1:
                raise MatrixFailure(f"relay host1 exited {data_relay.returncode}, want 1")
            seconds = max([rounds[r][0]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(f"relay host1 gave up (write stalled for 3 s); rank 2 raised {error['type']}; host 0 went on", seconds)


# ---------------------------------------------------------------------------
# Listeners
# ---------------------------------------------------------------------------


def mux_header(kind: int, length: int, rank: int = 0) -> bytes:
    return struct.pack("<IIBII", MUX_MAGIC, MUX_VERSION, kind, rank, length) + b"\x00" * 8


@case("controller-huge-first-record", fault="MuxRecord header declaring 2**32-1 bytes as the first record", leg="controller port")
async def controller_huge_first_record() -> Outcome:
    async with daemon_cluster(world_size=2, hosts=[[0], [1]], rounds=4, pause=0.2, control=False) as c:
        with diagnose(c):
            assert c.controller is not None
            await c.wait_round(0, 0)
            cap_address_space(c.controller)
            before = c.controller.memory()
            attacker = await trio.open_tcp_stream(*c.controller_address)
            async with attacker:
                t0 = mono()
                await attacker.send_all(CHANNEL_MAGIC_DATA.to_bytes(4, "little") + mux_header(MuxKind.CONTROL, 0xFFFFFFFF))
                await wait_closed_by_peer(attacker)
                refused = mono() - t0
            await expect_consensus(c, [0, 1], 4, everyone(2))
            await c.controller.wait_log(re.compile(r"refused: .*payload length 4294967295 exceeds the frame ceiling"))
            peak, hwm = memory_growth(before, c.controller.memory())
            if peak > MEMORY_SLACK or hwm > MEMORY_SLACK:
                raise MatrixFailure(f"controller grew by VmPeak {peak / MiB:.1f} MiB, VmHWM {hwm / MiB:.1f} MiB")
    return Outcome(
        f"refused at the Hello ceiling (VmPeak +{peak / MiB:.1f} MiB, VmHWM +{hwm / MiB:.1f} MiB); rounds went on correct", refused,
    )


@case("controller-huge-record-after-hello", fault="MuxRecord header declaring 2**32-1 bytes after a valid Hello", leg="controller port")
async def controller_huge_record_after_hello() -> Outcome:
    # World of 3: host 0 carries ranks 0, 1; the test is "relay mallory" carrying rank 2.
    async with daemon_cluster(world_size=3, hosts=[[0, 1]], rounds=2) as c:
        with diagnose(c):
            assert c.controller is not None
            attacker = await trio.open_tcp_stream(*c.controller_address)
            async with attacker:
                hello = encode_mux_record(MuxKind.CONTROL, encode_control_msg(Hello("mallory", (2,), ())), SALT)
                await attacker.send_all(CHANNEL_MAGIC_DATA.to_bytes(4, "little") + hello.tobytes())
                await receive_exactly(attacker, MUX_HEADER + 1)  # HelloAck
                await formed(c)
                await c.wait_event(0, "sending", round=0)
                cap_address_space(c.controller)
                before = c.controller.memory()
                t0 = mono()
                await attacker.send_all(mux_header(MuxKind.HOST_FRAME, 0xFFFFFFFF))
                await wait_closed_by_peer(attacker)
                refused = mono() - t0
            rounds = await expect_consensus(c, [0, 1], 2, lambda _k: {0, 1})
            match = await c.controller.wait_log(re.compile(r"relay mallory .*dropped for breaking the protocol .*"))
            line = match.group(0)
            if "payload length 4294967295 exceeds the frame ceiling" not in line:
                raise MatrixFailure(f"the controller dropped relay mallory for another reason: {line!r}")
            peak, hwm = memory_growth(before, c.controller.memory())
            if peak > MEMORY_SLACK or hwm > MEMORY_SLACK or "MemoryError" in c.controller.text:
                raise MatrixFailure(f"controller grew by VmPeak {peak / MiB:.1f} MiB, VmHWM {hwm / MiB:.1f} MiB")
            seconds = max([rounds[r][1]["time"] for r in rounds] + [t0 + refused]) - t0
    return Outcome(
        f"controller dropped relay mallory (FramingError, no allocation: VmPeak +{peak / MiB:.1f} MiB); "
        "ranks 0,1 got their 2-rank consensus", seconds,
    )


async def _slowloris(
    c: ProcessCluster, address: tuple[str, int], prefix: bytes, deadline: float, log: ChildProcess, log_line: str | re.Pattern[str],
) -> float:
    """Send ``prefix`` then nothing; return how long until the listener hung up."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(prefix)
        t0 = mono()
        with trio.move_on_after(deadline + 5.0):
            await wait_closed_by_peer(stream)
        held = mono() - t0
    if not deadline * 0.8 <= held <= deadline + 2.0:
        raise MatrixFailure(f"slow-loris {prefix.hex()} held for {held:.2f} s; the deadline is {deadline:.1f} s")
    await log.wait_log(log_line)
    return held


@case("slowloris-controller", fault="slow-loris: half a channel magic / half a Hello header, then silence", leg="controller port")
async def slowloris_controller() -> Outcome:
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=6, pause=0.25, controller_env={"FLODL_NET_TIMEOUT_SCALE": SCALE},
        controller_args=["--keep-serving"],  # its status page outlives the ranks
    ) as c:
        with diagnose(c):
            assert c.controller is not None
            await c.wait_round(0, 0)
            magic = CHANNEL_MAGIC_DATA.to_bytes(4, "little")
            held: dict[str, float] = {}
            async with trio.open_nursery() as nursery:
                async def loris(name: str, prefix: bytes, deadline: float, line: str) -> None:
                    assert c.controller is not None
                    held[name] = await _slowloris(c, c.controller_address, prefix, deadline, c.controller, line)

                nursery.start_soon(loris, "magic", magic[:2], 0.5, "no channel magic (timed out)")
                nursery.start_soon(
                    loris, "Hello", magic + mux_header(MuxKind.CONTROL, 10)[:12], 1.0, "no Hello within the handshake deadline"
                )
            await expect_consensus(c, [0, 1], 6, everyone(2))
            rejected = (await c.status())["stats"]["rejected"]
            if rejected != 2:
                raise MatrixFailure(f"controller counted {rejected} rejections for 2 slow-loris connections")
    return Outcome(
        f"closed after {held['magic']:.2f} s (half magic; bound 0.5 s) and {held['Hello']:.2f} s (half Hello header; "
        "bound 1 s), both counted; concurrent rounds correct", max(held.values()),
    )


@case("slowloris-relay-data", fault="slow-loris: half a data handshake, then silence", leg="relay data port")
async def slowloris_relay_data() -> Outcome:
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=6, pause=0.25, relay_env={0: {"FLODL_NET_TIMEOUT_SCALE": SCALE}},
    ) as c:
        with diagnose(c):
            await c.wait_round(0, 0)
            relay = c.relay_processes(0)[0]
            held = await _slowloris(
                c, c.relay_address(0), encode_data_handshake(0, 2)[:8], 1.0, relay, "no complete handshake within the deadline"
            )
            await expect_consensus(c, [0, 1], 6, everyone(2))
    return Outcome("refused at the 1 s handshake deadline; the relay's own rank kept averaging correctly", held)


@case("slowloris-relay-control", fault="slow-loris: half a control handshake, then silence", leg="relay control port")
async def slowloris_relay_control() -> Outcome:
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=6, pause=0.25, relay_env={0: {"FLODL_NET_TIMEOUT_SCALE": SCALE}},
    ) as c:
        with diagnose(c):
            await c.wait_round(0, 0)
            relay = c.relay_processes(0)[0]
            prefix = encode_control_handshake(0, 2, SIGNATURE, SALT)[:28]
            held = await _slowloris(c, c.control_address(0), prefix, 1.0, relay, "no complete handshake within the deadline")
            await expect_consensus(c, [0, 1], 6, everyone(2))
    return Outcome("refused at the 1 s handshake deadline; heartbeats and rounds unaffected", held)


@case("port-scanner", fault="port scanner: 150 connect-and-close / random-bytes / garbage-Hello connections", leg="controller port")
async def port_scanner() -> Outcome:
    rng = random.Random(20241130)
    magic = CHANNEL_MAGIC_DATA.to_bytes(4, "little")
    payloads: list[bytes] = [b""] * 60
    while len(payloads) < 120:
        blob = rng.randbytes(rng.randint(1, 64))
        if blob[:1] not in (b"G", b"P") and blob[:4] not in (magic, CHANNEL_MAGIC_CONTROL.to_bytes(4, "little")):
            payloads.append(blob)
    payloads += [magic + rng.randbytes(rng.randint(1, 80)) for _ in range(30)]
    rng.shuffle(payloads)
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=8, pause=0.15, control=False, controller_args=["--keep-serving"],
    ) as c:
        with diagnose(c):
            await c.wait_round(0, 0)
            limiter = trio.CapacityLimiter(8)
            t0 = mono()

            async def probe(blob: bytes) -> None:
                async with limiter:
                    stream = await trio.open_tcp_stream(*c.controller_address)
                    async with stream:
                        try:  # a scanner does not care how the other side hangs up
                            if blob:
                                await stream.send_all(blob)
                            await stream.send_eof()
                        except (trio.BrokenResourceError, OSError):
                            pass
                        await wait_closed_by_peer(stream)

            async with trio.open_nursery() as nursery:
                for blob in payloads:
                    nursery.start_soon(probe, blob)
            rejected = 0
            while rejected < len(payloads):
                rejected = (await c.status())["stats"]["rejected"]
                if rejected < len(payloads):
                    await trio.sleep(0.02)
            seconds = mono() - t0
            await expect_consensus(c, [0, 1], 8, everyone(2))
            rejected = (await c.status())["stats"]["rejected"]
            if rejected != len(payloads):
                raise MatrixFailure(f"controller counted {rejected} rejections for {len(payloads)} probes")
    return Outcome(f"controller kept serving (rounds correct) and counted exactly {rejected} rejections", seconds)


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


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
            seconds = max([rounds[r][0]["time"] for r in rounds] + [error["time"]]) - sending["time"]
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
            seconds = max([rounds[r][0]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(
        f"refused at the handshake (the salt is proven once there; frames go unsigned): raised {error['type']}; "
        "ranks 0,2 correct", seconds,
    )


async def _imposter(
    c: ProcessCluster, attempt: Callable[[], Awaitable[object]], log: ChildProcess, log_line: str,
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
            kind, seconds = await _imposter(c, lambda: connect(c), c.relay_processes(0)[0], log_line)
            await expect_consensus(c, range(3), 6, everyone(3))
    return Outcome(f"refused ({kind} at the client; relay logged '{log_line}'); the cluster's rounds stayed correct", seconds)


async def _reduce_once(address: tuple[str, int], rank: int, world: int, salt: SessionSalt) -> None:
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
# Blast radius: a peer with the salt says something impossible
# ---------------------------------------------------------------------------


def contribution_frame(rank: int, round_index: int, numel: int = 4, *, weight: float = 1.0) -> RoundFrame:
    """What rank_worker sends in round ``round_index`` (value (rank + 1) * (k + 1), mass 1)."""
    values = np.full(numel, float((rank + 1) * (round_index + 1)), dtype="<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, (numel,), values)], RoundKind.MODEL, weight)


def with_unknown_dtype(frame: RoundFrame) -> bytes:
    """``frame`` signed correctly, its first tensor's dtype tag set to 9 (no such dtype)."""
    body = bytearray(encode_round_frame(frame, SALT)[:-8])
    body[FRAME_HEADER_LEN] = 9
    return bytes(body) + SALT.mac8(bytes(body))


async def raw_data_rank(address: tuple[str, int], rank: int, world: int) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(encode_data_handshake(rank, world))
    await receive_exactly(stream, DATA_ACK_LEN)
    return stream


async def _bad_schema(hosts: list[list[int]], attacker: int, world: int = 3) -> Outcome:
    honest = [r for r in range(world) if r != attacker]
    async with daemon_cluster(world_size=world, hosts=hosts, rounds=2, control=False, external_ranks={attacker}) as c:
        with diagnose(c):
            stream = await raw_data_rank(c.relay_address(attacker), attacker, world)
            async with stream:
                await formed(c)
                bad = with_unknown_dtype(contribution_frame(attacker, 0))
                t0 = mono()
                await stream.send_all(struct.pack("<I", len(bad)) + bad)
                await wait_closed_by_peer(stream)
                refused = mono() - t0
            relay = c.relay_processes(c.host_of(attacker))[0]
            await relay.wait_log(re.compile(rf"rank {attacker} dropped: .*unknown dtype tag 9"))
            rounds = await expect_consensus(c, honest, 2, lambda _k: set(honest))
            assert c.controller is not None
            if "dropped for breaking the protocol" in c.controller.text:
                raise MatrixFailure("the bad frame reached the controller")
            seconds = max([rounds[r][1]["time"] for r in rounds] + [t0 + refused]) - t0
    return Outcome(
        f"its relay dropped rank {attacker} (SchemaError: unknown dtype tag 9); nothing reached the controller; "
        f"ranks {fmt_ranks(honest)} got their {len(honest)}-rank consensus", seconds,
    )


@case("rank-bad-schema", fault="an authenticated frame with an unknown dtype tag, beside an honest rank", leg="rank -> relay (data)")
async def rank_bad_schema() -> Outcome:
    return await _bad_schema([[0, 1], [2]], attacker=1)


@case("rank-bad-schema-alone", fault="an authenticated frame with an unknown dtype tag, alone on its host", leg="rank -> relay (data)")
async def rank_bad_schema_alone() -> Outcome:
    return await _bad_schema([[0], [1, 2]], attacker=0)


@case("rank-schema-change-first", fault="a rank's round-1 frame has 5 elements where round 0 completed with 4, folded first",
      leg="rank -> relay (data)")
async def rank_schema_change_first() -> Outcome:
    """In deterministic mode host 0 folds its ranks in rank order, so rank 0's wrong frame
    is its round's first: the relay takes it out when rank 1's arrives (with the schema
    round 0 completed with) and drops rank 0 alone."""
    ordered = {"FLODL_DETERMINISTIC": "1"}
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, worker_args={0: ["--numel-at", "1:5"]},
                              controller_env=ordered, relay_env={0: ordered, 1: ordered}) as c:
        with diagnose(c):
            t0 = (await c.wait_event(0, "sending", round=1))["time"]
            relay = c.relay_processes(0)[0]
            await relay.wait_log(re.compile(r"rank 0 dropped: .*shape \[5\], not \[4\].*taken out of the round"))
            rounds = await expect_consensus(c, [1, 2], 2, after(1, [0, 1, 2], [1, 2]))
            error = await expect_error(c, 0, before_round=1, contributors=everyone(3))
            seconds = max([rounds[r][1]["time"] for r in rounds] + [error["time"]]) - t0
    return Outcome(
        f"relay host0 took rank 0's frame out of the round and dropped it (tensor 0 of shape [5], not [4]), which "
        f"raised {error['type']}; ranks 1,2 got round 1 without it, exact", seconds,
    )


@case("rank-mass-overflow", fault="two ranks of a host each send weight 1e308 (finite alone)", leg="rank -> relay (data)")
async def rank_mass_overflow() -> Outcome:
    """The second 1e308 would make the host's mass infinite: its sender is dropped. The
    first is realized work: round 0's consensus is the honest values over a mass of
    1e308 (0 in f32); after the first attacker leaves, round 1 is the honest mean."""
    async with daemon_cluster(world_size=4, hosts=[[0, 1, 2], [3]], rounds=2, control=False, external_ranks={0, 1}) as c:
        with diagnose(c):
            streams = [await raw_data_rank(c.relay_address(r), r, 4) for r in (0, 1)]
            await formed(c)
            t0 = mono()
            for rank, stream in zip((0, 1), streams):
                frame = encode_round_frame(contribution_frame(rank, 0, weight=1e308), SALT)
                await stream.send_all(struct.pack("<I", len(frame)) + frame)
            relay = c.relay_processes(0)[0]
            match = await relay.wait_log(re.compile(r"rank ([01]) dropped: .*accepted mass inf"))
            first = await c.wait_round(2, 0)
            for stream in streams:  # the survivor leaves too: round 1 is the honest ranks'
                await stream.aclose()
            for rank in (2, 3):
                event = await c.wait_round(rank, 0)
                if not (event["value"] == event["min"] == event["max"] == 0.0 and event["mass"] == 1e308):
                    raise MatrixFailure(f"rank {rank} round 0: {event}; want 0.0 everywhere with mass 1e308")
            final = [await c.wait_outcome(r) for r in (2, 3)]
            for rank in (2, 3):
                check_round(await c.wait_round(rank, 1), {2, 3})
            if any(f["event"] != "done" for f in final):
                raise MatrixFailure(f"the honest ranks did not finish: {final}")
            seconds = first["time"] - t0
    return Outcome(
        f"relay dropped rank {match.group(1)} (its weight would make the mass inf); round 0 kept the other 1e308 "
        "(honest ranks got 0 with mass 1e308), round 1 the honest mean", seconds,
    )


@case("duplicate-handshake-race", fault="two clients claim the same rank at the same instant", leg="rank -> relay (data)")
async def duplicate_handshake_race() -> Outcome:
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=2, control=False, external_ranks={0}) as c:
        with diagnose(c):
            streams = [await trio.open_tcp_stream(*c.relay_address(0)) for _ in range(2)]
            t0 = mono()
            for stream in streams:  # both handshakes are in before either is answered
                await stream.send_all(encode_data_handshake(0, 3))
            acks = []
            for stream in streams:
                got = b""
                with trio.move_on_after(10):
                    while len(got) < DATA_ACK_LEN and (chunk := await stream.receive_some(DATA_ACK_LEN - len(got))):
                        got += chunk
                acks.append(len(got) == DATA_ACK_LEN)
            seconds = mono() - t0
            if sorted(acks) != [False, True]:
                raise MatrixFailure(f"acks {acks}: want exactly one of the two handshakes acknowledged")
            # "already connected" or, once the first joined the running channel, "already joined"
            await c.relay_processes(0)[0].wait_log("duplicate rank 0: already")
            for stream in streams:  # rank 0 leaves; the others go on without it
                await stream.aclose()
            await expect_consensus(c, [1, 2], 2, lambda _k: {1, 2})
    return Outcome("one acknowledged, the other refused (duplicate rank 0); ranks 1,2 went on", seconds)


@case("never-connected-declared-dead", fault="a rank never starts; the operator declares it dead", leg="formation (operator)")
async def never_connected_declared_dead() -> Outcome:
    """Rank 1 never connects (data or control). Its host's data relay is connected from
    the start, so once it is declared dead, rank 0's rounds complete, and the host's
    control relay joins the coordinator without it (rank 0 keeps its beacons)."""
    async with open_process_cluster(
        world_size=3, hosts=[[0, 1], [2]], salt=SALT, rounds=3, pause=HEARTBEAT_TIMEOUT / 2, backend="numpy",
        heartbeat_timeout=HEARTBEAT_TIMEOUT, external_ranks={1},
    ) as c:
        with diagnose(c):
            assert c.local is not None
            await c.wait_event(0, "sending", round=0)
            await trio.sleep(HEARTBEAT_TIMEOUT / 2)
            if c.ranks[0].rounds:
                raise MatrixFailure("round 0 completed without rank 1 before it was declared dead")
            t0 = mono()
            c.local.controller.dead_ranks.declare_dead(1)
            rounds = await expect_consensus(c, [0, 2], 3, lambda _k: {0, 2})
            seconds = rounds[0][0]["time"] - t0
    return Outcome("ranks 0,2 went on (3 rounds over 0,2; rank 0's control relay joined without rank 1)", seconds)


@case("control-garbage", fault="a rank's control connection carries garbage, a short heartbeat and a 100 KiB Metrics frame", leg="rank -> relay (control)")
async def control_garbage() -> Outcome:
    """Rank 1 (played here) takes part in every data round, and on its control
    connection sends its real heartbeats interleaved with bytes that are no
    ControlFrame, a correctly tagged heartbeat of the wrong size and a legal 100 KiB
    Metrics frame. The coordinator ignores and counts them; nobody dies."""
    rounds = 3
    async with daemon_cluster(world_size=3, hosts=[[0, 1], [2]], rounds=rounds, pause=HEARTBEAT_TIMEOUT / 2,
                              external_ranks={1}) as c:
        with diagnose(c):
            control = await trio.open_tcp_stream(*c.control_address(1))
            await control.send_all(encode_control_handshake(1, 3, SIGNATURE, SALT))
            await receive_exactly(control, CONTROL_ACK_LEN)
            junk = [
                b"\x00\x01 this is not a control frame",
                encode_control_frame(ControlFrame(ControlKind.HEARTBEAT, HEARTBEAT_TAG + b"\x01\x00\x00"), SALT),
                encode_control_frame(ControlFrame(ControlKind.METRICS, bytes(100 << 10)), SALT),
            ]

            async def noisy_control() -> None:
                seq = 0
                while True:
                    seq += 1
                    for blob in (encode_control_frame(heartbeat_frame(1, seq), SALT), junk[seq % len(junk)]):
                        await control.send_all(struct.pack("<I", len(blob)) + blob)
                    await trio.sleep(HEARTBEAT_TIMEOUT / 6)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(noisy_control)
                t0 = mono()
                async with connect_reduce_client(c.relay_address(1), 1, 3, SALT) as client:
                    for k in range(rounds):
                        await client.all_reduce(contribution_frame(1, k))
                    done = await expect_consensus(c, [0, 2], rounds, everyone(3))
                    nursery.cancel_scope.cancel()  # before rank 1 leaves (its control connection then closes)
            await control.aclose()
            assert c.controller is not None
            await c.controller.wait_log(re.compile(r"ignored a control frame from rank 1 \(malformed"))
            await c.controller.wait_log(re.compile(r"ignored a control frame from rank 1 \(not a heartbeat"))
            if "declared dead" in c.controller.text:
                raise MatrixFailure("a rank was declared dead")
            seconds = max(done[r][rounds - 1]["time"] for r in done) - t0
    return Outcome(f"ignored and counted (malformed, not a heartbeat); nobody declared dead; {rounds} rounds over 0,1,2", seconds)


@case("heartbeat-replay", fault="byte-identical copies of a frozen rank's last heartbeat record", leg="relay -> controller (control)")
async def heartbeat_replay() -> Outcome:
    """Rank 1's control relay (played here) sends one valid heartbeat record, then only
    copies of it, as an attacker replaying captured bytes would: the copies' sequence
    number does not increase, so rank 1 is declared dead on time and rank 0 goes on."""
    async with daemon_cluster(world_size=2, hosts=[[0]], rounds=2) as c:
        with diagnose(c):
            assert c.controller is not None
            stream = await trio.open_tcp_stream(*c.controller_address)
            async with stream:
                hello = encode_mux_record(MuxKind.CONTROL, encode_control_msg(Hello("replayer", (1,), (SIGNATURE,))), SALT)
                await stream.send_all(CHANNEL_MAGIC_CONTROL.to_bytes(4, "little") + hello.tobytes())
                await receive_exactly(stream, MUX_HEADER + 1)  # HelloAck
                heartbeat = encode_control_frame(heartbeat_frame(1, 1), SALT)
                record = encode_mux_record(MuxKind.DATA, heartbeat, SALT, rank=1).tobytes()
                t0 = mono()
                with trio.move_on_after(HEARTBEAT_TIMEOUT * 4):
                    while "rank 1 declared dead" not in c.controller.text:
                        await stream.send_all(record)
                        await trio.sleep(HEARTBEAT_TIMEOUT / 8)
                seconds = mono() - t0
            await c.controller.wait_log(re.compile(r"rank 1 declared dead: no heartbeat"))
            await c.controller.wait_log("replayed heartbeat")
            if seconds > HEARTBEAT_TIMEOUT * 2:
                raise MatrixFailure(f"rank 1 was declared dead only after {seconds:.2f} s of replays")
            await expect_consensus(c, [0], 2, lambda _k: {0})
    return Outcome("copies ignored (sequence not increasing); rank 1 declared dead on time; rank 0 went on alone", seconds)


# ---------------------------------------------------------------------------
# Connecting to nothing
# ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


async def _control_once(port: int) -> None:
    async with connect_control_client(("127.0.0.1", port), 0, 1, SALT, SIGNATURE, connect_attempts=3, connect_interval=0.05):
        pass



# ---------------------------------------------------------------------------
# Membership: ranks and hosts that come back, clusters that form without one
# ---------------------------------------------------------------------------

WINDOWS = 12
WINDOW_NUMEL = 256


def windowed_cluster(windows: int = WINDOWS, *, extra: dict[int, list[str]] | None = None, **options: Any) -> Any:
    """A daemon cluster of Local SGD trainers (``rank_worker --windows``: join, then
    average_window) whose controller lets dead ranks back for 60 s."""
    args = {r: ["--windows", str(windows), *(extra or {}).get(r, [])] for r in range(4)}
    controller_args = ["--rejoin-timeout", "60", *options.pop("controller_args", [])]
    return daemon_cluster(
        world_size=4, hosts=[[0, 1], [2, 3]], backend="torch", numel=WINDOW_NUMEL, pause=0.3, heartbeat_timeout=10.0,
        controller_args=controller_args, worker_args=args, **options,
    )


HOLD = 8  # survivors of a restart hold before this window until the restarted ranks asked back in


def held(survivors: tuple[int, ...]) -> dict[int, list[str]]:
    """Worker arguments that hold ``survivors`` before window :data:`HOLD` (see :func:`release_once_back`)."""
    return {r: ["--pause-before", f"{HOLD}:inf"] for r in survivors}


async def release_once_back(c: ProcessCluster, ranks: list[int], survivors: tuple[int, ...]) -> None:
    """The survivors go on once the restarted ``ranks`` have asked to come back in full:
    how long a process takes to start then decides nothing (they enter by window HOLD + 1)."""
    await c.wait_returns_asked(ranks)
    for rank in survivors:
        await c.resume(rank)


async def all_done(c: ProcessCluster) -> None:
    for rank in range(c.world_size):
        outcome = await c.wait_outcome(rank)
        if outcome["event"] != "done":
            raise MatrixFailure(f"rank {rank} did not finish: {outcome}")


def windows_exact(c: ProcessCluster, maybe_in: dict[int, set[int]], windows: int = WINDOWS) -> dict[int, set[int]]:
    try:
        contributors = check_windows(c, windows, WINDOW_NUMEL, maybe_in)
        check_final_and_joins(c, windows, contributors)
    except WindowMismatch as exc:
        raise MatrixFailure(f"WRONG OR STALE VALUE: {exc}") from exc
    return contributors


@case("rank-kill-restart", fault="rank SIGKILLed mid-training, restarted with the same command", leg="rank process", deadline=60)
async def rank_kill_restart() -> Outcome:
    async with windowed_cluster(extra=held((0, 1, 2))) as c:
        with diagnose(c):
            await c.wait_event(3, "window", window=2)
            t0 = mono()
            c.kill(3)
            await c.wait_exit(3)
            await c.restart(3)
            await release_once_back(c, [3], (0, 1, 2))
            start = (await c.wait_event(3, "joined"))["start"]
            first = await c.wait_event(3, "window", window=start)
            await all_done(c)
    windows_exact(c, {3: {3}})
    return Outcome(
        f"rank 3 came back at window {start} from the consensus of window {start - 1}; every window exact; "
        "all 4 end bit-identical", first["time"] - t0,
    )


@case("host-restart", fault="host 1's relay and ranks SIGKILLed, then restarted", leg="relay + rank processes", deadline=60)
async def host_restart() -> Outcome:
    async with windowed_cluster(extra=held((0, 1))) as c:
        with diagnose(c):
            await c.wait_event(2, "window", window=2)
            t0 = mono()
            for rank in (2, 3):
                c.kill(rank)
            c.kill_relay(1)
            for rank in (2, 3):
                await c.wait_exit(rank)
            await c.restart_relay(1)
            for rank in (2, 3):
                await c.restart(rank)
            await release_once_back(c, [2, 3], (0, 1))
            start = max([(await c.wait_event(rank, "joined"))["start"] for rank in (2, 3)])
            first = await c.wait_event(2, "window", window=start)
            await all_done(c)
    windows_exact(c, {3: {2, 3}})
    return Outcome(
        f"host 0 trained on alone; host 1 came back at window {start}; every window exact; all 4 end bit-identical",
        first["time"] - t0,
    )


@case("formation-missing-rank", fault="rank 3 starts 3 s late (--min-ranks 3 --formation-timeout 1)", leg="formation", deadline=60)
async def formation_missing_rank() -> Outcome:
    async with windowed_cluster(
        24, controller_args=["--min-ranks", "3", "--formation-timeout", "1"],
        extra={3: ["--start-delay", "3"], **held((0, 1, 2))},
    ) as c:
        with diagnose(c):
            await c.controller.wait_log("starting without ranks [3]")
            t0 = mono()
            await release_once_back(c, [3], (0, 1, 2))
            start = (await c.wait_event(3, "joined"))["start"]
            first = await c.wait_event(3, "window", window=start)
            await all_done(c)
    contributors = windows_exact(c, {}, 24)
    if start == 0 or any(contributors[w] != {0, 1, 2} for w in range(start)):
        raise MatrixFailure(f"the cluster did not start without rank 3 (it entered window {start}): {contributors}")
    return Outcome(f"ranks 0-2 started after 1 s; rank 3 joined at window {start} from the consensus", first["time"] - t0)


@case("rejoin-wrong-salt", fault="a state request signed with another salt", leg="rank -> relay -> controller (state)")
async def rejoin_wrong_salt() -> Outcome:
    async with daemon_cluster(world_size=4, hosts=[[0, 1], [2, 3]], rounds=4, worker_args={0: pause(2, 2.0)}) as c:
        with diagnose(c):
            await c.wait_event(0, "paused", round=2)
            t0 = mono()
            stream = await trio.open_tcp_stream(*c.relay_address(3))
            await stream.send_all(encode_state_request(3, 4, new_nonce(), SessionSalt(b"\x17" * 16)))
            with trio.fail_after(10):
                reply = await stream.receive_some(1024)
            await stream.aclose()
            if reply:
                raise MatrixFailure(f"a request with another salt got {len(reply)} bytes back")
            line = (await c.controller.wait_log(re.compile(r"state request from .*"))).group(0)
            seconds = mono() - t0
            await c.resume(0)
            await expect_consensus(c, [0, 1, 2, 3], 4, everyone(4))
    if "MAC mismatch" not in line:
        raise MatrixFailure(f"the refusal does not say why: {line}")
    return Outcome("no byte back; the controller logged the refused request (MAC mismatch); every round exact", seconds)

__all__ = [
    "MATRIX",
    "Case",
    "CaseRecord",
    "MatrixFailure",
    "Outcome",
    "case_by_name",
    "check_round",
    "expected",
    "run_case",
]
