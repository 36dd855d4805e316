"""Bagua's MinMaxUInt8 codec (lowbit.codecs.BaguaMinMaxCodec) against Bagua's
formulas written out in plain torch, bit for bit, and its wire layout."""

import pytest
import torch

from lowbit.codecs import BaguaMinMaxCodec, MinMaxCodec, make_codec
from lowbit.codecs.bagua_minmax import align32

C = BaguaMinMaxCodec()


def bagua_roundtrip(x):
    """Bagua's kernel: scale = 255/(max-min+eps), level = rint(x*scale) clamped at
    rint(max*scale), codes offset by rint(max*scale)-255; (code + lower)/scale. float32."""
    x = x.float()
    eps = torch.tensor(1e-7, dtype=torch.float32)
    lo, hi = x.min(), x.max()
    scale = 255.0 / (hi - lo + eps)
    upper = torch.round(hi * scale)
    lower = upper - 255.0
    codes = (torch.minimum(torch.round(x * scale), upper) - lower).clamp(min=0).to(torch.uint8)
    return (codes.float() + lower) / scale, codes


def _inputs():
    g = torch.Generator().manual_seed(0)
    for s in range(300):
        n = int(torch.randint(1, 300, (1,), generator=g))
        x = torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-3, 3, (1,), generator=g))
        if s % 3 == 0:
            x += float(torch.randn(1, generator=g)) * 100  # an offset far from 0: rounding at the bottom
        if s % 2 == 0:
            x[torch.randint(0, n, (n // 4 + 1,), generator=g)] = 0.0
        yield x


def _below_grid(x):
    """Whether float rounding puts some rint(x * scale) below lower (the saturated case)."""
    lo, hi = x.min(), x.max()
    scale = 255.0 / (hi - lo + torch.tensor(1e-7, dtype=torch.float32))
    return bool((torch.round(x * scale) < torch.round(hi * scale) - 255.0).any())


def test_bitwise_baguas_formulas():
    assert any(_below_grid(x) for x in _inputs())  # the bottom saturation is exercised
    for x in _inputs():
        want, codes = bagua_roundtrip(x)
        p = C.encode(x)
        assert torch.equal(p.data[:x.numel()], codes)
        assert torch.equal(C.decode(p), want)
        assert torch.equal(C.decode(C.payload_from_wire(p.to_wire()), numel=x.numel()), want)


def test_exact_zeros_are_kept_and_the_grid_is_anchored_at_zero():
    x = torch.tensor([-1.1, 0.0, 0.3, 0.0, 2.0])
    y = C.roundtrip(x)
    assert y[1] == 0.0 and y[3] == 0.0
    assert float((y - x).abs().max()) <= 3.1 / 255 / 2 + 1e-6
    # lowbit's own min-max anchors at min and does not keep zeros: the two differ
    assert MinMaxCodec(bits=8).roundtrip(x)[1] != 0.0


def test_wire_layout_is_baguas():
    for n in (1, 31, 32, 33, 770, 1000):
        p = C.encode(torch.randn(n))
        assert p.header.numel() == 32 and p.data.numel() == align32(n) and p.nbytes == 32 + align32(n)
        assert torch.equal(p.data[n:], torch.zeros(align32(n) - n, dtype=torch.uint8))
    x = torch.randn(100)
    lo, hi = C.encode(x).header[:8].view(torch.float32)
    assert lo == x.min() and hi == x.max()
    assert C.bits == 8 and make_codec("bagua-minmax") == C


def test_float64_is_quantized_in_float32():
    x = torch.randn(50, dtype=torch.float64)
    assert torch.equal(C.roundtrip(x), bagua_roundtrip(x.float())[0])
    assert C.decode(C.encode(x), dtype=torch.float64).dtype == torch.float64


def test_empty_constant_and_bad_input():
    assert C.decode(C.encode(torch.zeros(0))).numel() == 0 and C.encode(torch.zeros(0)).nbytes == 32
    assert torch.equal(C.roundtrip(torch.full((7,), 0.25)), bagua_roundtrip(torch.full((7,), 0.25))[0])
    with pytest.raises(ValueError, match="finite"):
        C.encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="finite"):
        C.encode(torch.tensor([1.0, float("inf")]))
    p = C.encode(torch.randn(40))
    with pytest.raises(ValueError, match="align32"):
        C.decode(p, numel=70)
    with pytest.raises(ValueError, match="numel"):
        C.decode(p, numel=-1)
    with pytest.raises(ValueError, match="32-byte"):
        C.decode(type(p)(header=p.header[:12], data=p.data))
    with pytest.raises(ValueError, match="flat"):
        C.encode(torch.zeros(2, 2))
