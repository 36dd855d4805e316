"""The per-worker training loop (SPMD): the same function runs on every
worker of either runtime, against a :class:`~lowbit.comm.Transport`."""

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
from ..integrations import FlatParams, TensorBoardStats
from ..topology import make_topology
from ..integrations.checkpoint import (ALGORITHM_STATE_FIELDS, LEDGER_FIELDS, OPTIMIZER_FIELDS, CheckpointError,
                                       agree_outcome, agree_resume, candidates, ledger_state, restore_ledger,
                                       save_checkpoint)
from .config import TrainConfig, resolve_device
from .errors import Diverged, strict_json, unwritable
from .tasks import TASKS

_CKPT_FORMAT = 1
# what a checkpoint of format 1 must hold (besides "step"), checked before any rank resumes from it
_CKPT_FIELDS = {"format": int, "rank": int, "world_size": int, "config": dict, "params": torch.Tensor,
                "optimizer": OPTIMIZER_FIELDS, "algorithm_state": ALGORITHM_STATE_FIELDS, "data_gen": torch.Tensor,
                "ledger": LEDGER_FIELDS, "compute": torch.Tensor, "evals": list}
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
    """Where this worker computes (:func:`~lowbit.train.config.resolve_device` of ``cfg.device``). A worker process
    of a torch.distributed run uses its local rank (``LOCAL_RANK`` under torchrun, else
    its rank); the thread runtime's workers share the process's current device."""
    from ..comm.distributed import TorchDistributedTransport

    if not isinstance(transport, TorchDistributedTransport):
        return resolve_device(cfg.device, None)
    return resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", transport.rank)))


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


def _resume(cfg: TrainConfig, folder: str, transport: Transport) -> tuple[dict | None, dict]:
    """This rank's state of the newest step that every rank has a good checkpoint of in
    ``folder`` (current or previous file; a refused newest file is a warning naming it, or an
    error with ``resume_fallback="error"``), and what the ranks agreed; collective."""
    found = candidates(checkpoint_path(folder, transport.rank), _CKPT_FIELDS)
    chosen, info = agree_resume(found, _gather(transport), folder, transport.rank, cfg.resume_fallback)
    return (None if chosen is None else {**chosen.state, "path": chosen.path}), info


def _check_resumable(cfg: TrainConfig, folder: str, state: dict, n: int, d: int) -> None:
    if state["format"] != _CKPT_FORMAT or state["world_size"] != n:
        raise CheckpointError(f"cannot resume from {folder}: its checkpoints are of {state['world_size']} "
                              f"workers, this run has {n}")
    theirs, mine = _comparable(state["config"]), _comparable(cfg.to_dict())
    differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    if differ:
        raise CheckpointError(f"cannot resume from {folder}: the run differs from the checkpointed one in "
                              + ", ".join(f"{k} ({theirs.get(k)!r} there, {mine.get(k)!r} here)" for k in differ))
    if state["params"].numel() != d:
        raise CheckpointError(f"cannot resume from {folder}: {state['params'].numel()} parameters, the model has {d}")
    if state["step"] > cfg.steps:
        raise CheckpointError(f"cannot resume from {folder}: it is at step {state['step']}, beyond steps={cfg.steps}")


def _restore(cfg: TrainConfig, state: dict, transport: Transport, d: int, flat, opt, algo,
             data_gen) -> tuple[list[float], list[dict], int]:
    """Check ``state`` against this run and load it (compute seconds, evaluations and step out);
    collective: a failure on any rank is the same :class:`CheckpointError` on every rank."""
    error = None
    try:
        _check_resumable(cfg, cfg.resume, state, transport.world_size, d)
        with torch.no_grad():
            flat.data.copy_(state["params"].to(flat.data.device))
        opt.load_state_dict(state["optimizer"])
        algo.load_state_dict(state["algorithm_state"])
        data_gen.set_state(state["data_gen"])
        restore_ledger(transport.ledger, state["ledger"])
        restored = [float(c) for c in state["compute"].tolist()], list(state["evals"]), int(state["step"])
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - any failure to restore ends every rank, with this message
        error = f"cannot resume from {state['path']}: {type(e).__name__}: {e}"
    agree_outcome(_gather(transport), int(state["step"]), error)
    return restored
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


