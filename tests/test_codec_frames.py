"""Every codec's decode checks its frame before it touches the data (issue 32, items 2, 7, 8, 11,
12 and 13's lzma blobs; issue 28 item 4): truncated, extended, empty and lying payloads and
non-finite scales are a PayloadError naming the codec, on the fast path and the reference; each
codec's documented range is enforced on encode, so no decode is inf or NaN; inputs a kernel
cannot type are refused before the kernel; entropy_decode is bounded by default.

The cases are parametrized over the registry (``lowbit.codecs.CODECS``): a codec added to it
without samples here fails ``test_every_registered_codec_has_samples``."""

from __future__ import annotations

import math
import struct
import time

import pytest
import torch

from lowbit.codecs import (CODECS, MAX_DECODE_NUMEL, BaguaMinMaxCodec, DitheredCodec, EntropyCodedCodec, HalfCodec,
                           IdentityCodec, MinMaxCodec, ModuloCodec, MultiScaleMaxNormCodec, NestedDitheredCodec,
                           Payload, PayloadError, PowerSGDCodec, QSGDCodec, QSGDMaxNormCodec, RandKCodec, SignCodec,
                           TernGradCodec, UniformCodec, entropy_code, entropy_decode, shared_generator)
from lowbit.codecs.entropy import ENTROPY_MAX_LENGTH
from lowbit.codecs.kernels import codec_path

N = 100
F32_MAX = float(torch.finfo(torch.float32).max)

# (codec, where its scales sit: ("header" | "data", byte offset) each, byte offset of the
# header's element count or None)
SAMPLES: dict[str, list] = {
    "fp32": [(IdentityCodec(), [], 0)],
    "fp16": [(HalfCodec("fp16"), [], 0), (HalfCodec("bf16"), [], 0)],
    "uniform": [(UniformCodec(step=0.1), [], 0)],
    "minmax": [(MinMaxCodec(bits=3), [("header", 4), ("header", 8)], 0),
               (MinMaxCodec(bits=8, rounding="stochastic"), [("header", 4), ("header", 8)], 0)],
    "modulo": [(ModuloCodec(bits=2, theta=5.0), [], 0), (ModuloCodec(bits=5, theta=5.0, rounding="nearest"), [], 0)],
    "dithered": [(DitheredCodec(levels=3), [("header", 4)], 0),
                 (DitheredCodec(levels=7, partitions=4), [("header", 4), ("data", 0), ("data", 8)], 0),
                 (DitheredCodec(levels=1, subtractive=False), [("header", 4)], 0)],
    "nested": [(NestedDitheredCodec(delta1=0.5, k=8), [], 0), (NestedDitheredCodec(delta1=0.5, k=5), [], 0)],
    "qsgd": [(QSGDCodec(levels=4), [("header", 4)], 0), (QSGDCodec(levels=7, bucket=16), [("data", 0), ("data", 12)], 0)],
    "terngrad": [(TernGradCodec(), [("header", 4)], 0)],
    "sign": [(SignCodec(), [("header", 4)], 0), (SignCodec("rms"), [("header", 4)], 0), (SignCodec("none"), [], 0)],
    "half_": [],
    "powersgd": [(PowerSGDCodec(rank=2), [("data", 0), ("data", 4 * 20)], 0)],
    "entropy": [(EntropyCodedCodec(MinMaxCodec(bits=2), "lzma"), [], None),
                (EntropyCodedCodec(QSGDCodec(levels=1), "ans"), [], None),
                (EntropyCodedCodec(SignCodec(), "zlib"), [], None),
                (EntropyCodedCodec(TernGradCodec(), "bz2"), [], None)],
    "qsgd-maxnorm": [(QSGDMaxNormCodec(bits=3), [("header", 4)], 0), (QSGDMaxNormCodec(bits=8), [("header", 4)], 0)],
    "qsgd-maxnorm-multiscale": [(MultiScaleMaxNormCodec(), [("header", 4)], 0)],
    "randk": [(RandKCodec(QSGDMaxNormCodec(bits=8), k=10, seed=3), [("header", 16)], 0),
              (RandKCodec(TernGradCodec(), k=10, send_indices=True), [("header", 8)], 0),
              (RandKCodec(DitheredCodec(levels=3), k=10), [("header", 16)], 0)],
    "bagua-minmax": [(BaguaMinMaxCodec(), [("header", 0), ("header", 4)], 8)],
}
del SAMPLES["half_"]

