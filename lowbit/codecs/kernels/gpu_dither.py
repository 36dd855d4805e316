"""Triton kernels of the "dither" family on CUDA (optional: needs ``triton``): DQSG
(DitheredCodec), NDQSG (NestedDitheredCodec) and QSGD (QSGDCodec).

The same torch-level API as :mod:`.cpu_dither` (same names and arguments).
Arithmetic is in float32 for float32/half input (float64 for float64); the
uniforms are the counter hash of :mod:`lowbit.codecs.rng` (:func:`.gpu.uniform`),
so codes differ from the reference only where float32 rounding moves a value
across a grid point (by one code, on a tiny fraction of elements: the codecs'
docstrings state the error bounds' float32 slack). Scales stay on the device;
an encode reads back to the host only its status (non-finite flag, largest
scale or index) once, to raise a clear error. Sums of squares are accumulated
in float64 (no overflow below the float32 norm limit; block partial sums are
added atomically, so their order, and the last bits, may vary between runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, is_nonfinite, pack, uniform, unpack

__all__ = ["code_dtype", "host_values", "index_limit", "ratio", "pack", "unpack", "dithered_scales", "dithered_encode",
           "dithered_decode", "nested_encode", "nested_decode", "qsgd_sumsq", "qsgd_encode", "qsgd_decode"]


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


def index_limit(dtype: torch.dtype) -> float:
    """NDQSG's fine index is exact below this: ``2^52`` in float64, ``2^24`` in float32
    (the arithmetic of float32 and half inputs)."""
    return 2.0**52 if dtype == torch.float64 else 2.0**24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
                                                 F64=_compute_dtype(dtype) == torch.float64, BLOCK_=BLOCK)
    return out


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
    """``(codes, all finite, max |fine index|)`` of NDQSG's eq. (6) (as :mod:`.cpu_dither`:
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
                                             F64=_compute_dtype(dtype) == torch.float64, BLOCK_=BLOCK)
    return out
