"""The "dithered", "nested" and "qsgd" families' fast path (numba on the CPU) against the float64 reference:
DQSG (DitheredCodec), NDQSG (NestedDitheredCodec) and QSGD (QSGDCodec). The same
bytes for the same generator, the same decodes, the statistics on the fast path,
the same errors."""

import math

import pytest
import torch

from lowbit.codecs import shared_generator
from lowbit.codecs.dithered import DitheredCodec
from lowbit.codecs.kernels import codec_path, cpu_dithered, cpu_nested, cpu_qsgd, kernels_for
from lowbit.codecs.nested import NestedDitheredCodec
from lowbit.codecs.quantize import lane_sums_reference
from lowbit.codecs.qsgd import QSGDCodec

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels

F64 = torch.float64
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _x(n, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=F64) * scale).to(dtype)


def _same_payload(a, b):
    assert torch.equal(a.header, b.header) and torch.equal(a.data, b.data)


@pytest.mark.parametrize("family,module", [("dithered", cpu_dithered), ("nested", cpu_nested), ("qsgd", cpu_qsgd)])
def test_the_families_have_cpu_kernels(family, module):
    assert kernels_for(torch.zeros(3), family) is module
    with codec_path("reference"):
        assert kernels_for(torch.zeros(3), family) is None


