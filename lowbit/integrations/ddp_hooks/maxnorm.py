"""The max-norm family: the shared scale's rounds, then one SUM all-reduce of integer codes
(``allreduce-int``), optionally on the global random-k coordinates (``allreduce-randk``): the
exchange of :class:`~lowbit.algorithms.maxnorm.MaxNormSGD`,
:func:`~lowbit.algorithms.maxnorm.maxnorm_exchange`, with the scale indices' MIN as bit-planes."""

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
