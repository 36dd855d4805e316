"""fp32, fp16 and bf16: each rank divides by the world size, casts to the wire dtype, one SUM
all-reduce, cast back (method ``allreduce-float``): AllReduce SGD's exchange,
:func:`~lowbit.algorithms.allreduce.allreduce_average`, on the pre-divided wire."""

from __future__ import annotations

import torch

from ...algorithms.allreduce import allreduce_average
from ...comm.base import then
from .state import _float_wire_dtype


def float_allreduce(t, codec, x):
    """``x / N`` in the codec's float dtype, one SUM all-reduce over the transport ``t``:
    (future of the float64 average, this rank's own contribution)."""
    # the codec's payload data is the wire tensor (HalfCodec raises ValueError on overflow)
    wire = codec.encode(x / t.world_size).data.view(_float_wire_dtype(codec))
    fut, own = allreduce_average(t, wire, divided=True)
    return then(fut, lambda avg: avg.to(torch.float64)), own
