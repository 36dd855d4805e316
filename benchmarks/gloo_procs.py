"""What the multi-process benchmarks share: a free port, ``n`` gloo processes on loopback spawned
with one torch thread each, and the argparse range checks.

A script's worker is ``worker(rank, world, port, *args, out)``; it calls :func:`init_gloo` and
puts rank 0's result on ``out``; :func:`run_gloo` starts the processes and returns that result.
"""

from __future__ import annotations

import argparse
import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    """One torch thread, and the default process group (gloo over 127.0.0.1:``port``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def run_gloo(worker, world: int, *args):
    """Spawn ``world`` processes of ``worker(rank, world, port, *args, out)`` (``OMP_NUM_THREADS=1``,
    and ``NUMBA_NUM_THREADS=1`` unless set) and return what rank 0 put on ``out``."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world, free_port(), *args, out), nprocs=world, start_method="spawn")
    return out.get()


def check_at_least(ap: argparse.ArgumentParser, args: argparse.Namespace, lows: dict[str, int]) -> None:
    """``ap.error`` naming the first option ``--name`` below its lowest value in ``lows``."""
    for name, lo in lows.items():
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be at least {lo}, got {getattr(args, name)}")


def mlp_setup(rank: int, hidden: int, batch: int, steps: int):
    """digits-mlp's shape (``64 -> hidden -> 10``, ReLU) for the loop benchmarks: (a function
    building the model from seed 0 with SGD, lr 0.05, momentum 0.9; ``steps`` synthetic
    batches of ``batch`` samples drawn once, from this rank's own seed)."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(batch, 64, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
               for _ in range(steps)]

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    return model, batches


def loop_args(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The options of the user-loop benchmarks (``--methods``, lowbit algorithms, ``--rounds``,
    ``--warmup``, ``--steps``, ``--batch``, ``--hidden``), parsed and checked; ``doc`` the
    script's docstring (its first paragraph is the description)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--methods", default="allreduce,dpsgd", help="lowbit algorithms, comma-separated")
    ap.add_argument("--rounds", type=int, default=15, help="counted rounds (default 15)")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    ap.add_argument("--steps", type=int, default=50, help="steps of each loop per round (default 50)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden units (default 128: 9,610 parameters)")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    check_at_least(ap, args, {"rounds": 1, "warmup": 0, "steps": 1, "batch": 1, "hidden": 1})
    from lowbit.algorithms import ALGORITHMS

    unknown = [m for m in args.methods if m not in ALGORITHMS]
    if unknown or not args.methods:
        ap.error(f"--methods must name lowbit algorithms ({', '.join(ALGORITHMS)}), got {args.methods}")
    return args


def rotated_rounds(names: list[str], warmup: int, rounds: int, time_one) -> dict[str, list]:
    """``time_one(name)`` for every name in each of ``warmup + rounds`` rounds, the order rotating
    by one every round (a method is not always first after the barrier); the results of the last
    ``rounds`` rounds, per name."""
    times: dict[str, list] = {n: [] for n in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            t = time_one(name)
            if r >= warmup:
                times[name].append(t)
    return times
