"""pytest-benchmark twin of ``lowbit bench codecs``.

Run: ``pip install ".[bench]" && python -m pytest benchmarks --benchmark-only``
(``--benchmark-group-by=param:size`` puts each codec beside memcpy).
"""

import pytest
import torch

from lowbit.bench import default_cases
from lowbit.codecs import CodecKind, shared_generator

SIZES = (1_000_000,)
CASES = default_cases()


@pytest.fixture(scope="module", params=SIZES)
def data(request):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(request.param, generator=g) * 0.05
    return x, x + (torch.rand(request.param, generator=g) - 0.5) * 0.01


def test_memcpy(benchmark, data):
    x, _ = data
    out = torch.empty_like(x)
    benchmark(out.copy_, x)


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_encode(benchmark, data, case):
    x, _ = data
    codec = case.make()
    benchmark(lambda: codec.encode(x, generator=shared_generator(0, 0, 0)))


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_decode(benchmark, data, case):
    x, ref = data
    codec = case.make()
    payload = codec.encode(x, generator=shared_generator(0, 0, 0))
    kw = {"ref": ref} if codec.kind is CodecKind.SIDE_INFO else {}
    benchmark(lambda: codec.decode(payload, generator=shared_generator(0, 0, 0), **kw))
