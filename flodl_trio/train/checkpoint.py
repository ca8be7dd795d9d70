"""Resuming a rank from a consensus checkpoint: the file's params and buffers copied
into a torch module (the format itself is :mod:`flodl_trio.wire.checkpoint`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import SchemaError
from ..wire.checkpoint import Checkpoint, c_contiguous

if TYPE_CHECKING:
    import torch


def restore_module(module: torch.nn.Module, checkpoint: Checkpoint, *, buffers: bool = True) -> None:
    """Copy a checkpoint into ``module``: its parameters, then its float buffers,
    in registration order (``module.parameters()`` / floating ``module.buffers()``:
    the order a rank passes them to ``average_window``).

    Everything is checked before anything is copied; a count or shape mismatch
    raises :class:`SchemaError` naming the index, the module's name for it and
    both shapes. ``buffers=False`` restores the parameters only. Values are
    cast to each tensor's dtype and device.
    """
    import torch

    named_params: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    named_buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()] if buffers else []
    pairs: list[tuple[torch.Tensor, np.ndarray]] = []
    groups = [("parameter", named_params, checkpoint.params)]
    if buffers:
        groups.append(("float buffer", named_buffers, checkpoint.buffers))
    for what, named, stored in groups:
        if len(named) != len(stored):
            hint = ""
            if what == "float buffer" and not stored and checkpoint.metadata.get("buffers", "") == "absent":
                hint = " (this window's buffers round had zero mass; pass buffers=False to restore parameters only)"
            raise SchemaError(
                f"restore_module: the checkpoint holds {len(stored)} {what}s, the module has {len(named)}{hint}"
            )
        for i, ((name, tensor), array) in enumerate(zip(named, stored)):
            if tuple(tensor.shape) != tuple(array.shape):
                raise SchemaError(
                    f"restore_module: {what} {i} ({name}): the checkpoint has shape {list(array.shape)}, "
                    f"the module has {list(tensor.shape)}"
                )
            pairs.append((tensor, array))
    with torch.no_grad():
        for tensor, array in pairs:
            tensor.copy_(torch.from_numpy(c_contiguous(array)))


__all__ = ["restore_module"]
