"""Triton kernels of mixed-radix packing (lowbit/codecs/kernels/gpu_radix.py) against the
torch reference of lowbit.codecs.radix: the same bytes (integer arithmetic, no float32
slack) for groups in one 64-bit word and for wide groups (57 to 113 bits, as 32-bit limbs),
round trips, refusal of group values that no digits make, and the level-count API of the
codecs routed to them. Run by tests/test_triton_interpret.py with
TRITON_INTERPRET=1 on CPU tensors."""

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_interpret.py"

from lowbit.codecs import radix  # noqa: E402
from lowbit.codecs.kernels import gpu_radix, kernels_on  # noqa: E402
from lowbit.codecs.radix import (pack_levels, pack_levels_fast, pack_radix_reference, radix_group,  # noqa: E402
                                 radix_nbytes, unpack_levels_fast, unpack_radix_reference)


def _symbols(L, n, seed):
    c = torch.randint(0, L, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    c[:min(n, 3 * radix_group(L)[0])] = L - 1  # the largest group values
    return c.to(torch.uint8 if L <= 256 else torch.int32)  # the CUDA kernels' code dtypes


# one-word groups, and wide ones: 60 (65 bits), 61 (89), 121 (90), 134 (57), 242 (103), 300 (33),
# 1061 (71), 16416 (113, the widest)
@pytest.mark.parametrize("L", [3, 5, 6, 7, 9, 15, 17, 60, 61, 100, 121, 129, 134, 200, 242, 255, 300, 1061, 16416])
def test_pack_unpack_match_the_reference(L):
    g, b = radix_group(L)
    for n in sorted({1, g - 1 or 1, g, g + 1, 8 * g + 3, 1001}):
        c = _symbols(L, n, L * 31 + n)
        data = gpu_radix.pack(c, L, g, b)
        assert data.dtype == torch.uint8 and data.numel() == radix_nbytes(n, L)
        assert torch.equal(data, pack_radix_reference(c, L)), n
        out, bad = gpu_radix.unpack(data, L, g, b, n, c.dtype)
        assert int(bad) == 0 and torch.equal(out, c), n
        assert torch.equal(unpack_radix_reference(data, L, n), c.long())


def test_wide_group_value_limits():
    """A wide group (242 levels: 13 digits in 103 bits) holding L^13 - 1 decodes; L^13 does not,
    nor does a last group of 2 digits holding L^2."""
    g, b = radix_group(242)
    top = torch.tensor(list((242 ** 13 - 1).to_bytes(13, "little")), dtype=torch.uint8)
    out, bad = gpu_radix.unpack(top, 242, g, b, 13)
    assert int(bad) == 0 and torch.equal(out, torch.full((13,), 241, dtype=torch.uint8))
    for value, n, nbytes in ((242 ** 13, 13, 13), (242 ** 2, 2, 2)):
        data = torch.tensor(list(value.to_bytes(nbytes, "little")), dtype=torch.uint8)
        assert int(gpu_radix.unpack(data, 242, g, b, n)[1]) == 1


@pytest.mark.parametrize("L,n,nbad", [(3, 10, 2), (5, 7, 3), (129, 20, 2), (61, 31, 3), (242, 27, 3),
                                      (1061, 15, 3)])
def test_bad_group_values_are_counted(L, n, nbad):
    g, b = radix_group(L)
    data = torch.full((radix_nbytes(n, L),), 255, dtype=torch.uint8)  # every group at its largest b-bit value
    _, bad = gpu_radix.unpack(data, L, g, b, n)
    assert int(bad) == nbad == -(-n // g)


@pytest.fixture
def triton_radix(monkeypatch):
    """radix's fast path takes the Triton kernels for CPU tensors (as it does for CUDA tensors)."""
    monkeypatch.setattr(radix, "kernels_for", lambda x, family="core", op=None: kernels_on("triton", family, op))


@pytest.mark.parametrize("L", [3, 4, 5, 61, 255, 300, 1061, 65537])
def test_level_api_on_the_triton_path(L, triton_radix):
    n = 777
    c = torch.randint(0, L, (n,), generator=torch.Generator().manual_seed(L))
    codes = c.to(torch.uint8 if L <= 256 else torch.int32 if L <= 2 ** 16 else torch.int64)
    data = pack_levels_fast(codes, L)
    assert torch.equal(data, pack_levels(c, L))
    assert torch.equal(unpack_levels_fast(data, L, n, torch.int64), c)
    if L == 3:
        with pytest.raises(ValueError, match="not a radix-3 packing"):
            unpack_levels_fast(torch.full_like(data, 250), L, n)
