"""pytest-benchmark twin of ``lowbit bench codecs``: the same data, codecs and calls.

Run: ``pip install ".[bench]" && OMP_NUM_THREADS=1 python -m pytest benchmarks --benchmark-only``
(``--benchmark-group-by=param:size`` puts each codec beside memcpy). pytest-benchmark
reports each timing on its own; the ratios the CLI reports (medians of per-round
ratios, timed interleaved) are ``lowbit bench codecs``'s.
"""

import pytest
import torch

from lowbit.bench import default_cases
from lowbit.bench.codecs import codec_calls, bench_data

SIZES = (1_000_000,)
CASES = default_cases()
DEVICE = torch.device("cpu")


@pytest.fixture(scope="module", params=SIZES)
def data(request):
    return bench_data(request.param, DEVICE)


def test_memcpy(benchmark, data):
    x, _ = data
    out = torch.empty_like(x)
    benchmark(out.copy_, x)


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_encode(benchmark, data, case):
    x, ref = data
    encode, _, _ = codec_calls(case.make(), x, ref, 0, DEVICE)
    benchmark(encode)


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_decode(benchmark, data, case):
    x, ref = data
    _, decode, _ = codec_calls(case.make(), x, ref, 0, DEVICE)
    benchmark(decode)
