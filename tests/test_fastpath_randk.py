"""RandK's fast selection (lowbit/codecs/kernels/cpu_randk.py, the 32-bit Feistel kernel)
gives exactly the indices of ``select_reference`` (and of the 64-bit inverse), and the
codec's fast path the reference path's bytes."""

import pytest
import torch

from lowbit.codecs import QSGDMaxNormCodec, RandKCodec, shared_generator
from lowbit.codecs.kernels import codec_path, cpu_kernels
from lowbit.codecs.randk import feistel_params, round_keys, select_reference

KR = cpu_kernels("randk")
KM = cpu_kernels("maxnorm")


@pytest.mark.parametrize("d", [2**14 + 1, 65537, 99_991, 2**20 + 3])
def test_dense_selection_is_the_reference_set(d):
    a, hb = feistel_params(d)
    for seed in (0, 7, 2**63 - 1):
        for k in (d // 2, d // 8 + 1, d - 1):
            keys = round_keys(seed, d).numpy().astype("uint64")
            fast = KR.select(d, k, a, hb, keys, True)
            assert fast.dtype == torch.int32
            assert torch.equal(fast.long(), KM.select_sparse(d, k, a, hb, keys))
            if d < 2**20:
                assert torch.equal(fast.long(), select_reference(d, k, seed))


def test_reference_at_a_million():
    d, k, seed = 2**20 + 3, 2**19, 12345
    a, hb = feistel_params(d)
    assert torch.equal(KR.select(d, k, a, hb, round_keys(seed, d).numpy().astype("uint64"), True).long(),
                       select_reference(d, k, seed))


@pytest.mark.parametrize("d,k", [(5, 2), (1000, 500), (2**14, 8000), (100_000, 100)])
def test_small_and_sparse_selections_are_the_reference_set(d, k):
    a, hb = feistel_params(d)
    keys = round_keys(3, d).numpy().astype("uint64")
    dense = k * 8 >= d
    assert torch.equal(KR.select(d, k, a, hb, keys, dense).long(), select_reference(d, k, 3))


@pytest.mark.parametrize("k", [100, 50_000])
@pytest.mark.parametrize("send_indices", [False, True])
def test_codec_fast_path_is_the_reference_bytes(k, send_indices):
    c = RandKCodec(QSGDMaxNormCodec(bits=6), k=k, seed=None if send_indices else 11, send_indices=send_indices)
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    p = c.encode(x, generator=shared_generator(0, 1, 2))
    y = c.decode(p, generator=shared_generator(0, 1, 2))
    with codec_path("reference"):
        pr = c.encode(x, generator=shared_generator(0, 1, 2))
        yr = c.decode(pr, generator=shared_generator(0, 1, 2))
    assert torch.equal(p.to_wire(), pr.to_wire())
    assert torch.equal(y, yr)
    if not send_indices:
        idx = c.indices(100_003)
        assert idx.dtype == torch.int64 and torch.equal(idx, select_reference(100_003, k, 11))
        assert torch.equal(y != 0, torch.zeros(100_003, dtype=torch.bool).index_fill_(0, idx, True) & (y != 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("d,k", [(70_001, 35_000), (70_001, 100), (1000, 500)])
def test_selection_with_the_gather(dtype, d, k):
    """With x, the selection also returns x's kept values (gathered in the same pass by the
    32-bit kernel for float32/float64, by index_select otherwise)."""
    a, hb = feistel_params(d)
    x = torch.randn(d, generator=torch.Generator().manual_seed(4)).to(dtype)
    keys = round_keys(8, d).numpy().astype("uint64")
    idx, vals = KR.select(d, k, a, hb, keys, k * 8 >= d, x=x)
    assert torch.equal(idx.long(), select_reference(d, k, 8))
    assert vals.dtype == dtype and torch.equal(vals, x[idx.long()])
