"""``lowbit plan``: will compression pay for my model on my cluster?

What it measures, on the current device, for one model and one batch:

1. **Forward, backward and optimizer time** of one worker: the model wrapped in torch's own
   ``DistributedDataParallel`` in a one-process group (gloo on the CPU, NCCL on CUDA), default
   buckets (25 MB, the first 1 MB, in reverse parameter order, rebuilt by DDP after its first
   iteration), SGD with momentum; medians over ``repeats`` steps after ``warmup`` steps.
2. **When each DDP bucket becomes ready** during backward: DDP calls a communication hook
   when a bucket's gradients are all computed, so a recording hook (which returns the bucket
   as it is: a one-process average) reads the time of each call from the start of backward
   (CUDA: events on the current stream), and the bucket's parameters.
3. **Each method's own compute** (:data:`METHODS`, the names of ``lowbit bench race``):
   - DDP methods: the method's hook (torch's or lowbit's, as the race configures it) run
     to its result on the one-process group, on each bucket holding the real gradients and
     the bucket's real parameters (PowerSGD factorises each of them), the bucket's refill
     subtracted, medians over rounds that interleave the methods (:func:`_time_hooks`).
   - What a DDP method sends for ``n`` workers: torch's hooks as torch's code issues their
     collectives (:func:`torch_powersgd_ops`); lowbit's hooks run once more on a
     :class:`MirrorTransport` of ``n`` ranks, so that their codes take the integer width
     ``n`` workers need (packed sums included) and their collectives are recorded op by op
     (a mirror's collectives return what ``n`` equal ranks would: the sum is ``n`` times the
     tensor). Whether an op is issued synchronously (inside the hook, blocking backward: the
     scale rounds of the max-norm codecs, PowerSGD's ``P``) or asynchronously (overlapped)
     is read from the transport call.
   - Decentralized methods: lowbit's wrapper
     (:class:`~lowbit.integrations.decentralized.DecentralizedDataParallel`, as the race
     runs them) on a ring of 3 (two neighbours, as on any larger ring; a ring of 2, one
     neighbour, for 2 workers) over a :class:`MirrorTransport`: its step time minus a plain
     step's (interleaved), and every message it sends, from its ledger.

What it models, with lowbit's network model (:mod:`lowbit.comm.netmodel`; every link the
same bandwidth and latency): ring all-reduce, all-gather, neighbour exchange (ring topology,
2 neighbours in parallel), and DDP's overlap of bucket communication with backward
(:func:`~lowbit.comm.netmodel.overlap_backward`: a bucket's communication starts when its hook
issues it and after the previous bucket's communication; compute inside a hook and
synchronous rounds delay the rest of backward). For ``n`` workers, a step of a DDP method is
``forward + max(backward end, communication end) + optimizer``; a decentralized step is
``forward + backward + optimizer + the wrapper's own compute + its messages``, one after
another (Moniqua, CHOCO and Bagua's low-precision algorithm do not overlap in the wrapper).

What it does not model (say so when you read a prediction): contention of communication with
compute for memory bandwidth or cores (gloo's reductions run on the CPU), the CPU time of the
transport itself, stragglers, collectives other than rings (NCCL's trees at scale), and
accuracy: a method that needs more steps to reach the same accuracy can be faster per step and
slower to the target (``lowbit bench race`` measures time to accuracy).

The recommendation for a setting is the method with the shortest predicted step when it is at
least ``min_speedup`` times faster than torch's DDP in fp32, and plain DDP
(``torch-ddp-fp32``) otherwise.
"""

from __future__ import annotations

import importlib
import inspect
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .comm.base import Transport
from .comm.ledger import CommRecord
from .comm.netmodel import NetworkModel, overlap_backward, parse_bandwidth, parse_latency

__all__ = ["METHODS", "DDP_METHODS", "GOSSIP_METHODS", "BASELINE", "DEFAULT_WORKERS", "DEFAULT_BANDWIDTHS",
           "DEFAULT_LATENCY", "Workload", "load_workload", "load_model_function", "MirrorTransport", "Profile",
           "measure", "predict", "plan", "format_plan_report", "plot_plan", "torch_powersgd_ops",
           "compare_with_race", "measure_latency", "format_race_comparison"]

#: the DDP anchor (``lowbit bench race``'s name)
BASELINE = "torch-ddp-fp32"
#: PowerSGD's rank, torch's hook and lowbit's alike (the race's; torch's hook also starts
#: compressing at its second iteration, as the race configures it)
POWERSGD_RANK = 2


def _race_methods() -> dict:
    from .bench.race import METHODS as RACE_METHODS

    return RACE_METHODS


#: DDP methods (torch DDP with or without a hook): name -> what it is; the race's contenders
DDP_METHODS = {m: r.description for m, r in _race_methods().items() if r.kind in ("torch", "hook")}
#: decentralized methods through lowbit's wrapper: name -> what it is
GOSSIP_METHODS = {m: r.description for m, r in _race_methods().items() if r.kind == "decentralized"}
#: every method, in the race's order (``lowbit bench race``'s :data:`~lowbit.bench.race.METHODS`)
METHODS = tuple(_race_methods())
DEFAULT_WORKERS = (8, 64, 512, 1024)
DEFAULT_BANDWIDTHS = ("1Gbit", "10Gbit", "25Gbit", "100Gbit")
#: assumed when none is given: a typical one-hop datacenter Ethernet latency (an assumption)
DEFAULT_LATENCY = "50us"
#: ranks of the ring the decentralized methods are measured on (two neighbours each)
GOSSIP_RING = 3


