"""DQSG (DitheredCodec) and NDQSG (NestedDitheredCodec): wire sizes, Lemma 2/3,
Schuchman's theorem, shared randomness, and Theorem 6 of the nested-dithered
quantization paper."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from lowbit.codecs import CodecKind, Payload, shared_generator
from lowbit.codecs.radix import level_bits, levels_nbytes, radix_group, unpack_levels
from lowbit.codecs.dithered import DitheredCodec, partition_sizes
from lowbit.codecs.rng import counter_uniforms, draw_key
from lowbit.codecs.nested import (
    NestedDitheredCodec,
    choose_nested_parameters,
    gaussian_failure_probability,
    matched_alpha,
    theorem6_failure_bound,
    theorem6_mse,
)

F64 = torch.float64


def _x(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=F64) * scale


def _codes(codec, payload, n):
    """The packed indices q + M of a DitheredCodec payload."""
    skip = 4 * (min(codec.partitions, n) - 1)
    return unpack_levels(payload.data[skip:], codec.num_codes, n)


# --- wire size ------------------------------------------------------------------------


@pytest.mark.parametrize("levels,code_bits", [(1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (8, 5), (100, 8), (2**20, 22)])
def test_dithered_bits(levels, code_bits):
    c = DitheredCodec(levels=levels)
    L = 2 * levels + 1
    assert c.code_bits == code_bits == math.ceil(math.log2(L))
    assert c.num_codes == L and c.step == 1 / levels
    if L <= 255:  # mixed radix: g codes in b bits, within 1% of log2(2M + 1)
        g, b = radix_group(L)
        assert c.bits == b / g <= 1.01 * math.log2(L)
    else:  # plain packing beyond 255 levels
        assert c.bits == code_bits
    assert DitheredCodec(levels=1).bits == 1.6  # 5 trits per byte


@pytest.mark.parametrize("n", [0, 1, 7, 1001])
@pytest.mark.parametrize("levels,partitions", [(1, 1), (2, 1), (3, 3), (100, 1), (2**20, 4), (2, 64)])
@pytest.mark.parametrize("subtractive", [True, False])
def test_dithered_wire_size(n, levels, partitions, subtractive):
    c = DitheredCodec(levels=levels, subtractive=subtractive, partitions=partitions)
    x = _x(n, seed=n).to(torch.float32)
    p = c.encode(x, generator=shared_generator(1, 2, 3))
    assert c.header_nbytes == p.header.numel() == 8 <= 32
    scales = min(partitions, n) - 1 if n else 0
    assert p.data.numel() == 4 * scales + levels_nbytes(n, 2 * levels + 1) == c.data_nbytes(n)
    assert p.nbytes == 8 + p.data.numel()
    wire = p.to_wire()
    assert len(wire) == p.nbytes
    q = c.payload_from_wire(wire)
    a = c.decode(p, generator=shared_generator(1, 2, 3))
    b = c.decode(q, generator=shared_generator(1, 2, 3))
    assert a.shape == (n,) and a.dtype == torch.float32 and torch.equal(a, b)
    assert c.unbiased is True and c.kind is CodecKind.PLAIN
    if n:
        codes = _codes(c, p, n)
        assert int(codes.min()) >= 0 and int(codes.max()) <= 2 * levels


def test_dithered_index_range_is_2M_plus_1():
    """|x/kappa| <= 1 and u/Delta in [-1/2, 1/2): indices lie in -M..M, and the
    elements at +-kappa always take the end indices."""
    M = 3
    c = DitheredCodec(levels=M)
    x = torch.cat([torch.tensor([1.0, -1.0], dtype=F64), torch.rand(5000, generator=torch.Generator().manual_seed(0),
                                                                      dtype=F64) * 2 - 1])
    seen = set()
    for s in range(20):
        codes = _codes(c, c.encode(x, generator=shared_generator(0, s, 0)), x.numel())
        assert int(codes[0]) == 2 * M and int(codes[1]) == 0
        seen.update(codes.tolist())
    assert seen == set(range(2 * M + 1))


def test_partition_sizes_and_scales():
    assert partition_sizes(10, 3) == [4, 3, 3]
    assert partition_sizes(2, 5) == [1, 1]
    assert partition_sizes(0, 3) == []
    x = torch.tensor([1.0, -3.0, 0.5, 2.0, -0.25, -0.7, 0.0], dtype=F64)
    k = DitheredCodec(levels=2, partitions=3).scales(x)
    assert k[:2].tolist() == [3.0, 2.0]
    assert float(np.float32(0.7)) < 0.7  # float32 rounds 0.7 down; the scale is rounded up instead
    assert k[2].item() == float(np.nextafter(np.float32(0.7), np.float32(1))) > 0.7
    # an all-zero part decodes to exact zeros
    z = torch.zeros(6)
    c = DitheredCodec(levels=2, partitions=2)
    assert torch.equal(c.roundtrip(torch.cat([z, torch.ones(6)]), generator=shared_generator(0, 0, 0))[:6], z)


@pytest.mark.parametrize("n", [0, 1, 7, 1001])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 16, 17, 256, 1000])
def test_nested_wire_size(n, k):
    c = NestedDitheredCodec(delta1=0.01, k=k, alpha=0.9)
    assert c.bits == level_bits(k) and c.code_bits == math.ceil(math.log2(k)) and c.delta2 == pytest.approx(k * 0.01)
    x = _x(n, seed=n).to(torch.float32)
    y = x + 0.001 * _x(n, seed=n + 1).to(torch.float32)
    p = c.encode(x, generator=shared_generator(4, 0, 1))
    assert c.header_nbytes == p.header.numel() == 4 <= 32
    assert p.data.numel() == levels_nbytes(n, k)
    assert p.nbytes == 4 + p.data.numel()
    q = c.payload_from_wire(p.to_wire())
    a = c.decode(p, ref=y, generator=shared_generator(4, 0, 1))
    b = c.decode(q, ref=y, generator=shared_generator(4, 0, 1))
    assert a.shape == (n,) and a.dtype == torch.float32 and torch.equal(a, b)
    if n:
        codes = unpack_levels(p.data, k, n)
        assert int(codes.min()) >= 0 and int(codes.max()) < k
    assert c.kind is CodecKind.SIDE_INFO


# --- unbiasedness (Lemma 3 P1, Lemma 2) ---------------------------------------------------


@pytest.mark.parametrize("subtractive,partitions", [(True, 1), (False, 1), (True, 3)])
def test_dithered_unbiased(subtractive, partitions):
    M, R = 2, 1000
    c = DitheredCodec(levels=M, subtractive=subtractive, partitions=partitions)
    x = _x(24, seed=5)
    out = torch.stack([c.roundtrip(x, generator=shared_generator(9, s, 0)).to(F64) for s in range(R)])
    kap = torch.repeat_interleave(c.scales(x), torch.tensor(partition_sizes(24, partitions)))
    if subtractive:  # Theorem 1: error uniform on kappa [-Delta/2, Delta/2]
        sd = kap / M / math.sqrt(12)
    else:  # Lemma 2: stochastic rounding of x / (kappa Delta), variance kappa^2 Delta^2 f (1 - f)
        w = x / kap * M
        f = w - torch.floor(w)
        sd = kap / M * torch.sqrt(f * (1 - f))
    se = sd / math.sqrt(R)
    err = out.mean(0) - x
    exact = se == 0  # half-dithered at x = +-kappa: no randomness at all
    assert torch.all(err[exact].abs() < 1e-6)
    z = err[~exact] / se[~exact]
    assert z.abs().max() < 4.5, z
    # and the spread is the predicted one (so the test above is not vacuous)
    emp_sd, big = out.std(0), sd > 0.05 * kap / M  # elements with a reasonable chance of either outcome
    assert torch.allclose(emp_sd[big], sd[big], rtol=0.12)


# --- Lemma 3 variance --------------------------------------------------------------------


@pytest.mark.parametrize("levels", [1, 4])
@pytest.mark.parametrize("partitions", [1, 4])
def test_lemma3_variance(levels, partitions):
    n, R = 1001, 100
    c = DitheredCodec(levels=levels, partitions=partitions)
    x = _x(n, seed=7, scale=0.3) + 0.05
    err2 = torch.stack([(c.roundtrip(x, generator=shared_generator(2, s, 1)).to(F64) - x).pow(2).sum()
                        for s in range(R)])
    delta = 1 / levels
    # excess variance sum_j n_j kappa_j^2 Delta^2 / 12 (n Delta^2 kappa^2 / 12 for K = 1), kappas from numpy
    parts = np.array_split(x.numpy(), partitions)
    predicted = sum(len(p) * np.abs(p).max() ** 2 for p in parts) * delta**2 / 12
    assert c.expected_sq_error(x) == pytest.approx(predicted, rel=1e-6)
    assert float(err2.mean()) == pytest.approx(predicted, rel=0.03)
    # P2's bound: kappa^2 <= ||x||_2^2
    assert predicted <= n * delta**2 / 12 * float(x.pow(2).sum())
    if partitions > 1:  # eq. (4): partitioning can only lower the excess variance
        assert predicted <= DitheredCodec(levels=levels).expected_sq_error(x)


def test_lemma3_stochastic_gradient():
    """P2 with g = grad + v: E||g~ - grad||^2 = E||g - grad||^2 + E[kappa^2] n Delta^2 / 12,
    below the bound n Delta^2 / 12 E||g||^2 + E||g - grad||^2."""
    n, R, M, sigma = 500, 200, 2, 0.2
    c = DitheredCodec(levels=M)
    grad = _x(n, seed=1, scale=0.1)
    noise = _x(n * R, seed=2, scale=sigma).view(R, n)
    lhs, kap2, g2 = [], [], []
    for s in range(R):
        g = grad + noise[s]
        lhs.append(float((c.roundtrip(g, generator=shared_generator(3, s, 0)).to(F64) - grad).pow(2).sum()))
        kap2.append(float(g.abs().max()) ** 2)
        g2.append(float(g.pow(2).sum()))
    sg_var = n * sigma**2
    exact = sg_var + np.mean(kap2) * n / M**2 / 12
    assert np.mean(lhs) == pytest.approx(exact, rel=0.03)
    assert exact <= n / M**2 / 12 * np.mean(g2) + sg_var


def test_half_dithered_variance_twice_subtractive():
    """Section 2.1.1: for x uniform on [-1, 1] the half-dithered (stochastic) quantizer's
    mean variance is Delta^2 / 6, twice the dithered quantizer's Delta^2 / 12."""
    M, n = 4, 200_000
    x = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=F64) * 2 - 1
    x[0] = 1.0
    sub = DitheredCodec(levels=M).roundtrip(x, generator=shared_generator(0, 0, 0)).to(F64)
    half = DitheredCodec(levels=M, subtractive=False).roundtrip(x, generator=shared_generator(0, 0, 0)).to(F64)
    d2 = (1 / M) ** 2
    assert float((sub - x).pow(2).mean()) == pytest.approx(d2 / 12, rel=0.02)
    assert float((half - x).pow(2).mean()) == pytest.approx(d2 / 6, rel=0.02)


