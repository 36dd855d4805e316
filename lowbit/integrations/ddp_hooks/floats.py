"""fp32, fp16 and bf16: each rank divides by the world size, casts to the wire dtype, one SUM
all-reduce, cast back (method ``allreduce-float``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import _float_wire_dtype, _ok


def float_allreduce(state, codec, x, world, group, bidx):
    """``x / world`` in the codec's float dtype, one SUM all-reduce: (future of the float64
    average, this rank's own contribution times ``world``)."""
    # the codec's payload data is the wire tensor (HalfCodec raises ValueError on overflow)
    t = codec.encode(x / world).data.view(_float_wire_dtype(codec))
    own = t.to(torch.float64) * world
    state._count("all_reduce", t.numel() * t.element_size(), world, bidx)
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: _ok(f) and t.to(torch.float64)), lambda: own
