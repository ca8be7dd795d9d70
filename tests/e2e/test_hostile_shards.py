"""Hostile peers around the reduction shards: relays and shards that hold the salt but
send what docs/wire.md does not allow. Each costs only itself (docs/wire.md, "Shards",
"A lost shard", "Validation order, and the errors you see"): the honest ranks' rounds
complete, exactly, nothing hangs, and the log names the peer and what was wrong."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import pytest
import trio

from flodl_trio.shard import open_shard
from flodl_trio.testing import hold_open
from flodl_trio.wire import DTYPE_BF16, RoundFrame, TensorPayload
from flodl_trio.wire.lanes import lane_owner, lane_tag, read_lane_tag
from flodl_trio.wire.mux import MuxKind, Pieces, encode_control_record, mux_signed_header
from tests.e2e.test_shards import (
    RawHost,
    assert_means,
    host_beside_a_raw_one,
    survivors_round,
    two_hosts_on,
    two_ranks_rounds,
)

LOOP = "127.0.0.1"
NUMEL, LANES = 40_000, 5  # 2 shards: 9 lanes, 4 a shard, 5,000 elements each


def _short_payload(part: RoundFrame) -> RoundFrame:
    """``part`` with its first piece's payload one element short of its shape."""
    first = part.tensors[0]
    return RoundFrame([TensorPayload(first.dtype, first.shape, bytes(first.data)[:-4]), *part.tensors[1:]],
                      part.kind, part.weight)


# -- a relay that sends a shard what it must not ---------------------------------


async def _pieces_then(bad: RawHost, lanes: Callable[[int], list[bytes]]) -> None:
    """``Pieces{1}`` to both shards, then each lane's records as ``lanes(lane)`` makes them."""
    for conn in bad.to_shards:
        await conn.send_chunks([encode_control_record(Pieces(1), bad.salt)])
    for lane in range(1, len(bad.parts)):
        for record in lanes(lane):
            await bad.to_shards[lane_owner(lane, 2)].send_chunks([record])


def _record(bad: RawHost, lane: int) -> bytes:
    return b"".join(bytes(chunk) for chunk in bad._record(bad.parts[lane]))


async def _short(bad: RawHost) -> None:
    bad.parts[1] = _short_payload(bad.parts[1])
    await bad.send_pieces()


async def _bf16(bad: RawHost) -> None:
    first = bad.parts[2].tensors[0]
    bad.parts[2] = RoundFrame([TensorPayload(DTYPE_BF16, first.shape, bytes(first.data)[: first.numel * 2]),
                               *bad.parts[2].tensors[1:]], bad.parts[2].kind, bad.parts[2].weight)
    await bad.send_pieces()


async def _bad_mac(bad: RawHost) -> None:
    def lanes(lane: int) -> list[bytes]:
        raw = bytearray(_record(bad, lane))
        if lane == 1:
            raw[len(raw) // 2] ^= 0x10
        return [bytes(raw)]

    await _pieces_then(bad, lanes)


async def _twice(bad: RawHost) -> None:
    await _pieces_then(bad, lambda lane: [_record(bad, lane)] * (2 if lane == 1 else 1))


async def _another_shards_lane(bad: RawHost) -> None:
    await _pieces_then(bad, lambda lane: [_record(bad, lane)])
    await bad.to_shards[0].send_chunks([_record(bad, 2)])  # shard 1's lane, to shard 0


async def _over_the_ceiling(bad: RawHost) -> None:
    await _pieces_then(bad, lambda lane: [_record(bad, lane)] if lane != 1 else
                       [mux_signed_header(MuxKind.HOST_FRAME, 0xFFFF_FFFF) + bytes(8)])  # (its tag: never read)


@pytest.mark.parametrize(("spoil", "named"), [
    (_short, "tensor 0: 19996 payload bytes, expected 20000"),
    (_bf16, "lane 2: tensors [bf16[5000]]"),
    (_bad_mac, "MAC mismatch"),
    (_twice, "sent lane 1 of its round 1 twice"),
    (_another_shards_lane, "sent lane LaneTag(index=2"),
    (_over_the_ceiling, "payload length 4294967295 exceeds the frame ceiling"),
], ids=["short-payload", "bf16-in-an-f32-round", "bad-mac", "a-lane-twice", "another-shards-lane",
        "length-over-the-ceiling"])
async def test_a_relay_sending_a_shard_bad_pieces_costs_only_that_relay(salt, spoil, named, caplog):
    """Rank 2's relay (played raw) sends its lane 0 to the controller, then breaks the
    rules with its pieces: the shard names it to the controller (``PieceRefused``), which
    drops it and decides the round again; ranks 0 and 1 get the mean of their own frames,
    no shard is lost, and the drop names the relay and what it sent."""
    caplog.set_level(logging.WARNING)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(2)]
            async with host_beside_a_raw_one(nursery, salt, shards, LANES) as (ctl, relay):

                async def bad_host() -> None:
                    bad = RawHost(salt, "bad", NUMEL, LANES, len(shards))
                    await bad.join(ctl.port, shards)
                    await bad.send_lane_0()
                    with contextlib.suppress(trio.BrokenResourceError):  # (a shard may close on it mid-write)
                        await spoil(bad)
                    await trio.sleep_forever()  # connected until the controller drops it

                nursery.start_soon(bad_host)
                got = await survivors_round(relay, NUMEL, salt)
                assert ctl.dead_ranks.is_dead(2) and ctl.stats.shards_lost == 0
                assert not any(shard.outcome.ended for shard in shards)
            nursery.cancel_scope.cancel()
    for rank in (0, 1):
        assert np.array_equal(got[rank], np.full(NUMEL, 0.5, np.float32))
    drops = [r.getMessage() for r in caplog.records if "relay bad (ranks [2]) dropped: shard" in r.getMessage()]
    assert drops and named in drops[0], [r.getMessage() for r in caplog.records]


