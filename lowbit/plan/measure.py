"""``lowbit plan``'s measurement of one step (:func:`measure`): forward, backward, optimizer,
the DDP buckets, the DDP methods' hooks and the decentralized methods' own compute and messages."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from .hooks import _hook_ops, _time_hooks
from .methods import (DDP_METHODS, DEFAULT_WORKERS, GOSSIP_METHODS, GOSSIP_RING, METHODS, _check_methods,
                      _check_workers, _race_methods)
from .mirror import MirrorTransport
from ..bench.hooks import one_process_group
from .profile import Bucket, Profile, _Clock, _device, _Recorder, _sync
from .workload import Workload, _to


def _time_gossip(workload: Workload, model: nn.Module, batch, methods: Sequence[str], dev, repeats: int,
                 warmup: int, world: int = GOSSIP_RING) -> dict:
    """Per decentralized method: the wrapper's step time minus a plain step's (medians of
    interleaved steps), the ledger of every step and every call of its transport (as
    :class:`~lowbit.plan.rounds.Round`: the untracked ones too), on a ring of ``world``
    mirrored ranks (3: two neighbours, as on any larger ring; 2: the one neighbour of a ring of
    two)."""
    import copy

    from ..integrations.decentralized import DecentralizedDataParallel

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

            diffs, steps, rounds = [], [], []
            for i in range(warmup + repeats):
                _sync(dev)
                t0 = time.perf_counter()
                step(plain, plain_opt)
                _sync(dev)
                t1 = time.perf_counter()
                before = len(mirror.rounds)
                step(wrapped, opt)
                _sync(dev)
                t2 = time.perf_counter()
                if i >= warmup:
                    diffs.append((t2 - t1) - (t1 - t0))
                    steps.append(wrapped.step_count - 1)
                    rounds.append(mirror.rounds[before:])
            records = [list(mirror.ledger.records.get(k, [])) for k in steps]
        finally:
            wrapped.close()
        out[m] = {"overhead_seconds": max(0.0, statistics.median(diffs)), "records": records, "world": world,
                  "rounds": rounds}
    return out


def _ddp_steps(ddp, rec: _Recorder, clock: _Clock, loss_fn, batch, dev, warmup: int, repeats: int) -> tuple:
    """``warmup + repeats + 1`` SGD steps of ``ddp`` (DDP rebuilds its buckets after the first):
    the timed steps' forward, backward and optimizer seconds, and when each bucket became ready
    (seconds from the end of forward); ``rec`` keeps the last step's gradients."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    fwd, bwd, opt_t, ready = [], [], [], []
    total = warmup + repeats + 1
    for i in range(total):
        rec.buckets = []
        rec.keep = i == total - 1
        opt.zero_grad()
        clock.start()
        loss = loss_fn(ddp, batch)
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
    return fwd, bwd, opt_t, ready


def _buckets(rec: _Recorder, ready: list[list[float]]) -> list[Bucket]:
    """The buckets of the last step, each ready at its median time over the timed steps (kept in
    the order DDP called them)."""
    if len({len(r) for r in ready}) != 1:
        raise RuntimeError(f"DDP called its hook a different number of times at different steps: "
                           f"{[len(r) for r in ready]}")
    buckets = [Bucket(idx, params, grad, statistics.median(r[j] for r in ready))
               for j, (idx, params, grad) in enumerate(rec.buckets)]
    for j in range(1, len(buckets)):
        buckets[j].ready_seconds = max(buckets[j].ready_seconds, buckets[j - 1].ready_seconds)
    return buckets


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
    with one_process_group(dev, "plan measures"):
        ddp = DDP(model, device_ids=[dev] if dev.type == "cuda" else None)
        rec = _Recorder(clock)
        ddp.register_comm_hook(None, rec.hook)
        fwd, bwd, opt_t, ready = _ddp_steps(ddp, rec, clock, workload.loss_fn, batch, dev, warmup, repeats)
        buckets = _buckets(rec, ready)
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