@pytest.mark.parametrize("levels,partitions,subtractive", [
    (1, 1, True), (2, 1, False), (3, 3, True), (7, 5, False), (100, 1, True), (2**20, 4, True), (2, 64, False),
])
@pytest.mark.parametrize("n", [1, 7, 1001, 10_007])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dithered_fast_path_gives_the_reference_bytes(levels, partitions, subtractive, n, dtype):
    codec = DitheredCodec(levels=levels, subtractive=subtractive, partitions=partitions)
    x = _x(n, seed=n + levels, dtype=dtype)
    if n > 3:
        x[n // 3: n // 2] = 0  # a zero part (for some K) decodes to zeros
        x[1] = x.abs().max()  # an element at +kappa
    fast = codec.encode(x, generator=shared_generator(0, 5, 1))
    ref = codec.encode_reference(x, generator=shared_generator(0, 5, 1))
    _same_payload(fast, ref)
    for out in (None, torch.float64, torch.bfloat16):
        a = codec.decode(fast, generator=shared_generator(0, 5, 1), dtype=out)
        b = codec.decode_reference(fast, generator=shared_generator(0, 5, 1), dtype=out)
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("k,alpha,delta1", [(2, 1.0, 0.3), (3, 1.0, 1 / 3), (4, 0.9, 0.05), (17, 0.7, 0.01),
                                            (256, 1.0, 1e-3), (1000, 0.95, 1e-4), (2**32, 1.0, 1e-6)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nested_fast_path_gives_the_reference_bytes(k, alpha, delta1, dtype):
    codec = NestedDitheredCodec(delta1=delta1, k=k, alpha=alpha)
    n = 5003
    x = _x(n, seed=k, dtype=dtype, scale=3.0)
    y = (x.double() + _x(n, seed=k + 1, dtype=F64, scale=delta1)).to(dtype)
    fast = codec.encode(x, generator=shared_generator(2, 3, 4))
    _same_payload(fast, codec.encode_reference(x, generator=shared_generator(2, 3, 4)))
    a = codec.decode(fast, ref=y, generator=shared_generator(2, 3, 4))
    b = codec.decode_reference(fast, ref=y, generator=shared_generator(2, 3, 4))
    assert a.dtype == y.dtype and torch.equal(a, b)


@pytest.mark.parametrize("levels,bucket", [(1, None), (2, None), (4, 128), (127, None), (128, 1000), (3, 1),
                                           (2**15, 7), (2**20, None)])
@pytest.mark.parametrize("n", [1, 999, 10_007])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_fast_path_gives_the_reference_bytes(levels, bucket, n, dtype):
    codec = QSGDCodec(levels=levels, bucket=bucket)
    x = _x(n, seed=levels + n, dtype=dtype)
    if n > 3:
        x[: min(n, 1000)] = 0  # a zero bucket
    fast = codec.encode(x, generator=shared_generator(7, 1, 0))
    _same_payload(fast, codec.encode_reference(x, generator=shared_generator(7, 1, 0)))
    for out in (None, torch.float64, torch.float16):
        a, b = codec.decode(fast, dtype=out), codec.decode_reference(fast, dtype=out)
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_bucket_sumsq_is_the_kernel_order():
    """The reference adds each bucket's squares in the kernel's lane order: terms of very
    different magnitudes make any other order give other bits (a sequential sum does)."""
    x = torch.randn(10_001, dtype=F64) * torch.logspace(-8, 8, 10_001, dtype=F64)
    for xs in (x, x.float()):
        for bucket in (1, 7, 10, 4096, 10_001):
            sq, finite = cpu_qsgd.qsgd_sumsq(xs, bucket)
            assert finite and torch.equal(sq, lane_sums_reference(xs.double() ** 2, bucket)), bucket
    # 2^60, then squares of 100 that a sequential sum drops one by one (half an ulp is 128)
    y = torch.tensor([2.0**30] + [10.0] * 15, dtype=F64)
    assert float((y * y).cumsum(0)[-1]) == 2.0**60 < float(cpu_qsgd.qsgd_sumsq(y, 16)[0][0])
    x[5] = float("nan")
    assert not cpu_qsgd.qsgd_sumsq(x, 4096)[1]


def test_empty_inputs_take_the_reference():
    g = shared_generator(0, 0, 0)
    for codec in (DitheredCodec(levels=2), QSGDCodec(levels=2), QSGDCodec(levels=2, bucket=4)):
        p = codec.encode(torch.zeros(0), generator=g)
        assert codec.decode(p, generator=shared_generator(0, 0, 0)).numel() == 0
    nc = NestedDitheredCodec(delta1=0.1, k=4)
    p = nc.encode(torch.zeros(0), generator=g)
    assert p.data.numel() == 0 and nc.decode(p, ref=torch.zeros(0), generator=g).numel() == 0


# --- statistics on the fast path (the codecs' own tests check the reference as well) -------


def test_dithered_fast_path_subtractive_error_is_uniform_and_bounded():
    M, n = 4, 200_000
    codec = DitheredCodec(levels=M)
    x = _x(n, seed=1)
    kappa = float(x.abs().max())
    e = codec.roundtrip(x, generator=shared_generator(3, 0, 0)).double() - x.double()
    half = kappa / M / 2
    assert float(e.abs().max()) <= half * (1 + 1e-6)
    assert float(e.mean()) == pytest.approx(0, abs=4 * half / math.sqrt(3 * n))
    assert float(e.pow(2).mean()) == pytest.approx((kappa / M) ** 2 / 12, rel=0.02)


def test_dithered_fast_path_half_dithered_is_unbiased():
    M, R = 2, 400
    codec = DitheredCodec(levels=M, subtractive=False, partitions=2)
    x = _x(16, seed=4)
    out = torch.stack([codec.roundtrip(x, generator=shared_generator(1, s, 0)).double() for s in range(R)])
    kap = torch.repeat_interleave(codec.scales(x), torch.tensor([8, 8]))
    w = x.double() / kap * M
    f = w - torch.floor(w)
    se = kap / M * torch.sqrt(f * (1 - f)) / math.sqrt(R)
    z = (out.mean(0) - x.double()) / se.clamp_min(1e-12)
    assert float(z.abs().max()) < 4.5


def test_nested_fast_path_alpha1_error_is_the_fine_error():
    codec = NestedDitheredCodec(delta1=0.1, k=8)
    x = _x(100_000, seed=5)
    y = x + (torch.rand(100_000, generator=torch.Generator().manual_seed(6)) * 2 - 1) * 0.9 * codec.safe_radius
    xh = codec.roundtrip(x, generator=shared_generator(1, 2, 3), ref=y)
    err = (xh - x).double()
    assert float(err.abs().max()) <= codec.delta1 / 2 + 4 * torch.finfo(torch.float32).eps * float(x.abs().max())
    assert float(err.pow(2).mean()) == pytest.approx(codec.delta1**2 / 12, rel=0.03)


def test_qsgd_fast_path_unbiased_and_lemma31():
    s, R, n = 2, 2000, 64
    codec = QSGDCodec(levels=s)
    x = _x(n, seed=8)
    out = torch.stack([codec.roundtrip(x, generator=shared_generator(4, r, 0)).double() for r in range(R)])
    norm = float(x.double().norm())
    v = x.double().abs() / norm * s
    f = v - torch.floor(v)
    se = norm / s * torch.sqrt(f * (1 - f)) / math.sqrt(R)
    z = (out.mean(0) - x.double()) / se.clamp_min(1e-12)
    assert float(z.abs().max()) < 4.5
    err2 = (out - x.double()).pow(2).sum(1).mean()
    assert float(err2) <= codec.variance_bound(n) * norm**2


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_fast_path_rejects_nonfinite_input(bad):
    x = torch.zeros(100)
    x[57] = bad
    g = shared_generator(0, 0, 0)
    with pytest.raises(ValueError, match="finite .*dithered codec"):
        DitheredCodec(levels=2, partitions=3).encode(x, generator=g)
    with pytest.raises(ValueError, match="finite for the nested dithered codec"):
        NestedDitheredCodec(delta1=0.1, k=4).encode(x, generator=g)
    for bucket in (None, 10):
        with pytest.raises(ValueError, match="finite for the QSGD codec"):
            QSGDCodec(levels=2, bucket=bucket).encode(x, generator=g)


def test_fast_path_range_errors():
    g = shared_generator(0, 0, 0)
    with pytest.raises(ValueError, match="float32 range"):
        DitheredCodec(levels=2).encode(torch.tensor([1.0, 1e300], dtype=F64), generator=g)
    with pytest.raises(ValueError, match="does not fit the float32"):
        QSGDCodec(levels=2).encode(torch.tensor([1e200, 1e200], dtype=F64), generator=g)
    with pytest.raises(ValueError, match="delta1=1e-20 is too small"):
        NestedDitheredCodec(delta1=1e-20, k=4).encode(torch.tensor([0.0, 1e3], dtype=F64), generator=g)
    # 2^51 fine steps still encode exactly (the reference's limit is 2^52)
    x = torch.tensor([2.0**51 * 0.5], dtype=F64)
    c = NestedDitheredCodec(delta1=0.5, k=4)
    _same_payload(c.encode(x, generator=shared_generator(1, 0, 0)),
                  c.encode_reference(x, generator=shared_generator(1, 0, 0)))
