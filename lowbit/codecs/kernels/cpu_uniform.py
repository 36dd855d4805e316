"""numba kernels of the "uniform" family on the CPU: the uniform grid ``{step n}``
(:class:`lowbit.codecs.UniformCodec`), the same names and signatures as :mod:`.gpu_uniform`
(:class:`~lowbit.codecs.kernels.families.UniformKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. Codes are packed by the core's :func:`.cpu.pack`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import empty_output
from .cpu import _jit, _out_dtype, _stats, as_numba, keys, nonfinite, pack, rint, round_stochastic, unpack

__all__ = ["uniform_codes", "uniform_pack", "uniform_decode"]


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