# -- a shard that sends the relays what it must not ------------------------------


def _shard_1_spoils_round_1(monkeypatch, spoil) -> None:
    """Shard 1 sends its consensus lanes of round 1 spoiled by ``spoil(frame, tag)``
    (signed as any lane: only what they say is wrong)."""
    from flodl_trio.shard import core as shard_core

    original = shard_core._Shard._signed_lane

    async def spoiled(self, frame):
        tag = read_lane_tag(frame)
        if self.index == 1 and self._summing is not None and self._summing.round == 1 and tag is not None:
            frame = spoil(frame, tag)
        return await original(self, frame)

    monkeypatch.setattr(shard_core._Shard, "_signed_lane", spoiled)


@contextlib.asynccontextmanager
async def _two_hosts_through_two_shards(salt):
    """Two hosts (a rank each) reducing through two shard servers, for at most 10 s."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            shards = [await nursery.start(hold_open, open_shard(LOOP, 0, salt=salt)) for _ in range(2)]
            async with two_hosts_on(shards, nursery, salt) as (ctl, relays):
                yield shards, ctl, relays
            nursery.cancel_scope.cancel()


async def _a_bad_shard_costs_only_itself(salt, caplog, named: str) -> None:
    """Three rounds of two hosts through two shards, shard 1 spoiling round 1: it is lost,
    its lanes move to shard 0, and no rank, relay or other shard pays; each relay's word
    names shard 1 and ``named``."""
    caplog.set_level(logging.WARNING)
    async with _two_hosts_through_two_shards(salt) as (shards, ctl, relays):
        got = await two_ranks_rounds(relays, 50_000, 3, salt)
        assert ctl.stats.shards_lost == 1 and not ctl.dead_ranks.snapshot()
        assert not shards[0].outcome.ended and not any(relay.outcome.ended for relay in relays)
    assert_means(got, 50_000)
    said = [r.getMessage() for r in caplog.records if "shard 1 failed (" in r.getMessage()]
    assert len(said) == 2 and all(named in line for line in said), [r.getMessage() for r in caplog.records]


async def test_a_shard_sending_a_lane_whose_bytes_are_not_its_shape_costs_only_that_shard(salt, monkeypatch, caplog):
    """A consensus lane whose piece says 5,000 elements and carries 4,999: the relays
    refuse it at once (it would not fit its place in the joined frame) and tell the
    controller, rather than fail themselves."""
    _shard_1_spoils_round_1(monkeypatch, lambda frame, tag: _short_payload(frame))
    await _a_bad_shard_costs_only_itself(salt, caplog, "tensor 0: 24996 payload bytes, expected 25000")


async def test_a_shard_sending_a_lane_it_does_not_own_costs_only_that_shard(salt, monkeypatch, caplog):
    """Shard 1 tags its lanes as shard 0's, and they reach the relays before shard 0's
    own: each relay sees at once which shard broke the rules (docs/wire.md: "a lane it
    does not own"), rather than blame shard 0 when its genuine lane comes "twice"."""
    def retagged(frame, tag):  # shard 1's lane 2k as shard 0's lane 2k - 1 (the same shapes here)
        assert lane_owner(tag.index - 1, 2) == 0
        return RoundFrame([*frame.tensors[:-1], lane_tag(tag.index - 1, tag.count)], frame.kind, frame.weight)

    _shard_1_spoils_round_1(monkeypatch, retagged)
    _shard_0_sums_round_1_once_both_relays_took_a_lane_of_shard_1(monkeypatch)
    await _a_bad_shard_costs_only_itself(salt, caplog, "which shard 0 reduces")


def _shard_0_sums_round_1_once_both_relays_took_a_lane_of_shard_1(monkeypatch) -> None:
    from flodl_trio.relay import shards as relay_shards
    from flodl_trio.shard import core as shard_core

    took: set[str] = set()
    both = trio.Event()
    on_lane, sum_lane = relay_shards.ShardLinks._on_lane, shard_core._Shard._sum_lane

    async def noting(self, index, conn, payload):
        try:
            await on_lane(self, index, conn, payload)
        finally:
            if index == 1:
                took.add(self._config.host_name)
                if len(took) == 2:
                    both.set()

    async def waiting(self, msg, lane):
        if self.index == 0 and msg.round == 1:
            await both.wait()
        await sum_lane(self, msg, lane)

    monkeypatch.setattr(relay_shards.ShardLinks, "_on_lane", noting)
    monkeypatch.setattr(shard_core._Shard, "_sum_lane", waiting)


# -- a controller's record replayed on a shard's link ----------------------------


async def test_a_decide_replayed_to_a_shard_is_ignored_and_costs_nobody(salt, monkeypatch, caplog):
    """Something on the controller's link to shard 1 sends round 1's ``Decide`` record
    a second time, byte for byte (authentic: docs/wire.md, "Replays"). Decisions only
    grow, so the shard ignores the copy: it does not send its lanes again (which the
    relays would take as a lane "twice" and lose the shard for), every round is exact,
    and nobody is lost."""
    from flodl_trio.controller import shards as controller_shards

    from flodl_trio.shard import core as shard_core

    send_records, decided, sum_lane = (controller_shards.ShardSet._send_records, shard_core._Shard._decided,
                                       shard_core._Shard._sum_lane)
    kept: list = []
    lanes_out, replayed = trio.Event(), trio.Event()

    async def keeping(self, index, records):  # round 1's Decide to shard 1, kept to be sent again
        if index == 1 and self.rounds == 2 and not kept:
            kept.extend(records)
            self._nursery.start_soon(replay, self)
        await send_records(self, index, records)

    async def replay(shard_set) -> None:
        await lanes_out.wait()  # shard 1 sent its lanes of round 1 ...
        await send_records(shard_set, 1, kept)  # ... and gets its Decide again, byte for byte

    def noting(self, msg) -> None:
        decided(self, msg)
        if self.index == 1 and msg.round == 1:
            lanes_out.set()

    async def holding(self, msg, lane) -> None:  # shard 0's lanes of round 1 wait: no commit before the copy
        if self.index == 0 and msg.round == 1:
            await replayed.wait()
        await sum_lane(self, msg, lane)

    stale = getattr(shard_core._Shard, "_stale_decision", None)

    def ignored(self, msg) -> None:  # (a shard that acts on the copy never gets here: the test fails)
        stale(self, msg)
        replayed.set()

    monkeypatch.setattr(shard_core._Shard, "_stale_decision", ignored, raising=False)
    monkeypatch.setattr(shard_core._Shard, "_decided", noting)
    monkeypatch.setattr(shard_core._Shard, "_sum_lane", holding)
    monkeypatch.setattr(controller_shards.ShardSet, "_send_records", keeping)
    caplog.set_level(logging.WARNING)
    async with _two_hosts_through_two_shards(salt) as (_shards, ctl, relays):
        got = await two_ranks_rounds(relays, 50_000, 3, salt)
        assert replayed.is_set()
        assert ctl.stats.shards_lost == 0 and not ctl.dead_ranks.snapshot()
    assert_means(got, 50_000)
    assert any("shard 1: the controller's Decide 1 again" in r.getMessage() for r in caplog.records)
