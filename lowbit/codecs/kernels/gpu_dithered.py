"""Triton kernels of the "dithered" family on CUDA: DQSG
(:class:`lowbit.codecs.DitheredCodec`), the same names and signatures as :mod:`.cpu_dithered`
(:class:`~lowbit.codecs.kernels.families.DitheredKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. Scales stay on the device; an encode reads back its status
once (:func:`host_values`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, _work_dtype, uniform
from .gpu_qsgd import code_dtype, host_values, ratio

__all__ = ["code_dtype", "host_values", "ratio", "dithered_scales", "dithered_encode", "dithered_decode"]


@triton.jit
def _part_of(offs, base, extra):
    """The part of element ``offs``: ``extra`` parts of ``base + 1`` elements, then parts of ``base``."""
    head = extra * (base + 1)
    return tl.where(offs < head, offs // (base + 1), extra + (offs - head) // base)


# --- DQSG -------------------------------------------------------------------------------------

def dithered_scales(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max |x_j| per part as float64, all finite as a device bool)``: one read of ``x``
    (``aminmax`` per part)."""
    x = x.detach()
    n = x.numel()
    base, extra = n // parts, n % parts
    h = extra * (base + 1)
    out = []
    for v in (x[:h].view(extra, base + 1), x[h:].view(parts - extra, base)):
        if v.shape[0]:
            lo, hi = torch.aminmax(v, dim=1)
            out.append(torch.maximum(-lo, hi).to(torch.float64))
    amax = torch.cat(out)
    return amax, torch.isfinite(amax).all()


@triton.jit
def _dithered_encode_kernel(x_ptr, factor_ptr, codes_ptr, n, base, extra, k0, k1, M: tl.constexpr,
                            BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    s = tl.load(factor_ptr + _part_of(offs, base, extra), mask=mask, other=0.0).to(x.dtype)
    q = tl.floor(x * s + uniform(offs, k0, k1).to(x.dtype))
    q = tl.minimum(tl.maximum(q, -M), M)
    tl.store(codes_ptr + offs, (q + M).to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dithered_decode_kernel(codes_ptr, step_ptr, out_ptr, n, base, extra, k0, k1, M: tl.constexpr,
                            SUBTRACTIVE: tl.constexpr, F64: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    c = tl.load(codes_ptr + offs, mask=mask, other=0)
    st = tl.load(step_ptr + _part_of(offs, base, extra), mask=mask, other=0.0)
    if F64:
        q = c.to(tl.float64) - M
        r = uniform(offs, k0, k1).to(tl.float64)
    else:
        q = c.to(tl.float32) - M
        r = uniform(offs, k0, k1)
        st = st.to(tl.float32)
    if SUBTRACTIVE:
        v = st * (q - (r - 0.5))
    else:
        v = st * q
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def dithered_encode(x: torch.Tensor, factor: torch.Tensor, levels: int, bits: int, key: int) -> torch.Tensor:
    """Codes ``q + M`` of DQSG; ``factor``: ``M / kappa_j`` per part (device float64)."""
    x = x.detach().contiguous()
    n, p = x.numel(), factor.numel()
    codes = torch.empty(n, dtype=code_dtype(bits), device=x.device)
    k0, k1 = split_key(key)
    if n:
        _dithered_encode_kernel[_grid(n, BLOCK)](x, factor.contiguous(), codes, n, n // p, n % p, k0, k1,
                                                 M=levels, BLOCK_=BLOCK)
    return codes


def dithered_decode(codes: torch.Tensor, step: torch.Tensor, levels: int, subtractive: bool, key: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """DQSG's reconstruction; ``step``: ``kappa_j / M`` per part (device float64)."""
    n, p = codes.numel(), step.numel()
    out = torch.empty(n, dtype=dtype, device=codes.device)
    k0, k1 = split_key(key)
    if n:
        _dithered_decode_kernel[_grid(n, BLOCK)](codes, step.contiguous(), out, n, n // p, n % p, k0, k1,
                                                 M=levels, SUBTRACTIVE=bool(subtractive),
                                                 F64=_work_dtype(dtype) == torch.float64, BLOCK_=BLOCK)
    return out
