"""Mixed-radix packing (lowbit.codecs.radix): group choice, exact byte counts,
round trips for every level count, the numba kernel against the torch reference,
and bad input."""

import math

import pytest
import torch

from lowbit.codecs.kernels import codec_path, cpu_kernels
from lowbit.codecs.packing import pack_wide, packed_nbytes
from lowbit.codecs.radix import (MAX_GROUP_BITS, level_bits, levels_nbytes, pack_levels, pack_levels_fast, pack_radix,
                                 pack_radix_reference, radix_group, radix_nbytes, unpack_levels, unpack_levels_fast,
                                 unpack_radix, unpack_radix_reference)

ALL_LEVELS = range(2, 256)
needs_numba = pytest.mark.skipif(cpu_kernels("radix") is None, reason="numba not installed")


def _bits_per_symbol(L):
    g, b = radix_group(L)
    return b / g


def test_group_examples():
    assert radix_group(3) == (5, 8)  # 5 trits per byte: 1.6 bits = 1.0095 x log2 3
    assert radix_group(5) == (3, 7)  # 3 quinary symbols in 7 bits
    for p in range(1, 8):  # powers of two: plain bit packing
        assert radix_group(2 ** p) == (1, p)
    assert _bits_per_symbol(3) / math.log2(3) == pytest.approx(1.6 / math.log2(3))


@pytest.mark.parametrize("L", ALL_LEVELS)
def test_group_is_exact_and_best(L):
    g, b = radix_group(L)
    assert L ** g <= 2 ** b < 2 * L ** g  # b = ceil(g log2 L), exactly
    assert b <= MAX_GROUP_BITS
    widths = {h: (L ** h - 1).bit_length() for h in range(1, MAX_GROUP_BITS + 1)}
    fits = {h: w for h, w in widths.items() if w <= MAX_GROUP_BITS}
    within = [h for h, w in fits.items() if w <= 1.01 * math.log2(L) * h]
    if within:  # the smallest group within 1% of log2 L
        assert g == min(within)
    else:  # none: the fewest bits per symbol
        assert b / g == min(w / h for h, w in fits.items())


def test_one_percent_reached_for_the_codecs_level_counts():
    for L in [3, 5, 7, 9, 11, 13, 15, 17, 31, 33, 63, 67, 127, 255]:  # 2s+1 levels of the codecs, and more
        assert _bits_per_symbol(L) <= 1.01 * math.log2(L), L
    missed = [L for L in ALL_LEVELS if _bits_per_symbol(L) > 1.01 * math.log2(L)]
    assert len(missed) == 25 and {60, 61, 119, 120, 121, 232, 242} <= set(missed)  # just below a power of two
    assert max(_bits_per_symbol(L) / math.log2(L) for L in missed) < 1.02


@pytest.mark.parametrize("L", [3, 5, 17, 60, 129])
def test_exact_byte_counts(L):
    g, b = radix_group(L)
    for n in (0, 1, g - 1, g, g + 1, 7 * g + 3, 100_001):
        q, r = divmod(n, g)
        last = math.ceil(r * math.log2(L)) if r else 0  # a last partial group of r digits
        assert radix_nbytes(n, L) == math.ceil((q * b + last) / 8)
        assert radix_nbytes(n, L) <= packed_nbytes(n, math.ceil(math.log2(L)))  # never above plain packing
        c = torch.randint(0, L, (n,))
        assert pack_radix(c, L).numel() == radix_nbytes(n, L)
    assert radix_nbytes(100_000, 3) == 20_000  # 1.6 bits per trit
    if _bits_per_symbol(L) <= 1.01 * math.log2(L):
        assert 8 * radix_nbytes(100_000, L) / 100_000 <= 1.01 * math.log2(L)


def _symbols(L, n, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, L, (n,), generator=g)
    c[:min(n, 3)] = L - 1  # the largest group value
    c[-1:] = 0
    return c


@pytest.mark.parametrize("L", ALL_LEVELS)
def test_round_trip_every_level_count(L):
    g, _ = radix_group(L)
    for n in sorted({1, 2, g - 1 or 1, g + 1, 3 * g + 2, 1001}):
        c = _symbols(L, n, seed=L * 7919 + n)
        data = pack_radix(c, L)
        assert data.dtype == torch.uint8 and data.numel() == radix_nbytes(n, L)
        assert torch.equal(unpack_radix(data, L, n), c), n
        ref = pack_radix_reference(c, L)
        assert torch.equal(ref, data), n  # the kernel's bytes are the reference's
        assert torch.equal(unpack_radix_reference(data, L, n), c), n


def test_all_maximal_symbols_and_shapes():
    for L in (3, 5, 7, 129, 255):
        c = torch.full((4, 5, 3), L - 1, dtype=torch.int32)
        assert torch.equal(unpack_radix(pack_radix(c, L), L, 60), c.reshape(-1).long())
        c8 = torch.full((37,), L - 1, dtype=torch.uint8)
        assert torch.equal(unpack_radix(pack_radix(c8, L), L, 37), c8.long())


@needs_numba
def test_kernel_matches_reference_large():
    for L in (3, 5, 9, 65, 129):
        c = torch.randint(0, L, (200_003,))
        fast = pack_radix(c, L)
        with codec_path("reference"):
            ref = pack_radix(c, L)
            assert torch.equal(unpack_radix(fast, L, c.numel()), c)
        assert torch.equal(fast, ref)
        assert torch.equal(unpack_radix(ref, L, c.numel()), c)


