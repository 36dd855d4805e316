"""The small model and per-rank batches the wrapper tests train (thread workers share torch's
global RNG, so both draw from their own generators)."""

from __future__ import annotations

import torch
from torch import nn

BATCH = 8


def small_model(hidden: int = 6, bn: bool = False, seed: int = 0) -> nn.Module:
    """5 -> hidden -> 3 with a tanh (and a BatchNorm with ``bn``); the same x_0 for a given seed."""
    layers = [nn.Linear(5, hidden)] + ([nn.BatchNorm1d(hidden)] if bn else []) + [nn.Tanh(), nn.Linear(hidden, 3)]
    m = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def rank_batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``k``: inputs shifted by the rank (non-identical data), 3 classes."""
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(BATCH, 5, generator=g) + rank, torch.randint(0, 3, (BATCH,), generator=g)
