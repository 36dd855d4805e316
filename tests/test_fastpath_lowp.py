"""The fp16/bf16 fast path (lowbit/codecs/kernels/cpu_lowp.py) against torch's casts and
the reference: the same bits for every 16-bit pattern and for millions of float32
patterns (subnormal, rounding ties, overflow boundary), with plain and with streaming
(nontemporal) stores, at every alignment; the overflow and non-finite errors, and the
decode's ``out=`` buffer."""

import pytest
import torch

from lowbit.codecs import HalfCodec
from lowbit.codecs.base import Payload
from lowbit.codecs.kernels import codec_path, cpu_kernels

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels

K = cpu_kernels("lowp")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _float32_patterns() -> torch.Tensor:
    """Random float32 bit patterns plus dense runs at fp16's subnormal range, its normal
    boundary, its overflow boundary and bf16's rounding ties."""
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(-2**31, 2**31 - 1, (500_000,), generator=g, dtype=torch.int32)
    runs = [torch.arange(0x33000000 - 64, 0x38800000 + 64, 5, dtype=torch.int32),  # fp16 subnormals
            torch.arange(0x477FE000 - 4096, 0x47800000 + 4096, dtype=torch.int32),  # 65504 .. 65536
            torch.arange(0x3F800000, 0x3F800000 + 0x40000, dtype=torch.int32),  # [1, 1 + 2^-5): all ties
            torch.arange(0x7F7F0000, 0x7F800000, dtype=torch.int32)]  # bf16's overflow boundary
    w = torch.cat([rnd, *runs])
    return torch.cat([w, w | torch.tensor(-2**31, dtype=torch.int32)]).view(torch.float32)  # both signs


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_encode_is_torchs_cast_bit_for_bit(name):
    x = _float32_patterns()
    ref = x.to(DTYPES[name])
    nan = torch.isnan(x)
    ref_bits = ref.view(torch.int16).masked_fill(nan, 0)  # NaN: any NaN bits will do
    fits = ref.float().abs() < float("inf")  # the values that fit: no flag
    xf = x[fits]
    ref_f = ref.view(torch.int16)[fits]
    for stream in (False, True):
        h, flagged = K.half_encode(x, DTYPES[name], stream=stream)
        assert flagged  # the patterns hold NaN, inf and overflows
        assert torch.equal(h.view(torch.int16).masked_fill(nan, 0), ref_bits)  # finite, inf, overflow
        assert bool(torch.isnan(h[nan]).all())
        h2, flagged2 = K.half_encode(xf, DTYPES[name], stream=stream)
        assert not flagged2 and torch.equal(h2.view(torch.int16), ref_f)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_encode_of_a_quotient_is_torchs_division_and_cast(name):
    """``half_encode(x, dtype, divisor=N)`` (the DDP hooks' share ``x / N`` cast in one pass)
    gives the bits of torch's ``(x / N).to(dtype)`` on the CPU, for world sizes that do and do
    not divide exactly, streamed or not, at three alignments, float32 and float64 inputs; the
    flag sees the quotient's overflow, not the input's; ``check=False`` never flags."""
    x = _float32_patterns()
    fits = torch.isfinite(x) & (x.abs() < 6e4)
    xf = x[fits]
    for N in (1, 2, 3, 4, 7, 12, 1024):  # powers of two by the exact reciprocal's product
        ref = (xf / N).to(DTYPES[name]).view(torch.int16)
        for stream in (False, True):
            for skip in (0, 1, 3):  # the head loop up to the store alignment
                h, flagged = K.half_encode(xf[skip:], DTYPES[name], stream=stream, divisor=N)
                assert not flagged and torch.equal(h.view(torch.int16), ref[skip:]), (N, stream, skip)
        h64, _ = K.half_encode(xf.double(), DTYPES[name], divisor=N)
        assert torch.equal(h64.view(torch.int16), (xf.double() / N).to(DTYPES[name]).view(torch.int16))
    big = torch.tensor([1.0, 1e5, 2.0])  # fp16 overflows at 1e5 but not at 1e5 / 2
    assert K.half_encode(big, torch.float16, divisor=1)[1] and not K.half_encode(big, torch.float16, divisor=2)[1]
    assert K.half_encode(torch.tensor([1.0, float("nan")]), DTYPES[name], divisor=3)[1]
    assert not K.half_encode(torch.tensor([1.0, float("nan")]), DTYPES[name], divisor=3, check=False)[1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_decode_every_16_bit_pattern(name, stream):
    h = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(DTYPES[name])
    out = K.half_decode(h, torch.empty(h.numel()), stream=stream)
    ref = h.float()
    assert torch.equal(out.view(torch.int32)[~ref.isnan()], ref.view(torch.int32)[~ref.isnan()])
    assert bool(out[ref.isnan()].isnan().all())
    o64 = K.half_decode(h, torch.empty(h.numel(), dtype=torch.float64))
    assert torch.equal(o64.view(torch.int64), h.double().view(torch.int64))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stream", [False, True])
def test_fast_equals_reference(name, xdtype, stream, monkeypatch):
    monkeypatch.setattr(K, "streams", lambda nbytes: stream)  # what a large tensor takes
    c = HalfCodec(name)
    x = (torch.randn(10_001, generator=torch.Generator().manual_seed(1)) * 100).to(xdtype)
    p = c.encode(x)
    assert torch.equal(p.to_wire(), c.encode_reference(x).to_wire())
    for dtype in (None, torch.float64, torch.float16):
        assert torch.equal(c.decode(p, dtype=dtype), c.decode_reference(p, dtype=dtype))


def test_overflow_and_nonfinite_errors():
    c = HalfCodec("fp16")
    with pytest.raises(ValueError, match=r"overflows fp16: \|x\| reaches 70000"):
        c.encode(torch.tensor([1.0, -7e4, 3.0]))
    c.encode(torch.tensor([65519.0]))  # rounds to 65504: no error
    with pytest.raises(ValueError, match="overflows fp16"):
        c.encode(torch.tensor([65520.0]))  # rounds to inf
    for bad in (float("nan"), float("inf"), -float("inf")):
        for name in ("fp16", "bf16"):
            x = torch.zeros(1000)
            x[537] = bad
            with pytest.raises(ValueError, match=f"x must be finite for the {name} codec"):
                HalfCodec(name).encode(x)
    with pytest.raises(ValueError, match="overflows bf16"):
        HalfCodec("bf16").encode(torch.tensor([3.4e38]))  # rounds to inf in bf16


def test_decode_into_out():
    c = HalfCodec("fp16")
    x = torch.randn(777)
    p = c.encode(x)
    out = torch.full((777,), 5.0)
    assert c.decode(p, out=out) is out and torch.equal(out, x.half().float())
    o64 = torch.empty(777, dtype=torch.float64)
    assert c.decode(p, dtype=torch.float64, out=o64) is o64 and torch.equal(o64, x.half().double())
    with codec_path("reference"):
        out2 = torch.empty(777)
        assert c.decode(p, out=out2) is out2 and torch.equal(out2, out)
    # an unaligned payload (as read off a wire at an odd offset) decodes the same
    wire = torch.cat([torch.zeros(1, dtype=torch.uint8), p.data])[1:]
    assert torch.equal(c.decode(Payload(p.header, wire), out=torch.empty(777)), out)


@pytest.mark.parametrize("out,match", [
    (torch.empty(776), "1-D tensor of the payload's 777 elements"),
    (torch.empty(777, 1), "1-D tensor of the payload's 777 elements"),
    (torch.empty(777, dtype=torch.float64), "dtype torch.float32"),
    (torch.empty(1554)[::2], "contiguous"),
    ([0.0] * 777, "must be a torch.Tensor"),
])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_decode_out_is_checked(out, match, path):
    c = HalfCodec("fp16")
    p = c.encode(torch.randn(777))
    with codec_path(path), pytest.raises((ValueError, TypeError), match=match):
        c.decode(p, out=out)


def test_decode_out_on_another_device_is_an_error():
    c = HalfCodec("fp16")
    p = c.encode(torch.randn(10))
    with pytest.raises(ValueError, match="payload's device cpu"):
        c.decode(p, out=torch.empty(10, device="meta"))


_ENCODERS = {"fp16": K._encode_f16, "bf16": K._encode_bf16}
_DECODERS = {"fp16": K._decode_f16, "bf16": K._decode_bf16}


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_streaming_at_every_alignment_and_length(name):
    """The streamed kernels write exactly ``[0, n)`` of a destination at any 2- or 4-byte
    offset from a block boundary (scalar head, aligned nontemporal blocks, scalar tail),
    with torch's bits and the flag of a value at any position."""
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(300, generator=g) * 1000
    for n in (0, 1, 15, 16, 17, 31, 32, 33, 47, 100, 257):
        x = xs[:n].clone()
        ref = x.to(DTYPES[name]).view(torch.int16)
        for off in range(K.LANES + 1):  # every offset from a block boundary
            hbuf = torch.full((n + 32,), 0x1234, dtype=torch.int16)
            flagged = _ENCODERS[name](x.view(torch.int32).data_ptr(), hbuf[off:].data_ptr(), n, True)
            assert not flagged
            assert torch.equal(hbuf[off:off + n], ref)
            assert bool((hbuf[:off] == 0x1234).all()) and bool((hbuf[off + n:] == 0x1234).all())
            obuf = torch.full((n + 32,), 7.0)
            _DECODERS[name](ref.data_ptr(), obuf[off:].data_ptr(), n, True)
            assert torch.equal(obuf[off:off + n], ref.view(DTYPES[name]).float())
            assert bool((obuf[:off] == 7.0).all()) and bool((obuf[off + n:] == 7.0).all())



@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_flag_at_every_position(name, stream):
    """One non-finite or overflowing value anywhere (head, a streamed block, the tail) flags."""
    big = {"fp16": 7e4, "bf16": 3.4e38}[name]
    for bad in (float("nan"), float("inf"), -big):
        for i in range(40):
            x = torch.ones(40)
            x[i] = bad
            hbuf = torch.empty(48, dtype=torch.int16)
            assert _ENCODERS[name](x.data_ptr(), hbuf[3:].data_ptr(), 40, stream)
        assert not K.half_encode(torch.ones(40), DTYPES[name], stream=stream)[1]


def test_unaligned_tensors():
    """Tensors at addresses that are not a multiple of their element size (torch.frombuffer
    allows any) are read and written correctly."""
    x = torch.randn(100)
    raw = bytearray(4 * 100 + 1)
    xu = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=100)
    xu.copy_(x)
    assert xu.data_ptr() % 4
    h, flagged = K.half_encode(xu, torch.float16)
    assert not flagged and torch.equal(h, x.half())
    ou = torch.frombuffer(bytearray(4 * 100 + 1), dtype=torch.float32, offset=1, count=100)
    assert K.half_decode(h, ou) is ou and torch.equal(ou, x.half().float())


