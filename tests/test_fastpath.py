"""The codecs' fast path (numba on the CPU) against the float64 reference: the same
bytes for the same generator, the same decodes, the same errors."""

import sys

import numpy as np
import pytest
import torch

from lowbit.codecs import ModuloCodec, shared_generator
from lowbit.codecs.kernels import codec_path, cpu, cpu_modulo, fast_backend, kernels_for
from lowbit.codecs.packing import pack_wide
from lowbit.codecs.rng import counter_uniforms, draw_key

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels


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
        # encode refuses x itself (out of the codec's range): the payload is a near-origin one,
        # decoded against a reference this far out
        p = codec.encode(torch.zeros(10, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
        with pytest.raises(OverflowError, match="Raise theta"):
            codec.decode_hashed(p, ref=x, block=4)


# ---- Moniqua's one-call-per-message exchange (cpu_modulo._moniqua_send / _moniqua_receive) ----------

def _message(codec, x, key, block, head=b"\x07\x00", ctrl=5):
    """The fused sender's message and own decode, and what the codec's calls give."""
    n = x.numel()
    nbytes = -(-n * codec.bits // 8)
    nb = -(-n // block)
    msg = torch.zeros(nbytes + len(head) + 2 * nb + 1, dtype=torch.uint8)
    msg[nbytes:nbytes + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    xhat = torch.empty(n, dtype=x.dtype)
    stochastic = codec.rounding == "stochastic"
    cpu_modulo.moniqua_send(x, codec.B_theta, codec.levels, stochastic, key if stochastic else 0, codec.bits, block, msg,
                     nbytes + len(head), ctrl, xhat)
    return msg.numpy(), xhat, nbytes, nb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "stochastic"), (4, "stochastic"), (8, "nearest")])
def test_moniqua_send_is_encode_and_decode_hashed(dtype, bits, rounding):
    codec = ModuloCodec(bits=bits, theta=0.1, rounding=rounding)
    x = (torch.randn(4_099, generator=torch.Generator().manual_seed(bits), dtype=torch.float64) * 3).to(dtype)
    key = draw_key(shared_generator(2, 3, 0))
    msg, xhat, nbytes, nb = _message(codec, x, key, 64)
    p = codec.encode(x, generator=shared_generator(2, 3, 0))
    own, hashes = codec.decode_hashed_reference(p, ref=x, block=64)
    assert torch.equal(torch.from_numpy(msg[:nbytes]), p.data) and torch.equal(xhat, own)
    assert msg[nbytes:nbytes + 2].tobytes() == b"\x07\x00" and msg[-1] == 5
    assert (msg[nbytes + 2:-1].view("<u2") == hashes.numpy()).all() and len(hashes) == nb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dither", [False, True])
def test_moniqua_receive_is_decode_hashed_then_torchs_mix(dtype, dither):
    """The receiver's call: the codec's decode and hashes, exactly the wrong blocks, and line 6's
    term bit for bit as torch's ``add_(x_j, alpha=w).sub_(x_hat_i, alpha=w)`` (fused multiply-adds),
    added only when every block is right."""
    codec = ModuloCodec(bits=2, theta=0.1)
    n, block, w = 5_003, 64, 1 / 3  # n not a multiple of the SIMD width or of the block
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 2).to(dtype)       # the receiver
    xj = x + (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype) * 0.09  # a neighbour
    v = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.05 if dither else None
    y, yj = (x.double() + v, xj.double() + v) if dither else (x, xj)
    key = draw_key(shared_generator(0, 1, 0))
    msg_i, own_i, nbytes, nb = _message(codec, y, key, block)
    x_hat_i = (own_i if v is None else own_i - v).to(dtype)
    start = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)  # a neighbour already mixed in
    for far in ([], [130, 4_000]):  # blocks 2 and 62 recovered wrong
        far_j = yj.clone()
        far_j[far] += 1.0
        msg, _, _, _ = _message(codec, far_j, key, block)
        sent = msg[nbytes + 2:-1].view("<u2")
        delta, xh = start.clone(), torch.empty(n, dtype=y.dtype)
        found = cpu_modulo.moniqua_receive(torch.from_numpy(msg), 2, codec.B_theta, codec.levels, y, block, xh, v, x_hat_i,
                                    w, delta)
        wrong = np.flatnonzero(found[:nb]).tolist()
        assert found[nb] == 5 and found.size == nb + 2  # the control byte, then the largest levels |k|
        p = codec.encode(far_j, generator=shared_generator(0, 1, 0))
        ref, mine = codec.decode_hashed_reference(p, ref=y, block=block)
        assert torch.equal(xh, ref)
        assert wrong == [i // block for i in far] == np.flatnonzero(mine.numpy() != sent).tolist()
        recovered = ref if v is None else ref - v
        expect = start.clone().add_(recovered.to(dtype), alpha=w).sub_(x_hat_i, alpha=w) if not far else start
        assert torch.equal(delta, expect)


def test_moniqua_fused_exchange_is_the_codec_path_bit_for_bit(monkeypatch):
    """Whole Moniqua runs (verification with wrong blocks and repairs, the 1-bit dither) on the
    fused calls and on the codecs' reference calls give the same parameters and bytes."""
    from lowbit.train import TrainConfig, train

    def run(**kw):
        r = train(TrainConfig(task="digits-mlp", workers=4, steps=15, eval_every=100, algorithm="moniqua", device="cpu",
                               **kw))
        return [(w.params, w.ledger_rows, w.report["mismatched_blocks"]) for w in r.workers]

    for kw in (dict(bits=2, theta=0.02), dict(bits=1)):
        fused = run(**kw)
        monkeypatch.setenv("LOWBIT_CODEC_PATH", "reference")
        plain = run(**kw)
        monkeypatch.delenv("LOWBIT_CODEC_PATH")
        assert any(m for _, _, m in fused) or kw["bits"] == 1  # theta 0.02: wrong blocks, repaired
        for (p, r, m), (q, s, o) in zip(fused, plain):
            assert torch.equal(p, q) and (r, m) == (s, o)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (Linux smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")
def test_large_decode_outputs_are_advised_as_huge_pages(monkeypatch):
    """empty_output advises the 2 MiB-aligned interior of a buffer of HUGE_FROM bytes or more
    (MADV_HUGEPAGE shows as the VmFlag "hg"), and leaves smaller ones to the heap."""
    import lowbit.codecs.kernels as kernels
    from lowbit.codecs.kernels import HUGE_FROM, empty_output

    advised = []
    real = kernels._MADVISE

    def recorded(start, length, advice):
        advised.append((start, length, advice))
        return real(start, length, advice)

    monkeypatch.setattr(kernels, "_MADVISE", recorded)
    big = empty_output(HUGE_FROM // 4 + 12345, torch.float32)
    assert big.shape == (HUGE_FROM // 4 + 12345,) and big.dtype == torch.float32
    interior = -(-big.data_ptr() // (2 << 20)) * (2 << 20)
    end = (big.data_ptr() + big.numel() * 4) // (2 << 20) * (2 << 20)
    assert advised == [(interior, end - interior, 14)]
    assert "hg" in _vm_flags(interior)
    # a smaller one is left to the heap: not advised (whatever mapping the heap gives it; a
    # mapping's flags depend on the process's history, so the call is what is checked)
    small = empty_output(HUGE_FROM // 8, torch.float32)
    assert small.numel() == HUGE_FROM // 8 and len(advised) == 1
