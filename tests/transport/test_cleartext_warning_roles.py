"""docs/wire.md, "Cleartext warning": a connection to *or from* a peer outside private
address space is warned about once per peer, whichever role accepts it - the shard
included (relays and the controller send it lanes in cleartext too)."""

from __future__ import annotations

import logging

import pytest
import trio

from flodl_trio import SessionSalt
from flodl_trio.shard import core as shard_core
from flodl_trio.shard import open_shard
from flodl_trio.transport import connect as peers
from flodl_trio.wire.constants import CHANNEL_MAGIC_SHARD

SALT = SessionSalt(b"cleartext-warns!")


@pytest.mark.deadline(30)
async def test_a_shard_warns_once_about_a_peer_outside_private_address_space(monkeypatch, caplog):
    monkeypatch.setattr(peers, "_warned_peers", set())
    monkeypatch.setattr(shard_core, "peer_host", lambda stream: "8.8.8.8")  # as if dialled from the internet
    caplog.set_level(logging.WARNING, logger="flodl_trio.net")
    async with open_shard(salt=SALT) as shard:
        for _ in range(2):
            stream = await trio.open_tcp_stream("127.0.0.1", shard.port)
            await stream.send_all(CHANNEL_MAGIC_SHARD.to_bytes(4, "little"))
            await stream.aclose()  # (no setup follows: the shard just closes it)
        while not peers._warned_peers:
            await trio.sleep(0.01)
    warnings = [r.getMessage() for r in caplog.records if r.name == "flodl_trio.net" and "NOT encrypted" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("shard: peer 8.8.8.8"), warnings


@pytest.mark.deadline(30)
async def test_a_relay_warns_once_about_a_rank_connecting_from_outside_private_address_space(monkeypatch, caplog):
    """A relay listening beyond loopback (``--listen-host``) may take ranks of other machines."""
    from flodl_trio.relay import core as relay_core
    from flodl_trio.testing import open_local_cluster

    monkeypatch.setattr(peers, "_warned_peers", set())
    monkeypatch.setattr(relay_core, "peer_host", lambda stream: "2001:4860:4860::8888")
    caplog.set_level(logging.WARNING, logger="flodl_trio.net")
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=SALT, local_leg=False) as cluster:
        stream = await trio.open_tcp_stream(*cluster.relay_address(0))
        await stream.aclose()
        while not peers._warned_peers:
            await trio.sleep(0.01)
    warnings = [r.getMessage() for r in caplog.records if r.name == "flodl_trio.net" and "NOT encrypted" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("relay host0: peer 2001:4860:4860::8888"), warnings
