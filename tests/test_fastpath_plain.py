"""The "plain" codecs' fast path (numba on the CPU: min-max, uniform, sign, TernGrad,
fp16/bf16, fp32) against their references: the same bytes and generator state for the
same generator, the same decodes, the statistics on the fast path, the same errors."""

import math

import pytest
import torch

from lowbit.codecs import (HalfCodec, IdentityCodec, MinMaxCodec, SignCodec, TernGradCodec, UniformCodec,
                           shared_generator)
from lowbit.codecs.base import Payload
from lowbit.codecs.kernels import cpu_kernels, kernels_for
from lowbit.codecs.quantize import lane_sums_reference

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels


CASES = [
    IdentityCodec(),
    HalfCodec("fp16"),
    HalfCodec("bf16"),
    *[MinMaxCodec(bits=b) for b in range(1, 9)],
    *[MinMaxCodec(bits=b, rounding="stochastic") for b in (1, 3, 6, 8)],
    UniformCodec(step=0.01),
    UniformCodec(step=0.3, rounding="nearest"),
    UniformCodec(step=1e-6),  # 23-bit codes
    UniformCodec(step=1e-8, rounding="nearest"),  # 32-bit codes
    TernGradCodec(),
    SignCodec(),
    SignCodec("rms"),
    SignCodec("none"),
]
LENGTHS = [0, 1, 7, 8, 9, 10_001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _x(n, dtype, seed=0):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("family", ["minmax", "uniform", "sign", "terngrad"])
def test_the_fast_path_is_taken(family):
    K = cpu_kernels(family)
    assert K is not None and K.__name__.endswith(f".cpu_{family}") and kernels_for(torch.zeros(3), family) is K


@pytest.mark.parametrize("codec", CASES, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_path_gives_the_reference_bytes_and_decodes(codec, dtype):
    for n in LENGTHS:
        x = _x(n, dtype, seed=n)
        g_fast, g_ref = shared_generator(0, n, 1), shared_generator(0, n, 1)
        fast = codec.encode(x, generator=g_fast)
        ref = codec.encode_reference(x, generator=g_ref)
        assert torch.equal(fast.header, ref.header) and torch.equal(fast.data, ref.data), n
        assert torch.equal(g_fast.get_state(), g_ref.get_state())  # one key drawn, or none, by both
        for out in (None, torch.float64, torch.float16):
            a, b = codec.decode(fast, dtype=out), codec.decode_reference(fast, dtype=out)
            assert a.dtype == b.dtype and torch.equal(a, b), (n, out)


def test_uniform_rebases_stochastic_codes_on_their_own_minimum():
    """x in (0, 1) with step 1: the bound is [0, 1], and the codes are all 1 for some keys."""
    c = UniformCodec(step=1.0)
    x = torch.full((3,), 0.9)
    widths = set()
    for seed in range(40):
        fast = c.encode(x, generator=shared_generator(1, seed, 0))
        ref = c.encode_reference(x, generator=shared_generator(1, seed, 0))
        assert torch.equal(fast.to_wire(), ref.to_wire())
        widths.add(tuple(c.decode(fast).tolist()))
    assert (1.0, 1.0, 1.0) in widths and len(widths) > 1


def test_uniform_wide_bounds_take_the_exact_range():
    """x's bounds span 2^32 codes, the codes themselves 2^32 - 2 .. 2^32 depending on the draws:
    the exact range decides, as in the reference (sometimes bytes, sometimes the range error)."""
    c = UniformCodec(step=1.0)
    x = torch.tensor([0.5, 2.0**32 - 0.5], dtype=torch.float64)
    outcomes = set()
    for seed in range(16):
        try:
            ref = c.encode_reference(x, generator=shared_generator(2, seed, 0)).to_wire()
        except ValueError as e:
            ref = str(e)
        try:
            fast = c.encode(x, generator=shared_generator(2, seed, 0)).to_wire()
        except ValueError as e:
            fast = str(e)
        assert type(fast) is type(ref) and (fast == ref if isinstance(ref, str) else torch.equal(fast, ref))
        outcomes.add(type(ref))
    assert outcomes == {str, torch.Tensor}


# --- statistics on the fast path ------------------------------------------------------------

N = 200_000


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_minmax_error_bound(bits, rounding):
    c = MinMaxCodec(bits=bits, rounding=rounding)
    x = _x(N, torch.float32, seed=bits)
    y = c.decode(c.encode(x, generator=shared_generator(3, bits, 0)), dtype=torch.float64)
    width = (float(x.max()) - float(x.min())) / c.levels
    err = (y - x.double()).abs().max()
    bound = width / 2 if rounding == "nearest" else width
    assert err <= bound * (1 + 1e-9)
    if rounding == "stochastic":  # unbiased: the mean error is within 5 sd of 0
        assert abs(float((y - x.double()).mean())) < 5 * width / 2 / math.sqrt(N)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_uniform_error_bound_and_bias(rounding):
    c = UniformCodec(step=0.05, rounding=rounding)
    x = _x(N, torch.float64, seed=4)
    y = c.decode(c.encode(x, generator=shared_generator(4, 0, 0)), dtype=torch.float64)
    assert (y - x).abs().max() <= c.error_bound * (1 + 1e-9)
    if rounding == "stochastic":
        assert abs(float((y - x).mean())) < 5 * c.step / 2 / math.sqrt(N)
        assert float(((y - x).abs() > c.step / 2).float().mean()) > 0.1  # not nearest rounding


def test_terngrad_ternary_and_unbiased():
    c = TernGradCodec()
    x = _x(64, torch.float32, seed=6).double()
    k = 4000
    y = c.decode(c.encode(x.repeat(k), generator=shared_generator(6, 0, 0)), dtype=torch.float64).view(k, -1)
    scale = float(x.abs().max())
    assert set(torch.unique(y / scale).round().tolist()) <= {-1.0, 0.0, 1.0}
    assert ((y.mean(0) - x).abs() < 5 * scale / 2 / math.sqrt(k)).all()


def test_sign_scales():
    x = _x(10_001, torch.float32, seed=7)
    y = SignCodec().decode(SignCodec().encode(x))
    assert torch.equal(torch.sign(y), torch.where(x >= 0, 1.0, -1.0))
    assert math.isclose(float(y[0].abs()), float(x.double().abs().mean()), rel_tol=1e-6)
    r = SignCodec("rms").decode(SignCodec("rms").encode(x))
    assert math.isclose(float(r.double().norm()), float(x.double().norm()), rel_tol=1e-6)


@pytest.mark.parametrize("order", [1, 2])
def test_sign_scale_sum_is_the_references_lane_order(order):
    """float64 sums in the lane order of lane_sums_reference: |x| or x^2 of float32 inputs
    (squares beyond float32 too); terms of very different sizes make another order show."""
    # a first term whose ulp the others' sequential additions each fall below (the lanes' do not)
    spread = torch.tensor([2.0**60 if order == 1 else 2.0**30] + [100.0 if order == 1 else 10.0] * 15,
                          dtype=torch.float64)
    for x in (_x(10_003, torch.float32, seed=8), torch.full((10,), 1e30), _x(77, torch.float64) * 1e100, spread):
        _, total, finite = cpu_kernels("sign").sign_encode(x, order)
        x64 = x.double()
        terms = x64.abs() if order == 1 else x64 * x64
        assert finite and total == float(lane_sums_reference(terms, x.numel())[0])
    terms = spread.abs() if order == 1 else spread * spread
    assert float(terms.cumsum(0)[-1]) == 2.0**60 < cpu_kernels("sign").sign_encode(spread, order)[1]  # not the sequential sum
    y = SignCodec("rms").decode(SignCodec("rms").encode(torch.full((10,), 1e30)))
    assert torch.allclose(y, torch.full((10,), 1e30))


def test_decodes_never_alias_the_payload():
    x = _x(100, torch.float32)
    for c in (IdentityCodec(), HalfCodec("fp16")):
        p = c.encode(x)
        for out in (None, torch.float32, c.torch_dtype if isinstance(c, HalfCodec) else torch.float64):
            y = c.decode(p, dtype=out)
            y.add_(1)
            assert not torch.equal(c.decode(p, dtype=out), y)
        x.add_(1)
        assert not torch.equal(c.decode(p), x.to(torch.float16).float() if isinstance(c, HalfCodec) else x)


def test_unaligned_wire_bytes_decode():
    x = _x(101, torch.float32)
    for c in (IdentityCodec(), HalfCodec("fp16"), HalfCodec("bf16")):
        wire = c.encode(x).to_wire()
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), wire])[1:]  # storage offset 1
        assert torch.equal(c.decode(c.payload_from_wire(shifted)), c.decode(c.payload_from_wire(wire)))


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("codec,message", [
    (MinMaxCodec(), "finite for the min-max codec"),
    (MinMaxCodec(bits=2, rounding="stochastic"), "finite for the min-max codec"),
    (UniformCodec(step=0.1), r"finite for the uniform codec \(step=0.1\)"),
    (UniformCodec(step=0.1, rounding="nearest"), "finite for the uniform codec"),
    (TernGradCodec(), "finite for the TernGrad codec"),
    (SignCodec(), "finite for the sign codec"),
    (SignCodec("rms"), "finite for the sign codec"),
    (SignCodec("none"), "finite for the sign codec"),
    (HalfCodec("fp16"), "finite for the fp16 codec"),
    (HalfCodec("bf16"), "finite for the bf16 codec"),
], ids=lambda v: repr(v)[:40])
def test_nonfinite_input_is_a_clear_error(codec, message, bad):
    x = torch.zeros(100)
    x[57] = bad
    with pytest.raises(ValueError, match=message):
        codec.encode(x)


