"""Triton kernels of the max-norm family on CUDA (optional: needs ``triton``).

The torch-level API of :mod:`.cpu_maxnorm` (same names and signatures). The
arithmetic is in float32 for float32/half inputs and float64 for float64: the
ratio ``|x_i| / W`` is one IEEE division, so ``a_i <= 1`` holds exactly when
``|x_i| <= W``, and a code may differ from the CPU's (float64) by one level on a
fraction ``~ s 2^-24`` of the coordinates (see :mod:`lowbit.codecs.maxnorm`).
Error flags are OR-ed into one int32 on the device; the caller reads it once.
The norm is a float64 sum of per-block float64 partial sums (deterministic: no
atomics on floats). Random-k's selection and scatter on CUDA are :mod:`.gpu_randk`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, div, load_work, uniform

__all__ = ["FLAG_NONFINITE", "FLAG_OVER", "FLAG_INDEX", "FLAG_LEVEL", "as_scale", "norm_stats", "code_dtype",
           "qsgd_encode", "qsgd_decode", "ms_index", "ms_encode_int", "ms_encode_words", "ms_decode_sum",
           "ms_decode_words"]

FLAG_NONFINITE = 1
FLAG_OVER = 2
FLAG_INDEX = 4
FLAG_LEVEL = 8


@triton.jit
def _flag_bits(mask, x, a, W):
    bad = tl.max(tl.where(mask & ((x != x) | (a == float("inf"))), 1, 0), axis=0)
    over = tl.max(tl.where(mask & (a > W), 2, 0), axis=0)
    return bad | over


@triton.jit
def _norm_partials_kernel(x_ptr, sq_ptr, amax_ptr, bad_ptr, n, BLOCK_: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    a = tl.abs(x)
    bad = mask & ((x != x) | (a == float("inf")))
    xf = tl.where(bad, 0.0, x)
    tl.store(sq_ptr + pid, tl.sum(xf * xf, axis=0))
    tl.store(amax_ptr + pid, tl.max(tl.where(bad, 0.0, a), axis=0))
    tl.store(bad_ptr + pid, tl.max(tl.where(bad, 1, 0), axis=0))


@triton.jit
def _qsgd_encode_kernel(x_ptr, codes_ptr, flag_ptr, n, W, Wdiv, S, OFFSET, k0, k1, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = load_work(x_ptr, offs, mask)
    a = tl.abs(x)
    t = div(a, Wdiv) * S
    lo = tl.floor(t)
    mag = (lo + (uniform(offs, k0, k1) < (t - lo)).to(t.dtype)).to(tl.int64)
    c = tl.where(x < 0, -mag, mag) + OFFSET
    tl.store(codes_ptr + offs, c.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.atomic_or(flag_ptr, _flag_bits(mask, x, a, W))


@triton.jit
def _qsgd_decode_kernel(codes_ptr, par_ptr, out_ptr, n, OFFSET, BLOCK_: tl.constexpr):
    """``(code - OFFSET) * f / m`` with ``(f, m)`` read from ``par_ptr`` (the working dtype:
    float scalar arguments would be float32)."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    f = tl.load(par_ptr)
    m = tl.load(par_ptr + 1)
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int64) - OFFSET
    v = div(c.to(f.dtype) * f, m)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _admissible(r, lev_ptr, N: tl.constexpr):
    s_min = tl.load(lev_ptr)
    j = tl.zeros(r.shape, dtype=tl.int32)
    for k in tl.static_range(1, N):
        j += tl.where(r * tl.load(lev_ptr + k) <= s_min, 1, 0)
    return j