# --- Schuchman (Theorem 1) ----------------------------------------------------------------


def _schuchman_input(M, n=20_000):
    """x / kappa in [0, 0.45 Delta] (plus one element at kappa = 2): plain rounding's
    error is then -x itself."""
    g = torch.Generator().manual_seed(11)
    kappa = 2.0
    v = torch.rand(n, generator=g, dtype=F64) * 0.45 / M
    v[0] = 1.0
    return kappa, kappa * v


def _independence_stats(e, x):
    """|corr(e, x)|, |corr(e^2, x)|, and the KS p-value comparing e on the lower and
    upper halves of x."""
    e, x = e[1:].numpy(), x[1:].numpy()  # drop the scale-setting element
    c1 = abs(np.corrcoef(e, x)[0, 1])
    c2 = abs(np.corrcoef(e**2, x)[0, 1])
    lo = x < np.median(x)
    return c1, c2, stats.ks_2samp(e[lo], e[~lo]).pvalue


def test_schuchman_subtractive_error_uniform_and_independent():
    M = 4
    kappa, x = _schuchman_input(M)
    n = x.numel()
    c = DitheredCodec(levels=M)
    e = c.roundtrip(x, generator=shared_generator(8, 0, 0)).to(F64) - x
    half = kappa / M / 2
    assert float(e.abs().max()) <= half * (1 + 1e-6)
    assert stats.kstest(e.numpy(), stats.uniform(loc=-half, scale=2 * half).cdf).pvalue > 0.01
    c1, c2, p = _independence_stats(e, x)
    bound = 4 / math.sqrt(n)
    assert c1 < bound and c2 < bound and p > 0.01

    # the same tests reject plain nearest rounding to the same grid ...
    plain = kappa / M * torch.round(x / kappa * M) - x
    assert stats.kstest(plain.numpy(), stats.uniform(loc=-half, scale=2 * half).cdf).pvalue < 1e-6
    c1, c2, p = _independence_stats(plain, x)
    assert c1 > 0.99 and c2 > 0.9 and p < 1e-6

    # ... and the half-dithered quantizer, whose error variance depends on x (section 2.1)
    eh = DitheredCodec(levels=M, subtractive=False).roundtrip(x, generator=shared_generator(8, 0, 0)).to(F64) - x
    c1, c2, p = _independence_stats(eh, x)
    assert c2 > 10 * bound and p < 1e-6


