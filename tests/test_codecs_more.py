import math
import sys

import numpy as np
import pytest
import torch

from lowbit.codecs import Codec, CodecKind, ModuloCodec, pack_bits
from lowbit.codecs.entropy import (
    ENTROPY_METHODS,
    EntropyCodedCodec,
    ans_overhead_nbytes,
    empirical_entropy_bits,
    entropy_code,
    entropy_decode,
)
from lowbit.codecs.lowp import HalfCodec
from lowbit.codecs.powersgd import PowerSGDCodec
from lowbit.codecs.qsgd import QSGDCodec
from lowbit.codecs.radix import radix_group
from lowbit.codecs.sign import SignCodec
from lowbit.codecs.terngrad import TernGradCodec

LENGTHS = [1, 7, 1001]


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _has_constriction():
    try:
        import constriction  # noqa: F401
    except ImportError:
        return False
    return True


needs_constriction = pytest.mark.skipif(not _has_constriction(), reason="constriction is not installed")


# --- wire sizes: nbytes = header + packed data ------------------------------------------


def _near_square(N):
    n = math.ceil(math.sqrt(N))
    while (n - 1) ** 2 >= N:  # guard against float sqrt rounding
        n -= 1
    while n * n < N:
        n += 1
    return n, math.ceil(N / n)


def _expected(codec, n):
    """(header bytes, data bytes), computed independently of the codec."""
    if isinstance(codec, QSGDCodec):
        L = 2 * codec.levels + 1
        if L > 255:  # plain packing at ceil(log2 L) bits
            codes = math.ceil(n * math.ceil(math.log2(L)) / 8)
        else:  # mixed radix: groups of g codes in b bits, a last group of r codes in ceil(r log2 L) bits
            g, b = radix_group(L)
            q, r = divmod(n, g)
            codes = math.ceil((q * b + (L ** r - 1).bit_length()) / 8)
        if codec.bucket is None:
            return 8, codes  # numel + float32 norm
        return 4, 4 * math.ceil(n / codec.bucket) + codes
    if isinstance(codec, TernGradCodec):
        return 8, math.ceil(n / 5)  # 5 trits per byte
    if isinstance(codec, SignCodec):
        return (4 if codec.scale == "none" else 8), math.ceil(n / 8)
    if isinstance(codec, HalfCodec):
        return 4, 2 * n
    if isinstance(codec, PowerSGDCodec):
        rows, cols = _near_square(n)
        r = min(codec.rank, rows, cols)
        return 4, 4 * (rows + cols) * r
    raise AssertionError(codec)


WIRE_CASES = [
    QSGDCodec(levels=1),
    QSGDCodec(levels=2),
    QSGDCodec(levels=7),
    QSGDCodec(levels=127),
    QSGDCodec(levels=4, bucket=3),
    QSGDCodec(levels=1, bucket=512),
    TernGradCodec(),
    SignCodec(),
    SignCodec(scale="rms"),
    SignCodec(scale="none"),
    HalfCodec("fp16"),
    HalfCodec("bf16"),
    PowerSGDCodec(rank=1),
    PowerSGDCodec(rank=4),
    PowerSGDCodec(rank=100),
]


