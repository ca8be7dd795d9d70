"""The tensor bridge: torch tensors <-> RoundFrames. The only module that imports torch.

Encoding avoids copies where it can: a contiguous f32 CPU tensor on an f32
wire is sent straight from its storage. Decoding always returns f32 tensors
(the bf16 wire widens exactly); it can decode into caller-owned tensors (the
pinned-decode slots, or the caller's own tensors for an in-place all-reduce)
so steady-state rounds allocate nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigError, SchemaError
from ..wire.bf16 import F32, bf16_to_f32, scale_payload
from ..wire.constants import DTYPE_BF16, DTYPE_F32
from ..wire.fragment import piece_range
from ..wire.round_frame import RoundFrame, RoundKind, TensorPayload, check_payload

# An elided (all-zero) tensor costs no wire bytes, so its shape alone must be sane.
MAX_DECODE_NUMEL = 1 << 36

_TORCH_NAMES = {
    torch.float32: "Float32",
    torch.float64: "Float64",
    torch.float16: "Float16",
    torch.bfloat16: "BFloat16",
}


def dtype_name(dtype: torch.dtype) -> str:
    """flodl's dtype spelling (Float32, BFloat16, ...) so messages match across stacks."""
    return _TORCH_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class SendStaging:
    """Host tensors a rank's converted frames are written into, one per tensor
    position and dtype, reused round after round.

    A frame needs a copy of a tensor when it is scaled, changes dtype for the
    wire, or lives on another device; without staging every such round would
    allocate (and page-fault) a model-sized block. A frame built into staging
    is valid until the next frame is built into the same staging.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def get(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        slot = self._slots.get((index, dtype))
        if slot is None or slot.numel() != numel:
            slot = self._slots[(index, dtype)] = torch.empty(numel, dtype=dtype)
        return slot


def _check_sendable(t: torch.Tensor, index: int) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise SchemaError(
            f"tensor {index} is {dtype_name(t.dtype)}; the reduce wire takes Float32 tensors "
            f"(or BFloat16 staging) - convert it to Float32 first"
        )


def check_sendable(tensors: Sequence[torch.Tensor], *, in_place: bool) -> None:
    """Refuse, before any round, tensors a round could not take: what the wire cannot
    carry, or (``in_place``) a destination the f32 consensus cannot be written into.
    A window checks all of its tensors first, so a refusal leaves it unstarted."""
    if in_place:
        check_destinations(tensors)
        return
    for i, t in enumerate(tensors):
        _check_sendable(t, i)


def _wire_array(
    t: torch.Tensor, index: int, wire_dtype: int, scale: float | None, staging: SendStaging | None
) -> np.ndarray:
    """A tensor's (scaled) values in the wire dtype as a flat array; a view when unscaled f32."""
    _check_sendable(t, index)
    if wire_dtype not in (DTYPE_F32, DTYPE_BF16):
        raise SchemaError(f"unknown wire dtype tag {wire_dtype} (0 = f32, 1 = bf16)")
    source = t.detach()
    wire_torch = torch.bfloat16 if wire_dtype == DTYPE_BF16 else torch.float32

    def converted(dtype: torch.dtype, values: torch.Tensor) -> torch.Tensor:
        """``values`` (the tensor's, any layout or device, or a flat copy of them) as a flat
        CPU tensor of ``dtype`` (rounded as ``.to`` rounds), in staging when given."""
        numel = values.numel()
        out = torch.empty(numel, dtype=dtype) if staging is None else staging.get(index, numel, dtype)
        out.view(values.shape).copy_(values)  # in the tensor's logical order, whatever its strides
        return out

    if scale is not None and scale != 1.0:
        if source.dtype == torch.bfloat16 and wire_dtype == DTYPE_BF16:
            # bf16 staging on a bf16 wire: scale the bits exactly as torch's bf16 mul would.
            owned = converted(torch.bfloat16, source).view(torch.int16).numpy()
            scale_payload(owned.view(np.uint8), DTYPE_BF16, scale)
            return owned
        # f32 math with the scalar rounded to f32 (torch's rule), then one rounding to the wire.
        scaled = converted(torch.float32, source).mul_(float(np.float32(scale)))
        return _as_wire(scaled if wire_dtype == DTYPE_F32 else converted(torch.bfloat16, scaled))
    if source.dtype == wire_torch and source.device.type == "cpu" and source.is_contiguous():
        return _as_wire(source.reshape(-1))  # sent straight from the tensor's storage
    # torch's own f32 -> bf16 is the reference rounding; a bf16 tensor goes verbatim. A
    # non-contiguous tensor is copied too: it has no run of memory to send from.
    return _as_wire(converted(wire_torch, source))


