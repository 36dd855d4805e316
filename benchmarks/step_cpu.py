"""The CPU seconds of one wrapper step on real processes, for one or more source trees side by
side: what a change to an algorithm's step costs where the race runs it.

Run (from the repository root; a "before" tree is a worktree of the commit to compare with)::

    git worktree add /tmp/before 6d996d1~1
    python benchmarks/step_cpu.py --trees /tmp/before,.                  # moniqua, fashion-lenet-tf, 4 processes
    python benchmarks/step_cpu.py --trees . --algorithm choco --task digits-mlp --workers 2

Method. For each round and each tree in turn (the order rotating every round), ``--workers``
gloo processes on loopback (one torch thread each) import lowbit from that tree (its path first,
the editable install's finder removed; each checks ``lowbit.__file__``), build the task's model
from seed 0 under :class:`~lowbit.integrations.DecentralizedDataParallel` (ring, ``--algorithm``
with its defaults), run ``--warmup`` steps, then ``--steps`` timed steps of
``zero_grad / forward / backward / step`` on the rank's own minibatches. Reported per tree and
round: rank 0's process CPU seconds per step (every thread of the process: the work the step
does, not the time it waits for a core, so that a loaded machine moves it less than the wall
clock) and its wall seconds per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gloo_procs import check_at_least, init_gloo, run_gloo


def _worker(rank: int, world: int, port: int, tree: str, args: argparse.Namespace, out) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, tree)
    import torch
    import torch.distributed as dist

    import lowbit
    from lowbit.comm.distributed import TorchDistributedTransport
    from lowbit.integrations import DecentralizedDataParallel
    from lowbit.train.tasks import make_task

    if not os.path.realpath(lowbit.__file__).startswith(os.path.realpath(tree)):
        raise SystemExit(f"imported lowbit from {lowbit.__file__}, not from {tree}")
    init_gloo(rank, world, port)
    task = make_task(args.task)
    torch.manual_seed(0)
    net = task.make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = DecentralizedDataParallel(net, opt, args.algorithm, topology="ring",
                                      transport=TorchDistributedTransport(process_group=dist.new_group()))
    shard, gen = task.shard(rank, world, 0), torch.Generator().manual_seed(rank)
    batches = [task.sample(shard, args.batch, gen) for _ in range(args.warmup + args.steps)]

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for x, y in batches[:args.warmup]:
        step(x, y)
    dist.barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    for x, y in batches[args.warmup:]:
        step(x, y)
    cpu, wall = (time.process_time() - c0) / args.steps, (time.perf_counter() - w0) / args.steps
    dist.barrier()
    model.close()
    if rank == 0:
        out.put((cpu, wall))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=".", help="comma-separated source trees (default: this one)")
    ap.add_argument("--algorithm", default="moniqua", help="a lowbit algorithm (default moniqua)")
    ap.add_argument("--task", default="fashion-lenet-tf", help="a classification task of lowbit train")
    ap.add_argument("--workers", type=int, default=4, help="processes (default 4)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the trees (default 2)")
    args = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.trees.split(",") if t]
    check_at_least(ap, args, {"workers": 2, "steps": 1, "warmup": 0, "batch": 1, "rounds": 1})
    missing = [t for t in trees if not os.path.isfile(os.path.join(t, "lowbit", "__init__.py"))]
    if missing or not trees:
        ap.error(f"--trees must name source trees holding lowbit/, got {missing or args.trees!r}")

    print(f"{args.algorithm}, {args.task}, {args.workers} gloo processes, {args.steps} steps; rank 0 per step")
    for r in range(args.rounds):
        for tree in trees[r % len(trees):] + trees[:r % len(trees)]:
            cpu, wall = run_gloo(_worker, args.workers, tree, args)
            print(f"round {r}  {tree}: process CPU {cpu * 1e3:7.1f} ms   wall {wall * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
