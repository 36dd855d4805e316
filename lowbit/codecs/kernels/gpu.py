"""Triton kernels of the "core" family on CUDA (optional: needs ``triton``), and the
primitives every GPU family shares.

The core family (:class:`~lowbit.codecs.kernels.families.CoreKernels`): :func:`pack`,
:func:`unpack` and :func:`stats`, the same names and signatures as :mod:`.cpu` (same
results up to float32 rounding). The shared primitives (imported by the ``gpu_<family>``
modules): the launch grid ``_grid``, the counter uniform (:func:`uniform`,
:func:`round_grid`), :func:`load_work`, the IEEE division :func:`div`, :func:`rint`,
:func:`is_nonfinite`, and the non-finite flag (:func:`nonfinite_flag`,
:func:`raise_if_flagged`).

Floating arithmetic is in the input's precision (float32 for float32 and half inputs,
float64 for float64); the uniforms are the same 24-bit counter hash as everywhere, in
uint32 arithmetic. Outputs are allocated on the input's device; no kernel reads a value
back to the host. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is
how CI tests them on a machine without a GPU (and each launched specialization is
compiled for sm_90 there too: tests/test_triton_interpret.py).

Codes of at most 8 bits are packed in groups of 8 codes, which fill exactly ``b`` bytes,
so one kernel serves every width 1..8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import rng

__all__ = ["pack", "unpack", "stats"]

# A jitted kernel reads a module global only as a constexpr (the compiler refuses a plain
# int; Triton's interpreter does not check).
MIX_C1 = tl.constexpr(rng.MIX_C1)
MIX_C2 = tl.constexpr(rng.MIX_C2)

BLOCK = 1024
GROUPS = 256


def _grid(n: int, block: int):
    return (max(1, triton.cdiv(n, block)),)


@triton.jit
def _mix32(h):
    h = h ^ (h >> 16)
    h = h * MIX_C1
    h = h ^ (h >> 15)
    h = h * MIX_C2
    return h ^ (h >> 16)


@triton.jit
def uniform(offs, k0, k1):
    """The counter uniforms (float32, exact) of element indices ``offs``."""
    i = offs.to(tl.uint32)
    h = _mix32(_mix32(i ^ k0.to(tl.uint32)) + k1.to(tl.uint32))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def load_work(ptr, offs, mask):
    """Elements as float32, or float64 for float64 inputs (the kernels' working precision)."""
    x = tl.load(ptr + offs, mask=mask, other=0.0)
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    return x


@triton.jit
def div(a, b):
    """``a / b`` correctly rounded (IEEE) for float32 and float64 ``a`` (``b`` float32, or
    ``a``'s dtype). Triton's ``/`` on float32 is an approximate division (``div.full.f32``, up
    to 2 ulp: x / x need not be 1), which would break the kernels' bounds, all derived for
    IEEE division; on float64 it is IEEE already."""
    if a.dtype == tl.float64:
        q = a / b
    else:
        q = tl.math.div_rn(a, b)
    return q


@triton.jit
def rint(v):
    """Round half to even (as ``torch.round``)."""
    r = tl.floor(v + 0.5)
    tie = (r - v) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def round_grid(v, offs, k0, k1, STOCHASTIC: tl.constexpr):
    """``v`` rounded to an integer (float): up with probability its fractional part, by the
    counter uniforms of element indices ``offs`` (``STOCHASTIC``), else half to even."""
    if STOCHASTIC:
        f = tl.floor(v)
        c = f + (uniform(offs, k0, k1) < (v - f)).to(v.dtype)
    else:
        c = rint(v)
    return c


@triton.jit
def is_nonfinite(x):
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, n, nbytes, B: tl.constexpr, G: tl.constexpr):
    g = tl.program_id(0) * G + tl.arange(0, G)
    acc = tl.zeros([G], dtype=tl.uint64)
    for k in tl.static_range(8):
        idx = g * 8 + k
        c = tl.load(codes_ptr + idx, mask=idx < n, other=0).to(tl.uint64)
        acc = acc | (c << (k * B))
    for j in tl.static_range(B):
        o = g * B + j
        tl.store(out_ptr + o, ((acc >> (8 * j)) & 0xFF).to(tl.uint8), mask=o < nbytes)


@triton.jit
def _unpack_kernel(data_ptr, out_ptr, n, nbytes, B: tl.constexpr, G: tl.constexpr):
    g = tl.program_id(0) * G + tl.arange(0, G)
    acc = tl.zeros([G], dtype=tl.uint64)
    for j in tl.static_range(B):
        o = g * B + j
        d = tl.load(data_ptr + o, mask=o < nbytes, other=0).to(tl.uint64)
        acc = acc | (d << (8 * j))
    for k in tl.static_range(8):
        idx = g * 8 + k
        tl.store(out_ptr + idx, ((acc >> (k * B)) & ((1 << B) - 1)).to(tl.uint8), mask=idx < n)


def pack(codes: torch.Tensor, b: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2^b, b in 1..8, trusted) into ``ceil(n b / 8)`` bytes; uint8
    codes of 8 bits are returned as they are (see :func:`.cpu.pack`)."""
    if b == 8 and codes.dtype == torch.uint8 and codes.is_contiguous():
        return codes.detach()
    if b > 8:
        from ..packing import pack_wide
        return pack_wide(codes.to(torch.int64), b)
    n = codes.numel()
    nbytes = (n * b + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if n:
        _pack_kernel[_grid(triton.cdiv(n, 8), GROUPS)](codes, out, n, nbytes, B=b, G=GROUPS)
    return out


def unpack(data: torch.Tensor, b: int, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The ``n`` codes of ``b`` bits in ``data``, as ``dtype``."""
    if b > 8:
        from ..packing import unpack_wide
        return unpack_wide(data, b, n).to(dtype)
    out = torch.empty(n, dtype=torch.uint8, device=data.device)
    if n:
        _unpack_kernel[_grid(triton.cdiv(n, 8), GROUPS)](data, out, n, data.numel(), B=b, G=GROUPS)
    return out if dtype == torch.uint8 else out.to(dtype)


def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(min, max, max |x|, sum x^2, all finite)`` as device tensors (no host read)."""
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    lo, hi = torch.aminmax(xf)
    return lo, hi, torch.maximum(lo.abs(), hi.abs()), (xf.float() * xf.float()).sum(), finite.all()


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """A zeroed int32 flag on ``x``'s device that a kernel sets when it meets a NaN or an inf."""
    return torch.zeros(1, dtype=torch.int32, device=x.device)


def raise_if_flagged(flag, codec: str) -> None:
    """The fast path's one deliberate host read on CUDA: a non-finite input found by a
    kernel becomes a clear error (reading one int32 waits for the encode kernel; a flag
    already read back is a CPU tensor or a number)."""
    if int(flag.item() if isinstance(flag, torch.Tensor) else flag):
        raise ValueError(f"x must be finite for the {codec} codec")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scalar(v: float, dtype: torch.dtype, device) -> torch.Tensor:
    """A one-element device tensor holding ``v`` (a fill kernel, no copy from the host)."""
    return torch.full((1,), v, dtype=dtype, device=device)
