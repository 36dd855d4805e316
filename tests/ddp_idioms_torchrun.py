"""Run by tests/test_ddp_idioms.py under ``torchrun --nproc-per-node 2`` (gloo): DDP's idioms
under DecentralizedDataParallel against torch's DistributedDataParallel in the same processes.
``python ddp_idioms_torchrun.py CASE``; rank 0 prints one JSON line.

- ``scaler`` (``scaler-cuda``: on cuda:0): torch's own GradScaler, rank 1 alone overflows at step 3 (``one``), against the same
  run where both ranks overflow there (``both``), for gossip and gradient averaging, with
  ``unscale_`` and ``ddp.clip_grad_norm_`` (``clip``) and with a fused optimizer (``fused``), and
  torch's DDP with the same scaler and overflow (``ddp``);
- ``ddp``: allreduce + ddp.clip_grad_norm_ against DDP + clip_grad_norm_ (and the plain call),
  and 2 micro-batches, the first under no_sync, against DDP + no_sync (and one summed loss)."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.integrations import DecentralizedDataParallel

STEPS, BATCH, OVERFLOW_STEP = 8, 16, 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, k: int, micro: int = 0):
    g = torch.Generator().manual_seed(10000 * micro + 1000 * rank + k)
    return torch.randn(BATCH, 6, generator=g) * 3 + 2 * rank, torch.randint(0, 3, (BATCH,), generator=g)


def loss_of(net, rank, k, micro=0, device="cpu"):
    x, y = batch(rank, k, micro)
    return nn.functional.cross_entropy(net(x.to(device)), y.to(device))


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def scaler_run(algorithm, overflow_ranks, clip=False, fused=False, device="cpu"):
    """8 steps under fp16 autocast and torch's GradScaler; ``overflow_ranks``' gradients are inf
    at OVERFLOW_STEP. ``algorithm`` None: torch's DDP."""
    rank = dist.get_rank()
    net = model().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=fused or None)
    ddp = DecentralizedDataParallel(net, opt, algorithm) if algorithm else DDP(net)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=2)
    taken, scales, error, steps = [], [], None, None
    try:
        for k in range(STEPS):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = loss_of(ddp, rank, k, device=device)
            if rank in overflow_ranks and k == OVERFLOW_STEP:
                loss = loss * float("inf")  # this rank's fp16 gradients overflow
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                ddp.clip_grad_norm_(1.0)
            before = opt.state[net[0].weight].get("momentum_buffer")
            before = None if before is None else before.clone()
            scaler.step(opt)
            scaler.update()
            after = opt.state[net[0].weight].get("momentum_buffer")
            taken.append(after is not None and (before is None or not torch.equal(before, after)))
            scales.append(float(scaler.get_scale()))
        if algorithm:
            steps = ddp.step_count
            ddp.close()
    except Exception as e:  # noqa: BLE001 - reported
        error = f"{type(e).__name__}: {str(e)[:300]}"
    return {"taken": taken, "scales": scales, "error": error, "steps": steps, "x": flat(net)}


def scaler_runs(device="cpu"):
    out = {}
    with warnings.catch_warnings(record=True) as caught:  # torch warns on some of a scaler's paths
        warnings.simplefilter("always")
        for algorithm in ("dpsgd", "allreduce"):
            for variant, extra in (("", {}), ("clip-", {"clip": True}), ("fused-", {"fused": True})):
                for who, ranks in (("one", (1,)), ("both", (0, 1))):
                    out[f"{algorithm}/{variant}{who}"] = scaler_run(algorithm, ranks, device=device, **extra)
        out["ddp/one"] = scaler_run(None, (1,), device=device)
    out["warnings"] = {"messages": [f"{w.category.__name__}: {w.message}"[:200] for w in caught]}
    return out


def clip_runs():
    rank = dist.get_rank()
    out = {}
    net = model()
    ref = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    norms = []
    for k in range(STEPS):
        opt.zero_grad()
        loss_of(ref, rank, k).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)))
        opt.step()
    out["ddp"], out["ddp_norms"] = flat(net), norms
    for how in ("method", "plain"):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        ddp = DecentralizedDataParallel(net, opt, "allreduce")
        norms = []
        for k in range(STEPS):
            opt.zero_grad()
            loss_of(ddp, rank, k).backward()
            clip = ddp.clip_grad_norm_ if how == "method" else \
                (lambda m: torch.nn.utils.clip_grad_norm_(net.parameters(), m))
            norms.append(float(clip(1.0)))
            opt.step()
        out[how], out[how + "_norms"], out[how + "_bytes"] = flat(net), norms, ddp.bytes_sent
        ddp.close()
    return out


def no_sync_runs():
    rank = dist.get_rank()
    out = {}
    net = model()
    ref = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for k in range(STEPS):
        opt.zero_grad()
        with ref.no_sync():
            loss_of(ref, rank, k, 0).backward()
        loss_of(ref, rank, k, 1).backward()
        opt.step()
    out["ddp"] = flat(net)
    for how in ("no_sync", "summed"):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, "allreduce")
        for k in range(STEPS):
            opt.zero_grad()
            if how == "no_sync":
                with ddp.no_sync():
                    loss_of(ddp, rank, k, 0).backward()
                loss_of(ddp, rank, k, 1).backward()
            else:
                (loss_of(ddp, rank, k, 0) + loss_of(ddp, rank, k, 1)).backward()
            opt.step()
        out[how], out[how + "_bytes"] = flat(net), ddp.bytes_sent
        ddp.close()
    return out


def gathered(result: dict) -> dict:
    """Every rank's values, tensors as lists (rank 0 prints)."""
    res = {}
    for key, v in result.items():
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, v.tolist() if isinstance(v, torch.Tensor) else v)
        res[key] = box
    return res


def main(case: str) -> None:
    dist.init_process_group("gloo")
    if case in ("scaler", "scaler-cuda"):  # scaler-cuda: both processes on cuda:0
        res = {name: gathered(r) for name, r in scaler_runs("cuda" if case == "scaler-cuda" else "cpu").items()}
    elif case == "ddp":
        res = {"clip": gathered(clip_runs()), "no_sync": gathered(no_sync_runs())}
    else:
        raise SystemExit(f"unknown case {case!r}")
    if dist.get_rank() == 0:
        print(json.dumps(res), flush=True)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # not destroy_process_group(): its teardown at exit sometimes aborts a process after the
    # work is done ("terminate called without an active exception"), which is not what is tested
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
