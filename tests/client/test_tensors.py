"""The torch bridge (flodl_trio.client.tensors): seed tests plus scaling, staging and copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_trio.client.tensors import (
    elided_like,
    numel_bytes,
    pinned_decode_affordable,
    round_frame_to_tensors,
    staging_like,
    tensors_to_round_frame,
)
from flodl_trio.errors import SchemaError
from flodl_trio.wire import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    decode_round_frame,
    encode_round_frame,
)

SALT = SessionSalt(b"\x42" * 16)
MiB = 2**20
GiB = 2**30
SEED_DATA = [1.0, -2.5, 0.0, 42.0, 0.125, -256.0]


def through_wire(frame: RoundFrame) -> RoundFrame:
    return decode_round_frame(bytearray(encode_round_frame(frame, SALT)), SALT)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- seed tests --------------------------------------------------------------------------------


def test_tensor_round_trip_through_round_frame():
    tensors = [
        torch.tensor(SEED_DATA).reshape(2, 3),
        torch.randn(5, 7, generator=torch.Generator().manual_seed(1)),
        torch.tensor(3.5),  # 0-dim
    ]
    frame = tensors_to_round_frame(tensors, weight=2.0)
    assert frame.kind == RoundKind.MODEL and frame.weight == 2.0
    assert [t.shape for t in frame.tensors] == [(2, 3), (5, 7), ()]
    back = round_frame_to_tensors(through_wire(frame))
    assert len(back) == 3
    for a, b in zip(tensors, back):
        assert b.dtype == torch.float32 and b.shape == a.shape
        assert raw_bytes(a) == raw_bytes(b)


def test_tensor_round_trip_through_round_frame_bf16():
    t = torch.tensor(SEED_DATA, dtype=torch.float32).reshape(2, 3)
    f32_frame = tensors_to_round_frame([t], DTYPE_F32)
    frame = tensors_to_round_frame([t], DTYPE_BF16)
    assert frame.tensors[0].dtype == DTYPE_BF16
    assert frame.tensors[0].shape == (2, 3)
    assert frame.tensors[0].nbytes == 12 == f32_frame.tensors[0].nbytes // 2  # bf16 bytes are half
    (back,) = round_frame_to_tensors(through_wire(frame))
    assert back.dtype == torch.float32
    assert back.shape == (2, 3)
    assert back.flatten().tolist() == SEED_DATA  # all exactly representable in bf16


def test_bf16_tensor_serializes_verbatim_into_bf16_frame():
    t = torch.tensor([1.0, -2.5, 0.1, 3.14159, 1e-3, -7e5], dtype=torch.float32).to(torch.bfloat16)
    frame = tensors_to_round_frame([t], DTYPE_BF16)
    assert bytes(frame.tensors[0].data) == raw_bytes(t)  # verbatim, no round trip through f32
    # on an f32 wire it upcasts (exactly)
    f32 = tensors_to_round_frame([t], DTYPE_F32)
    assert f32.tensors[0].dtype == DTYPE_F32
    assert bytes(f32.tensors[0].data) == raw_bytes(t.float())
    (back,) = round_frame_to_tensors(through_wire(frame))
    assert raw_bytes(back) == raw_bytes(t.float())


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.float64, "Float64"), (torch.float16, "Float16"), (torch.int32, "int32"), (torch.int64, "int64")],
)
def test_tensors_to_round_frame_rejects_non_f32(dtype, name):
    good = torch.zeros(2)
    with pytest.raises(SchemaError) as info:
        tensors_to_round_frame([good, torch.zeros(3, dtype=dtype)])
    msg = str(info.value)
    assert name in msg and "Float32" in msg and "tensor 1" in msg


def test_round_frame_to_tensors_rejects_shape_byte_mismatch():
    frame = RoundFrame([TensorPayload(DTYPE_F32, (4,), bytes(8))], RoundKind.MODEL, 1.0)
    with pytest.raises(SchemaError) as info:
        round_frame_to_tensors(frame)
    msg = str(info.value)
    assert "numel" in msg and "expected" in msg and "8" in msg and "16" in msg


def test_round_frame_to_tensors_rejects_unknown_dtype():
    frame = RoundFrame([TensorPayload(3, (4,), bytes(8))], RoundKind.MODEL, 1.0)
    with pytest.raises(SchemaError, match="dtype"):
        round_frame_to_tensors(frame)


def test_pinned_decode_affordable():
    assert not pinned_decode_affordable(727 * MiB, 2, 73 * GiB // 10)
    assert pinned_decode_affordable(727 * MiB, 1, 13 * GiB)
    assert pinned_decode_affordable(10 * MiB, 2, 73 * GiB // 10)
    # local_ranks 0 behaves like 1
    for staging, avail in [(727 * MiB, 13 * GiB), (727 * MiB, 4 * GiB), (10 * MiB, 73 * GiB // 10), (GiB, 6 * GiB)]:
        assert pinned_decode_affordable(staging, 0, avail) == pinned_decode_affordable(staging, 1, avail)
    assert not pinned_decode_affordable(727 * MiB, 0, 4 * GiB)


def test_pinned_decode_affordable_is_exported_lazily():
    import flodl_trio

    assert flodl_trio.pinned_decode_affordable is pinned_decode_affordable
    assert flodl_trio.tensors_to_round_frame is tensors_to_round_frame


# -- scaling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("w", [0.8349217, 1.0 / 3.0, 2.0, 1e-3])
def test_scale_on_f32_wire_matches_torch_mul(w):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    frame = tensors_to_round_frame([t], DTYPE_F32, scale=w, weight=w)
    assert bytes(frame.tensors[0].data) == raw_bytes(t.mul(w))
    assert frame.weight == w
    assert raw_bytes(t) == raw_bytes(torch.randn(1000, generator=torch.Generator().manual_seed(2)))  # input untouched


@pytest.mark.parametrize("w", [0.8349217, 1.0 / 3.0, 7.5])
def test_scale_on_bf16_wire_rounds_once(w):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    frame = tensors_to_round_frame([t], DTYPE_BF16, scale=w)
    assert bytes(frame.tensors[0].data) == raw_bytes(t.mul(w).to(torch.bfloat16))


@pytest.mark.parametrize("w", [0.8349217, -1.75, 3.0])
def test_scale_bf16_staging_on_bf16_wire_matches_torch_bf16_mul(w):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = raw_bytes(t)
    frame = tensors_to_round_frame([t], DTYPE_BF16, scale=w)
    assert bytes(frame.tensors[0].data) == raw_bytes(t.mul(w))
    assert raw_bytes(t) == before  # the caller's tensor is not scaled in place


def test_scale_one_is_no_scale():
    t = torch.randn(10)
    assert bytes(tensors_to_round_frame([t], scale=1.0).tensors[0].data) == raw_bytes(t)


@pytest.mark.parametrize("wire", [DTYPE_F32, DTYPE_BF16], ids=["f32-wire", "bf16-wire"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.8349217])
def test_send_staging_gives_the_same_bytes_and_is_reused(wire, dtype, scale):
    """Frames built into a SendStaging equal those built without, round after round,
    and a copy made for the wire lands in the same memory every round."""
    from flodl_trio.client.tensors import SendStaging

    staging = SendStaging()
    gen = torch.Generator().manual_seed(5)
    copied = scale is not None or dtype != (torch.bfloat16 if wire == DTYPE_BF16 else torch.float32)
    addresses = set()
    for _ in range(3):
        tensors = [torch.randn(1000, generator=gen).to(dtype), torch.randn(3, 7, generator=gen).to(dtype).t()]
        want = tensors_to_round_frame(tensors, wire, scale=scale)
        got = tensors_to_round_frame(tensors, wire, scale=scale, staging=staging)
        assert [bytes(p.data) for p in got.tensors] == [bytes(p.data) for p in want.tensors]
        first = np.frombuffer(got.tensors[0].data, np.uint8).ctypes.data
        # No copy needed: the round's own (contiguous) tensor goes out as it is.
        assert (first == tensors[0].data_ptr()) != copied
        addresses.add(tuple(np.frombuffer(p.data, np.uint8).ctypes.data for p in got.tensors))
    if copied:
        assert len(addresses) == 1  # the same staging memory every round


@pytest.mark.parametrize("scale", [None, 0.5])
def test_a_non_contiguous_f32_tensor_is_copied_into_the_staging(scale):
    """A non-contiguous tensor cannot go out from its own storage: its copy is made into
    the SendStaging too, the same memory every round (an unscaled f32 one got a fresh
    copy each round), in the tensor's logical order."""
    from flodl_trio.client.tensors import SendStaging

    staging = SendStaging()
    addresses = set()
    for k in range(3):
        t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + k).t()
        frame = tensors_to_round_frame([t], scale=scale, staging=staging)
        want = t.contiguous().reshape(-1) * (1.0 if scale is None else scale)
        assert np.frombuffer(frame.tensors[0].data, "<f4").tolist() == want.tolist()
        assert frame.tensors[0].shape == (4, 3)
        addresses.add(np.frombuffer(frame.tensors[0].data, np.uint8).ctypes.data)
    assert len(addresses) == 1