@pytest.mark.parametrize("codec", WIRE_CASES, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
def test_wire_size(codec, n):
    assert isinstance(codec, Codec) and codec.kind is CodecKind.PLAIN
    x = torch.randn(n, generator=_gen(n))
    p = codec.encode(x, generator=_gen(1))
    head, data = _expected(codec, n)
    assert p.header.numel() == codec.header_nbytes == head <= 32
    assert p.data.numel() == data
    assert p.nbytes == head + data
    wire = p.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == p.nbytes
    a, b = codec.decode(p), codec.decode(codec.payload_from_wire(wire))
    assert a.shape == (n,) and a.dtype == torch.float32 and torch.equal(a, b)
    assert isinstance(codec.bits, float) and isinstance(codec.unbiased, bool)


@pytest.mark.parametrize("codec", [QSGDCodec(levels=3), QSGDCodec(levels=3, bucket=4), TernGradCodec(),
                                   SignCodec(), HalfCodec(), PowerSGDCodec(rank=2)], ids=repr)
def test_empty_and_zero(codec):
    p = codec.encode(torch.zeros(0))
    assert codec.decode(p).shape == (0,)
    z = torch.zeros(9)
    assert torch.equal(codec.decode(codec.encode(z, generator=_gen(0))).abs(), z)


@pytest.mark.parametrize("codec", [QSGDCodec(levels=3), QSGDCodec(levels=3, bucket=4), TernGradCodec(),
                                   SignCodec(), HalfCodec(), HalfCodec("bf16"), PowerSGDCodec(rank=2)], ids=repr)
def test_non_finite_rejected(codec):
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            codec.encode(torch.tensor([1.0, bad, 2.0]))


def test_qsgd_codes_are_sign_and_level():
    c = QSGDCodec(levels=2)
    x = torch.tensor([3.0, -4.0, 0.0])  # norm 5: levels 1.2 and 1.6 of 2
    for seed in range(20):
        y = c.decode(c.encode(x, generator=_gen(seed)), dtype=torch.float64)
        assert set(y.tolist()) <= {0.0, 2.5, 5.0, -2.5, -5.0}
        assert y[0] >= 0 and y[1] <= 0 and y[2] == 0
    assert c.code_bits == 3 and QSGDCodec(levels=1).code_bits == 2 and QSGDCodec(levels=4).code_bits == 4
    g, b = radix_group(3)  # 3 codes for s = 1: 5 trits per byte, plus a 32-bit norm per 64 elements
    assert QSGDCodec(levels=1, bucket=64).bits == b / g + 32 / 64 == 2.1


# --- unbiasedness -------------------------------------------------------------------


def test_qsgd_unbiased():
    x = torch.randn(64, generator=_gen(2), dtype=torch.float64)
    c = QSGDCodec(levels=2)
    assert c.unbiased
    k = 2000
    g = _gen(3)
    mean = torch.stack([c.decode(c.encode(x, generator=g), dtype=torch.float64) for _ in range(k)]).mean(0)
    se = float(x.norm()) / c.levels / 2 / math.sqrt(k)  # std of one draw <= ||x|| / s / 2
    assert ((mean - x).abs() < 5 * se).all()


def test_qsgd_bucketed_unbiased():
    x = torch.randn(50, generator=_gen(4), dtype=torch.float64)
    c = QSGDCodec(levels=3, bucket=50)  # each bucket is one copy of x
    k = 4000
    y = c.decode(c.encode(x.repeat(k), generator=_gen(5)), dtype=torch.float64).view(k, -1)
    se = float(x.norm()) / c.levels / 2 / math.sqrt(k)
    assert ((y.mean(0) - x).abs() < 5 * se).all()


def test_terngrad_unbiased():
    x = torch.randn(64, generator=_gen(6), dtype=torch.float64)
    c = TernGradCodec()
    assert c.unbiased and c.bits == 8 / 5  # 5 trits per byte
    k = 4000
    y = c.decode(c.encode(x.repeat(k), generator=_gen(7)), dtype=torch.float64).view(k, -1)
    scale = float(x.abs().max())
    assert set(torch.unique(y / scale).round().tolist()) <= {-1.0, 0.0, 1.0}
    se = scale / 2 / math.sqrt(k)
    assert ((y.mean(0) - x).abs() < 5 * se).all()


def test_sign_is_biased():
    x = torch.tensor([4.0, 1.0, -0.5, -0.25, 0.0])
    c = SignCodec()
    assert not c.unbiased and c.bits == 1
    y = c.decode(c.encode(x))
    s = float(x.abs().mean())
    assert torch.allclose(y, s * torch.tensor([1.0, 1, -1, -1, 1]))
    assert (y - x).abs().max() > 1.0  # deterministic, so E[decode] = y != x
    assert torch.equal(SignCodec("none").decode(SignCodec("none").encode(x)), torch.tensor([1.0, 1, -1, -1, 1]))
    r = SignCodec("rms").decode(SignCodec("rms").encode(x))
    assert math.isclose(float(r.norm()), float(x.norm()), rel_tol=1e-6)


def test_shared_randomness():
    x = torch.randn(300, generator=_gen(0))
    for c in (QSGDCodec(levels=2), TernGradCodec()):
        a = c.encode(x, generator=_gen(9)).to_wire()
        assert torch.equal(a, c.encode(x, generator=_gen(9)).to_wire())
        assert not torch.equal(a, c.encode(x, generator=_gen(10)).to_wire())


# --- QSGD variance bound (Alistarh et al. 2017, Lemma 3.1) -----------------------------


def _qsgd_exact_var(x, s):
    norm = float(x.norm())
    v = x.abs() / norm * s
    p = v - v.floor()
    return float(((norm / s) ** 2 * p * (1 - p)).sum())


@pytest.mark.parametrize("s", [1, 2, 5, 16])
@pytest.mark.parametrize("kind", ["gauss", "flat"])
def test_qsgd_variance_bound(s, kind):
    n = 256
    x = torch.randn(n, generator=_gen(s), dtype=torch.float64) if kind == "gauss" else torch.ones(n, dtype=torch.float64)
    c = QSGDCodec(levels=s)
    bound = min(n / s**2, math.sqrt(n) / s) * float(x.norm()) ** 2
    assert math.isclose(c.variance_bound(n) * float(x.norm()) ** 2, bound)
    exact = _qsgd_exact_var(x, s)
    assert exact <= bound
    k = 400
    g = _gen(s + 100)
    errs = torch.tensor([float((c.decode(c.encode(x, generator=g), dtype=torch.float64) - x).pow(2).sum())
                         for _ in range(k)])
    se = float(errs.std()) / math.sqrt(k) + 1e-12
    assert abs(float(errs.mean()) - exact) < 5 * se
    assert float(errs.mean()) <= bound + 5 * se


def test_qsgd_bucket_variance_bound():
    d, k = 32, 300
    x = torch.randn(10 * d, generator=_gen(12), dtype=torch.float64)
    c = QSGDCodec(levels=2, bucket=d)
    bound = c.variance_bound(d) * float(x.norm()) ** 2  # summed over buckets
    g = _gen(13)
    errs = [float((c.decode(c.encode(x, generator=g), dtype=torch.float64) - x).pow(2).sum()) for _ in range(k)]
    assert np.mean(errs) <= bound


# --- HalfCodec ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float64])
def test_half_error_bounds(dtype, xdtype):
    c = HalfCodec(dtype)
    g = _gen(20)
    mags = [1e-9, 1e-6, 1e-3, 1.0, 1e3, 3e4] + ([1e20, 1e37] if dtype == "bf16" else [])
    x = torch.cat([m * torch.randn(500, generator=g, dtype=torch.float64) for m in mags])
    x = x.clamp(-65000, 65000).to(xdtype) if dtype == "fp16" else x.to(xdtype)
    p = c.encode(x)
    assert p.data.numel() == 2 * x.numel()
    y = c.decode(p, dtype=torch.float64)
    err = (y - x.double()).abs()
    assert (err <= c.rel_error * x.double().abs() + c.abs_error).all()
    assert torch.equal(c.decode(p), x.to(c.torch_dtype).float())


def test_half_overflow():
    c = HalfCodec("fp16")
    ok = c.decode(c.encode(torch.tensor([65504.0, -65519.0])))
    assert ok.tolist() == [65504.0, -65504.0]
    with pytest.raises(ValueError, match="overflows fp16"):
        c.encode(torch.tensor([1.0, 7e4]))
    with pytest.raises(ValueError, match="overflows fp16"):
        c.encode(torch.tensor([-65520.0]))
    with pytest.raises(ValueError, match="overflows bf16"):
        HalfCodec("bf16").encode(torch.tensor([1.0, 1e39], dtype=torch.float64))
    assert HalfCodec("bf16").decode(HalfCodec("bf16").encode(torch.tensor([7e4]))).item() == 70144.0


# --- PowerSGD ----------------------------------------------------------------------


def _low_rank(rows, cols, r, seed):
    g = _gen(seed)
    return torch.randn(rows, r, generator=g, dtype=torch.float64) @ torch.randn(r, cols, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("rows,cols,r", [(30, 30, 3), (43, 42, 2), (10, 10, 1)])
def test_powersgd_recovers_low_rank(rows, cols, r):
    N = rows * cols
    c = PowerSGDCodec(rank=r)
    assert c.matrix_shape(N) == (rows, cols, r)
    M = _low_rank(rows, cols, r, seed=rows)
    x = M.reshape(-1)
    state = c.init_state(N, _gen(1))
    assert state.shape == (cols, r) and state.dtype == torch.float32
    for _ in range(2):
        p, state = c.encode_with_state(x, state)
        assert p.nbytes == 4 + 4 * (rows + cols) * r
        P, Q = c.factors(p)
        assert torch.equal(Q, state)
    y = c.decode(p, dtype=torch.float64)
    assert float((y - x).norm() / x.norm()) < 1e-5
    assert torch.allclose(P.T.double() @ P.double(), torch.eye(r, dtype=torch.float64), atol=1e-5)


def test_powersgd_error_decreases_with_rank():
    rows = cols = 40
    g = _gen(30)
    U, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    M = U @ torch.diag(1.0 / torch.arange(1, rows + 1, dtype=torch.float64)) @ V.T
    x = M.reshape(-1)
    errs = []
    for r in (1, 2, 4, 8, 16):
        c = PowerSGDCodec(rank=r)
        state = c.init_state(x.numel(), _gen(r))
        for _ in range(4):
            p, state = c.encode_with_state(x, state)
        e = float((c.decode(p, dtype=torch.float64) - x).norm() / x.norm())
        errs.append(e)
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] < 1.0


def test_powersgd_state_and_cold_start():
    c = PowerSGDCodec(rank=2)
    x = torch.randn(1001, generator=_gen(3))
    cold = c.encode(x, generator=_gen(4))
    warm, q = c.encode_with_state(x, c.init_state(1001, _gen(4)))
    assert torch.equal(cold.to_wire(), warm.to_wire())
    assert float((c.decode(cold) - x).norm()) <= float(x.norm()) * (1 + 1e-5)  # a projection
    _, q2 = c.encode_with_state(x, q)  # warm start accepted
    assert q2.shape == (32, 2) and c.bits_for(1001) == 8 * 4 * 64 * 2 / 1001
    with pytest.raises(ValueError, match="state"):
        c.encode_with_state(x, torch.zeros(31, 2))
    with pytest.raises(ValueError, match="state"):
        c.encode_with_state(x, torch.full((32, 2), float("nan")))


# --- entropy -------------------------------------------------------------------------


def test_empirical_entropy():
    g = _gen(40)
    for k in (2, 4, 16, 256):
        codes = torch.randint(0, k, (200_000,), generator=g)
        assert abs(empirical_entropy_bits(codes) - math.log2(k)) < 0.01
    assert empirical_entropy_bits(torch.full((1000,), 3)) == 0.0
    assert empirical_entropy_bits(torch.zeros(0, dtype=torch.int64)) == 0.0
    assert math.isclose(empirical_entropy_bits(torch.tensor([0, 0, 1, 2])), 1.5)
    assert math.isclose(empirical_entropy_bits(torch.tensor([[-5, 7], [7, -5]], dtype=torch.int8)), 1.0)
    with pytest.raises(TypeError):
        empirical_entropy_bits(torch.rand(4))


def _skewed_codes(n, seed, p=(0.7, 0.2, 0.07, 0.03)):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.choice(len(p), size=n, p=p).astype(np.int64))


