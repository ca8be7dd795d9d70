"""flodl_trio's ControlFrame payloads for liveness (documented in docs/liveness.md).

All three ride in ControlFrames on the control channel, little-endian:

* Heartbeat (rank -> coordinator), msg_kind 5: ``b"HB01" | u32 rank | u64 seq``
* Beacon (coordinator -> rank), msg_kind 5:
  ``b"BC01" | u64 seq | u32 world_size | u32 dead_count | u32 heartbeat_timeout_ms``
  (the rank paces its heartbeats from the coordinator's timeout, so the two
  sides cannot be configured into a false death); from a controller that keeps
  a resume record, ``b"BC02"``, the same fields then ``u32 outage_ms``: how long
  the rank should hold for it if it is lost (docs/liveness.md, "A lost controller")
* Notice (coordinator -> rank), msg_kind 1: ``b"NT01" | UTF-8 reason`` - why the rank
  is being cut off (declared dead, refused at formation) just before its
  connection is closed, so the rank can raise that reason instead of "EOF".
* RunOver (coordinator -> rank), msg_kind 1: ``b"FN01"`` - the run is over (every
  rank finished or exited); the coordinator stops watching and the connection
  closes next, which the rank then takes as the end, not as the coordinator lost.
"""

from __future__ import annotations

import struct

import attrs

from ..errors import FramingError
from .control_frame import ControlFrame, ControlKind

_HEARTBEAT = struct.Struct("<4sIQ")
_BEACON = struct.Struct("<4sQIII")
_BEACON_V2 = struct.Struct("<4sQIIII")
HEARTBEAT_TAG = b"HB01"
BEACON_TAG = b"BC01"
BEACON_V2_TAG = b"BC02"
NOTICE_TAG = b"NT01"
RUN_OVER_TAG = b"FN01"


@attrs.frozen
class Heartbeat:
    rank: int
    seq: int


@attrs.frozen
class Beacon:
    seq: int
    world_size: int
    dead_count: int
    heartbeat_timeout_ms: int
    outage_ms: int = 0  # BC02: how long to hold for a lost controller (0: BC01, nothing said)


@attrs.frozen
class Notice:
    reason: str


@attrs.frozen
class RunOver:
    """Every rank finished or exited: the coordinator's watch is over."""


LivenessMessage = Heartbeat | Beacon | Notice | RunOver


def heartbeat_frame(rank: int, seq: int) -> ControlFrame:
    return ControlFrame(ControlKind.HEARTBEAT, _HEARTBEAT.pack(HEARTBEAT_TAG, rank, seq))


def timeout_ms(seconds: float) -> int:
    """A heartbeat timeout as a beacon carries it: whole milliseconds, rounded down (a rank
    pacing itself from it beats at least as often as asked), at least 1 (a rank reads 0 as
    "no pace said") and at most a u32's 2^32 - 1 (about 49 days: longer is sent capped)."""
    return min(max(int(seconds * 1000), 1), 0xFFFFFFFF)


def beacon_frame(seq: int, world_size: int, dead_count: int, heartbeat_timeout_ms: int, outage_ms: int = 0) -> ControlFrame:
    if outage_ms > 0:
        payload = _BEACON_V2.pack(BEACON_V2_TAG, seq, world_size, dead_count, heartbeat_timeout_ms, outage_ms)
    else:
        payload = _BEACON.pack(BEACON_TAG, seq, world_size, dead_count, heartbeat_timeout_ms)
    return ControlFrame(ControlKind.HEARTBEAT, payload)


def notice_frame(reason: str) -> ControlFrame:
    return ControlFrame(ControlKind.CONTROL, NOTICE_TAG + reason.encode("utf-8"))


def run_over_frame() -> ControlFrame:
    return ControlFrame(ControlKind.CONTROL, RUN_OVER_TAG)


def decode_liveness(frame: ControlFrame) -> LivenessMessage | None:
    """The liveness message a (MAC-verified) ControlFrame carries; None for other traffic."""
    tag = frame.payload[:4]
    try:
        if frame.msg_kind == ControlKind.HEARTBEAT and tag == HEARTBEAT_TAG:
            _, rank, seq = _HEARTBEAT.unpack(frame.payload)
            return Heartbeat(rank, seq)
        if frame.msg_kind == ControlKind.HEARTBEAT and tag == BEACON_TAG:
            _, seq, world, dead, timeout_ms = _BEACON.unpack(frame.payload)
            return Beacon(seq, world, dead, timeout_ms)
        if frame.msg_kind == ControlKind.HEARTBEAT and tag == BEACON_V2_TAG:
            _, seq, world, dead, timeout_ms, outage_ms = _BEACON_V2.unpack(frame.payload)
            return Beacon(seq, world, dead, timeout_ms, outage_ms)
        if frame.msg_kind == ControlKind.CONTROL and tag == NOTICE_TAG:
            return Notice(frame.payload[4:].decode("utf-8", errors="replace"))
        if frame.msg_kind == ControlKind.CONTROL and frame.payload == RUN_OVER_TAG:
            return RunOver()
    except struct.error:
        raise FramingError(
            f"{tag!r} liveness payload has {len(frame.payload)} bytes, which is not its fixed size"
        ) from None
    return None
