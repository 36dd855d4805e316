"""Triton kernels of the "sign" family on CUDA: 1-bit SGD and signSGD
(:class:`lowbit.codecs.SignCodec`), the same names and signatures as :mod:`.cpu_sign`
(:class:`~lowbit.codecs.kernels.families.SignKernels`).

Conventions of :mod:`.gpu`: arithmetic in the input's precision (float32 for half inputs),
results up to float32 rounding. An encode reads back to the host once: the scale with the
non-finite flag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import BLOCK, _grid, _scalar, _work_dtype, is_nonfinite, load_work

__all__ = ["sign_encode", "sign_decode"]


# --- sign ----------------------------------------------------------------------------------

@triton.jit
def _sign_encode_kernel(x_ptr, out_ptr, bad_ptr, n, nbytes, BLOCK_: tl.constexpr):
    j = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    acc = tl.zeros([BLOCK_], dtype=tl.int32)
    bad = tl.zeros([BLOCK_], dtype=tl.int32)
    for k in tl.static_range(8):
        i = j * 8 + k
        m = i < n
        v = load_work(x_ptr, i, m)
        acc = acc | (tl.where(m & (v >= 0.0), 1, 0) << k)
        bad = bad | tl.where(m & is_nonfinite(v), 1, 0)
    tl.store(out_ptr + j, acc.to(tl.uint8), mask=j < nbytes)
    tl.atomic_max(bad_ptr, tl.max(bad, axis=0))


@triton.jit
def _sign_decode_kernel(data_ptr, out_ptr, n, c_ptr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    d = tl.load(data_ptr + (offs >> 3), mask=mask, other=0).to(tl.int32)
    c = tl.load(c_ptr)
    tl.store(out_ptr + offs, tl.where(((d >> (offs & 7)) & 1) != 0, c, -c).to(out_ptr.dtype.element_ty), mask=mask)


def sign_encode(x: torch.Tensor, order: int) -> tuple[torch.Tensor, float, bool]:
    """``(packed sign bits, total, finite)``; ``total`` (sum of ``|x_i|`` or ``x_i^2``) is
    torch's norm in ``x``'s precision (float32 for float32 and half inputs)."""
    x = x.detach().contiguous()
    n = x.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        _sign_encode_kernel[_grid(nbytes, BLOCK)](x, out, flag, n, nbytes, BLOCK_=BLOCK)
    if order and n:
        norm = torch.linalg.vector_norm(x if x.dtype in (torch.float32, torch.float64) else x.float(), order)
        total, bad = torch.stack([norm.double(), flag.double()[0]]).tolist()  # the one host read
        total = total if order == 1 else total * total
    else:
        total, bad = 0.0, flag.item()
    return out, total, not bad


def sign_decode(data: torch.Tensor, n: int, c: float, dtype: torch.dtype) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_sign.sign_decode`: ``+c`` for a bit 1 (x_i >= 0), ``-c`` for a
    bit 0, as ``dtype``, from ``n`` packed sign bits."""
    out = torch.empty(n, dtype=dtype, device=data.device)
    if n:
        _sign_decode_kernel[_grid(n, BLOCK)](data, out, n, _scalar(c, _work_dtype(dtype), data.device), BLOCK_=BLOCK)
    return out
