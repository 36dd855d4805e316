"""Run a training job on a runtime, combine the workers' results, write them."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..algorithms import ALGORITHMS
from ..comm.inprocess import pinned_threads, run_threads
from ..comm.ledger import Ledger
from .config import TrainConfig, resolve_device
from .errors import OutputExists, classify, strict_json
from .loop import WorkerResult, run_worker


def _thread_job(cfg: TrainConfig, progress: bool, stream: str | None = None):
    with pinned_threads(1):  # n workers share the cores; thread CPU time stays per worker
        return run_threads(cfg.workers, functools.partial(run_worker, cfg=cfg, progress=progress, stream=stream),
                           device=resolve_device(cfg.device))


def _torch_worker(transport, cfg: TrainConfig, progress: bool, stream: str | None = None) -> WorkerResult:
    return run_worker(transport, cfg, progress, stream=stream)


def _torch_job(cfg: TrainConfig, progress: bool, stream: str | None = None):
    from ..comm.launcher import is_torchrun, launch

    bandwidth, latency = cfg.shaping()
    if not is_torchrun():
        limits = dict(latency_s=latency, timeout_s=cfg.timeout, stall_timeout_s=cfg.stall_timeout)
        if bandwidth is None:
            return launch(cfg.workers, _torch_worker, cfg, progress, stream, **limits)
        from ..comm.shaping import ShapedNetwork

        with ShapedNetwork(cfg.workers, bandwidth) as net:  # deleted afterwards, also on failure
            return launch(cfg.workers, _torch_worker, cfg, progress, stream, network=net, **limits)
    if bandwidth is not None:
        raise ValueError("shape_bandwidth: under torchrun the workers run on hosts lowbit does not manage; "
                         "shape their links yourself (tc), or launch without torchrun")
    # Under torchrun this process is one worker: run it, collect on rank 0.
    import torch.distributed as dist

    from ..comm.distributed import init_from_env

    transport = init_from_env(latency_s=latency)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    res = run_worker(transport, cfg, progress, stream=stream)
    gathered = [None] * transport.world_size if transport.rank == 0 else None
    dist.gather_object(res, gathered, dst=0)
    dist.barrier()  # no rank tears its process group down while another still reads from it
    transport.close()
    return gathered


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


def write_tensorboard(logdir: str | os.PathLike, run: Run) -> None:
    """What a run knows only at its end, beside the ``metrics/<column>`` scalars the loop's
    rank 0 wrote live (:class:`~lowbit.integrations.TensorBoardStats`): each evaluated
    step's ``metrics/emulated_seconds``, the summary's numbers as ``final/<key>`` and the
    config as text."""
    from ..integrations import TensorBoardStats

    tb = TensorBoardStats(logdir, prefix="metrics")
    try:
        for row in run.metrics:
            tb(row["step"], {"emulated_seconds": row["emulated_seconds"]})
        tb.prefix = "final"
        tb(run.summary["steps"], run.summary)
        tb.writer.add_text("config", "```\n" + json.dumps(run.summary["config"], indent=2) + "\n```")
    finally:
        tb.close()


@dataclass
class Run:
    summary: dict
    metrics: list[dict]
    workers: list[WorkerResult]


RUN_FILES = ("metrics.jsonl", "summary.json")


def prepare_out(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check ``--out`` before any training: a folder (made if missing) that this process can
    write, holding no previous run unless ``overwrite``. Raises OSError subclasses naming
    ``--out`` (:class:`~lowbit.train.errors.OutputExists` for a previous run)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder; choose a folder name")
    previous = [f for f in RUN_FILES if (out / f).exists()]
    if previous and not overwrite:
        raise OutputExists(f"--out {out} holds a previous run ({', '.join(previous)}); pass --overwrite to "
                           f"replace it, or choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".lowbit-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"--out {out} cannot be written ({e.strerror or e}); choose another --out") from None
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it and rename it onto ``path``:
    a reader sees the old file or the new one, never a truncated one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def to_json(value, indent: int | None = None) -> str:
    """Strict JSON (no NaN/Infinity): a non-finite number is null and the keys replaced are
    listed under ``non_finite`` (when ``value`` is a dict)."""
    clean, replaced = strict_json(value)
    if replaced and isinstance(clean, dict):
        clean["non_finite"] = replaced
    return json.dumps(clean, indent=indent, allow_nan=False)


def _failure_summary(cfg: TrainConfig, e: BaseException) -> dict:
    """What summary.json says about a run that ended early (its metrics so far are in metrics.jsonl)."""
    from ..comm.launcher import WorkerFailed
    from .errors import Diverged

    kind, message = classify(e)
    cause = e.cause if isinstance(e, WorkerFailed) and e.cause is not None else e
    out = {"status": "diverged" if isinstance(cause, Diverged) else "failed", "error_kind": kind,
           "error": message or f"{type(e).__name__}", "config": cfg.to_dict()}
    if isinstance(cause, Diverged):
        out["diverged_at_step"] = cause.step
    return out


def train(cfg: TrainConfig, out: str | os.PathLike | None = None, progress: bool = False,
          overwrite: bool = False) -> Run | None:
    """Run ``cfg`` and return its :class:`Run` (None on non-zero torchrun
    ranks); write ``metrics.jsonl`` and ``summary.json`` into ``out`` if given.

    ``out`` is checked before training (:func:`prepare_out`; a previous run there needs
    ``overwrite``, or ``cfg.resume``). Rank 0 appends each evaluation to
    ``metrics.jsonl`` as the run goes; the finished run's rows (with the emulated clock)
    and ``summary.json`` are then written atomically. A run that ends early (divergence,
    a dead or stalled worker, ...) keeps its metrics so far, writes a summary saying why
    (``status``), and re-raises."""
    from ..comm.launcher import is_torchrun

    if cfg.backend == "thread" and is_torchrun():
        raise ValueError("backend='thread' simulates all workers in one process; under torchrun use --backend torch")
    lead = not is_torchrun() or os.environ.get("RANK", "0") == "0"
    stream = None
    if out is not None:
        out = Path(out)
        if lead:
            prepare_out(out, overwrite=overwrite or cfg.resume is not None)
            (out / "metrics.jsonl").write_text("")  # rank 0's worker appends from here on
        stream = str(out / "metrics.jsonl")
    if cfg.checkpoint_every and cfg.checkpoint_dir is None:
        if out is None:
            raise ValueError("checkpoint_every needs --checkpoint-dir DIR (or --out, whose checkpoints/ it uses)")
        cfg = dataclasses.replace(cfg, checkpoint_dir=str(out / "checkpoints"))
    t0 = time.perf_counter()
    try:
        results = _thread_job(cfg, progress, stream) if cfg.backend == "thread" else _torch_job(cfg, progress, stream)
    except BaseException as e:
        if out is not None and lead:
            write_atomic(out / "summary.json", to_json(_failure_summary(cfg, e), indent=2) + "\n")
        raise
    wall = time.perf_counter() - t0
    if results is None:
        return None
    run = Run(summarize(cfg, results, wall), metrics_rows(cfg, results), results)
    if out is not None:
        write_atomic(out / "metrics.jsonl", "".join(to_json(row) + "\n" for row in run.metrics))
        write_atomic(out / "summary.json", to_json({"status": "finished", **run.summary}, indent=2) + "\n")
    if cfg.tensorboard is not None:
        write_tensorboard(cfg.tensorboard, run)
    return run
