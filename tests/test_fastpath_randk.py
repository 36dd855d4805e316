"""RandK's fast selection (lowbit/codecs/kernels/cpu_randk.py, the 32-bit Feistel kernel)
gives exactly the indices of ``select_reference`` (and of the 64-bit inverse), and the
codec's fast path the reference path's bytes."""

import pytest
import torch

from lowbit.codecs import QSGDMaxNormCodec, RandKCodec, shared_generator
from lowbit.codecs.kernels import codec_path, cpu_kernels
from lowbit.codecs.randk import feistel_params, round_keys, select_reference

# the numba kernels themselves: skipped where numba compiles for another CPU (conftest.py)
pytestmark = pytest.mark.numba_kernels

KR = cpu_kernels("randk")


@pytest.mark.parametrize("d", [2**14 + 1, 65537, 99_991, 2**20 + 3])
def test_dense_selection_is_the_reference_set(d):
    a, hb = feistel_params(d)
    for seed in (0, 7, 2**63 - 1):
        for k in (d // 2, d // 8 + 1, d - 1):
            keys = round_keys(seed, d).numpy().astype("uint64")
            fast = KR.select(d, k, a, hb, keys, True)
            assert fast.dtype == torch.int32
            assert torch.equal(fast.long(), KR.select_sparse(d, k, a, hb, keys))
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


def test_compaction_without_the_vector_compress(monkeypatch):
    """The compaction's lane-by-lane stores (LLVMs before 19) give the same indices and values
    as the vector compress: the kernel compiled afresh with VECTOR_COMPRESS off."""
    import numba
    import numpy as np

    from lowbit.codecs.kernels import cpu_randk

    monkeypatch.setattr(cpu_randk, "VECTOR_COMPRESS", False)
    scalar = numba.njit(nogil=True, boundscheck=False)(cpu_randk._select_dense.py_func)
    for d, k in [(17, 9), (70_001, 35_000), (70_001, 9000)]:
        a, hb = feistel_params(d)
        keys = tuple(np.uint32(int(v)) for v in round_keys(5, d))
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(d, dtype=dtype, generator=torch.Generator().manual_seed(d))
            out = np.empty(k + cpu_randk._LANES, dtype=np.int32)
            vals = np.empty(k + cpu_randk._LANES, dtype=x.numpy().dtype)
            assert scalar(d, k, a, hb, keys, out, True, x.numpy(), vals) == k
            ref = select_reference(d, k, 5)
            assert torch.equal(torch.from_numpy(out[:k]).long(), ref)
            assert torch.equal(torch.from_numpy(vals[:k]), x[ref])


@pytest.mark.parametrize("sent", [[5, 1023, 1000], [5, 5, 7], [7, 5, 9], [1000, 1001, 1002]])
def test_malformed_sent_indices_are_refused(sent):
    """Indices read from a message must be strictly increasing and below numel: a decode that
    trusted them would write outside its output (the CPU scatter does not check bounds)."""
    from lowbit.codecs.base import Payload
    from lowbit.codecs.packing import pack_wide

    c = RandKCodec(QSGDMaxNormCodec(bits=8), k=3, send_indices=True)
    p = c.encode(torch.randn(1000), generator=shared_generator(0, 1, 2))
    nb = (3 * 10 + 7) // 8
    good = torch.cat([pack_wide(torch.tensor([0, 1, 999]), 10), p.data[nb:]])
    assert torch.equal(c.decode(Payload(header=p.header, data=good)).nonzero().view(-1), torch.tensor([0, 1, 999]))
    bad = torch.cat([pack_wide(torch.tensor(sent), 10), p.data[nb:]])
    with pytest.raises(ValueError, match="sent indices must be strictly increasing and below numel=1000"):
        c.decode(Payload(header=p.header, data=bad))
