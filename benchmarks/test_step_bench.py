"""pytest-benchmark twin of ``lowbit bench step``: one short training run per algorithm
(digits-mlp, 8 thread workers, one torch thread, no evaluation).

pytest-benchmark times the whole run (setup included); the per-step wall time that
``lowbit bench step`` reports (steps after the warm-up, the latest worker's step ends)
is stored in each result's ``extra_info["step_ms"]``.

Run: ``OMP_NUM_THREADS=1 python -m pytest benchmarks/test_step_bench.py --benchmark-only``.
"""

import statistics

import pytest

from lowbit.bench.step import default_step_cases, step_config, step_end_times, step_seconds

CASES = default_step_cases()
STEPS, WARMUP = 40, 10


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_step(benchmark, case):
    cfg = step_config(case, "digits-mlp", 8, STEPS)
    seconds = []

    def run():
        seconds.append(step_seconds(step_end_times(cfg), WARMUP))

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)  # one torch thread: conftest.py
    benchmark.extra_info["step_ms"] = 1e3 * statistics.median(seconds)
