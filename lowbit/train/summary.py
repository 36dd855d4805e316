"""The summary of a finished run: its emulated clock (:func:`step_clock`, the network model
applied to each worker's ledger), the combined algorithm report, and the rows of ``metrics.jsonl``
and ``summary.json`` (:func:`summarize`, :func:`metrics_rows`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..algorithms import ALGORITHMS
from ..comm.ledger import Ledger
from .config import TrainConfig
from .loop import WorkerResult


@dataclass(frozen=True)
class StepClock:
    """The emulated clock of a run, per step (see :func:`step_clock`).

    ``compute``: compute seconds; ``comm``: the network model's communication
    seconds; ``seconds``: what the step took on the emulated clock;
    ``rank``: the worker whose clock it is (asynchronous runs), None for a
    synchronous run (the slowest worker of each step)."""

    compute: list[float]
    comm: list[float]
    seconds: list[float]
    rank: int | None


def overlaps_compute(algorithm: str) -> bool:
    """Whether a step of ``algorithm`` may communicate while it computes its gradient.

    True for the asynchronous algorithms (AD-PSGD and moniqua-async, the only
    ones lowbit has): the gradient of step k is taken at the model as read at
    the start of the step, before the step's own exchange averages it in
    (:mod:`lowbit.algorithms.adpsgd`), and the request carries the model, not
    the gradient; the optimizer step needs both. So the exchange can run on a
    communication thread while the gradient is computed, as Lian et al. (2018)
    run it. The synchronous algorithms are priced as lowbit runs them: the
    exchange after the gradient (their codecs and compensations use it, and
    no overlap is claimed for the others either)."""
    return not ALGORITHMS[algorithm].synchronous


def step_clock(cfg: TrainConfig, results: list[WorkerResult], ledgers: list[Ledger]) -> StepClock:
    """The emulated clock of a finished run (the model, stated exactly):

    - compute c_ik: worker i's measured compute seconds of step k (thread CPU
      time of the gradient, the algorithm's encoding/decoding and the optimizer
      step, plus the ``--slow`` extra);
    - communication g_ik: the network model (``cfg.network()``,
      :mod:`lowbit.comm.netmodel`) applied to the records worker i's ledger holds
      at step k: synchronous algorithms ``step_seconds`` (the step's ops one
      after another, a neighbour exchange one message time on parallel links);
      asynchronous ones ``gossip_step_seconds`` (the round trip of the worker's
      own request and the reply it waits for; the replies it sends are priced
      in their requesters' round trips);
    - synchronous run: every step waits for the slowest worker, first in
      compute, then in communication (no overlap):
      ``seconds_k = max_i c_ik + max_i g_ik``;
    - asynchronous run: no barrier; a worker's step overlaps its gradient with
      its exchange (:func:`overlaps_compute`), ``s_ik = max(c_ik, g_ik)``; every
      worker runs ``cfg.steps`` steps, so the run ends with the worker of the
      largest ``sum_k s_ik`` and the clock is that worker's own.
    The gossip messages of an asynchronous run must all have one size (so the
    reply a request waits for, recorded on the partner's ledger, has the
    request's size); otherwise ValueError."""
    n, net = cfg.workers, cfg.network()
    steps = range(cfg.steps)
    if not overlaps_compute(cfg.algorithm):
        comm = [[net.step_seconds(led.records.get(k, ()), n) for k in steps] for led in ledgers]
        compute = [max(r.compute_seconds[k] for r in results) for k in steps]
        slowest = [max(c[k] for c in comm) for k in steps]
        return StepClock(compute, slowest, [a + b for a, b in zip(compute, slowest)], None)
    sizes = {r.nbytes for led in ledgers for recs in led.records.values() for r in recs}
    if len(sizes) > 1:
        raise ValueError(f"the gossip messages of an asynchronous run must all have one size (the clock "
                         f"prices a reply at its request's size), got sizes {sorted(sizes)}")
    comm = [[net.gossip_step_seconds(led.records.get(k, ()), n) for k in steps] for led in ledgers]
    by_rank = {led.rank: c for led, c in zip(ledgers, comm)}
    per_worker = [(r.rank, list(r.compute_seconds), by_rank[r.rank]) for r in results]
    totals = [[max(c, g) for c, g in zip(cs, gs)] for _, cs, gs in per_worker]
    i = max(range(len(per_worker)), key=lambda i: (math.fsum(totals[i]), -per_worker[i][0]))
    rank, compute, g = per_worker[i]
    return StepClock(compute, g, totals[i], rank)


def emulated_clock(cfg: TrainConfig, results: list[WorkerResult], ledgers: list[Ledger]) -> tuple[list[float], list[float]]:
    """Emulated (compute, communication) seconds of each step, by :func:`step_clock`;
    the communication is the part not hidden behind compute (``seconds - compute``,
    all of it for a synchronous run), so that compute + communication is the step's
    time on the clock."""
    clock = step_clock(cfg, results, ledgers)
    if clock.rank is None:  # synchronous: nothing overlaps
        return clock.compute, clock.comm
    return clock.compute, [s - c for s, c in zip(clock.seconds, clock.compute)]


def _combine_reports(results: list[WorkerResult]) -> dict:
    """Algorithm.report() of all workers: int counters summed, float settings from rank 0."""
    first = min(results, key=lambda r: r.rank).report
    return {k: sum(r.report[k] for r in results) if isinstance(v, int) else v for k, v in first.items()}


def summarize(cfg: TrainConfig, results: list[WorkerResult], wall_seconds: float) -> dict:
    """The run's summary; logs the algorithm's :meth:`~lowbit.algorithms.Algorithm.run_warning`
    of the combined report (once per run, whatever the number of workers)."""
    n = cfg.workers
    report = _combine_reports(results)
    warning = ALGORITHMS[cfg.algorithm].run_warning(report)
    if warning:
        logging.getLogger("lowbit").warning(warning)
    ledgers = [Ledger.from_rows(r.rank, n, r.ledger_rows) for r in results]
    d = results[0].params.numel()
    compute, comm = (math.fsum(t) for t in emulated_clock(cfg, results, ledgers))
    bytes_sent = sum(led.bytes_sent for led in ledgers)
    # 8 * bytes a worker really sent per step / d, averaged over workers and steps (headers,
    # padding and wide sum dtypes included); the nominal bits are the algorithm's own count.
    wire_bits = 8.0 * bytes_sent / (n * cfg.steps * d) if d else 0.0
    last = results[0].evals[-1]
    return {
        "final_test_accuracy": last["test_accuracy"],
        "final_local_test_accuracy": last["local_test_accuracy"],
        "final_train_loss": last["train_loss"],
        "final_grad_norm_sq": last["grad_norm_sq"],
        "final_consensus_distance": last["consensus_distance"],
        "bytes_sent": bytes_sent,
        "bytes_sent_per_step": bytes_sent / cfg.steps,
        "messages_sent": sum(led.messages_sent for led in ledgers),
        "nominal_bits_per_element": sum(r.nominal_bits_per_element for r in results) / n,  # NDQSG groups differ
        "wire_bits_per_element": wire_bits,
        "parameters": d,
        "extra_memory_bytes": max(r.extra_memory_bytes for r in results),
        "algorithm_report": report,
        "emulated_seconds": compute + comm,
        "emulated_compute_seconds": compute,
        "emulated_comm_seconds": comm,
        "wall_seconds": wall_seconds,
        "steps": cfg.steps,
        **({"resume": results[0].resume} if results[0].resume else {}),
        "config": cfg.to_dict(),
    }


def metrics_rows(cfg: TrainConfig, results: list[WorkerResult]) -> list[dict]:
    """One row per evaluation, with the emulated clock at that step."""
    ledgers = [Ledger.from_rows(r.rank, cfg.workers, r.ledger_rows) for r in results]
    per_step = [a + b for a, b in zip(*emulated_clock(cfg, results, ledgers))]
    return [{**ev, "emulated_seconds": math.fsum(per_step[: ev["step"]])} for ev in results[0].evals]
