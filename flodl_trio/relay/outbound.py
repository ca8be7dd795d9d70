"""What a relay channel's tasks queue for its sole upstream writer.

A bounded memory channel of these joins the rank readers and the upstream
reader to the outbound writer. An item that holds a buffer lent from the
channel's pool owns it: the writer gives it back once the item is written
(or the queueing task, if the item never got queued).
"""

from __future__ import annotations

import attrs
import trio

from ..transport.buffers import ReceiveBuffer
from ..wire.mux import RankExit, RankFinished, RankJoin
from ..wire.round_frame import EncodedFrame
from .host_fold import FoldedHostFrame


@attrs.frozen
class RawHostFrame:
    """A single rank's verified frame, forwarded upstream byte for byte; ``buffer``
    (lent from the pool) holds it until it has been written."""

    body: memoryview
    buffer: ReceiveBuffer


@attrs.frozen
class SealedHostFrame:
    """A HostFrame record computed and signed while the round's last frame arrived;
    ``buffer`` (lent from the pool) holds it until it has been written."""

    record: EncodedFrame
    buffer: ReceiveBuffer


@attrs.frozen
class DataRecord:
    """A control-channel blob going upstream, tagged with its rank, never parsed."""

    rank: int
    payload: bytes


# What a channel says about its ranks (the channel writes these itself, whatever its role).
RankNotice = RankExit | RankJoin | RankFinished
PooledHostFrame = RawHostFrame | SealedHostFrame
Outbound = PooledHostFrame | FoldedHostFrame | DataRecord | RankNotice
Outbox = trio.MemorySendChannel[Outbound]

__all__ = ["DataRecord", "Outbound", "Outbox", "PooledHostFrame", "RankNotice", "RawHostFrame", "SealedHostFrame"]
