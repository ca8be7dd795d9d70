"""Cases: the daemons' listening ports - huge lengths, slow-loris clients, a port scanner."""

from __future__ import annotations

import random
import re

import trio

from ...wire.constants import CHANNEL_MAGIC_CONTROL, CHANNEL_MAGIC_DATA
from ...wire.handshake import encode_control_handshake, encode_data_handshake
from ...wire.mux import Hello, MuxKind
from ..processes import ProcessCluster
from .clusters import SALT, SCALE, SIGNATURE, MiB, cap_address_space, check_memory_growth, daemon_cluster, diagnose, formed
from .hostile import HUGE_LENGTH, channel_magic, forged_mux_header, raw_relay, slowloris, wait_closed_by_peer
from .oracle import everyone, expect_consensus, last_outcome, mono
from .registry import MatrixFailure, Outcome, case


def half(message: bytes) -> bytes:
    """The first half of a handshake or header: enough to be one, too little to be answered."""
    return message[: len(message) // 2]


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
                await attacker.send_all(channel_magic(CHANNEL_MAGIC_DATA) + forged_mux_header(MuxKind.CONTROL, HUGE_LENGTH))
                await wait_closed_by_peer(attacker)
                refused = mono() - t0
            await expect_consensus(c, [0, 1], 4, everyone(2))
            await c.controller.wait_log(re.compile(r"refused: .*payload length 4294967295 exceeds the frame ceiling"))
            peak, hwm = check_memory_growth("controller", c.controller, before)
    return Outcome(
        f"refused at the Hello ceiling (VmPeak +{peak / MiB:.1f} MiB, VmHWM +{hwm / MiB:.1f} MiB); rounds went on correct", refused,
    )


@case("controller-huge-record-after-hello", fault="MuxRecord header declaring 2**32-1 bytes after a valid Hello", leg="controller port")
async def controller_huge_record_after_hello() -> Outcome:
    # World of 3: host 0 carries ranks 0, 1; the test is "relay mallory" carrying rank 2.
    async with daemon_cluster(world_size=3, hosts=[[0, 1]], rounds=2) as c:
        with diagnose(c):
            assert c.controller is not None
            attacker = await raw_relay(c.controller_address, CHANNEL_MAGIC_DATA, Hello("mallory", (2,), ()))
            async with attacker:
                await formed(c)
                await c.wait_event(0, "sending", round=0)
                cap_address_space(c.controller)
                before = c.controller.memory()
                t0 = mono()
                await attacker.send_all(forged_mux_header(MuxKind.HOST_FRAME, HUGE_LENGTH))
                await wait_closed_by_peer(attacker)
                refused = mono() - t0
            rounds = await expect_consensus(c, [0, 1], 2, lambda _k: {0, 1})
            match = await c.controller.wait_log(re.compile(r"relay mallory .*dropped for breaking the protocol .*"))
            line = match.group(0)
            if "payload length 4294967295 exceeds the frame ceiling" not in line:
                raise MatrixFailure(f"the controller dropped relay mallory for another reason: {line!r}")
            peak, _hwm = check_memory_growth("controller", c.controller, before)
            seconds = last_outcome(rounds, 1, t0 + refused) - t0
    return Outcome(
        f"controller dropped relay mallory (FramingError, no allocation: VmPeak +{peak / MiB:.1f} MiB); "
        "ranks 0,1 got their 2-rank consensus", seconds,
    )


@case("slowloris-controller", fault="slow-loris: half a channel magic / half a Hello header, then silence", leg="controller port")
async def slowloris_controller() -> Outcome:
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=6, pause=0.25, controller_env={"FLODL_NET_TIMEOUT_SCALE": SCALE},
        controller_args=["--keep-serving"],  # its status page outlives the ranks
    ) as c:
        with diagnose(c):
            controller = c.controller
            assert controller is not None
            await c.wait_round(0, 0)
            magic = channel_magic(CHANNEL_MAGIC_DATA)
            held: dict[str, float] = {}

            async def loris(name: str, prefix: bytes, deadline: float, line: str) -> None:
                held[name] = await slowloris(c.controller_address, prefix, deadline, controller, line)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(loris, "magic", half(magic), 0.5, "no channel magic (timed out)")
                nursery.start_soon(
                    loris, "Hello", magic + half(forged_mux_header(MuxKind.CONTROL, 10)), 1.0,
                    "no Hello within the handshake deadline",
                )
            await expect_consensus(c, [0, 1], 6, everyone(2))
            rejected = (await c.status())["stats"]["rejected"]
            if rejected != 2:
                raise MatrixFailure(f"controller counted {rejected} rejections for 2 slow-loris connections")
    return Outcome(
        f"closed after {held['magic']:.2f} s (half magic; bound 0.5 s) and {held['Hello']:.2f} s (half Hello header; "
        "bound 1 s), both counted; concurrent rounds correct", max(held.values()),
    )


