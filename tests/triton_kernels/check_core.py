"""Triton kernels of the core (packing, Moniqua's modulo codec) against the numba
kernels and the float64 reference; run by tests/test_triton_interpret.py with
TRITON_INTERPRET=1 on CPU tensors."""

import math
import os
import warnings

import numpy as np
import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import ModuloCodec  # noqa: E402
from lowbit.codecs.kernels import cpu, cpu_modulo, gpu, gpu_modulo  # noqa: E402


@pytest.mark.parametrize("b", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_pack_matches_cpu_and_roundtrips(b, n):
    c = torch.randint(0, 2 ** b, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n * 10 + b))
    packed = gpu.pack(c, b)
    assert torch.equal(packed, cpu.pack(c, b))
    assert torch.equal(gpu.unpack(packed, b, n), c)


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "stochastic"), (3, "stochastic"), (8, "nearest")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_modulo_codes_match_the_reference(bits, rounding, dtype):
    codec = ModuloCodec(bits=bits, theta=0.1, rounding=rounding)
    x = torch.randn(4099, dtype=dtype, generator=torch.Generator().manual_seed(bits))
    codes = gpu_modulo.modulo_encode(x, codec.B_theta, codec.levels, rounding == "stochastic", 12345)
    ref = cpu_modulo.modulo_encode(x, codec.B_theta, codec.levels, rounding == "stochastic", 12345)
    # float32 arithmetic may move an element across a grid boundary: rare, and by one code
    differ = codes != ref
    assert differ.float().mean() <= (1e-3 if dtype == torch.float32 else 0.0)
    off = (codes.long() - ref.long()).remainder(codec.levels)[differ]
    assert bool(((off == 1) | (off == codec.levels - 1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_modulo_decode_within_lemma2_slack(dtype):
    codec = ModuloCodec(bits=2, theta=0.1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, dtype=dtype, generator=g)
    y = x + (torch.rand(5000, dtype=dtype, generator=g) * 2 - 1) * 0.0999
    codes = gpu_modulo.modulo_encode(x, codec.B_theta, codec.levels, True, 7)
    x_hat = gpu_modulo.modulo_decode(codes, codec.B_theta, codec.levels, y)
    eps = torch.finfo(dtype).eps
    slack = codec.B_theta * eps * (x.abs().max() / codec.B_theta + 2) * codec.levels + eps * (y.abs().max() + codec.B_theta)
    assert float((x_hat - x).abs().max()) <= codec.error_bound + float(slack)


def test_nonfinite_input_is_a_clear_error():
    with pytest.raises(ValueError, match="finite for the modulo codec"):
        gpu_modulo.modulo_encode(torch.tensor([1.0, float("nan"), 2.0]), 0.3, 4, True, 1)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block,dtype", [(100, torch.float64), (1100, torch.float32)])
def test_modulo_decode_hash_matches_the_reference(block, dtype, bits):
    """Moniqua's verification on CUDA: the same decode and the same block hashes as the float64
    reference (the grid integers are computed in float64 on every path; codes of 1, 2, 4 and 8
    bits read packed, others unpacked first)."""
    codec = ModuloCodec(bits=bits, theta=0.05, rounding="nearest" if bits == 1 else "stochastic")
    g = torch.Generator().manual_seed(block)
    x = torch.randn(1031, dtype=torch.float64, generator=g)
    y = (x + (torch.rand(1031, dtype=torch.float64, generator=g) - 0.5) * 0.2).to(dtype)  # some blocks wrong
    payload = codec.encode_reference(x, generator=torch.Generator().manual_seed(3))
    out, hashes = gpu_modulo.modulo_decode_hash(payload.data, codec.bits, x.numel(), codec.B_theta, codec.levels, y, block)
    ref_out, ref_hashes = codec.decode_hashed_reference(payload, ref=y, block=block)
    assert torch.equal(hashes, ref_hashes) and hashes.dtype == torch.int32
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    with pytest.raises(OverflowError, match="2\\^53"):
        gpu_modulo.modulo_decode_hash(payload.data[:1], codec.bits, 4, codec.B_theta, codec.levels,
                                      torch.full((4,), 1e17, dtype=dtype), block)


@pytest.mark.parametrize("block", [64, 99])  # 99: bytes of codes span two blocks below 8 bits (the unfused send)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype,dither", [(torch.float32, False), (torch.float64, False), (torch.float32, True)])
def test_moniqua_send_and_receive_match_the_numba_calls(dtype, dither, bits, block):
    """Moniqua's one-call exchange on CUDA: the same message bytes and decodes as the numba
    calls; the same wrong blocks, control byte and reach; line 6's term where every block agrees (float32 slack: the
    fused multiply-adds are the same, the rounding of xh - v may differ by an ulp)."""
    codec = ModuloCodec(bits=bits, theta=0.05, rounding="nearest" if bits == 1 else "stochastic")
    n, w = 1031, 1 / 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, dtype=torch.float64, generator=g).to(dtype)
    xj = x + (torch.rand(n, dtype=torch.float64, generator=g) - 0.5).to(dtype) * 0.09
    v = (torch.rand(n, dtype=torch.float64, generator=g) - 0.5) * 0.02 if dither else None
    y, yj = (x.double() + v, xj.double() + v) if dither else (x, xj)
    nbytes, nb = -(-n * bits // 8), -(-n // block)
    msgs = {}
    for name, K in (("gpu", gpu_modulo), ("cpu", cpu_modulo)):
        for who, src in (("i", y), ("j", yj)):
            msg = torch.zeros(nbytes + 2 * nb + 1, dtype=torch.uint8)
            xhat = torch.empty(n, dtype=src.dtype)
            K.moniqua_send(src, codec.B_theta, codec.levels, codec.rounding == "stochastic", 77, bits, block, msg,
                           nbytes, 3, xhat)
            msgs[name, who] = msg, xhat
    for who in "ij":
        assert torch.equal(msgs["gpu", who][0], msgs["cpu", who][0])
        assert torch.equal(msgs["gpu", who][1], msgs["cpu", who][1])
    for bad, error in ((math.nan, "finite"), (1e17, "2\\^53")):  # a non-finite model; a grid too fine for it
        src = y.clone()
        src[n - 1] = bad
        with pytest.raises((ValueError, OverflowError), match=error), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy casting NaN to int
            gpu_modulo.moniqua_send(src, codec.B_theta, codec.levels, codec.rounding == "stochastic", 77, bits, block,
                                    torch.zeros(nbytes + 2 * nb + 1, dtype=torch.uint8), nbytes, 3,
                                    torch.empty(n, dtype=y.dtype))
    msg_j = msgs["cpu", "j"][0]
    x_hat_i = (msgs["cpu", "i"][1] if v is None else msgs["cpu", "i"][1] - v).to(dtype)
    for far in ([], [250, 1030]):  # two blocks wrong
        if far:  # the receiver's model far from the sender's there: those blocks decode wrong
            y_far = y.clone()
            y_far[far] += 1.0
        else:
            y_far = y
        out = {}
        for name, K in (("gpu", gpu_modulo), ("cpu", cpu_modulo)):
            delta, xh = torch.zeros(n, dtype=dtype), torch.empty(n, dtype=y.dtype)
            (found,) = K.to_host([K.moniqua_receive(msg_j, bits, codec.B_theta, codec.levels, y_far, block, xh, v,
                                                    x_hat_i, w, delta)])
            assert found[nb] == 3  # the control byte
            out[name] = np.flatnonzero(found[:nb]).tolist(), xh, delta, found[nb + 1:].max()
        assert out["gpu"][0] == out["cpu"][0] == [f // block for f in far]
        assert out["gpu"][3] == out["cpu"][3]
        assert torch.equal(out["gpu"][1], out["cpu"][1])
        if not far:
            torch.testing.assert_close(out["gpu"][2], out["cpu"][2], rtol=0, atol=4 * torch.finfo(dtype).eps)
