"""What the papers' quantization costs the QSGD, QSGDMaxNorm and TernGrad DDP hooks per call
(issue 29): each hook as ``make_hook`` now builds it (QSGD and QSGDMaxNorm with one norm per
bucket of 512 coordinates, TernGrad per layer with clipping at 2.5 standard deviations) beside
the same hook as before (``bucket=None``; ``clip=None, per_layer=False``: one norm or scale for
the whole DDP bucket), on one bucket holding the gradients of paper 002's LeNet (1,663,370
elements in its 8 parameters, the layout DDP gives one bucket), in a one-process gloo group on
the CPU with one thread.

Each call refills the bucket with the same gradient and runs the hook to its result
(``hook(state, bucket).wait()``, as ``lowbit bench hooks``); rounds interleave all
contenders; the figure per hook is the median over rounds of the per-round ratio after/before
(:func:`lowbit.bench.timing.median_ratio`), with the smallest and largest round's ratio.

Run: ``OMP_NUM_THREADS=1 python benchmarks/hook_bucketing.py [--rounds 7]``.
"""

import argparse
import statistics

import torch
import torch.distributed as dist

from lowbit.bench.hooks import GradBucketStandIn
from lowbit.bench.timing import measure, median_ratio, spread
from lowbit.integrations.ddp_hooks import make_hook
from lowbit.models import lenet_tf

CASES = {  # hook: (make_hook options now, the same hook as before)
    "qsgd": ({"bits": 4}, {"bits": 4, "bucket": None}),
    "qsgd-maxnorm": ({"bits": 4}, {"bits": 4, "bucket": None}),
    "terngrad": ({}, {"clip": None, "per_layer": False}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-run-time", type=float, default=0.2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = lenet_tf()
    n = sum(p.numel() for p in model.parameters())
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.01
    bucket = GradBucketStandIn(model.parameters(), g)

    def call(hook, state):
        bucket.refill()
        return hook(state, bucket).wait()

    calls = {"refill": bucket.refill}
    for name, (now, before) in CASES.items():
        for tag, opts in (("now", now), ("before", before)):
            state, hook = make_hook(name, seed=1, **opts)
            call(hook, state)
            calls[f"{name} {tag}"] = lambda h=hook, s=state: call(h, s)
    rounds = []
    for _ in range(args.rounds):
        t = {k: measure(f, torch.device("cpu"), args.min_run_time, 1, "wall") for k, f in calls.items()}
        rounds.append({k: (v - t["refill"] if k != "refill" else v) for k, v in t.items()})
    dist.destroy_process_group()
    print(f"one bucket of {n} elements (LeNet's {len(bucket.params)} parameters), one thread, {args.rounds} rounds")
    for name in CASES:
        now, before = f"{name} now", f"{name} before"
        lo, hi = spread(rounds, now, before)
        print(f"{name:13s} now {1e3 * statistics.median(r[now] for r in rounds):7.2f} ms  before "
              f"{1e3 * statistics.median(r[before] for r in rounds):7.2f} ms  now/before "
              f"{median_ratio(rounds, now, before):.3f} (rounds {lo:.3f}..{hi:.3f})")


if __name__ == "__main__":
    main()
