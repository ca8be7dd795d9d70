"""A relay sends its lanes to the shards in turns: one lane to each shard, starting
with the shard after the relay's own place among the hosts, then each one's next
lane (ShardLinks._turns): at each moment the relays send to different shards, and
each shard has its first lane from every host early enough to fan it out while the
rest goes up."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from flodl_trio.relay.config import ChannelKind, RelayConfig
from flodl_trio.relay.shards import LANE_TURN_PATIENCE_S, ShardLinks
from flodl_trio.transport.settings import NetBounds
from flodl_trio.transport.stream import MessageStream
from flodl_trio.wire.round_frame import EncodedFrame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"lane-turns-salt!")
SHARDS = 4
LANES = 1 + 2 * SHARDS  # lane 0 (the controller's) and two lanes a shard


def links_of_host(host: int, ranks_per_host: int = 2) -> tuple[ShardLinks, list[trio.testing.MemoryReceiveStream]]:
    ranks = tuple(range(host * ranks_per_host, (host + 1) * ranks_per_host))
    config = RelayConfig(ChannelKind.DATA, ("ctl", 1), f"host{host}", ranks, SHARDS * ranks_per_host, SALT,
                         shards=tuple(("shard", 1000 + i) for i in range(SHARDS)))
    links = ShardLinks(config, lambda *args: None, lanes=None)  # type: ignore[arg-type]
    ends = []
    for shard in range(SHARDS):
        send, receive = trio.testing.memory_stream_one_way_pair()
        links.conns[shard] = MessageStream(trio.StapledStream(send, trio.testing.memory_stream_one_way_pair()[1]))
        ends.append(receive)
    return links, ends


class SignedOnDemand:
    """A HostFrame's lanes as a relay's uplink gives them (``record(k)``, signed when first
    asked for); lane k's record is 10_000 + k bytes long, so what was sent says which lane
    it was. ``asked`` is the order the lanes were asked for in."""

    def __init__(self, count: int = LANES) -> None:
        self.count = count
        self.asked: list[int] = []

    async def record(self, index: int) -> EncodedFrame:
        self.asked.append(index)
        return EncodedFrame([bytes(10_000 + index)], 10_000 + index)


def lane_records() -> SignedOnDemand:
    return SignedOnDemand()


async def sent_lanes(host: int) -> tuple[list[int], ShardLinks]:
    links, _ends = links_of_host(host)
    sent: list[int] = []
    await links._send_missing(lane_records(), sent.append)
    return [n - 10_000 for n in sent if n >= 10_000], links


async def test_each_shard_gets_one_lane_in_turn_from_the_one_after_the_relays_place():
    for host in range(SHARDS):
        order, links = await sent_lanes(host)
        owners = [links.owner(lane) for lane in order]
        first = (host + 1) % SHARDS
        turn = [(first + k) % SHARDS for k in range(SHARDS)]
        assert owners == turn + turn, (host, owners)  # a lane to each, then the next lane of each
        assert sorted(order) == list(range(1, LANES))  # every lane once
        for shard in range(SHARDS):  # each shard's own lanes in lane order
            mine = [lane for lane in order if links.owner(lane) == shard]
            assert mine == sorted(mine)


async def test_each_lane_is_signed_as_its_turn_nears_so_the_first_goes_up_before_the_last_is_signed():
    """The lanes are not all signed before the first goes up (a 64 MiB frame's lanes take
    tens of ms to sign): each shard's next lane is asked for once its previous one is in
    its socket."""
    for host in range(SHARDS):
        links, _ends = links_of_host(host)
        lanes = SignedOnDemand()
        events: list[str] = []
        recording = lanes.record

        async def record(index: int) -> EncodedFrame:
            events.append(f"signed {index}")
            return await recording(index)

        lanes.record = record  # type: ignore[method-assign]
        await links._send_missing(lanes, lambda n: events.append(f"sent {n - 10_000}") if n >= 10_000 else None)
        first_sent = events.index(next(e for e in events if e.startswith("sent")))
        assert first_sent < len(events) - 1 and any(e.startswith("signed") for e in events[first_sent:]), events
        assert sorted(lanes.asked) == list(range(1, LANES))  # every lane signed once


async def test_at_each_turn_the_relays_send_to_different_shards():
    owners_by_host = []
    for host in range(SHARDS):
        order, links = await sent_lanes(host)
        owners_by_host.append([links.owner(lane) for lane in order])
    for step in range(LANES - 1):
        at_step = [owners[step] for owners in owners_by_host]
        assert sorted(at_step) == list(range(SHARDS)), (step, at_step)


@pytest.mark.deadline(60)
async def test_a_shard_that_stops_reading_holds_the_others_lanes_back_one_patience_at_most(autojump_clock):
    """Shard 1 (host 0's first turn) takes nothing: the other shards still get every
    lane within one LANE_TURN_PATIENCE_S, and the stalled write ends at the write bound,
    closing that connection (its reader then reports the shard)."""
    ranks, shards, lanes = (0,), 4, 1 + 4 * 4
    config = RelayConfig(ChannelKind.DATA, ("ctl", 1), "host0", ranks, shards, SALT,
                         shards=tuple(("shard", 1000 + i) for i in range(shards)),
                         bounds=NetBounds(write_stall=5.0))
    links = ShardLinks(config, lambda *args: None, lanes=None)  # type: ignore[arg-type]
    for shard in range(shards):
        if shard == 1:
            stalled, _never_read = trio.testing.lockstep_stream_pair()
            links.conns[shard] = MessageStream(stalled, bounds=config.bounds)
        else:
            send, _receive = trio.testing.memory_stream_one_way_pair()
            links.conns[shard] = MessageStream(trio.StapledStream(send, trio.testing.memory_stream_one_way_pair()[1]),
                                               bounds=config.bounds)
    when: dict[int, float] = {}
    await links._send_missing(SignedOnDemand(lanes), lambda n: when.setdefault(n - 10_000, trio.current_time()))
    others = [lane for lane in range(1, lanes) if links.owner(lane) != 1]
    assert all(lane in when for lane in others)
    assert max(when[lane] for lane in others) <= LANE_TURN_PATIENCE_S + 0.01
    assert not any(lane in when for lane in range(1, lanes) if links.owner(lane) == 1)
    assert trio.current_time() >= 5.0  # the stalled write ended at its bound
