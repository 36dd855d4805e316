"""fp32, fp16 and bf16: each rank divides by the world size, casts to the wire dtype, one SUM
all-reduce, cast back (method ``allreduce-float``): AllReduce SGD's exchange,
:func:`~lowbit.algorithms.allreduce.allreduce_average`, on the pre-divided wire."""

from __future__ import annotations

from ...algorithms.allreduce import allreduce_average
from ...codecs.identity import IdentityCodec
from .state import _float_wire_dtype


def float_allreduce(t, codec, x, scratch: bool = False, checked: bool = True):
    """``x / N`` in the codec's float dtype, one SUM all-reduce over the transport ``t``:
    (future of the average in the wire dtype, this rank's own contribution). The division
    is in ``x``'s dtype (the bucket's, error memory included); rounding its
    float32 result to fp16/bf16 gives the correctly rounded quotient, as a float64 one would
    (double rounding is innocuous from 24 to 11 or 8 significant bits).

    ``scratch``: ``x`` is the caller's to overwrite and it needs no own contribution (the hook
    without error feedback, as torch's hooks divide the bucket in place): ``x`` is divided in
    place and the wire reduced in place (fp32: the bucket itself, as torch's allreduce_hook
    does), and ``own`` is None.

    ``checked=False`` (``nonfinite="propagate"``): the half wire is torch's cast of ``x / N``,
    as torch's compress hooks make it, without the codec's finiteness and overflow check."""
    share = x.div_(t.world_size) if scratch else x / t.world_size
    if isinstance(codec, IdentityCodec) or not checked:  # the payload data, without the copy encode makes
        wire = share.to(_float_wire_dtype(codec))
    else:  # the codec's payload data is the wire tensor (HalfCodec raises ValueError on overflow)
        try:
            wire = codec.encode(share).data.view(_float_wire_dtype(codec))
        except ValueError as e:
            raise ValueError(f"{e} (the bucket divided by the world size; under torch.amp.GradScaler, "
                             "LowbitHookState(nonfinite='propagate') passes it on as torch's hook does)") from None
    return allreduce_average(t, wire, divided=True, inplace=scratch)
