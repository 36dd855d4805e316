"""How noisy ``lowbit plan``'s calibration is where nothing separates the methods: ``--plans``
plans of a 195-parameter MLP (2 processes, 100 Mbit/s and 1000 Tbit/s, the arguments of
``tests/test_plan.py::test_plan_report_schema_and_cli``) and, at 1000 Tbit/s, where every method's
step is its compute plus a millisecond of rounds, each plan's recommendation and largest speedup
over DDP fp32 (noise: the methods' rounds differ by a few hundred bytes). ``--samples`` first
prints the raw replayed seconds of one small all-reduce round (the fraction above 2 ms).

    python benchmarks/plan_noise.py --plans 10 --samples 20
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

MODEL = '''
import torch
import torch.nn.functional as F


def build(batch_size=4):
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return m, (torch.randn(batch_size, 8), torch.randint(3, (batch_size,))), \\
        lambda model, b: F.cross_entropy(model(b[0]), b[1])
'''


class _Samples:  # the calibration worker's statistics, keeping every sample instead of a median
    median = staticmethod(list)


def raw_worker(transport, spec):
    import lowbit.plan.rounds as rounds

    rounds.statistics = _Samples
    return rounds._calibration_worker(transport, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", type=int, default=10)
    p.add_argument("--samples", type=int, default=0, help="raw samples of one round first (0: skip)")
    a = p.parse_args()
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "plan_noise_mod.py"), "w") as f:
        f.write(MODEL)
    sys.path.insert(0, d)
    os.environ["PYTHONPATH"] = d + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["OMP_NUM_THREADS"] = "1"
    if a.samples:
        from lowbit.comm import launch

        spec = {"workload": {"model": "plan_noise_mod:build"}, "sequences": [[("torch_all_reduce", 780, 1)]],
                "work": [0.0], "repeats": a.samples, "warmup": 2, "ping_samples": 50, "budget_seconds": 0.0,
                "max_repeats": a.samples}
        for rank, r in enumerate(launch(2, raw_worker, spec)):
            ms = [x * 1e3 for x in r["rounds"][0][0]]
            print(f"rank {rank}: 780-byte all-reduce ms {' '.join(f'{x:.2f}' for x in ms)}; "
                  f"above 2 ms: {sum(x > 2 for x in ms)} of {len(ms)}")
    from lowbit.cli import main as lowbit

    tops = []
    for i in range(a.plans):
        out = os.path.join(d, "plan.json")
        with contextlib.redirect_stdout(io.StringIO()):
            lowbit(["plan", "--model", "plan_noise_mod:build", "--workers", "2,8", "--bandwidth", "100Mbit,1000Tbit",
                    "--latency", "0s", "--repeats", "2", "--warmup", "1", "--threads", "1", "--json", out,
                    "--min-speedup", "1", "--processes", "2"])
        rows = [s for s in json.load(open(out))["settings"] if s["bandwidth"] == "1000Tbit"]
        best = max((v["speedup"], m) for s in rows for m, v in s["methods"].items())
        tops.append(best[0])
        print(f"plan {i}: at 1000Tbit the largest speedup over DDP fp32 {best[0]:.2f}x ({best[1]})", flush=True)
    print(f"largest of {len(tops)} plans: {max(tops):.2f}x")


if __name__ == "__main__":
    main()
