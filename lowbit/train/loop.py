"""The per-worker training loop of ``lowbit train`` (SPMD): the same function runs on every
worker of either runtime, against a :class:`~lowbit.comm.Transport`.

The loop owns the task, the data, the timing, the evaluations and the results; the algorithm
runs under :class:`~lowbit.integrations.DecentralizedDataParallel` (``overlap=False``), whose
optimizer step hooks are the one place an algorithm's step is called, and whose checkpoint
(:mod:`lowbit.integrations.wrapper_checkpoint`) is the one format, with the run's own fields
(:data:`_TRAIN_FIELDS`) beside it in the same file."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..algorithms import ALGORITHMS
from ..algorithms.base import Worker, make_worker
from ..algorithms.faults import PeerPayloadError
from ..codecs.rng import derive_seed
from ..comm.base import Transport
from ..comm.inprocess import blocking
from ..integrations import DecentralizedDataParallel, FlatParams, TensorBoardStats
from ..integrations.checkpoint import (REFUSED, Candidate, CheckpointError, agree_outcome, agree_resume, candidates,
                                       check_fields, save_checkpoint)
from ..integrations.wrapper_checkpoint import checkpoint_fields
from ..topology import make_topology
from .config import TrainConfig, resolve_device
from .errors import Diverged, strict_json, unwritable
from .tasks import TASKS

# what lowbit train saves beside the wrapper's checkpoint (integrations/wrapper_checkpoint.py), in the same file
_TRAIN_FIELDS = {"config": dict, "data_gen": torch.Tensor, "compute": torch.Tensor, "evals": list}
# options that may differ between a checkpointed run and the run resuming it
RESUME_MAY_DIFFER = ("steps", "timeout", "stall_timeout", "collective_timeout", "tensorboard", "checkpoint_every",
                     "checkpoint_dir", "resume", "resume_fallback", "device")

_INIT_LOCK = threading.Lock()


def build_algorithm(cfg: TrainConfig, transport: Transport) -> Worker:
    """This worker's algorithm for the run config ``cfg``, bound to ``transport``."""
    cls = ALGORITHMS[cfg.algorithm]
    topo = make_topology(cfg.topology, cfg.workers) if cls.family == "decentralized" else None
    return make_worker(cls.from_config(cfg), transport, topo, weights=cfg.weights, seed=cfg.seed)


@dataclass
class WorkerResult:
    """What one worker hands back (picklable, for the process runtime)."""

    rank: int
    params: torch.Tensor
    ledger_rows: list
    compute_seconds: list[float]
    extra_memory_bytes: int
    nominal_bits_per_element: float
    report: dict
    evals: list[dict] = field(default_factory=list)
    # a resumed run: the step every rank resumed from, whether some rank fell back from its newest
    # checkpoint, and which files were refused and why (the same on every rank); {} otherwise
    resume: dict = field(default_factory=dict)


def _evaluate(k, task, model, flat, transport, eval_model, eval_flat) -> dict:
    """Collective (all ranks call it), not counted in the ledger."""
    n = transport.world_size
    with transport.untracked():
        x = flat.data
        x_bar = transport.all_reduce(x.detach().clone(), "sum") / n
        local = task.evaluate(model)
        local_acc = local["test_accuracy"] if local["test_accuracy"] is not None else float("nan")
        gns = task.full_grad_norm_sq(model)
        cons = float((x - x_bar).pow(2).sum())
        stats = transport.all_reduce(torch.tensor([local_acc, gns, cons, float(transport.ledger.bytes_sent)],
                                                  dtype=torch.float64), "sum")
    out = {"step": k}
    if transport.rank == 0:
        eval_flat.data.copy_(x_bar)
        avg = task.evaluate(eval_model)
        out.update(train_loss=avg["train_loss"], test_accuracy=avg["test_accuracy"])
    out.update(local_test_accuracy=None if local["test_accuracy"] is None else float(stats[0]) / n,
               grad_norm_sq=float(stats[1]) / n, consensus_distance=float(stats[2]) / n,
               bytes_sent=int(stats[3]))
    return out


def _compute_clock(device: torch.device) -> Callable[[], float]:
    """The clock of a worker's compute seconds: its thread's CPU time on the CPU (other
    workers' threads do not count); on a GPU, whose kernels run asynchronously, the wall
    clock read after the device has finished its queued work."""
    if device.type != "cuda":
        return time.thread_time

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def worker_device(cfg: TrainConfig, transport: Transport) -> torch.device:
    """Where this worker computes (:func:`~lowbit.train.config.resolve_device` of ``cfg.device``). A worker
    that is a process of its own uses its index on the host (:attr:`~lowbit.comm.Transport.local_rank`:
    ``LOCAL_RANK`` under torchrun, else its rank); the thread runtime's workers share the process's
    current device."""
    return resolve_device(cfg.device, transport.local_rank)


