"""numba kernels of the "minmax" family on the CPU: min-max (Bagua's) quantization
(:class:`lowbit.codecs.MinMaxCodec`), the same names and signatures as :mod:`.gpu_minmax`
(:class:`~lowbit.codecs.kernels.families.MinMaxKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. Codes are packed by the core's :func:`.cpu.pack`.
"""

from __future__ import annotations

import numpy as np
import torch

from . import empty_output
from .cpu import _jit, _out_dtype, as_numba, keys, pack, rint, round_stochastic, stats, unpack

__all__ = ["minmax_range", "minmax_encode", "minmax_decode"]


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
