"""The random-k selection (a keyed Feistel permutation, see :mod:`lowbit.codecs.randk`)
on CUDA: a Triton kernel evaluates ``sigma(i)`` for every ``i < d`` in uint32 lanes
(cycle walking included) and flags ``sigma(i) < k``; the flags are compacted into the
sorted indices with torch ops on the device (a cumulative sum and a scatter: no host
synchronisation, the count is known to be ``k``). The integers are exactly those of
:func:`lowbit.codecs.randk.select_reference` (integer arithmetic only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import BLOCK, _grid
from .gpu import _mix32 as _mix

__all__ = ["select"]


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
def _flags_kernel(keys_ptr, flags_ptr, d, k, a, hb, NKEYS: tl.constexpr, BLOCK_: tl.constexpr):
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
    tl.store(flags_ptr + offs, (v < k.to(tl.uint32)).to(tl.int8), mask=mask)


def select(d: int, k: int, a: int, hb: int, round_keys, dense: bool = True, device=None,
           x: torch.Tensor | None = None):
    """The sorted int64 indices ``{i < d : sigma(i) < k}`` on ``device`` (CUDA; any device
    Triton runs on, the CPU under ``TRITON_INTERPRET=1``). Every coordinate is tested
    (``dense`` is accepted for the CPU module's signature). With ``x``: ``(indices, x's
    kept values)``."""
    if d >= 2**31:
        raise ValueError(f"d must be below 2^31 (int32 headers), got {d}")
    keys = torch.tensor([int(v) for v in round_keys], dtype=torch.int64).to(torch.int32).to(device)
    flags = torch.empty(d, dtype=torch.int8, device=device)
    if d:
        _flags_kernel[_grid(d, BLOCK)](keys, flags, d, k, a, hb, NKEYS=len(keys), BLOCK_=BLOCK)
    pos = torch.cumsum(flags, 0, dtype=torch.int64) - 1
    slot = torch.where(flags.bool(), pos, k)  # the unkept all land in a spare slot k
    out = torch.empty(k + 1, dtype=torch.int64, device=device)
    out.scatter_(0, slot, torch.arange(d, dtype=torch.int64, device=device))
    idx = out[:k]
    return idx if x is None else (idx, x.index_select(0, idx))
