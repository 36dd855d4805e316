"""pytest-benchmark twin of ``lowbit bench codecs --against references``: encode + decode
of each lowbit codec and of the plain-torch reference computing the same quantizer.

Run: ``OMP_NUM_THREADS=1 python -m pytest benchmarks/test_references_bench.py --benchmark-only
--benchmark-group-by=param:pair`` (each group: lowbit beside its reference).
"""

import pytest
import torch

from lowbit.bench import reference_pairs
from lowbit.bench.codecs import bench_data, roundtrip_calls

SIZE = 1_000_000
PAIRS = reference_pairs(SIZE)
DEVICE = torch.device("cpu")


@pytest.fixture(scope="module")
def data():
    return bench_data(SIZE, DEVICE)


@pytest.mark.parametrize("side", ["lowbit", "reference"])
@pytest.mark.parametrize("pair", PAIRS, ids=[p.label for p in PAIRS])
def test_roundtrip(benchmark, data, pair, side):
    x, ref = data
    lowbit, reference = roundtrip_calls(pair.make(), pair.make_reference(), x, ref, 0, DEVICE, pair.decode_out)
    benchmark(lowbit if side == "lowbit" else reference)
