"""The frame checks made cheap for the fast path (issue 32; benchmarks/frame_checks_cost.py) decide
exactly as the checks they replaced: the modulo decode's range of ``ref`` from the kernel's integer
max of the magnitudes' bits, PowerSGD's factor bounds in one kernel call, each at its boundary, with
NaN and inf, on the fast path and the reference."""

import math
import struct

import numpy as np
import pytest
import torch

from lowbit.codecs import ModuloCodec, Payload, PayloadError, PowerSGDCodec, shared_generator
from lowbit.codecs.kernels import codec_path
from lowbit.codecs.modulo import modulo_limit
from lowbit.codecs.powersgd import P_SLACK

PATHS = ("fast", "reference")


def _next_up(v: float, dtype) -> float:
    """The next value of ``dtype`` above ``v`` (a float of that dtype)."""
    return float(np.nextafter(np.array(v, dtype=dtype), np.array(np.inf, dtype=dtype)))


def _largest_within(lim: float, dtype) -> float:
    """The largest value of ``dtype`` at most ``lim``."""
    v = np.array(lim, dtype=dtype)
    if float(v) > lim:
        v = np.nextafter(v, np.array(-np.inf, dtype=dtype))
    return float(v)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", [2, 8])
def test_modulo_decode_refuses_a_ref_exactly_beyond_its_range(path, dtype, bits):
    c = ModuloCodec(bits=bits, theta=0.1)
    lim = modulo_limit(c.B_theta, c.levels)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    at = _largest_within(lim, np_dtype)
    beyond = _next_up(at, np_dtype)
    n = 300
    with codec_path(path):
        p = c.encode(torch.zeros(n))
        for sign in (1.0, -1.0):
            for pos in (0, 137, n - 1):  # the first, a middle and the last element
                ref = torch.zeros(n, dtype=dtype)
                ref[pos] = sign * at
                assert c.decode(p, ref=ref).dtype == dtype  # at the limit: decoded
                ref[pos] = sign * beyond
                with pytest.raises(OverflowError, match=r"ref is out of the modulo codec's range") as e:
                    c.decode(p, ref=ref)
                assert f"{beyond:.6g}" in str(e.value)
        ref = torch.zeros(n, dtype=dtype)
        ref[5] = math.inf
        with pytest.raises(OverflowError, match="reaches inf"):
            c.decode(p, ref=ref)
        ref = torch.zeros(n, dtype=dtype)
        ref[5] = math.nan  # a NaN is not beyond the range (it decodes to NaN, as before the checks)
        assert bool(torch.isnan(c.decode(p, ref=ref)[5]))
        ref[200] = -beyond  # a NaN does not hide a value beyond the range (its bits are the largest)
        with pytest.raises(OverflowError, match=r"ref is out of the modulo codec's range"):
            c.decode(p, ref=ref)


def test_modulo_decode_of_half_refs_and_large_in_range_values():
    """A float16/bfloat16 ``ref`` is widened for the kernel; in-range values of any size decode as
    the reference does."""
    c = ModuloCodec(bits=4, theta=0.1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g) * 1e6
    ref = x + (torch.rand(1000, generator=g) - 0.5) * 0.01
    p = c.encode(x, generator=shared_generator(0, 0, 0))
    fast = c.decode(p, ref=ref)
    with codec_path("reference"):
        slow = c.decode(p, ref=ref)
    assert torch.equal(fast, slow)
    for dt in (torch.float16, torch.bfloat16):
        small = torch.zeros(1000, dtype=dt)
        out = c.decode(c.encode(torch.zeros(1000)), ref=small)
        assert out.dtype == dt and bool((out == 0).all())


def _with_factor(p: Payload, index: int, value: float) -> Payload:
    data = p.data.clone()
    data[4 * index:4 * index + 4] = torch.frombuffer(bytearray(struct.pack("<f", value)), dtype=torch.uint8)
    return Payload(header=p.header, data=data)


@pytest.mark.parametrize("path", PATHS)
def test_powersgd_factor_bounds_at_their_boundary(path):
    c = PowerSGDCodec(rank=2)
    n_el = 1000
    p = c.encode(torch.randn(n_el, generator=torch.Generator().manual_seed(1)), generator=shared_generator(0, 0, 0))
    n, m, r = c.matrix_shape(n_el)
    p_at = _largest_within(1 + P_SLACK, np.float32)
    q_at = _largest_within(c.q_limit(n_el), np.float32)
    with codec_path(path):
        for i, at in ((0, p_at), (n * r - 1, p_at), (n * r, q_at), ((n + m) * r - 1, q_at)):
            for sign in (1.0, -1.0):
                c.decode(_with_factor(p, i, sign * at))  # at the bound: decoded
                c.factors(_with_factor(p, i, sign * at))
                bad = _with_factor(p, i, sign * _next_up(at, np.float32))
                for call in (c.decode, c.factors):
                    with pytest.raises(PayloadError, match="factors P within"):
                        call(bad)
            for v in (math.nan, math.inf):
                with pytest.raises(PayloadError, match="factors P within"):
                    c.decode(_with_factor(p, i, v))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [3, 7])
