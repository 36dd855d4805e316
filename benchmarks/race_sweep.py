"""One race contender's options across seeds: ``lowbit bench race`` on one network for one
method, once per (option value, seed), printing each run's steps to the target, final accuracy
and, where it failed, why (a divergence names its step). For the stability of a method's
setting, which one seed of the full race does not show.

    python benchmarks/race_sweep.py --method choco --option gamma --values 0.25,0.5,1.0 --seeds 0,1,2

Everything else is the full race's (``lowbit.bench.race.FULL``: fashion-lenet-tf, 4 gloo
processes, batch 32, 150 steps, target 0.80) unless ``--lr`` or ``--quick`` says otherwise.
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    from lowbit.bench import race

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", required=True, choices=sorted(race.METHODS))
    p.add_argument("--option", required=True, help="an option of the method's algorithm or hook, e.g. gamma")
    p.add_argument("--values", required=True, help="comma-separated values of --option (integers or numbers)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--network", default="loopback", choices=sorted(race.NETWORKS))
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="write every run's row there")
    a = p.parse_args(argv)
    values = [int(v) if v.strip().lstrip("-").isdigit() else float(v) for v in a.values.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    method = race.METHODS[a.method]
    base = dict(method.options)
    rows = []
    for v in values:
        for seed in seeds:
            method.options.clear()
            method.options.update(base, **{a.option: v})
            rep = race.bench_race(networks=[a.network], methods=[a.method], seed=seed, lr=a.lr, quick=a.quick,
                                  progress=None)
            r = rep["networks"][a.network][a.method]
            row = {a.option: v, "seed": seed, "steps_to_target": r.get("steps_to_target"),
                   "final_accuracy": r.get("final_accuracy"), "failed": r.get("failed"),
                   "curve": [c["accuracy"] for c in r.get("curve") or []]}
            rows.append(row)
            print(f"{a.option}={v} seed {seed}: steps to target {row['steps_to_target']}, final accuracy "
                  f"{row['final_accuracy']}" + (f", failed: {row['failed']}" if row["failed"] else ""), flush=True)
    method.options.clear()
    method.options.update(base)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"method": a.method, "network": a.network, "lr": a.lr, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