# --- shared randomness --------------------------------------------------------------------


def test_dithered_shared_randomness():
    M = 2
    c = DitheredCodec(levels=M)
    x = _x(1000, seed=4)
    kappa = float(c.scales(x)[0])
    wire = c.encode(x, generator=shared_generator(5, 3, 2)).to_wire()
    assert torch.equal(wire, c.encode(x, generator=shared_generator(5, 3, 2)).to_wire())
    assert not torch.equal(wire, c.encode(x, generator=shared_generator(5, 3, 1)).to_wire())
    p = c.payload_from_wire(wire)
    good = c.decode(p, generator=shared_generator(5, 3, 2), dtype=F64)
    assert torch.equal(good, c.decode(p, generator=shared_generator(5, 3, 2), dtype=F64))
    assert torch.equal(good.float(), c.roundtrip(x, generator=shared_generator(5, 3, 2)))
    assert float((good - x).abs().max()) <= kappa / M / 2 * (1 + 1e-9)
    assert float((good - x).pow(2).mean()) == pytest.approx((kappa / M) ** 2 / 12, rel=0.1)
    # a wrong dither u' leaves kappa (Delta q - u') - x = (half-dithered error) + kappa (u - u'), u' independent
    wrong_mse = (DitheredCodec(levels=M, subtractive=False).expected_sq_error(x) / x.numel()
                 + (kappa / M) ** 2 / 12)
    for wrong in (shared_generator(6, 3, 2), shared_generator(5, 4, 2), shared_generator(5, 3, 3)):
        bad = c.decode(p, generator=wrong, dtype=F64)
        assert float((bad - x).abs().max()) > kappa / M / 2
        assert float((bad - x).pow(2).mean()) == pytest.approx(wrong_mse, rel=0.1)
    with pytest.raises(ValueError, match="generator"):
        c.decode(p)
    with pytest.raises(ValueError, match="generator"):
        c.encode(x)
    # half-dithered: the receiver needs no generator
    h = DitheredCodec(levels=M, subtractive=False)
    ph = h.encode(x, generator=shared_generator(5, 3, 2))
    assert torch.equal(h.decode(ph), h.decode(ph, generator=shared_generator(0, 0, 0)))
    assert h.encode(x).nbytes == ph.nbytes  # global generator allowed