def test_randk_rescale_check_at_its_boundary(path, k):
    """RandK around fp32 (the kept values as they are): a kept value whose float64 product with
    d / k is float32's largest value or less decodes; the next float32 up, a NaN or an inf is a
    PayloadError, wherever it sits among the kept values."""
    from lowbit.codecs import IdentityCodec, RandKCodec

    n = 10
    r = RandKCodec(IdentityCodec(), k=k, seed=11)
    f32_max = float(np.finfo(np.float32).max)
    factor = n / k
    at = float(np.float32(f32_max / factor))
    while at * factor > f32_max:  # the largest float32 whose product fits
        at = float(np.nextafter(np.float32(at), np.float32(0)))
    while float(np.nextafter(np.float32(at), np.float32(np.inf))) * factor <= f32_max:
        at = float(np.nextafter(np.float32(at), np.float32(np.inf)))
    beyond = _next_up(at, np.float32)
    with codec_path(path):
        p = r.encode(torch.zeros(n))
        for j in range(k):
            for v, ok in ((at, True), (-at, True), (beyond, False), (-beyond, False), (math.nan, False),
                          (math.inf, False)):
                vals = torch.zeros(k)
                vals[j] = v
                data = p.data.clone()
                data[:4 * k] = vals.view(torch.uint8)
                bad = Payload(header=p.header, data=data)
                if ok:
                    assert bool(torch.isfinite(r.decode(bad)).all())
                else:
                    with pytest.raises(PayloadError, match="d / k"):
                        r.decode(bad)
        with pytest.raises(ValueError, match="random-k codec's range"):
            r.encode(torch.full((n,), beyond))
        r.encode(torch.full((n,), at))


def test_max_abs_is_torchs_abs_max():
    from lowbit.codecs.kernels import cpu_kernels, fast_backend

    if fast_backend(torch.empty(0)) != "numba":
        pytest.skip("the numba kernels do not run here (no numba, or it compiles for another CPU)")
    K = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.randn(1001, generator=g).to(dt) * 3
        assert K.max_abs(x) == float(x.abs().max())
        x[500] = -1e4
        assert K.max_abs(x) == float(x.abs().max()) >= 9984  # 1e4 in the dtype
        x[7] = math.inf
        assert K.max_abs(x) == math.inf
        x[9] = math.nan
        assert math.isnan(K.max_abs(x))
    assert K.max_abs(torch.empty(0)) == 0.0


def test_bagua_grid_ok_host_agrees_with_the_tensor_check():
    """The host check of Bagua's min/max (numpy float32 scalars) decides as the 0-d tensor one, over
    ordinary, extreme and out-of-order ranges, ranges at the edge of float32 and non-finite ends."""
    from lowbit.codecs import BaguaMinMaxCodec

    f32 = np.finfo(np.float32)
    edge = [0.0, -0.0, 1e-45, 1e-38, 1e-7, 0.5, 1.0, 3.0, 1e10, 9.9e27, 1e28, 1.1e28, 1e30, 1e36, 1.3e36, 1.4e36,
            1e37, 1e38, 1.7e38, 3e38, float(f32.max), math.inf, math.nan]
    vals = sorted({v for e in edge for v in (e, -e)}, key=lambda v: (math.isnan(v), v))
    g = np.random.default_rng(0)
    pairs = [(a, b) for a in vals for b in vals]
    for _ in range(3000):  # near the largest grids that still fit: both ends scaled by one random factor
        e = float(g.uniform(27, 38.6))
        a, b = np.clip(sorted(g.uniform(-1, 1, 2) * 10.0 ** e), -f32.max, f32.max)
        pairs.append((float(np.float32(a)), float(np.float32(b))))
    disagree = [(lo, hi) for lo, hi in pairs
                if BaguaMinMaxCodec.grid_ok_host(lo, hi)
                != bool(BaguaMinMaxCodec.grid_ok(torch.tensor(lo, dtype=torch.float32),
                                                 torch.tensor(hi, dtype=torch.float32)))]
    assert not disagree, disagree[:5]
    assert sum(BaguaMinMaxCodec.grid_ok_host(lo, hi) for lo, hi in pairs) > 100  # both answers are exercised
    assert sum(not BaguaMinMaxCodec.grid_ok_host(lo, hi) for lo, hi in pairs) > 100


def test_the_side_by_side_benchmark_runs_each_tree_in_its_own_worker():
    """benchmarks/frame_checks_cost.py, A/A on this tree at a small size: both workers import this
    tree's lowbit, every selected (case, operation) gets one ratio per round, the report formats."""
    import importlib.util
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("frame_checks_cost",
                                                  os.path.join(repo, "benchmarks", "frame_checks_cost.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rep = bench.run(repo, repo, 1000, 2, 0.002, ["fp32", "modulo b=2"])
    assert rep["before"] == rep["after"] == os.path.join(os.path.realpath(repo), "lowbit", "__init__.py")
    keys = {(r["case"], r["op"]) for r in rep["rows"]}
    assert keys == {("fp32", "encode"), ("fp32", "decode"), ("modulo b=2", "encode"), ("modulo b=2", "decode"),
                    ("modulo b=2", "decode_hashed")}
    for r in rep["rows"]:
        assert len(r["rounds"]) == 2 and 0 < r["min"] <= r["ratio"] <= r["max"] < float("inf")
    assert "modulo b=2" in bench.format_report(rep)
