"""The max-norm family's fast path (numba on the CPU) against the float64 reference:
QSGDMaxNorm and multi-scale give the reference's bytes, codes and decodes for the
same generator; the statistics hold on the fast path; errors are the reference's.
RandK's Feistel selection: the fast selection is the reference's set, k distinct
indices, uniform over seeds. PowerSGD's float32 path against the float64 one."""

import itertools
import math

import pytest
import torch

from lowbit.codecs import MultiScaleMaxNormCodec, PowerSGDCodec, QSGDMaxNormCodec, RandKCodec, shared_generator
from lowbit.codecs.kernels import codec_path, cpu_maxnorm, cpu_randk
from lowbit.codecs.maxnorm import sum_squares_reference
from lowbit.codecs.randk import feistel_params, round_keys, select_reference

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels

pytest.importorskip("numba")

SINGLE = [QSGDMaxNormCodec(bits=2), QSGDMaxNormCodec(bits=3), QSGDMaxNormCodec(bits=8),
          QSGDMaxNormCodec(bits=5, norm="linf"), QSGDMaxNormCodec(bits=12), QSGDMaxNormCodec(bits=32)]
MULTI = [MultiScaleMaxNormCodec(), MultiScaleMaxNormCodec(scales=(1, 3, 5), norm="linf"),
         MultiScaleMaxNormCodec(scales=(8, 12)), MultiScaleMaxNormCodec(scales=(3,)),
         MultiScaleMaxNormCodec(scales=(1, 2, 3, 4, 5))]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _x(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3 * 4  # heavy-ish tails
    return x.to(dtype)


def _same(p, q):
    return torch.equal(p.header, q.header) and torch.equal(p.data, q.data)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4099])
def test_sum_of_squares_is_the_reference_order(n):
    for dtype in (torch.float32, torch.float64):
        x = _x(n, dtype, n) * 1e3
        amax, sq, finite = cpu_maxnorm.norm_stats(x)
        assert finite and sq == sum_squares_reference(x.double())
        assert amax == (float(x.abs().max()) if n else 0.0)


