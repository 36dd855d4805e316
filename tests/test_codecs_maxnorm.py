"""QSGDMaxNorm, multi-scale max-norm and random-k codecs (paper 004): wire sizes,
unbiasedness, the variance bounds of Lemmas 1 and 2, and the summable protocol."""

import math
from dataclasses import dataclass

import pytest
import torch

from lowbit.codecs.base import (
    Codec,
    CodecKind,
    Payload,
    SummableCodec,
    agree_scale,
    is_summable,
    pack_header,
    reduce_scale,
    unpack_header,
)
from lowbit.codecs.maxnorm import MultiScaleMaxNormCodec, QSGDMaxNormCodec
from lowbit.codecs.minmax import MinMaxCodec
from lowbit.codecs.modulo import ModuloCodec
from lowbit.codecs.packing import pack_wide, packed_nbytes, unpack_wide
from lowbit.codecs.radix import level_bits, levels_nbytes
from lowbit.codecs.randk import RandKCodec, global_index_seed

LENGTHS = [0, 1, 2, 7, 13, 1001]
WORLD_SIZES = [1, 2, 3, 8, 64, 1024]


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _vec(n, seed, dtype=torch.float64):
    """Entries of very different magnitudes, so that several scales get used."""
    g = _gen(seed)
    return (torch.randn(n, generator=g, dtype=dtype) * torch.exp(2 * torch.randn(n, generator=g, dtype=dtype)))


# --- bits -> levels ------------------------------------------------------------------------


def test_bits_to_levels():
    for bits in range(2, 33):
        c = QSGDMaxNormCodec(bits=bits)
        assert c.levels == 2 ** (bits - 1) - 1 and c.precision == bits - 1 and c.max_code == c.levels
        # the paper's r = ceil(log2 s) + 1 (s = 1, the ternary case, needs its magnitude bit too)
        assert math.ceil(math.log2(c.levels)) + 1 == bits or (bits == 2 and c.levels == 1)
        # sign + magnitude in 0..s fit exactly `bits` bits, and one more level would not
        assert 2 * c.levels + 1 <= 2**bits < 2 * (c.levels + 1) + 1
    assert QSGDMaxNormCodec(bits=9).levels == 255  # the paper's "QSGD-MN 8" (precision 8)

    ts = MultiScaleMaxNormCodec(scales=(2, 6))  # the paper's two-scale (2, 6)
    assert ts.levels == (3, 63) and ts.index_bits == 1 and ts.code_bits == 3
    assert ts.bits == math.ceil(math.log2(3)) + 1 + math.ceil(math.log2(2)) == 4
    assert MultiScaleMaxNormCodec(scales=[6, 2]) == ts and ts.scales == (2, 6)
    three = MultiScaleMaxNormCodec(scales=(2, 4, 6))
    assert three.levels == (3, 15, 63) and three.index_bits == 2 and three.bits == 5
    one = MultiScaleMaxNormCodec(scales=(4,))
    assert one.index_bits == 0 and one.bits == QSGDMaxNormCodec(bits=5).bits and one.levels == (15,)
    for c in (QSGDMaxNormCodec(), ts):
        assert c.kind is CodecKind.SUMMABLE and c.unbiased and is_summable(c) and isinstance(c, SummableCodec)
    assert QSGDMaxNormCodec().scale_reduce_op == "max" and QSGDMaxNormCodec().scale_reduce_ops == ("max",)
    assert ts.scale_reduce_op == "max" and ts.scale_reduce_ops == ("max", "min")


# --- wire size and the single-message form ----------------------------------------------------

DENSE = [
    QSGDMaxNormCodec(bits=2),
    QSGDMaxNormCodec(bits=3),
    QSGDMaxNormCodec(bits=5, norm="linf"),
    QSGDMaxNormCodec(bits=8),
    QSGDMaxNormCodec(bits=13),
    QSGDMaxNormCodec(bits=32),
    MultiScaleMaxNormCodec(scales=(2, 6)),
    MultiScaleMaxNormCodec(scales=(1, 3, 5), norm="linf"),
    MultiScaleMaxNormCodec(scales=(8, 12)),
    MultiScaleMaxNormCodec(scales=(3,)),
]


