"""The codecs' fast path (numba on the CPU) against the float64 reference: the same
bytes for the same generator, the same decodes, the same errors."""

import pytest
import torch

from lowbit.codecs import ModuloCodec, shared_generator
from lowbit.codecs.kernels import codec_path, cpu, fast_backend, kernels_for
from lowbit.codecs.packing import pack_wide
from lowbit.codecs.rng import counter_uniforms, draw_key


def test_counter_uniforms_match_the_numba_kernel():
    key = draw_key(shared_generator(1, 2, 3))
    u = counter_uniforms(key, 2000)
    k0, k1 = cpu.keys(key)
    assert all(cpu.uniform(k0, k1, i) == float(u[i]) for i in range(2000))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02  # 2000 draws: sd 0.0065


def test_counter_uniforms_are_uniform_and_independent_of_neighbours():
    u = counter_uniforms(draw_key(torch.Generator().manual_seed(0)), 200_000)
    hist = torch.histc(u.float(), bins=20, min=0, max=1)
    assert float((hist - 10_000).abs().max()) < 500  # sd 98 per bin
    corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(corr)) < 0.01


def test_a_generator_is_advanced_by_one_draw_per_key():
    g1, g2 = shared_generator(0, 1, 2), shared_generator(0, 1, 2)
    assert draw_key(g1) == draw_key(g2) and draw_key(g1) != draw_key(shared_generator(0, 1, 3))


@pytest.mark.parametrize("b", list(range(1, 33)))
def test_numba_pack_is_the_reference_layout(b):
    for n in (0, 1, 7, 8, 9, 1001, 4099):
        c = torch.randint(0, 2 ** min(b, 31), (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(b))
        packed = cpu.pack(c, b)
        assert torch.equal(packed, pack_wide(c, b))
        assert torch.equal(cpu.unpack(packed, b, n, torch.int64), c)


def test_path_selection():
    assert fast_backend(torch.zeros(3)) == "numba"
    with codec_path("reference"):
        assert kernels_for(torch.zeros(3)) is None
    with pytest.raises(ValueError, match="path must be one of"):
        with codec_path("turbo"):
            pass


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "stochastic"), (2, "nearest"), (3, "stochastic"),
                                           (6, "stochastic"), (8, "nearest")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_modulo_fast_path_gives_the_reference_bytes(bits, rounding, dtype):
    codec = ModuloCodec(bits=bits, theta=0.1, rounding=rounding)
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(10_001, generator=g) * 3).to(dtype)
    y = (x.double() + (torch.rand(10_001, generator=g, dtype=torch.float64) * 2 - 1) * 0.0999).to(dtype)
    fast = codec.encode(x, generator=shared_generator(0, 5, 1))
    ref = codec.encode_reference(x, generator=shared_generator(0, 5, 1))
    assert torch.equal(fast.header, ref.header) and torch.equal(fast.data, ref.data)
    assert torch.equal(codec.decode(fast, ref=y), codec.decode_reference(fast, ref=y))


def test_modulo_fast_path_keeps_lemma2_at_the_boundary():
    """|x - y| just under theta: the decode error stays within delta * B_theta (float64
    registers on the CPU fast path: slack of a few ulps of |x|)."""
    codec = ModuloCodec(bits=2, theta=0.25)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * 10
    sign = torch.where(torch.rand(100_000, generator=g) < 0.5, -1.0, 1.0)
    y = x + sign * codec.theta * (1 - 1e-6)
    x_hat = codec.decode(codec.encode(x, generator=g), ref=y)
    slack = 4 * torch.finfo(torch.float32).eps * float(x.abs().max())
    assert float((x_hat - x).abs().max()) <= codec.error_bound + slack


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_modulo_fast_path_rejects_nonfinite_input(bad):
    x = torch.zeros(100)
    x[57] = bad
    with pytest.raises(ValueError, match="must be finite for the modulo codec"):
        ModuloCodec(bits=2, theta=0.1).encode(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("bits", [1, 2, 3, 8])  # 1, 2, 4, 8 unpacked inside the kernel, 3 before it
def test_decode_hashed_finds_exactly_the_wrong_blocks(dtype, block, bits):
    codec = ModuloCodec(bits=bits, theta=0.1, rounding="nearest" if bits == 1 else "stochastic")
    g = torch.Generator().manual_seed(block)
    x = (torch.randn(10_001, generator=g, dtype=torch.float64) * 5).to(dtype)
    y = x + (torch.rand(10_001, generator=g, dtype=torch.float64) * 2 - 1).to(dtype) * 0.0999
    y[100:140] += 1.0  # |x - y| > theta: the decode picks another lattice cell there
    p = codec.encode(x, generator=shared_generator(1, 1, 1))
    x_hat, h = codec.decode_hashed(p, ref=y, block=block)
    x_ref, h_ref = codec.decode_hashed_reference(p, ref=y, block=block)
    assert torch.equal(x_hat, x_ref) and torch.equal(h, h_ref)
    assert torch.equal(x_hat, codec.decode(p, ref=y))
    _, h_own = codec.decode_hashed(p, ref=x, block=block)
    wrong = sorted(set(range(100 // block, 139 // block + 1)))
    assert (h_own != h).nonzero().flatten().tolist() == wrong


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_decode_hashed_refuses_inexact_grid_integers(path):
    codec = ModuloCodec(bits=8, theta=1e-12)
    x = torch.full((10,), 1e6, dtype=torch.float64)
    with codec_path(path):
        p = codec.encode(x, generator=torch.Generator().manual_seed(0))
        with pytest.raises(OverflowError, match="Raise theta"):
            codec.decode_hashed(p, ref=x, block=4)
