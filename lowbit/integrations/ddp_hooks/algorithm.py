"""A centralized algorithm that runs as itself on each bucket (method ``algorithm``: NDQSG)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...algorithms.base import Algorithm, Context
from .state import _ok_future


def algorithm_step(state, algo: Algorithm, x, group, bidx, sig, dtype):
    """The algorithm's own step on the bucket, over the default group: its before_update
    replaces the bucket's gradient by the aggregate; the bytes are its transport's ledger's."""
    from ...comm.distributed import TorchDistributedTransport

    if state.process_group is not None and state.process_group is not dist.group.WORLD:
        raise ValueError(f"algorithm {algo.name!r} runs over the default process group; process_group "
                         f"must be None")
    if state._transport is None:
        state._transport = TorchDistributedTransport()
    t = state._transport
    ctx = Context.make(t, seed=state.seed)
    g = x.to(dtype)
    entry = state.algorithm_states.get(bidx)
    s = entry[1] if entry is not None and entry[0] == sig else algo.init(g, ctx)
    t.set_step(state.step)
    sent, msgs = t.ledger.bytes_sent, t.ledger.messages_sent
    s = algo.before_update(s, ctx, state.step, g, g, 0.0)
    state.algorithm_states[bidx] = (sig, s)
    state._add(t.ledger.messages_sent - msgs, t.ledger.bytes_sent - sent, bidx)
    out = g.to(torch.float64)
    return _ok_future(out), lambda: out
