"""A frame's declared payload - elided tensors counted at their whole shape - must fit
the frame ceiling (docs/wire.md, "Zero elision")."""

from __future__ import annotations

import pytest

from flodl_trio import FramingError, MacError
from flodl_trio.wire import DTYPE_BF16, DTYPE_F32, RoundFrame, TensorPayload
from flodl_trio.wire.lanes import LaneLayout, TensorCut
from flodl_trio.wire.round_frame import decode_round_frame, encode_round_frame


def _frame(*tensors: TensorPayload) -> RoundFrame:
    return RoundFrame(list(tensors))


def test_an_elided_tensor_counts_its_whole_shape_against_the_ceiling(salt):
    fits = encode_round_frame(_frame(TensorPayload(DTYPE_F32, (256,)), TensorPayload(DTYPE_BF16, (512,))), salt)
    assert [t.numel for t in decode_round_frame(fits, salt, ceiling=2048).tensors] == [256, 512]
    with pytest.raises(FramingError, match=r"tensor 1 \(elided, shape \[513\]\) .* 2050 bytes, over the frame ceiling of 2048"):
        decode_round_frame(encode_round_frame(_frame(TensorPayload(DTYPE_F32, (256,)), TensorPayload(DTYPE_BF16, (513,))), salt),
                           salt, ceiling=2048, source="rank 3")


def test_a_shape_whose_size_overflows_64_bits_is_refused_not_wrapped(salt):
    shape = (2, 0xFFFFFFFF, 0xFFFFFFFF)  # 2**65 elements: wraps to a small number in int64
    body = encode_round_frame(_frame(TensorPayload(DTYPE_BF16, shape)), salt)
    with pytest.raises(FramingError, match="over the frame ceiling"):
        decode_round_frame(body, salt)
    assert TensorCut.of(DTYPE_BF16, shape).nbytes == 2 * 2 * 0xFFFFFFFF ** 2


def test_the_mac_is_checked_before_the_declared_size(salt):
    body = bytearray(encode_round_frame(_frame(TensorPayload(DTYPE_F32, (1 << 20, 1 << 20))), salt))
    body[-1] ^= 1
    with pytest.raises(MacError):
        decode_round_frame(bytes(body), salt)


def test_a_lane0_schema_over_the_ceiling_is_a_schema_error(salt):
    from flodl_trio import SchemaError
    from flodl_trio.wire.lanes import lane_tag
    lane0 = _frame(TensorPayload(DTYPE_F32, (0,)), TensorPayload(DTYPE_F32, (0, 1 << 20, 1 << 20)), lane_tag(0, 2, 1))
    with pytest.raises(SchemaError, match="over the frame ceiling of 1073741824"):
        LaneLayout.declared_by(lane0, ceiling=1 << 30)
    assert LaneLayout.declared_by(lane0).count == 2  # no ceiling given: the layout alone
