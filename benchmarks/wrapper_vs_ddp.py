"""A user's training loop under :class:`~lowbit.integrations.DecentralizedDataParallel` against the
same loop under torch's own ``DistributedDataParallel``: the per-step time, same model, same data.

Run (from the repository root)::

    python benchmarks/wrapper_vs_ddp.py                          # allreduce and dpsgd, 15 rounds of 50 steps
    python benchmarks/wrapper_vs_ddp.py --methods allreduce,dpsgd,moniqua --rounds 21 --hidden 512

Method. Two gloo processes on loopback (``torch.multiprocessing``), one thread each
(``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). Each process builds one model per method
from the same seed, digits-mlp's shape (``64 -> hidden -> 10``, ReLU), with SGD (lr 0.05, momentum
0.9) and synthetic batches of ``--batch`` drawn once: torch's DDP (default buckets, the default
process group) and the wrapper with each lowbit method (``algorithm=``, its defaults, ``overlap``
its default, on a process group of its own). The loop is the one PyTorch's DDP tutorial writes::

    opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

A round runs ``--steps`` steps of every method, one method after the other in an order that
rotates every round, each preceded by a barrier; a method's time in a round is the slowest rank's.
``--warmup`` rounds are not counted. The figure is the median over rounds of the per-round ratio
method / DDP, which the machine's other load moves less than either time; the median step times
are printed beside it.
"""

from __future__ import annotations

import argparse
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
        net, opt = model()
        transport = TorchDistributedTransport(process_group=dist.new_group())
        runs[name] = (DecentralizedDataParallel(net, opt, name, transport=transport), opt)
    loss_fn = nn.CrossEntropyLoss()

    def steps(name: str) -> float:
        wrapped, opt = runs[name]
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            loss_fn(wrapped(x), y).backward()
            opt.step()
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(slowest, dist.ReduceOp.MAX)
        return slowest.item() / args.steps

    times = rotated_rounds(list(runs), args.warmup, args.rounds, steps)
    for name in args.methods:
        runs[name][0].close()
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = loop_args(__doc__, argv)
    times = run_gloo(_worker, 2, args)
    ddp = times["torch-ddp"]
    print(f"{'method':12s} {'median step':>12s} {'/ torch DDP':>12s}  per-round ratios")
    print(f"{'torch-ddp':12s} {statistics.median(ddp) * 1e3:9.3f} ms {1.0:12.3f}")
    for name in args.methods:
        ratios = [a / b for a, b in zip(times[name], ddp)]
        print(f"{name:12s} {statistics.median(times[name]) * 1e3:9.3f} ms {statistics.median(ratios):12.3f}  "
              f"{[round(x, 3) for x in ratios]}")


if __name__ == "__main__":
    main()
