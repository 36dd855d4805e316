"""Triton kernels of the fp16/bf16 codecs (lowbit/codecs/kernels/gpu_lowp.py) against torch's
casts, through HalfCodec pointed at the Triton module. Run by tests/test_triton_interpret.py
with TRITON_INTERPRET=1 on CPU tensors."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import HalfCodec, lowp  # noqa: E402
from lowbit.codecs.kernels import gpu_lowp, kernels_on  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def triton_path(monkeypatch):
    monkeypatch.setattr(lowp, "kernels_for", lambda x, family="core", op=None: kernels_on("triton", family, op))


def _patterns() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randint(-2**31, 2**31 - 1, (20_000,), generator=g, dtype=torch.int32),
                   torch.arange(0x38000000 - 3000, 0x38800000 + 3000, 97, dtype=torch.int32),  # fp16 subnormals
                   torch.arange(0x477FE000 - 2048, 0x47800000 + 2048, 3, dtype=torch.int32),  # fp16 overflow edge
                   torch.arange(0x3F800000, 0x3F808000, dtype=torch.int32)])  # ties of both formats
    return torch.cat([w, w | torch.tensor(-2**31, dtype=torch.int32)]).view(torch.float32)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_encode_is_torchs_cast(name):
    x = _patterns()
    finite = torch.isfinite(x)
    h, flagged = gpu_lowp.half_encode(x, DTYPES[name])
    assert flagged
    assert torch.equal(h.view(torch.int16)[finite], x.to(DTYPES[name]).view(torch.int16)[finite])
    fits = x[finite & torch.isfinite(x.to(DTYPES[name]))]
    h2, flagged2 = gpu_lowp.half_encode(fits, DTYPES[name])
    assert not flagged2 and torch.equal(h2.view(torch.int16), fits.to(DTYPES[name]).view(torch.int16))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_encode_of_a_quotient_is_torchs_cuda_division_and_cast(name):
    """``divisor=N``: ``x`` times the float32 reciprocal of ``N``, cast (torch's ``x / N`` on
    CUDA multiplies by that reciprocal); ``check=False`` computes and reads no flag."""
    x = _patterns()
    fits = x[torch.isfinite(x) & (x.abs() < 6e4)]
    for N in (1, 2, 3, 7):
        inv = torch.tensor(1.0, dtype=torch.float32) / N
        h, flagged = gpu_lowp.half_encode(fits, DTYPES[name], divisor=N)
        assert not flagged and torch.equal(h.view(torch.int16), (fits * inv).to(DTYPES[name]).view(torch.int16))
    assert not gpu_lowp.half_encode(torch.tensor([1.0, float("nan")]), DTYPES[name], divisor=3, check=False)[1]
    assert gpu_lowp.half_encode(torch.tensor([1.0, float("nan")]), DTYPES[name], divisor=3)[1]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_decode_every_pattern(name):
    h = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(DTYPES[name])
    out = gpu_lowp.half_decode(h, torch.empty(h.numel()))
    ref = h.float()
    keep = ~ref.isnan()
    assert torch.equal(out[keep].view(torch.int32), ref[keep].view(torch.int32)) and bool(out[~keep].isnan().all())


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_codec_bytes_errors_and_out(name):
    c = HalfCodec(name)
    x = torch.randn(3001, generator=torch.Generator().manual_seed(2)) * 50
    p = c.encode(x)
    assert torch.equal(p.to_wire(), c.encode_reference(x).to_wire())
    out = torch.empty(3001)
    assert c.decode(p, out=out) is out and torch.equal(out, c.decode_reference(p))
    x[1234] = float("nan")
    with pytest.raises(ValueError, match=f"x must be finite for the {name} codec"):
        c.encode(x)
    with pytest.raises(ValueError, match=f"overflows {name}"):
        c.encode(torch.tensor([1.0, 7e4 if name == "fp16" else 3.4e38]))
