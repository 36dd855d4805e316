"""The max-norm family: the shared scale's rounds, then one SUM all-reduce of integer codes
(``allreduce-int``), optionally on the global random-k coordinates (``allreduce-randk``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ...algorithms.maxnorm import agree_scale_by, kept_count
from ...codecs.base import SummableCodec, is_summable
from ...codecs.maxnorm import MultiScaleMaxNormCodec
from ...codecs.packing import pack_bits, unpack_bits
from ...codecs.randk import GLOBAL_RANDK_STREAM, RandKCodec
from ...codecs.rng import derive_seed
from .floats import float_allreduce
from .gathered import allgather
from .state import _FLOAT_WIRE, _ok


def _scale_rounds(state, codec: SummableCodec, x, world, group, bidx):
    """The max-norm algorithm's scale agreement (:func:`~lowbit.algorithms.maxnorm.agree_scale_by`)
    over ``group``, the MIN of small scale indices as packed bit-planes."""

    def reduce(stat, op):
        if op == "min" and stat.dtype == torch.uint8 and isinstance(codec, MultiScaleMaxNormCodec) \
                and len(codec.scales) - 1 <= 7:
            return _min_by_bitplanes(state, stat, len(codec.scales) - 1, world, group, bidx)
        state._count("all_reduce", stat.numel() * stat.element_size(), world, bidx)
        dist.all_reduce(stat, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
        return stat

    return agree_scale_by(codec, x, reduce)


def _min_by_bitplanes(state, idx: torch.Tensor, planes: int, world, group, bidx) -> torch.Tensor:
    """Element-wise MIN over ranks of small indices (0..planes): plane p = (index >= p),
    packed one bit per coordinate; the AND of a plane over ranks is (min >= p)."""
    n = idx.numel()
    if planes == 0:
        return idx
    i64 = idx.to(torch.int64)
    packed = torch.cat([pack_bits((i64 >= p).to(torch.int64), 1) for p in range(1, planes + 1)])
    state._count("all_reduce", packed.numel(), world, bidx)
    dist.all_reduce(packed, op=dist.ReduceOp.BAND, group=group)
    per = packed.numel() // planes
    out = torch.zeros(n, dtype=torch.int64, device=idx.device)
    for p in range(planes):
        out += unpack_bits(packed[p * per:(p + 1) * per], 1, n)
    return out.to(torch.uint8)


def int_allreduce(state, codec: SummableCodec, x, world, group, bidx, gen):
    """Lines 5-10 of the max-norm algorithms over ``group``: the scale rounds, the integer codes
    in the sum dtype (int16 widened to int32), one SUM all-reduce, ``decode_sum``."""
    scale = _scale_rounds(state, codec, x, world, group, bidx)
    codes = codec.encode_int(x, scale, gen)
    dtype = codec.sum_dtype(world, state.sum_dtype)
    if dtype == torch.int16:  # no backend reduces int16
        dtype = torch.int32
    t = codes.to(dtype)
    own = lambda: codec.decode_sum(codes, scale, 1, numel=x.numel(), dtype=torch.float64)  # noqa: E731
    state._count("all_reduce", t.numel() * t.element_size(), world, bidx)
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: _ok(f) and codec.decode_sum(t.to(torch.int64), scale, world, numel=x.numel(),
                                                          dtype=torch.float64)), own


def randk_allreduce(state, codec: RandKCodec, x, world, group, bidx, rank, gen):
    """Global random-k: the same coordinates of the bucket on every rank (from seed, step and
    bucket), those through the inner codec's method, the average scattered back (times d / k)."""
    d = x.numel()
    if state.kept is not None:  # a fraction of each bucket
        codec = dataclasses.replace(codec, k=kept_count(state.kept, d))
    sel_seed = derive_seed(state.seed, state.step, bidx, GLOBAL_RANDK_STREAM)
    idx = codec.indices(d, sel_seed, device=x.device)
    factor = d / idx.numel() if codec.rescale and idx.numel() else 1.0
    kept = x[idx]
    inner = codec.inner
    if isinstance(inner, _FLOAT_WIRE):
        fut, own = float_allreduce(state, inner, kept, world, group, bidx)
    elif is_summable(inner):
        fut, own = int_allreduce(state, inner, kept, world, group, bidx, gen)
    else:
        fut, own = allgather(state, inner, kept, world, group, bidx, rank)

    def scatter(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(d, dtype=torch.float64, device=x.device)
        out[idx] = v * factor
        return out

    return fut.then(lambda f: scatter(f.value())), lambda: scatter(own())
