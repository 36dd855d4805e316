"""numba kernels of mixed-radix packing (:mod:`lowbit.codecs.radix`): one pass that
forms each group's radix-``L`` value and writes it into the little-endian bit
stream of :mod:`lowbit.codecs.packing`, and its inverse. Group widths up to 56
bits: a value shifted by the < 8 bits left in the 64-bit accumulator still fits.

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
  Compiled once per level count and process (such functions are not cached on
  disk by numba).

:func:`pack` / :func:`unpack` are the torch-level API that the codecs' fast paths
call (the same names and signatures in :mod:`.gpu_radix`). They use the specialised
kernels from :data:`SPECIALISE_FROM` codes on (below, the compilation would cost more
than it saves), the run-time ones for the rest.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from ..radix import WORD_BITS, chunk_digits
from .cpu import M32, _jit

__all__ = ["SPECIALISE_FROM", "pack", "unpack", "pack_radix", "unpack_radix", "specialised"]

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
# remainder below W shifted up by 32 bits stays below 2^64), and each chunk split into its h digits
# in one word. The stream is written and read 32 bits at a time (a 64-bit accumulator holds < 32
# pending bits plus a limb). The helpers are inlined into the kernels (inline="always"), so where
# L, g, b are constants (the specialised kernels) the limb counts fold and the divisions by W and L
# become multiplications.

_inline = numba.njit(inline="always", nogil=True, boundscheck=False, error_model="numpy")
_S32 = np.uint64(32)


@_inline
def _chunk_base(Lu, h):
    """``W = L^h`` as a uint64 (``**`` would type it int64)."""
    Wu = np.uint64(1)
    for _ in range(h):
        Wu *= Lu
    return Wu


@_inline
def _wide_value(codes, base, r, b, Lu, h, Wu):
    """The limbs ``(l0, l1, l2, l3)`` of the value of the ``r`` digits ``codes[base:base + r]``
    (a value of at most ``b`` bits)."""
    l0 = np.uint64(0)
    l1 = np.uint64(0)
    l2 = np.uint64(0)
    l3 = np.uint64(0)
    for ci in range((r - 1) // h, -1, -1):  # Horner over the chunks, the most significant first
        lo = base + ci * h
        w = np.uint64(0)
        for i in range(min(lo + h, base + r) - 1, lo - 1, -1):
            w = w * Lu + np.uint64(codes[i])
        t = l0 * Wu + w
        l0 = t & M32
        t = l1 * Wu + (t >> _S32)
        l1 = t & M32
        if b > 64:
            t = l2 * Wu + (t >> _S32)
            l2 = t & M32
            if b > 96:
                l3 = l3 * Wu + (t >> _S32)
    return l0, l1, l2, l3


@_inline
def _put_bits(x, w, acc, nbits, out, o):
    """The ``w <= 32`` low bits of ``x`` appended to the stream: ``acc`` holds its ``nbits < 32``
    pending bits; 32 bits are written to ``out`` from index ``o`` once there are (bytes past its
    end dropped)."""
    acc |= x << np.uint64(nbits)
    nbits += w
    if nbits >= 32:
        if o + 4 <= out.shape[0]:
            out[o] = np.uint8(acc & np.uint64(0xFF))
            out[o + 1] = np.uint8((acc >> np.uint64(8)) & np.uint64(0xFF))
            out[o + 2] = np.uint8((acc >> np.uint64(16)) & np.uint64(0xFF))
            out[o + 3] = np.uint8((acc >> np.uint64(24)) & np.uint64(0xFF))
        else:
            for k in range(4):
                if o + k < out.shape[0]:
                    out[o + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))
        acc >>= _S32
        nbits -= 32
        o += 4
    return acc, nbits, o


@_inline
def _put_limbs(l0, l1, l2, l3, b, acc, nbits, out, o):
    """A ``b``-bit group value (``32 < b <= 128``) appended to the stream, limb by limb."""
    acc, nbits, o = _put_bits(l0, 32, acc, nbits, out, o)
    acc, nbits, o = _put_bits(l1, min(b - 32, 32), acc, nbits, out, o)
    if b > 64:
        acc, nbits, o = _put_bits(l2, min(b - 64, 32), acc, nbits, out, o)
    if b > 96:
        acc, nbits, o = _put_bits(l3, b - 96, acc, nbits, out, o)
    return acc, nbits, o


@_inline
def _get_bits(w, data, acc, nbits, o):
    """The next ``w <= 32`` stream bits: ``acc`` holds ``nbits`` read bits, 32 more are read
    from ``data[o:]`` when they are too few (bytes past its end read as zero)."""
    if nbits < w:
        if o + 4 <= data.shape[0]:
            word = (np.uint64(data[o]) | (np.uint64(data[o + 1]) << np.uint64(8))
                    | (np.uint64(data[o + 2]) << np.uint64(16)) | (np.uint64(data[o + 3]) << np.uint64(24)))
        else:
            word = np.uint64(0)
            for k in range(4):
                if o + k < data.shape[0]:
                    word |= np.uint64(data[o + k]) << np.uint64(8 * k)
        acc |= word << np.uint64(nbits)
        nbits += 32
        o += 4
    x = acc & ((np.uint64(1) << np.uint64(w)) - np.uint64(1))
    return x, acc >> np.uint64(w), nbits - w, o


@_inline
def _get_limbs(b, data, acc, nbits, o):
    """The limbs of the next ``b``-bit group value (``32 < b <= 128``) of the stream."""
    l0, acc, nbits, o = _get_bits(32, data, acc, nbits, o)
    l1, acc, nbits, o = _get_bits(min(b - 32, 32), data, acc, nbits, o)
    l2 = np.uint64(0)
    l3 = np.uint64(0)
    if b > 64:
        l2, acc, nbits, o = _get_bits(min(b - 64, 32), data, acc, nbits, o)
    if b > 96:
        l3, acc, nbits, o = _get_bits(b - 96, data, acc, nbits, o)
    return l0, l1, l2, l3, acc, nbits, o


@_inline
def _split_chunk(w, out, lo, hi, Lu):
    """The digits of ``w`` into ``out[lo:hi]``; returns what is left of ``w`` (0 when they hold it)."""
    for k in range(lo, hi):
        q = w // Lu
        out[k] = w - q * Lu
        w = q
    return w


@_inline
def _wide_digits(l0, l1, l2, l3, out, base, r, b, Lu, h, Wu):
    """The ``r`` digits of the limbs' value (at most ``b`` bits) into ``out[base:base + r]``;
    returns whether the value exceeds ``L^r - 1`` (then the digits are not all of it)."""
    nch = (r - 1) // h + 1
    for ci in range(nch - 1):  # the full chunks, the least significant first: long division by W
        t = np.uint64(0)
        if b > 96:
            t = l3 // Wu
            l3, t = t, l3 - t * Wu
        if b > 64:
            t = (t << _S32) | l2
            q = t // Wu
            l2, t = q, t - q * Wu
        t = (t << _S32) | l1
        q = t // Wu
        l1, t = q, t - q * Wu
        t = (t << _S32) | l0
        q = t // Wu
        l0 = q
        # below W <= 2^32: through uint32, so that the digits' divisions are 32-bit ones
        _split_chunk(np.uint64(np.uint32(t - q * Wu)), out, base + ci * h, base + ci * h + h, Lu)
    # the top chunk: below L^(its digits) <= W, so in l0 alone
    left = _split_chunk(l0, out, base + (nch - 1) * h, base + r, Lu)
    return (left | l1 | l2 | l3) != np.uint64(0)


@_inline
def _pack_wide(codes, L, g, b, h, out):
    n = codes.shape[0]
    Lu = np.uint64(L)
    Wu = _chunk_base(Lu, h)
    acc = np.uint64(0)
    nbits = 0
    o = 0
    full = n // g
    for j in range(full):  # full groups: g a constant in the specialised kernels (loops unroll)
        l0, l1, l2, l3 = _wide_value(codes, j * g, g, b, Lu, h, Wu)
        acc, nbits, o = _put_limbs(l0, l1, l2, l3, b, acc, nbits, out, o)
    if full * g < n:
        l0, l1, l2, l3 = _wide_value(codes, full * g, n - full * g, b, Lu, h, Wu)
        acc, nbits, o = _put_limbs(l0, l1, l2, l3, b, acc, nbits, out, o)
    while nbits > 0:  # the last < 32 bits
        if o < out.shape[0]:
            out[o] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        nbits -= 8
        o += 1


@_inline
def _unpack_wide(data, L, g, b, h, out):
    n = out.shape[0]
    Lu = np.uint64(L)
    Wu = _chunk_base(Lu, h)
    acc = np.uint64(0)
    nbits = 0
    o = 0
    bad = 0
    full = n // g
    for j in range(full):  # full groups: g a constant in the specialised kernels (loops unroll)
        l0, l1, l2, l3, acc, nbits, o = _get_limbs(b, data, acc, nbits, o)
        bad += _wide_digits(l0, l1, l2, l3, out, j * g, g, b, Lu, h, Wu)
    if full * g < n:
        l0, l1, l2, l3, acc, nbits, o = _get_limbs(b, data, acc, nbits, o)
        bad += _wide_digits(l0, l1, l2, l3, out, full * g, n - full * g, b, Lu, h, Wu)
    return bad


@_jit
def pack_radix_wide(codes, L, g, b, h, out):
    """:func:`pack_radix` for groups wider than ``WORD_BITS`` (``h`` digits per chunk)."""
    _pack_wide(codes, L, g, b, h, out)


@_jit
def unpack_radix_wide(data, L, g, b, h, out):
    """:func:`unpack_radix` for groups wider than ``WORD_BITS`` (``h`` digits per chunk)."""
    return _unpack_wide(data, L, g, b, h, out)


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
    if b > WORD_BITS:  # the wide kernels' stream loops with L, g, b, h constants
        H = chunk_digits(L)

        @numba.njit(**opts)
        def pack_blocks(codes, out, blocks):
            _pack_wide(codes[:blocks * 8 * g], L, g, b, H, out)

        @numba.njit(**opts)
        def unpack_wide_blocks(data, out, blocks):
            return _unpack_wide(data, L, g, b, H, out[:blocks * 8 * g])

        return pack_blocks, unpack_wide_blocks
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
            bad += int(unpack_radix_wide(d[blocks * b:], L, g, b, chunk_digits(L), o[blocks * 8 * g:]))
        else:
            bad += int(unpack_radix(d[blocks * b:], L, g, b, o[blocks * 8 * g:]))
    return out, bad
