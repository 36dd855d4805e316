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

from .cpu import _jit

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
            out[i] = np.uint8(v - q * Lu)
            v = q
        bad += v != np.uint64(0)
    return bad


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
    scope = {"np": np}
    exec(compile(_pack_source(L, g, b), f"<radix pack L={L}>", "exec"), scope)  # noqa: S102 (generated above)
    opts = dict(nogil=True, boundscheck=False, error_model="numpy")
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
                    out[base + j * G + k] = np.uint8(v - q * Lu)
                    v = q
        return bad

    return numba.njit(**opts)(scope["pack_blocks"]), unpack_blocks


# --- torch-level API (the same names and signatures as gpu_radix) -----------------------------

def pack(codes: torch.Tensor, L: int, g: int, b: int) -> torch.Tensor:
    """``codes`` (a contiguous uint8 CPU tensor, each < ``L``: the caller's kernel made
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
        pack_radix(c[blocks * 8 * g:], L, g, b, o[blocks * b:])
    return out


def unpack(data: torch.Tensor, L: int, g: int, b: int, n: int) -> tuple[torch.Tensor, int]:
    """``(the n uint8 digits, the number of group values their digits cannot hold)`` of
    ``data`` (exactly the bytes :func:`pack` writes for ``n`` codes: the caller checks)."""
    d = data.contiguous().numpy()
    out = torch.empty(n, dtype=torch.uint8)
    o = out.numpy()
    blocks = n // (8 * g) if n >= SPECIALISE_FROM else 0
    bad = 0
    if blocks:
        bad += int(specialised(L, g, b)[1](d, o, blocks))
    if blocks * 8 * g < n:
        bad += int(unpack_radix(d[blocks * b:], L, g, b, o[blocks * 8 * g:]))
    return out, bad