@triton.jit
def _ms_index_kernel(x_ptr, lev_ptr, idx_ptr, flag_ptr, n, W, Wdiv, N: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = load_work(x_ptr, offs, mask)
    a = tl.abs(x)
    r = div(a, Wdiv).to(tl.load(lev_ptr).dtype)
    tl.store(idx_ptr + offs, _admissible(r, lev_ptr, N).to(tl.uint8), mask=mask)
    tl.atomic_or(flag_ptr, _flag_bits(mask, x, a, W))


@triton.jit
def _ms_encode_kernel(x_ptr, lev_ptr, idx_ptr, out_ptr, flag_ptr, n, W, Wdiv, k0, k1, CODE_BITS: tl.constexpr,
                      N: tl.constexpr, OWN: tl.constexpr, BLOCK_: tl.constexpr):
    """OWN: this worker's own indices, words ``(j << CODE_BITS) | (code + s_min)``; else the
    codes (int64) on the agreed scales ``idx``."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = load_work(x_ptr, offs, mask)
    a = tl.abs(x)
    s_min = tl.load(lev_ptr)
    r = div(a, Wdiv).to(s_min.dtype)
    flags = _flag_bits(mask, x, a, W)
    if OWN:
        j = _admissible(r, lev_ptr, N)
    else:
        j = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int32)
        out_of_range = (j < 0) | (j >= N)
        flags = flags | tl.max(tl.where(mask & out_of_range, 4, 0), axis=0)
        j = tl.where(out_of_range, 0, j)
    t = r * tl.load(lev_ptr + j, mask=mask, other=1.0)
    if not OWN:
        flags = flags | tl.max(tl.where(mask & (t > s_min), 8, 0), axis=0)
    lo = tl.floor(t)
    mag = (lo + (uniform(offs, k0, k1) < (t - lo)).to(t.dtype)).to(tl.int64)
    c = tl.where(x < 0, -mag, mag)
    if OWN:
        c = (j.to(tl.int64) << CODE_BITS) | (c + s_min.to(tl.int64))
    tl.store(out_ptr + offs, c.to(out_ptr.dtype.element_ty), mask=mask)
    tl.atomic_or(flag_ptr, flags)


@triton.jit
def _ms_decode_kernel(c_ptr, idx_ptr, lev_ptr, out_ptr, flag_ptr, n, W, m, CODE_BITS: tl.constexpr,
                      N: tl.constexpr, WORDS: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    lev0 = tl.load(lev_ptr)
    w = tl.load(c_ptr + offs, mask=mask, other=0).to(tl.int64)
    if WORDS:
        j = w >> CODE_BITS
        c = (w & ((1 << CODE_BITS) - 1)) - lev0.to(tl.int64)
    else:
        j = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int64)
        c = w
    bad = (j < 0) | (j >= N)
    j = tl.where(bad, 0, j)
    v = div(div(c.to(lev0.dtype) * W, tl.load(lev_ptr + j, mask=mask, other=1.0)), m)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)
    tl.atomic_or(flag_ptr, tl.max(tl.where(mask & bad, 4, 0), axis=0))


# --- torch-level API (the names and signatures of cpu_maxnorm) ------------------------------------

def _flag(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=x.device)


def _W(W) -> tuple[float, float]:
    W = float(W)
    return W, (W if W > 0 else 1.0)


def _work(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def as_scale(W: float, x: torch.Tensor) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.as_scale`: the shared-scale tensor ``[W]`` (float32) on
    x's device (filled there: no copy from the host, which would wait for the GPU)."""
    return torch.full((1,), W, dtype=torch.float32, device=x.device)


def norm_stats(x: torch.Tensor) -> tuple[float, float, bool]:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.norm_stats`: ``(max |x|, sum x^2,
    all finite)`` from float64 partials per block, read to the host together (one read)."""
    x = x.detach().contiguous()
    if not x.numel():
        return 0.0, 0.0, True
    nb = triton.cdiv(x.numel(), BLOCK)
    sq = torch.empty(nb, dtype=torch.float64, device=x.device)
    amax = torch.empty(nb, dtype=torch.float64, device=x.device)
    bad = torch.empty(nb, dtype=torch.int32, device=x.device)
    _norm_partials_kernel[(nb,)](x, sq, amax, bad, x.numel(), BLOCK_=BLOCK)
    amax_v, sq_v, bad_v = torch.stack([amax.max(), sq.sum(), bad.max().to(torch.float64)]).tolist()
    return amax_v, sq_v, not bad_v


def code_dtype(bits: int) -> torch.dtype:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.code_dtype`: the narrowest dtype of the offset
    (non-negative) codes of ``bits`` bits on the wire."""
    return torch.uint8 if bits <= 8 else (torch.int32 if bits <= 31 else torch.int64)


def qsgd_encode(x: torch.Tensor, W, levels: int, offset: int, key: int, dtype: torch.dtype):
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.qsgd_encode`: ``(codes, flags)``: ``sign(x) sround(|x| / W
    * levels) + offset`` as ``dtype``."""
    x = x.detach().contiguous()
    W, Wdiv = _W(W)
    codes = torch.empty(x.numel(), dtype=dtype, device=x.device)
    flag = _flag(x)
    k0, k1 = split_key(key)
    if x.numel():
        _qsgd_encode_kernel[_grid(x.numel(), BLOCK)](x, codes, flag, x.numel(), W, Wdiv, float(levels), offset,
                                                     k0, k1, BLOCK_=BLOCK)
    return codes, flag


def qsgd_decode(codes: torch.Tensor, offset: int, W, levels: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.qsgd_decode`: ``(codes - offset) * (W / levels) / m`` in
    float64 registers, stored as ``dtype``."""
    codes = codes.contiguous()
    direct = dtype in (torch.float32, torch.float64)
    out = torch.empty(codes.numel(), dtype=dtype if direct else torch.float32, device=codes.device)
    par = torch.full((2,), float(m), device=codes.device,  # filled on the device: no copy from the host
                     dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    par[:1].fill_(float(W) / levels)
    if codes.numel():
        _qsgd_decode_kernel[_grid(codes.numel(), BLOCK)](codes, par, out, codes.numel(), offset, BLOCK_=BLOCK)
    return out if direct else out.to(dtype)


def _levels(levels: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return levels.to(device=x.device, dtype=_work(x)).contiguous()


def ms_index(x: torch.Tensor, W, levels: torch.Tensor):
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.ms_index`: ``(uint8 index of the admissible scale,
    flags)``; ``levels`` float64 ascending."""
    x = x.detach().contiguous()
    W, Wdiv = _W(W)
    idx = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    flag = _flag(x)
    if x.numel():
        _ms_index_kernel[_grid(x.numel(), BLOCK)](x, _levels(levels, x), idx, flag, x.numel(), W, Wdiv,
                                                  N=levels.numel(), BLOCK_=BLOCK)
    return idx, flag


def _ms_encode(x, W, levels, idx, key, out, code_bits, own):
    x = x.detach().contiguous()
    W, Wdiv = _W(W)
    flag = _flag(x)
    k0, k1 = split_key(key)
    if x.numel():
        _ms_encode_kernel[_grid(x.numel(), BLOCK)](x, _levels(levels, x), idx, out, flag, x.numel(), W, Wdiv, k0, k1,
                                                   CODE_BITS=code_bits, N=levels.numel(), OWN=own, BLOCK_=BLOCK)
    return out, flag


def ms_encode_int(x: torch.Tensor, W, levels: torch.Tensor, idx: torch.Tensor, key: int,
                  dtype: torch.dtype = torch.int64):
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.ms_encode_int`: ``(signed codes on the scales
    levels[idx] as dtype, flags)``."""
    out = torch.empty(x.numel(), dtype=dtype, device=x.device)
    return _ms_encode(x, W, levels, idx.contiguous(), key, out, 0, False)


def ms_encode_words(x: torch.Tensor, W, levels: torch.Tensor, code_bits: int, key: int, dtype: torch.dtype):
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.ms_encode_words`: ``(words (j << code_bits) | (code +
    s_min) with this worker's own indices j, flags)``."""
    out = torch.empty(x.numel(), dtype=dtype, device=x.device)
    return _ms_encode(x, W, levels, out, key, out, code_bits, True)


def _ms_decode(c, idx, W, levels, m, dtype, code_bits, words):
    c = c.contiguous()
    direct = dtype in (torch.float32, torch.float64)
    out = torch.empty(c.numel(), dtype=dtype if direct else torch.float32, device=c.device)
    flag = _flag(c)
    lev = levels.to(device=c.device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if c.numel():
        _ms_decode_kernel[_grid(c.numel(), BLOCK)](c, idx, lev, out, flag, c.numel(), float(W), float(m),
                                                   CODE_BITS=code_bits, N=levels.numel(), WORDS=words, BLOCK_=BLOCK)
    return (out if direct else out.to(dtype)), flag


def ms_decode_sum(codes: torch.Tensor, idx: torch.Tensor, W, levels: torch.Tensor, m: int, dtype: torch.dtype):
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.ms_decode_sum`: ``(codes * W / levels[idx] / m as dtype,
    flags)`` (FLAG_INDEX for an index outside 0..N-1)."""
    return _ms_decode(codes, idx.contiguous(), W, levels, m, dtype, 0, False)


def ms_decode_words(words: torch.Tensor, code_bits: int, W, levels: torch.Tensor, dtype: torch.dtype):
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_maxnorm.ms_decode_words`: ``(one message's decode as dtype,
    flags)``."""
    return _ms_decode(words, words, W, levels, 1, dtype, code_bits, True)