# -- copies, layout, staging ---------------------------------------------------------------------


def test_unscaled_f32_tensor_is_sent_without_copy():
    t = torch.zeros(4)
    frame = tensors_to_round_frame([t])
    t[1] = 5.0  # documented: do not modify until the send completed; the frame sees it
    assert np.frombuffer(frame.tensors[0].data, "<f4").tolist() == [0.0, 5.0, 0.0, 0.0]


def test_non_contiguous_and_grad_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = base.T  # non-contiguous
    g = torch.ones(2, 2, requires_grad=True)
    frame = tensors_to_round_frame([t, g])
    assert frame.tensors[0].shape == (4, 3)
    (a, b) = round_frame_to_tensors(through_wire(frame))
    assert torch.equal(a, t)
    assert torch.equal(b, torch.ones(2, 2))


def test_decode_into_staging():
    src = [torch.tensor(SEED_DATA).reshape(2, 3), torch.ones(4)]
    for wire in (DTYPE_F32, DTYPE_BF16):
        frame = through_wire(tensors_to_round_frame(src, wire))
        staging = staging_like(frame.tensors)
        assert [s.shape for s in staging] == [torch.Size([2, 3]), torch.Size([4])]
        assert numel_bytes(staging) == (6 + 4) * 4
        out = round_frame_to_tensors(frame, out=staging)
        assert out[0] is staging[0] and out[1] is staging[1]
        assert torch.equal(out[0], src[0]) and torch.equal(out[1], src[1])


