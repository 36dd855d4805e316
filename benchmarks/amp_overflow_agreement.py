"""What the GradScaler's overflow agreement costs a step (:mod:`lowbit.integrations.amp`): the
same fp16-autocast loop under :class:`~lowbit.integrations.DecentralizedDataParallel` with the
agreement at the end of every backward pass, and with it switched off, beside torch's DDP.

Run (from the repository root)::

    python benchmarks/amp_overflow_agreement.py                  # allreduce and dpsgd, 15 rounds of 50 steps

Method. Two gloo processes on loopback, one thread each, the model, data and rounds of
``benchmarks/wrapper_vs_ddp.py`` (digits-mlp's shape, SGD with momentum, ``--batch`` samples),
every step ``opt.zero_grad(); with torch.autocast("cpu", dtype=torch.float16): loss = ...;
scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` with torch's GradScaler (no
overflow happens). Per method two wrappers: ``agreed`` (as shipped) and ``off`` (the wrapper's
autocast note disabled, so no agreement runs). A round runs every loop once, in an order that
rotates; a loop's time in a round is the slowest rank's. The figure is the median over rounds of
the per-round ratio agreed / off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from gloo_procs import init_gloo, loop_args, mlp_setup, rotated_rounds, run_gloo


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lowbit.comm.distributed import TorchDistributedTransport
    from lowbit.integrations import DecentralizedDataParallel

    init_gloo(rank, world, port)
    model, batches = mlp_setup(rank, args.hidden, args.batch, args.steps)

    runs = {}
    net, opt = model()
    runs["torch-ddp"] = (torch.nn.parallel.DistributedDataParallel(net), opt)
    for name in args.methods:
        for how in ("agreed", "off"):
            net, opt = model()
            transport = TorchDistributedTransport(process_group=dist.new_group())
            ddp = DecentralizedDataParallel(net, opt, name, transport=transport)
            if how == "off":
                ddp._note_autocast = lambda: None  # the forward never notes fp16: no agreement
            runs[f"{name}/{how}"] = (ddp, opt)
    scalers = {n: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for n in runs}
    loss_fn = nn.CrossEntropyLoss()

    def steps(name: str) -> float:
        wrapped, opt = runs[name]
        scaler = scalers[name]
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(wrapped(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(slowest, dist.ReduceOp.MAX)
        return slowest.item() / args.steps

    times = rotated_rounds(list(runs), args.warmup, args.rounds, steps)
    for name in list(runs)[1:]:
        runs[name][0].close()
    if rank == 0:
        out.put(times)
    dist.barrier()
    os._exit(0)  # no process-group teardown at exit: gloo's sometimes aborts a process after the work is done


def main(argv: list[str] | None = None) -> None:
    args = loop_args(__doc__, argv)
    times = run_gloo(_worker, 2, args)
    print(f"{'loop':16s} {'median step':>12s}  agreed / off per round")
    for name, t in times.items():
        print(f"{name:16s} {statistics.median(t) * 1e3:9.3f} ms")
    for name in args.methods:
        ratios = [a / b for a, b in zip(times[f"{name}/agreed"], times[f"{name}/off"])]
        print(f"{name:16s} agreed / off {statistics.median(ratios):.3f}  {[round(x, 3) for x in ratios]}")


if __name__ == "__main__":
    main()
