"""``lowbit bench step``: the wall time of one training step of each algorithm, against
D-PSGD and AllReduce, in one run.

Each measurement is a short training run with lowbit's own loop
(:func:`lowbit.train.loop.run_worker` on :func:`lowbit.comm.inprocess.run_threads`
thread workers, one torch thread, no evaluation). Every worker records the wall
clock (``time.perf_counter``; on CUDA after synchronizing the device) when
each of its steps ends (after the algorithm's ``after_update``); step ``k`` of the run ends when its last worker
ends it, ``T_k = max_i t_ik``, and takes ``T_k - T_{k-1}``. The per-step time
is the median of these over steps ``warmup..steps-1``: the first ``warmup``
steps (lazy initialization, threads starting at different times) are left out,
and, as with the Timer's median over blocks, a step during which a loaded
machine took the cores away moves the median little.

Rounds interleave the algorithms: in each round every algorithm runs once, in
the same order; the ratios to D-PSGD and to AllReduce are taken within a round
and the reported figure is their median over rounds
(:mod:`lowbit.bench.timing`).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from dataclasses import dataclass, field

from .table import Column, span_column, table_lines
from .timing import check_positive_int, median_ratio, pinned_threads, spread

BASELINES = ("dpsgd", "allreduce")


@dataclass(frozen=True)
class StepCase:
    """``label`` (unique, shown in the table) and the :class:`TrainConfig` options that
    make it (on top of the bench's task, workers, steps, device)."""

    label: str
    options: dict = field(default_factory=dict)


def default_step_cases() -> list[StepCase]:
    """The algorithms ``lowbit bench step`` times by default (``--algorithms`` picks among them)."""
    return [StepCase("dpsgd", dict(algorithm="dpsgd")), StepCase("allreduce", dict(algorithm="allreduce")),
            StepCase("moniqua 2-bit", dict(algorithm="moniqua", bits=2)),
            StepCase("moniqua 1-bit", dict(algorithm="moniqua", bits=1)),
            # without verification, hence without the repair round that a wrong block costs
            StepCase("moniqua 2-bit unverified", dict(algorithm="moniqua", bits=2, theta=0.05, verify=False)),
            StepCase("choco", dict(algorithm="choco")), StepCase("dcd", dict(algorithm="dcd")),
            StepCase("deepsqueeze", dict(algorithm="deepsqueeze")), StepCase("qsgd", dict(algorithm="qsgd")),
            StepCase("powersgd", dict(algorithm="powersgd")), StepCase("maxnorm", dict(algorithm="maxnorm"))]


def select_steps(cases: list[StepCase], algorithms: str | list[str] | None) -> list[StepCase]:
    """The cases named in ``algorithms`` (labels, comma-separated or a list; the algorithm
    name selects all its cases, e.g. ``moniqua``), always with the baselines D-PSGD and
    AllReduce; None keeps all. An unknown name is a ValueError."""
    if algorithms is None:
        return list(cases)
    names = [n.strip() for n in (algorithms.split(",") if isinstance(algorithms, str) else algorithms) if n.strip()]
    if not names:
        raise ValueError("algorithms must name at least one algorithm (comma-separated), got an empty list")
    algo = lambda c: c.options.get("algorithm", c.label)  # noqa: E731
    valid = {c.label for c in cases} | {algo(c) for c in cases}
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"algorithms: unknown {', '.join(map(repr, unknown))}; choose from: "
                         f"{', '.join(c.label for c in cases)}")
    return [c for c in cases if algo(c) in BASELINES or c.label in names or algo(c) in names]


def step_config(case: StepCase, task: str, workers: int, steps: int, device: str = "cpu", seed: int = 0):
    """The :class:`TrainConfig` of one timed run of ``case``: thread backend, and
    ``eval_every`` past the last step (the loop also runs with ``evaluate=False``)."""
    from ..train.config import TrainConfig

    return TrainConfig(**{"task": task, "workers": workers, "steps": steps, "device": device, "seed": seed,
                          "eval_every": steps + 1, "backend": "thread", **case.options})


def step_end_times(cfg) -> list[list[float]]:
    """Run ``cfg`` on thread workers; each worker's wall clock at the end of each step
    (on CUDA read after synchronizing the device, so the step's kernels are inside)."""
    import torch

    from ..comm.inprocess import run_threads
    from ..train.config import resolve_device
    from ..train.loop import run_worker

    device = resolve_device(cfg.device)  # the thread runtime's workers share it
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    stamps: dict[int, list[float]] = {}
    lock = threading.Lock()

    def instrument(algo) -> None:
        mine: list[float] = []
        with lock:
            stamps[algo.rank] = mine
        after = algo.after_update

        def after_update(*args, **kwargs):
            out = after(*args, **kwargs)
            sync()
            mine.append(time.perf_counter())
            return out

        algo.after_update = after_update  # this worker's instance only

    run_threads(cfg.workers, functools.partial(run_worker, cfg=cfg, evaluate=False, instrument=instrument))
    return [stamps[r] for r in sorted(stamps)]


