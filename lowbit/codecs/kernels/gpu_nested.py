"""Triton kernels of the "nested" family on CUDA: NDQSG
(:class:`lowbit.codecs.NestedDitheredCodec`), the same names and signatures as :mod:`.cpu_nested`
(:class:`~lowbit.codecs.kernels.families.NestedKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. The fine index is exact below ``2^52`` in float64 and
``2^24`` in float32 (:func:`index_limit`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, is_nonfinite, uniform
from .gpu_qsgd import code_dtype, host_values

__all__ = ["code_dtype", "index_limit", "nested_encode", "nested_decode"]


def index_limit(dtype: torch.dtype) -> float:
    """NDQSG's fine index is exact below this: ``2^52`` in float64, ``2^24`` in float32
    (the arithmetic of float32 and half inputs)."""
    return 2.0**52 if dtype == torch.float64 else 2.0**24


# --- NDQSG ------------------------------------------------------------------------------------

@triton.jit
def _nested_encode_kernel(x_ptr, codes_ptr, status_ptr, worst_ptr, n, alpha, delta1, inv_delta1, k, k0, k1,
                          LIMIT: tl.constexpr, POW2: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    u = (uniform(offs, k0, k1).to(x.dtype) - 0.5) * delta1
    t = alpha * x + u
    m = tl.floor(t * inv_delta1 + 0.5)
    a = tl.where(mask, tl.abs(m), 0.0)
    nonfinite = tl.sum(tl.where(mask & is_nonfinite(x), 1, 0), axis=0)
    over = tl.sum(tl.where(a >= LIMIT, 1, 0), axis=0)
    tl.atomic_max(status_ptr, nonfinite)
    tl.atomic_max(status_ptr + 1, over)
    tl.atomic_max(worst_ptr, tl.max(tl.where(a == a, a, 0.0), axis=0).to(tl.float32))
    mi = tl.where(a < LIMIT, m, 0.0).to(tl.int64)
    if POW2:
        c = mi & (k - 1)
    else:
        c = mi % k
        c = tl.where(c < 0, c + k, c)
    tl.store(codes_ptr + offs, c.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nested_decode_kernel(codes_ptr, y_ptr, out_ptr, n, alpha, delta1, delta2, inv_delta2, k0, k1,
                          BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    y0 = tl.load(y_ptr + offs, mask=mask, other=0.0)
    y = y0 if y0.dtype == tl.float64 else y0.to(tl.float32)
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(y.dtype)
    u = (uniform(offs, k0, k1).to(y.dtype) - 0.5) * delta1
    r = c * delta1 - u - alpha * y
    fold = r - delta2 * tl.floor(r * inv_delta2 + 0.5)
    tl.store(out_ptr + offs, (y + alpha * fold).to(y0.dtype), mask=mask)


def nested_encode(x: torch.Tensor, alpha: float, delta1: float, k: int, bits: int, key: int):
    """``(codes, all finite, max |fine index|)`` of NDQSG's eq. (6) (as :mod:`.cpu_nested`:
    the maximum is exact when it reaches the limit, else only known to be below it); the
    scalars come from one host read. Beyond ``2^24`` (float32) or ``2^52`` (float64) the index is not
    exact: the codec raises, and the codes are then meaningless."""
    x = x.detach().contiguous()
    n = x.numel()
    codes = torch.empty(n, dtype=code_dtype(bits), device=x.device)
    status = torch.zeros(2, dtype=torch.int32, device=x.device)
    worst = torch.zeros(1, dtype=torch.float32, device=x.device)
    k0, k1 = split_key(key)
    limit = index_limit(x.dtype)
    if n:
        _nested_encode_kernel[_grid(n, BLOCK)](x, codes, status, worst, n, alpha, delta1, 1.0 / delta1, k, k0, k1,
                                               LIMIT=limit, POW2=(k & (k - 1)) == 0, BLOCK_=BLOCK)
    bad, over, w = host_values(status[0], status[1], worst[0])
    return codes, not bad, (max(w, limit) if over else w)


def nested_decode(codes: torch.Tensor, y: torch.Tensor, alpha: float, delta1: float, delta2: float,
                  key: int) -> torch.Tensor:
    """Eq. (7) against side information ``y``, in ``y``'s dtype."""
    y = y.detach().contiguous()
    n = codes.numel()
    out = torch.empty(n, dtype=y.dtype, device=y.device)
    k0, k1 = split_key(key)
    if n:
        _nested_decode_kernel[_grid(n, BLOCK)](codes, y, out, n, alpha, delta1, delta2, 1.0 / delta2, k0, k1,
                                               BLOCK_=BLOCK)
    return out