def _run_worker(transport, cfg, progress, evaluate, instrument, stream) -> WorkerResult:
    rank, n = transport.rank, transport.world_size
    if n != cfg.workers:
        raise ValueError(f"the runtime has {n} workers but workers={cfg.workers}")
    device = worker_device(cfg, transport)
    task = TASKS[cfg.task].from_config(cfg).to(device)
    with _INIT_LOCK:  # thread workers share torch's global RNG
        torch.manual_seed(cfg.seed)  # A4: every worker starts from the same x_0 (drawn on the CPU)
        model = task.make_model().to(device)
        eval_model = task.make_model().to(device)
    flat, eval_flat = FlatParams(model), FlatParams(eval_model)
    d = flat.data.numel()
    from ..comm.distributed import TorchDistributedTransport, max_payload_nbytes

    if isinstance(transport, TorchDistributedTransport):  # a peer's stated sizes are bounded by the model's
        transport.max_message_bytes = max_payload_nbytes(d)
    if cfg.k is not None and cfg.k >= 1 and cfg.k > d and "k" in ALGORITHMS[cfg.algorithm].options:
        raise ValueError(f"k={cfg.k:g} coordinates kept is more than the model's d={d} parameters; "
                         f"use k in [1, {d}] or a fraction in (0, 1)")
    algo = build_algorithm(cfg, transport)
    algo.setup(flat.data)
    if instrument is not None:
        instrument(algo)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    shard = task.shard(rank, n, cfg.seed)
    data_gen = torch.Generator().manual_seed(derive_seed(cfg.seed, 0, rank, stream=1))

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{cfg.algorithm} x{n}", unit="step", leave=False, mininterval=0.5)
    slow = cfg.slow_factors().get(rank, 1.0)
    now = _compute_clock(device)
    compute: list[float] = []
    evals: list[dict] = []
    start = 0
    resumed: dict = {}
    if cfg.resume is not None:
        state, resumed = _resume(cfg, cfg.resume, transport)
        if state is None:
            if not cfg.checkpoint_every:  # a restart with nothing saved yet starts afresh; a --resume needs one
                raise CheckpointError(f"resume={cfg.resume!r}: no checkpoint (rank*.pt) there")
        else:
            compute, evals, start = _restore(cfg, state, transport, d, flat, opt, algo, data_gen)
    metrics = _MetricsStream(stream, rank, cfg.tensorboard)
    guard = algo.guard

    at_start = algo.agrees_before_update  # else the step's one agreement is before after_update

    def agree(k: int, point: int) -> None:
        # an asynchronous algorithm has no collective per step: its gossip carries faults
        guard.agree(k, point, flat.data.device) if algo.synchronous else guard.check_local()
    if bar is not None and start:
        bar.update(start)
    try:
        for row in evals:
            metrics.write(row)
        for k in range(start, cfg.steps):
            # An asynchronous algorithm has no global barrier: evaluate (a collective) only at the ends.
            if evaluate and k % cfg.eval_every == 0 and (algo.synchronous or k == 0):
                evals.append(_evaluate(k, task, model, flat, transport, eval_model, eval_flat))
                metrics.write(evals[-1])
            transport.set_step(k)
            t0 = now()
            lr = cfg.lr_at(k)
            for group in opt.param_groups:
                group["lr"] = lr
            flat.zero_grad()
            loss = task.loss(model, task.sample(shard, cfg.batch_size, data_gen))
            guard.note(k, "training loss", loss.detach())
            loss.backward()
            # --slow: this worker's gradient takes `slow` times longer (sleeping, so the cores stay free)
            extra = (slow - 1.0) * (now() - t0)
            if extra > 0:
                with blocking():  # a thread worker lets another compute meanwhile
                    time.sleep(extra)
            # A fault on any rank (non-finite loss, gradient or model; a rank at another step) ends
            # every rank here, with the same Diverged, before anything derived from it is sent.
            guard.note(k, "gradient", flat.grad)
            guard.note(k, "model", flat.data)
            if at_start:
                agree(k, 0)
            try:
                algo.before_update(k, flat.data, flat.grad, lr)
                opt.step()
                if algo.acts_after_update:
                    guard.note(k, "model", flat.data)
                    agree(k, 1)
                algo.after_update(k, flat.data, flat.grad, lr)
            except PeerPayloadError:
                raise
            except (ValueError, RuntimeError) as e:  # e.g. a codec refusing a non-finite model
                for what, t in (("gradient", flat.grad), ("model", flat.data)):
                    if not torch.isfinite(t).all():
                        raise Diverged(k, what, rank) from e
                raise
            compute.append(now() - t0 + extra)
            if bar is not None:
                bar.update(1)
            if cfg.checkpoint_every and (k + 1) % cfg.checkpoint_every == 0 and k + 1 < cfg.steps:
                _save_checkpoint({
                    "format": _CKPT_FORMAT, "rank": rank, "world_size": n, "step": k + 1,
                    "config": strict_json(cfg.to_dict())[0], "params": flat.data.detach().cpu().clone(),
                    "optimizer": opt.state_dict(), "algorithm_state": algo.state_dict(),
                    "data_gen": data_gen.get_state(), "ledger": ledger_state(transport.ledger),
                    "compute": torch.tensor(compute, dtype=torch.float64), "evals": evals,
                }, checkpoint_path(cfg.checkpoint_dir, rank))
        algo.finish()
        transport.set_step(cfg.steps)
        guard.note(cfg.steps, "model", flat.data)
        agree(cfg.steps, 2)
        if evaluate:
            evals.append(_evaluate(cfg.steps, task, model, flat, transport, eval_model, eval_flat))
            metrics.write(evals[-1])
    finally:
        metrics.close()
    if bar is not None:
        bar.close()
    if not torch.isfinite(flat.data).all():
        raise Diverged(cfg.steps, "model", rank)
    flat.check_aliasing()
    return WorkerResult(rank=rank, params=flat.data.detach().cpu().clone(), ledger_rows=transport.ledger.to_rows(),
                        compute_seconds=compute, extra_memory_bytes=algo.extra_memory_bytes(),
                        nominal_bits_per_element=float(algo.nominal_bits_per_element()), report=algo.report(),
                        evals=evals, resume=resumed)
