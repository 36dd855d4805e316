"""Paper 004's experiments at this machine's scale: single-scale QSGDMaxNorm at
{8, 4, 2} bits and two-scale at {(8, 12), (6, 10), (4, 8), (2, 6)} bits against
AllReduce SGD and PowerSGD ranks 1 and 2 (sections 5.2-5.3), with training
loss and test accuracy curves and both bit counts.

digits-mlp (the embedded dataset; the paper trains ResNet-50 and VGG16 on
CIFAR-10), 8 workers, 300 steps with the paper's cosine-annealed step size,
momentum 0.9 (--quick: 4 workers, 30 steps).
"""

from __future__ import annotations

from pathlib import Path

from ..train import train
from ..train.config import TrainConfig
from .common import run_row, write_outputs

# (label, options)
ROWS = [("AllReduce SGD (fp32)", {"algorithm": "allreduce"})]
ROWS += [(f"QSGD-MN {b} bits", {"algorithm": "maxnorm", "bits": b}) for b in (8, 4, 2)]
ROWS += [(f"QSGD-MN-TS ({a}, {b}) bits", {"algorithm": "maxnorm-multiscale", "scales": f"{a},{b}"})
         for a, b in ((8, 12), (6, 10), (4, 8), (2, 6))]
ROWS += [(f"PowerSGD rank {r}", {"algorithm": "powersgd", "powersgd_rank": r}) for r in (1, 2)]


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""
    workers, steps, eval_every = (4, 30, 10) if quick else (8, 300, 25)
    base = {"task": "digits-mlp", "workers": workers, "steps": steps, "eval_every": eval_every,
            "lr_schedule": "cosine", "seed": 0}
    rows = []
    for label, opts in ROWS:
        rows.append(run_row(label, opts, train(TrainConfig(**base, **opts)), "final_train_loss",
                            "final_test_accuracy", "nominal_bits_per_element", "wire_bits_per_element",
                            "bytes_sent_per_step"))
    results = {"experiment": "maxnorm", "quick": quick, "settings": base, "rows": rows}
    write_outputs(
        out, results, "Paper 004: single- and two-scale max-norm quantizers against AllReduce and PowerSGD",
        [(["method", "train loss", "test accuracy", "nominal bits/element", "wire bits/element/step"],
          [[r["label"], r["final_train_loss"], r["final_test_accuracy"], r["nominal_bits_per_element"],
            r["wire_bits_per_element"]] for r in rows])],
        notes=f"digits-mlp, {workers} workers, {steps} steps, cosine step size from lr 0.1, momentum 0.9, seed 0. "
              "Nominal bits are the paper's count of code bits per element; wire bits are 8 x bytes a worker "
              "really sent per step / d, with the ring all-reduce of the codes packed in summable lanes "
              "(log2(2 M s + 1) bits a lane in int64 words), or of the narrowest integer dtype whose sum "
              "cannot overflow where that is smaller.")
    from ..plot import plot_series

    plot_series([(r["label"], r["steps"], r["train_loss"]) for r in rows], "step", "train loss",
                out / "train_loss.png", logy=True)
    plot_series([(r["label"], r["steps"], r["test_accuracy"]) for r in rows], "step", "test accuracy",
                out / "test_accuracy.png")
    return results
