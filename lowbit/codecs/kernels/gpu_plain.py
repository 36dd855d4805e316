"""Triton kernels of the "plain" codecs' fast path on CUDA (optional: needs ``triton``):
the torch-level API of :mod:`.cpu_plain`, the same codes up to float32 rounding.

Arithmetic is in float32 for float32 and half inputs, float64 for float64 inputs
(scalars such as ``lo`` and ``scale`` reach a kernel as one-element device tensors
in that dtype, made with ``torch.full``: no host-to-device copy). The uniforms are
the core's counter hash (:func:`.gpu.uniform`). Each encode reads back to the host
once, the values its header needs together with the non-finite flag (the uniform
codec twice: ``x``'s range, then the codes' range, which fixes the width); a
TernGrad decode reads one flag (a byte that is not 5 radix-3 trits). fp16/bf16 have their
own kernels (:mod:`.gpu_lowp`); fp32 uses torch's copies, already single kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..rng import counter_uniforms, split_key
from .gpu import BLOCK, _grid, div, is_nonfinite, load_work, pack, round_grid, uniform, unpack

__all__ = ["minmax_range", "minmax_encode", "minmax_decode", "uniform_codes",
           "uniform_pack", "uniform_decode", "sign_encode", "sign_decode", "terngrad_max_abs", "terngrad_encode",
           "terngrad_decode"]



def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scalar(v: float, dtype: torch.dtype, device) -> torch.Tensor:
    """A one-element device tensor holding ``v`` (a fill kernel, no copy from the host)."""
    return torch.full((1,), v, dtype=dtype, device=device)


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
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.minmax_range`: ``(min, max, finite)`` of ``x`` in one pass
    (min/max over the finite elements)."""
    from .gpu import stats
    lo, hi, _, _, finite = stats(x.detach())
    lo, hi, finite = torch.stack([lo.double(), hi.double(), finite.double()]).tolist()  # the one host read
    return lo, hi, bool(finite)


def minmax_encode(x: torch.Tensor, lo: float, scale: float, bits: int, stochastic: bool, key: int) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.minmax_encode`: ``clamp(round((x - lo) * scale), 0, 2^bits -
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
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.minmax_decode`: ``unpack(data) / scale + lo`` as ``dtype``
    (``scale > 0``; the caller handles ``scale == 0``)."""
    codes = unpack(data, bits, n)
    out = torch.empty(n, dtype=dtype, device=data.device)
    wd = _work_dtype(dtype)
    if n:
        _minmax_decode_kernel[_grid(n, BLOCK)](codes, out, n, _scalar(scale, wd, data.device),
                                              _scalar(lo, wd, data.device), BLOCK_=BLOCK)
    return out


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
    """See :func:`.cpu_plain.uniform_codes`; here the codes minus ``base`` are int32."""
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
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.uniform_pack`: ``codes - shift`` (each then < 2^b, checked
    by the caller) packed ``b`` bits each."""
    rel = codes - shift if shift else codes
    return pack(rel.to(torch.uint8) if b <= 8 else rel.to(torch.int64), b)


