"""Triton kernels of the "terngrad" family on CUDA: TernGrad
(:class:`lowbit.codecs.TernGradCodec`), the same names and signatures as :mod:`.cpu_terngrad`
(:class:`~lowbit.codecs.kernels.families.TernGradKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. An encode reads back to the host once: the scale with the
non-finite flag; a decode reads one flag (a byte that is not 5 radix-3 trits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rng import split_key
from .gpu import BLOCK, _grid, _scalar, _work_dtype, div, load_work, uniform

__all__ = ["terngrad_max_abs", "terngrad_encode", "terngrad_decode"]


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
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_terngrad.terngrad_max_abs`: ``(max |x|, finite)`` in one pass."""
    from .gpu import stats
    _, _, amax, _, finite = stats(x.detach())
    amax, finite = torch.stack([amax.double(), finite.double()]).tolist()  # the one host read
    return amax, bool(finite)


def terngrad_encode(x: torch.Tensor, scale: float, key: int) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_terngrad.terngrad_encode`: Packed codes for ``scale`` = max|x|
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
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_terngrad.terngrad_decode`: ``(decoded, valid)``: valid is False when
    a byte holds more than its trits can."""
    out = torch.empty(n, dtype=dtype, device=data.device)
    if not n:
        return out, True
    flag = torch.zeros(1, dtype=torch.int32, device=data.device)
    nbytes = data.numel()
    _terngrad_decode_kernel[_grid(nbytes, BLOCK)](data, out, flag, n, nbytes,
                                                  _scalar(scale, _work_dtype(dtype), data.device), BLOCK_=BLOCK)
    return out, not flag.item()  # a byte that is not 5 trits is an error: one host read