def _samples():
    rng = np.random.default_rng(41)
    return [
        b"",
        b"\x00",
        b"\xff" * 7,
        rng.integers(0, 256, 1001, dtype=np.uint8).tobytes(),
        pack_bits(_skewed_codes(4001, 42), 2).numpy().tobytes(),
    ]


@pytest.mark.parametrize("method", ENTROPY_METHODS)
def test_coders_roundtrip(method):
    if method == "ans" and not _has_constriction():
        pytest.skip("constriction is not installed")
    widths = (1, 2, 4, 8) if method == "ans" else (8,)
    for raw in _samples():
        for b in widths:
            blob = entropy_code(raw, method, symbol_bits=b)
            assert isinstance(blob, bytes)
            assert entropy_decode(blob) == raw
            assert entropy_decode(blob, method) == raw
    t = torch.tensor([1, 2, 3, 250], dtype=torch.uint8)
    assert entropy_decode(entropy_code(t, method)) == bytes([1, 2, 3, 250])
    other = "zlib" if method != "zlib" else "bz2"
    with pytest.raises(ValueError, match="method"):
        entropy_decode(entropy_code(b"abc", method), other)


@needs_constriction
def test_ans_size_near_entropy():
    n = 100_000
    codes = _skewed_codes(n, 43)
    data = pack_bits(codes, 2)
    H = empirical_entropy_bits(codes)
    ideal = H * n / 8
    blob = entropy_code(data, "ans", symbol_bits=2)
    model = ans_overhead_nbytes(blob)
    assert model <= 32  # tag + header + 4 counts
    stream = len(blob) - model
    assert 0.99 * ideal <= stream <= 1.05 * ideal, (stream, ideal)
    assert entropy_decode(blob) == data.numpy().tobytes()
    # byte symbols see 4 codes at a time: same rate, larger model
    blob8 = entropy_code(data, "ans")
    assert len(blob8) - ans_overhead_nbytes(blob8) <= 1.05 * ideal
    assert len(blob) < len(entropy_code(data, "bz2"))


