"""Triton kernels of the "qsgd" family on CUDA: QSGD
(:class:`lowbit.codecs.QSGDCodec`), the same names and signatures as :mod:`.cpu_qsgd`
(:class:`~lowbit.codecs.kernels.families.QSGDKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. Sums of squares are accumulated in float64, block partial
sums added atomically (their order, and the last bits, may vary between runs). Also here,
shared with :mod:`.gpu_dithered` and :mod:`.gpu_nested`: :func:`code_dtype`,
:func:`host_values` (one read from the device for all the tensors among them) and
:func:`ratio`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, _work_dtype, is_nonfinite, uniform

__all__ = ["code_dtype", "host_values", "ratio", "qsgd_sumsq", "qsgd_encode", "qsgd_decode"]


def code_dtype(b: int) -> torch.dtype:
    """Codes of ``b`` bits on CUDA: uint8 up to 8 bits (the core's packing kernels), int32
    up to 31, int64 beyond (the core packs widths above 8 with :func:`~lowbit.codecs.packing.pack_wide`)."""
    return torch.uint8 if b <= 8 else (torch.int32 if b <= 31 else torch.int64)


def host_values(*values) -> tuple:
    """Python scalars of ``values`` (bools, floats or one-element tensors), with ONE read
    from the device for all the tensors among them (the encode's status)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return tuple(values)
    host = iter(torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).tolist())
    return tuple((bool(next(host)) if v.dtype == torch.bool else next(host)) if isinstance(v, torch.Tensor) else v
                 for v in values)


def ratio(num: float, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` in float64 on the device, 0 where ``den == 0``."""
    d = den.to(torch.float64)
    pos = d > 0
    return torch.where(pos, torch.full_like(d, float(num)) / torch.where(pos, d, torch.ones_like(d)),
                       torch.zeros_like(d))


# --- QSGD -------------------------------------------------------------------------------------

@triton.jit
def _sumsq_kernel(x_ptr, out_ptr, bad_ptr, n, bucket, chunks, BLOCK_: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // chunks
    offs = b * bucket + (pid % chunks) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = (offs < n) & (offs < b * bucket + bucket)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    tl.atomic_add(out_ptr + b, tl.sum(x * x, axis=0))
    nonfinite = tl.sum(tl.where(mask & is_nonfinite(x), 1, 0), axis=0)
    tl.atomic_max(bad_ptr, nonfinite)


@triton.jit
def _qsgd_encode_kernel(x_ptr, factor_ptr, codes_ptr, n, bucket, k0, k1, S: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    f = tl.load(factor_ptr + offs // bucket, mask=mask, other=0.0).to(x.dtype)
    v = tl.minimum(tl.abs(x) * f, S)
    lo = tl.floor(v)
    xi = lo + (uniform(offs, k0, k1).to(x.dtype) < (v - lo)).to(x.dtype)
    code = tl.where(x < 0, -xi, xi) + S
    tl.store(codes_ptr + offs, code.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qsgd_decode_kernel(codes_ptr, step_ptr, out_ptr, n, bucket, S: tl.constexpr, F64: tl.constexpr,
                        BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    c = tl.load(codes_ptr + offs, mask=mask, other=0)
    st = tl.load(step_ptr + offs // bucket, mask=mask, other=0.0)
    if F64:
        v = (c.to(tl.float64) - S) * st
    else:
        v = (c.to(tl.float32) - S) * st.to(tl.float32)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def qsgd_sumsq(x: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of squares per bucket as device float64, all finite as a device bool)``."""
    x = x.detach().contiguous()
    n = x.numel()
    k = max(1, triton.cdiv(n, bucket))
    out = torch.zeros(k, dtype=torch.float64, device=x.device)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        block = min(BLOCK, triton.next_power_of_2(min(bucket, n)))
        chunks = triton.cdiv(min(bucket, n), block)
        _sumsq_kernel[(k * chunks,)](x, out, bad, n, bucket, chunks, BLOCK_=block)
    return out, bad[0] == 0


def qsgd_encode(x: torch.Tensor, factor: torch.Tensor, bucket: int, levels: int, bits: int, key: int) -> torch.Tensor:
    """QSGD codes ``sign xi + s``; ``factor``: ``s / norm_j`` per bucket (device float64)."""
    x = x.detach().contiguous()
    n = x.numel()
    codes = torch.empty(n, dtype=code_dtype(bits), device=x.device)
    k0, k1 = split_key(key)
    if n:
        _qsgd_encode_kernel[_grid(n, BLOCK)](x, factor.contiguous(), codes, n, bucket, k0, k1, S=levels,
                                             BLOCK_=BLOCK)
    return codes


def qsgd_decode(codes: torch.Tensor, step: torch.Tensor, bucket: int, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """``(code - s) st_j``; ``step``: ``norm_j / s`` per bucket (device float64)."""
    n = codes.numel()
    out = torch.empty(n, dtype=dtype, device=codes.device)
    if n:
        _qsgd_decode_kernel[_grid(n, BLOCK)](codes, step.contiguous(), out, n, bucket, S=levels,
                                             F64=_work_dtype(dtype) == torch.float64, BLOCK_=BLOCK)
    return out
