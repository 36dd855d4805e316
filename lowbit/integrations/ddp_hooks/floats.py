"""fp32, fp16 and bf16: each rank divides by the world size and casts to the wire dtype (for
fp16/bf16 on the fast path in one pass), one SUM all-reduce, cast back (method
``allreduce-float``): AllReduce SGD's exchange,
:func:`~lowbit.algorithms.allreduce.allreduce_average`, on the pre-divided wire.

The method: ````allreduce-float`` -- fp32 (:class:`IdentityCodec`; the exact reference) and
fp16/bf16 (:class:`HalfCodec`): each rank divides by the world size, casts to the
wire dtype (the codec's overflow check applies), one SUM all-reduce, cast back.
"""

from __future__ import annotations

from ...algorithms.allreduce import allreduce_average
from ...codecs.identity import IdentityCodec
from ...codecs.kernels import kernels_for
from ...codecs.lowp import HALF_DTYPES
from .state import _float_wire_dtype

_HALF_WIRES = tuple(HALF_DTYPES.values())


def float_allreduce(t, codec, x, scratch: bool = False, checked: bool = True):
    """``x / N`` in the codec's float dtype, one SUM all-reduce over the transport ``t``:
    (future of the average in the wire dtype, this rank's own contribution). The division
    is in ``x``'s dtype (the bucket's, error memory included), as torch's ``x / N`` computes
    it on ``x``'s device; rounding its float32 result to fp16/bf16 gives the correctly rounded
    quotient, as a float64 one would (double rounding is innocuous from 24 to 11 or 8
    significant bits).

    ``scratch``: ``x`` is the caller's to overwrite and it needs no own contribution (the hook
    without error feedback, as torch's hooks work in the bucket): fp32 divides ``x`` in place
    and reduces the bucket itself, as torch's allreduce_hook does; ``own`` is None.

    ``checked=False`` (``nonfinite="propagate"``): the half wire is torch's cast of ``x / N``,
    as torch's compress hooks make it, without the codec's finiteness and overflow check."""
    n = t.world_size
    if isinstance(codec, IdentityCodec):  # the payload data, without the copy encode makes
        wire = (x.div_(n) if scratch else x / n).to(_float_wire_dtype(codec))
    else:
        wire = _half_wire(codec, x, n, checked)
    return allreduce_average(t, wire, divided=True, inplace=scratch)


def _half_wire(codec, x, n: int, checked: bool):
    """The fp16/bf16 wire of ``x / n`` (``x`` left as it is): the codec's values of the
    quotient (:meth:`~lowbit.codecs.HalfCodec.cast`, one pass on the fast path), its errors
    naming the hook's option."""
    try:
        return codec.cast(x, divisor=n, check=checked)
    except ValueError as e:
        raise ValueError(f"{e} (the bucket divided by the world size; under torch.amp.GradScaler, "
                         "LowbitHookState(nonfinite='propagate') passes it on as torch's hook does)") from None


def write_average(buf, avg):
    """``buf[:] = avg`` (the hook's last step): from a half wire by the codec's decode kernel
    (one pass; on the CPU with nontemporal stores for a large bucket), else torch's copy."""
    if avg.dtype in _HALF_WIRES and avg is not buf:
        K = kernels_for(avg, "lowp")
        if K is not None:
            return K.half_decode(avg, buf)
    return buf.copy_(avg)
