"""The max-norm family: the shared scale's rounds, then one SUM all-reduce of integer codes
(``allreduce-int``), optionally on the global random-k coordinates (``allreduce-randk``): the
exchange of :class:`~lowbit.algorithms.maxnorm.MaxNormSGD`,
:func:`~lowbit.algorithms.maxnorm.maxnorm_exchange`, with the scale indices' MIN as bit-planes.

The methods: ````allreduce-int`` -- summable codecs (QSGDMaxNorm, multi-scale, GlobalRandK around
them): the max-norm algorithm's exchange; the codec's scale rounds (MAX all-reduce of the float32 norm; for the
multi-scale codec a MIN of the per-coordinate scale indices), then one SUM
all-reduce of the integer codes, packed in summable lanes (:mod:`lowbit.codecs.lanes`:
int64 words of ``log2(2 N s + 1)``-bit lanes that the SUM adds without a carry)
wherever those are smaller than ``codec.sum_dtype(world_size)`` (int16 is
widened to int32: neither gloo nor NCCL reduces int16), else in it, then ``decode_sum``.
The MIN of the scale indices travels as ``N - 1`` packed bit-planes (plane ``p``
holds ``index >= p``) combined by bitwise AND, which is exactly the MIN, when
that is narrower than one uint8 per coordinate (``N <= 8`` scales; for the
paper's two scales one bit per coordinate, its ``ceil(log2 N)``) and the backend
has a bitwise AND (gloo; NCCL has none); otherwise a uint8 MIN all-reduce. Unpacked,
integers on the wire take whole bytes (the paper's section on framework support):
``bits=4`` (codes -7..7) would sum in int8 up to 18 ranks and ``bits=8`` in int32;
in lanes ``bits=2`` takes 2.37/3.2/4.27/5.33 bits per element on 2/4/8/16 ranks,
``bits=4`` 4.92/6.4/7.11 on 2/4/8 (int8 from 16 on), ``bits=8`` 9.14 on 2.

````allreduce-randk`` -- :class:`RandKCodec` with ``send_indices=False``: every
rank keeps the same ``k`` coordinates of a bucket, chosen from the seed
``derive_seed(seed, step, bucket_index, GLOBAL_RANDK_STREAM)`` (the codec's own
``seed`` field is replaced by it), and the kept values travel as the inner
codec does (a summable inner codec: the seeded random-k codec is itself summable and
travels as ``allreduce-int``, as the GlobalRandK algorithm's; fp32/fp16 floats for an
identity/half inner codec, all-gather otherwise, the average scattered back, times
``d / k`` when ``rescale``).
"""

from __future__ import annotations

import dataclasses

import torch

from ...algorithms.maxnorm import kept_count, maxnorm_exchange
from ...codecs.base import SummableCodec, is_summable
from ...codecs.kernels import kernels_for
from ...codecs.maxnorm import MultiScaleMaxNormCodec
from ...codecs.packing import pack_bits, unpack_bits
from ...codecs.randk import GLOBAL_RANDK_STREAM, RandKCodec
from ...codecs.rng import derive_seed
from ...comm.base import then
from .floats import float_allreduce
from .gathered import allgather


def _scale_reduce(t, codec: SummableCodec):
    """``reduce(stat, op)`` for the scale agreement over the transport ``t``: the transport's
    all-reduce, but the MIN of a multi-scale codec's small scale indices as packed bit-planes
    where the backend has a bitwise AND (gloo; NCCL reduces the uint8 indices by MIN)."""
    inner = codec.inner if isinstance(codec, RandKCodec) else codec
    planes = len(inner.scales) - 1 if isinstance(inner, MultiScaleMaxNormCodec) else None
    planes_ok = planes is not None and planes <= 7 and "band" in t.reduce_ops

    def reduce(stat, op):
        if op == "min" and stat.dtype == torch.uint8 and planes_ok:
            return _min_by_bitplanes(t, stat, planes)
        return t.all_reduce(stat, op)

    return reduce


def _min_by_bitplanes(t, idx: torch.Tensor, planes: int) -> torch.Tensor:
    """Element-wise MIN over ranks of small uint8 indices (0..planes): plane p = (index >= p),
    packed one bit per coordinate; the AND of a plane over ranks is (min >= p). Packed by the
    codecs' kernels (the reference's int64 packing on the reference path: the same bytes)."""
    n = idx.numel()
    if planes == 0:
        return idx
    K = kernels_for(idx)
    if K is None:
        pack, unpack = (lambda c: pack_bits(c.to(torch.int64), 1)), (lambda d: unpack_bits(d, 1, n).to(torch.uint8))
    else:
        pack, unpack = (lambda c: K.pack(c, 1)), (lambda d: K.unpack(d, 1, n))
    packed = t.all_reduce(torch.cat([pack((idx >= p).to(torch.uint8)) for p in range(1, planes + 1)]), "band")
    per = packed.numel() // planes
    out = unpack(packed[:per])
    for p in range(1, planes):
        out += unpack(packed[p * per:(p + 1) * per])
    return out


def int_allreduce(state, t, codec: SummableCodec, x, gen):
    """Lines 5-10 of the max-norm algorithms over the transport ``t``
    (:func:`~lowbit.algorithms.maxnorm.maxnorm_exchange`), the codes packed in summable lanes
    where those send fewer bytes, else in the sum dtype (int16 widened to int32: no backend
    reduces int16); an explicit ``state.sum_dtype``: in it, unpacked."""
    dtype = codec.sum_dtype(t.world_size, state.sum_dtype)
    if dtype == torch.int16:
        dtype = torch.int32
    lanes = codec.sum_lanes(t.world_size, state.sum_dtype, plain=dtype)
    return maxnorm_exchange(t, codec, x, gen, dtype, x.dtype, _scale_reduce(t, codec), lanes=lanes)


def randk_allreduce(state, t, codec: RandKCodec, x, bidx, gen):
    """Global random-k: the same coordinates of the bucket on every rank (the codec seeded from
    seed, step and bucket). A summable inner codec: the codec itself is summable, as the
    algorithm's GlobalRandK; otherwise the kept values travel through the inner codec's method
    and the average is scattered back (times d / k)."""
    d = x.numel()
    if state.kept is not None:  # a fraction of each bucket
        codec = dataclasses.replace(codec, k=kept_count(state.kept, d))
    codec = codec.with_seed(derive_seed(state.seed, state.step, bidx, GLOBAL_RANDK_STREAM))
    inner = codec.inner
    if is_summable(inner):
        return int_allreduce(state, t, codec, x, gen)
    idx = codec.indices(d, device=x.device)
    factor = d / idx.numel() if codec.rescale and idx.numel() else 1.0
    kept = x[idx]
    if inner.float_wire:
        fut, own = float_allreduce(t, inner, kept, scratch=not state.error_feedback)  # kept: a copy
    else:
        fut, own = allgather(state, t, inner, kept, bidx)

    def scatter(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(d, dtype=x.dtype, device=x.device)
        out[idx] = v.to(x.dtype) * factor  # v may be the fp16 wire: scaled in x's dtype
        return out

    return then(fut, scatter), None if own is None else lambda: scatter(own())
