"""Two source trees' kernels side by side in one process: what the before/after kernel
benchmarks (``moniqua_kernels.py``, ``kernel_pairs.py``) share.

:func:`load_before` imports a module of another tree (a git worktree of the commit to compare
with) as the package ``lowbit_before``; :func:`private_numba_cache` points numba's cache at a
fresh temporary folder first (a cache entry of ``lowbit_before`` in the tree would break that
tree's own imports), so both trees compile; :func:`race` times each named call of both trees
in rounds, the trees' order swapping every round, the best of ``reps`` calls by the thread's
CPU time (the work, without the waits for a core on a loaded machine) or the wall clock, and
prints the medians over rounds and the median of the per-round ratios after/before.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time


def private_numba_cache() -> str:
    """A fresh folder as numba's cache, removed at exit; one numba thread. Call it before
    importing lowbit."""
    cache = tempfile.mkdtemp(prefix="lowbit_trees_numba_")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["NUMBA_CACHE_DIR"] = cache
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    return cache


def load_before(tree: str, module: str):
    """``lowbit.<module>`` of the lowbit in ``tree``, imported as ``lowbit_before.<module>``."""
    root = os.path.join(os.path.realpath(tree), "lowbit")
    if "lowbit_before" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lowbit_before", os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["lowbit_before"] = pkg
        spec.loader.exec_module(pkg)
    mod = importlib.import_module(f"lowbit_before.{module}")
    if not os.path.realpath(mod.__file__).startswith(root):
        raise SystemExit(f"imported the before kernels from {mod.__file__}, not from {tree}")
    return mod


def race(calls: dict, rounds: int, reps: int, clock: str = "cpu", per: int | None = None) -> dict:
    """``calls``: name -> ``(before_call, after_call)``. Prints and returns, per name, the medians
    (seconds per call) and the median per-round ratio after/before (below 1: after is faster);
    ``per``: also print nanoseconds per that many elements."""
    tick = time.thread_time if clock == "cpu" else time.perf_counter

    def best(call) -> float:
        out = float("inf")
        for _ in range(reps):
            t = tick()
            call()
            out = min(out, tick() - t)
        return out

    res = {(side, name): [] for side in (0, 1) for name in calls}
    for r in range(rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            for name, pair in calls.items():
                res[side, name].append(best(pair[side]))
    out = {}
    for name in calls:
        b, a = res[0, name], res[1, name]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        out[name] = (statistics.median(b), statistics.median(a), ratio)
        each = (f"  ({out[name][0] / per * 1e9:.2f} -> {out[name][1] / per * 1e9:.2f} ns/element)" if per else "")
        print(f"{name:24s} before {out[name][0] * 1e3:7.3f} ms  after {out[name][1] * 1e3:7.3f} ms{each}"
              f"  median ratio after/before {ratio:.3f}", flush=True)
    return out