# --- the workload -----------------------------------------------------------------------------


@dataclass
class Workload:
    """One worker's training step: ``loss_fn(model, batch)`` is the scalar loss."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable
    batch_size: int | None
    description: str


def _call_with_batch(fn: Callable, what: str, batch_size: int | None, **extra):
    """``fn(batch_size=..., **extra)`` where it takes them (ValueError naming ``what`` otherwise)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {}
    if batch_size is not None:
        if "batch_size" not in params and not var_kw:
            raise ValueError(f"batch_size: {what} takes no batch_size argument; leave --batch-size out or add a "
                             "batch_size parameter to it")
        kw["batch_size"] = batch_size
    for k, v in extra.items():
        if v is None:
            continue
        if k not in params and not var_kw:
            raise ValueError(f"{k}: {what} takes no {k} argument")
        kw[k] = v
    return fn(**kw)


def _check_triple(out, what: str) -> tuple[nn.Module, Any, Callable]:
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"model: {what} must return a tuple (model, batch, loss_fn), got "
                         f"{type(out).__name__}{f' of {len(out)} items' if isinstance(out, tuple) else ''}")
    model, batch, loss_fn = out
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: the first item {what} returns must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"model: the third item {what} returns must be a callable loss_fn(model, batch), got "
                         f"{type(loss_fn).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model: the module {what} returns has no trainable parameters")
    _check_batch(batch, what)
    return model, batch, loss_fn


def _check_batch(batch, what: str) -> None:
    if isinstance(batch, torch.Tensor):
        return
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else None
    if items is None:
        raise ValueError(f"model: the batch {what} returns must be a tensor or a tuple, list or dict of tensors, "
                         f"got {type(batch).__name__}")
    for b in items:
        _check_batch(b, what)


