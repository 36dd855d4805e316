"""Triton kernels of mixed-radix packing (:mod:`lowbit.codecs.radix`) on CUDA: the
torch-level API of :mod:`.cpu_radix` (``pack``, ``unpack``), the same bytes.

Integer arithmetic only, so the bytes are the CPU kernels' and the reference's
exactly (no float rounding is involved). ``L``, ``g`` and ``b`` are compile-time
constants (one compilation per level count), so the digit loops unroll and the
divisions by ``L`` become multiplications.

- ``pack``: one lane per output byte. Byte ``k`` holds stream bits ``[8k, 8k + 8)``,
  to which at most ``7 // b + 2`` groups contribute; the lane forms each of their
  values (Horner over its ``g`` digits, int64: values stay below ``2^56``) and ORs
  in the bits that fall into its byte. Groups wider than ``WORD_BITS`` = 56 bits
  (up to 128) are formed as four 32-bit limbs in uint64 lanes, a chunk of
  ``h = chunk_digits(L)`` digits at a time (Horner ``v <- v L^h + w`` with a carry
  through the limbs), and the byte's bits taken from the two limbs they span. A
  group's value is recomputed by each of the ``<= b / 8 + 2`` bytes it touches: the
  codes are read from cache, not memory.
- ``unpack``: one lane per group. It reads the ``<= 8`` bytes that hold the group's
  ``b`` bits at its bit offset (uint64, logical shifts), checks the value against
  ``L^r`` (``r`` the group's digits: ``g``, or fewer for a last group) and writes
  its digits. A wide group is read as limbs (5 bytes each) and taken apart by long
  division of the limbs by ``L^h`` per chunk, then by ``L`` per digit; a digit past
  ``r`` that is not 0, or a value left over, marks it bad. The count of bad groups
  stays on the device; :func:`unpack` returns it as a one-element tensor and the
  caller reads it (one host read per decode, as TernGrad's decode does: a payload
  that is not a radix packing is an error).

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors
(tests/triton_kernels/check_radix.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..radix import WORD_BITS, chunk_digits

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
        tl.store(out_ptr + i, (v - q * L).to(out_ptr.dtype.element_ty), mask=jm & (i < n))
        v = q
    tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32), axis=0))


# --- wide groups (WORD_BITS < b <= MAX_GROUP_BITS): the value as 32-bit limbs l0..l3 (uint64 lanes,
# least significant first), a chunk of H digits (W = L^H <= 2^32) at a time, as in cpu_radix.


@triton.jit
def _group_limbs(codes_ptr, j, valid, n, L: tl.constexpr, G: tl.constexpr, B: tl.constexpr, H: tl.constexpr,
                 W: tl.constexpr):
    """The limbs of group ``j``'s value (its missing digits past ``n`` are 0): Horner over the
    chunks, the most significant first, ``v <- v W + w`` carried through the limbs."""
    l0 = tl.zeros(j.shape, dtype=tl.uint64)
    l1 = tl.zeros(j.shape, dtype=tl.uint64)
    l2 = tl.zeros(j.shape, dtype=tl.uint64)
    l3 = tl.zeros(j.shape, dtype=tl.uint64)
    for cc in tl.static_range((G - 1) // H + 1):
        ci = (G - 1) // H - cc
        w = tl.zeros(j.shape, dtype=tl.uint64)
        for t in tl.static_range(H):
            d = ci * H + (H - 1 - t)  # the chunk's digits, the most significant first
            if d < G:
                i = j * G + d
                w = w * L + tl.load(codes_ptr + i, mask=valid & (i < n), other=0).to(tl.uint64)
        x = l0 * W + w
        l0 = x & 0xFFFFFFFF
        x = l1 * W + (x >> 32)
        l1 = x & 0xFFFFFFFF
        if B > 64:
            x = l2 * W + (x >> 32)
            l2 = x & 0xFFFFFFFF
            if B > 96:
                l3 = l3 * W + (x >> 32)
    return l0, l1, l2, l3


@triton.jit
def _pack_wide_kernel(codes_ptr, out_ptr, n, nbytes, L: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
                      H: tl.constexpr, W: tl.constexpr, BLOCK_: tl.constexpr):
    """One lane per output byte, as ``_pack_kernel``: at most 2 groups (``B > 8``) overlap it."""
    k = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    km = k < nbytes
    start = k.to(tl.int64) * 8
    j0 = start // B
    m = (n + G - 1) // G
    byte = tl.zeros([BLOCK_], dtype=tl.uint64)
    for t in tl.static_range(2):
        j = j0 + t
        off = j * B - start  # bit offset of the group's bit 0 from the byte's bit 0: in (-B, 8)
        valid = km & (off < 8) & (j < m)
        l0, l1, l2, l3 = _group_limbs(codes_ptr, j, valid, n, L, G, B, H, W)
        s = tl.maximum(-off, 0)  # the group's bits [s, s + 8) are the byte's (shifted up by max(off, 0))
        li = s // 32
        lo = tl.where(li == 0, l0, tl.where(li == 1, l1, tl.where(li == 2, l2, l3)))
        hi = tl.where(li == 0, l1, tl.where(li == 1, l2, tl.where(li == 2, l3, 0)))
        window = lo | (hi << 32)
        part = tl.where(off >= 0, l0 << tl.maximum(off, 0).to(tl.uint64), window >> (s % 32).to(tl.uint64))
        byte = byte | tl.where(valid, part & 0xFF, 0)
    tl.store(out_ptr + k, byte.to(tl.uint8), mask=km)


@triton.jit
def _read_limb(data_ptr, pos, jm, nbytes):
    """The 32 stream bits from bit ``pos`` (5 bytes; bytes past the end read as zero)."""
    first = pos >> 3
    acc = tl.zeros(pos.shape, dtype=tl.uint64)
    for t in tl.static_range(5):
        byte = tl.load(data_ptr + first + t, mask=jm & (first + t < nbytes), other=0).to(tl.uint64)
        acc = acc | (byte << (8 * t))
    return (acc >> (pos & 7).to(tl.uint64)) & 0xFFFFFFFF


@triton.jit
def _unpack_wide_kernel(data_ptr, out_ptr, bad_ptr, n, nbytes, L: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
                        H: tl.constexpr, W: tl.constexpr, BLOCK_: tl.constexpr):
    """One lane per group, as ``_unpack_kernel``: its limbs, then long division by ``W`` per
    chunk and by ``L`` per digit; a digit at or past the group's ``r`` digits that is not 0, or
    a value left over, marks the group bad (its value is not below ``L^r``)."""
    j = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_).to(tl.int64)
    m = (n + G - 1) // G
    jm = j < m
    pos = j * B
    r = n - j * G  # digits of this group: G, or fewer for the last one
    l0 = _read_limb(data_ptr, pos, jm, nbytes)
    l1 = _read_limb(data_ptr, pos + 32, jm, nbytes)
    l2 = tl.zeros([BLOCK_], dtype=tl.uint64)
    l3 = tl.zeros([BLOCK_], dtype=tl.uint64)
    if B > 64:
        l2 = _read_limb(data_ptr, pos + 64, jm, nbytes)
    if B > 96:
        l3 = _read_limb(data_ptr, pos + 96, jm, nbytes)
    if B <= 64:  # the top limb's bits past B are the next group's
        l1 = l1 & ((1 << (B - 32)) - 1)
    elif B <= 96:
        l2 = l2 & ((1 << (B - 64)) - 1)
    else:
        l3 = l3 & ((1 << (B - 96)) - 1)
    bad = tl.zeros([BLOCK_], dtype=tl.int1)
    for ci in tl.static_range((G - 1) // H + 1):
        if ci < (G - 1) // H:  # a full chunk: long division of the limbs by W, the top limb first
            x = tl.zeros([BLOCK_], dtype=tl.uint64)
            if B > 96:
                x = l3 % W
                l3 = l3 // W
            if B > 64:
                x = (x << 32) | l2
                l2 = x // W
                x = x % W
            x = (x << 32) | l1
            l1 = x // W
            x = ((x % W) << 32) | l0
            l0 = x // W
            w = x % W
        else:  # the top chunk: below L^(its digits) <= W, so in l0 alone
            w = l0
            bad = bad | ((l1 | l2 | l3) != 0)
        for t in tl.static_range(H):
            d = ci * H + t
            if d < G:
                q = w // L
                digit = w - q * L
                w = q
                i = j * G + d
                tl.store(out_ptr + i, digit.to(out_ptr.dtype.element_ty), mask=jm & (i < n))
                bad = bad | ((d >= r) & (digit != 0))
        if ci == (G - 1) // H:
            bad = bad | (w != 0)
    tl.atomic_add(bad_ptr, tl.sum((jm & bad).to(tl.int32), axis=0))


def pack(codes: torch.Tensor, L: int, g: int, b: int) -> torch.Tensor:
    """``codes`` (integers on the device, each < ``L``: the caller's kernel made them so)
    packed in mixed radix: :func:`~lowbit.codecs.radix.radix_nbytes` bytes (a last partial
    group's top bits, all zero, are cut: lanes stop at the last byte)."""
    codes = codes.contiguous()
    n = codes.numel()
    q, r = divmod(n, g)
    nbytes = (q * b + (L ** r - 1).bit_length() + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if nbytes and b > WORD_BITS:
        h = chunk_digits(L)
        _pack_wide_kernel[(triton.cdiv(nbytes, BLOCK),)](codes, out, n, nbytes, L=L, G=g, B=b, H=h, W=L ** h,
                                                          BLOCK_=BLOCK)
    elif nbytes:
        _pack_kernel[(triton.cdiv(nbytes, BLOCK),)](codes, out, n, nbytes, L=L, G=g, B=b, T=7 // b + 2,
                                                     BLOCK_=BLOCK)
    return out


def unpack(data: torch.Tensor, L: int, g: int, b: int, n: int,
           dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the n digits as dtype (one that holds L - 1), the number of group values their
    digits cannot hold, as a one-element int32 device tensor)`` of ``data`` (exactly the
    bytes :func:`pack` writes)."""
    data = data.contiguous()
    out = torch.empty(n, dtype=dtype, device=data.device)
    bad = torch.zeros(1, dtype=torch.int32, device=data.device)
    m = -(-n // g)
    if m and b > WORD_BITS:
        h = chunk_digits(L)
        _unpack_wide_kernel[(triton.cdiv(m, BLOCK),)](data, out, bad, n, data.numel(), L=L, G=g, B=b, H=h,
                                                      W=L ** h, BLOCK_=BLOCK)
    elif m:
        _unpack_kernel[(triton.cdiv(m, BLOCK),)](data, out, bad, n, data.numel(), L=L, G=g, B=b,
                                                 NB=(b + 14) // 8, BLOCK_=BLOCK)
    return out, bad