def test_dither_is_the_documented_draw():
    c = DitheredCodec(levels=3)
    u = c.dither(10, shared_generator(1, 1, 1))
    r = counter_uniforms(draw_key(shared_generator(1, 1, 1)), 10)  # one key, then the counter uniforms
    assert torch.equal(u, (r - 0.5) / 3)
    assert float(u.abs().max()) <= 0.5 / 3


def test_nested_shared_randomness():
    c = NestedDitheredCodec(delta1=0.05, k=4)
    x = _x(2000, seed=1)
    y = x + 0.02 * _x(2000, seed=2)
    p = c.encode(x, generator=shared_generator(1, 7, 0))
    good = c.decode(p, ref=y, generator=shared_generator(1, 7, 0))
    assert torch.equal(good, c.roundtrip(x, generator=shared_generator(1, 7, 0), ref=y))
    assert float((good - x).abs().max()) <= c.delta1 / 2 + 1e-12  # |z| < safe radius: alpha = 1 error is -e
    bad = c.decode(p, ref=y, generator=shared_generator(1, 7, 1))
    assert float(((bad - x).abs() > c.delta1 / 2 + 1e-12).double().mean()) > 0.3
    with pytest.raises(ValueError, match="generator"):
        c.decode(p, ref=y)
    with pytest.raises(ValueError, match="generator"):
        c.encode(x)
    with pytest.raises(ValueError, match="ref"):
        c.decode(p, generator=shared_generator(1, 7, 0))
    with pytest.raises(ValueError, match="ref"):
        c.decode(p, ref=y[:-1], generator=shared_generator(1, 7, 0))


