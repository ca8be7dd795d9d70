"""A shard reading a controller's ``Seed{decision, lanes}`` (variant 224) and the lane
states after it (docs/wire.md, "Seeding the shards' outer state"), the controller
spoken raw: a state that is not a Broadcast record, not a Model frame, or a lane
seeded twice in one Seed is a protocol error that ends the shard, naming it; a seed
of a lane the shard does not own is ignored."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import trio

from flodl_trio.errors import FlodlError
from flodl_trio.shard import open_shard
from flodl_trio.testing import hold_open
from flodl_trio.wire import DTYPE_F32
from flodl_trio.wire.constants import CHANNEL_MAGIC_SHARD
from flodl_trio.wire.lanes import lane_tag
from flodl_trio.wire.mux import (
    Decide,
    MuxKind,
    RelayControlMsg,
    Seed,
    ShardOuter,
    ShardSetup,
    encode_control_record,
    encode_mux_record,
)
from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload, encode_round_frame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"wire-audit-seeds")
LANES, NUMEL = 3, 5  # a round of one [10] f32 tensor in 3 lanes: lanes 1 and 2 carry 5 elements each
DECIDE = Decide(0, 0, LANES, [(DTYPE_F32, (10,))], [0], [0], step=True)


def control(*msgs: RelayControlMsg) -> bytes:
    return b"".join(encode_control_record(m, SALT) for m in msgs)


def state(lane: int, *, kind: RoundKind = RoundKind.MODEL, record: MuxKind = MuxKind.BROADCAST) -> bytes:
    """Lane ``lane``'s outer state as docs/wire.md lays it out: x_prev, momentum, the lane's tag."""
    frame = RoundFrame([TensorPayload(DTYPE_F32, (NUMEL,), np.ones(NUMEL, "<f4")),
                        TensorPayload(DTYPE_F32, (NUMEL,), np.zeros(NUMEL, "<f4")), lane_tag(lane, LANES)], kind)
    return encode_mux_record(record, encode_round_frame(frame, SALT), SALT).tobytes()


async def shard_outcome(sent: bytes, *, index: int = 0, count: int = 1) -> str:
    """What a shard that is told ``sent`` after its setup ends with (its error's text)."""
    async with trio.open_nursery() as nursery:
        shard = await nursery.start(hold_open, open_shard("127.0.0.1", 0, salt=SALT))
        stream = await trio.open_tcp_stream("127.0.0.1", shard.port)
        setup = control(ShardSetup(index, count, 30_000), ShardOuter(2, 0.7, 0.9))
        await stream.send_all(CHANNEL_MAGIC_SHARD.to_bytes(4, "little") + setup + sent)
        try:
            await shard.outcome.wait()
            ended = "ended without an error"
        except FlodlError as exc:
            ended = str(exc)
        await stream.aclose()
        nursery.cancel_scope.cancel()
    return ended


# After a good seed and its Decide, the controller sends a second ShardSetup: a protocol
# error of its own, so a shard that took what came before ends naming that one instead.
THEN_A_BAD_RECORD = control(ShardSetup(0, 1, 30_000))


@pytest.mark.parametrize(("sent", "named"), [
    (control(Seed(0, 1)) + state(1, kind=RoundKind.CONTROL) + control(DECIDE), "is a CONTROL frame"),
    (control(Seed(0, 1)) + state(1, record=MuxKind.HOST_FRAME) + control(DECIDE), "HOST_FRAME record"),
    (control(Seed(0, 2)) + state(1) + state(1) + control(DECIDE), "seeded twice"),
    (control(Seed(0, 65)), "promises 65 lane states"),
], ids=["control-kind", "host-frame", "lane-twice", "65-states"])
async def test_a_seed_that_is_not_lane_states_ends_the_shard_naming_it(sent, named):
    with trio.fail_after(20):
        assert named in await shard_outcome(sent + THEN_A_BAD_RECORD)


async def test_a_good_seed_and_a_seed_of_a_lane_another_shard_owns_are_taken_quietly():
    """Shard 0 of 2 owns lane 1 (lane 2 is shard 1's): seeding both is no error; the
    shard goes on to the next record (here the second ShardSetup, which ends it)."""
    with trio.fail_after(20):
        ended = await shard_outcome(control(Seed(0, 2)) + state(1) + state(2) + control(DECIDE) + THEN_A_BAD_RECORD,
                                    count=2)
    assert "ShardSetup" in ended and "Seed" not in ended, ended


def test_the_seed_record_is_variant_224_with_two_varints():
    payload = control(Seed(300, 2))[25:]
    assert payload == bytes([224]) + b"\xfb" + struct.pack("<H", 300) + bytes([2])
