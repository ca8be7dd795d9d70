"""One MAC a lane (docs/wire.md, "One MAC a lane"): a lane frame never leaves its
record, so its own MAC field holds zeros and signing it is one pass, the record's,
which covers every byte of the frame. Receivers read the field nowhere, so a lane
that still carries a frame MAC is taken as well."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_trio.errors import FlodlError
from flodl_trio.relay.lanes import LaneUplink
from flodl_trio.transport.hashing import PARALLEL_SIGN_MIN, encode_enveloped_frame
from flodl_trio.wire.constants import DTYPE_F32, MAC_LEN, MUX_HEADER_LEN, UNSIGNED_TAG
from flodl_trio.wire.lanes import LaneLayout, read_lane_tag
from flodl_trio.wire.mux import MuxKind, parse_mux_header, verify_mux_payload
from flodl_trio.wire.round_frame import RoundFrame, RoundKind, TensorPayload, decode_round_frame
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"one-mac-a-lane!!")


def model(numel: int, seed: int = 0) -> RoundFrame:
    values = np.random.default_rng(seed).standard_normal(numel).astype("<f4")
    return RoundFrame([TensorPayload(DTYPE_F32, (numel,), values), TensorPayload(DTYPE_F32, (3,), values[:3].copy())],
                      RoundKind.MODEL, 2.5)


def opened(record: bytes, salt: SessionSalt = SALT) -> tuple[MuxKind, bytes]:
    """A record's kind and payload, its MAC verified as every receiver does."""
    header = parse_mux_header(record[:MUX_HEADER_LEN])
    payload = record[MUX_HEADER_LEN:]
    return verify_mux_payload(header, payload, salt), payload


@pytest.mark.parametrize("numel", [1000, PARALLEL_SIGN_MIN // 4 + 1000])  # signed inline, and on a worker thread
async def test_a_lane_record_is_signed_by_its_mac_alone_and_the_frames_field_holds_zeros(numel):
    frame = model(numel)
    both = (await encode_enveloped_frame(MuxKind.HOST_FRAME, frame, SALT)).tobytes()
    one = (await encode_enveloped_frame(MuxKind.HOST_FRAME, frame, SALT, frame_mac=False)).tobytes()
    kind, payload = opened(one)
    assert kind is MuxKind.HOST_FRAME
    assert payload[-MAC_LEN:] == UNSIGNED_TAG
    # The same bytes as the two-MAC record but for the frame's field and the record's MAC.
    assert len(one) == len(both) and one[MUX_HEADER_LEN:-MAC_LEN] == both[MUX_HEADER_LEN:-MAC_LEN]
    assert one[:MUX_HEADER_LEN - MAC_LEN] == both[:MUX_HEADER_LEN - MAC_LEN]
    assert decode_round_frame(payload, None, authenticated=True) == frame


async def test_every_byte_of_a_one_mac_lane_is_under_its_records_mac():
    one = bytearray((await encode_enveloped_frame(MuxKind.BROADCAST, model(500), SALT, frame_mac=False)).tobytes())
    assert opened(bytes(one))[0] is MuxKind.BROADCAST
    for at in (MUX_HEADER_LEN, MUX_HEADER_LEN + 30, len(one) // 2, len(one) - MAC_LEN, len(one) - 1):
        bent = bytearray(one)
        bent[at] ^= 0x01
        with pytest.raises(FlodlError, match="MAC"):
            opened(bytes(bent))
    with pytest.raises(FlodlError, match="MAC"):
        opened(bytes(one), SessionSalt(b"another-salt!!!!"))


async def test_a_relays_lanes_go_up_with_one_mac_each_and_join_back_into_its_frame():
    frame = model(300_000, seed=3)
    layout = LaneLayout.through_shards(frame, 8, 4, 64 << 10)
    uplink = LaneUplink(iter(layout.split(frame)), layout.count, SALT)
    lanes = []
    while (record := await uplink.next_record()) is not None:
        kind, payload = opened(record.tobytes())
        assert kind is MuxKind.HOST_FRAME and payload[-MAC_LEN:] == UNSIGNED_TAG
        lane = decode_round_frame(payload, None, authenticated=True)
        tag = read_lane_tag(lane)
        assert tag is not None and tag.index == len(lanes)
        lanes.append(lane)
    assert len(lanes) == layout.count > 4
    assert lanes == layout.split(frame)
