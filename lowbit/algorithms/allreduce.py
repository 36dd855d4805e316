"""AllReduce SGD: every worker applies the average of all workers' fp32
gradients (the centralized baseline of every source document)."""

from __future__ import annotations

from .legacy import CentralizedAlgorithm


class AllReduceSGD(CentralizedAlgorithm):
    name = "allreduce"

    def before_update(self, k, x, g, lr):
        g.copy_(self.transport.all_reduce(g, "sum")).div_(self.world_size)
