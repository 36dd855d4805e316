"""numba kernels of the "dithered" family on the CPU: DQSG
(:class:`lowbit.codecs.DitheredCodec`), the same names and signatures as :mod:`.gpu_dithered`
(:class:`~lowbit.codecs.kernels.families.DitheredKernels`).

Conventions of :mod:`.cpu`: one loop over the elements in float64 registers, the reference's
results bit for bit. Per-part scales: the ``K`` parts are ``extra`` parts of ``base + 1``
elements then parts of ``base`` (:func:`~lowbit.codecs.dithered.partition_sizes`); the
kernels loop over the parts and, inside, over that part's elements.
"""

from __future__ import annotations

import numpy as np
import torch

from .cpu import _jit, as_numba, keys, uniform
from .cpu_qsgd import _out_buffer, code_dtype, host_values, ratio

__all__ = ["code_dtype", "host_values", "ratio", "dithered_scales", "dithered_encode", "dithered_decode"]


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

# --- torch-level API (the same names and signatures as gpu_dithered) ------------------------

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