def _save_checkpoint(state: dict, path: str) -> None:
    """save_checkpoint, with a write that fails (a full filesystem) naming the file and --checkpoint-dir."""
    try:
        save_checkpoint(state, path)
    except OSError as e:
        raise unwritable("--checkpoint-dir", path, e) from None


def checkpoint_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` writes its checkpoint in ``folder``."""
    return os.path.join(folder, f"rank{rank}.pt")


def _comparable(cfg_dict: dict) -> dict:
    return {k: v for k, v in cfg_dict.items() if k not in RESUME_MAY_DIFFER}


def _gather(transport: Transport):
    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        with transport.untracked():
            return transport.all_gather(t)
    return gather


def _train_file_fields(state: dict, path: str) -> None:
    """A :class:`CheckpointError` naming ``path`` unless ``state`` is a checkpoint of ``lowbit train`` in the
    current format: the wrapper's checkpoint with :data:`_TRAIN_FIELDS` beside it."""
    if state.get("format") == 1 and "params" in state and "module" not in state:
        raise CheckpointError(f"checkpoint {path} is of lowbit train's checkpoint format 1 (lowbit before the "
                              "training loop ran on DecentralizedDataParallel), which this version does not read: "
                              "finish that run with the lowbit that wrote it, or start it afresh (without "
                              "--resume, or with another --checkpoint-dir)")
    check_fields(state, checkpoint_fields(_TRAIN_FIELDS), path)


def _candidates(path: str) -> list[Candidate]:
    """:func:`~lowbit.integrations.checkpoint.candidates` of ``path``, a file that is not a
    checkpoint of ``lowbit train`` in the current format refused with the reason."""
    out = []
    for c in candidates(path):
        if c.state is not None:
            try:
                _train_file_fields(c.state, c.path)
            except CheckpointError as e:
                c = Candidate(c.path, REFUSED, None, str(e))
        out.append(c)
    return out


def _check_resumable(cfg: TrainConfig, folder: str, state: dict, n: int, d: int) -> None:
    if state["world_size"] != n:
        raise CheckpointError(f"cannot resume from {folder}: its checkpoints are of {state['world_size']} "
                              f"workers, this run has {n}")
    theirs, mine = _comparable(state["config"]), _comparable(cfg.to_dict())
    differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    if differ:
        raise CheckpointError(f"cannot resume from {folder}: the run differs from the checkpointed one in "
                              + ", ".join(f"{k} ({theirs.get(k)!r} there, {mine.get(k)!r} here)" for k in differ))
    if state["numel"] != d:
        raise CheckpointError(f"cannot resume from {folder}: {state['numel']} parameters, the model has {d}")
    if state["step"] > cfg.steps:
        raise CheckpointError(f"cannot resume from {folder}: it is at step {state['step']}, beyond steps={cfg.steps}")


class _MetricsStream:
    """Rank 0 appends each evaluation row to ``path`` as the run goes (flushed), so that a run
    that stops early keeps its metrics; the finished run's rows are written over it by train().
    With ``tensorboard`` (a directory), rank 0 also writes each row there live, as
    ``metrics/<column>`` scalars, through the wrapper's :class:`TensorBoardStats`."""

    def __init__(self, path: str | None, rank: int, tensorboard: str | None = None):
        self.path = path
        self.f = open(path, "a") if path is not None and rank == 0 else None
        self.tb = TensorBoardStats(tensorboard, prefix="metrics") if tensorboard is not None and rank == 0 else None

    def write(self, row: dict) -> None:
        if self.f is not None:
            clean, replaced = strict_json(row)
            if replaced:
                clean["non_finite"] = replaced
            try:
                self.f.write(json.dumps(clean, allow_nan=False) + "\n")
                self.f.flush()
            except OSError as e:  # e.g. a full filesystem: name the file and the option
                raise unwritable("--out", self.path, e) from None
        if self.tb is not None:
            self.tb(row["step"], row)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        if self.tb is not None:
            self.tb.close()


def run_worker(transport: Transport, cfg: TrainConfig, progress: bool = False, *, evaluate: bool = True,
               instrument: Callable[[Worker], None] | None = None, stream: str | None = None) -> WorkerResult:
    """One worker's training run. ``evaluate=False`` skips every evaluation (its
    collectives too: ``evals`` stays empty), for runs that only measure what is
    sent; ``instrument`` is called with the algorithm once it is set up (e.g. to
    observe its payloads); ``stream``: rank 0 appends each evaluation row to this
    file as it goes.

    A non-finite training loss, or an algorithm failing on a non-finite model or
    gradient, raises :class:`~lowbit.train.errors.Diverged` naming the step.
    ``cfg.checkpoint_every`` K > 0 saves this rank's state into
    ``cfg.checkpoint_dir`` every K steps (atomically, checksummed);
    ``cfg.resume`` (a folder) continues from the newest step every rank has there,
    bit-identically for a synchronous algorithm."""
    return _run_worker(transport, cfg, progress, evaluate, instrument, stream)


@dataclass
class _Run:
    """One worker's training as :func:`_set_up` builds it: the task, the model under
    :class:`~lowbit.integrations.DecentralizedDataParallel` (which runs the algorithm at every
    ``optimizer.step()``), this worker's data, and what the run has recorded so far."""

    cfg: TrainConfig
    transport: Transport
    task: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ddp: DecentralizedDataParallel
    eval_model: torch.nn.Module
    eval_flat: FlatParams
    shard: object
    data_gen: torch.Generator
    now: Callable[[], float]
    compute: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    start: int = 0  # the first step to run (a resumed run: the checkpoint's)
    resumed: dict = field(default_factory=dict)


def _set_up(transport: Transport, cfg: TrainConfig, instrument) -> _Run:
    """The task, the model (every worker the same x_0), the optimizer and the wrapper running the
    algorithm on them, without overlap (the loop times compute and communication apart) and without
    the initial broadcast (every worker draws the same x_0)."""
    rank, n = transport.rank, transport.world_size
    if n != cfg.workers:
        raise ValueError(f"the runtime has {n} workers but workers={cfg.workers}")
    device = worker_device(cfg, transport)
    task = TASKS[cfg.task].from_config(cfg).to(device)
    with _INIT_LOCK:  # thread workers share torch's global RNG
        torch.manual_seed(cfg.seed)  # A4: every worker starts from the same x_0 (drawn on the CPU)
        model = task.make_model().to(device)
        eval_model = task.make_model().to(device)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.k is not None and cfg.k >= 1 and cfg.k > d and "k" in ALGORITHMS[cfg.algorithm].options:
        raise ValueError(f"k={cfg.k:g} coordinates kept is more than the model's d={d} parameters; "
                         f"use k in [1, {d}] or a fraction in (0, 1)")
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    ddp = DecentralizedDataParallel(model, opt, build_algorithm(cfg, transport), overlap=False, sync_initial=False)
    if instrument is not None:
        instrument(ddp.algorithm)
    data_gen = torch.Generator().manual_seed(derive_seed(cfg.seed, 0, rank, stream=1))
    return _Run(cfg, transport, task, model, opt, ddp, eval_model, FlatParams(eval_model),
                task.shard(rank, n, cfg.seed), data_gen, _compute_clock(device))


def _resume(run: _Run) -> None:
    """Continue from the newest step of which every rank has a good checkpoint in ``cfg.resume``
    (current or previous file; a refused newest file is a warning naming it, or an error with
    ``resume_fallback="error"``); collective: a failure to load on any rank is the same
    :class:`CheckpointError` on every rank."""
    cfg, transport = run.cfg, run.transport
    found = _candidates(checkpoint_path(cfg.resume, transport.rank))
    chosen, run.resumed = agree_resume(found, _gather(transport), cfg.resume, transport.rank, cfg.resume_fallback)
    if chosen is None:
        if not cfg.checkpoint_every:  # a restart with nothing saved yet starts afresh; a --resume needs one
            raise CheckpointError(f"resume={cfg.resume!r}: no checkpoint (rank*.pt) there")
        return
    state = chosen.state
    error = None
    try:
        _check_resumable(cfg, cfg.resume, state, transport.world_size, len(run.ddp.flat))
        run.ddp.load_checkpoint_state(state)
        run.data_gen.set_state(state["data_gen"])
        run.compute, run.evals = [float(c) for c in state["compute"].tolist()], list(state["evals"])
        run.start = int(state["step"])
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - any failure to restore ends every rank, with this message
        error = f"cannot resume from {chosen.path}: {type(e).__name__}: {e}"
    agree_outcome(_gather(transport), int(state["step"]), error)


def _save(run: _Run, step: int) -> None:
    """This rank's checkpoint at ``step`` (between steps): the wrapper's, with the run's own fields
    (:data:`_TRAIN_FIELDS`)."""
    state = {**run.ddp.checkpoint_state(), "config": strict_json(run.cfg.to_dict())[0],
             "data_gen": run.data_gen.get_state(), "compute": torch.tensor(run.compute, dtype=torch.float64),
             "evals": run.evals}
    _save_checkpoint(state, checkpoint_path(run.cfg.checkpoint_dir, run.transport.rank))


def _evaluate_into(run: _Run, k: int, metrics: _MetricsStream) -> None:
    run.evals.append(_evaluate(k, run.task, run.model, run.ddp.flat, run.transport, run.eval_model, run.eval_flat))
    metrics.write(run.evals[-1])


def _step(run: _Run, k: int, slow: float) -> None:
    """Step ``k``: the learning rate, the gradient of a sampled batch, the ``--slow`` delay, then
    ``optimizer.step()``, whose hooks run the algorithm (the agreement, before_update, the
    optimizer's update, after_update)."""
    cfg, flat, now = run.cfg, run.ddp.flat, run.now
    run.transport.set_step(k)  # the heartbeat of step k, before its compute
    t0 = now()
    lr = cfg.lr_at(k)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.ddp.zero_grad()
    loss = run.task.loss(run.model, run.task.sample(run.shard, cfg.batch_size, run.data_gen))
    run.ddp.algorithm.guard.note(k, "training loss", loss.detach())
    loss.backward()
    # --slow: this worker's gradient takes `slow` times longer (sleeping, so the cores stay free)
    extra = (slow - 1.0) * (now() - t0)
    if extra > 0:
        with blocking():  # a thread worker lets another compute meanwhile
            time.sleep(extra)
    # A fault on any rank (non-finite loss, gradient or model; a rank at another step) ends
    # every rank in the step's agreement, with the same Diverged, before anything derived from it is sent.
    try:
        run.optimizer.step()
    except PeerPayloadError:
        raise
    except (ValueError, RuntimeError) as e:  # e.g. a codec refusing a non-finite model
        for what, t in (("gradient", flat.grad), ("model", flat.data)):
            if not torch.isfinite(t).all():
                raise Diverged(k, what, run.transport.rank) from e
        raise
    run.compute.append(now() - t0 + extra)


def _train(run: _Run, evaluate: bool, metrics: _MetricsStream, bar) -> None:
    """Steps ``run.start`` to ``cfg.steps``, the evaluations and checkpoints between them, then the
    wrapper's close (the algorithm's finish and the last agreement) and the final evaluation."""
    cfg, sync = run.cfg, run.ddp.algorithm.synchronous
    slow = cfg.slow_factors().get(run.transport.rank, 1.0)
    for row in run.evals:
        metrics.write(row)
    for k in range(run.start, cfg.steps):
        # An asynchronous algorithm has no global barrier: evaluate (a collective) only at the ends.
        if evaluate and k % cfg.eval_every == 0 and (sync or k == 0):
            _evaluate_into(run, k, metrics)
        _step(run, k, slow)
        if bar is not None:
            bar.update(1)
        if cfg.checkpoint_every and (k + 1) % cfg.checkpoint_every == 0 and k + 1 < cfg.steps:
            _save(run, k + 1)
    run.ddp.close()
    if evaluate:
        _evaluate_into(run, cfg.steps, metrics)


def _result(run: _Run) -> WorkerResult:
    flat, algo, rank = run.ddp.flat, run.ddp.algorithm, run.transport.rank
    if not torch.isfinite(flat.data).all():
        raise Diverged(run.cfg.steps, "model", rank)
    flat.check_aliasing()
    return WorkerResult(rank=rank, params=flat.data.detach().cpu().clone(), ledger_rows=run.transport.ledger.to_rows(),
                        compute_seconds=run.compute, extra_memory_bytes=algo.extra_memory_bytes(),
                        nominal_bits_per_element=float(algo.nominal_bits_per_element()), report=algo.report(),
                        evals=run.evals, resume=run.resumed)


def _run_worker(transport, cfg, progress, evaluate, instrument, stream) -> WorkerResult:
    run = _set_up(transport, cfg, instrument)
    if cfg.resume is not None:
        _resume(run)
    bar = None
    if progress and transport.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=run.start, desc=f"{cfg.algorithm} x{cfg.workers}", unit="step",
                   leave=False, mininterval=0.5)
    metrics = _MetricsStream(stream, transport.rank, cfg.tensorboard)
    try:
        _train(run, evaluate, metrics, bar)
    finally:
        metrics.close()
        if bar is not None:
            bar.close()
    return _result(run)
