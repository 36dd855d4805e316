"""The per-worker training loop (SPMD): the same function runs on every
worker of either runtime, against a :class:`~lowbit.comm.Transport`."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..algorithms import ALGORITHMS, Algorithm
from ..codecs.rng import derive_seed
from ..comm.base import Transport
from ..comm.inprocess import blocking
from ..integrations import FlatParams
from ..topology import make_topology
from .config import TrainConfig, resolve_device
from .tasks import TASKS

_INIT_LOCK = threading.Lock()


def build_algorithm(cfg: TrainConfig, transport: Transport) -> Algorithm:
    cls = ALGORITHMS[cfg.algorithm]
    topo = make_topology(cfg.topology, cfg.workers) if cls.family == "decentralized" else None
    return cls.from_config(cfg, transport, topo)


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


def run_worker(transport: Transport, cfg: TrainConfig, progress: bool = False, *, evaluate: bool = True,
               instrument: Callable[[Algorithm], None] | None = None) -> WorkerResult:
    """One worker's training run. ``evaluate=False`` skips every evaluation (its
    collectives too: ``evals`` stays empty), for runs that only measure what is
    sent; ``instrument`` is called with the algorithm once it is set up (e.g. to
    observe its payloads)."""
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
    for k in range(cfg.steps):
        # An asynchronous algorithm has no global barrier: evaluate (a collective) only at the ends.
        if evaluate and k % cfg.eval_every == 0 and (algo.synchronous or k == 0):
            evals.append(_evaluate(k, task, model, flat, transport, eval_model, eval_flat))
        transport.set_step(k)
        t0 = now()
        lr = cfg.lr_at(k)
        for group in opt.param_groups:
            group["lr"] = lr
        flat.zero_grad()
        loss = task.loss(model, task.sample(shard, cfg.batch_size, data_gen))
        loss.backward()
        # --slow: this worker's gradient takes `slow` times longer (sleeping, so the cores stay free)
        extra = (slow - 1.0) * (now() - t0)
        if extra > 0:
            with blocking():  # a thread worker lets another compute meanwhile
                time.sleep(extra)
        algo.before_update(k, flat.data, flat.grad, lr)
        opt.step()
        algo.after_update(k, flat.data, flat.grad, lr)
        compute.append(now() - t0 + extra)
        if bar is not None:
            bar.update(1)
    algo.finish()
    transport.set_step(cfg.steps)
    if evaluate:
        evals.append(_evaluate(cfg.steps, task, model, flat, transport, eval_model, eval_flat))
    if bar is not None:
        bar.close()
    flat.check_aliasing()
    return WorkerResult(rank=rank, params=flat.data.detach().cpu().clone(), ledger_rows=transport.ledger.to_rows(),
                        compute_seconds=compute, extra_memory_bytes=algo.extra_memory_bytes(),
                        nominal_bits_per_element=float(algo.nominal_bits_per_element()), report=algo.report(),
                        evals=evals)
