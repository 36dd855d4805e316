"""numba kernels of the summable lanes (:mod:`lowbit.codecs.lanes`) on the CPU.

Pack: one pass, each word Horner's ``v <- v R + c`` over its ``k`` codes (most
significant first) in int64 (every partial value is at most ``s (R^k - 1) / (R - 1)``).

Pack and unpack take ``R`` and ``k`` at run time (:func:`pack_words`, :func:`unpack_words`,
cached on disk) below :data:`SPECIALISE_FROM` codes, and from there the layout's kernels
compiled with them as constants (:func:`specialised`).

Unpack: each summed word ``V`` in ``[-H, H]`` (``H = (R^k - 1) / 2``) plus ``H`` is a plain
radix-``R`` number ``u`` in ``[0, R^k - 1]`` (computed in uint64, where it fits); its
digits minus ``h = (R - 1) / 2`` are the lane sums. A word whose ``u`` is ``R^k`` or more
(nonzero after ``k`` digits), or a last word with a nonzero digit past the codes, is
counted as bad (the caller raises). At run time each digit costs a 64-bit division
(~5 ns here); :func:`specialised` compiles the loops again with ``R``, ``k``, ``H`` as
constants, where the division by ``R`` becomes a multiplication (~0.8 ns per digit) and
the packer's Horner loop unrolls (0.3-0.6 ns per code, against ~1 ns at run time;
``python benchmarks/lanes_cost.py``), once per layout and process (~1 s: closures are not
cached on disk).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .cpu import _jit, np_view

__all__ = ["SPECIALISE_FROM", "pack", "pack_words", "specialised", "unpack", "unpack_words"]

SPECIALISE_FROM = 1 << 16  # codes from which pack and unpack compile the layout's specialised kernels


@_jit
def pack_words(codes, R, k, out):
    """``out[j] = sum_i codes[j k + i] R^i`` (missing codes of the last word are 0)."""
    n = codes.shape[0]
    m = out.shape[0]
    RI = np.int64(R)
    full = n // k
    for j in range(full):
        b = j * k
        v = np.int64(0)
        for i in range(k - 1, -1, -1):
            v = v * RI + np.int64(codes[b + i])
        out[j] = v
    if full < m:
        v = np.int64(0)
        for i in range(n - 1, full * k - 1, -1):
            v = v * RI + np.int64(codes[i])
        out[full] = v


@_jit
def unpack_words(words, R, k, H, out):
    """The lane sums of ``words`` into ``out`` (``out.shape[0]`` of them); returns the number
    of bad words (see the module docstring). ``H = (R^k - 1) / 2``."""
    n = out.shape[0]
    RU = np.uint64(R)
    HU = np.uint64(H)
    h = np.int64((R - 1) // 2)
    full = n // k
    bad = 0
    for j in range(full):
        u = np.uint64(words[j]) + HU
        b = j * k
        for i in range(k):
            q = u // RU
            out[b + i] = np.int64(u - q * RU) - h
            u = q
        bad += u != np.uint64(0)
    if full < words.shape[0]:
        u = np.uint64(words[full]) + HU
        b = full * k
        for i in range(k):
            q = u // RU
            d = np.int64(u - q * RU) - h
            if b + i < n:
                out[b + i] = d
            else:
                bad += d != 0
            u = q
        bad += u != np.uint64(0)
    return bad


@functools.cache
def specialised(R: int, k: int):
    """``(pack_full, unpack_full)``: :func:`pack_words` and :func:`unpack_words` over the first
    ``full`` (whole) words, compiled with ``R``, ``k`` and ``H`` as constants (the digit loops
    unroll; a multiplication by ``R`` and a division by ``R`` become a few shifts and
    multiplications). ``pack_full(codes, out, full)``; ``unpack_full(words, out, full)``
    returns the bad count."""
    RI = np.int64(R)
    RU = np.uint64(R)
    HU = np.uint64((R ** k - 1) // 2)
    h = np.int64((R - 1) // 2)
    K = k
    opts = dict(nogil=True, boundscheck=False, error_model="numpy")

    @numba.njit(**opts)
    def pack_full(codes, out, full):
        for j in range(full):
            b = j * K
            v = np.int64(0)
            for i in range(K - 1, -1, -1):
                v = v * RI + np.int64(codes[b + i])
            out[j] = v

    @numba.njit(**opts)
    def unpack_full(words, out, full):
        bad = 0
        for j in range(full):
            u = np.uint64(words[j]) + HU
            b = j * K
            for i in range(K):
                q = u // RU
                out[b + i] = np.int64(u - q * RU) - h
                u = q
            bad += u != np.uint64(0)
        return bad

    return pack_full, unpack_full


# --- torch-level API --------------------------------------------------------------------------

def pack(codes: torch.Tensor, R: int, k: int) -> torch.Tensor:
    """The int64 words of the integer ``codes`` (``ceil(n / k)`` of them)."""
    n = codes.numel()
    out = torch.empty(-(-n // k), dtype=torch.int64)
    c, o = np_view(codes), out.numpy()
    done = n // k if n >= SPECIALISE_FROM else 0
    if done:
        specialised(R, k)[0](c, o, done)
    if done < out.numel():
        pack_words(c[done * k:], R, k, o[done:])
    return out


def unpack(words: torch.Tensor, R: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(the n lane sums of words as dtype, the number of bad words)``."""
    out = torch.empty(n, dtype=dtype)
    w, o = np_view(words), out.numpy()
    H = (R ** k - 1) // 2
    done = 0
    bad = 0
    if n >= SPECIALISE_FROM:
        done = n // k
        bad += int(specialised(R, k)[1](w, o, done))
    if done < words.numel():
        bad += int(unpack_words(w[done:], R, k, H, o[done * k:]))
    return out, bad
