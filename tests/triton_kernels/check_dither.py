"""Triton kernels of the "dithered", "nested" and "qsgd" families (DQSG, NDQSG, QSGD) against the numba kernels
(= the float64 reference's bytes) and the error bounds with their float32 slack; run by
tests/test_triton_interpret.py with TRITON_INTERPRET=1 on CPU tensors (small tensors)."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs.dithered import DitheredCodec  # noqa: E402
from lowbit.codecs.kernels import (cpu_dithered, cpu_nested, cpu_qsgd, gpu_dithered, gpu_nested,  # noqa: E402
                                  gpu_qsgd, kernels_on)
from lowbit.codecs.nested import NestedDitheredCodec  # noqa: E402
from lowbit.codecs.qsgd import QSGDCodec, exact_ratio, round_up_float32  # noqa: E402

KEY = 0x1234_5678_9ABC_DEF


def _x(n, seed, dtype, scale=1.0):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _close_codes(a, b, dtype, modulus=None):
    """float32 may move an element across a grid point: rarely, and by one code."""
    a, b = a.long(), b.long()
    differ = a != b
    assert differ.double().mean() <= (2e-3 if dtype != torch.float64 else 1e-4)
    off = a[differ] - b[differ]
    if modulus is not None:
        off = off.remainder(modulus)
        assert bool(((off == 1) | (off == modulus - 1)).all())
    else:
        assert bool((off.abs() == 1).all())


@pytest.mark.parametrize("levels,parts,subtractive", [(1, 1, True), (3, 4, False), (7, 3, True), (300, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dithered_matches_the_reference_within_float32(levels, parts, subtractive, dtype):
    codec = DitheredCodec(levels=levels, subtractive=subtractive, partitions=parts)
    n = 2001
    x = _x(n, levels, dtype)
    amax, finite = gpu_dithered.dithered_scales(x, parts)
    ref_amax, _ = cpu_dithered.dithered_scales(x, parts)
    assert bool(finite) and torch.equal(amax, ref_amax)
    k32 = round_up_float32(amax)
    codes = gpu_dithered.dithered_encode(x, gpu_dithered.ratio(levels, k32), levels, codec.code_bits, KEY)
    ref = cpu_dithered.dithered_encode(x, exact_ratio(levels, k32), levels, codec.code_bits, KEY)
    assert codes.dtype == gpu_dithered.code_dtype(codec.code_bits)
    _close_codes(codes, ref, dtype)
    step = k32.double() / levels
    xt = gpu_dithered.dithered_decode(codes, step, levels, subtractive, KEY, torch.float32)
    same = gpu_dithered.dithered_decode(ref.to(codes.dtype), step, levels, subtractive, KEY, torch.float64)
    assert torch.allclose(same, cpu_dithered.dithered_decode(ref, step, levels, subtractive, KEY, torch.float64),
                          rtol=1e-6 if dtype != torch.float64 else 1e-15, atol=0)
    kap = torch.repeat_interleave(k32.double(), torch.tensor([n // parts + 1] * (n % parts) +
                                                             [n // parts] * (parts - n % parts)))
    err = (xt.double() - x.double()).abs()
    eps = torch.finfo(torch.float32).eps / 2
    if subtractive:  # |x~ - x| <= kappa Delta / 2 + 4 eps32 kappa (M + 1) / M (module docstring of dithered)
        bound = kap / levels / 2 + 4 * eps * kap * (levels + 1) / levels
    else:  # one step at most, same slack
        bound = kap / levels + 4 * eps * kap * (levels + 1) / levels
    assert bool((err <= bound).all())


@pytest.mark.parametrize("k,alpha,delta1", [(4, 1.0, 0.05), (3, 1.0, 1 / 3), (17, 0.8, 0.01), (2**20, 1.0, 1e-4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nested_matches_the_reference_within_float32(k, alpha, delta1, dtype):
    codec = NestedDitheredCodec(delta1=delta1, k=k, alpha=alpha)
    n = 2001
    x = _x(n, k, dtype, scale=2.0)
    z = (torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1) * 0.9 * codec.safe_radius
    y = (x.double() - z).to(dtype)
    codes, finite, worst = gpu_nested.nested_encode(x, alpha, delta1, k, codec.code_bits, KEY)
    ref, _, _ = cpu_nested.nested_encode(x, alpha, delta1, k, codec.code_bits, KEY)
    assert finite and worst < 2.0**24
    _close_codes(codes, ref, dtype, modulus=k)
    xh = gpu_nested.nested_decode(codes, y, alpha, delta1, codec.delta2, KEY)
    assert xh.dtype == dtype
    # with |z| < safe_radius: x_hat = x - (1 - alpha^2) z - alpha e, |e| <= Delta1 / 2, plus the float32 slack
    eps = torch.finfo(dtype).eps / 2
    expected = x.double() - (1 - alpha**2) * z.double()
    slack = 4 * eps * (x.double().abs() + y.double().abs() + codec.delta2)
    assert bool(((xh.double() - expected).abs() <= alpha * delta1 / 2 + slack).all())


def test_nested_reports_an_inexact_fine_index():
    x = torch.tensor([0.0, 1e8])
    _, finite, worst = gpu_nested.nested_encode(x, 1.0, 1.0, 4, 2, KEY)
    assert finite and worst >= 2.0**24
    _, _, worst64 = gpu_nested.nested_encode(x.double(), 1.0, 1.0, 4, 2, KEY)
    assert worst64 == pytest.approx(1e8, abs=1)


@pytest.mark.parametrize("levels,bucket", [(1, None), (4, 500), (127, 250), (300, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qsgd_matches_the_reference_within_float32(levels, bucket, dtype):
    codec = QSGDCodec(levels=levels, bucket=bucket)
    n = 2001
    x = _x(n, levels, dtype)
    b = n if bucket is None else bucket
    sq, finite = gpu_qsgd.qsgd_sumsq(x, b)
    ref_sq, _ = cpu_qsgd.qsgd_sumsq(x, b)
    assert bool(finite) and torch.allclose(sq, ref_sq, rtol=1e-13, atol=0)  # float64 sums, another order
    norms = round_up_float32(torch.sqrt(ref_sq))
    codes = gpu_qsgd.qsgd_encode(x, gpu_dithered.ratio(levels, norms), b, levels, codec.code_bits, KEY)
    ref = cpu_qsgd.qsgd_encode(x, exact_ratio(levels, norms), b, levels, codec.code_bits, KEY)
    _close_codes(codes, ref, dtype)
    step = norms.double() / levels
    out = gpu_qsgd.qsgd_decode(codes, step, b, levels, torch.float32)
    ref_out = cpu_qsgd.qsgd_decode(codes.to(ref.dtype), step, b, levels, torch.float32)
    assert torch.allclose(out, ref_out, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    # each level is within one step of |x| (QSGD's quantizer), with the float32 slack
    per = torch.repeat_interleave(step, b)[:n]
    assert bool(((out.double() - x.double()).abs() <= per * (1 + 1e-6)).all())


def test_nonfinite_flags():
    x = torch.tensor([1.0, float("nan"), 2.0, float("inf")] * 3)
    assert not bool(gpu_dithered.dithered_scales(x, 2)[1])
    assert not gpu_nested.nested_encode(x, 1.0, 0.1, 4, 2, KEY)[1]
    assert not bool(gpu_qsgd.qsgd_sumsq(x, 5)[1])
    assert bool(gpu_qsgd.qsgd_sumsq(torch.ones(10), 5)[1])


def test_host_values_reads_scalars():
    assert gpu_dithered.host_values(torch.tensor(True), 3.0, torch.tensor([2.5])) == (True, 3.0, 2.5)


# --- the codecs' CUDA glue (headers and scales on the device, one status read), driven
# through the Triton kernels on CPU tensors by routing the codecs' kernel lookup to them --


@pytest.fixture
def triton_route(monkeypatch):
    import lowbit.codecs.dithered as dithered
    import lowbit.codecs.nested as nested
    import lowbit.codecs.qsgd as qsgd
    import lowbit.codecs.radix as radix
    for mod in (dithered, nested, qsgd):
        monkeypatch.setattr(mod, "kernels_for", lambda x, family="core", op=None: kernels_on("triton", family, op))
    # the codes are packed by the Triton radix kernels (the core's for a power of two / > 2^16 levels)
    monkeypatch.setattr(radix, "kernels_for", lambda x, family="core", op=None: kernels_on("triton", family, op))


def _codes_of(payload_data, skip, levels, n):
    from lowbit.codecs.radix import unpack_levels
    return unpack_levels(payload_data[skip:], levels, n)


@pytest.mark.parametrize("codec", [DitheredCodec(levels=2), DitheredCodec(levels=3, subtractive=False, partitions=3),
                                   DitheredCodec(levels=200, partitions=2)])
def test_dithered_codec_on_the_triton_path(triton_route, codec):
    from lowbit.codecs import shared_generator
    n = 1001
    x = _x(n, 3, torch.float32)
    fast = codec.encode(x, generator=shared_generator(1, 2, 3))
    ref = codec.encode_reference(x, generator=shared_generator(1, 2, 3))
    assert torch.equal(fast.header, ref.header) and fast.data.numel() == ref.data.numel()
    skip = 4 * (min(codec.partitions, n) - 1)
    assert torch.equal(fast.data[:skip], ref.data[:skip])  # the other parts' scales
    _close_codes(_codes_of(fast.data, skip, codec.num_codes, n), _codes_of(ref.data, skip, codec.num_codes, n),
                 x.dtype)
    xt = codec.decode(fast, generator=shared_generator(1, 2, 3))
    assert torch.allclose(xt, codec.decode_reference(fast, generator=shared_generator(1, 2, 3)), rtol=1e-6, atol=1e-7)
    bad = x.clone()
    bad[5] = float("nan")
    with pytest.raises(ValueError, match="finite .*dithered codec"):
        codec.encode(bad, generator=shared_generator(1, 2, 3))


@pytest.mark.parametrize("codec", [QSGDCodec(levels=2), QSGDCodec(levels=7, bucket=300)])
def test_qsgd_codec_on_the_triton_path(triton_route, codec):
    from lowbit.codecs import shared_generator
    n = 1001
    x = _x(n, 4, torch.float32)
    fast = codec.encode(x, generator=shared_generator(0, 1, 0))
    ref = codec.encode_reference(x, generator=shared_generator(0, 1, 0))
    assert torch.equal(fast.header, ref.header) and fast.data.numel() == ref.data.numel()
    skip = 0 if codec.bucket is None else 4 * -(-n // codec.bucket)
    assert torch.equal(fast.data[:skip], ref.data[:skip])  # the norms (float64 sums, rounded up to float32)
    _close_codes(_codes_of(fast.data, skip, codec.num_codes, n), _codes_of(ref.data, skip, codec.num_codes, n),
                 x.dtype)
    assert torch.allclose(codec.decode(fast), codec.decode_reference(fast), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="finite for the QSGD codec"):
        codec.encode(torch.tensor([1.0, float("inf")]))


def test_nested_codec_on_the_triton_path(triton_route):
    from lowbit.codecs import shared_generator
    codec = NestedDitheredCodec(delta1=0.05, k=4)
    n = 1001
    x = _x(n, 5, torch.float32)
    y = x + 0.5 * codec.safe_radius * _x(n, 6, torch.float32).clamp(-1, 1)
    fast = codec.encode(x, generator=shared_generator(0, 0, 1))
    ref = codec.encode_reference(x, generator=shared_generator(0, 0, 1))
    assert torch.equal(fast.header, ref.header)
    _close_codes(_codes_of(fast.data, 0, codec.k, n), _codes_of(ref.data, 0, codec.k, n), x.dtype, codec.k)
    xh = codec.decode(fast, ref=y, generator=shared_generator(0, 0, 1))
    eps = torch.finfo(torch.float32).eps / 2
    slack = 4 * eps * (x.abs() + y.abs() + codec.delta2)
    assert bool(((xh - x).abs() <= codec.delta1 / 2 + slack).all())
    with pytest.raises(ValueError, match="delta1=1.0 is too small .*float32 on CUDA"):
        NestedDitheredCodec(delta1=1.0, k=4).encode(torch.tensor([0.0, 1e8]), generator=shared_generator(0, 0, 1))
