"""numba kernels of the "nested" family on the CPU: NDQSG
(:class:`lowbit.codecs.NestedDitheredCodec`), the same names and signatures as :mod:`.gpu_nested`
(:class:`~lowbit.codecs.kernels.families.NestedKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. The fine index is exact below ``2^52`` in float64
(:func:`index_limit`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..nested import _MAX_INDEX as MAX_INDEX  # NDQSG's fine index is exact below it in float64
from .cpu import _jit, as_numba, keys, nonfinite, uniform
from .cpu_qsgd import _out_buffer, code_dtype

__all__ = ["code_dtype", "index_limit", "nested_encode", "nested_decode"]


def index_limit(dtype: torch.dtype) -> float:
    """NDQSG's fine index is exact below this (float64 registers for every input dtype)."""
    return MAX_INDEX


@_jit
def _fine_index(xv, i, alpha, delta1, inv_delta1, k0, k1):
    """Eq. (6)'s fine index ``m = floor((alpha x + u) / Delta1 + 1/2)``, ``u = (r_i - 1/2) Delta1``."""
    t = alpha * xv + (uniform(k0, k1, i) - 0.5) * delta1
    return np.floor(t * inv_delta1 + 0.5)


@_jit
def _nested_encode(x, alpha, delta1, inv_delta1, k, inv_k, limit, k0, k1, codes):
    """``c = m mod k`` (:func:`_fine_index`); returns (non-finite flag, some ``|m| >= limit``).
    No float reduction in the loop (it would not vectorize)."""
    bad = False
    over = False
    kf = float(k)
    for i in range(x.shape[0]):
        xv = np.float64(x[i])
        bad |= nonfinite(xv)
        m = _fine_index(xv, i, alpha, delta1, inv_delta1, k0, k1)
        over |= not abs(m) < limit
        c = m - np.floor(m * inv_k) * kf
        c = c + kf if c < 0.0 else (c - kf if c >= kf else c)
        codes[i] = np.int64(c)
    return bad, over


@_jit
def _nested_worst(x, alpha, delta1, inv_delta1, k0, k1):
    """``max |m|`` over the elements (for the error message only)."""
    worst = 0.0
    for i in range(x.shape[0]):
        worst = max(worst, abs(_fine_index(np.float64(x[i]), i, alpha, delta1, inv_delta1, k0, k1)))
    return worst


@_jit
def _nested_decode(codes, y, alpha, delta1, delta2, inv_delta2, k0, k1, out):
    """Eq. (7): ``r = Delta1 c - u - alpha y``, ``x_hat = y + alpha (r - Delta2 floor(r / Delta2 + 1/2))``."""
    for i in range(codes.shape[0]):
        yv = np.float64(y[i])
        r = np.float64(codes[i]) * delta1 - (uniform(k0, k1, i) - 0.5) * delta1 - alpha * yv
        out[i] = yv + alpha * (r - delta2 * np.floor(r * inv_delta2 + 0.5))


# --- torch-level API (the same names and signatures as gpu_nested) ------------------------

def nested_encode(x: torch.Tensor, alpha: float, delta1: float, k: int, bits: int, key: int):
    """``(codes, all finite, max |fine index|)`` of NDQSG's eq. (6); the maximum is computed
    (a second pass) only when it reaches ``2^52``, else 0 is returned for it."""
    codes = torch.empty(x.numel(), dtype=code_dtype(bits))
    k0, k1 = keys(key)
    xs = as_numba(x)
    bad, over = _nested_encode(xs, alpha, delta1, 1.0 / delta1, k, 1.0 / k, MAX_INDEX, k0, k1, codes.numpy())
    worst = _nested_worst(xs, alpha, delta1, 1.0 / delta1, k0, k1) if over and not bad else 0.0
    return codes, not bad, worst


def nested_decode(codes: torch.Tensor, y: torch.Tensor, alpha: float, delta1: float, delta2: float,
                  key: int) -> torch.Tensor:
    """Eq. (7) against side information ``y``, in ``y``'s dtype."""
    y = y.detach()
    out = _out_buffer(codes.numel(), y.dtype)
    k0, k1 = keys(key)
    _nested_decode(codes.numpy(), as_numba(y), alpha, delta1, delta2, 1.0 / delta2, k0, k1, out.numpy())
    return out.to(y.dtype)