async def _slowloris_relay(prefix: bytes, address_of: str) -> float:
    """Host 0's relay (its socket bounds scaled down) is held by ``prefix`` on its
    ``address_of`` port ("data" or "control"); its rank keeps averaging."""
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=6, pause=0.25, relay_env={0: {"FLODL_NET_TIMEOUT_SCALE": SCALE}},
    ) as c:
        with diagnose(c):
            await c.wait_round(0, 0)
            relay = c.relay_processes(0)[0]
            address = c.relay_address(0) if address_of == "data" else c.control_address(0)
            held = await slowloris(address, prefix, 1.0, relay, "no complete handshake within the deadline")
            await expect_consensus(c, [0, 1], 6, everyone(2))
    return held


@case("slowloris-relay-data", fault="slow-loris: half a data handshake, then silence", leg="relay data port")
async def slowloris_relay_data() -> Outcome:
    held = await _slowloris_relay(half(encode_data_handshake(0, 2)), "data")
    return Outcome("refused at the 1 s handshake deadline; the relay's own rank kept averaging correctly", held)


@case("slowloris-relay-control", fault="slow-loris: half a control handshake, then silence", leg="relay control port")
async def slowloris_relay_control() -> Outcome:
    held = await _slowloris_relay(half(encode_control_handshake(0, 2, SIGNATURE, SALT)), "control")
    return Outcome("refused at the 1 s handshake deadline; heartbeats and rounds unaffected", held)


def scanner_payloads(rng: random.Random) -> list[bytes]:
    """What a port scanner sends, shuffled: 60 bare connects, 60 random blobs that
    look like no channel (nor HTTP), 30 data-channel magics followed by garbage."""
    magic = channel_magic(CHANNEL_MAGIC_DATA)
    channels = (magic, channel_magic(CHANNEL_MAGIC_CONTROL))
    payloads: list[bytes] = [b""] * 60
    while len(payloads) < 120:
        blob = rng.randbytes(rng.randint(1, 64))
        if blob[:1] not in (b"G", b"P") and blob[:4] not in channels:
            payloads.append(blob)
    payloads += [magic + rng.randbytes(rng.randint(1, 80)) for _ in range(30)]
    rng.shuffle(payloads)
    return payloads


async def probe(c: ProcessCluster, blob: bytes) -> None:
    """Connect to the controller, send ``blob`` (if any) and EOF, and wait to be hung up on."""
    stream = await trio.open_tcp_stream(*c.controller_address)
    async with stream:
        try:  # a scanner does not care how the other side hangs up
            if blob:
                await stream.send_all(blob)
            await stream.send_eof()
        except (trio.BrokenResourceError, OSError):
            pass
        await wait_closed_by_peer(stream)


async def rejected_count(c: ProcessCluster) -> int:
    return int((await c.status())["stats"]["rejected"])


@case("port-scanner", fault="port scanner: 150 connect-and-close / random-bytes / garbage-Hello connections", leg="controller port")
async def port_scanner() -> Outcome:
    payloads = scanner_payloads(random.Random(20241130))
    async with daemon_cluster(
        world_size=2, hosts=[[0], [1]], rounds=8, pause=0.15, control=False, controller_args=["--keep-serving"],
    ) as c:
        with diagnose(c):
            await c.wait_round(0, 0)
            limiter = trio.CapacityLimiter(8)
            t0 = mono()

            async def limited_probe(blob: bytes) -> None:
                async with limiter:
                    await probe(c, blob)

            async with trio.open_nursery() as nursery:
                for blob in payloads:
                    nursery.start_soon(limited_probe, blob)
            while await rejected_count(c) < len(payloads):
                await trio.sleep(0.02)
            seconds = mono() - t0
            await expect_consensus(c, [0, 1], 8, everyone(2))
            rejected = await rejected_count(c)
            if rejected != len(payloads):
                raise MatrixFailure(f"controller counted {rejected} rejections for {len(payloads)} probes")
    return Outcome(f"controller kept serving (rounds correct) and counted exactly {rejected} rejections", seconds)
