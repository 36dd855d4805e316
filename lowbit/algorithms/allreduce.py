"""AllReduce SGD: every worker applies the average of all workers' fp32
gradients (the centralized baseline of every source document)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import CentralizedAlgorithm


@dataclass(frozen=True)
class AllReduceSGD(CentralizedAlgorithm):
    """Synchronous data-parallel SGD: every worker replaces its gradient by the average of all
    workers' gradients, sent in full precision (one fp32 SUM all-reduce). It has no options
    and keeps no state; it is the baseline every source document measures against."""

    name = "allreduce"

    def before_update(self, state, ctx, k, x, g, lr):
        g.copy_(ctx.transport.all_reduce(g, "sum")).div_(ctx.world_size)
        return state