@pytest.mark.parametrize("n", [1, 8, 9, 4099])
def test_norm_stats_flags_every_nonfinite_position(n):
    """The vector loop finds NaN and inf by their bits: in a whole group and in the tail, at
    either end, beside values larger than any finite square; subnormals and -0.0 are finite."""
    for dtype in (torch.float32, torch.float64):
        x = _x(n, dtype, n)
        info = torch.finfo(dtype)
        y = x.clone()
        y[0], y[-1] = -info.max, info.tiny / 4
        amax, sq, finite = cpu_maxnorm.norm_stats(y)
        assert finite and amax == float(y.double().abs().max()) and sq == sum_squares_reference(y.double())
        assert cpu_maxnorm.norm_stats(torch.full((n,), -0.0, dtype=dtype)) == (0.0, 0.0, True)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for pos in {0, n // 2, n - 1}:
                y = x.clone()
                y[pos] = bad
                assert not cpu_maxnorm.norm_stats(y)[2], (dtype, bad, pos)


@pytest.mark.parametrize("n,k", [(1, 1), (5000, 1), (5000, 2500), (5000, 5000), (70_001, 35_000)])
def test_scatter_writes_every_element(n, k):
    """The blocked scatter zeroes what it does not fill, into memory that held garbage."""
    g = torch.Generator().manual_seed(n + k)
    idx = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    vals = torch.randn(k, generator=g)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        torch.full((n,), float("nan"), dtype=dtype)  # leave NaNs where the next allocation may land
        out, far = cpu_randk.scatter(vals, idx, n, 1.5, dtype)
        assert not far
        ref = torch.zeros(n, dtype=dtype)
        ref[idx.long()] = (vals.double() * 1.5).to(dtype)
        assert out.dtype == dtype and torch.equal(out, ref)


@pytest.mark.parametrize("codec", SINGLE + MULTI, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_path_gives_the_reference_bytes_and_decodes(codec, dtype):
    x = _x(10_001, dtype)
    fast = codec.encode(x, generator=shared_generator(0, 5, 1))
    with codec_path("reference"):
        ref = codec.encode(x, generator=shared_generator(0, 5, 1))
    assert _same(fast, codec.encode_reference(x, generator=shared_generator(0, 5, 1))) and _same(fast, ref)
    for dt in (None, torch.float64, torch.bfloat16):
        assert torch.equal(codec.decode(fast, dtype=dt), codec.decode_reference(fast, dtype=dt))


@pytest.mark.parametrize("codec", SINGLE + MULTI, ids=repr)
def test_summable_protocol_matches_the_reference(codec):
    xs = [_x(3001, torch.float32, seed=s) for s in range(3)]
    agreed = []
    for r, op in enumerate(codec.scale_reduce_ops):
        fast = [codec.shared_scale(x, tuple(agreed)) for x in xs]
        ref = [codec.shared_scale_reference(x, tuple(agreed)) for x in xs]
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(fast, ref))
        stack = torch.stack(fast)
        agreed.append(stack.amax(0) if op == "max" else stack.amin(0))
    scale = agreed[0] if len(agreed) == 1 else tuple(agreed)
    codes = [codec.encode_int(x, scale, shared_generator(1, 2, m)) for m, x in enumerate(xs)]
    refs = [codec.encode_int_reference(x, scale, shared_generator(1, 2, m)) for m, x in enumerate(xs)]
    assert all(torch.equal(a, b) and a.dtype == torch.int64 for a, b in zip(codes, refs))
    total = sum(c.to(torch.int32) for c in codes)
    for dt in (None, torch.float64):
        assert torch.equal(codec.decode_sum(total, scale, 3, dtype=dt),
                           codec.decode_sum_reference(total.to(torch.int64), scale, 3, dtype=dt))


@pytest.mark.parametrize("codec", [QSGDMaxNormCodec(bits=3), MultiScaleMaxNormCodec(scales=(2, 6))], ids=repr)
def test_fast_path_is_unbiased_within_lemma_bound(codec):
    """E[Q(x)] = x and E||Q(x) - x||^2 <= Lemma 1/2's bound, on the fast path."""
    n, T = 64, 4000
    x = _x(n, torch.float64, seed=9)
    W = codec.shared_scale(x)
    ys = torch.stack([codec.decode(codec.encode(x, generator=shared_generator(3, t, 0)), dtype=torch.float64)
                      for t in range(T)])
    step = float(W) / codec.max_code  # the coarsest grid step: a code's sd is at most step / 2
    assert float((ys.mean(0) - x).abs().max()) <= 4.5 * step / 2 / math.sqrt(T)  # 64 coordinates
    mse = float(((ys - x) ** 2).sum(1).mean())
    assert mse <= codec.variance_bound(n, W)


@pytest.mark.parametrize("codec", [QSGDMaxNormCodec(bits=4), MultiScaleMaxNormCodec()], ids=repr)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_is_the_reference_error(codec, bad):
    x = torch.zeros(100)
    x[57] = bad
    for fn in (lambda: codec.encode(x), lambda: codec.shared_scale(x), lambda: codec.encode_reference(x)):
        with pytest.raises(ValueError, match="must be finite for the max-norm codecs"):
            fn()


def test_scale_errors_are_the_reference_errors():
    x = torch.tensor([0.5, -2.0, 1.0])
    c = QSGDMaxNormCodec(bits=4)
    with pytest.raises(ValueError, match=r"smaller than this worker's max \|x_i\| = 2.0"):
        c.encode_int(x, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="finite and >= 0"):
        c.encode(x, scale=float("nan"))
    ms = MultiScaleMaxNormCodec(scales=(2, 6))
    W = ms.shared_scale(x)
    with pytest.raises(ValueError, match="exceeds this worker's admissible scale"):
        ms.encode_int(x, (W, torch.ones(3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"must lie in 0..1"):
        ms.encode_int(x, (W, torch.full((3,), 2, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"must lie in 0..1"):
        ms.decode_sum(torch.zeros(3, dtype=torch.int64), (W, torch.full((3,), 5)), 1)
    with pytest.raises(ValueError, match="1-D integer tensor of 3"):
        ms.encode_int(x, (W, torch.zeros(4, dtype=torch.uint8)))
    # an index beyond the scales in a (corrupted) message: N = 3 scales use 2 index bits
    ms3 = MultiScaleMaxNormCodec(scales=(1, 3, 5))
    p = ms3.encode(x)
    bad = p.data.clone()
    bad[0] |= 0b11 << ms3.code_bits  # element 0's index bits -> 3
    from lowbit.codecs.base import Payload
    with pytest.raises(ValueError, match=r"must lie in 0..2"):
        ms3.decode(Payload(header=p.header, data=bad))
    with pytest.raises(ValueError, match=r"must lie in 0..2"):
        ms3.decode_reference(Payload(header=p.header, data=bad))


def test_zero_vector():
    for c in (QSGDMaxNormCodec(bits=3), MultiScaleMaxNormCodec()):
        p = c.encode(torch.zeros(10))
        assert _same(p, c.encode_reference(torch.zeros(10)))
        assert torch.equal(c.decode(p), torch.zeros(10))


# --- RandK: the Feistel selection --------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3, 5, 8, 9, 100, 4097, 65537])
def test_fast_selection_is_the_reference_set(d):
    a, hb = feistel_params(d)
    assert a * 2 ** hb >= d and a * 2 ** hb - d < 2 ** hb
    for k in sorted({1, 2, d // 3 + 1, d - 1} - {0, d}):
        for seed in (0, 7, 2**63 - 1):
            ref = select_reference(d, k, seed)
            keys = round_keys(seed, d).numpy().astype("uint64")
            assert torch.equal(cpu_randk.select_sparse(d, k, a, hb, keys), ref)
            for dense in (True, False):
                assert torch.equal(cpu_randk.select(d, k, a, hb, keys, dense).long(), ref)
            assert ref.numel() == k and bool((ref[1:] > ref[:-1]).all()) and 0 <= int(ref[0]) and int(ref[-1]) < d


def test_selection_is_uniform_over_seeds():
    """d = 5, k = 2: each of the 10 subsets with frequency 1/10 over 20000 seeds (sd 0.002),
    and each coordinate kept with probability k/d in a larger case."""
    c = RandKCodec(QSGDMaxNormCodec(), k=2)
    counts = {}
    T = 20_000
    for s in range(T):
        key = tuple(c.indices(5, s).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) == set(itertools.combinations(range(5), 2))
    assert max(abs(v / T - 0.1) for v in counts.values()) < 0.01
    d, k, T = 1000, 50, 2000
    c = RandKCodec(QSGDMaxNormCodec(), k=k)
    hits = torch.zeros(d)
    for s in range(T):
        hits[c.indices(d, s * 7919 + 1)] += 1
    p = hits / T  # each ~ k/d = 0.05, sd 0.0049
    assert int(hits.sum()) == k * T and float((p - k / d).abs().max()) < 0.025
    # and the first positions are not favoured (a bad permutation keeps low indices)
    assert abs(float(p[:100].mean()) - k / d) < 0.005


def test_randk_fast_matches_reference_end_to_end():
    c = RandKCodec(QSGDMaxNormCodec(bits=6), k=300, seed=11)
    x = _x(5000, torch.float32)
    p = c.encode(x, generator=shared_generator(0, 0, 0))
    with codec_path("reference"):
        pr = c.encode(x, generator=shared_generator(0, 0, 0))
        yr = c.decode(pr)
    assert _same(p, pr) and torch.equal(c.decode(p), yr)
    assert torch.equal(c.indices(5000), c.indices_reference(5000))
    nz = torch.nonzero(yr).view(-1)
    assert set(nz.tolist()) <= set(c.indices(5000).tolist())


# --- PowerSGD: float32 ---------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 12, 1001, 4096, 10_007])
def test_powersgd_float32_path_is_close_to_the_reference(N):
    c = PowerSGDCodec(rank=3)
    x = _x(N, torch.float32, seed=N)
    state = c.init_state(N, torch.Generator().manual_seed(1))
    p, q = c.encode_with_state(x, state)
    pr, qr = c.encode_with_state_reference(x, state)
    assert p.nbytes == pr.nbytes and q.dtype == torch.float32
    y, yr = c.decode(p), c.decode_reference(pr)
    assert y.dtype == torch.float32 and y.shape == (N,)
    scale = float(x.norm()) + 1e-30
    # same subspace step up to float32 rounding (QR signs may differ per column: compare M_hat)
    assert float((y.double() - yr.double()).norm()) <= 1e-4 * scale
    assert float(y.double().norm()) <= float(x.double().norm()) * (1 + 1e-5)  # a projection


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_powersgd_float32_path_rejects_nonfinite(bad):
    x = torch.randn(1000)
    x[3] = bad
    with pytest.raises(ValueError, match="finite for the PowerSGD codec"):
        PowerSGDCodec(rank=2).encode(x)


def test_powersgd_float32_overflow_falls_back_to_the_reference():
    x = torch.full((100,), 3e38)  # finite, but M Q overflows float32: the float64 path says so
    with pytest.raises(ValueError, match="does not fit float32"):
        PowerSGDCodec(rank=2).encode(x)