def uniform_decode(data: torch.Tensor, b: int, n: int, offset: int, step: float, dtype: torch.dtype) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.uniform_decode`: ``(codes + offset) * step`` as ``dtype``
    from ``n`` codes of ``b`` bits."""
    codes = unpack(data, b, n, torch.uint8 if b <= 8 else torch.int64)
    out = torch.empty(n, dtype=dtype, device=data.device)
    if n:
        _uniform_decode_kernel[_grid(n, BLOCK)](codes, out, n, offset, _scalar(step, _work_dtype(dtype), data.device),
                                               BLOCK_=BLOCK)
    return out


# --- sign ----------------------------------------------------------------------------------

@triton.jit
def _sign_encode_kernel(x_ptr, out_ptr, bad_ptr, n, nbytes, BLOCK_: tl.constexpr):
    j = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    acc = tl.zeros([BLOCK_], dtype=tl.int32)
    bad = tl.zeros([BLOCK_], dtype=tl.int32)
    for k in tl.static_range(8):
        i = j * 8 + k
        m = i < n
        v = load_work(x_ptr, i, m)
        acc = acc | (tl.where(m & (v >= 0.0), 1, 0) << k)
        bad = bad | tl.where(m & is_nonfinite(v), 1, 0)
    tl.store(out_ptr + j, acc.to(tl.uint8), mask=j < nbytes)
    tl.atomic_max(bad_ptr, tl.max(bad, axis=0))


@triton.jit
def _sign_decode_kernel(data_ptr, out_ptr, n, c_ptr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    d = tl.load(data_ptr + (offs >> 3), mask=mask, other=0).to(tl.int32)
    c = tl.load(c_ptr)
    tl.store(out_ptr + offs, tl.where(((d >> (offs & 7)) & 1) != 0, c, -c).to(out_ptr.dtype.element_ty), mask=mask)


def sign_encode(x: torch.Tensor, order: int) -> tuple[torch.Tensor, float, bool]:
    """``(packed sign bits, total, finite)``; ``total`` (sum of ``|x_i|`` or ``x_i^2``) is
    torch's norm in ``x``'s precision (float32 for float32 and half inputs)."""
    x = x.detach().contiguous()
    n = x.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        _sign_encode_kernel[_grid(nbytes, BLOCK)](x, out, flag, n, nbytes, BLOCK_=BLOCK)
    if order and n:
        norm = torch.linalg.vector_norm(x if x.dtype in (torch.float32, torch.float64) else x.float(), order)
        total, bad = torch.stack([norm.double(), flag.double()[0]]).tolist()  # the one host read
        total = total if order == 1 else total * total
    else:
        total, bad = 0.0, flag.item()
    return out, total, not bad


def sign_decode(data: torch.Tensor, n: int, c: float, dtype: torch.dtype) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.sign_decode`: ``+c`` for a bit 1 (x_i >= 0), ``-c`` for a
    bit 0, as ``dtype``, from ``n`` packed sign bits."""
    out = torch.empty(n, dtype=dtype, device=data.device)
    if n:
        _sign_decode_kernel[_grid(n, BLOCK)](data, out, n, _scalar(c, _work_dtype(dtype), data.device), BLOCK_=BLOCK)
    return out


# --- TernGrad ----------------------------------------------------------------------------------

@triton.jit
def _terngrad_encode_kernel(x_ptr, out_ptr, n, nbytes, scale_ptr, k0, k1, BLOCK_: tl.constexpr):
    """Byte ``j``: the radix-3 value ``sum_k code[5 j + k] 3^k`` of 5 trits (:mod:`lowbit.codecs.radix`)."""
    j = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BLOCK_], dtype=tl.int32)
    for k in tl.static_range(5):
        i = j * 5 + k
        m = i < n
        v = load_work(x_ptr, i, m)
        r = tl.minimum(div(tl.abs(v), scale), 1.0)
        f = tl.floor(r)
        b = tl.minimum(f + (uniform(i, k0, k1) < (r - f)).to(r.dtype), 1.0)
        code = (1.0 + tl.where(v < 0.0, -b, b)).to(tl.int32)
        acc = acc + tl.where(m, code, 0) * (3 ** k)
    tl.store(out_ptr + j, acc.to(tl.uint8), mask=j < nbytes)


@triton.jit
def _terngrad_decode_kernel(data_ptr, out_ptr, bad_ptr, n, nbytes, scale_ptr, BLOCK_: tl.constexpr):
    """5 trits per byte; flags a byte above ``3^r - 1`` for its ``r = min(5, n - 5 j)`` trits."""
    j = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    jm = j < nbytes
    d = tl.load(data_ptr + j, mask=jm, other=0).to(tl.int32)
    scale = tl.load(scale_ptr)
    r = n - 5 * j
    limit = tl.where(r >= 5, 243, tl.where(r == 4, 81, tl.where(r == 3, 27, tl.where(r == 2, 9, 3))))
    bad = jm & (d >= limit)
    for k in tl.static_range(5):
        i = j * 5 + k
        q = d // 3
        c = d - 3 * q
        d = q
        tl.store(out_ptr + i, ((c - 1).to(scale.dtype) * scale).to(out_ptr.dtype.element_ty), mask=jm & (i < n))
    tl.atomic_max(bad_ptr, tl.max(tl.where(bad, 1, 0), axis=0))


def terngrad_max_abs(x: torch.Tensor) -> tuple[float, bool]:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.terngrad_max_abs`: ``(max |x|, finite)`` in one pass."""
    from .gpu import stats
    _, _, amax, _, finite = stats(x.detach())
    amax, finite = torch.stack([amax.double(), finite.double()]).tolist()  # the one host read
    return amax, bool(finite)


def terngrad_encode(x: torch.Tensor, scale: float, key: int) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.terngrad_encode`: Packed codes for ``scale`` = max|x|
    rounded up to float32 (``0``: every ``x_i`` is 0)."""
    x = x.detach().contiguous()
    n = x.numel()
    nbytes = (n + 4) // 5
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        k0, k1 = split_key(key)
        s = _scalar(scale if scale > 0 else 1.0, _work_dtype(x.dtype), x.device)
        _terngrad_encode_kernel[_grid(nbytes, BLOCK)](x, out, n, nbytes, s, k0, k1, BLOCK_=BLOCK)
    return out


def terngrad_decode(data: torch.Tensor, n: int, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_plain.terngrad_decode`: ``(decoded, valid)``: valid is False when
    a byte holds more than its trits can."""
    out = torch.empty(n, dtype=dtype, device=data.device)
    if not n:
        return out, True
    flag = torch.zeros(1, dtype=torch.int32, device=data.device)
    nbytes = data.numel()
    _terngrad_decode_kernel[_grid(nbytes, BLOCK)](data, out, flag, n, nbytes,
                                                  _scalar(scale, _work_dtype(dtype), data.device), BLOCK_=BLOCK)
    return out, not flag.item()  # a byte that is not 5 trits is an error: one host read

