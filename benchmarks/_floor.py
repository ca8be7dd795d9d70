"""The protocol floor: the shortest round any implementation of flodl's wire
protocol could reach on this machine.

The protocol makes some work mandatory whatever the code: every frame that
crosses TCP is signed by its sender and verified by its receiver
(HMAC-SHA256 over all of it), a relay <-> controller record carries a second
MAC over the same bytes, ranks reach their relay over loopback TCP - or, on
flodl_trio's local leg (docs/wire.md), over a Unix socket with no MACs at
all - and, because a record's MAC comes before its payload and the consensus
depends on every host, a host's uplink and the consensus's downlink cannot
overlap. Pricing only that work at this
machine's measured speeds, and assuming a perfect schedule on every core,
gives a lower bound. When it is above a target, no implementation of the
protocol meets that target on this machine; on one with more cores or a
faster hash it may.

Deliberately left out (so the bound stays a bound): the fold, the divide,
bf16 conversions, copies into the rank's tensors, interpreter and event-loop
cost, TCP/IP header bytes on the link, and everything the other host does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import resource
import socket
import threading
import time
from dataclasses import dataclass

MUX_HEADER = 25  # bytes before a relay <-> controller record's payload (docs/wire.md)


def frame_len(numel: int, dtype: str) -> int:
    """One RoundFrame of a single 1-D tensor (docs/wire.md): header 17 + tensor header 14 + data + MAC 8.

    Restated here because the orchestrator must not import numpy (its RSS floors
    every measured process); a test pins it to the wire layer's own count.
    """
    return 25 + 14 + numel * (2 if dtype == "bf16" else 4)
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt]?)(i?)(bit|bps))?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_IEC = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(frozen=True)
class MachineCosts:
    """What this machine charges for the protocol's mandatory work."""

    hmac_bytes_per_s: float  # HMAC-SHA256 throughput of one core
    loopback_cpu_s_per_byte: float  # CPU of one loopback TCP transfer, sender and receiver together
    cores: int
    unix_cpu_s_per_byte: float | None = None  # the same over a Unix socket (None: as loopback TCP)

    @property
    def local_cpu_s_per_byte(self) -> float:
        """A rank <-> relay transfer on the local leg."""
        return self.loopback_cpu_s_per_byte if self.unix_cpu_s_per_byte is None else self.unix_cpu_s_per_byte

    def describe(self) -> str:
        return (f"HMAC-SHA256 {self.hmac_bytes_per_s / 1e9:.2f} GB/s on one core; a loopback TCP transfer "
                f"{self.loopback_cpu_s_per_byte * (1 << 20) * 1e3:.2f} ms of CPU per MiB (sender + receiver), "
                f"a Unix-socket one {self.local_cpu_s_per_byte * (1 << 20) * 1e3:.2f}; {self.cores} cores")


