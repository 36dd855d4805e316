"""Mixed-radix packing in the codecs (issue 11 item 2): every codec whose level count is
not a power of two packs its codes at about log2(levels) bits, on both paths, and its
``bits`` (the runs' nominal bits) is the same count."""

import math

import pytest
import torch

from lowbit.codecs import (DitheredCodec, NestedDitheredCodec, QSGDCodec, QSGDMaxNormCodec, TernGradCodec,
                           shared_generator)
from lowbit.codecs.kernels import codec_path
from lowbit.codecs.packing import pack_wide
from lowbit.codecs.radix import radix_group, radix_nbytes, unpack_levels

# (codec, its number of levels L, bytes in front of the codes for n elements)
CASES = [
    (DitheredCodec(levels=1), 3, lambda n: 0),
    (DitheredCodec(levels=2, partitions=3), 5, lambda n: 4 * (min(3, n) - 1)),
    (DitheredCodec(levels=3, subtractive=False), 7, lambda n: 0),
    (DitheredCodec(levels=127), 255, lambda n: 0),
    (NestedDitheredCodec(delta1=0.01, k=3), 3, lambda n: 0),
    (NestedDitheredCodec(delta1=0.01, k=6, alpha=0.9), 6, lambda n: 0),
    (QSGDCodec(levels=1), 3, lambda n: 0),
    (QSGDCodec(levels=2, bucket=100), 5, lambda n: 4 * -(-n // 100)),
    (QSGDCodec(levels=7), 15, lambda n: 0),
    (TernGradCodec(), 3, lambda n: 0),
    (QSGDMaxNormCodec(bits=2), 3, lambda n: 0),
    (QSGDMaxNormCodec(bits=3), 7, lambda n: 0),
    (QSGDMaxNormCodec(bits=4), 15, lambda n: 0),
    # groups wider than 64 bits (61 levels: 15 in 89 bits; 121: 13 in 90), and above 255 levels
    (DitheredCodec(levels=30), 61, lambda n: 0),
    (QSGDCodec(levels=60), 121, lambda n: 0),
    (DitheredCodec(levels=200), 401, lambda n: 0),
    (QSGDCodec(levels=300), 601, lambda n: 0),
    (NestedDitheredCodec(delta1=0.01, k=1000), 1000, lambda n: 0),
]
IDS = [repr(c) for c, _, _ in CASES]


def _needs_generator(codec):
    return isinstance(codec, NestedDitheredCodec) or (isinstance(codec, DitheredCodec) and codec.subtractive)


def _roundtrip(codec, x, y):
    gen = lambda: shared_generator(3, 1, 4)  # noqa: E731
    p = codec.encode(x, generator=gen())

    def kw():  # a fresh generator for each decode: the dither's key is drawn from it
        out = {"generator": gen()} if _needs_generator(codec) else {}
        return {**out, "ref": y} if isinstance(codec, NestedDitheredCodec) else out
    return p, codec.decode(p, **kw()), codec.decode_reference(p, **kw())


@pytest.mark.parametrize("codec,L,front", CASES, ids=IDS)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 13, 1001, 4099])
def test_odd_lengths_round_trip_at_radix_byte_counts(codec, L, front, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    y = x + 0.001 * torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    p, fast, ref = _roundtrip(codec, x, y)
    assert p.data.numel() == front(n) + radix_nbytes(n, L)
    assert torch.equal(fast, ref)
    with codec_path("reference"):
        q, _, _ = _roundtrip(codec, x, y)
    assert torch.equal(q.data, p.data) and torch.equal(q.header, p.header)  # the fast path's bytes are the reference's
    codes = unpack_levels(p.data[front(n):], L, n)
    assert int(codes.min()) >= 0 and int(codes.max()) < L


@pytest.mark.parametrize("codec,L,front", CASES, ids=IDS)
def test_wire_and_nominal_bits_at_1e5(codec, L, front):
    """<= 1.01 log2(L) bits per element on the wire at n = 1e5, and the codec's ``bits`` (the
    nominal count of a run's summary) is the wire's: g codes in b bits."""
    n = 100_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    p, _, _ = _roundtrip(codec, x, x)
    wire = 8 * (p.data.numel() - front(n)) / n
    assert wire <= 1.01 * math.log2(L)
    g, b = radix_group(L)
    nominal = codec.wire_bits if isinstance(codec, QSGDMaxNormCodec) else codec.bits
    nominal -= 32 / codec.bucket if isinstance(codec, QSGDCodec) and codec.bucket else 0
    assert nominal == b / g and wire == pytest.approx(nominal, abs=8 / n)
    assert (nominal < math.ceil(math.log2(L))) == (g > 1)  # fewer bits than plain packing, unless g = 1 (L = 255)


def test_trits_are_five_per_byte():
    for codec in (TernGradCodec(), DitheredCodec(levels=1), QSGDCodec(levels=1)):
        assert codec.bits == 1.6
        p, _, _ = _roundtrip(codec, torch.randn(10), None)
        assert p.data.numel() == 2


@pytest.mark.parametrize("codec,L", [(NestedDitheredCodec(delta1=0.01, k=4), 4),
                                     (NestedDitheredCodec(delta1=0.01, k=16), 16),
                                     (DitheredCodec(levels=40_000), 80_001), (QSGDCodec(levels=2 ** 16), 2 ** 17 + 1),
                                     (QSGDMaxNormCodec(bits=8), 255), (QSGDMaxNormCodec(bits=9), 511)])
def test_power_of_two_and_large_level_counts_keep_plain_packing(codec, L):
    n = 1001
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    p, _, _ = _roundtrip(codec, x, x)
    width = math.ceil(math.log2(L))
    codes = unpack_levels(p.data, L, n)
    assert torch.equal(p.data, pack_wide(codes, width))  # today's packing exactly (255: g = 1 at 8 bits)
    assert codec.bits == (width if not isinstance(codec, QSGDMaxNormCodec) else codec.bits)