# --- nested quantization (eq. 6-7, Theorem 6) ----------------------------------------------


def test_nested_paper_example():
    """Figure 3: Delta1 = 1, Delta2 = 3, alpha = 1, x = -4.2, u = 0.3, y = -3.4: s = -1
    (sent as -4 mod 3 = 2) and x_hat = -4.3."""
    c = NestedDitheredCodec(delta1=1.0, k=3, alpha=1.0)
    x, u, y = (torch.tensor([v], dtype=F64) for v in (-4.2, 0.3, -3.4))
    codes = c.indices(x, u)
    assert codes.tolist() == [2]
    assert float(c.reconstruct(codes, u, y)[0]) == pytest.approx(-4.3, abs=1e-12)


def _nested_trial(codec, x, z, seed):
    """Roundtrip against y = x - z; returns (x_hat, e, success by the exact condition)."""
    n = x.numel()
    y = x - z
    xh = codec.roundtrip(x, generator=shared_generator(seed, 0, 0), ref=y)
    u = codec.dither(n, shared_generator(seed, 0, 0))
    t = codec.alpha * x + u
    e = t - codec.delta1 * torch.floor(t / codec.delta1 + 0.5)
    w = codec.alpha * z - e
    margin = (w.abs() - codec.delta2 / 2).abs() > 1e-9  # drop float ties at the coarse cell edge
    return xh, e, w.abs() < codec.delta2 / 2, margin


@pytest.mark.parametrize("method,alpha", [("gaussian", "matched"), ("gaussian", 1.0), ("bound", "matched")])
def test_nested_theorem6(method, alpha):
    sigma, n = 0.3, 200_000
    target = 0.02 if method == "gaussian" else 0.2
    prm = choose_nested_parameters(sigma, target, k=4, alpha=alpha, method=method)
    c = prm.codec()
    x = _x(n, seed=21, scale=5.0)
    z = _x(n, seed=22, scale=sigma)
    xh, e, ok, margin = _nested_trial(c, x, z, seed=3)
    # correct decoding <=> |alpha z - e| < Delta2 / 2, and then x_hat = x - (1 - alpha^2) z - alpha e
    expected = x - (1 - c.alpha**2) * z - c.alpha * e
    dev = xh - expected
    assert float(dev[ok & margin].abs().max()) < 1e-9
    jumps = dev[~ok & margin] / (c.alpha * c.delta2)
    assert torch.all(jumps.round().abs() >= 1) and float((jumps - jumps.round()).abs().max()) < 1e-6
    # |z| < (Delta2 - Delta1) / (2 alpha) guarantees success
    assert bool(ok[z.abs() < c.safe_radius].all())
    # the failure rate is Theorem 6's p, below the bound (8)
    rate = float((~ok).double().mean())
    p = c.failure_probability(sigma)
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12
    assert rate <= c.failure_bound(sigma)
    if method == "gaussian":
        assert p == pytest.approx(target, rel=1e-6)
    else:
        assert c.failure_bound(sigma) == pytest.approx(target, rel=1e-9)


