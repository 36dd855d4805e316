"""Triton kernels of mixed-radix packing (:mod:`lowbit.codecs.radix`) on CUDA: the
torch-level API of :mod:`.cpu_radix` (``pack``, ``unpack``), the same bytes.

Integer arithmetic only, so the bytes are the CPU kernels' and the reference's
exactly (no float rounding is involved). ``L``, ``g`` and ``b`` are compile-time
constants (one compilation per level count), so the digit loops unroll and the
divisions by ``L`` become multiplications.

- ``pack``: one lane per output byte. Byte ``k`` holds stream bits ``[8k, 8k + 8)``,
  to which at most ``7 // b + 2`` groups contribute; the lane forms each of their
  values (Horner over its ``g`` digits, int64: values stay below ``2^56``) and ORs
  in the bits that fall into its byte. A group's value is recomputed by each of
  the ``<= b / 8 + 2`` bytes it touches: the codes are read from cache, not memory.
- ``unpack``: one lane per group. It reads the ``<= 8`` bytes that hold the group's
  ``b`` bits at its bit offset (uint64, logical shifts), checks the value against
  ``L^r`` (``r`` the group's digits: ``g``, or fewer for a last group) and writes
  its digits. The count of bad groups stays on the device; :func:`unpack` returns
  it as a one-element tensor and the caller reads it (one host read per decode, as
  TernGrad's decode does: a payload that is not a radix packing is an error).

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors
(tests/triton_kernels/check_radix.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pack", "unpack"]

BLOCK = 1024


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, n, nbytes, L: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
                 T: tl.constexpr, BLOCK_: tl.constexpr):
    k = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    km = k < nbytes
    start = k.to(tl.int64) * 8
    j0 = start // B
    m = (n + G - 1) // G
    byte = tl.zeros([BLOCK_], dtype=tl.int64)
    for t in tl.static_range(T):
        j = j0 + t
        off = j * B - start  # bit offset of the group's bit 0 from the byte's bit 0: in (-B, 8)
        valid = km & (off < 8) & (j < m)
        v = tl.zeros([BLOCK_], dtype=tl.int64)
        for d in tl.static_range(G):
            i = j * G + (G - 1 - d)  # Horner: the most significant digit first
            c = tl.load(codes_ptr + i, mask=valid & (i < n), other=0).to(tl.int64)
            v = v * L + c
        part = tl.where(off >= 0, v << tl.maximum(off, 0), v >> tl.maximum(-off, 0)) & 0xFF
        byte = byte | tl.where(valid, part, 0)
    tl.store(out_ptr + k, byte.to(tl.uint8), mask=km)


@triton.jit
def _unpack_kernel(data_ptr, out_ptr, bad_ptr, n, nbytes, L: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
                   NB: tl.constexpr, BLOCK_: tl.constexpr):
    j = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_).to(tl.int64)
    m = (n + G - 1) // G
    jm = j < m
    pos = j * B
    first = pos >> 3
    acc = tl.zeros([BLOCK_], dtype=tl.uint64)
    for t in tl.static_range(NB):
        byte = tl.load(data_ptr + first + t, mask=jm & (first + t < nbytes), other=0).to(tl.uint64)
        acc = acc | (byte << (8 * t))
    v = (acc >> (pos & 7).to(tl.uint64)) & ((1 << B) - 1)
    r = n - j * G  # digits of this group: G, or fewer for the last one
    limit = tl.full([BLOCK_], 1, dtype=tl.uint64)
    for d in tl.static_range(G):
        limit = tl.where(d < r, limit * L, limit)
    bad = jm & (v >= limit)
    for d in tl.static_range(G):
        q = v // L
        i = j * G + d
        tl.store(out_ptr + i, (v - q * L).to(tl.uint8), mask=jm & (i < n))
        v = q
    tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32), axis=0))


def pack(codes: torch.Tensor, L: int, g: int, b: int) -> torch.Tensor:
    """``codes`` (uint8 on the device, each < ``L``: the caller's kernel made them so)
    packed in mixed radix: :func:`~lowbit.codecs.radix.radix_nbytes` bytes (a last partial
    group's top bits, all zero, are cut: lanes stop at the last byte)."""
    codes = codes.contiguous()
    n = codes.numel()
    q, r = divmod(n, g)
    nbytes = (q * b + (L ** r - 1).bit_length() + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if nbytes:
        _pack_kernel[(triton.cdiv(nbytes, BLOCK),)](codes, out, n, nbytes, L=L, G=g, B=b, T=7 // b + 2,
                                                     BLOCK_=BLOCK)
    return out


def unpack(data: torch.Tensor, L: int, g: int, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the n uint8 digits, the number of group values their digits cannot hold, as a
    one-element int32 device tensor)`` of ``data`` (exactly the bytes :func:`pack` writes)."""
    data = data.contiguous()
    out = torch.empty(n, dtype=torch.uint8, device=data.device)
    bad = torch.zeros(1, dtype=torch.int32, device=data.device)
    m = -(-n // g)
    if m:
        _unpack_kernel[(triton.cdiv(m, BLOCK),)](data, out, bad, n, data.numel(), L=L, G=g, B=b,
                                                 NB=(b + 14) // 8, BLOCK_=BLOCK)
    return out, bad
