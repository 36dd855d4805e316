"""Triton kernels of the "minmax" family on CUDA: min-max (Bagua's) quantization
(:class:`lowbit.codecs.MinMaxCodec`), the same names and signatures as :mod:`.cpu_minmax`
(:class:`~lowbit.codecs.kernels.families.MinMaxKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. An encode reads back to the host once: the header's values
with the non-finite flag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, _scalar, _work_dtype, div, load_work, pack, round_grid, unpack

__all__ = ["minmax_range", "minmax_encode", "minmax_decode"]


# --- min-max -------------------------------------------------------------------------------

@triton.jit
def _minmax_encode_kernel(x_ptr, codes_ptr, n, lo_ptr, scale_ptr, k0, k1, TOP: tl.constexpr,
                          STOCHASTIC: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = load_work(x_ptr, offs, mask)
    c = round_grid((x - tl.load(lo_ptr)) * tl.load(scale_ptr), offs, k0, k1, STOCHASTIC)
    c = tl.minimum(tl.maximum(c, 0.0), TOP)
    tl.store(codes_ptr + offs, c.to(tl.uint8), mask=mask)


@triton.jit
def _minmax_decode_kernel(codes_ptr, out_ptr, n, scale_ptr, lo_ptr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    scale = tl.load(scale_ptr)
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(scale.dtype)
    tl.store(out_ptr + offs, (div(c, scale) + tl.load(lo_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


def minmax_range(x: torch.Tensor) -> tuple[float, float, bool]:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_minmax.minmax_range`: ``(min, max, finite)`` of ``x`` in one pass
    (min/max over the finite elements)."""
    from .gpu import stats
    lo, hi, _, _, finite = stats(x.detach())
    lo, hi, finite = torch.stack([lo.double(), hi.double(), finite.double()]).tolist()  # the one host read
    return lo, hi, bool(finite)


def minmax_encode(x: torch.Tensor, lo: float, scale: float, bits: int, stochastic: bool, key: int) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_minmax.minmax_encode`: ``clamp(round((x - lo) * scale), 0, 2^bits -
    1)`` packed ``bits`` each."""
    x = x.detach().contiguous()
    n = x.numel()
    wd = _work_dtype(x.dtype)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    k0, k1 = split_key(key)
    _minmax_encode_kernel[_grid(n, BLOCK)](x, codes, n, _scalar(lo, wd, x.device), _scalar(scale, wd, x.device),
                                          k0, k1, TOP=float((1 << bits) - 1), STOCHASTIC=bool(stochastic),
                                          BLOCK_=BLOCK)
    return pack(codes, bits)


def minmax_decode(data: torch.Tensor, bits: int, n: int, lo: float, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_minmax.minmax_decode`: ``unpack(data) / scale + lo`` as ``dtype``
    (``scale > 0``; the caller handles ``scale == 0``)."""
    codes = unpack(data, bits, n)
    out = torch.empty(n, dtype=dtype, device=data.device)
    wd = _work_dtype(dtype)
    if n:
        _minmax_decode_kernel[_grid(n, BLOCK)](codes, out, n, _scalar(scale, wd, data.device),
                                              _scalar(lo, wd, data.device), BLOCK_=BLOCK)
    return out