def test_kernel_api_checks_what_it_passes_as_addresses():
    """The torch-level kernels pass addresses: a length mismatch or a tensor off the CPU is
    an error, a strided ``out`` takes torch's cast."""
    h = torch.randn(10).half()
    with pytest.raises(ValueError, match="out must have h's 10 elements, got 9"):
        K.half_decode(h, torch.empty(9))
    with pytest.raises(ValueError, match="x must be a CPU tensor"):
        K.half_encode(torch.empty(10, device="meta"), torch.float16)
    strided = torch.zeros(20)[::2]
    assert K.half_decode(h, strided) is strided and torch.equal(strided, h.float())


def test_when_to_stream(monkeypatch):
    """A call streams when the bytes it moves exceed half the last-level cache, never when the
    cache size is unknown; sysfs sizes are read in bytes."""
    assert (K.cache_size_bytes("32768K"), K.cache_size_bytes("1M\n"), K.cache_size_bytes("512")) == (2**25, 2**20, 512)
    assert K.cache_size_bytes("") is None and K.cache_size_bytes("lots") is None
    monkeypatch.setattr(K, "last_level_cache_bytes", lambda: 2**25)
    assert not K.streams(2**24) and K.streams(2**24 + 1)
    monkeypatch.setattr(K, "last_level_cache_bytes", lambda: None)
    assert not K.streams(2**40)


def test_under_another_numba_target_the_codecs_take_the_reference():
    """``NUMBA_CPU_NAME=generic`` (issue 28: there LLVM crashed compiling the fp16 kernel, and
    the bf16 one corrupted the heap): the codecs take the reference, with torch's bits."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from lowbit.codecs import HalfCodec\n"
        "from lowbit.codecs.kernels import fast_backend, native_target\n"
        "x = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 100\n"
        "assert not native_target() and fast_backend(x) is None\n"
        "for name, dt in (('fp16', torch.float16), ('bf16', torch.bfloat16)):\n"
        "    c = HalfCodec(name)\n"
        "    p = c.encode(x)\n"
        "    assert torch.equal(c.decode(p), x.to(dt).float())\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "NUMBA_CPU_NAME": "generic"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
