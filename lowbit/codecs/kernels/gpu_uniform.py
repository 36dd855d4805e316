"""Triton kernels of the "uniform" family on CUDA: the uniform grid ``{step n}``
(:class:`lowbit.codecs.UniformCodec`), the same names and signatures as :mod:`.cpu_uniform`
(:class:`~lowbit.codecs.kernels.families.UniformKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. An encode reads back to the host twice: ``x``'s range, then
the codes' range, which fixes the width (each with the non-finite flag).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..rng import counter_uniforms, split_key
from .gpu import BLOCK, _grid, _scalar, _work_dtype, div, load_work, pack, round_grid, unpack

__all__ = ["uniform_codes", "uniform_pack", "uniform_decode"]


# --- uniform grid {step n} -------------------------------------------------------------------

@triton.jit
def _uniform_encode_kernel(x_ptr, codes_ptr, range_ptr, n, step_ptr, base, k0, k1, STOCHASTIC: tl.constexpr,
                           BLOCK_: tl.constexpr):
    """``round(x / step) - base`` as int32, and atomically the min and max of those."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = load_work(x_ptr, offs, mask)
    c = round_grid(div(x, tl.load(step_ptr)), offs, k0, k1, STOCHASTIC)
    r = (c.to(tl.int64) - base).to(tl.int32)
    tl.store(codes_ptr + offs, r, mask=mask)
    tl.atomic_min(range_ptr, tl.min(tl.where(mask, r, 2147483647), axis=0))
    tl.atomic_max(range_ptr + 1, tl.max(tl.where(mask, r, -2147483647 - 1), axis=0))


@triton.jit
def _uniform_decode_kernel(codes_ptr, out_ptr, n, offset, step_ptr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    step = tl.load(step_ptr)
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int64) + offset
    tl.store(out_ptr + offs, (c.to(step.dtype) * step).to(out_ptr.dtype.element_ty), mask=mask)


def _uniform_codes_torch(x: torch.Tensor, step: float, stochastic: bool, key: int):
    """Codes whose bounds span more than int32: float64 torch, as the reference."""
    v = x.detach().to(torch.float64) / step
    if stochastic:
        f = torch.floor(v)
        c = f + (counter_uniforms(key, v.numel(), v.device, torch.float64) < v - f).to(torch.float64)
    else:
        c = torch.round(v)
    lo, hi = torch.aminmax(c)
    lo, hi = float(lo), float(hi)
    if not (hi - lo <= 2**32 - 1 and -2.0**62 < lo <= hi < 2.0**62):
        return None, 0, lo, hi, True
    return (c - lo).to(torch.int64), int(lo), lo, hi, True


def uniform_codes(x: torch.Tensor, step: float, stochastic: bool, key: int):
    """See :func:`.cpu_uniform.uniform_codes`; here the codes minus ``base`` are int32."""
    from .gpu import stats
    x = x.detach().contiguous()
    lo, hi, _, _, finite = stats(x)
    xmin, xmax, finite = torch.stack([lo.double(), hi.double(), finite.double()]).tolist()
    if not finite:
        return None, 0, math.nan, math.nan, False
    lo_b, hi_b = math.floor(xmin / step) - 1.0, math.floor(xmax / step) + 2.0  # float32 may move a code by one
    if not (hi_b - lo_b < 2**31 - 2 and -2.0**62 < lo_b <= hi_b < 2.0**62):
        return _uniform_codes_torch(x, step, stochastic, key)
    n = x.numel()
    base = int(lo_b)
    codes = torch.empty(n, dtype=torch.int32, device=x.device)
    rng = torch.full((2,), 2**31 - 1, dtype=torch.int32, device=x.device)
    rng[1] = -2**31
    k0, k1 = split_key(key)
    _uniform_encode_kernel[_grid(n, BLOCK)](x, codes, rng, n, _scalar(step, _work_dtype(x.dtype), x.device), base,
                                           k0, k1, STOCHASTIC=bool(stochastic), BLOCK_=BLOCK)
    cmin, cmax = rng.tolist()  # the second host read: the codes' range fixes the width
    return codes, base, float(base + cmin), float(base + cmax), True


def uniform_pack(codes: torch.Tensor, shift: int, b: int) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_uniform.uniform_pack`: ``codes - shift`` (each then < 2^b, checked
    by the caller) packed ``b`` bits each."""
    rel = codes - shift if shift else codes
    return pack(rel.to(torch.uint8) if b <= 8 else rel.to(torch.int64), b)


def uniform_decode(data: torch.Tensor, b: int, n: int, offset: int, step: float, dtype: torch.dtype) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_uniform.uniform_decode`: ``(codes + offset) * step`` as ``dtype``
    from ``n`` codes of ``b`` bits."""
    codes = unpack(data, b, n, torch.uint8 if b <= 8 else torch.int64)
    out = torch.empty(n, dtype=dtype, device=data.device)
    if n:
        _uniform_decode_kernel[_grid(n, BLOCK)](codes, out, n, offset, _scalar(step, _work_dtype(dtype), data.device),
                                               BLOCK_=BLOCK)
    return out
