"""How every lowbit benchmark measures: one place.

* A timing is ``torch.utils.benchmark.Timer(...).blocked_autorange()``: the
  statement runs in blocks of ``number`` calls (``number`` chosen so one block
  outlasts the timer's resolution), blocks repeat until ``min_run_time``
  seconds have passed, and the time per call is the median over blocks. The
  first block-size estimate doubles as a warm-up. On CUDA the timer
  synchronizes the device before reading the clock, so a call's queued kernels
  are inside its time.
* Clock: on the CPU by default the thread's CPU time (``time.thread_time``; the
  statement runs in the calling thread, and with one torch thread all its work
  is there), so the time a shared machine's scheduler takes the core away is
  not counted; ``clock="wall"`` uses ``timeit.default_timer`` instead. On a
  machine with the cores to itself the two agree; on a loaded one the wall
  clock inflates long calls (preempted more often) far more than short ones,
  the CPU clock does not. On CUDA the clock is the wall clock read after
  synchronizing the device.
* Threads: the Timer runs with ``num_threads`` torch threads (lowbit's
  benchmarks pass 1, and :func:`pinned_threads` pins the whole benchmark).
* Comparisons are made round by round: in each round the things compared are
  timed one right after the other (interleaved), a ratio is taken inside the
  round, and the reported figure is the median of the per-round ratios. A slow
  spell on a shared machine then moves both sides of a ratio together, and one
  bad round moves a median little.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import timeit
import traceback
import warnings
from collections.abc import Callable, Sequence

import torch

from ..comm.inprocess import pinned_threads  # noqa: F401  (the benchmarks' thread pinning)

__all__ = ["CLOCKS", "check_positive_float", "check_positive_int", "clock_for", "host_syncs", "measure",
           "median_ratio", "pinned_threads", "resolve_clock", "spread", "syncs_within"]


def check_positive_int(value, name: str, lo: int = 1) -> int:
    """``value`` as an int ``>= lo``; otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


def check_positive_float(value, name: str) -> float:
    """``value`` as a finite float ``> 0``; otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


CLOCKS = ("auto", "cpu", "wall")


def resolve_clock(clock: str, device: torch.device) -> str:
    """``auto`` is ``cpu`` (thread CPU time) on the CPU and ``wall`` on CUDA; ``cpu`` on
    CUDA is a ValueError (kernels run on the GPU, not in the thread)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is unknown; choose one of: {', '.join(CLOCKS)}")
    if clock == "auto":
        return "wall" if device.type == "cuda" else "cpu"
    if clock == "cpu" and device.type == "cuda":
        raise ValueError("clock='cpu' times the calling thread's CPU work; on CUDA use clock='wall' (or auto)")
    return clock


def clock_for(device: torch.device, clock: str = "auto") -> Callable[[], float]:
    """The Timer's clock (module doc): thread CPU time, or the wall clock; on CUDA the
    device is synchronized first (so queued kernels are timed, also on a ``cuda:N``
    other than the current device)."""
    clock = resolve_clock(clock, device)
    if device.type == "cuda":
        def synced() -> float:
            torch.cuda.synchronize(device)
            return timeit.default_timer()

        return synced
    return time.thread_time if clock == "cpu" else timeit.default_timer


def measure(fn: Callable[[], object], device: torch.device, min_run_time: float, threads: int = 1,
            clock: str = "auto") -> float:
    """Median seconds per call of ``fn()`` by ``Timer.blocked_autorange`` (see the module doc)."""
    from torch.utils.benchmark import Timer

    timer = Timer(stmt="fn()", globals={"fn": fn}, timer=clock_for(device, clock), num_threads=threads)
    return float(timer.blocked_autorange(min_run_time=min_run_time).median)


def _ratios(rounds: Sequence[dict], num: str | Sequence[str], den: str) -> list[float]:
    if not rounds:
        raise ValueError("rounds must hold at least one round of timings")
    keys = (num,) if isinstance(num, str) else tuple(num)
    out = []
    for i, r in enumerate(rounds):
        for k in (*keys, den):
            if k not in r:
                raise ValueError(f"round {i} has no timing {k!r} (has {sorted(r)})")
            if not (isinstance(r[k], (int, float)) and r[k] > 0 and r[k] < float("inf")):
                raise ValueError(f"round {i}: timing {k!r} must be a finite number of seconds > 0, got {r[k]!r}")
        out.append(sum(r[k] for k in keys) / r[den])
    return out


def median_ratio(rounds: Sequence[dict], num: str | Sequence[str], den: str) -> float:
    """The median over rounds of ``sum(round[k] for k in num) / round[den]``: each ratio is
    taken inside one round (timings measured side by side), then the median is taken."""
    return statistics.median(_ratios(rounds, num, den))


def spread(rounds: Sequence[dict], num: str | Sequence[str], den: str) -> tuple[float, float]:
    """(smallest, largest) per-round ratio, to show how far the rounds agree."""
    r = _ratios(rounds, num, den)
    return min(r), max(r)


def host_syncs(fn: Callable[[], object]) -> tuple[object, list[str]]:
    """``(fn(), where)``: ``where`` lists, as ``"file:line"``, each place where ``fn`` made the
    host wait for the GPU, as torch's CUDA sync debug mode sees them (copies to and from the
    host, ``.item()``, stream synchronisations; a prototype of torch's that may miss some).
    Needs CUDA (RuntimeError otherwise). What is counted is :func:`syncs_within`'s."""
    if not torch.cuda.is_available():
        raise RuntimeError("host_syncs counts a GPU's synchronisations with the host: CUDA is not available here")
    return syncs_within(fn, lambda: torch.cuda.set_sync_debug_mode("warn"),
                        lambda: torch.cuda.set_sync_debug_mode("default"))


def _library_dirs() -> tuple[str, ...]:
    """The folders of the libraries a synchronisation is reported from (torch's Python code,
    Triton's launcher), not the code that asked for it."""
    dirs = [os.path.dirname(torch.__file__)]
    try:
        import triton

        dirs.append(os.path.dirname(triton.__file__))
    except ImportError:
        pass
    return tuple(d + os.sep for d in dirs)


def syncs_within(fn: Callable[[], object], start: Callable[[], None], stop: Callable[[], None]
                 ) -> tuple[object, list[str]]:
    """``(fn(), where)`` for the synchronisation warnings ("...synchronizing...") raised on this
    thread while ``fn`` runs, between ``start()`` (which turns the warnings on) and ``stop()``.

    Counted are only the warnings raised inside ``fn``'s own call, never one that ``stop()``
    raises as it turns them off (issue 28: on torch 2.11 each count had one read more, reported
    from ``torch/cuda/__init__.py``, torch's own Python code). Each is named by the innermost
    frame of its stack outside torch's and Triton's Python code: the line that asked torch for
    the read."""
    me, libs, seen, inside = threading.get_ident(), _library_dirs(), [], [False]

    def record(message, category, filename, lineno, file=None, line=None):
        if inside[0] and threading.get_ident() == me and "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]
            caller = next((f for f in reversed(stack) if not f.filename.startswith(libs)
                           and f.filename not in (__file__, warnings.__file__)), None)
            seen.append(f"{filename}:{lineno}" if caller is None else f"{caller.filename}:{caller.lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        start()
        try:
            inside[0] = True
            result = fn()
        finally:
            inside[0] = False
            stop()
    return result, seen
