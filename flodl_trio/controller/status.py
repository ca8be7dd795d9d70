"""The status page: the controller's port answers ``GET`` with one JSON document.

An operator curls the controller (``curl http://controller:port/``) to see the
dead ranks, the returns in progress, the relays and the counters. The request
head is read for at most the handshake bound and 8 KiB, then ignored: every
request gets the same page, and a client that sends nothing gets it too once
the bound passes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import trio

from ..transport.stream import CONNECTION_LOST, MessageStream

REQUEST_HEAD_LIMIT = 8192  # bytes of a request head read before answering anyway


async def serve_status(conn: MessageStream, page: Mapping[str, object], bound: float) -> None:
    """Answer ``page`` as JSON over HTTP/1.0 and close the connection."""
    await _read_request_head(conn, bound)
    body = json.dumps(page).encode()
    head = f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    try:
        await conn.send_chunks([head, body])
    except CONNECTION_LOST:
        pass
    await conn.aclose()


async def _read_request_head(conn: MessageStream, bound: float) -> None:
    request = bytearray()
    with trio.move_on_after(bound):
        while b"\r\n\r\n" not in request and len(request) < REQUEST_HEAD_LIMIT:
            try:
                chunk = await conn.stream.receive_some(4096)
            except CONNECTION_LOST:
                return
            if not chunk:
                return
            request += chunk


__all__ = ["serve_status"]
