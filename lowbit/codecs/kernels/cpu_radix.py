"""numba kernels of mixed-radix packing (:mod:`lowbit.codecs.radix`): one pass that
forms each group's radix-``L`` value and writes it into the little-endian bit
stream of :mod:`lowbit.codecs.packing`, and its inverse. Groups of up to
``WORD_BITS`` = 56 bits are one 64-bit word (a value shifted by the < 8 bits left in
the 64-bit accumulator still fits); wider ones (up to 128 bits) take the limb kernels
:func:`pack_radix_wide` / :func:`unpack_radix_wide` (see the section "wide groups").

Two kinds of kernels with one format:

- :func:`pack_radix` / :func:`unpack_radix`: ``L``, ``g``, ``b`` are run-time
  arguments (any length; the tail of the specialised kernels below, and the
  kernels :mod:`lowbit.codecs.radix` calls).
- :func:`specialised` ``(L, g, b)``: kernels compiled for one level count, with
  ``L``, ``g`` and ``b`` compile-time constants, over "blocks" of 8 groups (8
  groups of ``b`` bits fill exactly ``b`` bytes, so every block starts on a byte):
  the packer is generated as straight-line source per level count (every shift a
  literal, each output byte written once: as fast as plain bit packing), the
  unpacker's digit loops unroll and its division by ``L`` becomes a multiplication.
  For wide groups, the run-time limb kernels' own source compiled again with ``L``,
  ``g``, ``b`` and the chunk length as constants (:func:`_bind`). Compiled once per
  level count and process (such functions are not cached on disk by numba).

:func:`pack` / :func:`unpack` are the torch-level API that the codecs' fast paths
call (the same names and signatures in :mod:`.gpu_radix`). They use the specialised
kernels from :data:`SPECIALISE_FROM` codes on (below, the compilation would cost more
than it saves), the run-time ones for the rest.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import numba
import numpy as np
import torch

from ..radix import WORD_BITS, chunk_digits
from .cpu import M32, _jit

_S32 = np.uint64(32)

__all__ = ["pack", "unpack"]

SPECIALISE_FROM = 1 << 16  # codes from which pack/unpack compile the specialised kernels of a level count


@_jit
def pack_radix(codes, L, g, b, out):
    """``codes`` (uint8, each < L) in groups of ``g``, each group's value
    ``sum_k codes[j g + k] L^k`` (the missing digits of a last partial group are 0)
    written as ``b`` stream bits into the zeroed ``out``, cut at ``out``'s length (a last
    partial group's top bits are zero)."""
    n = codes.shape[0]
    m = (n + g - 1) // g
    Lu = np.uint64(L)
    acc = np.uint64(0)
    nbits = 0
    o = 0
    nout = out.shape[0]
    for j in range(m):
        base = j * g
        hi = min(base + g, n)
        v = np.uint64(0)
        for i in range(hi - 1, base - 1, -1):  # Horner, most significant digit first
            v = v * Lu + np.uint64(codes[i])
        acc |= v << np.uint64(nbits)
        nbits += b
        while nbits >= 8:
            if o < nout:
                out[o] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nbits -= 8
            o += 1
    if nbits > 0 and o < nout:
        out[o] = np.uint8(acc & np.uint64(0xFF))


@_jit
def unpack_radix(data, L, g, b, out):
    """Inverse of :func:`pack_radix` into ``out`` (uint8, ``n`` digits). Returns the
    number of groups whose value does not fit their digits (>= L^g, or >= L^r for a
    last group of r < g digits): 0 for the output of :func:`pack_radix`. Bytes past the
    end of ``data`` read as zero (a last partial group's cut top bits)."""
    n = out.shape[0]
    nd = data.shape[0]
    m = (n + g - 1) // g
    Lu = np.uint64(L)
    mask = (np.uint64(1) << np.uint64(b)) - np.uint64(1)
    acc = np.uint64(0)
    nbits = 0
    o = 0
    bad = 0
    for j in range(m):
        while nbits < b:
            acc |= np.uint64(data[o] if o < nd else 0) << np.uint64(nbits)
            o += 1
            nbits += 8
        v = acc & mask
        acc >>= np.uint64(b)
        nbits -= b
        base = j * g
        hi = min(base + g, n)
        for i in range(base, hi):
            q = v // Lu
            out[i] = v - q * Lu
            v = q
        bad += v != np.uint64(0)
    return bad


