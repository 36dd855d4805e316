"""numba kernels of the "terngrad" family on the CPU: TernGrad
(:class:`lowbit.codecs.TernGradCodec`), the same names and signatures as :mod:`.gpu_terngrad`
(:class:`~lowbit.codecs.kernels.families.TernGradKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. The trits are packed 5 to a byte in radix 3
(:mod:`lowbit.codecs.radix`'s layout for 3 levels) in the encode's loop and unpacked in the
decode's.
"""

from __future__ import annotations

import numpy as np
import torch

from . import empty_output
from .cpu import _jit, _out_dtype, as_numba, keys, np_view, round_stochastic, stats

__all__ = ["terngrad_max_abs", "terngrad_encode", "terngrad_decode"]


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
