"""numba kernels of mixed-radix packing (:mod:`lowbit.codecs.radix`): one pass that
forms each group's radix-``L`` value and writes it into the little-endian bit
stream of :mod:`lowbit.codecs.packing`, and its inverse. Group widths up to 56
bits: a value shifted by the < 8 bits left in the 64-bit accumulator still fits.
"""

from __future__ import annotations

import numpy as np

from .cpu import _jit


@_jit
def pack_radix(codes, L, g, b, out):
    """``codes`` (uint8, each < L) in groups of ``g``, each group's value
    ``sum_k codes[j g + k] L^k`` (the missing digits of a last partial group are 0)
    written as ``b`` stream bits into the zeroed ``out``."""
    n = codes.shape[0]
    m = (n + g - 1) // g
    Lu = np.uint64(L)
    acc = np.uint64(0)
    nbits = 0
    o = 0
    for j in range(m):
        base = j * g
        hi = min(base + g, n)
        v = np.uint64(0)
        for i in range(hi - 1, base - 1, -1):  # Horner, most significant digit first
            v = v * Lu + np.uint64(codes[i])
        acc |= v << np.uint64(nbits)
        nbits += b
        while nbits >= 8:
            out[o] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nbits -= 8
            o += 1
    if nbits > 0:
        out[o] = np.uint8(acc & np.uint64(0xFF))


@_jit
def unpack_radix(data, L, g, b, out):
    """Inverse of :func:`pack_radix` into ``out`` (uint8, ``n`` digits). Returns the
    number of groups whose value does not fit their digits (>= L^g, or >= L^r for a
    last group of r < g digits): 0 for the output of :func:`pack_radix`."""
    n = out.shape[0]
    m = (n + g - 1) // g
    Lu = np.uint64(L)
    mask = (np.uint64(1) << np.uint64(b)) - np.uint64(1)
    acc = np.uint64(0)
    nbits = 0
    o = 0
    bad = 0
    for j in range(m):
        while nbits < b:
            acc |= np.uint64(data[o]) << np.uint64(nbits)
            o += 1
            nbits += 8
        v = acc & mask
        acc >>= np.uint64(b)
        nbits -= b
        base = j * g
        hi = min(base + g, n)
        for i in range(base, hi):
            q = v // Lu
            out[i] = np.uint8(v - q * Lu)
            v = q
        bad += v != np.uint64(0)
    return bad
