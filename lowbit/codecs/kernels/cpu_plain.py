"""numba kernels of the "plain" codecs' fast path on the CPU: min-max, uniform,
sign, TernGrad and the 16-bit floats' overflow check (fp32 needs no kernel).

Conventions of :mod:`.cpu` (the core): one branch-free loop over the elements,
the input read once in its own dtype and computed in float64 registers, so
every kernel gives the float64 reference's bytes exactly; uniforms from the
counter hash (:func:`.cpu.uniform`); codes of at most 8 bits as ``uint8``;
a kernel that may meet a non-finite value returns a flag and its caller raises.

Sign packs its 1-bit codes inside the encode loop and unpacks inside the decode
loop (8 codes per byte, the layout of :mod:`lowbit.codecs.packing`); TernGrad
likewise packs its trits 5 per byte in radix 3 (the layout of
:mod:`lowbit.codecs.radix` for 3 levels); min-max and uniform use the core's
:func:`.cpu.pack` / :func:`.cpu.unpack`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import empty_output
from .cpu import _jit, _stats, as_numba, keys, nonfinite, np_view, pack, rint, round_stochastic, stats, unpack

__all__ = ["minmax_range", "minmax_encode", "minmax_decode", "uniform_codes",
           "uniform_pack", "uniform_decode", "sign_encode", "sign_decode", "terngrad_max_abs", "terngrad_encode",
           "terngrad_decode"]


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a decode kernel writes: float32 or float64 directly; any other dtype is
    written as float64 and cast once (a single rounding, as the reference's)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float64


# --- min-max (Bagua) ----------------------------------------------------------------------

@_jit
def _minmax_encode(x, lo, scale, levels, stochastic, k0, k1, codes):
    """``clamp(round((x - lo) * scale), 0, levels)`` as uint8."""
    top = float(levels)
    if stochastic:
        for i in range(x.shape[0]):
            c = round_stochastic((np.float64(x[i]) - lo) * scale, k0, k1, i)
            c = 0.0 if c < 0.0 else (top if c > top else c)
            codes[i] = np.uint8(c)
    else:
        for i in range(x.shape[0]):
            c = rint((np.float64(x[i]) - lo) * scale)
            c = 0.0 if c < 0.0 else (top if c > top else c)
            codes[i] = np.uint8(c)


@_jit
def _minmax_decode(codes, scale, lo, out):
    """``codes / scale + lo`` (``scale > 0``)."""
    for i in range(codes.shape[0]):
        out[i] = np.float64(codes[i]) / scale + lo


def minmax_range(x: torch.Tensor) -> tuple[float, float, bool]:
    """``(min, max, finite)`` of ``x`` in one pass (min/max over the finite elements)."""
    lo, hi, _, _, finite = stats(x.detach())
    return lo, hi, finite


def minmax_encode(x: torch.Tensor, lo: float, scale: float, bits: int, stochastic: bool, key: int) -> torch.Tensor:
    """``clamp(round((x - lo) * scale), 0, 2^bits - 1)`` packed ``bits`` each."""
    xv = as_numba(x.detach())
    codes = torch.empty(xv.shape[0], dtype=torch.uint8)
    _minmax_encode(xv, lo, scale, (1 << bits) - 1, stochastic, *keys(key), codes.numpy())
    return pack(codes, bits)


def minmax_decode(data: torch.Tensor, bits: int, n: int, lo: float, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``unpack(data) / scale + lo`` as ``dtype`` (``scale > 0``; the caller handles ``scale == 0``)."""
    codes = unpack(data, bits, n)
    out = empty_output(n, _out_dtype(dtype))
    _minmax_decode(codes.numpy(), scale, lo, out.numpy())
    return out.to(dtype)


# --- uniform grid {step n} ---------------------------------------------------------------

@_jit
def _uniform_range(x, step, stochastic, k0, k1):
    """``(min code, max code, non-finite)`` of ``round(x / step)`` over the finite elements;
    the codes are recomputed by :func:`_uniform_encode` (same uniforms), never stored."""
    lo = math.inf
    hi = -math.inf
    bad = False
    if stochastic:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= nonfinite(xv)
            c = round_stochastic(xv / step, k0, k1, i)
            lo = c if c < lo else lo
            hi = c if c > hi else hi
    else:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= nonfinite(xv)
            c = rint(xv / step)
            lo = c if c < lo else lo
            hi = c if c > hi else hi
    return lo, hi, bad


@_jit
def _uniform_encode(x, step, stochastic, k0, k1, offset, codes):
    """``round(x / step) - offset`` into ``codes`` (uint8 or uint32, wide enough)."""
    if stochastic:
        for i in range(x.shape[0]):
            codes[i] = np.int64(round_stochastic(np.float64(x[i]) / step, k0, k1, i) - offset)
    else:
        for i in range(x.shape[0]):
            codes[i] = np.int64(rint(np.float64(x[i]) / step) - offset)


@_jit
def _uniform_decode(codes, offset, step, out):
    """``(codes + offset) * step`` (the sum is an exact integer in float64)."""
    for i in range(codes.shape[0]):
        out[i] = (np.float64(codes[i]) + offset) * step


