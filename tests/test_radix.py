"""Mixed-radix packing (lowbit.codecs.radix): group choice (within 1% of log2 L for every
level count up to 2^16, groups up to 128 bits), exact byte counts, round trips for every
level count up to 255 and a sample above, the numba kernels against the torch reference,
the reference against a plain Python-int model of the format, and bad input."""

import math

import pytest
import torch

from lowbit.codecs.kernels import codec_path, cpu_kernels
from lowbit.codecs.packing import pack_wide, packed_nbytes
from lowbit.codecs.radix import (MAX_GROUP_BITS, MAX_LEVELS, WORD_BITS, level_bits, levels_nbytes, pack_levels,
                                 pack_levels_fast, pack_radix, pack_radix_reference, radix_group, radix_nbytes,
                                 unpack_levels, unpack_levels_fast, unpack_radix, unpack_radix_reference)

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels

ALL_LEVELS = range(2, 256)
# above 255 levels: around powers of two, the widest group (16416 levels: 113 bits), the top of the range
LARGE_LEVELS = [256, 257, 300, 511, 1000, 1061, 4095, 4097, 16416, 40000, 65535, 65536]
# the level counts that groups of at most 56 bits (a 64-bit word) left above 1% of log2 L
GAP_LEVELS = [60, 61, 65, 66, *range(118, 122), *range(129, 135), *range(232, 243)]
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


def _smallest_group_within(L, bits_cap):
    """The smallest g whose b = bitlen(L^g - 1) <= bits_cap is within 1% of log2 L (None if none)."""
    for g in range(1, bits_cap + 1):
        b = (L ** g - 1).bit_length()
        if b > bits_cap:
            return None
        if b <= 1.01 * math.log2(L) * g:
            return g
    return None


@pytest.mark.parametrize("L", ALL_LEVELS)
def test_group_is_exact_and_the_smallest_within_one_percent(L):
    g, b = radix_group(L)
    assert L ** g <= 2 ** b < 2 * L ** g  # b = ceil(g log2 L), exactly
    assert b <= MAX_GROUP_BITS == 128
    assert b <= 1.01 * math.log2(L) * g
    assert g == _smallest_group_within(L, MAX_GROUP_BITS)
    # groups that fit a 64-bit word are today's (the 56-bit cap's), so their bytes are too
    word_g = _smallest_group_within(L, WORD_BITS)
    assert (b <= WORD_BITS) == (word_g is not None)
    if word_g is not None:
        assert g == word_g


def test_one_percent_for_every_level_count_up_to_the_cap():
    """b / g <= 1.01 log2 L for every L in 3..2^16 (powers of two: exactly log2 L), with groups of
    at most 113 bits (so 128, four 32-bit limbs, is the cap)."""
    widest = 0
    for L in range(3, MAX_LEVELS + 1):
        g, b = radix_group(L)
        assert b <= 1.01 * math.log2(L) * g, L
        widest = max(widest, b)
    assert widest == 113 == radix_group(16416)[1]
    assert max(radix_group(L)[1] for L in ALL_LEVELS) == 103 == radix_group(242)[1]


def test_gap_level_counts_take_wide_groups():
    """The 25 level counts that 56-bit groups left within 2% (not 1%) of log2 L."""
    for L in GAP_LEVELS:
        g, b = radix_group(L)
        assert b > WORD_BITS and _smallest_group_within(L, WORD_BITS) is None, L
        assert b / g <= 1.01 * math.log2(L)
    assert radix_group(61) == (15, 89) and radix_group(121) == (13, 90) and radix_group(242) == (13, 103)
    assert len(GAP_LEVELS) == 25


