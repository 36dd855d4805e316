"""Triton kernels of the max-norm family against the numba kernels (the reference's
bytes); run by tests/test_triton_interpret.py with TRITON_INTERPRET=1 on CPU tensors.
float64 inputs give the same codes; float32 codes differ by one level on a small
fraction (the float32 ratio), and the decodes stay within the stated slack."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import MultiScaleMaxNormCodec, QSGDMaxNormCodec  # noqa: E402
from lowbit.codecs.kernels import cpu_maxnorm as C, gpu_maxnorm as G  # noqa: E402
from lowbit.codecs.maxnorm import _f32_up, _norm_of  # noqa: E402

EPS32 = 2.0 ** -24


def _x(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3).to(dtype)


def _W(x, norm="l2"):
    amax, sq, ok = C.norm_stats(x)
    return _f32_up(_norm_of(amax, sq, norm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_stats(dtype):
    x = _x(5003, dtype)
    amax, sq, ok = G.norm_stats(x)
    a2, s2, ok2 = C.norm_stats(x)
    assert bool(ok) and ok2 and float(amax) == a2 and abs(float(sq) - s2) <= 1e-12 * s2
    assert all(isinstance(v, t) for v, t in zip((amax, sq, ok), (float, float, bool)))  # read together
    x[17] = float("nan")
    assert not G.norm_stats(x)[2]
    assert G.norm_stats(x[:0]) == (0.0, 0.0, True)


@pytest.mark.parametrize("bits", [2, 3, 8, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qsgd_codes_and_decode(bits, dtype):
    c = QSGDMaxNormCodec(bits=bits)
    x = _x(4099, dtype, bits)
    W = _W(x)
    s = c.levels
    dt = C.code_dtype(bits)
    g, gf = G.qsgd_encode(x, W, s, s, 999, dt)
    r, rf = C.qsgd_encode(x, W, s, s, 999, dt)
    assert int(gf) == 0 and rf == 0
    differ = g != r
    assert float(differ.float().mean()) <= (max(1e-3, 20 * s * EPS32) if dtype == torch.float32 else 0.0)
    assert bool(((g.long() - r.long()).abs()[differ] == 1).all())
    for out in (torch.float32, torch.float64):
        yg = G.qsgd_decode(g, s, W, s, 1, out)
        yr = C.qsgd_decode(g, s, W, s, 1, out)
        assert yg.dtype == out
        tol = (2 * EPS32 if out == torch.float32 else 1e-15) * W
        assert float((yg.double() - yr.double()).abs().max()) <= tol


@pytest.mark.parametrize("scales", [(2, 6), (1, 3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multiscale_index_codes_and_decode(scales, dtype):
    c = MultiScaleMaxNormCodec(scales=scales)
    x = _x(3001, dtype, 5)
    W = _W(x)
    lev = torch.tensor(c.levels, dtype=torch.float64)
    gi, gf = G.ms_index(x, W, lev)
    ri, rf = C.ms_index(x, W, lev)
    assert int(gf) == 0 and float((gi != ri).float().mean()) <= (1e-3 if dtype == torch.float32 else 0.0)
    gc, gf = G.ms_encode_int(x, W, lev, ri, 5)
    rc, rf = C.ms_encode_int(x, W, lev, ri, 5)
    assert int(gf) == 0 and float((gc != rc).float().mean()) <= (1e-3 if dtype == torch.float32 else 0.0)
    g8, _ = G.ms_encode_int(x, W, lev, ri, 5, torch.int8)  # straight in the sum dtype: the same codes
    assert g8.dtype == torch.int8 and torch.equal(g8.to(torch.int64), gc)
    dt = C.code_dtype(c.bits)
    gw, _ = G.ms_encode_words(x, W, lev, c.code_bits, 5, dt)
    rw, _ = C.ms_encode_words(x, W, lev, c.code_bits, 5, dt)
    assert float((gw != rw).float().mean()) <= (2e-3 if dtype == torch.float32 else 0.0)
    yg, f1 = G.ms_decode_words(rw, c.code_bits, W, lev, torch.float64)
    yr, f2 = C.ms_decode_words(rw, c.code_bits, W, lev, torch.float64)
    assert int(f1) == 0 and torch.allclose(yg, yr, rtol=1e-15, atol=0)
    ys, _ = G.ms_decode_sum(rc, ri, W, lev, 3, torch.float32)
    yr2, _ = C.ms_decode_sum(rc, ri, W, lev, 3, torch.float32)
    assert float((ys - yr2).abs().max()) <= 2 * EPS32 * W


def test_flags():
    x = torch.tensor([1.0, -3.0, float("inf"), 0.5])
    assert int(G.qsgd_encode(x, 2.0, 3, 0, 1, torch.int64)[1]) & G.FLAG_NONFINITE
    x = torch.tensor([1.0, -3.0, 0.5])
    assert int(G.qsgd_encode(x, 2.0, 3, 0, 1, torch.int64)[1]) == G.FLAG_OVER
    lev = torch.tensor([3.0, 63.0], dtype=torch.float64)
    assert int(G.ms_encode_int(x, 3.0, lev, torch.tensor([0, 0, 5]), 1)[1]) & G.FLAG_INDEX
    assert int(G.ms_encode_int(x, 3.0, lev, torch.tensor([1, 1, 1]), 1)[1]) & G.FLAG_LEVEL
    assert int(G.ms_decode_sum(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 0]), 3.0, lev, 1, torch.float32)[1])