@_jit
def _int_range(codes):
    """``(min, max)`` of an unsigned integer array (a vectorised integer reduction)."""
    lo = codes[0]
    hi = codes[0]
    for i in range(codes.shape[0]):
        c = codes[i]
        lo = c if c < lo else lo
        hi = c if c > hi else hi
    return lo, hi


@_jit
def _subtract(codes, shift):
    for i in range(codes.shape[0]):
        codes[i] = codes[i] - shift


_SPAN_LIMIT = 2**32 - 1


def _narrowest_unsigned(span: float) -> torch.dtype:
    return torch.uint8 if span < 2**8 else (torch.uint16 if span < 2**16 else torch.uint32)


def uniform_codes(x: torch.Tensor, step: float, stochastic: bool, key: int):
    """The codes ``round(x / step)`` of the non-empty ``x``: ``(codes, base, lo, hi, finite)``
    with ``codes`` the codes minus ``base`` (narrowest unsigned dtype), ``lo``/``hi`` the
    smallest and largest code (floats). ``codes`` is None when ``x`` is not finite or the
    codes span more than 32 bits (the caller raises).

    ``x``'s min and max bound the codes (``x / step`` and both roundings are monotone):
    exactly for nearest rounding, within one step for stochastic, where the codes' own
    range is then read from the narrow codes. Only when those bounds span more than 32
    bits are the codes' exact range computed first, in a separate pass."""
    xv = as_numba(x.detach())
    xmin, xmax, _, _, bad = _stats(xv)
    if bad:
        return None, 0, math.nan, math.nan, False
    k0, k1 = keys(key)
    if stochastic:
        lo, hi = math.floor(xmin / step), math.floor(xmax / step) + 1.0
    else:
        lo, hi = rint(xmin / step), rint(xmax / step)
    if hi - lo > _SPAN_LIMIT or not -2.0**62 < lo <= hi < 2.0**62:  # rare: the exact range first
        lo, hi, _ = _uniform_range(xv, step, stochastic, k0, k1)
        if hi - lo > _SPAN_LIMIT or not -2.0**62 < lo <= hi < 2.0**62:
            return None, 0, lo, hi, True
        stochastic_bounds = False
    else:
        stochastic_bounds = stochastic
    base = int(lo)
    codes = torch.empty(xv.shape[0], dtype=_narrowest_unsigned(hi - lo))
    _uniform_encode(xv, step, stochastic, k0, k1, float(base), codes.numpy())
    if stochastic_bounds:
        cmin, cmax = _int_range(codes.numpy())
        lo, hi = float(base + int(cmin)), float(base + int(cmax))
    return codes, base, lo, hi, True


def uniform_pack(codes: torch.Tensor, shift: int, b: int) -> torch.Tensor:
    """``codes - shift`` (each then < 2^b, checked by the caller) packed ``b`` bits each."""
    if shift:
        _subtract(codes.numpy(), codes.numpy().dtype.type(shift))
    return pack(codes, b)


def uniform_decode(data: torch.Tensor, b: int, n: int, offset: int, step: float, dtype: torch.dtype) -> torch.Tensor:
    """``(codes + offset) * step`` as ``dtype`` from ``n`` codes of ``b`` bits."""
    codes = unpack(data, b, n, torch.uint8 if b <= 8 else torch.uint32)
    out = empty_output(n, _out_dtype(dtype))
    _uniform_decode(codes.numpy(), float(offset), step, out.numpy())
    return out.to(dtype)


# --- sign (1-bit SGD, signSGD) --------------------------------------------------------------

@_jit
def _sign_encode(x, order, out):
    """Bit ``x_i >= 0`` packed 8 per byte into ``out``; returns ``(total, non-finite)`` with
    ``total`` the float64 sum of ``|x_i|`` (order 1) or ``x_i^2`` (order 2) in the order of
    :func:`lowbit.codecs.quantize.lane_sums_reference` (lane ``i mod 8``, one per bit of a
    byte, then pairwise; 0 for order 0)."""
    n = x.shape[0]
    full = n // 8
    bad = False
    lanes = np.zeros(8)
    if order == 0:
        for j in range(full):
            acc = 0
            for k in range(8):
                v = np.float64(x[8 * j + k])
                bad |= nonfinite(v)
                acc |= (1 if v >= 0.0 else 0) << k
            out[j] = np.uint8(acc)
    else:
        for j in range(full):
            acc = 0
            for k in range(8):
                v = np.float64(x[8 * j + k])
                bad |= nonfinite(v)
                acc |= (1 if v >= 0.0 else 0) << k
                lanes[k] += abs(v) if order == 1 else v * v
            out[j] = np.uint8(acc)
    if full * 8 < n:
        acc = 0
        for k in range(n - full * 8):
            v = np.float64(x[8 * full + k])
            bad |= nonfinite(v)
            acc |= (1 if v >= 0.0 else 0) << k
            lanes[k] += 0.0 if order == 0 else (abs(v) if order == 1 else v * v)
        out[full] = np.uint8(acc)
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    return total, bad


