"""The demo's model and data: a small MLP learning a shared teacher from non-IID shards.

Torch is imported inside the functions: the orchestrator imports this module
(for the cluster model's loss) without paying for torch at startup.
"""

from __future__ import annotations

from typing import Any

import attrs

FEATURES = 16
VALIDATION_SAMPLES = 512


@attrs.frozen
class Shard:
    """One rank's training data and the validation set every rank shares (torch tensors)."""

    x: Any
    y: Any
    x_val: Any
    y_val: Any


def make_model(seed: int = 0) -> Any:
    """The same initial weights on every rank for a given ``seed``."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )


def make_data(rank: int, samples: int) -> Shard:
    """A shared teacher function; each rank sees its own noisy, shifted shard."""
    import torch

    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 32, generator=teacher)
    w2 = torch.randn(32, 1, generator=teacher)

    def label(x: Any) -> Any:
        return torch.tanh(x @ w1) @ w2 / 4

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(samples, FEATURES, generator=gen) + 0.3 * (rank - 1.5)  # non-IID shards
    y = label(x) + 0.05 * torch.randn(samples, 1, generator=gen)
    val = torch.Generator().manual_seed(999)
    x_val = torch.randn(VALIDATION_SAMPLES, FEATURES, generator=val)
    return Shard(x, y, x_val, label(x_val))


def validation_loss(model: Any, shard: Shard) -> float:
    """MSE on the shared validation set, in eval mode (BatchNorm's running statistics)."""
    import torch

    with torch.no_grad():
        model.eval()
        return float(torch.nn.functional.mse_loss(model(shard.x_val), shard.y_val).item())
