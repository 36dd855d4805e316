"""numba kernels of the summable lanes (:mod:`lowbit.codecs.lanes`) on the CPU.

Layout (the module's): ``n`` codes in ``m = ceil(n / k)`` words, code ``t`` the digit
``t // m`` of word ``t mod m`` (row ``i`` of a ``k x m`` table of codes is digit ``i`` of
every word), so that each step below is a loop over contiguous arrays, which LLVM
vectorises.

Pack: Horner over the rows, ``out <- out R + row`` (most significant row first), in
int64 (every partial value is at most ``s (R^k - 1) / (R - 1)`` in magnitude).

Unpack: each summed word ``V`` in ``[-H, H]`` (``H = (R^k - 1) / 2``) plus ``H`` is a plain
radix-``R`` number ``u`` in ``[0, R^k - 1]`` (computed in uint64, where it fits); its
digits minus ``h = (R - 1) / 2`` are the lane sums. A word whose ``u`` is ``R^k`` or more,
or a digit past the last code that is not zero, is counted as bad (the caller raises).

Two kinds of kernels with one result: :func:`pack_words` / :func:`unpack_words` take
``R`` and ``k`` at run time (cached on disk; a 64-bit division per digit); from
:data:`SPECIALISE_FROM` codes on, :func:`specialised` compiles kernels with ``R`` and
``k`` as constants, once per layout and process (~1 s: closures are not cached on disk):
the packer's multiplication by ``R`` vectorises, and the unpacker first splits each
word into 32-bit limbs of ``G`` digits (``R^G <= 2^32``; a division by a constant per
limb), then takes the digits of each limb row by row in 32-bit arithmetic, where the
division by the constant ``R`` is a vectorised multiply-high. At 1e6 codes, one thread,
here: pack ~0.1 ms, unpack 0.17-0.31 ms (``python benchmarks/lanes_cost.py`` times them
with the encode and decode around them).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .cpu import _inline, _jit, np_view

__all__ = ["pack", "unpack"]

SPECIALISE_FROM = 1 << 16  # codes from which pack and unpack compile the layout's specialised kernels


@_inline
def _pack_rows(codes, RI, k, out):
    """:func:`pack_words`' loops, ``RI = R`` as an int64; inlined, so that :func:`specialised`'s
    constant ``R`` and ``k`` reach them. The inner loops index slices from 0 (``codes[b + j]``
    kept LLVM from vectorising them: 10x slower)."""
    n = codes.shape[0]
    m = out.shape[0]
    out[:] = 0
    for i in range(k - 1, -1, -1):
        b = i * m
        lim = min(max(n - b, 0), m)
        o = out[:lim]
        c = codes[b:b + lim]
        for j in range(lim):
            o[j] = o[j] * RI + np.int64(c[j])
        for j in range(lim, m):
            out[j] = out[j] * RI


@_jit
def pack_words(codes, R, k, out):
    """``out[j] = sum_i codes[i m + j] R^i`` (``m = out.shape[0]``; codes past the end are 0)."""
    _pack_rows(codes, np.int64(R), k, out)


@_jit
def unpack_words(words, R, k, H, out):
    """The lane sums of ``words`` into ``out`` (``out.shape[0]`` of them); returns the number
    of bad words and padding digits (see the module docstring). ``H = (R^k - 1) / 2``."""
    n = out.shape[0]
    m = words.shape[0]
    RU = np.uint64(R)
    HU = np.uint64(H)
    h = np.int64((R - 1) // 2)
    bad = 0
    for j in range(m):
        u = np.uint64(words[j]) + HU
        for i in range(k):
            q = u // RU
            d = np.int64(u - q * RU) - h
            t = i * m + j
            if t < n:
                out[t] = d
            else:
                bad += d != 0
            u = q
        bad += u != np.uint64(0)
    return bad


def _limbs(R: int, k: int) -> tuple[int, int]:
    """``(G, NG)``: digits per 32-bit limb (the largest ``G <= k`` with ``R^G <= 2^32``, at
    least 1) and limbs per word."""
    G = 1
    while G < k and R ** (G + 1) <= 1 << 32:
        G += 1
    return G, -(-k // G)


@functools.cache
def specialised(R: int, k: int):
    """``(pack_all, unpack_all)`` for one layout, ``R`` and ``k`` compile-time constants:
    ``pack_all(codes, out)`` as :func:`pack_words`; ``unpack_all(words, out, limbs)``
    as :func:`unpack_words` (``limbs``: a ``(NG, m)`` uint32 scratch array, see
    :func:`_limbs`)."""
    G, NG = _limbs(R, k)
    RI = np.int64(R)
    R32 = np.uint32(R)
    HU = np.uint64((R ** k - 1) // 2)
    h = np.int32((R - 1) // 2)
    K = k
    PG = np.uint64(R ** G)  # a full limb's radix
    TOP = np.uint64(R ** (k - (NG - 1) * G))  # the last limb's bound
    opts = dict(nogil=True, boundscheck=False, error_model="numpy")

    @numba.njit(**opts)
    def pack_all(codes, out):
        _pack_rows(codes, RI, K, out)

    @numba.njit(**opts)
    def unpack_all(words, out, limbs):
        n = out.shape[0]
        m = words.shape[0]
        bad = 0
        for j in range(m):  # each word's limbs, least significant first
            u = np.uint64(words[j]) + HU
            for t in range(NG - 1):
                q = u // PG
                limbs[t, j] = np.uint32(u - q * PG)
                u = q
            bad += u >= TOP
            limbs[NG - 1, j] = np.uint32(u)
        for t in range(NG):
            L = limbs[t]
            for i in range(min(G, K - t * G)):
                b = (t * G + i) * m
                lim = min(max(n - b, 0), m)
                o = out[b:b + lim]
                for j in range(lim):
                    v = L[j]
                    q = v // R32
                    o[j] = np.int32(v - q * R32) - h
                    L[j] = q
                for j in range(lim, m):  # digits past the codes: zero sums, h offset
                    v = L[j]
                    q = v // R32
                    bad += np.int32(v - q * R32) != h
                    L[j] = q
        return bad

    return pack_all, unpack_all


# --- torch-level API --------------------------------------------------------------------------

def pack(codes: torch.Tensor, R: int, k: int) -> torch.Tensor:
    """The int64 words of the integer ``codes`` (``ceil(n / k)`` of them)."""
    n = codes.numel()
    out = torch.empty(-(-n // k), dtype=torch.int64)
    if n >= SPECIALISE_FROM:
        specialised(R, k)[0](np_view(codes), out.numpy())
    elif n:
        pack_words(np_view(codes), R, k, out.numpy())
    return out


def unpack(words: torch.Tensor, R: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(the n lane sums of words as dtype, the number of bad words and padding digits)``."""
    out = torch.empty(n, dtype=dtype)
    w, o = np_view(words), out.numpy()
    if n >= SPECIALISE_FROM:
        limbs = np.empty((_limbs(R, k)[1], w.shape[0]), dtype=np.uint32)
        return out, int(specialised(R, k)[1](w, o, limbs))
    return out, int(unpack_words(w, R, k, (R ** k - 1) // 2, o)) if w.shape[0] else 0