CASES = [pytest.param(c, scales, at, id=f"{name}-{i}") for name, lst in SAMPLES.items()
         for i, (c, scales, at) in enumerate(lst)]
PATHS = ["fast", "reference"]


def _x(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _encode(codec, x):
    return codec.encode(x, generator=shared_generator(0, 1, 2))


def _decode(codec, payload, x, **kw):
    """``codec.decode`` with what the codec's kind needs: ``ref`` (side information: the sender's
    own x, so the decode is correct) and the receiver's copy of the sender's generator."""
    if codec.kind.value == "side-information":
        kw.setdefault("ref", x)
    if codec.dither_on_decode:
        kw.setdefault("generator", shared_generator(0, 1, 2))
    return codec.decode(payload, **kw)


def _names(codec) -> tuple[str, ...]:
    inner = getattr(codec, "inner", None)
    return (codec.name,) + (_names(inner) if inner is not None else ())


def _refused(codec, payload, x, **kw) -> PayloadError:
    with pytest.raises(PayloadError) as e:
        _decode(codec, payload, x, **kw)
    msg = str(e.value)
    assert any(name.split("_")[0] in msg for name in _names(codec)), msg  # the codec (or its inner codec) is named
    return e.value


def _with(t: torch.Tensor, at: int, raw: bytes) -> torch.Tensor:
    t = t.clone()
    t[at:at + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return t


def test_every_registered_codec_has_samples():
    assert set(SAMPLES) == set(CODECS)
    for name, lst in SAMPLES.items():
        assert lst and all(type(c) is CODECS[name] for c, _, _ in lst), name


def test_payload_error_is_one_importable_value_error():
    import lowbit.codecs as codecs

    assert codecs.PayloadError is PayloadError and issubclass(PayloadError, ValueError)
    e = PayloadError("sign", "2 data bytes", "1")
    assert (e.codec, e.expected, e.got) == ("sign", "2 data bytes", "1")
    assert str(e) == "malformed sign payload: expected 2 data bytes, got 1"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scales,count_at", CASES)
def test_valid_payloads_still_decode(codec, scales, count_at, path):
    x = _x()
    with codec_path(path):
        p = _encode(codec, x)
        out = _decode(codec, p, x)
        assert out.shape == (N,) and bool(torch.isfinite(out).all())
        assert torch.equal(_decode(codec, p, x, numel=N), out)  # numel= the count the receiver expects


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scales,count_at", CASES)
def test_truncated_extended_and_empty_data_are_refused(codec, scales, count_at, path):
    x = _x()
    with codec_path(path):
        p = _encode(codec, x)
        for data in (p.data[:-1], p.data[: p.data.numel() // 2], torch.cat([p.data, p.data[:1]]),
                     torch.cat([p.data, torch.zeros(7, dtype=torch.uint8)]), p.data[:0]):
            _refused(codec, Payload(header=p.header, data=data), x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scales,count_at", CASES)
def test_wrong_header_sizes_are_refused(codec, scales, count_at, path):
    x = _x()
    with codec_path(path):
        p = _encode(codec, x)
        for header in (p.header[:-1], p.header[:0], torch.cat([p.header, p.header[:1]])):
            if header.numel() == p.header.numel():
                continue  # a codec without a header (entropy)
            _refused(codec, Payload(header=header, data=p.data), x)
        short = p.to_wire()[: p.header.numel() - 1] if p.header.numel() else None
        if short is not None:
            with pytest.raises(PayloadError, match=codec.name):
                codec.payload_from_wire(short)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scales,count_at", CASES)
def test_lying_counts_are_refused(codec, scales, count_at, path):
    """The header's count against ``numel`` (every codec), and without ``numel`` against what the
    data or MAX_DECODE_NUMEL allow: 2^31 - 1 elements from a small payload is refused at once
    (RandK tried to allocate 8 GiB), a negative count too."""
    x = _x()
    with codec_path(path):
        p = _encode(codec, x)
        for wrong in (N - 1, N + 1):
            _refused(codec, p, x, numel=wrong)
        if count_at is None:
            return
        for lie in (N + 1, N - 1, 2**31 - 1, -1):
            bad = Payload(header=_with(p.header, count_at, struct.pack("<i", lie)), data=p.data)
            _refused(codec, bad, x, numel=N)
            if lie in (2**31 - 1, -1):
                t0 = time.perf_counter()
                _refused(codec, bad, x)
                assert time.perf_counter() - t0 < 5  # refused from the header: nothing of 2^31 elements is made
            else:
                # without numel: refused, or (where the data's length cannot tell the two counts apart:
                # the same packed bytes, PowerSGD's matrix, RandK's kept values) exactly that many elements
                try:
                    out = _decode(codec, bad, x)
                except PayloadError:
                    continue
                assert out.numel() == lie and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scales,count_at", [c for c in CASES if c.values[1]])
def test_non_finite_and_out_of_range_scales_are_refused(codec, scales, count_at, path):
    """NaN, +-inf and (for norms and scales, which encode sends >= 0) negative or beyond-float32
    scales in a header or the data: each is a PayloadError, never a NaN/inf decode."""
    x = _x()
    with codec_path(path):
        p = _encode(codec, x)
        for where, at in scales:
            for v in (math.nan, math.inf, -math.inf):
                raw = struct.pack("<f", v)
                bad = Payload(header=_with(p.header, at, raw), data=p.data) if where == "header" else \
                    Payload(header=p.header, data=_with(p.data, at, raw))
                _refused(codec, bad, x)
        if codec.name not in ("minmax", "bagua-minmax", "powersgd"):  # a min, and PowerSGD's factors, may be negative
            for where, at in scales:
                raw = struct.pack("<f", -1.0)
                bad = Payload(header=_with(p.header, at, raw), data=p.data) if where == "header" else \
                    Payload(header=p.header, data=_with(p.data, at, raw))
                _refused(codec, bad, x)


def test_the_issue_probes():
    """The probes of issue 32 as they were filed."""
    # ModuloCodec.decode read 1,000 elements from 0 bytes, and 12.5 MB from a 1-byte tensor
    c = ModuloCodec(bits=2, theta=0.5)
    y = _x(1000)
    p = c.encode(y)
    for data in (torch.empty(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)):
        with pytest.raises(PayloadError, match="modulo"):
            c.decode(Payload(header=p.header, data=data), ref=y)
    big = Payload(header=struct_header(50_000_000), data=torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="modulo"):
        c.decode(big, ref=torch.zeros(50_000_000 // 1000))
    # RandKCodec.decode: 16 bytes claiming n = 2^31 - 1
    r = RandKCodec(QSGDMaxNormCodec(bits=8), k=4, seed=1)
    rp = r.encode(_x(100))
    lie = Payload(header=_with(rp.header, 0, struct.pack("<i", 2**31 - 1)), data=rp.data)
    with pytest.raises(PayloadError, match=f"at most MAX_DECODE_NUMEL = {MAX_DECODE_NUMEL}"):
        r.decode(lie)
    # PowerSGD returned 1,001 elements for a 1,000-element payload: numel= names the count
    ps = PowerSGDCodec(rank=2)
    pp = ps.encode(_x(1000), generator=torch.Generator().manual_seed(0))
    lie = Payload(header=struct_header(1001), data=pp.data)
    with pytest.raises(PayloadError, match="expected 1000 elements"):
        ps.decode(lie, numel=1000)


def struct_header(n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack("<i", n)), dtype=torch.uint8)


# --- extreme values: each codec's range is enforced on encode; a decode is never inf or NaN ------------

MAGNITUDES = [1.0, 1e10, 1e20, 1e30, 1e37, 1e38, 3e38, F32_MAX]


def _extreme_inputs():
    for m in MAGNITUDES:
        yield f"const{m:g}", torch.full((64,), m)
        yield f"pm{m:g}", torch.tensor([m, -m] * 32)
        yield f"spike{m:g}", torch.cat([torch.tensor([m]), torch.full((63,), 1e-3)])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scales,count_at", CASES)
def test_out_of_range_inputs_are_refused_on_encode_never_decoded_wrong(codec, scales, count_at, path):
    with codec_path(path):
        for label, x in _extreme_inputs():
            try:
                p = _encode(codec, x)
            except (ValueError, OverflowError) as e:
                assert "x" in str(e), (label, str(e))
                continue
            out = _decode(codec, p, x)
            assert bool(torch.isfinite(out).all()), (label, out[:4])
            if codec.name in ("fp32", "fp16"):  # the values themselves
                assert torch.allclose(out.double(), x.double(), rtol=1e-2), label


@pytest.mark.parametrize("path", PATHS)
def test_the_extreme_value_probes(path):
    with codec_path(path):
        c = ModuloCodec(bits=8, theta=0.1)
        for v in (1e20, 1e38):  # decoded to 1.8447e19 and 0 before
            with pytest.raises(ValueError, match=r"x is out of the modulo codec's range"):
                c.encode(torch.full((10,), v))
            p = c.encode(torch.zeros(10))
            with pytest.raises(OverflowError, match=r"ref is out of the modulo codec's range"):
                c.decode(p, ref=torch.full((10,), v))
        b = BaguaMinMaxCodec()  # a constant 3e38 decoded to inf, +-3.4e38 to NaN
        for x in (torch.full((8,), 3e38), torch.tensor([-3.4e38, 3.4e38])):
            with pytest.raises(ValueError, match="x is out of Bagua's min-max codec's range"):
                b.encode(x)
        d = DitheredCodec(levels=1)  # the n/k rescale turned values near 1e38 into inf
        with pytest.raises(ValueError, match="float32 range for the dithered codec"):
            d.encode(torch.full((4,), 3e38), generator=shared_generator(0, 1, 2))
        ok = torch.full((4,), d.scale_limit * 0.999)
        assert bool(torch.isfinite(d.decode(d.encode(ok, generator=shared_generator(0, 1, 2)),
                                            generator=shared_generator(0, 1, 2))).all())
        r = RandKCodec(TernGradCodec(), k=2, seed=5)
        with pytest.raises(ValueError, match="random-k codec's range"):
            r.encode(torch.full((100,), 1e37))
        assert bool(torch.isfinite(r.decode(r.encode(torch.full((100,), 1e36)))).all())


def test_a_lying_rescale_is_refused():
    """A RandK payload whose kept values times d / k overflow float32 (a peer's): refused."""
    r = RandKCodec(QSGDMaxNormCodec(bits=8), k=2, seed=5)
    p = r.encode(_x(100))
    bad = Payload(header=_with(p.header, 16, struct.pack("<f", 3e37)), data=p.data)  # W = 3e37, d / k = 50
    with pytest.raises(PayloadError, match="d / k"):
        r.decode(bad)


# --- inputs a kernel cannot type: refused before the kernel, by name --------------------------------

BAD_INPUTS = [("0-d", torch.tensor(1.0)), ("int32", torch.arange(8, dtype=torch.int32)),
              ("2-D", torch.randn(4, 4))]


@pytest.mark.parametrize("label,x", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("codec,scales,count_at", CASES)
def test_untypable_inputs_are_clear_errors(codec, scales, count_at, label, x):
    with pytest.raises((TypeError, ValueError), match=r"\bx\b"):
        _encode(codec, x)


@pytest.mark.parametrize("label,x", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_maxnorm_summable_steps_check_x_first(label, x):
    """qsgd_maxnorm and multi-scale raised a numba TypingError (a compiler traceback) here."""
    for c in (QSGDMaxNormCodec(bits=4), MultiScaleMaxNormCodec()):
        with pytest.raises((TypeError, ValueError), match=r"\bx\b"):
            c.shared_scale(x)
        with pytest.raises((TypeError, ValueError), match=r"\bx\b"):
            c.encode_int(x, torch.tensor([1.0]) if c.name == "qsgd-maxnorm" else
                         (torch.tensor([1.0]), torch.zeros(x.numel(), dtype=torch.uint8)))


# --- entropy blobs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["zlib", "bz2", "lzma", "ans"])
def test_truncated_and_extended_blobs_are_refused(method):
    raw = bytes(range(256)) * 4
    blob = entropy_code(raw, method)
    assert entropy_decode(blob) == raw
    for bad in (blob[:-1], blob[: len(blob) // 2], blob + b"\x00", blob + b"\x00" * 4, blob + blob[1:]):
        with pytest.raises(PayloadError, match=rf"corrupt {method} blob|ans blob"):
            entropy_decode(bad)


def test_entropy_decode_is_bounded_by_default():
    """A 14-byte ANS blob claiming 2^32 - 1 bytes asked for 17 GB: refused before allocating,
    against the default bound; max_length overrides it either way."""
    blob = b"A" + struct.pack("<BIBH", 8, 2**32 - 1, 1, 1) + b"\x00" + b"\x00" * 4
    assert len(blob) == 14
    t0 = time.perf_counter()
    with pytest.raises(PayloadError, match=f"more than max_length={ENTROPY_MAX_LENGTH}"):
        entropy_decode(blob)
    assert time.perf_counter() - t0 < 5
    assert ENTROPY_MAX_LENGTH == 2**30
    raw = b"\x07" * 5000  # compresses to a few bytes: bounded by what it expands to
    for method in ("zlib", "bz2", "lzma", "ans"):
        blob = entropy_code(raw, method)
        assert entropy_decode(blob, max_length=5000) == raw
        with pytest.raises(PayloadError, match="more than max_length=4999"):
            entropy_decode(blob, max_length=4999)


def test_ans_decodes_in_chunks():
    """Symbols are decoded a chunk at a time: the same bytes across chunk boundaries."""
    import lowbit.codecs.entropy as ent

    raw = bytes(torch.randint(0, 4, (3000,), generator=torch.Generator().manual_seed(1)).to(torch.uint8).tolist())
    blob = entropy_code(raw, "ans", symbol_bits=2)
    old = ent._ANS_CHUNK
    try:
        ent._ANS_CHUNK = 8 * 37
        assert entropy_decode(blob) == raw
    finally:
        ent._ANS_CHUNK = old
    assert entropy_decode(blob) == raw


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec,scale_at", [(QSGDCodec(levels=127), 4), (QSGDMaxNormCodec(bits=8), 4)], ids=repr)
def test_a_code_past_the_top_with_a_scale_near_float32s_limit_is_refused(codec, scale_at, path):
    """Codes of 255 levels are bit-packed (8 bits): a lying payload can hold the code 255, one
    level past the top; with a scale near float32's largest value its decode would be inf."""
    x = _x()
    with codec_path(path):
        p = codec.encode(x)
        near = Payload(header=_with(p.header, scale_at, struct.pack("<f", 0.999 * F32_MAX)), data=p.data)
        assert bool(torch.isfinite(codec.decode(near)).all())  # codes within their levels: finite
        past = Payload(header=near.header, data=_with(p.data, 0, b"\xff"))
        with pytest.raises(PayloadError, match="codes within their levels"):
            codec.decode(past)
