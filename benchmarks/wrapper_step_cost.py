"""The fixed per-step cost of :class:`~lowbit.integrations.DecentralizedDataParallel`: a step through
the wrapper (``optimizer.step()`` and its hooks) against the same step driving the algorithm
directly, as ``lowbit train`` did before it ran on the wrapper (commit cc9a8bd's loop body).

Run (from the repository root; ``PYTHONPATH=TREE`` measures another tree's lowbit)::

    python benchmarks/wrapper_step_cost.py                        # dpsgd and allreduce
    PYTHONPATH=/tmp/before python benchmarks/wrapper_step_cost.py --algorithms dpsgd --rounds 41
    python benchmarks/wrapper_step_cost.py --workers 4              # as lowbit train's thread runtime

Method. One thread worker (``run_threads``, one torch thread; ``--workers`` more, rank 0's
figures), digits-mlp's model shape
(64 -> 128 -> 10, SGD with momentum, a fixed batch of 32), ``overlap=False`` and no initial
broadcast, as ``lowbit train`` runs the wrapper. Per round, ``--steps`` steps of each way (their
order alternating), timed by the thread's CPU clock (``time.thread_time``: the work, not the
waiting for a core); the figure is the median over rounds of the per-round difference
wrapper - direct, in microseconds per step. One worker: the algorithm's communication is trivial,
so the difference is the wrapper's own work (the hooks, the step bookkeeping, ``stats()``, the
backward-pass count); in ``lowbit train``'s thread runtime the workers' Python shares one
interpreter lock, so a step of n workers pays about n times it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def measure(algorithm: str, steps: int, rounds: int, workers: int = 1) -> tuple[float, float, float]:
    """(median wrapper step, median direct step, median per-round difference), microseconds."""
    from lowbit.algorithms import build_worker
    from lowbit.comm import run_threads
    from lowbit.integrations import DecentralizedDataParallel, FlatParams

    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def body(t):
        m = net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        ddp = DecentralizedDataParallel(m, opt, algorithm, transport=t, overlap=False, sync_initial=False)

        def wrapper():
            for _ in range(steps):
                ddp.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()

        m2 = net()
        flat = FlatParams(m2)
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        algo = build_worker(algorithm, t, None)
        algo.setup(flat.data)
        guard, at = algo.guard, [0]

        def direct():  # cc9a8bd's lowbit train step, without its timing and evaluation
            for _ in range(steps):
                k = at[0]
                t.set_step(k)
                for group in opt2.param_groups:
                    group["lr"] = 0.1
                flat.zero_grad()
                loss = nn.functional.cross_entropy(m2(x), y)
                guard.note(k, "training loss", loss.detach())
                loss.backward()
                guard.note(k, "gradient", flat.grad)
                guard.note(k, "model", flat.data)
                if algo.agrees_before_update:
                    guard.agree(k, 0, flat.data.device)
                algo.before_update(k, flat.data, flat.grad, 0.1)
                opt2.step()
                if algo.acts_after_update:
                    guard.note(k, "model", flat.data)
                    guard.agree(k, 1, flat.data.device)
                algo.after_update(k, flat.data, flat.grad, 0.1)
                at[0] += 1

        wrapper()
        direct()
        times: dict[str, list[float]] = {"wrapper": [], "direct": []}
        for r in range(rounds):
            for name, fn in ((("wrapper", wrapper), ("direct", direct)) if r % 2 else
                             (("direct", direct), ("wrapper", wrapper))):
                c = time.thread_time()
                fn()
                times[name].append((time.thread_time() - c) / steps * 1e6)
        ddp.close()
        return times

    times = run_threads(workers, body)[0]
    diffs = [a - b for a, b in zip(times["wrapper"], times["direct"])]
    return statistics.median(times["wrapper"]), statistics.median(times["direct"]), statistics.median(diffs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithms", default="dpsgd,allreduce", help="comma-separated (default dpsgd,allreduce)")
    ap.add_argument("--steps", type=int, default=200, help="steps of each way per round (default 200)")
    ap.add_argument("--rounds", type=int, default=21, help="rounds (default 21)")
    ap.add_argument("--workers", type=int, default=1, help="thread workers (default 1)")
    args = ap.parse_args(argv)
    for name in ("steps", "rounds", "workers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    import lowbit

    print(f"lowbit from {lowbit.__file__}")
    for algorithm in args.algorithms.split(","):
        w, d, diff = measure(algorithm, args.steps, args.rounds, args.workers)
        print(f"{algorithm:10s} wrapper {w:8.1f} us/step  direct {d:8.1f} us/step  wrapper - direct {diff:7.1f} us/step",
              flush=True)


if __name__ == "__main__":
    main()
