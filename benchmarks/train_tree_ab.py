"""What a change costs ``lowbit train`` end to end: the same run in the tree before the change
and the tree after it, side by side.

Run (from the repository root; the "before" tree is a worktree of the commit to compare with)::

    git worktree add /tmp/before cc9a8bd
    python benchmarks/train_tree_ab.py --before /tmp/before                      # dpsgd, moniqua, allreduce, choco
    python benchmarks/train_tree_ab.py --before /tmp/before --algorithms dpsgd --rounds 9 --steps 300
    python benchmarks/train_tree_ab.py --before /tmp/before --after /tmp/before    # A/A: the method's error
    python benchmarks/train_tree_ab.py --before /tmp/before --clock cpu            # CPU seconds, not wall

Method. Each run is one whole :func:`lowbit.train.train` (digits-mlp, the thread backend,
``--workers`` workers, ``--steps`` steps, seed 0, no evaluation until the end) in a fresh
subprocess whose ``sys.path`` puts its tree first (it checks ``lowbit.__file__`` is inside
it), with ``OMP_NUM_THREADS=1`` and ``NUMBA_NUM_THREADS=1``. The two trees alternate within
each round, the first one swapping every round, after one uncounted warm-up run each (numba's
cache and the file cache fill); the figure is the median over rounds of the
per-round ratio after/before, which the machine's other load moves less than either time.
``--clock cpu`` times the run by the process's CPU seconds (every thread's), not the wall clock:
the work the run does, without the time it waits for a core, for a machine whose other load is
too heavy for wall times to compare (its threads wait at barriers without spinning).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN = r"""
import json, sys, time
import lowbit
clock = time.process_time if sys.argv[5] == "cpu" else time.perf_counter
from lowbit.train import TrainConfig, train
if not lowbit.__file__.startswith(sys.argv[2]):
    raise SystemExit(f"imported lowbit from {lowbit.__file__}, not from {sys.argv[2]}")
cfg = TrainConfig(task="digits-mlp", backend="thread", workers=int(sys.argv[3]), steps=int(sys.argv[4]), seed=0,
                  algorithm=sys.argv[1], eval_every=int(sys.argv[4]) + 1)
t = clock()
train(cfg)
print(json.dumps(clock() - t))
"""


def run_once(tree: str, algorithm: str, workers: int, steps: int, clock: str = "wall") -> float:
    """Seconds (wall, or CPU with ``clock="cpu"``) of one whole ``train()`` of ``algorithm`` with
    ``tree``'s lowbit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": tree}
    proc = subprocess.run([sys.executable, "-c", RUN, algorithm, tree, str(workers), str(steps), clock], env=env,
                          capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"the run of {algorithm} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(before: str, after: str, algorithm: str, rounds: int, workers: int, steps: int,
            clock: str = "wall") -> dict:
    """Per round, both trees' times (their order alternating) and the ratio after/before."""
    trees = {"before": before, "after": after}
    times: dict[str, list[float]] = {"before": [], "after": []}
    ratios = []
    for tree in trees.values():  # a warm-up run each, not counted: numba's cache and the OS's file cache fill
        run_once(tree, algorithm, workers, steps, clock)
    for r in range(rounds):
        got = {}
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            got[name] = run_once(trees[name], algorithm, workers, steps, clock)
            times[name].append(got[name])
        ratios.append(got["after"] / got["before"])
    return {"algorithm": algorithm, "before_s": statistics.median(times["before"]),
            "after_s": statistics.median(times["after"]), "ratio": statistics.median(ratios), "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", required=True, help="the tree before the change (a git worktree)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]), help="the tree after (default: this one)")
    ap.add_argument("--algorithms", default="dpsgd,moniqua,allreduce,choco", help="comma-separated lowbit train names")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each running both trees once (default 5)")
    ap.add_argument("--workers", type=int, default=4, help="thread workers (default 4)")
    ap.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall seconds (default) or the process's CPU seconds")
    args = ap.parse_args(argv)
    for name, lo in (("rounds", 1), ("workers", 2), ("steps", 1)):
        if getattr(args, name) < lo:
            ap.error(f"--{name} must be at least {lo}, got {getattr(args, name)}")
    for algorithm in args.algorithms.split(","):
        r = compare(os.path.abspath(args.before), os.path.abspath(args.after), algorithm, args.rounds, args.workers,
                    args.steps, args.clock)
        print(f"{algorithm:10s} before {r['before_s']:.3f} s  after {r['after_s']:.3f} s  "
              f"after/before {r['ratio']:.3f}  (per round {[round(x, 3) for x in r['ratios']]})", flush=True)


if __name__ == "__main__":
    main()
