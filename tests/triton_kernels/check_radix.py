"""Triton kernels of mixed-radix packing (lowbit/codecs/kernels/gpu_radix.py) against the
torch reference of lowbit.codecs.radix: the same bytes (integer arithmetic, no float32
slack), round trips, refusal of group values that no digits make, and the level-count API
of the codecs routed to them. Run by tests/test_triton_interpret.py with
TRITON_INTERPRET=1 on CPU tensors."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import radix  # noqa: E402
from lowbit.codecs.kernels import gpu, gpu_radix  # noqa: E402
from lowbit.codecs.radix import (pack_levels, pack_levels_fast, pack_radix_reference, radix_group,  # noqa: E402
                                 radix_nbytes, unpack_levels_fast, unpack_radix_reference)


def _symbols(L, n, seed):
    c = torch.randint(0, L, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    c[:min(n, 3)] = L - 1  # the largest group value
    return c.to(torch.uint8)


@pytest.mark.parametrize("L", [3, 5, 6, 7, 9, 15, 17, 60, 100, 129, 200, 255])
def test_pack_unpack_match_the_reference(L):
    g, b = radix_group(L)
    for n in sorted({1, g - 1 or 1, g, g + 1, 8 * g + 3, 1001}):
        c = _symbols(L, n, L * 31 + n)
        data = gpu_radix.pack(c, L, g, b)
        assert data.dtype == torch.uint8 and data.numel() == radix_nbytes(n, L)
        assert torch.equal(data, pack_radix_reference(c, L)), n
        out, bad = gpu_radix.unpack(data, L, g, b, n)
        assert int(bad) == 0 and torch.equal(out, c), n
        assert torch.equal(unpack_radix_reference(data, L, n), c.long())


@pytest.mark.parametrize("L,n,nbad", [(3, 10, 2), (5, 7, 3), (129, 20, 3)])
def test_bad_group_values_are_counted(L, n, nbad):
    g, b = radix_group(L)
    data = torch.full((radix_nbytes(n, L),), 255, dtype=torch.uint8)  # every group at its largest b-bit value
    _, bad = gpu_radix.unpack(data, L, g, b, n)
    assert int(bad) == nbad == -(-n // g)


@pytest.fixture
def triton_radix(monkeypatch):
    """radix's fast path takes the Triton kernels for CPU tensors (as it does for CUDA tensors)."""
    monkeypatch.setattr(radix, "kernels_for", lambda x, family="core": gpu_radix if family == "radix" else gpu)


@pytest.mark.parametrize("L", [3, 4, 5, 255, 300])
def test_level_api_on_the_triton_path(L, triton_radix):
    n = 777
    c = torch.randint(0, L, (n,), generator=torch.Generator().manual_seed(L))
    codes = c.to(torch.uint8 if L <= 256 else torch.int64)
    data = pack_levels_fast(codes, L)
    assert torch.equal(data, pack_levels(c, L))
    assert torch.equal(unpack_levels_fast(data, L, n, torch.int64), c)
    if L == 3:
        with pytest.raises(ValueError, match="not a radix-3 packing"):
            unpack_levels_fast(torch.full_like(data, 250), L, n)