def test_range_errors_match_the_reference():
    for codec, x, message in [
        (MinMaxCodec(), torch.tensor([0.0, 1e300], dtype=torch.float64), "does not fit the float32 header"),
        (UniformCodec(step=1e-12), torch.tensor([0.0, 1.0]), "step=1e-12 is too small"),
        (SignCodec(), torch.full((4,), 1e300, dtype=torch.float64), "does not fit the float32 header"),
        (TernGradCodec(), torch.tensor([1e300], dtype=torch.float64), "does not fit the float32"),
        (HalfCodec("fp16"), torch.tensor([1.0, 7e4]), "overflows fp16"),
    ]:
        for encode in (codec.encode, codec.encode_reference):
            with pytest.raises(ValueError, match=message):
                encode(x)


def test_bad_payloads_are_clear_errors():
    p = TernGradCodec().encode(torch.randn(9))  # 5 + 4 trits: 2 bytes
    for data in (torch.tensor([243, 0], dtype=torch.uint8), torch.tensor([0, 81], dtype=torch.uint8)):
        bad = Payload(header=p.header, data=data)  # a byte above 3^5 - 1, a last byte of 4 trits above 3^4 - 1
        with pytest.raises(ValueError, match="not 5 ternary digits"):
            TernGradCodec().decode(bad)
        with pytest.raises(ValueError, match="not a radix-3 packing"):
            TernGradCodec().decode_reference(bad)
    for codec in (MinMaxCodec(bits=3), UniformCodec(step=0.1), SignCodec(), TernGradCodec()):
        p = codec.encode(torch.randn(50))
        short = Payload(header=p.header, data=p.data[:-1])
        with pytest.raises(ValueError, match="need exactly"):
            codec.decode(short)
    for codec in (IdentityCodec(), HalfCodec()):
        p = codec.encode(torch.randn(50))
        with pytest.raises(ValueError, match="data bytes"):
            codec.decode(Payload(header=p.header, data=p.data[:-2]))
