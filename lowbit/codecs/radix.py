"""Mixed-radix packing: ``n`` symbols of ``L`` levels (2 <= L <= 2^16) at close to
``log2(L)`` bits each.

Symbols are taken in groups of ``g``; a group's value ``v = sum_k c_k L^k`` (symbol
``k`` of the group is digit ``k``, least significant first) lies in ``[0, L^g)`` and
takes ``b = ceil(g log2 L)`` bits (computed exactly: the bit length of ``L^g - 1``).
The group values are then written with the layout of :mod:`lowbit.codecs.packing`
(one little-endian bit stream, value ``j`` at stream bits ``[j b, (j + 1) b)``), except
that a last partial group of ``r < g`` symbols takes ``b_r = ceil(r log2 L)`` bits (the
bit length of ``L^r - 1``: its value is below ``L^r``; its missing digits are 0). So
``n = q g + r`` symbols take ``ceil((q b + b_r) / 8)`` bytes: never more than plain bit
packing at ``ceil(log2 L)`` bits, since ``h`` digits take ``ceil(h log2 L) <=
h ceil(log2 L)`` bits. (The stream is the one a full-width last group would give, with
its zero top bits cut.)

:func:`radix_group` picks the smallest ``g`` whose ``b / g`` is within 1% of ``log2 L``
(e.g. L = 3: 5 trits in 8 bits, 1.6 bits = 1.0095 x log2 3; L = 5: 3 symbols in 7 bits;
L = 61: 15 symbols in 89 bits). Groups go up to :data:`MAX_GROUP_BITS` = 128 bits, and
every ``L`` in 3..2^16 finds one within 1% there: the widest needed is 113 bits (16,416
levels; 103 bits up to 255 levels, at 242), so the 1% holds for every level count this
module takes. A power of two takes ``g = 1``, ``b = log2 L``: plain bit packing. Groups
of at most :data:`WORD_BITS` = 56 bits are those the former 56-bit cap chose (the same
smallest ``g``), so their bytes are unchanged; the 25 level counts that cap left within
2% only (60, 61, 65, 66, 118-121, 129-134, 232-242) take wider groups now.

Arithmetic: a group value of at most 56 bits is one 64-bit word in the kernels; a wider
one is held as 32-bit limbs (:func:`limbs`; int64 columns in the reference, 64-bit
registers in the kernels): Horner ``v <- v L + c`` with a carry between limbs packs, long
division of the limbs by ``L`` unpacks (the kernels take :func:`chunk_digits` digits at a
time, ``v = sum_i w_i W^i`` with ``W = L^h <= 2^32``: the same value, so the same bytes),
and the stream is written and read limb by limb.

Three implementations with one format: numba kernels (:mod:`.kernels.cpu_radix`, CPU
tensors, the default where numba imports; see :mod:`lowbit.codecs.kernels`), Triton
kernels (:mod:`.kernels.gpu_radix`, CUDA tensors, used by the codecs' fast paths) and
the plain torch reference (any device; forced with ``LOWBIT_CODEC_PATH=reference``).

Codecs call the level-count API at the bottom (:func:`pack_levels`, :func:`levels_nbytes`,
:func:`level_bits`, and their fast-path forms), which routes a power of two, a group of one
code (``g = 1``: 127, 255 or 65,535 levels, say) and more than 2^16 levels to plain bit packing.
"""

from __future__ import annotations

import functools
import math

import torch

from .base import PayloadError
from .kernels import cpu_kernels, fast_backend, kernels_for
from .packing import check_packed, check_wire_bytes, pack_bits, pack_wide, packed_nbytes, unpack_bits, unpack_wide

__all__ = ["LIMB_BITS", "MAX_GROUP_BITS", "MAX_LEVELS", "WORD_BITS", "check_levels_packed", "chunk_digits",
           "level_bits", "level_width", "levels_nbytes", "limbs", "pack_levels", "pack_levels_fast", "pack_radix",
           "radix_applies", "radix_group", "radix_nbytes", "unpack_levels", "unpack_levels_fast", "unpack_radix"]

MAX_LEVELS = 2 ** 16
MAX_GROUP_BITS = 128  # four 32-bit limbs; every L in 3..MAX_LEVELS needs at most 113 bits
LIMB_BITS = 32
WORD_BITS = 56  # groups up to this wide: one 64-bit word in the kernels (the value plus < 8 pending bits)
TOLERANCE = 1.01
_LIMB_MASK = (1 << LIMB_BITS) - 1


