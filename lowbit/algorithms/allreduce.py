"""AllReduce SGD: every worker applies the average of all workers' fp32
gradients (the centralized baseline of every source document)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.base import Transport, then
from .base import CentralizedAlgorithm


def allreduce_average(t: Transport, x: torch.Tensor, *, divided: bool = False, inplace: bool = False):
    """The average over ranks of ``x`` by one SUM all-reduce, in ``x``'s dtype (the wire's):
    ``(future of the average, own)``, ``own()`` this rank's own contribution to it (float64).

    ``divided``: ``x`` is already this rank's share ``x_m / N`` (a narrow float wire, whose sum
    could overflow otherwise, as the DDP hook's fp16), so the sum is the average; else the sum
    is divided by ``N`` after the all-reduce (AllReduce SGD). ``inplace``: the caller gives ``x``
    up (:meth:`~lowbit.comm.base.Transport.all_reduce_async`), and ``own`` is then None. Shared
    by :class:`AllReduceSGD` and the DDP hook's float family."""
    n = t.world_size
    if inplace:
        own = None
    else:
        own = (lambda: x.to(torch.float64) * n) if divided else (lambda: x.to(torch.float64))
    fut = t.all_reduce_async(x, "sum", inplace=inplace)
    return (fut if divided else then(fut, lambda total: total.div_(n))), own


@dataclass(frozen=True)
class AllReduceSGD(CentralizedAlgorithm):
    """Synchronous data-parallel SGD: every worker replaces its gradient by the average of all
    workers' gradients, sent in full precision (one fp32 SUM all-reduce). It has no options
    and keeps no state; it is the baseline every source document measures against."""

    name = "allreduce"

    def before_update(self, state, ctx, k, x, g, lr):
        g.copy_(allreduce_average(ctx.transport, g)[0].wait())
        return state
