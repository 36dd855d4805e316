"""A whole DDP training step with torch's fp16 hook and lowbit's hooks beside torch's DDP without a
hook, on real processes, the methods interleaved: what a hook costs where the race runs it.

Run (from the repository root)::

    python benchmarks/ddp_hooks_step.py                                   # fp16, fashion-lenet-tf, 4 processes
    python benchmarks/ddp_hooks_step.py --hooks fp16,qsgd-maxnorm --task digits-mlp --workers 2

Method. ``--workers`` gloo processes on loopback (one torch thread each) build the task's model
from seed 0 once per method: torch's ``DistributedDataParallel`` (default buckets) without a
hook (``ddp``), with torch's ``fp16_compress_hook`` (``torch-fp16``), and with each lowbit hook
of ``--hooks`` (``make_hook(name, seed=0, model=ddp)``, its defaults). A round runs ``--steps``
steps of every method (``zero_grad / forward / backward / step`` on the rank's own minibatches),
the order rotating every round, each after a barrier; the first round is not counted. Reported
per method: the median over rounds of the slowest rank's wall seconds per step, of rank 0's
process CPU seconds per step, and of the per-round ratio to ``ddp``'s wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gloo_procs import check_at_least, init_gloo, rotated_rounds, run_gloo


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lowbit.integrations.ddp_hooks import make_hook
    from lowbit.train.tasks import make_task

    init_gloo(rank, world, port)
    task = make_task(args.task)
    shard, gen = task.shard(rank, world, 0), torch.Generator().manual_seed(rank)
    batches = [task.sample(shard, args.batch, gen) for _ in range(args.steps)]
    runs = {}
    for name in ["ddp", "torch-fp16", *args.hooks]:
        torch.manual_seed(0)
        net = task.make_model()
        model = torch.nn.parallel.DistributedDataParallel(net)
        if name == "torch-fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name != "ddp":
            model.register_comm_hook(*make_hook(name, seed=0, model=model))
        runs[name] = (model, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))

    def steps(name: str) -> tuple[float, float]:
        """The slowest rank's wall seconds and this rank's process CPU seconds per step."""
        model, opt = runs[name]
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        cpu = (time.process_time() - c0) / args.steps
        wall = torch.tensor([(time.perf_counter() - w0) / args.steps])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        return wall.item(), cpu

    times = rotated_rounds(list(runs), 1, args.rounds, steps)
    walls = {n: [w for w, _ in t] for n, t in times.items()}
    cpus = {n: [c for _, c in t] for n, t in times.items()}
    if rank == 0:
        out.put((walls, cpus))
    dist.barrier()
    runs.clear()  # DDP models hold the group: release them before it goes (a clean exit)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hooks", default="fp16", help="comma-separated lowbit hook names (default fp16)")
    ap.add_argument("--task", default="fashion-lenet-tf", help="a classification task of lowbit train")
    ap.add_argument("--workers", type=int, default=4, help="processes (default 4)")
    ap.add_argument("--steps", type=int, default=20, help="steps of each method per round (default 20)")
    ap.add_argument("--rounds", type=int, default=7, help="counted rounds (default 7)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    args = ap.parse_args(argv)
    args.hooks = [h for h in args.hooks.split(",") if h]
    check_at_least(ap, args, {"workers": 2, "steps": 1, "rounds": 1, "batch": 1})
    from lowbit.integrations.ddp_hooks.names import hook_names

    unknown = [h for h in args.hooks if h not in hook_names()]
    if unknown:
        ap.error(f"--hooks must name lowbit hooks ({', '.join(hook_names())}), got {unknown}")

    walls, cpus = run_gloo(_worker, args.workers, args)
    print(f"{args.task}, {args.workers} gloo processes, {args.steps} steps x {args.rounds} rounds; medians")
    for name in walls:
        ratio = statistics.median(a / b for a, b in zip(walls[name], walls["ddp"]))
        print(f"{name:16s} wall {statistics.median(walls[name]) * 1e3:7.1f} ms   rank-0 CPU "
              f"{statistics.median(cpus[name]) * 1e3:6.1f} ms   wall / ddp {ratio:.3f}")


if __name__ == "__main__":
    main()