def test_ans_missing_constriction(monkeypatch):
    monkeypatch.setitem(sys.modules, "constriction", None)
    with pytest.raises(ImportError, match="pip install constriction"):
        entropy_code(b"abc", "ans")
    assert entropy_decode(entropy_code(b"abc", "zlib")) == b"abc"


def _moniqua_pair(n, seed):
    g = _gen(seed)
    x = 0.02 * torch.randn(n, generator=g, dtype=torch.float64)
    y = x + 0.09 * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)  # |x - y| < theta = 0.1
    return x, y


@pytest.mark.parametrize("method", ENTROPY_METHODS)
@pytest.mark.parametrize("n", [1, 7, 1001])
def test_entropy_coded_modulo(method, n):
    if method == "ans" and not _has_constriction():
        pytest.skip("constriction is not installed")
    inner = ModuloCodec(bits=2, theta=0.1)
    c = EntropyCodedCodec(inner, method)
    assert c.kind is CodecKind.SIDE_INFO and c.unbiased == inner.unbiased and c.bits == 2
    x, y = _moniqua_pair(n, seed=n)
    p = c.encode(x, generator=_gen(5))
    ip = inner.encode(x, generator=_gen(5))
    kw = {"symbol_bits": 2} if method == "ans" else {}
    assert p.nbytes == len(entropy_code(ip.to_wire(), method, **kw)) == p.to_wire().numel()
    assert p.header.numel() == c.header_nbytes == 0
    out = c.decode(p, ref=y)
    assert torch.equal(out, inner.decode(ip, ref=y))
    assert torch.equal(c.decode(c.payload_from_wire(p.to_wire()), ref=y), out)
    assert ((out - x).abs() <= inner.error_bound + 1e-12).all()
    with pytest.raises(ValueError, match="ref"):
        c.decode(p)
    if n == 1001 and method in ("ans", "bz2"):
        assert p.nbytes < ip.nbytes  # skewed codes do compress