def _as_wire(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def tensors_to_round_frame(
    tensors: Sequence[torch.Tensor],
    wire_dtype: int = DTYPE_F32,
    *,
    kind: RoundKind = RoundKind.MODEL,
    weight: float = 1.0,
    scale: float | None = None,
    staging: SendStaging | None = None,
) -> RoundFrame:
    """Serialize tensors for one round; ``scale`` multiplies them first (f32 math).

    Without ``scale`` an f32 CPU tensor is not copied: do not modify it until
    the round's send has completed. Copies (scaled, converted to bf16, moved
    off a GPU) go into ``staging`` when given.
    """
    payloads = [
        TensorPayload(wire_dtype, tuple(t.shape), _wire_array(t, i, wire_dtype, scale, staging))
        for i, t in enumerate(tensors)
    ]
    return RoundFrame(payloads, kind, weight)


def f32_copies(tensors: Sequence[torch.Tensor], out: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """The tensors' values as flat f32 arrays, copied (into ``out`` when given): a delta
    round's params snapshot, which the rank then trains on past."""
    arrays = out if out is not None else [np.empty(t.numel(), dtype=np.float32) for t in tensors]
    for array, t in zip(arrays, tensors):
        torch.from_numpy(array).copy_(t.detach().reshape(-1))
    return arrays


def f32_views(tensors: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """The tensors' values as flat f32 arrays sharing their memory, when every one is a
    contiguous f32 tensor on the CPU (None otherwise: copy them with :func:`f32_copies`).
    Only for values read at once, before anything can train the tensors on."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return None
    return [t.detach().reshape(-1).numpy() for t in tensors]


def copy_arrays_into(tensors: Sequence[torch.Tensor], arrays: Sequence[np.ndarray]) -> None:
    """Write flat f32 ``arrays`` into ``tensors`` in place (their shapes and dtypes kept)."""
    with torch.no_grad():
        for t, array in zip(tensors, arrays):
            t.copy_(torch.from_numpy(array).view(t.shape))


def elided_like(tensors: Sequence[torch.Tensor], wire_dtype: int = DTYPE_F32) -> list[TensorPayload]:
    """Zero-elided payloads with the same shapes (what non-root ranks send in a broadcast)."""
    return [TensorPayload(wire_dtype, tuple(t.shape)) for t in tensors]


def round_frame_to_tensors(
    frame: RoundFrame, out: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Decode a frame into f32 tensors; into ``out`` (staging) when given.

    Without ``out``, an f32 payload becomes a tensor over the frame's own
    buffer (no copy): the frame must own that buffer (replies from a client do).
    """
    if out is not None and len(out) != len(frame.tensors):
        raise SchemaError(f"staging holds {len(out)} tensors, the frame carries {len(frame.tensors)}")
    result = []
    for i, payload in enumerate(frame.tensors):
        check_payload(payload, i, "RoundFrame")
        dest = None if out is None else out[i]
        result.append(_decode_one(payload, dest, i))
    return result


def fragment_pieces(params: Sequence[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """Each fragment's pieces: fragment ``p`` holds run ``p`` of every parameter's
    elements (:func:`~flodl_trio.wire.fragment.piece_range`), as flat views of the
    parameter's storage, so a fragment's average lands in the parameters in place.
    Every sync then moves a part of every layer (a fragment of whole tensors - a
    layer or two at a time - cost DiLoCo 11% of its loss on short windows;
    docs/performance.md). ``join`` writes a fragmented cluster's state through them."""
    total = sum(t.numel() for t in params)
    if total < fragments:
        raise ConfigError(f"fragments={fragments} needs at least that many parameter elements, the model has {total}")
    flats = []
    for i, t in enumerate(params):
        if not t.is_contiguous():
            raise ConfigError(
                f"fragments={fragments} cuts every parameter into runs of its elements, which needs contiguous "
                f"tensors: parameter {i} (shape {list(t.shape)}) is not; make it contiguous before training"
            )
        flats.append(t.detach().view(-1))
    return [[flat[slice(*piece_range(flat.numel(), fragments, p))] for flat in flats] for p in range(fragments)]


def check_destinations(tensors: Sequence[torch.Tensor], what: str = "in-place destination") -> None:
    """Tensors a consensus can be decoded into: f32, any device or layout."""
    for i, t in enumerate(tensors):
        if t.dtype != torch.float32:
            raise SchemaError(f"tensor {i}: {what} is {dtype_name(t.dtype)}; the consensus is Float32")


def _decode_one(p: TensorPayload, dest: torch.Tensor | None, index: int) -> torch.Tensor:
    shape = list(p.shape)
    if dest is not None and (list(dest.shape) != shape or dest.dtype != torch.float32):
        raise SchemaError(
            f"tensor {index}: destination is {dtype_name(dest.dtype)}{list(dest.shape)}, "
            f"the frame carries Float32{shape}"
        )
    if p.elided:
        if dest is not None:
            dest.detach().zero_()
            return dest
        if p.numel > MAX_DECODE_NUMEL:
            raise SchemaError(f"tensor {index}: elided shape {shape} has {p.numel} elements, more than any model tensor")
        return torch.zeros(shape, dtype=torch.float32)
    if dest is not None:
        _decode_into(p, dest)
        return dest
    if p.dtype == DTYPE_F32:
        values = np.frombuffer(p.data, dtype=F32)
        if p.data.readonly:
            return torch.from_numpy(values.copy()).reshape(shape)
        return torch.from_numpy(values).reshape(shape)
    target = torch.empty(shape, dtype=torch.float32)
    bf16_to_f32(np.frombuffer(p.data, dtype="<u2"), out=target.numpy().reshape(-1))
    return target


def _decode_into(p: TensorPayload, dest: torch.Tensor) -> None:
    """Write a payload's values into ``dest`` (a parameter, say: autograd is bypassed).

    A contiguous CPU destination is written directly (bf16 widens straight
    into it); any other goes through one f32 temporary and ``copy_``.
    """
    target = dest.detach()
    direct = target.device.type == "cpu" and target.is_contiguous()
    flat = target.numpy().reshape(-1) if direct else np.empty(p.numel, dtype=F32)
    if p.dtype == DTYPE_F32:
        np.copyto(flat, np.frombuffer(p.data, dtype=F32))
    else:
        bf16_to_f32(np.frombuffer(p.data, dtype="<u2"), out=flat)
    if not direct:
        target.copy_(torch.from_numpy(flat).view(target.shape))


def staging_like(shaped: Sequence[torch.Tensor | TensorPayload]) -> list[torch.Tensor]:
    """Fresh f32 staging tensors with the shapes of ``shaped`` (tensors, or a frame's
    payloads): a pinned-decode slot."""
    return [torch.empty(list(t.shape), dtype=torch.float32) for t in shaped]


def numel_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """f32 bytes of a tensor list: the staging one decode slot needs."""
    return sum(t.numel() * 4 for t in tensors)


__all__ = [
    "DTYPE_BF16",
    "DTYPE_F32",
    "SendStaging",
    "check_destinations",
    "check_sendable",
    "dtype_name",
    "elided_like",
    "numel_bytes",
    "round_frame_to_tensors",
    "staging_like",
    "tensors_to_round_frame",
]


def pinned_decode_affordable(staging_bytes: int, local_ranks: int, available_bytes: int) -> bool:
    """Whether reusable decode staging fits: the whole host's ranks budget
    ``staging x max(local_ranks, 1) x 6`` (two slots, transfer copies, headroom)
    and it must stay under what the host has available."""
    need = staging_bytes * max(local_ranks, 1) * 6
    return available_bytes > need


def model_signature(module: torch.nn.Module) -> bytes:
    """32 bytes identifying a model's architecture: every parameter and buffer's
    name, shape and dtype, in registration order (values are not included).

    Ranks send it in the control handshake; the coordinator refuses a rank
    whose signature differs, so two ranks training different models (or the
    same model in different dtypes) are caught at formation, not as NaNs later.
    """
    import hashlib

    digest = hashlib.sha256(b"flodl_trio.model_signature.v1\0")
    for kind, items in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in items:
            digest.update(f"{kind}:{name}:{list(tensor.shape)}:{tensor.dtype}\0".encode())
    return digest.digest()
