"""numba kernels of the "sign" family on the CPU: 1-bit SGD and signSGD
(:class:`lowbit.codecs.SignCodec`), the same names and signatures as :mod:`.gpu_sign`
(:class:`~lowbit.codecs.kernels.families.SignKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. The 1-bit codes are packed (8 to a byte, :mod:`lowbit.codecs.packing`'s
layout) in the encode's loop and unpacked in the decode's.
"""

from __future__ import annotations

import numpy as np
import torch

from . import empty_output
from .cpu import _inline, _jit, _out_dtype, as_numba, nonfinite, np_view

__all__ = ["sign_encode", "sign_decode"]


# --- sign (1-bit SGD, signSGD) --------------------------------------------------------------

@_inline
def _sign_bytes(x, full, order, out, lanes):
    """Bytes ``0..full-1`` of :func:`_sign_encode`: the sign bits of ``x[8 j: 8 j + 8]``, the
    lane sums of order ``order`` added to ``lanes`` (none for 0); returns whether any element
    is not finite. Inlined: a caller's constant ``order`` drops the sums from the loop."""
    bad = False
    for j in range(full):
        acc = 0
        for k in range(8):
            v = np.float64(x[8 * j + k])
            bad |= nonfinite(v)
            acc |= (1 if v >= 0.0 else 0) << k
            if order != 0:
                lanes[k] += abs(v) if order == 1 else v * v
        out[j] = np.uint8(acc)
    return bad


@_jit
def _sign_encode(x, order, out):
    """Bit ``x_i >= 0`` packed 8 per byte into ``out``; returns ``(total, non-finite)`` with
    ``total`` the float64 sum of ``|x_i|`` (order 1) or ``x_i^2`` (order 2) in the order of
    :func:`lowbit.codecs.quantize.lane_sums_reference` (lane ``i mod 8``, one per bit of a
    byte, then pairwise; 0 for order 0)."""
    n = x.shape[0]
    full = n // 8
    lanes = np.zeros(8)
    # order 0 passed as a constant: the inlined loop then has no lane sums at all, as fast as a
    # loop of its own (benchmarks/kernel_pairs.py); a run-time test of order in it cost 4.1x
    bad = _sign_bytes(x, full, 0, out, lanes) if order == 0 else _sign_bytes(x, full, order, out, lanes)
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
