"""A centralized algorithm that runs as itself on each bucket (method ``algorithm``: NDQSG).

The method: ````algorithm`` -- a centralized algorithm (an instance) that runs its own step on the
bucket over the state's process group (NDQSG), one algorithm state per bucket,
synchronously (its future is complete when the hook returns).
"""

from __future__ import annotations

import torch

from ...algorithms.base import Algorithm, Context
from ...comm.base import completed


def algorithm_step(state, t, algo: Algorithm, x, bidx, sig, dtype):
    """The algorithm's own step on the bucket over the transport ``t`` (the state's process
    group): its before_update replaces the bucket's gradient by the aggregate (synchronously;
    the ledger of ``t`` gives the bytes, as for every family)."""
    ctx = Context.make(t, seed=state.seed)
    g = x.to(dtype)
    entry = state.algorithm_states.get(bidx)
    s = entry[1] if entry is not None and entry[0] == sig else algo.init(g, ctx)
    s = algo.before_update(s, ctx, state.step, g, g, 0.0)
    state.algorithm_states[bidx] = (sig, s)
    out = g.to(torch.float64)
    return completed(out), lambda: out
