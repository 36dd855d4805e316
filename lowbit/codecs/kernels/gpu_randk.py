"""Triton kernels of the "randk" family on CUDA (:class:`~lowbit.codecs.kernels.families.RandKKernels`,
the same names and signatures as :mod:`.cpu_randk`). The decode's :func:`scatter` is torch
ops on the device. The random-k selection (a keyed Feistel permutation, see
:mod:`lowbit.codecs.randk`): a Triton kernel evaluates ``sigma(i)`` for every ``i < d`` in
uint32 lanes (cycle walking included), flags ``sigma(i) < k`` and counts the flags of each block; a
second kernel writes the kept positions of each block from the block's start (no host
synchronisation: the count is known to be ``k``). The integers are exactly those of
:func:`lowbit.codecs.randk.select_reference` (integer arithmetic only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import BLOCK, _grid
from .gpu import _mix32 as _mix

__all__ = ["select", "scatter"]


@triton.jit
def _sigma(v, keys_ptr, A, HB, NKEYS: tl.constexpr):
    """The permutation on uint32 values (``NKEYS`` rounds, even)."""
    bmask = (tl.full(v.shape, 1, tl.uint32) << HB) - 1
    st = 32 - HB
    L = v >> HB
    R = v & bmask
    for r in tl.static_range(NKEYS):
        key = tl.load(keys_ptr + r).to(tl.uint32, bitcast=True)
        h = _mix(R ^ key)
        if r % 2 == 0:
            t = L + ((h.to(tl.uint64) * A.to(tl.uint64)) >> 32).to(tl.uint32)
            L, R = R, tl.where(t >= A, t - A, t)
        else:
            L, R = R, (L + (h >> st)) & bmask
    return (L << HB) | R


@triton.jit
def _flags_kernel(keys_ptr, flags_ptr, counts_ptr, d, k, a, hb, NKEYS: tl.constexpr, BLOCK_: tl.constexpr):
    """``flags[i] = sigma(i) < k`` (int8) and each program's count of them."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < d
    D = d.to(tl.uint32)
    A = a.to(tl.uint32)
    HB = hb.to(tl.uint32)
    v = _sigma(offs.to(tl.uint32), keys_ptr, A, HB, NKEYS)
    walk = (v >= D) & mask
    while tl.max(walk.to(tl.int32), axis=0) > 0:  # cycle walking (rare)
        v = tl.where(walk, _sigma(v, keys_ptr, A, HB, NKEYS), v)
        walk = (v >= D) & mask
    keep = (v < k.to(tl.uint32)) & mask
    tl.store(flags_ptr + offs, keep.to(tl.int8), mask=mask)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(keep.to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(flags_ptr, starts_ptr, out_ptr, d, BLOCK_: tl.constexpr):
    """The flagged positions of each program's block, in order, from its start in ``out``."""
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < d
    f = tl.load(flags_ptr + offs, mask=mask, other=0).to(tl.int32)
    pos = tl.load(starts_ptr + tl.program_id(0)) + tl.cumsum(f, axis=0) - f
    tl.store(out_ptr + pos, offs.to(tl.int64), mask=f > 0)


def select(d: int, k: int, a: int, hb: int, round_keys, dense: bool = True, device=None,
           x: torch.Tensor | None = None):
    """The sorted int64 indices ``{i < d : sigma(i) < k}`` on ``device`` (CUDA; any device
    Triton runs on, the CPU under ``TRITON_INTERPRET=1``). Every coordinate is tested
    (``dense`` is accepted for the CPU module's signature): one kernel flags them and counts
    them per block, a second writes each block's kept positions from the block's start (a
    prefix sum of the counts), with no host synchronisation. With ``x``: ``(indices, x's
    kept values)``."""
    if d >= 2**31:
        raise ValueError(f"d must be below 2^31 (int32 headers), got {d}")
    keys = torch.tensor([int(v) for v in round_keys], dtype=torch.int64).to(torch.int32).to(device)
    idx = torch.empty(k, dtype=torch.int64, device=device)
    if d:
        grid = _grid(d, BLOCK)
        flags = torch.empty(d, dtype=torch.int8, device=device)
        counts = torch.empty(grid[0], dtype=torch.int32, device=device)
        _flags_kernel[grid](keys, flags, counts, d, k, a, hb, NKEYS=len(keys), BLOCK_=BLOCK)
        starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
        _compact_kernel[grid](flags, starts, idx, d, BLOCK_=BLOCK)
    return idx if x is None else (idx, x.index_select(0, idx))


def scatter(vals: torch.Tensor, idx: torch.Tensor, n: int, factor: float, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """Zeros of ``n`` elements with ``vals * factor`` at ``idx`` (torch ops on the device), and
    whether a product is beyond ``dtype``'s largest finite value or NaN (one host read)."""
    out = torch.zeros(n, dtype=dtype, device=vals.device)
    prod = vals.to(torch.float64) * factor
    out[idx.to(vals.device)] = prod.to(dtype)
    far = bool(prod.numel()) and not bool((prod.abs() <= torch.finfo(dtype).max).all())
    return out, far
