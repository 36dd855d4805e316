"""Summable lanes: the integer codes of ``n`` workers packed into int64 words that one
ordinary SUM all-reduce (gloo or NCCL) adds exactly, every lane at once.

A summable codec's codes lie in ``[-s, s]`` (``s = max_code``); the sum of ``n``
workers' codes lies in ``[-n s, n s]``, ``R = 2 n s + 1`` values. A word holds ``k``
codes ``c_0..c_{k-1}`` as balanced radix-``R`` digits::

    V = sum_i c_i R^i,   |c_i| <= s,   k = the largest k with R^k < 2^64

(the codes offset by ``s`` are plain radix-``R`` digits in ``[0, 2s]``; the word then is
that offset word minus ``s (R^k - 1) / (R - 1)``, centred on zero so that the int64 sign
bit is used and no sum ever overflows it). The SUM of the ``n`` workers' words is
``sum_i C_i R^i`` with ``C_i = sum_m c_{m,i}`` in ``[-n s, n s] = [-h, h]``, ``h = (R - 1) / 2``:
balanced digits, so no lane carries into the next and every ``C_i`` is read back
exactly (the no-carry bound, derived in docs/CODECS.md, "Summable lanes"). Any
partial sum of ``j <= n`` workers' words (a ring's, a tree's, in any order) is at most
``j s (R^k - 1) / (R - 1) <= (R^k - 1) / 2 <= 2^63 - 1`` in magnitude: it never
overflows int64, on either backend.

Layout: ``n`` codes take ``m = ceil(n / k)`` words, code ``t`` is digit ``t // m`` of word
``t mod m`` (the codes as a ``k x m`` table, row ``i`` the digits ``i`` of all words:
every step of the kernels is a loop over contiguous memory); the digits past the last
code are 0.

A lane is ``log2 R`` bits wide, not rounded up to a whole bit: ``64 / k`` bits per
element, e.g. ternary codes (``s = 1``, codec ``bits = 2``) of 2/4/8/16 workers take
2.37/3.2/4.27/5.33 bits (an int8 sum takes 8). :meth:`Lanes.pays` says whether the lanes
send fewer bits than a plain integer dtype; :meth:`~lowbit.codecs.base.SummableCodec.sum_wire`
picks between them.

Three implementations with one format: numba kernels on the CPU
(:mod:`lowbit.codecs.kernels.cpu_lanes`, the default where numba compiles for this CPU),
and the plain torch reference (:func:`pack_lanes_reference`,
:func:`unpack_lanes_reference`: whole-tensor integer ops, any device, CUDA included;
forced with ``LOWBIT_CODEC_PATH=reference``). Both give the same words and sums.

Hostile sums: a word outside ``[-(R^k - 1) / 2, (R^k - 1) / 2]``, or a last word whose
digits past the codes are not zero, cannot be a sum of ``n`` valid words (some peer sent
codes outside ``[-s, s]``); :meth:`Lanes.unpack` raises a ValueError saying so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .kernels import cpu_kernels, fast_backend

__all__ = ["WORD_BITS", "Lanes", "pack_lanes_reference", "unpack_lanes_reference"]

WORD_BITS = 64  #: the words are int64: gloo and NCCL add int64 exactly
_INT64_MAX = (1 << 63) - 1
_SUM_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _check_int(v, name: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


@functools.cache
def _per_word(radix: int) -> int:
    """The largest ``k`` with ``radix^k < 2^64`` (exact integer arithmetic)."""
    k, p = 0, 1
    while p * radix < (1 << WORD_BITS):
        p *= radix
        k += 1
    return k


@functools.lru_cache(maxsize=64)
def _powers(radix: int, k: int, device: torch.device) -> torch.Tensor:
    """``radix^0 .. radix^(k-1)`` as int64 on ``device`` (each below 2^63). Read only."""
    return torch.tensor([radix ** i for i in range(k)], dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Lanes:
    """The lane layout of codes in ``[-max_code, max_code]`` summed over ``world_size``
    workers: ``radix = 2 world_size max_code + 1``, ``per_word`` codes per int64 word
    (the largest ``k`` with ``radix^k < 2^64``). ValueError when ``radix`` does not fit an
    int64 (``radix > 2^63 - 1``)."""

    max_code: int
    world_size: int

    def __post_init__(self) -> None:
        _check_int(self.max_code, "max_code", 1)
        _check_int(self.world_size, "world_size", 1)
        if self.radix > _INT64_MAX:
            raise ValueError(f"max_code={self.max_code} summed over world_size={self.world_size} takes "
                             f"{self.radix} values per lane, more than an int64 word holds (2^63 - 1); use fewer "
                             "bits or workers")

    @property
    def radix(self) -> int:
        """``R = 2 n s + 1``: the values a lane's sum can take, ``-n s .. n s``."""
        return 2 * self.world_size * self.max_code + 1

    @property
    def per_word(self) -> int:
        """``k``: codes per int64 word, the largest ``k`` with ``R^k < 2^64``."""
        return _per_word(self.radix)

    @property
    def half_range(self) -> int:
        """``(R^k - 1) / 2``: the largest ``|word|`` of a valid sum (at most ``2^63 - 1``)."""
        return (self.radix ** self.per_word - 1) // 2

    @property
    def bits_per_element(self) -> float:
        """``64 / k``: bits per code in the all-reduce buffer (a last partial word aside)."""
        return WORD_BITS / self.per_word

    @property
    def sum_dtype(self) -> torch.dtype:
        """The narrowest signed integer dtype holding the sums ``-n s .. n s``."""
        need = self.world_size * self.max_code
        return next(d for d in _SUM_DTYPES if need <= torch.iinfo(d).max)

    def words(self, numel: int) -> int:
        """Words for ``numel`` codes: ``ceil(numel / k)``."""
        return -(-_check_int(numel, "numel", 0) // self.per_word)

    def nbytes(self, numel: int) -> int:
        """Bytes of the all-reduce buffer for ``numel`` codes (what the ledger counts)."""
        return 8 * self.words(numel)

    @property
    def code_dtype(self) -> torch.dtype:
        """The narrowest signed integer dtype holding one worker's codes ``-s .. s``."""
        return next(d for d in _SUM_DTYPES if self.max_code <= torch.iinfo(d).max)

    def pays(self, dtype: torch.dtype, numel: int | None = None) -> bool:
        """Whether the lanes send fewer bytes than a plain sum in ``dtype``: for ``numel``
        codes, :meth:`nbytes` below ``numel`` elements of ``dtype`` (a last partial word
        counted whole); without ``numel``, per element (``64 / k`` below ``dtype``'s width)."""
        if numel is None:
            return self.per_word * torch.iinfo(dtype).bits > WORD_BITS
        return self.nbytes(numel) < numel * torch.iinfo(dtype).bits // 8

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """The int64 words of ``codes`` (a 1-D integer tensor of values in ``[-s, s]``: this
        worker's own codes, trusted; a code outside gives words that :meth:`unpack` refuses
        after the sum), in the module's layout (digits past the last code are 0)."""
        _check_codes(codes)
        K = _kernels(codes)
        if K is None:
            return pack_lanes_reference(codes, self)
        return K.pack(codes, self.radix, self.per_word)

    def unpack(self, words: torch.Tensor, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``numel`` lane sums held by ``words`` (the SUM of the workers' :meth:`pack`
        outputs), as ``dtype`` (default :attr:`sum_dtype`; one holding ``n s``). ValueError
        when ``words`` is not of ``words(numel)`` int64s, or cannot be a sum of valid words."""
        dtype = self._out_dtype(dtype)
        if not isinstance(words, torch.Tensor) or words.dtype != torch.int64 or words.dim() != 1 \
                or words.numel() != self.words(numel):
            desc = f"{words.dtype} {tuple(words.shape)}" if isinstance(words, torch.Tensor) else type(words).__name__
            raise ValueError(f"words must be a 1-D int64 tensor of {self.words(numel)} words for numel={numel}, "
                             f"got {desc}")
        K = _kernels(words)
        if K is None:
            return unpack_lanes_reference(words, self, numel, dtype)
        out, bad = K.unpack(words, self.radix, self.per_word, numel, dtype)
        if bad:
            raise self._bad_sum(bad)
        return out

    def _out_dtype(self, dtype) -> torch.dtype:
        if dtype is None:
            return self.sum_dtype
        if dtype not in _SUM_DTYPES or torch.iinfo(dtype).max < self.world_size * self.max_code:
            raise ValueError(f"dtype must be a signed integer dtype holding sums up to "
                             f"{self.world_size * self.max_code}, got {dtype!r}")
        return dtype

    def _bad_sum(self, bad: int) -> ValueError:
        return ValueError(f"{bad} summed word(s) cannot be the sum of {self.world_size} workers' lanes of codes in "
                          f"[-{self.max_code}, {self.max_code}] (a word beyond +-{self.half_range}, or a nonzero "
                          "digit past the codes): some worker sent codes out of range")


def _check_codes(codes) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dim() != 1 or codes.is_floating_point() \
            or codes.is_complex() or codes.dtype in (torch.bool, torch.uint8):
        desc = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise ValueError(f"codes must be a 1-D signed integer tensor, got {desc}")


def _kernels(t: torch.Tensor):
    """The numba lane kernels for a CPU tensor on the fast path, else None (the reference)."""
    return cpu_kernels("lanes") if fast_backend(t) == "numba" else None


def pack_lanes_reference(codes: torch.Tensor, lanes: Lanes) -> torch.Tensor:
    """:meth:`Lanes.pack` in whole-tensor torch ops (any device): the codes padded with
    zeros to ``k m`` as a ``k x m`` table (row ``i``: digit ``i`` of every word), each
    column's dot product with ``R^0..R^(k-1)`` in int64 (every partial sum at most
    ``s (R^k - 1) / (R - 1) < 2^63``: exact)."""
    _check_codes(codes)
    n, k = codes.numel(), lanes.per_word
    m = lanes.words(n)
    c = torch.zeros(m * k, dtype=torch.int64, device=codes.device)
    c[:n] = codes
    return (c.view(k, m) * _powers(lanes.radix, k, codes.device).view(k, 1)).sum(0)


def unpack_lanes_reference(words: torch.Tensor, lanes: Lanes, numel: int,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
    """:meth:`Lanes.unpack` in whole-tensor torch ops (any device). ``T_i = round(V / R^i)``
    (a floor division and a comparison of the remainder with ``(R^i - 1) / 2``; no sum
    overflows) is ``sum_{j >= i} C_j R^(j - i)``, so ``C_i = T_i - R T_{i+1}``."""
    dtype = lanes._out_dtype(dtype)
    R, k = lanes.radix, lanes.per_word
    if words.dtype != torch.int64 or words.dim() != 1 or words.numel() != lanes.words(numel):
        raise ValueError(f"words must be a 1-D int64 tensor of {lanes.words(numel)} words for numel={numel}, "
                         f"got {words.dtype} {tuple(words.shape)}")
    lim = lanes.half_range
    P = _powers(R, k, words.device).view(k, 1)
    V = words.view(1, -1)
    q = torch.div(V, P, rounding_mode="floor")
    T = q + ((V - q * P) > (P - 1) // 2).to(torch.int64)  # row i: T_i of every word
    C = T.clone()
    C[:-1] -= R * T[1:]
    C = C.reshape(-1)  # code t = i m + j: digit i of word j
    bad = int(((words > lim) | (words < -lim)).sum() + (C[numel:] != 0).sum())  # one read (on CUDA: one sync)
    if bad:
        raise lanes._bad_sum(bad)
    return C[:numel].to(dtype)