def _model_bytes(c, L):
    """The format with Python ints: group j's value sum_k c_k L^k at stream bit j b, the last
    partial group's top bits cut (an independent model of the reference)."""
    g, b = radix_group(L)
    n = len(c)
    stream = 0
    for j in range(0, n, g):
        stream |= sum(int(d) * L ** k for k, d in enumerate(c[j:j + g])) << (j // g * b)
    return torch.tensor(list(stream.to_bytes(radix_nbytes(n, L), "little")), dtype=torch.uint8)


@pytest.mark.parametrize("L", [3, 5, 7, 61, 66, 121, 129, 242, 255, 300, 16416, 65535])
def test_reference_is_the_python_int_model(L):
    g, _ = radix_group(L)
    for n in (1, g - 1 or 1, g, 2 * g + 1, 8 * g + 5):
        c = _symbols(L, n, seed=L + 13 * n)
        assert torch.equal(pack_radix_reference(c, L), _model_bytes(c.tolist(), L)), n
    assert torch.equal(pack_radix_reference(torch.full((g,), L - 1), L),  # the largest group value, L^g - 1
                       torch.tensor(list((L ** g - 1).to_bytes(radix_nbytes(g, L), "little")), dtype=torch.uint8))


@pytest.mark.parametrize("L", [3, 5, 17, 60, 129, 242, 1061, 16416])
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
    assert 8 * radix_nbytes(100_000, L) / 100_000 <= 1.01 * math.log2(L)


def _symbols(L, n, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, L, (n,), generator=g)
    c[:min(n, 3 * radix_group(L)[0])] = L - 1  # the largest group values
    c[-1:] = 0
    return c


@pytest.mark.parametrize("L", [*ALL_LEVELS, *LARGE_LEVELS])
def test_round_trip_every_level_count(L):
    g, _ = radix_group(L)
    for n in sorted({0, 1, 2, max(g - 1, 1), g, g + 1, 3 * g + 2, 1007}):
        c = _symbols(L, n, seed=L * 7919 + n)
        data = pack_radix(c, L)
        assert data.dtype == torch.uint8 and data.numel() == radix_nbytes(n, L)
        assert torch.equal(unpack_radix(data, L, n), c), n
        ref = pack_radix_reference(c, L)
        assert torch.equal(ref, data), n  # the kernel's bytes are the reference's
        assert torch.equal(unpack_radix_reference(data, L, n), c), n


def test_all_maximal_symbols_and_shapes():
    for L in (3, 5, 7, 61, 129, 242, 255, 16416):
        c = torch.full((4, 5, 3), L - 1, dtype=torch.int32)
        assert torch.equal(unpack_radix(pack_radix(c, L), L, 60), c.reshape(-1).long())
        c8 = torch.full((37,), L - 1, dtype=torch.uint8 if L < 256 else torch.int16)
        assert torch.equal(unpack_radix(pack_radix(c8, L), L, 37), c8.long())


@needs_numba
def test_kernel_matches_reference_large():
    for L in (3, 9, 129, 242, 1061):  # one-word groups, then wide ones
        c = torch.randint(0, L, (100_003,))
        fast = pack_radix(c, L)
        with codec_path("reference"):
            ref = pack_radix(c, L)
            assert torch.equal(unpack_radix(fast, L, c.numel()), c)
        assert torch.equal(fast, ref)
        assert torch.equal(unpack_radix(ref, L, c.numel()), c)


def test_empty():
    for L in (3, 200, 242, 1061):
        assert pack_radix(torch.empty(0, dtype=torch.int64), L).numel() == 0
        assert unpack_radix(torch.empty(0, dtype=torch.uint8), L, 0).numel() == 0


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_bad_input(path):
    with codec_path(path):
        for bad in (1, 0, -3, 2 ** 16 + 1, 10 ** 6, 3.0, True, "3"):
            with pytest.raises(ValueError, match="levels must be an int in 2..65536"):
                pack_radix(torch.zeros(4, dtype=torch.int64), bad)
            with pytest.raises(ValueError, match="levels must be an int in 2..65536"):
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
        with pytest.raises(ValueError, match=r"codes must lie in \[0, levels\) = \[0, 1060\] for levels=1061"):
            pack_radix(torch.tensor([0, 1061]), 1061)
        for L, n in ((134, 7), (129, 20), (242, 14), (1061, 15)):  # 57-, 92-, 103- and 71-bit groups
            with pytest.raises(ValueError, match=f"not a radix-{L} packing: {-(-n // radix_group(L)[0])} of its"):
                unpack_radix(torch.full((radix_nbytes(n, L),), 255, dtype=torch.uint8), L, n)
        # one wide group (242 levels: 13 digits in 103 bits) holding exactly L^13, then L^13 - 1
        too_big = torch.tensor(list((242 ** 13).to_bytes(13, "little")), dtype=torch.uint8)
        with pytest.raises(ValueError, match="1 of its 1 group values"):
            unpack_radix(too_big, 242, 13)
        top = torch.tensor(list((242 ** 13 - 1).to_bytes(13, "little")), dtype=torch.uint8)
        assert torch.equal(unpack_radix(top, 242, 13), torch.full((13,), 241))
        # a last group of 2 digits (16 bits) holding 242^2, one more than its digits hold
        last = torch.tensor(list((242 ** 2).to_bytes(2, "little")), dtype=torch.uint8)
        with pytest.raises(ValueError, match="1 of its 1 group values"):
            unpack_radix(last, 242, 2)


@needs_numba
@pytest.mark.parametrize("L", [3, 5, 6, 7, 9, 15, 60, 61, 129, 134, 242, 255, 1061, 16416])
def test_specialised_kernels_match_reference(L, monkeypatch):
    """The per-level-count numba kernels (blocks of 8 groups, then the run-time kernel for
    the tail) give the reference's bytes, and refuse a group value above L^g - 1."""
    monkeypatch.setattr(cpu_kernels("radix"), "SPECIALISE_FROM", 0)
    g, _ = radix_group(L)
    for n in (8 * g, 8 * g + 1, 16 * g + g - 1, 24 * g + 5, 5001):
        c = _symbols(L, n, seed=L + n).to(torch.uint8 if L <= 256 else torch.uint16)  # the codecs' dtypes
        data = pack_radix(c, L)
        assert torch.equal(data, pack_radix_reference(c, L)), n
        assert torch.equal(unpack_radix(data, L, n), c.long()), n
        fast, bad = cpu_kernels("radix").unpack(data, L, g, radix_group(L)[1], n, c.dtype)
        assert bad == 0 and torch.equal(fast, c), n
    if L ** g < 2 ** radix_group(L)[1]:
        bad = torch.full((radix_nbytes(8 * g, L),), 255, dtype=torch.uint8)
        with pytest.raises(ValueError, match=f"not a radix-{L} packing: 8 of its 8 group values"):
            unpack_radix(bad, L, 8 * g)


@pytest.mark.parametrize("L", [2, 3, 4, 5, 16, 17, 61, 127, 242, 255, 256, 257, 401, 1061, 65535, 65536, 65537,
                               2 ** 20 + 1])
def test_levels_api_routes_by_level_count(L):
    """Mixed radix for non-powers of two up to 2^16 whose groups hold more than one code,
    plain packing at ceil(log2 L) bits otherwise (a power of two; g = 1, e.g. 127, 255 or
    65535 levels, is the same format); level_bits is the bits per element of long vectors."""
    width = math.ceil(math.log2(L))
    plain = L & (L - 1) == 0 or L > MAX_LEVELS or radix_group(L)[0] == 1
    g, b = (1, width) if plain else radix_group(L)
    assert level_bits(L) == b / g <= (1.01 if L <= MAX_LEVELS else 1 + 1 / 16) * math.log2(L)
    n = 1003
    c = torch.randint(0, L, (n,))
    c[0] = L - 1
    data = pack_levels(c, L)
    assert data.numel() == levels_nbytes(n, L) == (packed_nbytes(n, width) if plain else radix_nbytes(n, L))
    if plain:
        assert torch.equal(data, pack_wide(c, width))  # today's packing, exactly
    assert torch.equal(unpack_levels(data, L, n), c)
    if L <= MAX_LEVELS:  # the fast path's codes: uint8 up to 256 levels, uint16 (the CPU kernels' dtype) above
        dtype = torch.uint8 if L <= 256 else torch.uint16
        fast = pack_levels_fast(c.to(dtype), L)
        assert torch.equal(fast, data)
        assert torch.equal(unpack_levels_fast(fast, L, n, dtype), c.to(dtype))
    assert 8 * levels_nbytes(100_000, L) / 100_000 <= level_bits(L) + 1e-3
    with pytest.raises(ValueError, match="exactly"):
        unpack_levels_fast(data[:-1], L, n)


def test_levels_api_bad_level_counts():
    for bad in (1, 0, 2 ** 32 + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"levels must be an int in 2..2\^32"):
            level_bits(bad)
        with pytest.raises(ValueError, match=r"levels must be an int in 2..2\^32"):
            levels_nbytes(4, bad)