@dataclass(frozen=True)
class Floor:
    """A lower bound on one round, and what it is made of."""

    ms: float
    hash_passes: int
    link_ms: float = 0.0

    def describe(self, costs: MachineCosts) -> str:
        link = f"{self.link_ms:.0f} ms on the link + " if self.link_ms else ""
        return (f"{link}{self.hash_passes} hash passes at {costs.hmac_bytes_per_s / 1e9:.2f} GB/s and loopback "
                f"copies on {costs.cores} cores")


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate: ``1gbit``, ``500mbit``, ``10mbps`` (bytes), ``1mibit``
    (binary prefix) or a bare number (bits), as tc reads them."""
    m = _RATE.match(rate)
    if not m:
        raise ValueError(f"cannot read the link rate {rate!r} (expected e.g. 1gbit, 500mbit, 100mbps)")
    value, prefix, binary, unit = float(m.group(1)), (m.group(2) or "").lower(), m.group(3), (m.group(4) or "bit")
    scale = (_IEC if binary else _SCALE)[prefix]
    bits = value * scale * (8 if unit.lower() == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"link rate {rate!r} is not positive")
    return bits


def _cpu_work_ms(
    costs: MachineCosts, frame_bytes: int, hash_passes: int, transfers: int, local_transfers: int = 0
) -> float:
    """The mandatory CPU work, spread perfectly over every core."""
    cpu_s = (hash_passes * frame_bytes / costs.hmac_bytes_per_s
             + transfers * frame_bytes * costs.loopback_cpu_s_per_byte
             + local_transfers * frame_bytes * costs.local_cpu_s_per_byte)
    return cpu_s / costs.cores * 1e3


def one_host_floor(costs: MachineCosts, frame_bytes: int, ranks: int, local_leg: bool = False) -> Floor:
    """One host, one relay carrying ``ranks`` ranks, the controller beside it.

    Hash passes: the relay signs its HostFrame twice (the frame's MAC and the
    record's), the controller verifies the record and signs the Broadcast
    twice, the relay verifies the Broadcast: 6. Over TCP each rank also signs
    its frame, the relay verifies each one and each rank verifies the
    consensus: 3K + 6 in all; on the local leg those 3K passes are gone.
    Transfers: K up to the relay and K back down (loopback TCP, or the Unix
    socket), one each way between relay and controller. All of it shares the
    machine's cores.
    """
    passes = 6 if local_leg else 3 * ranks + 6
    legs = 2 * ranks
    work = _cpu_work_ms(costs, frame_bytes, passes, 2 + (0 if local_leg else legs), legs if local_leg else 0)
    return Floor(work, passes)


def two_host_floor(
    costs: MachineCosts, frame_bytes: int, rate: str, ranks_per_host: int, local_leg: bool = False, lanes: int = 1
) -> Floor:
    """Two hosts joined by a ``rate`` link, the controller on host A.

    The remote host's HostFrame must be on the controller before the
    consensus can leave, and a record's MAC precedes its payload, so its
    uplink and the downlink add up: 2 x (record bytes) at the link rate.
    Between the consensus arriving at that host and its next HostFrame
    leaving, its relay signs the HostFrame twice and its K frames cross to
    the relay; over TCP the K ranks also sign and the relay verifies K frames
    (2K + 2 hash passes in all, 2 on the local leg). That work cannot overlap
    either link transfer. Even with every core of this machine given to it,
    it takes that CPU divided by the cores. With ``lanes`` the consensus of
    each lane comes down while the next goes up: only the last lane's
    downlink follows the whole uplink, (1 + 1 / lanes) x the record bytes.
    """
    link_ms = (1 + 1 / lanes) * (frame_bytes + lanes * MUX_HEADER) * 8 / parse_rate(rate) * 1e3
    passes = 2 if local_leg else 2 * ranks_per_host + 2
    tcp, unix = (0, ranks_per_host) if local_leg else (ranks_per_host, 0)
    return Floor(link_ms + _cpu_work_ms(costs, frame_bytes, passes, tcp, unix), passes, link_ms)


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_hmac(nbytes: int, repeats: int) -> float:
    """Best-of-``repeats`` HMAC-SHA256 throughput over ``nbytes``, bytes/s of wall time on one core."""
    data = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    key = os.urandom(16)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        hmac.new(key, data, hashlib.sha256).digest()
        best = min(best, time.perf_counter() - t0)
    return len(data) / best


PROBE_STALL_S = 30.0  # a loopback probe that moves nothing for this long is broken, not slow


def _transfer_cpu_s(tx: socket.socket, rx: socket.socket, payload: memoryview) -> float:
    """CPU seconds of this process while ``payload`` goes from ``tx`` to ``rx``."""
    sink = bytearray(1 << 20)
    rx.settimeout(PROBE_STALL_S)
    sender = threading.Thread(target=tx.sendall, args=(payload,))
    cpu0 = _process_cpu_s()
    sender.start()
    got = 0
    while got < len(payload):
        n = rx.recv_into(sink)
        if n == 0:
            raise ConnectionError(f"transfer probe: peer closed after {got} of {len(payload)} bytes")
        got += n
    sender.join()
    return _process_cpu_s() - cpu0


def measure_loopback(nbytes: int, repeats: int) -> float:
    """Best-of-``repeats`` CPU seconds per byte of one loopback TCP transfer (both ends, this process)."""
    payload = memoryview(bytearray(nbytes))
    best = float("inf")
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(PROBE_STALL_S)
        for _ in range(repeats):
            with socket.create_connection(server.getsockname(), timeout=PROBE_STALL_S) as tx:
                rx, _addr = server.accept()
                with rx:
                    best = min(best, _transfer_cpu_s(tx, rx, payload))
    return best / nbytes


def measure_unix(nbytes: int, repeats: int) -> float:
    """The same over a Unix socket pair, with the local leg's 4 MiB socket buffers."""
    payload = memoryview(bytearray(nbytes))
    best = float("inf")
    for _ in range(repeats):
        tx, rx = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with tx, rx:
            for sock in (tx, rx):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            best = min(best, _transfer_cpu_s(tx, rx, payload))
    return best / nbytes


def measure_costs(nbytes: int = 64 << 20, repeats: int = 3) -> MachineCosts:
    """This machine's HMAC, loopback and Unix-socket prices (about a second of work at 64 MiB)."""
    return MachineCosts(
        measure_hmac(nbytes, repeats), measure_loopback(nbytes, repeats), os.cpu_count() or 1,
        measure_unix(nbytes, repeats),
    )
