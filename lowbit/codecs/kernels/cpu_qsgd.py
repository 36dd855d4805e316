"""numba kernels of the "qsgd" family on the CPU: QSGD
(:class:`lowbit.codecs.QSGDCodec`), the same names and signatures as :mod:`.gpu_qsgd`
(:class:`~lowbit.codecs.kernels.families.QSGDKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. Buckets are ``bucket`` contiguous elements each but the last; the sums
of squares are added in the max-norm kernel's fixed lane order. Also here, shared with
:mod:`.cpu_dithered` and :mod:`.cpu_nested`: :func:`code_dtype`, :func:`host_values` and
``ratio`` (:func:`lowbit.codecs.qsgd.exact_ratio`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..qsgd import exact_ratio as ratio
from . import empty_output
from .cpu import _inline, _jit, _out_dtype, as_numba, keys, uniform
from .cpu_maxnorm import _norm_stats

__all__ = ["code_dtype", "host_values", "ratio", "qsgd_sumsq", "qsgd_encode", "qsgd_decode"]


def code_dtype(b: int) -> torch.dtype:
    """The narrowest unsigned dtype for codes of ``b`` bits (1..32)."""
    return torch.uint8 if b <= 8 else (torch.uint16 if b <= 16 else torch.uint32)


def host_values(*values) -> tuple:
    """Python scalars of ``values`` (bools, floats or one-element tensors)."""
    return tuple(v.item() if isinstance(v, torch.Tensor) else v for v in values)


def _out_buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode output: float32/float64 written directly; other dtypes (half types) are
    written in float64 and converted once, as the reference converts."""
    return empty_output(n, _out_dtype(dtype))


# --- kernels ------------------------------------------------------------------------------------

@_inline
def _bucket(j, bucket, n):
    """``(start, stop)`` of QSGD's bucket ``j`` of ``n`` elements (the last may be shorter)."""
    start = j * bucket
    return start, min(n, start + bucket)


@_jit
def _qsgd_sumsq(x, bucket, out):
    """``out[j]`` = the sum of ``x_i^2`` over bucket ``j`` in the max-norm kernel's fixed lane
    order (:func:`.cpu_maxnorm._norm_stats`); returns the non-finite flag."""
    n = x.shape[0]
    bad = False
    for j in range(out.shape[0]):
        start, stop = _bucket(j, bucket, n)
        _, sq, nonfinite_j = _norm_stats(x[start:stop])
        bad |= nonfinite_j
        out[j] = sq
    return bad


@_jit
def _qsgd_encode(x, factor, bucket, s, k0, k1, codes):
    """``sign(x_i) xi_i + s``, ``xi_i`` the stochastic rounding of ``min(|x_i| f_j, s)``,
    ``f_j = s / norm_j`` (0 for a zero bucket)."""
    n = x.shape[0]
    sf = float(s)
    for j in range(factor.shape[0]):
        inv = factor[j]
        start, stop = _bucket(j, bucket, n)
        xs, cs = x[start:stop], codes[start:stop]
        for i in range(xs.shape[0]):
            xv = np.float64(xs[i])
            v = abs(xv) * inv
            v = sf if v > sf else v
            lo = np.floor(v)
            xi = lo + (1.0 if uniform(k0, k1, start + i) < v - lo else 0.0)
            cs[i] = np.int64((-xi if xv < 0.0 else xi) + sf)


@_jit
def _qsgd_decode(codes, step, bucket, s, out):
    """``(code - s) st_j``, ``st_j = norm_j / s``."""
    n = codes.shape[0]
    sf = float(s)
    for j in range(step.shape[0]):
        st = step[j]
        start, stop = _bucket(j, bucket, n)
        cs, os = codes[start:stop], out[start:stop]
        for i in range(cs.shape[0]):
            os[i] = (np.float64(cs[i]) - sf) * st


# --- torch-level API (the same names and signatures as gpu_qsgd) ----------------------------

def qsgd_sumsq(x: torch.Tensor, bucket: int) -> tuple[torch.Tensor, bool]:
    """``(sum of squares per bucket as float64, added in index order; all finite)``."""
    n = x.numel()
    out = torch.empty(max(1, -(-n // bucket)), dtype=torch.float64)
    bad = _qsgd_sumsq(as_numba(x), bucket, out.numpy())
    return out, not bad


def qsgd_encode(x: torch.Tensor, factor: torch.Tensor, bucket: int, levels: int, bits: int, key: int) -> torch.Tensor:
    """QSGD codes ``sign xi + s``; ``factor``: ``s / norm_j`` per bucket (float64)."""
    codes = torch.empty(x.numel(), dtype=code_dtype(bits))
    k0, k1 = keys(key)
    _qsgd_encode(as_numba(x), factor.numpy(), bucket, levels, k0, k1, codes.numpy())
    return codes


def qsgd_decode(codes: torch.Tensor, step: torch.Tensor, bucket: int, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """``(code - s) st_j``; ``step``: ``norm_j / s`` per bucket (float64)."""
    out = _out_buffer(codes.numel(), dtype)
    _qsgd_decode(codes.numpy(), step.numpy(), bucket, levels, out.numpy())
    return out.to(dtype)