def _check_levels(L) -> int:
    if isinstance(L, bool) or not isinstance(L, int) or not 2 <= L <= MAX_LEVELS:
        raise ValueError(f"levels must be an int in 2..{MAX_LEVELS}, got {L!r}")
    return L


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    return n


@functools.cache
def _group(L: int) -> tuple[int, int]:
    target = TOLERANCE * math.log2(L)
    g = 1
    while (b := (L ** g - 1).bit_length()) <= MAX_GROUP_BITS:  # b = ceil(g log2 L), exactly
        if b <= target * g:
            return g, b
        g += 1
    raise AssertionError(f"no group of at most {MAX_GROUP_BITS} bits is within {TOLERANCE} x log2 {L}")


def radix_group(L: int) -> tuple[int, int]:
    """``(g, bits_per_group)`` for ``L`` levels (see the module docstring)."""
    return _group(_check_levels(L))


def radix_nbytes(n: int, L: int) -> int:
    """Bytes taken by ``n = q g + r`` symbols of ``L`` levels: ``ceil((q b + b_r) / 8)``,
    ``b_r`` the bit length of ``L^r - 1`` (0 for ``r = 0``)."""
    g, b = radix_group(L)
    q, r = divmod(_check_n(n), g)
    return (q * b + (L ** r - 1).bit_length() + 7) // 8


def chunk_digits(L: int) -> int:
    """Digits ``h`` of ``L`` levels per 32-bit chunk: the largest ``h`` with ``L^h <= 2^32``.
    The kernels split a wide group value (more than :data:`WORD_BITS` bits) into chunks of
    ``h`` digits, ``v = sum_i w_i W^i`` with ``W = L^h``: Horner and long division over the
    limbs then take one step per chunk, not per digit (the same value, so the same bytes)."""
    h = 1
    while L ** (h + 1) <= 1 << LIMB_BITS:
        h += 1
    return h


def _as_symbols(codes, L: int) -> torch.Tensor:
    """``codes`` flattened to uint8 (int32 above 256 levels), after checking they lie in ``[0, L)``."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    c = codes.reshape(-1)
    if c.dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch has few kernels for these
        c = c.to(torch.int64)
    if c.numel():
        lo, hi = (int(v) for v in torch.aminmax(c))
        if lo < 0 or hi >= L:
            raise ValueError(f"codes must lie in [0, levels) = [0, {L - 1}] for levels={L}, got range [{lo}, {hi}]")
    return c.to(torch.uint8 if L <= 256 else torch.int32)


def _check_data(data, n: int, L: int) -> torch.Tensor:
    return check_wire_bytes(data, radix_nbytes(n, L), f"{n} symbols of {L} levels")


def _fast(x: torch.Tensor):
    return cpu_kernels("radix") if fast_backend(x) == "numba" else None


# --- reference (plain torch, any device) ------------------------------------------------------
#
# A group value is held as limbs(b) 32-bit limbs (int64 columns, least significant first): Horner
# over the digits with a carry between limbs packs, long division of the limbs by L unpacks.

def limbs(b: int) -> int:
    """32-bit limbs that hold a ``b``-bit group value."""
    return -(-b // LIMB_BITS)


def _group_limbs(c: torch.Tensor, L: int, nl: int) -> torch.Tensor:
    """``(m, g)`` digits -> ``(m, nl)`` limbs of the group values ``sum_k c_k L^k``:
    Horner, the most significant digit first, ``v <- v L + c`` carried through the limbs
    (each step stays below ``2^32 L <= 2^48``: int64 holds it)."""
    v = torch.zeros((c.shape[0], nl), dtype=torch.int64, device=c.device)
    for k in range(c.shape[1] - 1, -1, -1):
        carry = c[:, k]
        for i in range(nl):
            t = v[:, i] * L + carry
            v[:, i] = t & _LIMB_MASK
            carry = t >> LIMB_BITS
    return v


def _limb_digits(v: torch.Tensor, L: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the (m, g) digits of the limbs v, a bool (m,) mask of values >= L^g)``: ``g``
    long divisions of the limbs by ``L``, the most significant limb first (the remainder
    below ``L`` shifted up by 32 bits stays below ``2^48``)."""
    v = v.clone()
    digits = torch.empty((v.shape[0], g), dtype=torch.int64, device=v.device)
    for k in range(g):
        rem = torch.zeros(v.shape[0], dtype=torch.int64, device=v.device)
        for i in range(v.shape[1] - 1, -1, -1):
            cur = (rem << LIMB_BITS) | v[:, i]
            v[:, i] = cur // L
            rem = cur - v[:, i] * L
        digits[:, k] = rem
    return digits, (v != 0).any(1)


