"""Triton kernels of the "plain" codecs (min-max, uniform, sign, TernGrad, fp16/bf16)
against the CPU fast path (the reference's bytes), through the codecs themselves: the
codec modules are pointed at the Triton kernel modules. Run by
tests/test_triton_interpret.py with TRITON_INTERPRET=1 on CPU tensors."""

import math
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import (HalfCodec, IdentityCodec, MinMaxCodec, SignCodec, TernGradCodec,  # noqa: E402
                           UniformCodec, shared_generator)
from lowbit.codecs import fastpath, identity, lowp  # noqa: E402
from lowbit.codecs.base import Payload  # noqa: E402
from lowbit.codecs.kernels import gpu, kernels_on  # noqa: E402

EPS32 = 2.0**-24  # float32's unit roundoff
N = 1500


@pytest.fixture
def triton_path(monkeypatch):
    """The codecs take the Triton kernels for CPU tensors (as they do for CUDA tensors)."""
    pick = lambda x, family="core", op=None: kernels_on("triton", family, op)  # noqa: E731
    for module in (identity, lowp, fastpath):  # fastpath: min-max, uniform, sign, TernGrad
        monkeypatch.setattr(module, "kernels_for", pick)


def _x(dtype, seed=0, n=N):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _codes_close(a, b, dtype):
    """float32 arithmetic may move an element across a rounding boundary: rarely, by one code."""
    differ = a != b
    assert differ.float().mean() <= (2e-3 if dtype == torch.float32 else 0.0)
    assert bool(((a.long() - b.long()).abs()[differ] == 1).all())


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (3, "stochastic"), (4, "nearest"), (8, "stochastic")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_minmax(bits, rounding, dtype, monkeypatch):
    codec = MinMaxCodec(bits=bits, rounding=rounding)
    x = _x(dtype, bits)
    cpu_p = codec.encode(x, generator=shared_generator(0, bits, 1))
    cpu_y = codec.decode(cpu_p, dtype=torch.float64)
    pick = lambda t, family="core", op=None: kernels_on("triton", family, op)  # noqa: E731
    monkeypatch.setattr(fastpath, "kernels_for", pick)
    p = codec.encode(x, generator=shared_generator(0, bits, 1))
    assert torch.equal(p.header, cpu_p.header)  # min and max are exact
    _codes_close(gpu.unpack(p.data, bits, N), gpu.unpack(cpu_p.data, bits, N), dtype)
    y = codec.decode(p, dtype=torch.float64)
    lo, hi = float(x.min()), float(x.max())
    width = (hi - lo) / codec.levels
    # the float32 slack stated in lowbit/codecs/minmax.py
    slack = 6 * EPS32 * (hi - lo) + 2 * EPS32 * max(abs(lo), abs(hi)) if dtype == torch.float32 else 1e-12
    bound = width / 2 if rounding == "nearest" else width
    assert float((y - x.double()).abs().max()) <= bound + slack
    assert float((y - cpu_y).abs().max()) <= width + slack


@pytest.mark.parametrize("step,rounding", [(0.01, "stochastic"), (0.3, "nearest"), (1e-3, "stochastic")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform(step, rounding, dtype, triton_path):
    codec = UniformCodec(step=step, rounding=rounding)
    x = _x(dtype, 5)
    p = codec.encode(x, generator=shared_generator(0, 5, 1))
    y = codec.decode(p, dtype=torch.float64)
    ref = codec.encode_reference(x, generator=shared_generator(0, 5, 1))
    _codes_close(codec.decode_reference(p, dtype=torch.float64).div(step).round().long(),
                 codec.decode_reference(ref, dtype=torch.float64).div(step).round().long(), dtype)
    assert torch.equal(y, codec.decode_reference(p, dtype=torch.float64)) or dtype == torch.float32
    # float32: x / step carries <= 2^-22 |x| / step; (c + offset) * step rounds once more
    slack = 2.0**-21 * (x.double().abs() + step) if dtype == torch.float32 else 1e-12 * (x.double().abs() + step)
    assert bool(((y - x.double()).abs() <= codec.error_bound + slack).all())


@pytest.mark.parametrize("scale", ["mean_abs", "rms", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_sign(scale, dtype, triton_path):
    codec = SignCodec(scale)
    x = _x(dtype, 7)
    p = codec.encode(x)
    ref = codec.encode_reference(x)
    assert torch.equal(p.data, ref.data)  # the bits are exact
    if scale != "none":
        c, c_ref = struct_scale(p), struct_scale(ref)
        assert math.isclose(c, c_ref, rel_tol=1e-5)  # float32 norm against the float64 sum
    y = codec.decode(p)
    assert torch.equal(y, codec.decode_reference(p))


def struct_scale(p: Payload) -> float:
    import struct
    return struct.unpack("<if", bytes(p.header.tolist()))[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_terngrad(dtype, triton_path):
    codec = TernGradCodec()
    x = _x(dtype, 9)
    p = codec.encode(x, generator=shared_generator(0, 9, 1))
    ref = codec.encode_reference(x, generator=shared_generator(0, 9, 1))
    assert torch.equal(p.header, ref.header)  # max |x| is exact
    from lowbit.codecs.radix import unpack_levels
    assert p.data.numel() == ref.data.numel() == -(-N // 5)  # 5 trits per byte
    _codes_close(unpack_levels(p.data, 3, N), unpack_levels(ref.data, 3, N), dtype)
    y = codec.decode(p, dtype=torch.float64)
    assert torch.equal(y, codec.decode_reference(p, dtype=torch.float64))
    s = struct_scale(p)
    assert set((y / s).unique().tolist()) <= {-1.0, 0.0, 1.0}
    # unbiased: E[y] = x; 4099 draws of sd <= s/2 each
    assert abs(float((y - x.double()).mean())) < 5 * s / 2 / math.sqrt(N)
    with pytest.raises(ValueError, match="not 5 ternary digits"):
        codec.decode(Payload(header=p.header, data=torch.full_like(p.data, 243)))
    p2 = codec.encode(_x(dtype, 9, n=N + 2), generator=shared_generator(0, 9, 1))
    last = p2.data.clone()
    last[-1] = 9  # the last byte holds 2 trits: at most 8
    with pytest.raises(ValueError, match="not 5 ternary digits"):
        codec.decode(Payload(header=p2.header, data=last))


@pytest.mark.parametrize("codec", [HalfCodec("fp16"), HalfCodec("bf16"), IdentityCodec()], ids=repr)
def test_casts(codec, triton_path):
    x = _x(torch.float32, 11)
    p = codec.encode(x)
    assert torch.equal(p.to_wire(), codec.encode_reference(x).to_wire())
    assert torch.equal(codec.decode(p), codec.decode_reference(p))


@pytest.mark.parametrize("codec", [MinMaxCodec(), UniformCodec(step=0.1), SignCodec(), SignCodec("none"),
                                   TernGradCodec(), HalfCodec("fp16")], ids=repr)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_input_is_a_clear_error(codec, bad, triton_path):
    x = torch.zeros(100)
    x[57] = bad
    with pytest.raises(ValueError, match="finite"):
        codec.encode(x)


def test_half_overflow_is_a_clear_error(triton_path):
    with pytest.raises(ValueError, match="overflows fp16"):
        HalfCodec("fp16").encode(torch.tensor([1.0, 7e4]))
