"""Two CPU kernel pairs kept apart for speed, each against its one-loop merge, at 1e6 codes:
``cpu_lanes.pack_words`` (``R``, ``k`` at run time) against ``specialised(R, k)``'s
``pack_all``, and ``cpu_sign._sign_encode`` (separate order-0 loop) against one loop with
the lane sums behind an ``order != 0`` test, or with order 0 adding 0.0. Results are checked
equal first; then the two are timed interleaved (thread CPU time, median of 5 blocks of 20
calls, order alternating per round) and the median of the per-round ratios merged / kept is
printed, with min and max.

Run: ``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/kernel_pairs.py``.
"""
import statistics
import time

import numpy as np

from lowbit.codecs.kernels.cpu import _jit, nonfinite
from lowbit.codecs.kernels import cpu_lanes as L
import lowbit.codecs.kernels.cpu_sign as S

@_jit
def sign_merged(x, order, out):
    """``_sign_encode`` as one loop: the lane sums behind ``order != 0``."""
    n = x.shape[0]
    full = n // 8
    bad = False
    lanes = np.zeros(8)
    for j in range(full):
        acc = 0
        for k in range(8):
            v = np.float64(x[8 * j + k])
            bad |= nonfinite(v)
            acc |= (1 if v >= 0.0 else 0) << k
            if order != 0:
                lanes[k] += abs(v) if order == 1 else v * v
        out[j] = np.uint8(acc)
    if full * 8 < n:
        acc = 0
        for k in range(n - full * 8):
            v = np.float64(x[8 * full + k])
            bad |= nonfinite(v)
            acc |= (1 if v >= 0.0 else 0) << k
            lanes[k] += 0.0 if order == 0 else (abs(v) if order == 1 else v * v)
        out[full] = np.uint8(acc)
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    return total, bad

@_jit
def sign_merged_add(x, order, out):
    """``_sign_encode`` as one loop: order 0 adds 0.0 to the lane sums."""
    n = x.shape[0]
    full = n // 8
    bad = False
    lanes = np.zeros(8)
    for j in range(full):
        acc = 0
        for k in range(8):
            v = np.float64(x[8 * j + k])
            bad |= nonfinite(v)
            acc |= (1 if v >= 0.0 else 0) << k
            lanes[k] += 0.0 if order == 0 else (abs(v) if order == 1 else v * v)
        out[j] = np.uint8(acc)
    if full * 8 < n:
        acc = 0
        for k in range(n - full * 8):
            v = np.float64(x[8 * full + k])
            bad |= nonfinite(v)
            acc |= (1 if v >= 0.0 else 0) << k
            lanes[k] += 0.0 if order == 0 else (abs(v) if order == 1 else v * v)
        out[full] = np.uint8(acc)
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    return total, bad

def t(f, reps):
    """Median nanoseconds per call of ``f`` over 5 blocks of ``reps`` calls."""
    best = []
    for _ in range(5):
        s = time.thread_time_ns()
        for _ in range(reps):
            f()
        best.append((time.thread_time_ns() - s) / reps)
    return statistics.median(best)

def race(name, a, b, rounds=15, reps=20):
    """Print the median of per-round ratios b / a (``b`` the merge)."""
    a()
    b()
    rs = []
    for r in range(rounds):
        if r % 2:
            tb, ta = t(b, reps), t(a, reps)
        else:
            ta, tb = t(a, reps), t(b, reps)
        rs.append(tb / ta)
    print(f"{name}: merged/kept median {statistics.median(rs):.3f} (min {min(rs):.3f} max {max(rs):.3f}); kept {ta/1e3:.0f} us", flush=True)

n = 1_000_000
rng = np.random.default_rng(0)
for R, k in [(5, 27), (9, 19), (17, 15), (33, 12)]:
    codes = rng.integers(-(R // 2), R // 2 + 1, n).astype(np.int8)
    out = np.empty(-(-n // k), np.int64)
    out2 = out.copy()
    pa = L.specialised(R, k)[0]
    pa(codes, out)
    L.pack_words(codes, R, k, out2)
    assert (out == out2).all()
    race(f"lanes pack R={R} k={k}", lambda: pa(codes, out), lambda: L.pack_words(codes, R, k, out2))
x = rng.standard_normal(n).astype(np.float32)
o1 = np.empty((n + 7) // 8, np.uint8)
o2 = o1.copy()
for order in (0, 1, 2):
    r1, r2 = S._sign_encode(x, order, o1), sign_merged(x, order, o2)
    assert r1 == r2 and (o1 == o2).all(), order
    assert sign_merged_add(x, order, o2) == r1 and (o1 == o2).all(), order
    race(f"sign order={order} (if order != 0)", lambda: S._sign_encode(x, order, o1), lambda: sign_merged(x, order, o2))
    race(f"sign order={order} (add 0.0)", lambda: S._sign_encode(x, order, o1), lambda: sign_merged_add(x, order, o2))
