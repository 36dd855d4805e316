"""One rank of ``lowbit bench race`` (:mod:`lowbit.bench.race`): every method of the race in turn,
in one process, on the network the launch put it behind.

For each method the rank builds the same model (``torch.manual_seed(seed)``), the same optimizer
(SGD with momentum, a constant learning rate) and draws the same minibatches (a generator seeded
by ``seed`` and the rank), wraps the model as the method says (torch's
``DistributedDataParallel``, with or without a communication hook, or lowbit's
:class:`~lowbit.integrations.DecentralizedDataParallel`) and trains ``steps`` steps. Every
``eval_every`` steps the ranks meet at a barrier, the clock stops, rank 0 evaluates the model
(the average over the workers for a decentralized method), and the clock restarts after a
second barrier: evaluation is not training time. Then, untimed, the rank times
``compute_steps`` steps of the plain module (forward, backward and the optimizer's step on a
copy, no communication), on the wall clock and on the process's CPU clock.

Each finished run's record is written as JSON to ``record_dir``
(``NETWORK.METHOD.REPEAT.rankR.json``), and ``NETWORK.METHOD.REPEAT.rankR.started`` before it
starts, so that the launcher keeps the runs that finished and names the one that failed when a
launch dies.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from ..comm.netmodel import op_messages_and_bytes


def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chunk: int = 1000) -> float:
    """Share of ``X`` that ``model`` classifies as ``y`` (evaluation mode, no gradients)."""
    was = model.training
    model.eval()
    correct = 0
    dev = next(model.parameters()).device
    with torch.no_grad():
        for a in range(0, len(y), chunk):
            correct += int((model(X[a:a + chunk].to(dev)).argmax(1) == y[a:a + chunk].to(dev)).sum())
    model.train(was)
    return correct / len(y)


class _CountAllReduce:
    """Counts what the Python-level ``torch.distributed.all_reduce`` calls send while it is
    installed (torch's own hooks call it through ``torch.distributed``): per call, the ring
    all-reduce bytes of :func:`~lowbit.comm.netmodel.op_messages_and_bytes`, the convention of
    lowbit's ledger."""

    def __init__(self, world_size: int):
        self.world_size, self.bytes, self.calls = world_size, 0, 0
        self._orig = None

    def __enter__(self):
        self._orig = orig = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.bytes += op_messages_and_bytes("all_reduce", tensor.numel() * tensor.element_size(),
                                                self.world_size)[1]
            self.calls += 1
            return orig(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _anchor_bytes(ddp, world_size: int) -> int:
    """Ring bytes one rank sends per step under DDP's built-in all-reduce (no hook): every
    gradient travels once a step, in one all-reduce per bucket, so the buckets add up to the
    gradients' bytes (the ring's bytes are linear in the size: the split does not change them)."""
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
    return op_messages_and_bytes("all_reduce", grad_bytes, world_size)[1]


def _torch_hook(name: str, cfg: dict):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    if name == "fp16":
        return None, dh.fp16_compress_hook
    state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=cfg["powersgd_rank"],
                             start_powerSGD_iter=cfg["powersgd_start"], use_error_feedback=True, warm_start=True,
                             random_seed=cfg["seed"])
    if dist.get_backend() != "gloo":
        return state, ph.powerSGD_hook
    return state, powersgd_hook_in_order


def powersgd_hook_in_order(state, bucket):
    """torch's ``powerSGD_hook``, its future awaited before the hook returns: the form in which
    it runs on gloo with more than one bucket.

    The hook all-reduces ``P`` and issues the second all-reduce (``Q``) from that future's callback.
    On gloo the callback runs in a backend thread when ``P`` arrives, while the main thread goes on
    with backward and issues the next bucket's ``P``: the two ranks can issue the two collectives
    in different orders, and gloo then matches messages of different sizes (``op.preamble.length
    <= op.nbytes ... Received data size doesn't match expected size``, a SIGABRT of one rank and
    "Connection reset by peer" on the other). Waiting here makes every rank issue one bucket's
    collectives before the next bucket's; it costs the overlap of this bucket's communication with
    the rest of backward. (NCCL runs the callbacks when the work is enqueued, in order.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    fut = ph.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


class _Method:
    """A method's wrapped model: ``module`` (what is evaluated), ``train_step(x, y)``,
    ``eval_model()`` (collective for the decentralized wrapper), ``bytes_per_step()``, ``close()``."""

    def __init__(self, spec: dict, net: nn.Module, opt: torch.optim.Optimizer, transport, cfg: dict):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.kind, self.net, self.opt, self.transport = spec["kind"], net, opt, transport
        self.n = transport.world_size
        self.counter = None
        self.extra: dict = {}
        if self.kind == "decentralized":
            from ..integrations import DecentralizedDataParallel

            self.model = DecentralizedDataParallel(net, opt, spec["algorithm"], topology="ring", transport=transport,
                                                   seed=cfg["seed"], **spec["options"])
            self.ledger0, self.steps = transport.ledger.bytes_sent, 0
            return
        self.model = DDP(net)  # torch's defaults: 25 MB buckets (the first 1 MB), overlap with backward
        if self.kind == "torch" and spec["hook"] is not None:
            state, hook = _torch_hook(spec["hook"], cfg)
            self.model.register_comm_hook(state, hook)
            self.counter = _CountAllReduce(self.n)
        elif self.kind == "hook":
            from ..integrations.ddp_hooks import make_hook

            self.state, hook = make_hook(spec["hook"], seed=cfg["seed"], model=self.model, **spec["options"])
            self.model.register_comm_hook(self.state, hook)
        self.steps = 0

    def train_step(self, x, y) -> None:
        self.opt.zero_grad()
        if self.counter is not None:
            with self.counter:
                nn.functional.cross_entropy(self.model(x), y).backward()
        else:
            nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.step()
        self.steps += 1
        if self.kind != "decentralized":
            hb = getattr(self.transport, "heartbeat", None)  # DDP's collectives bypass the transport
            if hb is not None:
                hb(self.steps)

    def eval_model(self) -> nn.Module:
        return self.model.averaged_module() if self.kind == "decentralized" else self.net

    def bytes_per_step(self) -> float:
        if self.kind == "decentralized":
            # the ledger's growth over the run (evaluation and barriers are untracked); not the
            # wrapper's stats(), whose per-step figure is keyed by step number and so also holds
            # what earlier wrappers on this transport recorded at the same step numbers
            return (self.transport.ledger.bytes_sent - self.ledger0) / max(self.steps, 1)
        if self.kind == "hook":
            self.extra["fp32_bytes_per_step"] = self.state.fp32_bytes_sent / max(self.state.step, 1)
            return self.state.bytes_sent / max(self.state.step, 1)
        if self.counter is not None:
            return self.counter.bytes / max(self.steps, 1)
        return float(_anchor_bytes(self.model, self.n))

    def close(self) -> None:
        if self.kind == "decentralized":
            self.model.close()


def _sync() -> None:
    """Wait for the GPU's queued work (NCCL runs: a step's time is its kernels', not their launch)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _compute_only(net: nn.Module, lr: float, momentum: float, batches, transport) -> tuple[float, float]:
    """Median wall and CPU seconds of a step of the plain module (a copy): forward, backward and
    the optimizer's step, no communication; all ranks at once, as in the race."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    walls, cpus = [], []
    transport.barrier()
    for x, y in batches:
        w0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        _sync()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    transport.barrier()
    return statistics.median(walls[1:]), statistics.median(cpus[1:])


def _warm(spec: dict, task, shard, transport, cfg: dict) -> None:
    """``cfg["jit_steps"]`` untimed steps of the method on a throwaway model, outside the ledger:
    the one-time costs of a process (compiling or loading the codecs' kernels, torch's first
    autograd and collective calls) stay out of the race's clock, for every method alike."""
    torch.manual_seed(cfg["seed"] + 1)
    net = task.make_model().to(task.device)
    opt = torch.optim.SGD(net.parameters(), lr=spec["lr"], momentum=cfg["momentum"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    with transport.untracked():
        method = _Method(spec, net, opt, transport, cfg)
        for _ in range(cfg["jit_steps"]):
            method.train_step(*task.sample(shard, cfg["batch"], gen))
        method.close()
        transport.barrier()


def _run(name: str, spec: dict, task, shard, transport, cfg: dict, Xe, ye) -> dict:
    rank = transport.rank
    _warm(spec, task, shard, transport, cfg)
    torch.manual_seed(cfg["seed"])
    net = task.make_model().to(task.device)
    lr = spec["lr"]
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=cfg["momentum"])
    gen = torch.Generator().manual_seed(cfg["seed"] * 7919 + rank)
    method = _Method(spec, net, opt, transport, cfg)
    curve, step_times = [], []
    train_s, cpu_s = 0.0, 0.0
    steps, every = cfg["steps"], cfg["eval_every"]

    def evaluate(k: int) -> None:
        with transport.untracked():
            model = method.eval_model()
            acc = accuracy(model, Xe, ye) if rank == 0 else None
        curve.append([k, train_s, acc])

    evaluate(0)
    transport.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    last = t0
    for k in range(steps):
        x, y = task.sample(shard, cfg["batch"], gen)
        method.train_step(x, y)
        _sync()
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
        if (k + 1) % every == 0 or k + 1 == steps:
            with transport.untracked():
                transport.barrier()  # the step ends when every rank has ended it
            train_s += time.perf_counter() - t0
            cpu_s += time.process_time() - c0
            evaluate(k + 1)
            with transport.untracked():
                transport.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            last = t0
    bytes_per_step = method.bytes_per_step()
    final = None
    with transport.untracked():
        model = method.eval_model()
        if rank == 0:
            final = accuracy(model, task.X_test, task.y_test)
    method.close()
    gen_c = torch.Generator().manual_seed(cfg["seed"] * 7919 + rank)
    batches = [task.sample(shard, cfg["batch"], gen_c) for _ in range(cfg["compute_steps"] + 1)]
    compute_s, compute_cpu_s = _compute_only(net, lr, cfg["momentum"], batches, transport)
    warm = min(cfg["warmup"], max(len(step_times) - 1, 0))
    return {"curve": curve, "step_seconds": statistics.median(step_times[warm:]), "train_seconds": train_s,
            "cpu_seconds_per_step": cpu_s / steps, "compute_seconds": compute_s, "compute_cpu_seconds": compute_cpu_s,
            "bytes_per_step": float(bytes_per_step), "final_accuracy": final, "lr": lr, **method.extra}


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def set_link(rate_bps: float | None) -> None:
    """Shape this process's link (the shaped network's interface, in the namespace this rank
    runs in) to ``rate_bps`` bits/s with the token bucket :class:`~lowbit.comm.shaping.ShapedNetwork`
    builds, or take the shaping off (None). Each rank changes its own link only."""
    import subprocess

    from ..comm.shaping import IFNAME, TBF_BURST

    if rate_bps is None:
        cmd = ["tc", "qdisc", "del", "dev", IFNAME, "root"]
    else:
        cmd = ["tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf", "rate", f"{int(round(rate_bps))}bit",
               "burst", TBF_BURST, "latency", "200ms"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 and not (rate_bps is None and "No such file" in res.stderr + res.stdout):
        raise RuntimeError(f"race: `{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")


def race_worker(transport, cfg: dict) -> dict:
    """Run every ``(network, rate, method, repeat)`` of ``cfg["runs"]`` in order on this rank (see
    the module doc); on a shaped launch (``cfg["shaped"]``) each rank first sets its link to the
    network's rate (:func:`set_link`) whenever the network changes. Each record is written to
    ``cfg["record_dir"]`` as ``NETWORK.METHOD.REPEAT.rankR.json``."""
    from ..train.tasks import make_task

    torch.manual_seed(cfg["seed"])
    task = make_task(cfg["task"], **cfg["task_options"])
    if dist.get_backend() == "nccl":  # one GPU per rank: the launcher set this rank's device
        task.to(torch.device("cuda", torch.cuda.current_device()))
    shard = task.shard(transport.rank, transport.world_size, cfg["seed"])
    ne = min(cfg["eval_samples"], len(task.y_test))
    idx = torch.randperm(len(task.y_test), generator=torch.Generator().manual_seed(54321))[:ne]
    Xe, ye = task.X_test[idx], task.y_test[idx]
    done, network = [], object()
    for net, rate, name, rep in cfg["runs"]:
        stem = os.path.join(cfg["record_dir"], f"{net}.{name}.{rep}.rank{transport.rank}")
        with open(stem + ".started", "w") as f:
            f.write(name)
        if net != network and cfg["shaped"]:
            set_link(rate)
        network = net
        with transport.untracked():
            transport.barrier()
        t0, load0 = time.perf_counter(), _loadavg()
        try:
            rec = _run(name, cfg["methods"][name], task, shard, transport, cfg, Xe, ye)
            rec["loadavg"] = [load0, _loadavg()]  # the machine's 1-minute load at the start and the end
        except Exception as e:
            raise RuntimeError(f"race method {name} on {net}: {type(e).__name__}: {e}") from e
        with open(stem + ".json.tmp", "w") as f:
            json.dump(rec, f)
        os.replace(stem + ".json.tmp", stem + ".json")
        if transport.rank == 0:
            print(f"  {net} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        done.append(f"{net}.{name}.{rep}")
    return {"done": done}
