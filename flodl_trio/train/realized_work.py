"""Realized-work weighting: how much each rank's contribution counts in a round.

Local SGD ranks do unequal work between averaging rounds (uneven data,
stragglers, a rank that died mid-window). Weighting each contribution by the
work it realized - and dividing once by the total the controller actually
accepted - keeps the consensus unbiased. Parameters are weighted by
``gamma_mass(steps, gamma)``; float buffers (BatchNorm running stats) by
``mover_mass`` so a rank that did no steps does not drag them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from ..client.reduce import DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS
from ..client.delta import RankDelta
from ..wire.fragment import FragmentTag
from ..wire.quant import DeltaCodec
from ..wire.round_frame import RoundFrame, RoundKind

if TYPE_CHECKING:
    import torch


def gamma_mass(steps: float, gamma: float) -> float:
    """Mass of a rank that did ``steps`` local steps: 0 if none, else steps ** gamma."""
    if steps <= 0:
        return 0.0
    if gamma == 1.0:
        return float(steps)
    return float(steps) ** gamma


def mover_mass(steps: float) -> float:
    """1 for a rank that moved at all this window, else 0."""
    return 1.0 if steps > 0 else 0.0


class _ReduceClientLike(Protocol):
    pinned_decode: bool
    bf16_wire: bool
    delta_codec: DeltaCodec | None
    rank: int
    catching_up: set[int]

    def delta_state(self, fragment: int | None = None) -> RankDelta: ...

    async def all_reduce(self, frame: RoundFrame) -> RoundFrame: ...

    def arm_pinned_decode(self, slot: int) -> None: ...

    async def all_reduce_scaled(
        self, tensors: Sequence[Any], scale: float, kind: RoundKind, weight: float, *, in_place: bool = False
    ) -> tuple[list[Any], float]: ...

    async def all_reduce_per_rank_f64(self, values: Sequence[float], *, fragment: FragmentTag | None = None) -> list[float]: ...


async def sumcount_reduce(
    client: _ReduceClientLike, tensors: Sequence[torch.Tensor], weight: float, slot: int, *, in_place: bool = False
) -> list[torch.Tensor]:
    """Weighted mean of ``tensors`` over the cluster, each rank counting ``weight``.

    Returns the local tensors unchanged when the accepted mass is 0 (nobody
    realized any work: there is nothing better to adopt). ``in_place``: the
    mean is written into ``tensors`` themselves (a model's parameters, say).
    """
    if client.pinned_decode and not in_place:
        client.arm_pinned_decode(slot)
    consensus, mass = await client.all_reduce_scaled(tensors, weight, RoundKind.MODEL, weight, in_place=in_place)
    if mass <= 0:
        return list(tensors)
    return consensus


async def delta_reduce(
    client: _ReduceClientLike, params: Sequence[torch.Tensor], weight: float, *, in_place: bool = False,
    fragment: int | None = None,
) -> list[torch.Tensor]:
    """The params round of a delta run (docs/wire.md, "Delta rounds"): this window's
    change since the base goes out coded, the new consensus comes back as a delta
    against that base. Unlike an f32 round the consensus is adopted even when the
    accepted mass is 0: the base every rank holds moves with every consensus - except
    in a lineage's first round, whose zero-mass sums are nobody's params (the ranks
    keep theirs, and the next round with mass starts the lineage).
    ``fragment``: the params are that fragment's pieces, a lineage of their own."""
    from ..client.tensors import copy_arrays_into, f32_copies, f32_views

    state = client.delta_state(fragment)
    # The frame is computed from them at once (nothing trains meanwhile): CPU f32
    # params are read in place, others copied into buffers kept from window to window.
    snapshot = f32_views(params) or f32_copies(params, out=state.snapshot_buffers([p.numel() for p in params]))
    frame = state.frame(snapshot, [tuple(p.shape) for p in params], weight)
    base = state.take(await client.all_reduce(frame), client.rank)
    if base is None:  # a first round with zero mass: no lineage yet, every rank kept its params
        return list(params)
    if in_place:
        copy_arrays_into(params, base)
        return list(params)
    fresh = [p.detach().clone().float() for p in params]
    copy_arrays_into(fresh, base)
    return fresh


def check_window_tensors(
    client: _ReduceClientLike, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], *, in_place: bool
) -> None:
    """Refuse a window's tensors that one of its rounds would refuse, before its first
    round: a refusal half-way (after the step-count gather) would leave this rank a
    round behind its cluster, and its next frame would break the round for its host.
    A delta run's params are read and written through f32 copies: any float dtype."""
    from ..client.tensors import check_sendable

    if client.delta_codec is None:
        check_sendable(params, in_place=in_place)
    check_sendable(buffers, in_place=in_place)


def _work_to_count(client: _ReduceClientLike, steps: int, fragment: int) -> int:
    """``steps``, or 0 for the first window of a fragment this rank is catching up on."""
    if fragment not in client.catching_up:
        return steps
    client.catching_up.discard(fragment)
    return 0


@attrs.frozen
class WindowResult:
    """What one averaging window produced."""

    counts: list[float]
    params: list[Any]
    buffers: list[Any]


async def average_window(
    client: _ReduceClientLike,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    steps: int,
    *,
    rank: int,
    world_size: int,
    gamma: float = 1.0,
    in_place: bool = False,
    fragment: FragmentTag | None = None,
) -> WindowResult:
    """One Local-SGD window: gather step counts, average params by gamma mass,
    then float buffers by mover mass. Dead ranks' counts come back 0.

    ``in_place``: the averages are written straight into ``params`` and
    ``buffers`` (which the result then holds), so a window allocates nothing
    model-sized. ``fragment``: the window syncs that fragment of the model
    (``params`` and ``buffers`` are its tensors); the step-count gather
    carries the tag, so the controller keeps its state per fragment.
    A rank that joined behind its host (``client.catching_up``) sends its
    first window of each fragment with no work: it adopts the consensus of
    the others and contributes from the next. With ``client.delta_codec`` set
    the params go as a coded delta (:func:`delta_reduce`).
    """
    check_window_tensors(client, params, buffers, in_place=in_place)
    steps = _work_to_count(client, steps, 0 if fragment is None else fragment.index)
    counts = [0.0] * world_size
    counts[rank] = float(steps)
    gathered = await client.all_reduce_per_rank_f64(counts, fragment=fragment)
    if client.delta_codec is not None:
        new_params = await delta_reduce(client, params, gamma_mass(steps, gamma), in_place=in_place,
                                        fragment=None if fragment is None else fragment.index)
    else:
        new_params = await sumcount_reduce(
            client, params, gamma_mass(steps, gamma), DECODE_SLOT_PARAMS, in_place=in_place
        )
    new_buffers = list(buffers)
    if buffers:
        new_buffers = await sumcount_reduce(
            client, buffers, mover_mass(steps), DECODE_SLOT_BUFFERS, in_place=in_place
        )
    return WindowResult(gathered, new_params, new_buffers)