def _pack_values(v: torch.Tensor, b: int) -> torch.Tensor:
    """Group values (``(m, nl)`` limbs) of ``b`` bits into the packing layout (``pack_wide``
    up to 32 bits, else bit by bit)."""
    if b <= LIMB_BITS:
        return pack_wide(v[:, 0], b)
    shifts = torch.arange(LIMB_BITS, device=v.device)
    bits = ((v.unsqueeze(2) >> shifts) & 1).view(v.shape[0], -1)[:, :b]
    return pack_bits(bits.reshape(-1), 1)


def _unpack_values(data: torch.Tensor, b: int, m: int) -> torch.Tensor:
    """Inverse of :func:`_pack_values`: the ``(m, limbs(b))`` limbs of ``m`` group values."""
    if b <= LIMB_BITS:
        return unpack_wide(data[:packed_nbytes(m, b)], b, m).unsqueeze(1)
    nl = limbs(b)
    bits = unpack_bits(data[:packed_nbytes(m * b, 1)], 1, m * b).view(m, b)
    bits = torch.nn.functional.pad(bits, (0, nl * LIMB_BITS - b)).view(m, nl, LIMB_BITS)
    return (bits << torch.arange(LIMB_BITS, device=data.device)).sum(2)


def pack_radix_reference(codes: torch.Tensor, L: int) -> torch.Tensor:
    """The torch reference of :func:`pack_radix`."""
    L = _check_levels(L)
    g, b = radix_group(L)
    c = _as_symbols(codes, L).to(torch.int64)
    n = c.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=c.device)
    m = -(-n // g)
    c = torch.nn.functional.pad(c, (0, m * g - n)).view(m, g)
    # the last group's bits above b_r are zero: cut to radix_nbytes
    return _pack_values(_group_limbs(c, L, limbs(b)), b)[:radix_nbytes(n, L)]


def unpack_radix_reference(data: torch.Tensor, L: int, n: int, codec: str | None = None) -> torch.Tensor:
    """The torch reference of :func:`unpack_radix`."""
    L, n = _check_levels(L), _check_n(n)
    g, b = radix_group(L)
    data = _check_data(data, n, L)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    m = -(-n // g)
    v = _unpack_values(torch.nn.functional.pad(data, (0, (m * b + 7) // 8 - data.numel())), b, m)
    digits, over = _limb_digits(v, L, g)
    # a value must fit its group's digits: < L^g, and < L^r for a last group of r symbols
    r = n - (m - 1) * g
    over[-1] |= bool((digits[-1, r:] != 0).any())
    _raise_bad(int(over.sum()), L, m, codec)
    return digits.view(-1)[:n]


def _raise_bad(bad: int, L: int, m: int, codec: str | None = None) -> None:
    """A PayloadError (naming ``codec``, else the packing) when ``bad`` of the ``m`` group values
    exceed what their digits can hold: not the output of a radix-``L`` packing."""
    if bad:
        name = codec or f"radix-{L}"
        raise PayloadError(name, f"a radix-{L} packing", f"{bad} group values beyond their digits",
                           f"malformed {name} payload: the packed data is not a radix-{L} packing: {bad} of its "
                           f"{m} group values exceed what their digits can hold")


# --- public API --------------------------------------------------------------------------------

def pack_radix(codes: torch.Tensor, L: int) -> torch.Tensor:
    """Pack integer ``codes`` in ``[0, L)`` (any shape, flattened) into
    :func:`radix_nbytes` ``(codes.numel(), L)`` bytes (a uint8 tensor on their device)."""
    k = _fast(codes) if isinstance(codes, torch.Tensor) else None
    if k is None:
        return pack_radix_reference(codes, L)
    L = _check_levels(L)
    return k.pack(_as_symbols(codes, L).contiguous(), L, *radix_group(L))


def unpack_radix(data: torch.Tensor, L: int, n: int, codec: str | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_radix`: the ``n`` codes, as an int64 tensor. Raises
    ValueError when ``data`` is not ``radix_nbytes(n, L)`` bytes, and a PayloadError (naming
    ``codec`` when given) when it holds a group value that its digits cannot hold (so not the
    output of :func:`pack_radix`)."""
    k = _fast(data) if isinstance(data, torch.Tensor) else None
    if k is None:
        return unpack_radix_reference(data, L, n, codec)
    L, n = _check_levels(L), _check_n(n)
    g, b = radix_group(L)
    out, bad = k.unpack(_check_data(data, n, L), L, g, b, n, torch.int64)
    _raise_bad(bad, L, -(-n // g), codec)
    return out


# --- codes of L levels, whatever L: what the codecs call -----------------------------------------
#
# L <= MAX_LEVELS = 2^16 levels, not a power of two, g > 1: mixed radix (above). A power of two, or
# g = 1: plain bit packing at b = ceil(log2 L) bits (radix_group gives g = 1 there, so the two formats
# are one). More than 2^16 levels: plain bit packing at ceil(log2 L) bits (< 1/16 over log2 L).


def radix_applies(L: int) -> bool:
    """Mixed radix saves bits: not a power of two, at most :data:`MAX_LEVELS` levels, and groups of
    more than one code (``g = 1``, e.g. 127 or 255 levels, is plain packing at ``b`` bits: the core's
    kernels)."""
    return L <= MAX_LEVELS and L & (L - 1) != 0 and radix_group(L)[0] > 1


def _check_any_levels(L) -> int:
    if isinstance(L, bool) or not isinstance(L, int) or not 2 <= L <= 2 ** 32:
        raise ValueError(f"levels must be an int in 2..2^32, got {L!r}")
    return L


def level_width(L: int) -> int:
    """Bits per code in plain packing of ``L`` levels: ``ceil(log2 L)``."""
    return (L - 1).bit_length()


def level_bits(L: int) -> float:
    """Bits per element that codes of ``L`` levels take on the wire (for long vectors):
    ``b / g`` in mixed radix (e.g. 1.6 for L = 3), ``ceil(log2 L)`` otherwise. The
    codecs' ``bits`` (the nominal bits of a run's summary) is this count."""
    L = _check_any_levels(L)
    if radix_applies(L):
        g, b = radix_group(L)
        return b / g
    return float(level_width(L))


def levels_nbytes(n: int, L: int) -> int:
    """Bytes taken by ``n`` codes of ``L`` levels (:func:`radix_nbytes` where mixed radix
    applies, else ``ceil(n ceil(log2 L) / 8)``)."""
    L = _check_any_levels(L)
    return radix_nbytes(n, L) if radix_applies(L) else packed_nbytes(_check_n(n), level_width(L))


def check_levels_packed(data: torch.Tensor, L: int, n: int) -> torch.Tensor:
    """``data`` is a 1-D uint8 tensor of exactly :func:`levels_nbytes` ``(n, L)`` bytes
    (TypeError / ValueError otherwise)."""
    L = _check_any_levels(L)
    return _check_data(data, n, L) if radix_applies(L) else check_packed(data, level_width(L), n)


def pack_levels(codes: torch.Tensor, L: int) -> torch.Tensor:
    """The reference packing of integer ``codes`` in ``[0, L)``: :func:`pack_radix_reference`
    where mixed radix applies, else :func:`~lowbit.codecs.packing.pack_wide` at ``ceil(log2 L)``
    bits. ValueError for codes outside ``[0, L)`` (outside ``[0, 2^ceil(log2 L))`` where plain packing applies)."""
    L = _check_any_levels(L)
    return pack_radix_reference(codes, L) if radix_applies(L) else pack_wide(codes, level_width(L))


def unpack_levels(data: torch.Tensor, L: int, n: int, codec: str | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_levels` (int64 codes); ``codec`` names the codec in a PayloadError."""
    L = _check_any_levels(L)
    return unpack_radix_reference(data, L, n, codec) if radix_applies(L) else unpack_wide(data, level_width(L), n)


def pack_levels_fast(codes: torch.Tensor, L: int) -> torch.Tensor:
    """The fast path's :func:`pack_levels` for codes a fast-path kernel made (uint8 up to 256
    levels, a wider integer dtype above; trusted to lie in ``[0, L)``): numba on the CPU, Triton
    on CUDA, the same bytes."""
    if radix_applies(L):
        return kernels_for(codes, "radix").pack(codes, L, *radix_group(L))
    return kernels_for(codes).pack(codes, level_width(L))


def unpack_levels_fast(data: torch.Tensor, L: int, n: int, dtype: torch.dtype = torch.uint8,
                       codec: str | None = None) -> torch.Tensor:
    """The fast path's :func:`unpack_levels`: the ``n`` codes as ``dtype`` (a dtype that holds
    ``L - 1``). ``data`` must be exactly :func:`levels_nbytes` bytes (ValueError otherwise, before
    any kernel runs; a PayloadError naming ``codec`` for group values that their digits cannot hold)."""
    data = check_levels_packed(data, L, n)
    if not radix_applies(L):
        return kernels_for(data).unpack(data, level_width(L), n, dtype)
    g, b = radix_group(L)
    out, bad = kernels_for(data, "radix").unpack(data, L, g, b, n, dtype)
    _raise_bad(int(bad), L, -(-n // g), codec)
    return out
