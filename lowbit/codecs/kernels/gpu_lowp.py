"""Triton kernels of the 16-bit float codecs (fp16, bf16) on CUDA.

The same torch-level API as :mod:`.cpu_lowp`. The encode of a float32 input is
one kernel: the cast (round to nearest even, as torch's) and, in the same pass,
a flag raised when a result has an all-ones exponent (inf or NaN: a non-finite
input or an overflow); the caller reads that flag once (the one host read of
the encode, which must raise on overflow). The decode casts into the caller's
(or a fresh) float32 buffer in one kernel. Casts have no float32 slack: the
results are torch's casts bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .gpu import BLOCK, _grid

__all__ = ["half_encode", "half_decode"]

_EXP_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}


@triton.jit
def _encode_kernel(x_ptr, h_ptr, flag_ptr, n, inv, BF16: tl.constexpr, MASK: tl.constexpr, SCALE: tl.constexpr,
                   BLOCK_: tl.constexpr):
    """``h_ptr``: int16 bits. fp16 by Triton's cast (round to nearest even); bf16 by round to
    nearest even on the float32 bits, as torch (the same on every backend, the interpreter too).
    ``SCALE``: the cast of ``x * inv`` (float32), else ``inv`` is not read."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SCALE:
        x = x * inv
    if BF16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        qnan = ((u >> 16) & 0x8000) | 0x7FC0
        bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, qnan, r).to(tl.int32)
    else:
        bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(h_ptr + offs, bits.to(tl.int16), mask=mask)
    if MASK != 0:  # 0: no check
        bad = tl.max((((bits & MASK) == MASK) & mask).to(tl.int32), axis=0)
        tl.atomic_max(flag_ptr, bad)


@triton.jit
def _decode_kernel(h_ptr, out_ptr, n, BF16: tl.constexpr, BLOCK_: tl.constexpr):
    """``h_ptr``: int16 bits. bf16 is the top half of a float32: a shift, exact on every backend."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    b = tl.load(h_ptr + offs, mask=mask, other=0)
    if BF16:
        y = ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        y = b.to(tl.float16, bitcast=True).to(tl.float32)
    tl.store(out_ptr + offs, y, mask=mask)


def half_encode(x: torch.Tensor, dtype: torch.dtype, divisor: int | None = None,
                check: bool = True) -> tuple[torch.Tensor, bool]:
    """``(h, flagged)``: ``x`` (or ``x / divisor`` as torch computes it on CUDA: ``x`` times
    the float32 reciprocal of ``divisor``, in ``x``'s dtype) cast to ``dtype``, and True when
    ``h`` holds an inf or NaN (one kernel for float32 inputs; torch's division, cast and one
    reduction otherwise; one host read). ``check=False``: no flag is computed or read (no host
    read), and ``flagged`` is False."""
    n = x.numel()
    m = _EXP_MASK[dtype]
    if x.dtype != torch.float32:
        h = (x.detach() if divisor is None else x.detach() / divisor).to(dtype, copy=True)
        return h, check and bool(n) and bool(((h.view(torch.int16) & m) == m).any())
    x = x.contiguous()
    h = torch.empty(n, dtype=dtype, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device) if check else h  # unchecked: not written
    inv = 1.0 if divisor is None else float(np.float32(1.0) / np.float32(divisor))
    if n:
        _encode_kernel[_grid(n, BLOCK)](x, h.view(torch.int16), flag, n, inv, BF16=dtype == torch.bfloat16,
                                        MASK=m if check else 0, SCALE=divisor is not None, BLOCK_=BLOCK)
    return h, check and bool(flag.item())


def half_decode(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = h`` (one kernel for a contiguous float32 ``out``, torch's cast otherwise).
    Returns ``out``."""
    n = h.numel()
    if out.numel() != n:
        raise ValueError(f"out must have h's {n} elements, got {out.numel()}")
    if out.dtype != torch.float32 or not out.is_contiguous():
        return out.copy_(h)
    h = h.contiguous()
    if n:
        _decode_kernel[_grid(n, BLOCK)](h.view(torch.int16), out, n, BF16=h.dtype == torch.bfloat16, BLOCK_=BLOCK)
    return out