def step_intervals(end_times: list[list[float]], warmup: int) -> list[float]:
    """``T_k - T_{k-1}`` for ``k = warmup..steps-1``, with ``T_k`` the latest worker's end
    of step ``k`` (module doc). ``warmup >= 1``: the first interval starts at the end of
    step ``warmup - 1``."""
    if not end_times or any(len(t) != len(end_times[0]) for t in end_times):
        raise ValueError("end_times must hold one equal-length list of step end times per worker")
    steps = len(end_times[0])
    if not 1 <= warmup < steps:
        raise ValueError(f"warmup must be in [1, steps - 1] = [1, {steps - 1}], got {warmup}")
    T = [max(t[k] for t in end_times) for k in range(steps)]
    return [T[k] - T[k - 1] for k in range(warmup, steps)]


def step_seconds(end_times: list[list[float]], warmup: int) -> float:
    """The per-step time: the median of :func:`step_intervals`."""
    return statistics.median(step_intervals(end_times, warmup))


def bench_step(task: str = "digits-mlp", workers: int = 8, steps: int = 40, warmup: int = 10, rounds: int = 5,
               device: str = "cpu", algorithms: str | list[str] | None = None,
               cases: list[StepCase] | None = None, seed: int = 0) -> dict:
    """Per-step wall seconds of each case, ``rounds`` interleaved rounds; each case's
    ratios to D-PSGD and AllReduce are medians of per-round ratios."""
    from ..train.config import resolve_device

    check_positive_int(workers, "workers")
    check_positive_int(steps, "steps", 2)
    check_positive_int(rounds, "rounds")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 1 <= warmup < steps:
        raise ValueError(f"warmup must be an integer in [1, steps - 1] = [1, {steps - 1}], got {warmup!r}")
    cases = select_steps(cases if cases is not None else default_step_cases(), algorithms)
    labels = [c.label for c in cases]
    if len(set(labels)) != len(labels):
        raise ValueError(f"step cases need unique labels, got {labels}")
    missing = [b for b in BASELINES if b not in labels]
    if missing:
        raise ValueError(f"the step bench compares against {', '.join(BASELINES)}; cases lack {', '.join(missing)}")
    configs = {c.label: step_config(c, task, workers, steps, device, seed) for c in cases}
    timings: list[dict] = []  # per round: each case's median step seconds
    means: list[dict] = []  # per round: each case's mean step seconds (stalls included)
    with pinned_threads(1) as threads:  # as lowbit train's thread runtime: workers share the cores
        for _ in range(rounds):
            intervals = {label: step_intervals(step_end_times(cfg), warmup) for label, cfg in configs.items()}
            timings.append({label: statistics.median(v) for label, v in intervals.items()})
            means.append({label: statistics.fmean(v) for label, v in intervals.items()})
    rows = []
    for c in cases:
        per = [{"case": r[c.label], **{b: r[b] for b in BASELINES}} for r in timings]
        rows.append({"algorithm": c.label, "options": c.options,
                     "step_ms": 1e3 * statistics.median(r[c.label] for r in timings),
                     "mean_step_ms": 1e3 * statistics.median(r[c.label] for r in means),
                     **{f"x_{b}": median_ratio(per, "case", b) for b in BASELINES},
                     **{f"x_{b}_range": spread(per, "case", b) for b in BASELINES},
                     "rounds": [r[c.label] for r in timings]})
    return {"benchmark": "step", "task": task, "workers": workers, "steps": steps, "warmup": warmup,
            "rounds": rounds, "device": str(resolve_device(device)), "threads": threads, "rows": rows}


def format_step_report(report: dict) -> str:
    """The report of :func:`bench_step` as the text ``lowbit bench step`` prints."""
    lines = [f"per-step wall time, {report['task']}, {report['workers']} thread workers on {report['device']}, "
             f"{report['threads']} torch thread, steps {report['warmup']}..{report['steps'] - 1} of each run "
             f"(first {report['warmup']} left out), {report['rounds']} interleaved rounds, "
             f"medians of per-round ratios; step ms: median step of a run (mean ms: its mean, stalls included), "
             f"median over rounds"]
    cols = [Column("algorithm", 16, "algorithm", left=True), Column("step ms", 9, "step_ms", ".2f"),
            Column("mean ms", 9, "mean_step_ms", ".2f"), Column("x dpsgd", 8, "x_dpsgd", ".2f"),
            span_column("x_dpsgd_range", ".2f", 11), Column("x allreduce", 11, "x_allreduce", ".2f"),
            span_column("x_allreduce_range", ".2f", 11)]
    return "\n".join(lines + table_lines(cols, report["rows"]))