@pytest.mark.parametrize("method", ["bz2", "lzma"])
def test_entropy_coded_plain_codecs(method):
    x = torch.randn(1001, generator=_gen(50))
    for inner in (QSGDCodec(levels=2), TernGradCodec(), SignCodec(), HalfCodec(), PowerSGDCodec(rank=2)):
        c = EntropyCodedCodec(inner, method)
        p = c.encode(x, generator=_gen(51))
        assert torch.equal(c.decode(p), inner.decode(inner.encode(x, generator=_gen(51))))
        assert torch.equal(c.decode(p, dtype=torch.float64),
                           inner.decode(inner.encode(x, generator=_gen(51)), dtype=torch.float64))


# --- errors name the field ------------------------------------------------------------


@pytest.mark.parametrize(
    "factory,field",
    [
        (lambda: QSGDCodec(levels=0), "levels"),
        (lambda: QSGDCodec(levels=2.5), "levels"),
        (lambda: QSGDCodec(levels=True), "levels"),
        (lambda: QSGDCodec(levels=2, bucket=0), "bucket"),
        (lambda: QSGDCodec(levels=2, bucket=1.5), "bucket"),
        (lambda: SignCodec(scale="l2"), "scale"),
        (lambda: HalfCodec(dtype="fp8"), "dtype"),
        (lambda: PowerSGDCodec(rank=0), "rank"),
        (lambda: PowerSGDCodec(rank=-3), "rank"),
        (lambda: EntropyCodedCodec(QSGDCodec(levels=2), method="gzip"), "method"),
        (lambda: EntropyCodedCodec("qsgd", method="bz2"), "inner"),
        (lambda: EntropyCodedCodec(QSGDCodec(levels=2), method="bz2", symbol_bits=2), "symbol_bits"),
        (lambda: EntropyCodedCodec(QSGDCodec(levels=2), method="ans", symbol_bits=3), "symbol_bits"),
        (lambda: entropy_code(b"abc", "zip"), "method"),
        (lambda: entropy_code(b"abc", "ans", symbol_bits=5), "symbol_bits"),
        (lambda: entropy_code(b"abc", "bz2", symbol_bits=2), "symbol_bits"),
        (lambda: entropy_decode(b"Qabc"), "tag"),
    ],
)
def test_errors_name_the_field(factory, field):
    with pytest.raises(ValueError, match=field):
        factory()


def test_frozen_and_equal():
    assert QSGDCodec(levels=2) == QSGDCodec(2) and hash(PowerSGDCodec(3)) == hash(PowerSGDCodec(rank=3))
    assert EntropyCodedCodec(TernGradCodec(), "ans") == EntropyCodedCodec(TernGradCodec(), "ans")
    with pytest.raises(Exception):
        QSGDCodec(levels=2).levels = 3