def test_nested_alpha1_error_is_fine_error():
    """alpha = 1: whenever decoding is correct, |x_hat - x| = |e| <= Delta1 / 2."""
    c = NestedDitheredCodec(delta1=0.1, k=8, alpha=1.0)
    x = _x(50_000, seed=5)
    z = _x(50_000, seed=6, scale=0.15)
    xh, e, ok, _ = _nested_trial(c, x, z, seed=1)
    assert 0 < float((~ok).double().mean()) < 0.05
    err = (xh - x)[ok]
    assert float(err.abs().max()) <= c.delta1 / 2 + 1e-12
    assert torch.allclose(err, -e[ok], atol=1e-12, rtol=0)


def test_failure_condition_is_on_e_not_on_u():
    """Theorem 6's |alpha z + u| > Delta2/2 is a statement in distribution (-e ~ u);
    per element, |alpha z + u| < Delta2/2 with the actual dither does not suffice."""
    c = NestedDitheredCodec(delta1=1.0, k=3, alpha=1.0)
    x, u = torch.tensor([0.45], dtype=F64), torch.tensor([0.1], dtype=F64)
    z = torch.tensor([1.3], dtype=F64)
    assert float((c.alpha * z + u).abs()) < c.delta2 / 2
    xh = c.reconstruct(c.indices(x, u), u, x - z)
    assert abs(float(xh - x)) > c.delta1  # decoded into the wrong coarse cell


def test_eq9_mse():
    """Eq. (9) with |z| below the safe radius; matched alpha gives DQSG's Delta1^2 / 12."""
    n, d1, k = 200_000, 0.2, 8
    b = 0.3  # z uniform on [-b, b]: sigma_z^2 = b^2 / 3
    sigma = b / math.sqrt(3)
    x = _x(n, seed=8, scale=3.0)
    z = (torch.rand(n, generator=torch.Generator().manual_seed(9), dtype=F64) * 2 - 1) * b
    for alpha in (1.0, 0.8, matched_alpha(d1, sigma)):
        c = NestedDitheredCodec(delta1=d1, k=k, alpha=alpha)
        assert b < c.safe_radius
        xh, _, ok, _ = _nested_trial(c, x, z, seed=4)
        assert bool(ok.all())
        assert float((xh - x).pow(2).mean()) == pytest.approx(theorem6_mse(d1, alpha, sigma), rel=0.02)
    assert theorem6_mse(d1, matched_alpha(d1, sigma), sigma) == pytest.approx(d1**2 / 12, rel=1e-12)


def test_choose_nested_parameters_formulas():
    sigma, p, k = 0.5, 0.05, 8
    prm = choose_nested_parameters(sigma, p, k=k)  # bound, matched alpha
    assert prm.delta2 == pytest.approx(2 * sigma / math.sqrt(p))
    assert prm.delta1 == pytest.approx(prm.delta2 / k)
    assert prm.alpha == pytest.approx(math.sqrt(1 - 1 / (3 * k**2 * p)))
    assert prm.failure_bound == pytest.approx(p)
    assert prm.mse == pytest.approx(prm.delta1**2 / 12)
    assert prm.failure_probability < prm.failure_bound
    fixed = choose_nested_parameters(sigma, p, bits=3, alpha=0.9)
    assert fixed.k == 8 and fixed.alpha == 0.9
    assert fixed.delta2 == pytest.approx(2 * 0.9 * sigma / math.sqrt(p - 1 / (3 * k**2)))
    assert theorem6_failure_bound(fixed.delta1, fixed.delta2, 0.9, sigma) == pytest.approx(p)
    g = choose_nested_parameters(sigma, 1e-6, k=k, method="gaussian")
    assert g.failure_probability == pytest.approx(1e-6, rel=1e-6)
    # the exact probability is decreasing in Delta2, so a slightly smaller step fails more often
    assert gaussian_failure_probability(g.delta1 * 0.99, g.delta2 * 0.99, g.alpha, sigma) > 1e-6
    with pytest.raises(ValueError, match="failure_prob"):
        choose_nested_parameters(sigma, 1 / (3 * k**2), k=k)  # below what bound (8) can certify
    with pytest.raises(ValueError, match="failure_prob"):
        choose_nested_parameters(sigma, 1.5, k=k)
    with pytest.raises(ValueError, match="sigma_z"):
        choose_nested_parameters(0.0, p, k=k)
    with pytest.raises(ValueError, match="k"):
        choose_nested_parameters(sigma, p, k=1)
    with pytest.raises(ValueError, match="k and bits"):
        choose_nested_parameters(sigma, p, k=4, bits=2)
    with pytest.raises(ValueError, match="alpha"):
        choose_nested_parameters(sigma, p, k=4, alpha=1.5)
    with pytest.raises(ValueError, match="method"):
        choose_nested_parameters(sigma, p, k=4, method="exact")