def test_decode_elided_into_staging_zeroes_it():
    staging = [torch.full((3,), 7.0)]
    frame = RoundFrame(elided_like([torch.empty(3)]), RoundKind.CONTROL, 0.0)
    assert frame.tensors[0].elided
    out = round_frame_to_tensors(frame, out=staging)
    assert out[0] is staging[0] and out[0].tolist() == [0.0, 0.0, 0.0]
    (fresh,) = round_frame_to_tensors(frame)
    assert fresh.dtype == torch.float32 and fresh.tolist() == [0.0, 0.0, 0.0]


def test_elided_like_shapes_and_dtype():
    payloads = elided_like([torch.empty(64, 128), torch.empty(512)], DTYPE_BF16)
    assert [(p.dtype, p.shape, p.nbytes) for p in payloads] == [(DTYPE_BF16, (64, 128), 0), (DTYPE_BF16, (512,), 0)]


def test_staging_mismatch_is_schema_error():
    frame = through_wire(tensors_to_round_frame([torch.ones(2, 3)]))
    with pytest.raises(SchemaError, match="staging holds 2 tensors"):
        round_frame_to_tensors(frame, out=[torch.empty(2, 3), torch.empty(1)])
    with pytest.raises(SchemaError, match="tensor 0: destination is Float32"):
        round_frame_to_tensors(frame, out=[torch.empty(3, 2)])
    with pytest.raises(SchemaError, match="destination is Float64"):
        round_frame_to_tensors(frame, out=[torch.empty(2, 3, dtype=torch.float64)])


def test_decode_from_readonly_buffer_copies():
    frame = decode_round_frame(encode_round_frame(tensors_to_round_frame([torch.ones(3)]), SALT), SALT)
    assert frame.tensors[0].data.readonly
    (t,) = round_frame_to_tensors(frame)
    t += 1  # writable, no warning, does not touch the frame's bytes
    assert np.frombuffer(frame.tensors[0].data, "<f4").tolist() == [1.0, 1.0, 1.0]
