"""numba kernels of the "dither" family on the CPU: DQSG (DitheredCodec), NDQSG
(NestedDitheredCodec) and QSGD (QSGDCodec).

As in :mod:`.cpu`: one loop per kernel over the elements, the input read once in
its own dtype and computed on in float64 registers, branch-free in the loop,
uint8 codes for widths <= 8 (uint16/uint32 beyond), a non-finite flag returned
instead of raising. The arithmetic is the references' operation for operation
(the same multiplications by precomputed inverses, the same sequential order of
the sums of squares), so the bytes and decodes are the references' exactly.

Per-part and per-bucket scales: elements are split into contiguous segments;
DQSG's ``K`` parts are ``extra`` parts of ``base + 1`` elements then parts of
``base`` (:func:`~lowbit.codecs.dithered.partition_sizes`), QSGD's buckets
are ``bucket`` elements each but the last. The kernels loop over segments and,
inside, over that segment's elements.

Shared primitives added here (not in the core), with the same names in
:mod:`.gpu_dither`: :func:`code_dtype` (the narrowest unsigned dtype holding
codes of ``b`` bits), :func:`host_values` (scalars for an encode's checks; on
CUDA one read for all of them), ``ratio`` (per-part ``num / den`` factors:
:func:`lowbit.codecs.qsgd.exact_ratio` on the CPU), and ``pack``/``unpack``
re-exported from the core.
"""

from __future__ import annotations

import numpy as np
import torch

from ..nested import _MAX_INDEX as MAX_INDEX  # NDQSG's fine index is exact below it in float64
from ..qsgd import exact_ratio as ratio
from . import empty_output
from .cpu import _inline, _jit, as_numba, keys, nonfinite, pack, uniform, unpack
from .cpu_maxnorm import _norm_stats

__all__ = ["code_dtype", "host_values", "index_limit", "ratio", "pack", "unpack", "dithered_scales", "dithered_encode", "dithered_decode", "nested_encode", "nested_decode",
           "qsgd_sumsq", "qsgd_encode", "qsgd_decode"]


def index_limit(dtype: torch.dtype) -> float:
    """NDQSG's fine index is exact below this (float64 registers for every input dtype)."""
    return MAX_INDEX


def code_dtype(b: int) -> torch.dtype:
    """The narrowest unsigned dtype for codes of ``b`` bits (1..32)."""
    return torch.uint8 if b <= 8 else (torch.uint16 if b <= 16 else torch.uint32)


def host_values(*values) -> tuple:
    """Python scalars of ``values`` (bools, floats or one-element tensors)."""
    return tuple(v.item() if isinstance(v, torch.Tensor) else v for v in values)


def _out_buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode output: float32/float64 written directly; other dtypes (half types) are
    written in float64 and converted once, as the reference converts."""
    return empty_output(n, dtype if dtype in (torch.float32, torch.float64) else torch.float64)


# --- DQSG -------------------------------------------------------------------------------------

@_jit
def _part_start(j, base, extra):
    return j * base + (j if j < extra else extra)


@_jit
def _dithered_absmax(bits, base, extra, parts, inf_bits, out):
    """``out[j]`` = the bit pattern of ``max |x_i|`` over part ``j``, from ``bits`` (the
    input's IEEE bit patterns as signed integers of its width): with the sign bit cleared
    the patterns of non-negative floats order as the floats, so the maximum is an integer
    reduction (it vectorizes; a float one does not). Returns the non-finite flag (a
    pattern ``>= inf_bits``: inf or NaN)."""
    mask = inf_bits | (inf_bits - 1)  # all bits but the sign
    bad = False
    for j in range(parts):
        bs = bits[_part_start(j, base, extra):_part_start(j + 1, base, extra)]
        m = bs[0] & 0
        for i in range(bs.shape[0]):
            a = bs[i] & mask
            m = a if a > m else m
        bad |= m >= inf_bits
        out[j] = m
    return bad


@_jit
def _dithered_encode(x, factor, base, extra, M, k0, k1, codes):
    """``q + M``, ``q = clamp(floor(x_i s_j + r_i), -M, M)``, ``s_j = M / kappa_j`` (0 for a
    zero part), ``r_i`` the counter uniform."""
    Mf = float(M)
    for j in range(factor.shape[0]):
        s = factor[j]
        lo = _part_start(j, base, extra)
        xs = x[lo:_part_start(j + 1, base, extra)]
        cs = codes[lo:lo + xs.shape[0]]
        for i in range(xs.shape[0]):
            q = np.floor(np.float64(xs[i]) * s + uniform(k0, k1, lo + i))
            q = -Mf if q < -Mf else (Mf if q > Mf else q)
            cs[i] = np.int64(q + Mf)


@_jit
def _dithered_decode(codes, step, base, extra, M, subtractive, k0, k1, out):
    """``st_j (q - (r_i - 1/2))`` (subtractive) or ``st_j q`` (half-dithered), ``st_j = kappa_j / M``."""
    Mf = float(M)
    for j in range(step.shape[0]):
        st = step[j]
        lo = _part_start(j, base, extra)
        cs = codes[lo:_part_start(j + 1, base, extra)]
        os = out[lo:lo + cs.shape[0]]
        if subtractive:
            for i in range(cs.shape[0]):
                os[i] = st * ((np.float64(cs[i]) - Mf) - (uniform(k0, k1, lo + i) - 0.5))
        else:
            for i in range(cs.shape[0]):
                os[i] = st * (np.float64(cs[i]) - Mf)


# --- NDQSG ------------------------------------------------------------------------------------

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


# --- QSGD -------------------------------------------------------------------------------------

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


# --- torch-level API (the same names and signatures as gpu_dither) ----------------------------

_INT_OF = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def dithered_scales(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, bool]:
    """``(max |x_j| per part as float64, all finite)`` for ``parts`` contiguous parts."""
    n = x.numel()
    x = x.detach().contiguous()
    if x.dtype not in _INT_OF:
        x = x.float()
    itype, inf_bits = _INT_OF[x.dtype]
    out = torch.empty(parts, dtype=itype)
    bad = _dithered_absmax(x.view(itype).numpy(), n // parts, n % parts, parts, inf_bits, out.numpy())
    return out.view(x.dtype).to(torch.float64), not bad


def dithered_encode(x: torch.Tensor, factor: torch.Tensor, levels: int, bits: int, key: int) -> torch.Tensor:
    """Codes ``q + M`` of DQSG; ``factor``: ``M / kappa_j`` per part (float64)."""
    n, p = x.numel(), factor.numel()
    codes = torch.empty(n, dtype=code_dtype(bits))
    k0, k1 = keys(key)
    _dithered_encode(as_numba(x), factor.numpy(), n // p, n % p, levels, k0, k1, codes.numpy())
    return codes


def dithered_decode(codes: torch.Tensor, step: torch.Tensor, levels: int, subtractive: bool, key: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """DQSG's reconstruction; ``step``: ``kappa_j / M`` per part (float64)."""
    n, p = codes.numel(), step.numel()
    out = _out_buffer(n, dtype)
    k0, k1 = keys(key)
    _dithered_decode(codes.numpy(), step.numpy(), n // p, n % p, levels, bool(subtractive), k0, k1, out.numpy())
    return out.to(dtype)


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