# --- clear errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory,field",
    [
        (lambda: DitheredCodec(levels=0), "levels"),
        (lambda: DitheredCodec(levels=-2), "levels"),
        (lambda: DitheredCodec(levels=2.5), "levels"),
        (lambda: DitheredCodec(levels=True), "levels"),
        (lambda: DitheredCodec(levels=2**31), "levels"),
        (lambda: DitheredCodec(levels=2, partitions=0), "partitions"),
        (lambda: DitheredCodec(levels=2, partitions=1.0), "partitions"),
        (lambda: DitheredCodec(levels=2, subtractive="yes"), "subtractive"),
        (lambda: NestedDitheredCodec(delta1=0.0, k=4), "delta1"),
        (lambda: NestedDitheredCodec(delta1=-0.1, k=4), "delta1"),
        (lambda: NestedDitheredCodec(delta1=float("nan"), k=4), "delta1"),
        (lambda: NestedDitheredCodec(delta1=float("inf"), k=4), "delta1"),
        (lambda: NestedDitheredCodec(delta1=0.1, k=1), "k"),
        (lambda: NestedDitheredCodec(delta1=0.1, k=2.0), "k"),
        (lambda: NestedDitheredCodec(delta1=0.1, k=4, alpha=0.0), "alpha"),
        (lambda: NestedDitheredCodec(delta1=0.1, k=4, alpha=1.5), "alpha"),
        (lambda: NestedDitheredCodec(delta1=0.1, k=4, alpha=-0.5), "alpha"),
        (lambda: NestedDitheredCodec(delta1=0.1, k=4, alpha=float("nan")), "alpha"),
        (lambda: NestedDitheredCodec(delta1=1e308, k=4), "delta2"),
    ],
)
def test_errors_name_the_field(factory, field):
    with pytest.raises(ValueError, match=field):
        factory()


def test_encode_errors():
    c = DitheredCodec(levels=2)
    g = shared_generator(0, 0, 0)
    with pytest.raises(ValueError, match="finite"):
        c.encode(torch.tensor([1.0, float("nan")]), generator=g)
    with pytest.raises(ValueError, match="finite"):
        c.encode(torch.tensor([1.0, float("inf")]), generator=g)
    with pytest.raises(ValueError, match="float32"):
        c.encode(torch.tensor([1e300], dtype=F64), generator=g)
    with pytest.raises(ValueError, match="flat"):
        c.encode(torch.zeros(2, 2), generator=g)
    n = NestedDitheredCodec(delta1=1e-20, k=4)
    with pytest.raises(ValueError, match="delta1"):
        n.encode(torch.tensor([1e3], dtype=F64), generator=g)
    with pytest.raises(ValueError, match="finite"):
        NestedDitheredCodec(delta1=0.1, k=4).encode(torch.tensor([float("nan")]), generator=g)
    with pytest.raises(ValueError, match="data bytes"):
        c.decode(Payload(header=c.encode(torch.ones(5), generator=g).header, data=torch.zeros(1, dtype=torch.uint8)),
                 generator=g)
