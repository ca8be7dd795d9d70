"""The delta rounds' dtype tags (docs/wire.md, "Delta rounds"): what each names, the
byte counts the checks derive from them, and the refusals."""

from __future__ import annotations

import pytest

from flodl_trio.errors import HandshakeError, SchemaError
from flodl_trio.wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, Code, DeltaCodec, payload_bytes
from flodl_trio.wire.round_frame import (
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_payload,
    check_payloads,
    describe_dtype,
    payload_nbytes,
)
from flodl_trio.wire.salt import SessionSalt
from flodl_trio.wire.state import EntryStatus, JoinNonces, StateEntry, decode_state_entry, encode_state_entry


@pytest.mark.parametrize(
    ("text", "tag", "code", "block"),
    [("int8", 0x8A, Code.INT8, 1024), ("fp4", 0xA8, Code.FP4, 256), ("int4:4096", 0x9C, Code.INT4, 4096),
     ("int8:256", 0x88, Code.INT8, 256)],
)
def test_a_codec_and_its_tag_name_each_other(text, tag, code, block):
    codec = DeltaCodec.parse(text)
    assert (codec.code, codec.block, codec.tag) == (code, block, tag)
    assert DeltaCodec.of_tag(tag) == codec
    assert payload_nbytes(tag, 3001) == payload_bytes(code, 3001, block)
    assert describe_dtype(tag) == f"{code.value}:{block} delta"


@pytest.mark.parametrize("tag", [0, 1, 0x7E, 0x87, 0x8D, 0xB8, 0xFF])
def test_tags_that_name_no_codec_are_unknown(tag):
    assert DeltaCodec.of_tag(tag) is None
    if tag > 1:
        with pytest.raises(SchemaError, match=f"unknown dtype tag {tag}"):
            check_payload(TensorPayload(tag, (4,), bytes(4)), 2, "rank 1")


@pytest.mark.parametrize("text", ["int2", "int8:100", "fp4:8192", "int8:abc"])
def test_a_bad_codec_text_is_refused_with_what_is_wrong(text):
    with pytest.raises(SchemaError):
        DeltaCodec.parse(text)


def test_a_delta_payload_of_the_wrong_length_names_the_tensor_and_both_counts():
    codec = DeltaCodec.parse("int8")
    want = codec.payload_bytes(100)
    check_payload(TensorPayload(codec.tag, (10, 10), bytes(want)), 0, "rank 1")
    check_payload(TensorPayload(codec.tag, (10, 10)), 0, "rank 1")  # elided: all zeros
    with pytest.raises(SchemaError, match=rf"rank 1 tensor 3: {want - 1} payload bytes, expected {want}"):
        check_payload(TensorPayload(codec.tag, (10, 10), bytes(want - 1)), 3, "rank 1")


def test_the_base_digest_is_16_bytes_never_elided_and_only_in_model_frames():
    check_payload(TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), bytes(DIGEST_LEN)), 1, "rank 0")
    with pytest.raises(SchemaError, match="0 payload bytes, expected 16"):
        check_payload(TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,)), 1, "rank 0")
    with pytest.raises(SchemaError, match=r"a base digest of shape \[8\]"):
        check_payload(TensorPayload(DTYPE_BASE_DIGEST, (8,), bytes(8)), 1, "rank 0")
    digest = TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), bytes(DIGEST_LEN))
    check_payloads(RoundFrame([digest], RoundKind.MODEL), "rank 0")
    with pytest.raises(SchemaError, match="in a Control frame"):
        check_payloads(RoundFrame([digest], RoundKind.CONTROL), "rank 0")


def test_an_entry_with_catch_up_frames_round_trips_and_needs_a_window():
    salt, nonces = SessionSalt(b"0123456789abcdef"), JoinNonces(bytes(16), bytes(range(16)))
    entry = StateEntry(EntryStatus.CATCH_UP, 7)
    assert decode_state_entry(encode_state_entry(entry, nonces, salt), nonces, salt) == entry
    with pytest.raises(HandshakeError, match="CATCH_UP with window -1"):
        decode_state_entry(encode_state_entry(StateEntry(EntryStatus.CATCH_UP, -1), nonces, salt), nonces, salt)


@pytest.mark.parametrize("shape", [(4, 4), (2, 8), (1, 16), (5, 0), (0, 0, 16)])
def test_a_base_digest_of_any_other_shape_is_refused_naming_it(shape):
    """The digest is [16]; in lane frames also [0] (an empty piece) and [0, 16] (lane 0's
    schema tensor) - any other shape with the right element count is a SchemaError."""
    data = bytes(16) if 16 in shape and 0 not in shape else b""
    with pytest.raises(SchemaError, match=rf"rank 2 tensor 1: a base digest of shape \[{', '.join(map(str, shape))}\]"):
        check_payload(TensorPayload(DTYPE_BASE_DIGEST, shape, data), 1, "rank 2")
    for good, payload in (((16,), bytes(16)), ((0,), b""), ((0, 16), b"")):
        check_payload(TensorPayload(DTYPE_BASE_DIGEST, good, payload), 1, "rank 2")
