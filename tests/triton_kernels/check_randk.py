"""RandK's selection on the device (lowbit/codecs/kernels/gpu_randk.py: a Triton kernel
flags sigma(i) < k, torch ops compact) against select_reference, and the codec through
it. Run by tests/test_triton_interpret.py with TRITON_INTERPRET=1 on CPU tensors."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import QSGDMaxNormCodec, RandKCodec, randk, shared_generator  # noqa: E402
from lowbit.codecs.kernels import codec_path, gpu_randk, kernels_on  # noqa: E402
from lowbit.codecs.randk import feistel_params, round_keys, select_reference  # noqa: E402


@pytest.mark.parametrize("d,k", [(2, 1), (5, 2), (100, 7), (1000, 500),  # 16-round small domains
                                 (16385, 8000), (20_011, 10_005), (65537, 65536)])
def test_selection_is_the_reference_set(d, k):
    a, hb = feistel_params(d)
    for seed in ((1, 2**63 - 1) if d < 20_000 else (1,)):
        got = gpu_randk.select(d, k, a, hb, round_keys(seed, d), True, "cpu")
        assert got.dtype == torch.int64 and torch.equal(got, select_reference(d, k, seed))


def test_codec_selects_on_the_device(monkeypatch):
    pick = lambda x, family="core", op=None: kernels_on("triton", family, op)  # noqa: E731
    monkeypatch.setattr(randk, "kernels_for", pick)
    randk.clear_selection_cache()
    c = RandKCodec(QSGDMaxNormCodec(bits=4), k=3000, seed=5)
    x = torch.randn(20_011, generator=torch.Generator().manual_seed(1))
    p = c.encode(x, generator=shared_generator(0, 0, 0))
    y = c.decode(p)
    randk.clear_selection_cache()
    with codec_path("reference"):
        assert torch.equal(p.to_wire(), c.encode(x, generator=shared_generator(0, 0, 0)).to_wire())
        assert torch.equal(y, c.decode(p))
    randk.clear_selection_cache()