# --- wide groups (WORD_BITS < b <= MAX_GROUP_BITS): the value as 32-bit limbs ---------------------
#
# The group value v = sum_k c_k L^k is held as limbs l0..l3 (32 bits each in 64-bit words, least
# significant first; those above bit b stay 0) and handled a chunk of h digits at a time
# (radix.chunk_digits: W = L^h <= 2^32), v = sum_i w_i W^i: Horner v <- v W + w_i carried through
# the limbs (a limb times W plus a carry stays below 2^64), long division of the limbs by W (a
# remainder below W shifted up by 32 bits stays below 2^64) while the value is wider than a word
# (word_digits: once its digits fit 64 bits, one 64-bit division by W per chunk), each chunk split
# into its h digits with 32-bit divisions. The stream is written and read 32 bits at a time (a
# 64-bit accumulator holds < 32 pending bits plus a limb). A last partial group is handled as a
# full one whose missing digits are 0 (the same value), so every group loop has constant trip
# counts where g is a constant.
#
# The kernels are flat loops (no helper calls): :func:`specialised` compiles them again with L, g,
# b, h bound as constants (:func:`_bind`), where the limb counts fold, the loops unroll and the
# divisions by W and L become multiplications.


@_jit
def pack_radix_wide(codes, L, g, b, h, out):
    """:func:`pack_radix` for groups wider than ``WORD_BITS`` (``h`` digits per chunk)."""
    n = codes.shape[0]
    nout = out.shape[0]
    Lu = np.uint64(L)
    Wu = np.uint64(1)
    for _ in range(h):
        Wu *= Lu
    full = n // g
    tail = np.zeros(g, dtype=codes.dtype)  # a last partial group, its missing digits 0
    for k in range(full * g, n):
        tail[k - full * g] = codes[k]
    acc = np.uint64(0)
    nbits = 0
    o = 0
    for j in range((n + g - 1) // g):
        src = codes if j < full else tail
        base = j * g if j < full else 0
        l0 = np.uint64(0)
        l1 = np.uint64(0)
        l2 = np.uint64(0)
        l3 = np.uint64(0)
        for cc in range((g - 1) // h + 1):  # Horner over the chunks, the most significant first
            ci = (g - 1) // h - cc
            lo = base + ci * h
            w = np.uint64(0)
            for t in range(min(h, g - ci * h) - 1, -1, -1):
                w = w * Lu + np.uint64(src[lo + t])
            t = l0 * Wu + w
            l0 = t & M32
            t = l1 * Wu + (t >> _S32)
            l1 = t & M32
            if b > 64:
                t = l2 * Wu + (t >> _S32)
                l2 = t & M32
                if b > 96:
                    l3 = l3 * Wu + (t >> _S32)
        for li in range(4):  # the limbs into the stream, 32 bits written at a time
            if 32 * li < b:
                x = l0 if li == 0 else (l1 if li == 1 else (l2 if li == 2 else l3))
                acc |= x << np.uint64(nbits)
                nbits += min(32, b - 32 * li)
                if nbits >= 32:
                    for k in range(4):
                        if o + 4 <= nout or o + k < nout:  # bytes past the end (a cut group's zero bits) dropped
                            out[o + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))
                    acc >>= _S32
                    nbits -= 32
                    o += 4
    while nbits > 0:  # the last < 32 bits
        if o < nout:
            out[o] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        nbits -= 8
        o += 1


def word_digits(L: int) -> int:
    """Digits of ``L`` levels whose values fit a 64-bit word: the largest ``d`` with ``L^d <= 2^64``."""
    d = 1
    while L ** (d + 1) <= 1 << 64:
        d += 1
    return d


@_jit
def unpack_radix_wide(data, L, g, b, h, dw, out):
    """:func:`unpack_radix` for groups wider than ``WORD_BITS`` (``h`` digits per chunk; values
    of ``dw`` digits fit a 64-bit word, so chunks are peeled from those by one division)."""
    n = out.shape[0]
    nd = data.shape[0]
    Lu = np.uint64(L)
    Wu = np.uint64(1)
    for _ in range(h):
        Wu *= Lu
    full = n // g
    tail = np.zeros(g, dtype=out.dtype)  # a last partial group's digits, all g of them
    acc = np.uint64(0)
    nbits = 0
    o = 0
    bad = 0
    for j in range((n + g - 1) // g):
        dst = out if j < full else tail
        base = j * g if j < full else 0
        l0 = np.uint64(0)
        l1 = np.uint64(0)
        l2 = np.uint64(0)
        l3 = np.uint64(0)
        for li in range(4):  # the limbs from the stream, 32 bits read at a time
            if 32 * li < b:
                wl = min(32, b - 32 * li)
                if nbits < wl:
                    word = np.uint64(0)
                    for k in range(4):
                        if o + 4 <= nd or o + k < nd:  # bytes past the end (a cut group's zero bits) read as 0
                            word |= np.uint64(data[o + k]) << np.uint64(8 * k)
                    acc |= word << np.uint64(nbits)
                    nbits += 32
                    o += 4
                x = acc & ((np.uint64(1) << np.uint64(wl)) - np.uint64(1))
                acc >>= np.uint64(wl)
                nbits -= wl
                if li == 0:
                    l0 = x
                elif li == 1:
                    l1 = x
                elif li == 2:
                    l2 = x
                else:
                    l3 = x
        for ci in range((g - 1) // h + 1):  # the chunks, the least significant first
            if ci < (g - 1) // h and g - ci * h <= dw:  # a full chunk of a value that fits a word
                v = (l1 << _S32) | l0
                q = v // Wu
                w = np.uint64(np.uint32(v - q * Wu))
                l0 = q & M32
                l1 = q >> _S32
            elif ci < (g - 1) // h:  # a full chunk: long division of the limbs by W, the top limb first
                t = np.uint64(0)
                if b > 96:
                    q = l3 // Wu
                    t = l3 - q * Wu
                    l3 = q
                if b > 64:
                    t = (t << _S32) | l2
                    q = t // Wu
                    t = t - q * Wu
                    l2 = q
                t = (t << _S32) | l1
                q = t // Wu
                t = t - q * Wu
                l1 = q
                t = (t << _S32) | l0
                q = t // Wu
                w = np.uint64(np.uint32(t - q * Wu))  # below W <= 2^32: 32-bit divisions by L below
                l0 = q
            else:  # the top chunk: below L^(its digits) <= W, so in l0 alone
                w = l0
                l0 = np.uint64(0)
            for t in range(min(h, g - ci * h)):
                q = w // Lu
                dst[base + ci * h + t] = w - q * Lu
                w = q
            l0 |= w  # what the digits do not hold
        bad += (l0 | l1 | l2 | l3) != np.uint64(0)
    r = n - full * g
    if r:
        for k in range(r):
            out[full * g + k] = tail[k]
        for k in range(r, g):  # a last group of r digits holds a value below L^r
            if tail[k] != 0:
                bad += 1
                break
    return bad


def _bind(fn, **consts):
    """The numba kernel ``fn`` compiled anew with the parameters named in ``consts`` bound to
    those values: its source with the parameters dropped and the values as globals, which numba
    freezes as compile-time constants."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.py_func)))
    f = tree.body[0]
    f.decorator_list = []
    f.args.args = [a for a in f.args.args if a.arg not in consts]
    scope = dict(fn.py_func.__globals__, **consts)
    exec(compile(tree, f"<{f.name} {consts}>", "exec"), scope)  # noqa: S102 (fn's own source)
    return numba.njit(nogil=True, boundscheck=False, error_model="numpy")(scope[f.name])


def _pack_source(L: int, g: int, b: int) -> str:
    """Python source of the block packer for one level count: straight-line code over a
    block of 8 groups (8 g codes, b bytes), every shift and offset a literal."""
    u = "np.uint64"
    pack = ["def pack_blocks(codes, out, blocks):", "    for s in range(blocks):",
            f"        c = codes[s * {8 * g}:(s + 1) * {8 * g}]", f"        o = out[s * {b}:(s + 1) * {b}]"]
    for j in range(8):  # each group's value, Horner over its digits (most significant first)
        expr = f"{u}(c[{j * g + g - 1}])"
        for k in range(g - 2, -1, -1):
            expr = f"({expr} * {u}({L}) + {u}(c[{j * g + k}]))"
        pack.append(f"        v{j} = {expr}")
    for t in range(b):  # byte t of the block: the bits of the groups that overlap it
        parts = []
        for j in range(8):
            lo = j * b - 8 * t  # group j's bit 0 relative to byte t's bit 0
            if lo < 8 and lo + b > 0:
                parts.append(f"(v{j} << {u}({lo}))" if lo >= 0 else f"(v{j} >> {u}({-lo}))")
        pack.append(f"        o[{t}] = np.uint8(({' | '.join(parts)}) & {u}(255))")
    return "\n".join(pack) + "\n"


@functools.cache
def specialised(L: int, g: int, b: int):
    """``(pack_blocks, unpack_blocks)`` for ``L`` levels in groups of ``g`` digits and
    ``b`` bits: ``pack_blocks(codes, out, blocks)`` packs the first ``8 g blocks``
    codes into the first ``b blocks`` bytes of ``out``; ``unpack_blocks(data, out,
    blocks)`` is its inverse and returns the number of groups whose value exceeds
    ``L^g - 1``. The packer is generated as straight-line source (:func:`_pack_source`:
    the block's 8 group values, then each of its bytes from the groups that overlap it,
    every shift literal, each byte written once); the unpacker is a loop over the
    block's groups with ``L``, ``g``, ``b`` as constants (a generated straight-line
    unpacker was not faster and took longer to compile)."""
    opts = dict(nogil=True, boundscheck=False, error_model="numpy")
    if b > WORD_BITS:  # the wide kernels with L, g, b, h constants, over the blocks' codes
        consts = {"L": L, "g": g, "b": b, "h": chunk_digits(L)}
        pack_wide = _bind(pack_radix_wide, **consts)
        unpack_wide = _bind(unpack_radix_wide, dw=word_digits(L), **consts)
        return (lambda codes, out, blocks: pack_wide(codes[:blocks * 8 * g], out[:blocks * b]),
                lambda data, out, blocks: unpack_wide(data[:blocks * b], out[:blocks * 8 * g]))
    scope = {"np": np}
    exec(compile(_pack_source(L, g, b), f"<radix pack L={L}>", "exec"), scope)  # noqa: S102 (generated above)
    Lu = np.uint64(L)
    G = g
    B = b
    MASK = np.uint64((1 << b) - 1)
    BU = np.uint64(b)
    LIMIT = np.uint64(L ** g)

    @numba.njit(**opts)
    def unpack_blocks(data, out, blocks):
        bad = 0
        for s in range(blocks):
            base = s * 8 * G
            o = s * B
            acc = np.uint64(0)
            nbits = 0
            for j in range(8):
                while nbits < B:
                    acc |= np.uint64(data[o]) << np.uint64(nbits)
                    o += 1
                    nbits += 8
                v = acc & MASK
                acc >>= BU
                nbits -= B
                bad += v >= LIMIT
                for k in range(G):
                    q = v // Lu
                    out[base + j * G + k] = v - q * Lu
                    v = q
        return bad

    return numba.njit(**opts)(scope["pack_blocks"]), unpack_blocks


# --- torch-level API (the same names and signatures as gpu_radix) -----------------------------

def pack(codes: torch.Tensor, L: int, g: int, b: int) -> torch.Tensor:
    """``codes`` (a contiguous integer CPU tensor, each < ``L``: the caller's kernel made
    them so) packed in mixed radix: :func:`~lowbit.codecs.radix.radix_nbytes` bytes."""
    c = codes.numpy()
    n = c.shape[0]
    q, r = divmod(n, g)
    out = torch.zeros((q * b + (L ** r - 1).bit_length() + 7) // 8, dtype=torch.uint8)
    o = out.numpy()
    blocks = n // (8 * g) if n >= SPECIALISE_FROM else 0
    if blocks:
        specialised(L, g, b)[0](c, o, blocks)
    if blocks * 8 * g < n:
        if b > WORD_BITS:
            pack_radix_wide(c[blocks * 8 * g:], L, g, b, chunk_digits(L), o[blocks * b:])
        else:
            pack_radix(c[blocks * 8 * g:], L, g, b, o[blocks * b:])
    return out


def unpack(data: torch.Tensor, L: int, g: int, b: int, n: int,
           dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, int]:
    """``(the n digits as dtype (one that holds L - 1), the number of group values their
    digits cannot hold)`` of ``data`` (exactly the bytes :func:`pack` writes for ``n``
    codes: the caller checks)."""
    d = data.contiguous().numpy()
    out = torch.empty(n, dtype=dtype)
    o = out.numpy()
    blocks = n // (8 * g) if n >= SPECIALISE_FROM else 0
    bad = 0
    if blocks:
        bad += int(specialised(L, g, b)[1](d, o, blocks))
    if blocks * 8 * g < n:
        if b > WORD_BITS:
            bad += int(unpack_radix_wide(d[blocks * b:], L, g, b, chunk_digits(L), word_digits(L),
                                         o[blocks * 8 * g:]))
        else:
            bad += int(unpack_radix(d[blocks * b:], L, g, b, o[blocks * 8 * g:]))
    return out, bad