def test_empty():
    for L in (3, 200):
        assert pack_radix(torch.empty(0, dtype=torch.int64), L).numel() == 0
        assert unpack_radix(torch.empty(0, dtype=torch.uint8), L, 0).numel() == 0


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_bad_input(path):
    with codec_path(path):
        for bad in (1, 0, -3, 256, 1000, 3.0, True, "3"):
            with pytest.raises(ValueError, match="levels must be an int in 2..255"):
                pack_radix(torch.zeros(4, dtype=torch.int64), bad)
            with pytest.raises(ValueError, match="levels must be an int in 2..255"):
                unpack_radix(torch.zeros(1, dtype=torch.uint8), bad, 4)
        with pytest.raises(ValueError, match=r"codes must lie in \[0, levels\) = \[0, 2\] for levels=3, got range \[0, 3\]"):
            pack_radix(torch.tensor([0, 1, 3]), 3)
        with pytest.raises(ValueError, match=r"got range \[-1, 1\]"):
            pack_radix(torch.tensor([-1, 1]), 3)
        with pytest.raises(TypeError, match="integer tensor"):
            pack_radix(torch.tensor([0.0, 1.0]), 3)
        with pytest.raises(TypeError, match="torch.Tensor"):
            pack_radix([0, 1], 3)
        with pytest.raises(ValueError, match="7 symbols of 3 levels need exactly 2 bytes, got 3"):
            unpack_radix(torch.zeros(3, dtype=torch.uint8), 3, 7)
        with pytest.raises(ValueError, match="exactly 2 bytes, got 1"):
            unpack_radix(torch.zeros(1, dtype=torch.uint8), 3, 7)
        with pytest.raises(TypeError, match="1-D uint8"):
            unpack_radix(torch.zeros(2, dtype=torch.int64), 3, 7)
        with pytest.raises(ValueError, match="n must be a non-negative int"):
            unpack_radix(torch.zeros(2, dtype=torch.uint8), 3, -1)
        # group values that no 5 trits make (243..255), and a last group of 1 trit holding 5
        with pytest.raises(ValueError, match="not a radix-3 packing: 1 of its 1 group values"):
            unpack_radix(torch.tensor([250], dtype=torch.uint8), 3, 5)
        with pytest.raises(ValueError, match="1 of its 2 group values"):
            unpack_radix(torch.tensor([0, 5], dtype=torch.uint8), 3, 6)
        with pytest.raises(ValueError, match="not a radix-129 packing"):  # 50-bit groups
            unpack_radix(torch.full((radix_nbytes(7, 129),), 255, dtype=torch.uint8), 129, 7)


@needs_numba
@pytest.mark.parametrize("L", [3, 5, 6, 7, 9, 15, 60, 100, 129, 255])
def test_specialised_kernels_match_reference(L, monkeypatch):
    """The per-level-count numba kernels (blocks of 8 groups, then the run-time kernel for
    the tail) give the reference's bytes, and refuse a group value above L^g - 1."""
    monkeypatch.setattr(cpu_kernels("radix"), "SPECIALISE_FROM", 0)
    g, _ = radix_group(L)
    for n in (8 * g, 8 * g + 1, 16 * g + g - 1, 24 * g + 5, 5001):
        c = _symbols(L, n, seed=L + n)
        data = pack_radix(c, L)
        assert torch.equal(data, pack_radix_reference(c, L)), n
        assert torch.equal(unpack_radix(data, L, n), c), n
    if L ** g < 2 ** radix_group(L)[1]:
        bad = torch.full((radix_nbytes(8 * g, L),), 255, dtype=torch.uint8)
        with pytest.raises(ValueError, match=f"not a radix-{L} packing: 8 of its 8 group values"):
            unpack_radix(bad, L, 8 * g)


@pytest.mark.parametrize("L", [2, 3, 4, 5, 16, 17, 255, 256, 257, 401, 2 ** 20 + 1])
def test_levels_api_routes_by_level_count(L):
    """Mixed radix for non-powers of two up to 255, plain packing at ceil(log2 L) bits
    otherwise; level_bits is the bits per element of long vectors."""
    width = math.ceil(math.log2(L))
    plain = L & (L - 1) == 0 or L > 255
    g, b = radix_group(L) if L <= 255 else (1, width)
    assert level_bits(L) == (float(width) if plain else b / g)
    n = 1003
    c = torch.randint(0, L, (n,))
    c[0] = L - 1
    data = pack_levels(c, L)
    assert data.numel() == levels_nbytes(n, L) == (packed_nbytes(n, width) if plain else radix_nbytes(n, L))
    if plain:
        assert torch.equal(data, pack_wide(c, width))  # today's packing, exactly
    assert torch.equal(unpack_levels(data, L, n), c)
    if L <= 255:  # the fast path's codes are uint8 below 256 levels
        fast = pack_levels_fast(c.to(torch.uint8), L)
        assert torch.equal(fast, data)
        assert torch.equal(unpack_levels_fast(fast, L, n), c.to(torch.uint8))
    assert 8 * levels_nbytes(100_000, L) / 100_000 <= level_bits(L) + 1e-3
    with pytest.raises(ValueError, match="exactly"):
        unpack_levels_fast(data[:-1], L, n)


def test_levels_api_bad_level_counts():
    for bad in (1, 0, 2 ** 32 + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"levels must be an int in 2..2\^32"):
            level_bits(bad)
        with pytest.raises(ValueError, match=r"levels must be an int in 2..2\^32"):
            levels_nbytes(4, bad)