@_jit
def _sign_decode(data, c, out):
    """``+c`` for bit 1, ``-c`` for bit 0."""
    n = out.shape[0]
    full = n // 8
    for j in range(full):
        d = data[j]
        for k in range(8):
            out[8 * j + k] = c if (d >> k) & 1 else -c
    for i in range(full * 8, n):
        out[i] = c if (data[full] >> (i - full * 8)) & 1 else -c


def sign_encode(x: torch.Tensor, order: int) -> tuple[torch.Tensor, float, bool]:
    """``(packed sign bits, total, finite)``: ``total`` is the float64 sum of ``|x_i|``
    (``order`` 1) or ``x_i^2`` (2) in the lane order, 0.0 for ``order`` 0."""
    xv = as_numba(x.detach())
    out = torch.empty((xv.shape[0] + 7) // 8, dtype=torch.uint8)
    total, bad = _sign_encode(xv, order, out.numpy())
    return out, total, not bad


def sign_decode(data: torch.Tensor, n: int, c: float, dtype: torch.dtype) -> torch.Tensor:
    """``+c`` for a bit 1 (x_i >= 0), ``-c`` for a bit 0, as ``dtype``, from ``n`` packed sign bits."""
    out = empty_output(n, _out_dtype(dtype))
    if n:
        _sign_decode(np_view(data), c, out.numpy())
    return out.to(dtype)


# --- TernGrad -----------------------------------------------------------------------------

@_jit
def _tern_code(v, scale, k0, k1, i):
    """``sign(v) * Bernoulli(min(|v| / scale, 1)) + 1`` in {0, 1, 2}."""
    r = abs(v) / scale
    r = 1.0 if r > 1.0 else r
    b = round_stochastic(r, k0, k1, i)
    b = 1.0 if b > 1.0 else b
    return np.int64(1.0 + (-b if v < 0.0 else b))


@_jit
def _terngrad_encode(x, scale, k0, k1, out):
    """TernGrad's codes packed 5 per byte in radix 3 (:mod:`lowbit.codecs.radix`, ``L = 3``,
    ``g = 5``, ``b = 8``: byte ``j`` is ``sum_k code[5 j + k] 3^k``) into ``out``."""
    n = x.shape[0]
    full = n // 5
    for j in range(full):
        i = 5 * j  # five independent codes, then one sum (no dependency chain between them)
        c0 = _tern_code(np.float64(x[i]), scale, k0, k1, i)
        c1 = _tern_code(np.float64(x[i + 1]), scale, k0, k1, i + 1)
        c2 = _tern_code(np.float64(x[i + 2]), scale, k0, k1, i + 2)
        c3 = _tern_code(np.float64(x[i + 3]), scale, k0, k1, i + 3)
        c4 = _tern_code(np.float64(x[i + 4]), scale, k0, k1, i + 4)
        out[j] = np.uint8(c0 + 3 * c1 + 9 * c2 + 27 * c3 + 81 * c4)
    if full * 5 < n:
        acc = 0
        for i in range(n - 1, full * 5 - 1, -1):
            acc = 3 * acc + _tern_code(np.float64(x[i]), scale, k0, k1, i)
        out[full] = np.uint8(acc)


@_jit
def _terngrad_decode(data, scale, out):
    """``(code - 1) * scale`` from 5 trits per byte; returns 1 when a byte holds more than
    its trits can (a byte above 242, or above ``3^r - 1`` for a last byte of ``r`` trits)."""
    n = out.shape[0]
    full = n // 5
    bad = 0
    for j in range(full):
        d = np.int64(data[j])
        bad |= d > 242
        for k in range(5):
            q = d // 3
            out[5 * j + k] = (float(d - 3 * q) - 1.0) * scale
            d = q
    if full * 5 < n:
        d = np.int64(data[full])
        for i in range(full * 5, n):
            q = d // 3
            out[i] = (float(d - 3 * q) - 1.0) * scale
            d = q
        bad |= d != 0
    return bad


def terngrad_max_abs(x: torch.Tensor) -> tuple[float, bool]:
    """``(max |x|, finite)`` in one pass."""
    _, _, amax, _, finite = stats(x.detach())
    return amax, finite


def terngrad_encode(x: torch.Tensor, scale: float, key: int) -> torch.Tensor:
    """Packed codes for ``scale`` = max|x| rounded up to float32 (``0``: every ``x_i`` is 0)."""
    xv = as_numba(x.detach())
    out = torch.empty((xv.shape[0] + 4) // 5, dtype=torch.uint8)
    _terngrad_encode(xv, scale if scale > 0 else 1.0, *keys(key), out.numpy())
    return out


def terngrad_decode(data: torch.Tensor, n: int, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``(decoded, valid)``: valid is False when a byte holds more than its trits can."""
    out = empty_output(n, _out_dtype(dtype))
    bad = _terngrad_decode(np_view(data), scale, out.numpy()) if n else 0
    return out.to(dtype), not bad