@pytest.mark.parametrize("codec", DENSE, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
def test_wire_size_and_roundtrip(codec, n):
    x = _vec(n, n, torch.float32)
    p = codec.encode(x, generator=_gen(1))
    assert codec.header_nbytes <= 32 and p.header.numel() == codec.header_nbytes
    if isinstance(codec, QSGDMaxNormCodec):  # 2s + 1 = 2^bits - 1 levels, mixed radix (plain from 7 bits on)
        data = levels_nbytes(n, codec.num_codes)
        assert codec.num_codes == 2 ** codec.bits - 1 and codec.wire_bits == level_bits(codec.num_codes) <= codec.bits
    else:  # multi-scale words: index and code, plain packing
        data = math.ceil(n * codec.bits / 8)
    assert p.data.numel() == data
    assert p.nbytes == codec.header_nbytes + data
    wire = p.to_wire()
    assert len(wire) == p.nbytes
    y = codec.decode(codec.payload_from_wire(wire))
    assert y.dtype == torch.float32 and y.shape == (n,) and torch.equal(y, codec.decode(p))
    # the payload carries exactly encode_int's codes against the worker's own scale
    scale = agree_scale(codec, [x])
    codes = codec.encode_int(x, scale, _gen(1))
    assert codes.dtype == torch.int64 and int(codes.abs().max()) <= codec.max_code if n else True
    for dt in (torch.int8, torch.int16, torch.int32):  # the codes straight in a narrower dtype that holds them
        if torch.iinfo(dt).max >= codec.max_code:
            narrow = codec.encode_int(x, scale, _gen(1), dt)
            assert narrow.dtype == dt and torch.equal(narrow.to(torch.int64), codes)
        else:
            with pytest.raises(ValueError, match="dtype must be a signed integer dtype holding codes up to"):
                codec.encode_int(x, scale, _gen(1), dt)
    y64 = codec.decode(p, dtype=torch.float64)
    assert torch.equal(y64, codec.decode_sum(codes, scale, 1, dtype=torch.float64))
    if n:  # |x_hat_i| <= W: the reconstruction stays within the shared norm, sign preserved
        W = float(scale if isinstance(scale, torch.Tensor) else scale[0])
        assert float(y64.abs().max()) <= W * (1 + 1e-12)
        assert bool(((torch.sign(y64) == torch.sign(x.double())) | (y64 == 0)).all())


def test_zero_vector_and_exact_levels():
    for codec in (QSGDMaxNormCodec(bits=4), MultiScaleMaxNormCodec(scales=(2, 6))):
        z = torch.zeros(9)
        assert torch.equal(codec.decode(codec.encode(z, generator=_gen())), z)
        assert float(codec.shared_scale(z)) == 0.0
    # values on the grid are reproduced exactly: x = W * l / s
    c = QSGDMaxNormCodec(bits=4, norm="linf")  # s = 7
    x = torch.tensor([7.0, -3.0, 0.0, 1.0, -7.0], dtype=torch.float64) * (2.5 / 7)
    ys = [c.decode(c.encode(x, generator=_gen(seed)), dtype=torch.float64) for seed in range(5)]
    assert all(torch.equal(ys[0], y) for y in ys)  # no randomness on the grid
    assert torch.allclose(ys[0], x, rtol=1e-6, atol=0)  # up to the float32 header's W
    # float32 header: the shared norm is rounded UP, so |x_i| / W <= 1 holds exactly
    x = torch.tensor([1.0 + 2.0**-40, 0.0], dtype=torch.float64)
    W = float(c.shared_scale(x))
    assert W >= float(x[0]) and W == float(torch.tensor(W, dtype=torch.float32))


# --- unbiasedness and the variance bounds (Lemmas 1 and 2) -------------------------------------


def _scale_of(codec, x, W):
    """The scale a worker holding x would use when the shared norm is W (and, multi-scale,
    when another worker forces some coordinates down to coarser scales)."""
    Wt = torch.tensor([W], dtype=torch.float32)
    if isinstance(codec, QSGDMaxNormCodec):
        return Wt
    own = codec.shared_scale(x, (Wt,))
    other = torch.randint(0, len(codec.scales), own.shape, generator=_gen(99)).to(torch.uint8)
    return Wt, reduce_scale("min", [own, other])


def _trials(codec, x, scale, T, seed):
    """T independent quantizations of x at once: coordinates are independent given the scale,
    so x repeated T times (with the scale index repeated) is T trials."""
    n = x.numel()
    big = x.repeat(T)
    sc = scale if isinstance(scale, torch.Tensor) else (scale[0], scale[1].repeat(T))
    y = codec.decode_sum(codec.encode_int(big, sc, _gen(seed)), sc, 1, dtype=torch.float64)
    return y.view(T, n)


def _exact_moments(codec, x, scale):
    """Per-coordinate step W / s_i and p_i = frac(s_i |x_i| / W): variance (W/s_i)^2 p_i (1 - p_i)."""
    W = float(scale if isinstance(scale, torch.Tensor) else scale[0])
    if isinstance(codec, QSGDMaxNormCodec):
        s = torch.full_like(x, float(codec.levels))
    else:
        s = torch.tensor(codec.levels, dtype=torch.float64)[scale[1].long()]
    t = x.abs() * s / W
    p = t - torch.floor(t)
    return W, s, (W / s) ** 2 * p * (1 - p)


LEMMA_CASES = [
    (QSGDMaxNormCodec(bits=2), 400),  # s = 1: the sqrt(n)/s branch of the bound
    (QSGDMaxNormCodec(bits=3), 16),
    (QSGDMaxNormCodec(bits=5, norm="linf"), 400),
    (QSGDMaxNormCodec(bits=9), 400),  # s = 255 > sqrt(n): the n/s^2 branch
    (MultiScaleMaxNormCodec(scales=(2, 6)), 400),
    (MultiScaleMaxNormCodec(scales=(1, 4, 8)), 64),
    (MultiScaleMaxNormCodec(scales=(3, 7), norm="linf"), 400),
]


@pytest.mark.parametrize("codec,n", LEMMA_CASES, ids=repr)
def test_unbiased_and_variance_bound(codec, n):
    T = 2000
    x = _vec(n, 11 + n)
    W = 1.5 * float(codec.shared_scale(x))  # another worker holds the largest norm
    scale = _scale_of(codec, x, W)
    if isinstance(codec, MultiScaleMaxNormCodec):
        assert len(set(scale[1].tolist())) > 1, "the test vector should use several scales"
    y = _trials(codec, x, scale, T, seed=n)
    W, s, var = _exact_moments(codec, x, scale)

    # unbiased: every coordinate's mean within 5 standard errors (exact where the variance is 0)
    # (plus a few steps / T: with p_i near 0 or 1 the count of round-ups is far from normal)
    err = (y.mean(0) - x).abs()
    assert bool((err <= 5 * var.sqrt() / math.sqrt(T) + 8 * (W / s) / T + 1e-12 * W).all())

    # squared error per trial: its mean matches the exact expectation and obeys the lemma
    sq = ((y - x) ** 2).sum(1)
    mean_sq, se = float(sq.mean()), float(sq.std()) / math.sqrt(T)
    assert abs(mean_sq - float(var.sum())) <= 5 * se + 1e-12 * W**2
    s_hat = codec.levels if isinstance(codec, QSGDMaxNormCodec) else codec.levels[0]
    if codec.norm == "l2":
        lemma = (1 + min(n / s_hat**2, math.sqrt(n) / s_hat)) * W**2  # Lemma 1 / Lemma 2 (s_hat = min s_j)
        tight = min(n / s_hat**2, math.sqrt(n) / s_hat) * W**2  # the proof's bound on the variance alone
    else:
        lemma, tight = (1 + n / s_hat**2) * W**2, n / s_hat**2 * W**2
    assert codec.variance_bound(n, torch.tensor([W])) == pytest.approx(lemma, rel=1e-6)
    assert mean_sq <= lemma
    assert mean_sq <= tight + 5 * se


def test_randk_rescaled_unbiased():
    n, k, T = 12, 3, 2500
    x = _vec(n, 5)
    c = RandKCodec(QSGDMaxNormCodec(bits=6), k)  # seed drawn per message: per-worker random-k
    assert c.unbiased and not RandKCodec(QSGDMaxNormCodec(bits=6), k, rescale=False).unbiased
    g = _gen(17)
    ys, hits = [], torch.zeros(n)
    for _ in range(T):
        p = c.encode(x, generator=g)
        ys.append(c.decode(p, dtype=torch.float64))
        hits[c.indices(n, unpack_header("iq", p.header[:12])[1])] += 1  # the seed in the header
    ys = torch.stack(ys)
    assert int((ys != 0).sum(1).max()) <= k
    se = ys.std(0) / math.sqrt(T)
    assert bool(((ys.mean(0) - x).abs() <= 5 * se).all())
    # every coordinate is kept k / n of the time
    assert float(hits.sum()) == T * k and bool(((hits / T - k / n).abs() < 0.05).all())


# --- the summable protocol --------------------------------------------------------------------

SUMMABLE = [
    QSGDMaxNormCodec(bits=4),
    QSGDMaxNormCodec(bits=9, norm="linf"),
    MultiScaleMaxNormCodec(scales=(2, 6)),
    MultiScaleMaxNormCodec(scales=(3, 5, 8), norm="linf"),
    RandKCodec(QSGDMaxNormCodec(bits=5), k=7).with_seed(global_index_seed(3, 10)),
    RandKCodec(MultiScaleMaxNormCodec(scales=(2, 6)), k=7, rescale=False).with_seed(global_index_seed(3, 11)),
]


@pytest.mark.parametrize("codec", SUMMABLE, ids=repr)
@pytest.mark.parametrize("M", WORLD_SIZES)
def test_summable_protocol(codec, M):
    n = 29
    assert is_summable(codec)
    xs = [_vec(n, 1000 * M + m) * (1 + m % 5) for m in range(M)]
    scale = agree_scale(codec, xs)

    # scale round 1: MAX of the workers' norms (or MIN, for ops that say so); round 2: MIN of indices
    r1 = [codec.shared_scale(x) for x in xs]
    first = scale if isinstance(scale, torch.Tensor) else scale[0]
    assert torch.equal(first, torch.stack(r1).amax(0)) and codec.scale_reduce_op == "max"
    if isinstance(scale, tuple):
        r2 = [codec.shared_scale(x, (first,)) for x in xs]
        assert torch.equal(scale[1], torch.stack(r2).amin(0))

    dt = codec.sum_dtype(M)
    need = M * codec.max_code
    assert need <= torch.iinfo(dt).max
    order = [torch.int8, torch.int16, torch.int32, torch.int64]
    if dt is not torch.int8:  # the narrowest: the next narrower type could overflow
        assert need > torch.iinfo(order[order.index(dt) - 1]).max

    codes = [codec.encode_int(x, scale, _gen(m)) for m, x in enumerate(xs)]
    total64 = torch.stack(codes).sum(0)
    acc = torch.zeros_like(codes[0], dtype=dt)
    for q in codes:  # summing in the narrow type, as an all-reduce would
        assert q.dtype == torch.int64 and int(q.abs().max()) <= codec.max_code
        acc = acc + q.to(dt)
    assert acc.dtype == dt and torch.equal(acc.to(torch.int64), total64)

    avg = codec.decode_sum(acc, scale, M, numel=n, dtype=torch.float64)
    decodes = torch.stack([codec.decode(codec.encode(x, generator=_gen(m), scale=scale), dtype=torch.float64)
                           for m, x in enumerate(xs)])
    ref = decodes.mean(0)
    assert avg.shape == (n,)
    assert torch.allclose(avg, ref, rtol=1e-12, atol=1e-12 * float(first.max()))
    assert codec.decode_sum(acc, scale, M, numel=n).dtype == torch.float32


def test_sum_dtype_narrowest_and_worst_case():
    c = QSGDMaxNormCodec(bits=4)  # codes in -7..7
    assert [c.sum_dtype(m) for m in (1, 18, 19, 4681, 4682)] == [
        torch.int8, torch.int8, torch.int16, torch.int16, torch.int32]
    # worst case: every worker sends +7 (|x_0| = W, a 1-sparse vector), deterministically
    for M in (18, 19):
        dt = c.sum_dtype(M)
        x = torch.tensor([2.0, 0.0, 0.0])
        acc = torch.zeros(3, dtype=dt)
        for m in range(M):
            acc = acc + c.encode_int(x, c.shared_scale(x), _gen(m)).to(dt)
        assert int(acc[0]) == 7 * M
    assert c.sum_dtype(18, dtype=torch.int8) is torch.int8
    with pytest.raises(ValueError, match=r"int8.*overflow|overflow.*int8"):
        c.sum_dtype(19, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        QSGDMaxNormCodec(bits=8).sum_dtype(2, dtype=torch.int8)  # 2 * 127 > 127
    assert MultiScaleMaxNormCodec(scales=(2, 6)).sum_dtype(42) is torch.int8  # codes in -3..3
    assert MultiScaleMaxNormCodec(scales=(2, 6)).sum_dtype(43) is torch.int16


def test_sum_dtype_errors():
    with pytest.raises(ValueError, match=r"bits=32.*world_size=8589934592"):
        QSGDMaxNormCodec(bits=32).sum_dtype(2**33)
    assert QSGDMaxNormCodec(bits=32).sum_dtype(2**32) is torch.int64
    with pytest.raises(ValueError, match=r"bits=32.*world_size"):
        MultiScaleMaxNormCodec(scales=(31,)).sum_dtype(2**33)
    with pytest.raises(ValueError, match="bits=.*world_size"):
        RandKCodec(QSGDMaxNormCodec(bits=32), 3, seed=1).sum_dtype(2**40)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="world_size"):
            QSGDMaxNormCodec().sum_dtype(bad)
    with pytest.raises(ValueError, match="dtype"):
        QSGDMaxNormCodec().sum_dtype(2, dtype=torch.float32)
    with pytest.raises(ValueError, match="world_size"):
        QSGDMaxNormCodec().decode_sum(torch.zeros(3, dtype=torch.int64), 1.0, 0)


# --- random-k --------------------------------------------------------------------------------


def test_global_randk_same_indices_everywhere():
    base = RandKCodec(QSGDMaxNormCodec(bits=4), k=10)
    n = 1000
    s3, s4 = global_index_seed(7, 3), global_index_seed(7, 4)
    workers = [dict(run_seed=7, step=3) for _ in range(8)]
    sel = [base.with_seed(global_index_seed(**w)).indices(n) for w in workers]
    assert all(torch.equal(sel[0], s) for s in sel)
    idx = sel[0]
    assert idx.numel() == 10 and torch.equal(idx, idx.sort().values) and idx.unique().numel() == 10
    assert 0 <= int(idx.min()) and int(idx.max()) < n
    assert not torch.equal(base.indices(n, s4), idx)  # another step, another selection
    assert not torch.equal(base.indices(n, global_index_seed(8, 3)), idx)  # another run
    assert s3 != s4

    # payloads of different workers (different dither generators) keep the same coordinates,
    # and the indices are not on the wire: header (numel, seed) + the inner codec's message only
    c = base.with_seed(s3)
    for m in range(4):
        x = _vec(n, m)
        p = c.encode(x, generator=_gen(m))
        assert p.header.numel() == c.header_nbytes == 4 + 8 + QSGDMaxNormCodec().header_nbytes <= 32
        assert p.data.numel() == math.ceil(10 * 4 / 8)
        y = c.decode(c.payload_from_wire(p.to_wire()))
        assert set(torch.nonzero(y).view(-1).tolist()) <= set(idx.tolist())


def test_per_worker_randk_and_send_indices():
    n, k = 300, 17
    x = _vec(n, 3)
    plain = RandKCodec(QSGDMaxNormCodec(bits=6), k)  # no seed: each worker draws its own
    a, b = (plain.decode(plain.encode(x, generator=_gen(s))) for s in (1, 2))
    assert not torch.equal(torch.nonzero(a), torch.nonzero(b))

    sent = RandKCodec(QSGDMaxNormCodec(bits=6), k, send_indices=True)
    assert sent.kind is CodecKind.PLAIN and not is_summable(sent)
    for m in (0, 1):
        p = sent.encode(x, generator=_gen(m))
        idx_bytes = packed_nbytes(k, math.ceil(math.log2(n)))  # 9 bits per index
        assert p.header.numel() == sent.header_nbytes == 4 + 8
        assert p.nbytes == sent.header_nbytes + idx_bytes + math.ceil(k * 6 / 8)
        y = sent.decode(sent.payload_from_wire(p.to_wire()))
        assert torch.equal(y, sent.decode(p)) and int((y != 0).sum()) <= k
    # small and odd lengths, including fewer elements than k
    for nn in (0, 1, 2, 7, 13):
        for c in (sent, plain.with_seed(5)):
            xx = _vec(nn, nn)
            p = c.encode(xx, generator=_gen(nn))
            kk = min(k, nn)
            extra = packed_nbytes(kk, max(1, math.ceil(math.log2(nn)) if nn > 1 else 1)) if c.send_indices else 0
            assert p.nbytes == c.header_nbytes + extra + math.ceil(kk * 6 / 8)
            assert c.decode(p).shape == (nn,)


def test_randk_rescale_and_plain_inner():
    n, k = 50, 5
    x = _vec(n, 8, torch.float32)
    inner = MinMaxCodec(bits=8)
    on = RandKCodec(inner, k, seed=123)
    off = RandKCodec(inner, k, rescale=False, seed=123)
    assert on.kind is CodecKind.PLAIN and not on.unbiased  # min-max 'nearest' is biased
    idx = on.indices(n)
    vals = inner.decode(inner.encode(x[idx]))
    y_off = off.decode(off.encode(x))
    assert torch.equal(y_off[idx], vals) and int((y_off != 0).sum()) <= k
    mask = torch.ones(n, dtype=torch.bool)
    mask[idx] = False
    assert bool((y_off[mask] == 0).all())
    y_on = on.decode(on.encode(x), dtype=torch.float64)
    assert torch.allclose(y_on[idx], vals.double() * n / k)
    with pytest.raises(ValueError, match="summable"):
        on.encode_int(x, torch.ones(1))


@dataclass(frozen=True)
class _SubtractiveDither(Codec):
    """Test-only inner codec whose decode regenerates the sender's dither (dither_on_decode)."""

    step: float = 0.25
    bits = 32
    name = "test-subtractive"
    header_format = "i"
    dither_on_decode = True

    def encode(self, x, *, generator=None):
        u = torch.rand(x.numel(), generator=generator, dtype=torch.float64)
        codes = torch.round(x.double() / self.step + u).to(torch.int64)
        return Payload(header=pack_header("i", x.numel()), data=pack_wide(codes + 2**31, 32))

    def decode(self, payload, *, ref=None, generator=None):
        (n,) = unpack_header("i", payload.header)
        if generator is None:
            raise ValueError("generator is needed")
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return (unpack_wide(payload.data, 32, n) - 2**31 - u) * self.step


def test_roundtrip_and_dither_replay():
    x = _vec(40, 2, torch.float32)
    for c in (QSGDMaxNormCodec(bits=6), MultiScaleMaxNormCodec(scales=(2, 6)),
              RandKCodec(QSGDMaxNormCodec(bits=6), 9), RandKCodec(MultiScaleMaxNormCodec(), 9, send_indices=True)):
        y = c.roundtrip(x, generator=_gen(4))
        assert y.shape == x.shape and torch.equal(y, c.decode(c.encode(x, generator=_gen(4))))
    # an inner codec that needs the sender's generator on decode: the random-k seed draw is replayed
    for rk in (RandKCodec(_SubtractiveDither(), 9, rescale=False), RandKCodec(_SubtractiveDither(), 9, seed=3),
               RandKCodec(_SubtractiveDither(), 9, rescale=False, send_indices=True)):
        assert rk.dither_on_decode
        y = rk.roundtrip(x, generator=_gen(6)).double()
        kept = y != 0
        assert int(kept.sum()) <= 9
        err = (y - x.double() * (1 if not rk.rescale else 40 / 9))[kept].abs().max()
        assert float(err) <= 0.25 * (1 if not rk.rescale else 40 / 9) / 2 + 1e-6


# --- errors name the field ---------------------------------------------------------------------


@pytest.mark.parametrize("make,field", [
    (lambda: QSGDMaxNormCodec(bits=1), "bits"),
    (lambda: QSGDMaxNormCodec(bits=33), "bits"),
    (lambda: QSGDMaxNormCodec(bits=4.0), "bits"),
    (lambda: QSGDMaxNormCodec(bits=True), "bits"),
    (lambda: QSGDMaxNormCodec(bits=4, norm="l1"), "norm"),
    (lambda: MultiScaleMaxNormCodec(scales=()), "scales"),
    (lambda: MultiScaleMaxNormCodec(scales=(2, 2)), "scales"),
    (lambda: MultiScaleMaxNormCodec(scales=(0, 3)), "scales"),
    (lambda: MultiScaleMaxNormCodec(scales=(2, 32)), "scales"),
    (lambda: MultiScaleMaxNormCodec(scales=(2, "6")), r"scales\[1\]"),
    (lambda: MultiScaleMaxNormCodec(scales=6), "scales"),
    (lambda: MultiScaleMaxNormCodec(scales=tuple(range(1, 18))), "scales"),
    (lambda: MultiScaleMaxNormCodec(scales=(2, 6), norm="l0"), "norm"),
    (lambda: RandKCodec(QSGDMaxNormCodec(), k=0), "k"),
    (lambda: RandKCodec(QSGDMaxNormCodec(), k=2.5), "k"),
    (lambda: RandKCodec("qsgd", k=3), "inner"),
    (lambda: RandKCodec(ModuloCodec(bits=2, theta=0.5), k=3), "inner"),
    (lambda: RandKCodec(QSGDMaxNormCodec(), k=3, rescale=1), "rescale"),
    (lambda: RandKCodec(QSGDMaxNormCodec(), k=3, send_indices="no"), "send_indices"),
    (lambda: RandKCodec(QSGDMaxNormCodec(), k=3, seed=-1), "seed"),
])
def test_constructor_errors_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_protocol_misuse_errors():
    x = torch.tensor([3.0, -4.0, 0.5])
    c = QSGDMaxNormCodec(bits=4)
    with pytest.raises(ValueError, match="scale.*max"):
        c.encode_int(x, torch.tensor([1.0]))  # not the MAX over the workers
    with pytest.raises(ValueError, match="scale"):
        c.encode_int(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="agreed"):
        c.shared_scale(x, (torch.ones(1),))
    with pytest.raises(ValueError, match="finite"):
        c.encode(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="int_sum"):
        c.decode_sum(torch.zeros(3), torch.ones(1), 2)

    ms = MultiScaleMaxNormCodec(scales=(2, 6))
    x = torch.tensor([1.0, 0.01, -0.02, 0.5])
    W = ms.shared_scale(x)
    idx = ms.shared_scale(x, (W,))
    assert idx.tolist() == [0, 1, 1, 0]  # |x_i| / W <= 3 / 63 admits the fine scale
    with pytest.raises(ValueError, match=r"scale\[1\].*MIN"):
        ms.encode_int(x, (W, torch.ones(4, dtype=torch.uint8)))  # not the MIN: codes would overflow
    with pytest.raises(ValueError, match=r"scale\[1\]"):
        ms.encode_int(x, (W, torch.full((4,), 2, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="scale"):
        ms.encode_int(x, W)
    with pytest.raises(ValueError, match="agreed"):
        ms.shared_scale(x, (W, idx))

    rk = RandKCodec(QSGDMaxNormCodec(bits=4), k=2)
    with pytest.raises(ValueError, match="seed"):
        rk.shared_scale(x)
    with pytest.raises(ValueError, match="send_indices"):
        RandKCodec(QSGDMaxNormCodec(), 2, send_indices=True, seed=1).shared_scale(x)
    seeded = rk.with_seed(4)
    sc = agree_scale(seeded, [x])
    q = seeded.encode_int(x, sc)
    with pytest.raises(ValueError, match="numel"):
        seeded.decode_sum(q, sc, 1)
    with pytest.raises(ValueError, match="numel"):
        seeded.decode_sum(q, sc, 1, numel=1)
    assert seeded.decode_sum(q, sc, 1, numel=4).shape == (4,)
    assert seeded.scale_nbytes(4) == 4 and ms.scale_nbytes(9) == 4 + 2
    with pytest.raises(ValueError, match="op"):
        reduce_scale("sum", [torch.ones(1)])