def load_model_function(spec: str) -> Callable:
    """The function ``module:function`` names (``module`` importable, e.g. ``mypkg.models``,
    from ``sys.path`` or the current directory, as ``python -m`` finds it; a dotted attribute
    path after the colon is allowed). ValueError naming what is wrong."""
    import os
    import sys

    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"model must be 'module:function' (e.g. mypkg.nets:build), got {spec!r}")
    mod_name, attr = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"model: cannot import module {mod_name!r} ({e})") from None
    obj = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"model: module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"model: {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def load_workload(task: str | None = None, model: str | None = None, batch_size: int | None = None,
                  seq_len: int | None = None, task_options: dict | None = None) -> Workload:
    """The step to plan: a ``task`` (a name of :data:`lowbit.plan_models.PLAN_MODELS` or a
    ``lowbit train`` task) or ``model``, ``'module:function'``.

    The function's contract: called with no argument (or ``batch_size=B`` when ``batch_size``
    is given; it must then take that keyword), it returns ``(model, batch, loss_fn)``: an
    ``nn.Module``, one worker's minibatch (a tensor, or a tuple/list/dict of tensors; moved
    to the device with the model) and ``loss_fn(model, batch)``, the scalar loss whose
    backward gives the gradient DDP averages. ``task_options``: keyword arguments of a ``lowbit
    train`` task (e.g. ``{"hidden": 1024}`` for digits-mlp)."""
    from .plan_models import PLAN_MODELS

    if (task is None) == (model is None):
        raise ValueError("give exactly one of task (a name) or model ('module:function')")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if seq_len is not None and task != "gpt2-small":
        raise ValueError("seq_len is for the gpt2-small task only")
    if model is not None:
        fn = load_model_function(model)
        net, batch, loss_fn = _check_triple(_call_with_batch(fn, model, batch_size), model)
        return Workload(model, net, batch, loss_fn, _leading_dim(batch) if batch_size is None else batch_size,
                        f"{model} (a user's function)")
    if task in PLAN_MODELS:
        fn, default_batch, what = PLAN_MODELS[task]
        b = default_batch if batch_size is None else batch_size
        net, batch, loss_fn = _check_triple(_call_with_batch(fn, task, b, seq_len=seq_len), task)
        if seq_len is not None:
            what += f", sequences of {seq_len} tokens"
        return Workload(task, net, batch, loss_fn, b, what)
    from .train.tasks import TASKS, make_task

    if task_options and task not in TASKS:
        raise ValueError("task_options are for the lowbit train tasks")
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of: {', '.join([*PLAN_MODELS, *TASKS])}")
    t = make_task(task, **(task_options or {}))
    b = 32 if batch_size is None else batch_size
    torch.manual_seed(0)
    net = t.make_model()
    batch = t.sample(t.shard(0, 1, 0), b, torch.Generator().manual_seed(0))
    return Workload(task, net, batch, t.loss, b, f"lowbit train task {task}")


def _leading_dim(batch) -> int | None:
    """The batch size a batch shows: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = list(batch.values()) if isinstance(batch, dict) else list(batch)
    return _leading_dim(items[0]) if items else None


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return type(batch)(_to(b, device) for b in batch)


# --- a transport of n equal ranks -------------------------------------------------------------


class MirrorTransport(Transport):
    """This rank among ``world_size`` ranks that all hold what it holds: a neighbour sends back
    this rank's own buffer, an all-reduce SUM is ``world_size`` times the tensor (MAX, MIN and
    AND the tensor itself), an all-gather ``world_size`` copies. It runs an algorithm's or a
    hook's real code, with the sizes ``world_size`` ranks need, without a network; the ledger
    records every op as any transport does, and :attr:`calls` says for each all-reduce whether
    it was issued synchronously or asynchronously (``(kind, CommRecord)``, ``kind`` ``"sync"``
    or ``"async"``)."""

    def __init__(self, world_size: int, rank: int = 0, group=None):
        super().__init__(rank, world_size)
        self.group = group
        self.calls: list[tuple[str, CommRecord]] = []
        self.max_message_bytes = None

    def _note(self, kind: str, n_before: int) -> None:
        recs = self.ledger.records.get(self.ledger.step, [])
        if self.ledger.tracking and len(recs) > n_before:
            self.calls.append((kind, recs[-1]))

    def _count(self) -> int:
        return len(self.ledger.records.get(self.ledger.step, []))

    def all_reduce(self, t, op="sum"):
        n = self._count()
        out = super().all_reduce(t, op)
        self._note("sync", n)
        return out

    def all_reduce_async(self, t, op="sum", *, inplace=False):
        n = self._count()
        out = super().all_reduce_async(t, op, inplace=inplace)
        self._note("async", n)
        return out

    def all_gather(self, t):
        n = self._count()
        out = super().all_gather(t)
        self._note("sync", n)
        return out

    def all_gather_async(self, t):
        n = self._count()
        out = super().all_gather_async(t)
        self._note("async", n)
        return out

    def _neighbor_exchange(self, buf, neighbors):
        return {j: buf.clone() for j in neighbors}

    def _all_reduce(self, t, op):
        if op == "sum":
            return t * self.world_size
        return t.clone()

    def _all_gather(self, t):
        return [t.clone() for _ in range(self.world_size)]

    def _broadcast(self, t, src):
        return t.clone()

    def _gather(self, t, dst):
        return [t.clone() for _ in range(self.world_size)] if self.rank == dst else None

    def _barrier(self) -> None:
        return None

    def post_refusal(self, text: str) -> None:
        """Nothing to post to: no other rank runs."""

    def posted_refusal(self) -> str | None:
        """No other rank refuses anything."""
        return None


# --- measuring ---------------------------------------------------------------------------------


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available here")
    return dev


class _OneProcessGroup:
    """A process group of this one process (gloo; NCCL on CUDA) unless one exists (which must
    have one rank): DDP and torch's hooks need it."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.own = False

    def __enter__(self):
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != 1:
                raise ValueError(f"plan measures one process: the default process group has "
                                 f"{dist.get_world_size()} ranks")
            return self
        nccl = self.dev.type == "cuda" and dist.is_nccl_available()
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
        dist.init_process_group("nccl" if nccl else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": self.dev} if nccl else {}))
        self.own = True
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        if self.own:
            dist.destroy_process_group()


class _Clock:
    """Seconds since :meth:`start` at each :meth:`mark`: the wall clock on the CPU, CUDA events on
    the current stream (read after the step: marking does not wait for the device)."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.marks: list = []

    def start(self) -> None:
        self.marks = []
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        if self.cuda:
            return [self.t0.elapsed_time(e) / 1e3 for e in self.marks]
        return [m - self.t0 for m in self.marks]


class _Recorder:
    """DDP communication hook of the profiling run: notes when DDP calls it for each bucket (the
    bucket is ready) and which parameters the bucket holds, and returns the bucket as it is
    (the average over one process)."""

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.buckets: list[tuple[int, list, torch.Tensor | None]] = []
        self.keep = False

    def hook(self, state, bucket):
        self.clock.mark()
        buf = bucket.buffer()
        self.buckets.append((bucket.index(), list(bucket.parameters()), buf.detach().clone() if self.keep else None))
        fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
        fut.set_result(buf)
        return fut


@dataclass
class Bucket:
    """One DDP bucket as the profiling run saw it: its index, its parameters (in bucket order),
    a copy of its gradient at the last step, and when it became ready (seconds from the start of
    backward, the median over the timed steps)."""

    index: int
    params: list
    grad: torch.Tensor
    ready_seconds: float

    @property
    def numel(self) -> int:
        """Elements of the bucket."""
        return self.grad.numel()


@dataclass
class Profile:
    """What :func:`measure` measured (seconds are medians over ``repeats`` steps)."""

    workload: str
    description: str
    parameters: int
    batch_size: int | None
    device: str
    threads: int
    repeats: int
    warmup: int
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    buckets: list[Bucket]
    hook_seconds: dict  # DDP method -> [seconds of its hook per bucket]
    hook_ops: dict  # DDP method -> {workers: [[(kind, CommRecord), ...] per bucket]}
    gossip: dict  # method -> {ring size: {"overhead_seconds", "records": [[CommRecord...] per step], "world"}}

    def to_json(self) -> dict:
        """The measurements as plain JSON values."""
        return {"workload": self.workload, "description": self.description, "parameters": self.parameters,
                "batch_size": self.batch_size, "device": self.device, "threads": self.threads,
                "repeats": self.repeats, "warmup": self.warmup, "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds, "optimizer_seconds": self.optimizer_seconds,
                "buckets": [{"index": b.index, "numel": b.numel, "bytes": b.numel * b.grad.element_size(),
                             "tensors": len(b.params), "ready_seconds": b.ready_seconds} for b in self.buckets],
                "hook_seconds": {m: v for m, v in self.hook_seconds.items()},
                "gossip_overhead_seconds": {m: {str(w): v["overhead_seconds"] for w, v in g.items()}
                                            for m, g in self.gossip.items()}}


def _rec(op: str, nbytes: int, n: int, peers: int = 1) -> CommRecord:
    from .comm.netmodel import op_messages_and_bytes

    messages, sent = op_messages_and_bytes(op, int(nbytes), n, peers=peers)
    return CommRecord(op, int(nbytes), sent, messages, peers)


def torch_powersgd_ops(params: Sequence[torch.Tensor], n: int, rank: int = POWERSGD_RANK,
                       min_compression_rate: float = 2.0, element_size: int = 4) -> list[tuple[str, CommRecord]]:
    """The all-reduces torch's ``powerSGD_hook`` issues for one bucket holding ``params``: the
    uncompressed tensors (1-D ones, and matrices that torch's ``_should_compress`` leaves
    alone) in one, then every ``P`` (rows x rank), then every ``Q`` (columns x rank), each
    waiting for the one before (asynchronous: chained in the hook's futures)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    dense, p_elems, q_elems = 0, 0, 0
    for t in params:
        if t.dim() <= 1:
            dense += t.numel()
            continue
        rows, cols = t.shape[0], t.numel() // t.shape[0]
        r = min(rows, cols, rank)
        if _should_compress(rows, cols, r, min_compression_rate)[0]:
            p_elems += rows * r
            q_elems += cols * r
        else:
            dense += t.numel()
    ops = [("async", _rec("all_reduce", dense * element_size, n))] if dense else []
    if p_elems:
        ops += [("async", _rec("all_reduce", p_elems * element_size, n)),
                ("async", _rec("all_reduce", q_elems * element_size, n))]
    return ops


class _HookBucket:
    """What the hooks read of a ``torch.distributed.GradBucket``: a profiled bucket, refilled
    with its gradient before each call (a hook overwrites its bucket)."""

    def __init__(self, b: Bucket, last: bool):
        self.b = b
        self.last = last
        self._buf = b.grad.clone()
        self._views, off = [], 0
        for p in b.params:
            self._views.append(self._buf[off:off + p.numel()].view(p.shape))
            off += p.numel()

    def refill(self) -> None:
        self._buf.copy_(self.b.grad)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self.b.index

    def is_last(self) -> bool:
        return self.last

    def parameters(self) -> list:
        return self.b.params

    def gradients(self) -> list:
        return self._views


def _ddp_contender(name: str, n: int | None = None, model: nn.Module | None = None):
    """(hook, state, mirror or None) of DDP method ``name``: on the process group (``n`` None:
    what is timed) or, for lowbit's hooks, on a :class:`MirrorTransport` of ``n`` ranks (what
    records the ops ``n`` workers send). ``model``: lowbit's hook state keys its error memory
    by the model's parameter names, as the race binds it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    from .integrations.ddp_hooks import make_hook

    race = _race_methods().get(name)
    if race is not None and race.kind == "torch":
        if race.hook is None:
            return dh.allreduce_hook, None, None
        if race.hook == "fp16":
            return dh.fp16_compress_hook, None, None
        if race.hook != "powersgd":
            raise ValueError(f"method {name!r}: torch hook {race.hook!r} is not planned")
        state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2,
                                 use_error_feedback=True, warm_start=True)
        return ph.powerSGD_hook, state, None
    if race is not None:
        hook_name, opts = race.hook, dict(race.options)
    elif name.startswith("lowbit-qsgd-maxnorm-"):  # any bits (repro throughput-model times 2, 4 and 8)
        hook_name, opts = "qsgd_maxnorm", {"bits": int(name.rsplit("-", 1)[1])}
    else:
        raise ValueError(f"method {name!r} is not a DDP method of the race")
    if hook_name == "powersgd":
        opts.setdefault("powersgd_rank", POWERSGD_RANK)
    state, hook = make_hook(hook_name, **opts, **({} if model is None else {"model": model}))
    if n is None:
        return hook, state, None
    mirror = MirrorTransport(n, group=state.process_group)
    state._transport = mirror  # the hook's collectives go to n mirrored ranks (LowbitHookState._comm keeps it)
    return hook, state, mirror


def _torch_ops(name: str, b: Bucket, n: int) -> list[tuple[str, CommRecord]]:
    es = b.grad.element_size()
    hook = _race_methods()[name].hook
    if hook is None:  # DDP's own all-reduce of the bucket
        return [("async", _rec("all_reduce", b.numel * es, n))]
    if hook == "fp16":
        return [("async", _rec("all_reduce", b.numel * 2, n))]
    return torch_powersgd_ops(b.params, n, element_size=es)


def _run_pass(hook, state, mirror, buckets: list[_HookBucket], dev):
    """One iteration's hook calls, bucket by bucket, each run to its result: (seconds per
    bucket, ops per bucket as the mirror recorded them, or None)."""
    secs, ops = [], []
    for hb in buckets:
        hb.refill()
        if mirror is not None:
            mirror.calls = []
        _sync(dev)
        t0 = time.perf_counter()
        hook(state, hb).wait()
        _sync(dev)
        secs.append(time.perf_counter() - t0)
        ops.append(list(mirror.calls) if mirror is not None else None)
    return secs, ops


def _hook_ops(name: str, buckets: list[Bucket], n: int, dev) -> list[list[tuple[str, CommRecord]]]:
    """What DDP method ``name`` sends for each bucket on ``n`` workers: lowbit's hooks run on a
    mirror of ``n`` ranks (the codes in the width ``n`` workers need, as the hook packs them);
    torch's hooks as torch's code issues them (:func:`torch_powersgd_ops`)."""
    if not name.startswith("lowbit-"):
        return [_torch_ops(name, b, n) for b in buckets]
    hook, state, mirror = _ddp_contender(name, n)
    hbs = [_HookBucket(b, i == len(buckets) - 1) for i, b in enumerate(buckets)]
    return _run_pass(hook, state, mirror, hbs, dev)[1]


def _time_hooks(buckets: list[Bucket], methods: Sequence[str], dev, rounds: int, warm: int = 3,
                min_run_time: float = 0.02, model: nn.Module | None = None) -> dict:
    """Per DDP method: the hook's time per bucket on the one-process group (the collective a
    local copy): each round times, for every method and bucket, the refill of the bucket and
    the refill plus the hook run to its result (``torch.utils.benchmark``'s blocked_autorange,
    ``min_run_time`` seconds each; the hook's time is the difference), and the figures are
    medians over ``rounds`` rounds that interleave the methods, after ``warm`` untimed passes
    (3: torch's PowerSGD compresses from its third)."""
    from .bench.timing import measure as timed

    threads = torch.get_num_threads()
    contenders = {}
    for m in methods:
        hook, state, _ = _ddp_contender(m, model=model)
        hbs = [_HookBucket(b, i == len(buckets) - 1) for i, b in enumerate(buckets)]
        for _ in range(warm):
            _run_pass(hook, state, None, hbs, dev)
        contenders[m] = (hook, state, hbs)
    runs: dict = {m: [] for m in methods}
    for _ in range(rounds):
        for m, (hook, state, hbs) in contenders.items():
            row = []
            for hb in hbs:
                refill = timed(hb.refill, dev, min_run_time, threads, "wall")
                call = timed(lambda hb=hb: (hb.refill(), hook(state, hb).wait()), dev, min_run_time, threads, "wall")
                row.append(max(call - refill, 0.0))
            runs[m].append(row)
    return {m: [statistics.median(r[i] for r in runs[m]) for i in range(len(buckets))] for m in methods}


def _time_gossip(workload: Workload, model: nn.Module, batch, methods: Sequence[str], dev, repeats: int,
                 warmup: int, world: int = GOSSIP_RING) -> dict:
    """Per decentralized method: the wrapper's step time minus a plain step's (medians of
    interleaved steps) and the ledger of every step, on a ring of ``world`` mirrored ranks (3:
    two neighbours, as on any larger ring; 2: the one neighbour of a ring of two)."""
    import copy

    from .integrations.decentralized import DecentralizedDataParallel

    out = {}
    for m in methods:
        r = _race_methods()[m]
        algo, opts = r.algorithm, dict(r.options)
        plain = copy.deepcopy(model)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        mirror = MirrorTransport(world)
        wrapped = DecentralizedDataParallel(net, opt, algorithm=algo, topology="ring", transport=mirror,
                                            sync_initial=False, **opts)
        try:
            def step(module, o):
                o.zero_grad()
                workload.loss_fn(module, batch).backward()
                o.step()

            diffs, steps = [], []
            for i in range(warmup + repeats):
                _sync(dev)
                t0 = time.perf_counter()
                step(plain, plain_opt)
                _sync(dev)
                t1 = time.perf_counter()
                step(wrapped, opt)
                _sync(dev)
                t2 = time.perf_counter()
                if i >= warmup:
                    diffs.append((t2 - t1) - (t1 - t0))
                    steps.append(wrapped.step_count - 1)
            records = [list(mirror.ledger.records.get(k, [])) for k in steps]
        finally:
            wrapped.close()
        out[m] = {"overhead_seconds": max(0.0, statistics.median(diffs)), "records": records, "world": world}
    return out


def measure(workload: Workload, device: str | torch.device = "cpu", workers: Sequence[int] = DEFAULT_WORKERS,
            methods: Sequence[str] = METHODS, repeats: int = 5, warmup: int = 2, threads: int | None = None) -> Profile:
    """Measure ``workload``'s step on ``device`` (see the module doc): forward, backward and
    optimizer time, the DDP buckets and when each becomes ready, every DDP method's hook
    compute per bucket for the integer widths of ``workers``, and the decentralized methods'
    own compute and messages."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _device(device)
    for name, v, lo in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    workers = _check_workers(workers)
    methods = _check_methods(methods)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    model = workload.model.to(dev)
    batch = _to(workload.batch, dev)
    clock = _Clock(dev)
    fwd, bwd, opt_t, ready = [], [], [], []
    with _OneProcessGroup(dev):
        ddp = DDP(model, device_ids=[dev] if dev.type == "cuda" else None)
        rec = _Recorder(clock)
        ddp.register_comm_hook(None, rec.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        total = warmup + repeats + 1  # DDP rebuilds its buckets after the first iteration
        for i in range(total):
            rec.buckets = []
            rec.keep = i == total - 1
            opt.zero_grad()
            clock.start()
            loss = workload.loss_fn(ddp, batch)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ValueError(f"model: loss_fn(model, batch) must return a scalar tensor that requires grad, got "
                                 f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            f_end = clock.mark()
            loss.backward()
            b_end = clock.mark()
            opt.step()
            o_end = clock.mark()
            _sync(dev)
            s = clock.seconds()
            # marks: forward end, one per bucket (recorded during backward), backward end, step end
            if i > warmup:
                fwd.append(s[f_end])
                bwd.append(s[b_end] - s[f_end])
                opt_t.append(s[o_end] - s[b_end])
                ready.append([t - s[f_end] for t in s[f_end + 1:b_end]])
        if len({len(r) for r in ready}) != 1:
            raise RuntimeError(f"DDP called its hook a different number of times at different steps: "
                               f"{[len(r) for r in ready]}")
        buckets = [Bucket(idx, params, grad, statistics.median(r[j] for r in ready))
                   for j, (idx, params, grad) in enumerate(rec.buckets)]
        for j in range(1, len(buckets)):  # medians of each bucket: keep the order DDP called them in
            buckets[j].ready_seconds = max(buckets[j].ready_seconds, buckets[j - 1].ready_seconds)
        backward = max(statistics.median(bwd), buckets[-1].ready_seconds)
        ddp_methods = [m for m in methods if m in DDP_METHODS]
        hook_seconds = _time_hooks(buckets, ddp_methods, dev, repeats, model=model)
        hook_ops = {m: {n: _hook_ops(m, buckets, n, dev) for n in workers} for m in ddp_methods}
        del ddp
    gossip_methods = [m for m in methods if m in GOSSIP_METHODS]
    gossip = {}
    for world in sorted({min(n, GOSSIP_RING) for n in workers}) if gossip_methods else ():
        gossip[world] = _time_gossip(workload, model, batch, gossip_methods, dev, repeats, warmup, world)
    gossip = {m: {w: g[m] for w, g in gossip.items()} for m in gossip_methods}
    return Profile(workload.name, workload.description, sum(p.numel() for p in model.parameters()),
                   workload.batch_size, str(dev) if dev.type == "cpu" else f"{dev} ({torch.cuda.get_device_name(dev)})",
                   torch.get_num_threads(), repeats, warmup, statistics.median(fwd), backward,
                   statistics.median(opt_t), buckets, hook_seconds, hook_ops, gossip)


def _check_workers(workers) -> tuple[int, ...]:
    if isinstance(workers, str):
        try:
            workers = [int(w) for w in workers.split(",") if w.strip()]
        except ValueError:
            raise ValueError(f"workers must be comma-separated integers >= 2, got {workers!r}") from None
    workers = tuple(workers)
    if not workers or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in workers):
        raise ValueError(f"workers must be integers >= 2, got {workers!r}")
    return tuple(sorted(set(workers)))


def _check_methods(methods) -> tuple[str, ...]:
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = tuple(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must name methods of {', '.join(METHODS)}; got {methods!r}")
    if BASELINE not in methods:
        methods = (BASELINE, *methods)
    return tuple(m for m in METHODS if m in methods)


# --- predicting -------------------------------------------------------------------------------


def _ddp_prediction(p: Profile, m: str, n: int, net: NetworkModel) -> dict:
    ops = p.hook_ops[m][n]
    compute = p.hook_seconds[m]
    rows, sent, comm_total = [], 0, 0.0
    for b, c, bops in zip(p.buckets, compute, ops):
        sync = math.fsum(net.op_seconds(r, n) for k, r in bops if k == "sync")
        comm = math.fsum(net.op_seconds(r, n) for k, r in bops if k == "async")
        sent += sum(r.sent_bytes for _, r in bops)
        comm_total += sync + comm
        rows.append((b.ready_seconds, c, sync, comm))
    bwd_end, comm_end = overlap_backward(p.backward_seconds, rows)
    step = p.forward_seconds + max(bwd_end, comm_end) + p.optimizer_seconds
    compute_total = math.fsum(compute)
    return {"step_seconds": step, "bytes_per_step": sent, "method_compute_seconds": compute_total,
            "comm_seconds": comm_total,
            "exposed_comm_seconds": step - (p.forward_seconds + p.backward_seconds + p.optimizer_seconds + compute_total)}


def _gossip_prediction(p: Profile, m: str, n: int, net: NetworkModel) -> dict:
    g = p.gossip[m][min(n, GOSSIP_RING)]
    steps = g["records"]
    comm = statistics.fmean(net.step_seconds(r, n) for r in steps) if steps else 0.0
    sent = statistics.fmean(sum(_rec(r.op, r.nbytes, n, r.peers).sent_bytes for r in recs) for recs in steps) \
        if steps else 0.0
    base = p.forward_seconds + p.backward_seconds + p.optimizer_seconds
    return {"step_seconds": base + g["overhead_seconds"] + comm, "bytes_per_step": sent,
            "method_compute_seconds": g["overhead_seconds"], "comm_seconds": comm, "exposed_comm_seconds": comm}


def predict(p: Profile, workers: Sequence[int], bandwidths: Sequence, latencies: Sequence,
            min_speedup: float = 1.1) -> list[dict]:
    """Predicted step time of every measured method for each number of ``workers``, bandwidth
    and latency: one row per setting, ``{"workers", "bandwidth", "latency_s", "methods":
    {method: {"step_seconds", "speedup", ...}}, "recommendation"}``. ``speedup`` is fp32 DDP's
    predicted step over the method's; the recommendation is the fastest method when its speedup
    is at least ``min_speedup``, else ``torch-ddp-fp32``."""
    if not (isinstance(min_speedup, (int, float)) and math.isfinite(min_speedup) and min_speedup >= 1):
        raise ValueError(f"min_speedup must be a number >= 1, got {min_speedup!r}")
    workers = _check_workers(workers)
    methods = [m for m in METHODS if m in p.hook_ops or m in p.gossip]
    missing = [n for n in workers if any(n not in p.hook_ops[m] for m in p.hook_ops)]
    if missing:
        raise ValueError(f"workers {missing} were not measured (measure with them: the integer width depends on them)")
    rows = []
    for bw in bandwidths:
        for lat in latencies:
            net = NetworkModel(parse_bandwidth(bw), parse_latency(lat))
            for n in workers:
                res = {m: (_ddp_prediction(p, m, n, net) if m in DDP_METHODS else _gossip_prediction(p, m, n, net))
                       for m in methods}
                base = res[BASELINE]["step_seconds"]
                for r in res.values():
                    r["speedup"] = base / r["step_seconds"]
                best = min(methods, key=lambda m: res[m]["step_seconds"])
                rec = best if res[best]["speedup"] >= min_speedup else BASELINE
                rows.append({"workers": n, "bandwidth": str(bw), "bandwidth_bit_s": net.bandwidth,
                             "latency_s": net.latency, "methods": res, "recommendation": rec})
    return rows


def plan(task: str | None = None, model: str | None = None, device: str = "cpu", workers=DEFAULT_WORKERS,
         bandwidths=DEFAULT_BANDWIDTHS, latencies=(DEFAULT_LATENCY,), batch_size: int | None = None,
         repeats: int = 5, warmup: int = 2, threads: int | None = None, methods=METHODS, min_speedup: float = 1.1,
         seq_len: int | None = None) -> dict:
    """Measure the model's step on ``device`` and predict every method's step time on each
    setting (see the module doc); the report :func:`format_plan_report` prints and ``--json``
    writes: ``{"measured": ..., "settings": [...], "assumptions": [...], "not_modelled": [...]}``."""
    if isinstance(bandwidths, str):
        bandwidths = [b for b in bandwidths.split(",") if b.strip()]
    if isinstance(latencies, str):
        latencies = [x for x in latencies.split(",") if x.strip()]
    bandwidths, latencies = list(bandwidths), list(latencies)
    if not bandwidths or not latencies:
        raise ValueError("bandwidths and latencies must each hold at least one value")
    for b in bandwidths:
        parse_bandwidth(b)
    for x in latencies:
        parse_latency(x)
    workers = _check_workers(workers)
    w = load_workload(task, model, batch_size, seq_len=seq_len)
    prof = measure(w, device, workers, methods, repeats, warmup, threads)
    settings = predict(prof, workers, bandwidths, latencies, min_speedup)
    assumptions = ["every link has the bandwidth and latency of the setting; collectives are rings",
                   "the decentralized methods gossip on a ring (2 neighbours per worker)",
                   f"PowerSGD at rank {POWERSGD_RANK} (torch's hook: start_powerSGD_iter=2, min_compression_rate=2)",
                   "hook decode time is counted before the bucket's communication (it follows it in reality)"]
    if any(str(x) == DEFAULT_LATENCY for x in latencies):
        assumptions.append(f"latency {DEFAULT_LATENCY} per message (the default: an assumption, not measured)")
    return {"plan": "lowbit plan", "measured": prof.to_json(), "workers": list(workers),
            "bandwidths": [str(b) for b in bandwidths], "latencies_s": [parse_latency(x) for x in latencies],
            "min_speedup": min_speedup,
            "methods": {m: (DDP_METHODS[m] if m in DDP_METHODS else GOSSIP_METHODS[m])
                        for m in METHODS if m in prof.hook_ops or m in prof.gossip},
            "settings": settings, "assumptions": assumptions,
            "not_modelled": ["contention between communication and compute (gloo reduces on the CPU)",
                             "the transport's own CPU time", "stragglers", "tree or hierarchical collectives",
                             "accuracy: steps to a target may differ between methods"]}


def format_plan_report(report: dict) -> str:
    """The text ``lowbit plan`` prints: what was measured, then one table per bandwidth and
    latency (predicted step time and speedup against fp32 DDP per method and worker count,
    the recommendation)."""
    m = report["measured"]
    lines = [f"lowbit plan: {m['description']}, {m['parameters']:,} parameters, batch {m['batch_size']} per worker",
             f"measured on {m['device']} ({m['threads']} torch threads), medians of {m['repeats']} steps after "
             f"{m['warmup']} warm-up: forward {m['forward_seconds'] * 1e3:.1f} ms, backward "
             f"{m['backward_seconds'] * 1e3:.1f} ms, optimizer {m['optimizer_seconds'] * 1e3:.1f} ms",
             f"DDP buckets (ready at ms of backward): " + ", ".join(
                 f"{b['bytes'] / 2**20:.1f} MiB@{b['ready_seconds'] * 1e3:.1f}" for b in m["buckets"])]
    methods = list(report["methods"])
    groups: dict = {}
    for s in report["settings"]:
        groups.setdefault((s["bandwidth"], s["latency_s"]), []).append(s)
    for (bw, lat), rows in groups.items():
        lines.append("")
        lines.append(f"{bw}, latency {lat * 1e6:g} us: predicted step ms (speedup vs {BASELINE})")
        lines.append(f"{'method':<24}" + "".join(f"{'n=' + str(r['workers']):>20}" for r in rows))
        for meth in methods:
            lines.append(f"{meth:<24}" + "".join(
                f"{r['methods'][meth]['step_seconds'] * 1e3:>11.1f} ({r['methods'][meth]['speedup']:>5.2f}x)"
                for r in rows))
        lines.append(f"{'recommended':<24}" + "".join(f"{r['recommendation']:>20}" for r in rows))
    lines.append("")
    lines.append("assumptions: " + "; ".join(report["assumptions"]))
    lines.append("not modelled: " + "; ".join(report["not_modelled"]))
    return "\n".join(lines)


def plot_plan(report: dict, out) -> list:
    """One PNG per bandwidth and latency: each method's predicted speedup against fp32 DDP over
    the number of workers (log y), fp32 DDP as the dashed line at 1. ``out``: a file name; the
    setting is added to its stem (``plan.png`` -> ``plan_1Gbit_50us.png``). Returns the paths."""
    from pathlib import Path

    from .plot import plot_series

    out = Path(out)
    groups: dict = {}
    for s in report["settings"]:
        groups.setdefault((s["bandwidth"], s["latency_s"]), []).append(s)
    paths = []
    for (bw, lat), rows in groups.items():
        series = [(meth, [r["workers"] for r in rows], [r["methods"][meth]["speedup"] for r in rows])
                  for meth in report["methods"] if meth != BASELINE]
        path = out.with_name(f"{out.stem}_{bw}_{lat * 1e6:g}us{out.suffix or '.png'}")
        paths.append(plot_series(series, "workers", f"predicted speedup vs {BASELINE}", path, logy=True,
                                 hlines=[(BASELINE, 1.0)],
                                 title=f"{report['measured']['workload']}: {bw}, {lat * 1e6:g} us"))
    return paths


def _ping(transport, samples: int) -> float:
    """Median seconds of a 4-byte SUM all-reduce on this launch's process group."""
    import torch.distributed as dist

    x = torch.zeros(1)
    times = []
    for i in range(10 + samples):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_latency(workers: int, rate: float | None, samples: int = 50) -> float:
    """The effective latency of one message between ``workers`` gloo processes, each behind a
    ``tc tbf`` link of ``rate`` bits/s (None: unshaped loopback), as the race runs them: the
    median time of a 4-byte ring all-reduce divided by its ``2 (n - 1)`` messages. It holds the
    links' own delay and gloo's fixed cost per message, and on a loaded machine the wait for the
    peer process to be scheduled."""
    from .comm import launch

    if rate is None:
        t = launch(workers, _ping, samples)
    else:
        from .comm.shaping import ShapedNetwork

        with ShapedNetwork(workers, rate) as net:
            t = launch(workers, _ping, samples, network=net)
    return max(t) / (2 * (workers - 1))


def compare_with_race(race: dict | None = None, quick: bool = True, networks=("100Mbit", "1Gbit"),
                      latency: str | None = None, repeats: int = 20, progress=print) -> dict:
    """The plan's predicted step time against ``lowbit bench race``'s measured one, for every
    contender on each shaped network: ``{"errors": {"NETWORK/METHOD": (predicted - measured) /
    measured}, "rows": [...], "plan": ..., "latency_s": {NETWORK: seconds}}``. ``race``: a race
    report (``bench race --json``), or None to run the race here (``quick``: its CI-sized
    settings). The plan measures the race's model, batch and workers with one torch thread, as
    each race worker runs. ``latency``: per message; None measures it on each network
    (:func:`measure_latency`: the race adds none, its links and gloo have their own)."""
    if race is None:
        from .bench.race import bench_race

        race = bench_race(quick=quick, networks=list(networks), progress=progress)
    st = race["settings"]
    nets = [n for n in networks if n in race["networks"]]
    if not nets:
        raise ValueError(f"the race has none of the networks {list(networks)} (skipped: "
                         f"{race.get('skipped_networks')})")
    from .bench.race import NETWORKS

    w = load_workload(task=st["task"], batch_size=st["batch"], task_options=st.get("task_options") or None)
    methods = [m for m in METHODS if any(m in race["networks"][n] for n in nets)]
    prof = measure(w, "cpu", [st["workers"]], methods, repeats=repeats, warmup=2, threads=1)
    lat = {net: (parse_latency(latency) if latency is not None else measure_latency(st["workers"], NETWORKS[net]))
           for net in nets}
    rows = [predict(prof, [st["workers"]], [NETWORKS[net]], [lat[net]])[0] for net in nets]
    errors, table = {}, []
    for net, row in zip(nets, rows):
        for m in methods:
            got = race["networks"][net].get(m) or {}
            measured = got.get("step_seconds")
            pred = row["methods"][m]["step_seconds"]
            err = None if not measured else (pred - measured) / measured
            if err is not None:
                errors[f"{net}/{m}"] = err
            table.append({"network": net, "method": m, "predicted_step_seconds": pred,
                          "measured_step_seconds": measured, "relative_error": err,
                          "predicted_bytes_per_step": row["methods"][m]["bytes_per_step"],
                          "measured_bytes_per_step": got.get("bytes_per_step"),
                          "measured_compute_seconds": got.get("compute_seconds"), "failed": got.get("failed")})
    return {"errors": errors, "rows": table, "plan": prof.to_json(), "race_settings": st, "latency_s": lat}


def format_race_comparison(cmp: dict) -> str:
    """The table of :func:`compare_with_race`: predicted and measured step and bytes per method."""
    lines = [f"latency per message (measured): " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in cmp["latency_s"].items()),
             f"{'network':<8} {'method':<24} {'plan ms':>9} {'race ms':>9} {'error':>7} {'plan B/step':>12} "
             f"{'race B/step':>12}"]
    for r in cmp["rows"]:
        meas = r["measured_step_seconds"]
        err = r["relative_error"]
        lines.append(f"{r['network']:<8} {r['method']:<24} {r['predicted_step_seconds'] * 1e3:>9.2f} "
                     f"{'-' if meas is None else f'{meas * 1e3:.2f}':>9} {'-' if err is None else f'{err:+.0%}':>7} "
                     f"{r['predicted_bytes_per_step']:>12.0f} "
                     f"{'-' if r['measured_bytes_per_step'] is None else round(r['measured_bytes_per_step']):>12}"
                     + (f"  race FAILED: {r['failed']}" if r["failed"] else ""))
    return "\n".join(lines)
