"""Benchmarks measured side by side in one process: ``lowbit bench codecs`` (every codec
against memcpy, or ``--against references`` against plain-torch reference codecs) and
``lowbit bench step`` (the per-step wall time of each algorithm against D-PSGD and
AllReduce) and ``lowbit bench overlap`` (:mod:`lowbit.bench.overlap`: the wrapper with its
exchange overlapped with backward, against without). How they measure: :mod:`lowbit.bench.timing`."""

from .codecs import (AGAINST, MEMCPY_DEFINITION, PATHS, BenchCase, ReferencePair, bench_codecs, bench_references,
                     codec_row, default_cases, format_report, pair_row, randk_cases, reference_pairs, select)
from .timing import median_ratio, spread

__all__ = ["AGAINST", "MEMCPY_DEFINITION", "PATHS", "BenchCase", "ReferencePair", "bench_codecs", "bench_references",
           "codec_row", "default_cases", "format_report", "median_ratio", "pair_row", "randk_cases", "reference_pairs", "select",
           "spread"]
