import math

import numpy as np
import pytest
import torch

from lowbit.codecs import (
    CODECS,
    Codec,
    CodecKind,
    IdentityCodec,
    MinMaxCodec,
    ModuloCodec,
    Payload,
    UniformCodec,
    centered_mod,
    make_codec,
    pack_bits,
    pack_wide,
    packed_nbytes,
    shared_generator,
    unpack_bits,
    unpack_wide,
)
from lowbit.codecs.kernels import codec_path
from lowbit.codecs.quantize import error_bound, round_to_int
from lowbit.codecs.radix import levels_nbytes

LENGTHS = [0, 1, 7, 13, 1001]


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _random_codes(n, b, seed=0):
    rng = np.random.default_rng(seed + 97 * b + n)
    c = rng.integers(0, 2**b, size=n, dtype=np.int64)
    if n:
        c[0] = 2**b - 1  # always exercise the largest code
    return torch.from_numpy(c)


def _reference_pack(codes, b):
    """Independent reference: LSB-first bit stream via numpy."""
    c = codes.numpy().astype(np.uint64)
    bits = ((c[:, None] >> np.arange(b, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8).reshape(-1)
    return np.packbits(bits, bitorder="little")


# --- packing ------------------------------------------------------------------


@pytest.mark.parametrize("b", range(1, 9))
@pytest.mark.parametrize("n", LENGTHS)
def test_pack_bits_roundtrip(b, n):
    codes = _random_codes(n, b)
    data = pack_bits(codes, b)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert data.numel() == math.ceil(n * b / 8) == packed_nbytes(n, b)
    np.testing.assert_array_equal(data.numpy(), _reference_pack(codes, b))
    out = unpack_bits(data, b, n)
    assert torch.equal(out.to(torch.int64), codes)


@pytest.mark.parametrize("b", range(1, 33))
@pytest.mark.parametrize("n", [1, 7, 13, 1001])
def test_pack_wide_roundtrip(b, n):
    codes = _random_codes(n, b)
    data = pack_wide(codes, b)
    assert data.numel() == math.ceil(n * b / 8)
    np.testing.assert_array_equal(data.numpy(), _reference_pack(codes, b))
    assert torch.equal(unpack_wide(data, b, n), codes)
    if b <= 8:
        assert torch.equal(data, pack_bits(codes, b))


def test_pack_layout_and_dtypes():
    assert pack_bits(torch.tensor([1, 0, 1, 1]), 1).tolist() == [0b1101]
    assert pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 3).tolist() == [1 | (2 << 3)]
    assert pack_wide(torch.tensor([2**32 - 1]), 32).tolist() == [255] * 4
    assert pack_bits(torch.tensor([3, 1], dtype=torch.int32), 2).tolist() == [3 | (1 << 2)]


def test_pack_errors():
    for b in (0, 9):
        with pytest.raises(ValueError, match=f"bits must be in 1..8, got {b}"):
            pack_bits(torch.tensor([0]), b)
        with pytest.raises(ValueError, match="bits must be in 1..8"):
            unpack_bits(torch.zeros(1, dtype=torch.uint8), b, 1)
    with pytest.raises(ValueError, match="bits must be in 1..32"):
        pack_wide(torch.tensor([0]), 33)
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits(torch.tensor([0, 4]), 2)
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits(torch.tensor([-1, 0]), 2)
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_wide(torch.tensor([2**32]), 32)
    with pytest.raises(TypeError):
        pack_bits(torch.tensor([0.0]), 2)
    with pytest.raises(ValueError, match="need exactly"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 7)


# --- rounding -----------------------------------------------------------------


def test_round_to_int():
    v = torch.tensor([-1.75, -0.5, 0.0, 0.25, 2.5, 7.9], dtype=torch.float64)
    assert torch.equal(round_to_int(v, "nearest"), torch.round(v))
    g = _gen(1)
    draws = torch.stack([round_to_int(v, "stochastic", g) for _ in range(4000)])
    assert torch.all((draws == torch.floor(v)) | (draws == torch.ceil(v)))
    se = 0.5 / math.sqrt(len(draws))
    assert torch.all((draws.mean(0) - v).abs() < 5 * se)
    assert round_to_int(v.float(), "stochastic", g).dtype == torch.float32
    with pytest.raises(ValueError, match="rounding"):
        round_to_int(v, "floor")
    assert error_bound(0.5, "stochastic") == 0.5 and error_bound(0.5, "nearest") == 0.25


# --- every codec: honest bytes, wire round trip ---------------------------------

CODEC_CASES = [
    IdentityCodec(),
    UniformCodec(step=0.01),
    UniformCodec(step=0.3, rounding="nearest"),
    *[MinMaxCodec(bits=b) for b in range(1, 9)],
    MinMaxCodec(bits=3, rounding="stochastic"),
    *[ModuloCodec(bits=b, theta=0.5) for b in range(2, 9)],
    ModuloCodec(bits=1, theta=0.5, rounding="nearest"),
]


def _data_bytes(codec, payload, n):
    if isinstance(codec, IdentityCodec):
        return 4 * n
    if isinstance(codec, UniformCodec):  # the header's last field: the codes' span
        top = int.from_bytes(bytes(payload.header[-4:].tolist()), "little")
        return levels_nbytes(n, max(2, top + 1))
    return math.ceil(n * codec.bits / 8)


@pytest.mark.parametrize("codec", CODEC_CASES, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
def test_payload_honest_bytes(codec, n):
    assert isinstance(codec, Codec) and CODECS[codec.name] is type(codec)
    x = torch.randn(n, generator=_gen(n))
    ref = x + 0.1 * (torch.rand(n, generator=_gen(n + 1)) - 0.5)
    p = codec.encode(x, generator=_gen(3))
    assert p.header.numel() == codec.header_nbytes
    assert p.data.numel() == _data_bytes(codec, p, n)
    assert p.nbytes == codec.header_nbytes + p.data.numel()
    wire = p.to_wire()
    assert wire.dtype == torch.uint8 and len(wire) == p.nbytes
    q = codec.payload_from_wire(wire)
    kw = {"ref": ref} if codec.kind is CodecKind.SIDE_INFO else {}
    a, b = codec.decode(p, **kw), codec.decode(q, **kw)
    assert a.shape == (n,) and torch.equal(a, b)
    assert isinstance(codec.bits, (int, float)) and isinstance(codec.unbiased, bool)


def test_identity_lossless():
    x = torch.randn(101, dtype=torch.float32)
    c = IdentityCodec()
    p = c.encode(x)
    assert c.name == "fp32" and c.bits == 32 and c.unbiased
    assert torch.equal(c.decode(p), x)
    x.add_(1.0)  # the payload does not alias x
    assert not torch.equal(c.decode(p), x)
    y = c.decode(c.encode(torch.randn(5, dtype=torch.float64)))
    assert y.dtype == torch.float32


# --- uniform and min-max: error bounds and unbiasedness ----------------------------


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_uniform_error_bound(rounding, scale):
    x = scale * torch.randn(2000, generator=_gen(5), dtype=torch.float64)
    c = UniformCodec(step=0.05, rounding=rounding)
    err = (c.decode(c.encode(x, generator=_gen(6)), dtype=torch.float64) - x).abs().max()
    assert err <= c.error_bound * (1 + 1e-9)
    assert c.unbiased == (rounding == "stochastic")


def test_uniform_packs_at_its_number_of_levels():
    c = UniformCodec(step=1.0, rounding="nearest")
    p = c.encode(torch.tensor([5.0, 6.0, 8.0]))
    assert p.header.tolist()[-4:] == [3, 0, 0, 0]  # span 3: 4 levels, 2 bits
    assert p.data.numel() == 1
    p = c.encode(torch.full((9,), -7.0))
    assert p.header.tolist()[-4:] == [0, 0, 0, 0] and torch.equal(c.decode(p), torch.full((9,), -7.0))
    # 3 levels: 5 per byte (mixed radix), on both paths, at 1.6 bits per element for long vectors
    x = torch.randint(-1, 2, (100_000,), generator=_gen(3)).double()
    for path in ("fast", "reference"):
        with codec_path(path):
            p = c.encode(x)
            assert p.data.numel() == 20_000 and torch.equal(c.decode(p, dtype=torch.float64), x)
    with pytest.raises(ValueError, match="step"):
        UniformCodec(step=1e-12).encode(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="step"):
        UniformCodec(step=1.0).encode(torch.tensor([0.0, float("nan")]))


def _mean_decode(codec, x, k=4000, seed=11):
    p = codec.encode(x.repeat(k), generator=_gen(seed))
    return codec.decode(p, dtype=torch.float64).view(k, -1).mean(0)


def test_uniform_unbiased():
    x = torch.randn(64, generator=_gen(8), dtype=torch.float64)
    c = UniformCodec(step=0.1)
    se = (c.step / 2) / math.sqrt(4000)  # std of one draw <= step/2
    assert ((_mean_decode(c, x) - x).abs() < 5 * se).all()


def test_minmax_stochastic_unbiased():
    x = torch.randn(64, generator=_gen(9), dtype=torch.float64)
    c = MinMaxCodec(bits=2, rounding="stochastic")
    assert c.unbiased and not MinMaxCodec().unbiased
    width = float(x.float().max() - x.float().min()) / c.levels
    se = (width / 2) / math.sqrt(4000)
    mean = _mean_decode(c, x.float().double())
    assert ((mean - x.float().double()).abs() < 5 * se).all()


@pytest.mark.parametrize("bits", range(1, 9))
def test_minmax_nearest_error(bits):
    x = 3 * torch.randn(1001, generator=_gen(bits))
    c = MinMaxCodec(bits=bits)
    p = c.encode(x)
    lo, hi = float(x.min()), float(x.max())
    bound = (hi - lo) / (2**bits - 1) / 2
    err = (c.decode(p, dtype=torch.float64) - x.double()).abs().max()
    assert err <= bound * (1 + 1e-6) + 1e-6
    assert torch.equal(c.decode(c.encode(torch.full((5,), 2.5))), torch.full((5,), 2.5))


# --- Moniqua's modulo codec -------------------------------------------------------


def test_centered_mod():
    z = torch.tensor([-3.0, -1.5, -0.5, -1e-20, 0.0, 0.49, 0.5, 1.0, 2.75, 1e3 + 0.25], dtype=torch.float64)
    r = centered_mod(z, 1.0)
    assert ((r >= -0.5) & (r < 0.5)).all()
    k = z - r
    assert torch.allclose(k, torch.round(k))
    assert r[1] == -0.5 and r[6] == -0.5 and r[-1] == 0.25


def test_modulo_properties():
    c = ModuloCodec(bits=2, theta=0.3)
    assert c.delta == 0.25 and math.isclose(c.B_theta, 1.2) and c.kind is CodecKind.SIDE_INFO
    c = ModuloCodec(bits=1, theta=0.3, rounding="nearest")
    assert c.delta == 0.25 and math.isclose(c.B_theta, 1.2)
    assert ModuloCodec(bits=8, theta=1.0, rounding="nearest").delta == 2.0**-9


def _pairs(theta, n, dtype, seed):
    """x (incl. |x| ~ 1e3) and y with |x - y| < theta, many near the +-theta edge."""
    g = _gen(seed)
    x = torch.cat([torch.randn(n, generator=g), 1e3 * torch.randn(n, generator=g)]).double()
    d = (2 * torch.rand(2 * n, generator=g, dtype=torch.float64) - 1) * theta
    edge = torch.rand(2 * n, generator=g) < 0.3
    d = torch.where(edge, torch.sign(d) * theta * (1 - 1e-6), d)
    x, y = x.to(dtype), (x - d).to(dtype)
    for _ in range(4):  # rounding to dtype may cross the edge: step y back towards x
        y = torch.where((x.double() - y.double()).abs() < theta, y, torch.nextafter(y, x))
    assert ((x.double() - y.double()).abs() < theta).all()
    return x, y


MODULO_CASES = [(b, r) for b in range(1, 9) for r in ("stochastic", "nearest") if (b, r) != (1, "stochastic")]


@pytest.mark.parametrize("bits,rounding", MODULO_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("theta", [1e-3, 0.1, 5.0])
def test_lemma2(bits, rounding, dtype, theta):
    c = ModuloCodec(bits=bits, theta=theta, rounding=rounding)
    x, y = _pairs(theta, 500, dtype, seed=bits + 31 * int(theta * 1000))
    x_hat = c.decode(c.encode(x, generator=_gen(bits)), ref=y)
    assert x_hat.dtype == dtype
    err = (x_hat.double() - x.double()).abs()
    tol = 16 * 2.0**-52 * (x.double().abs() + c.B_theta)
    if dtype == torch.float32:
        tol = tol + 2.0**-24 * x.double().abs()  # rounding x_hat to float32
    assert (err <= c.delta * c.B_theta + tol).all(), float((err - c.delta * c.B_theta - tol).max())


def test_lemma2_needs_theta():
    """With |x - y| well beyond theta the receiver picks the wrong cell."""
    c = ModuloCodec(bits=4, theta=0.1)
    B = c.B_theta
    x = torch.randn(1000, generator=_gen(2), dtype=torch.float64)
    d = B * (0.6 + 0.3 * torch.rand(1000, generator=_gen(3), dtype=torch.float64))
    y = x - d
    assert ((x - y).abs() > c.theta).all()
    err = (c.decode(c.encode(x, generator=_gen(4)), ref=y) - x).abs()
    assert (err > c.delta * B).all()


def test_modulo_local_term_and_dtype():
    c = ModuloCodec(bits=3, theta=0.2, rounding="nearest")
    x = torch.randn(50, dtype=torch.float64)
    p = c.encode(x)
    assert ((c.decode(p, ref=x) - x).abs() <= c.delta * c.B_theta + 1e-12).all()  # Algorithm 1 line 4
    h = c.decode(p, ref=x.half())
    assert h.dtype == torch.float16
    with pytest.raises(ValueError, match="ref"):
        c.decode(p)
    with pytest.raises(ValueError, match="ref"):
        c.decode(p, ref=x[:10])
    with pytest.raises(ValueError, match="finite"):
        c.encode(torch.tensor([float("inf")]))


# --- shared randomness ----------------------------------------------------------


@pytest.mark.parametrize("codec", [UniformCodec(step=0.1), ModuloCodec(bits=2, theta=1.0),
                                   MinMaxCodec(bits=2, rounding="stochastic")], ids=repr)
def test_shared_randomness(codec):
    x = torch.randn(500, generator=_gen(0))
    a = codec.encode(x, generator=shared_generator(7, 3, 1)).to_wire()
    b = codec.encode(x, generator=shared_generator(7, 3, 1)).to_wire()
    c = codec.encode(x, generator=shared_generator(7, 3, 2)).to_wire()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# --- clear errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    "factory,field",
    [
        (lambda: MinMaxCodec(bits=0), "bits"),
        (lambda: MinMaxCodec(bits=9), "bits"),
        (lambda: MinMaxCodec(bits=2.5), "bits"),
        (lambda: MinMaxCodec(rounding="up"), "rounding"),
        (lambda: ModuloCodec(bits=0, theta=1.0), "bits"),
        (lambda: ModuloCodec(bits=9, theta=1.0), "bits"),
        (lambda: ModuloCodec(bits=2, theta=0.0), "theta"),
        (lambda: ModuloCodec(bits=2, theta=-1.0), "theta"),
        (lambda: ModuloCodec(bits=2, theta=float("inf")), "theta"),
        (lambda: ModuloCodec(bits=2, theta=float("nan")), "theta"),
        (lambda: ModuloCodec(bits=1, theta=1.0), "bits"),
        (lambda: ModuloCodec(bits=1, theta=1.0, rounding="stochastic"), "delta"),
        (lambda: UniformCodec(step=0.0), "step"),
        (lambda: UniformCodec(step=-0.1), "step"),
        (lambda: UniformCodec(step=0.1, rounding="floor"), "rounding"),
        (lambda: make_codec("nope"), "fp32"),
    ],
)
def test_errors_name_the_field(factory, field):
    with pytest.raises(ValueError, match=field):
        factory()


@pytest.mark.parametrize("kwargs,field", [(dict(theta=1.0), "bits"), (dict(bits=2), "theta")])
def test_modulo_requires_bits_and_theta(kwargs, field):
    with pytest.raises(TypeError, match=field):
        ModuloCodec(**kwargs)


def test_make_codec_and_frozen():
    c = make_codec("modulo", bits=2, theta=0.5)
    assert c == ModuloCodec(bits=2, theta=0.5)
    assert isinstance(make_codec("fp32"), IdentityCodec)
    with pytest.raises(Exception):
        c.bits = 3
    with pytest.raises(TypeError):
        Payload(header=torch.zeros(1), data=torch.zeros(1, dtype=torch.uint8))
