"""``lowbit repro NAME --out DIR [--quick]``: the papers' experiments, one command each.

Each experiment is one module of this package with a ``run(out, quick)``
function that writes ``out/results.json`` (raw numbers), ``out/table.md``
(a markdown table) and PNG plots, and returns the results dict. The registry
below maps a name to its module; modules are imported only when run, so
adding an experiment is one module plus one line here.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# name -> (module in this package, one-line description)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "moniqua-theorem1": ("theorem1", "naive quantized gossip vs Moniqua on the quadratic, with Theorem 1's floor"),
    "maxnorm": ("maxnorm", ("paper 004: single-scale {8,4,2} and two-scale {(8,12),(6,10),(4,8),(2,6)} bits "
                            "against AllReduce and PowerSGD ranks 1 and 2, on digits-mlp")),
    "moniqua-figure1": ("figure1", ("training loss against emulated wall-clock under Figure 1's four networks, "
                        "fp32 and 8-bit algorithms")),
    "moniqua-figure2": ("figure2", "Moniqua on D2 (one label per worker) and async Moniqua vs AD-PSGD at 20 Mbps"),
    "moniqua-table2": ("table2", "test accuracy (mean/std over seeds) at 1 and 2 bits and extra memory, fashion-lenet"),
    "ndqsg-tables": ("ndqsg", "paper 002: raw/entropy-coded Kbits (Tables 1-2, 32 workers), accuracy, Figure 6"),
    "train-tables": ("tables", ("the `lowbit train` tables of docs/RESULTS.md (decentralized and centralized "
                                "digits-mlp, fashion-lenet, Moniqua's issue-11 targets) from their OPTIONS rows")),
    "throughput-model": ("throughput", ("paper 004's performance model (Wen et al. 2017): 32 nodes x 4 GPUs, "
                         "1 and 10 Gbps, ResNet-50 and VGG-16")),
}


def names() -> list[str]:
    """The experiment names ``lowbit repro`` takes."""
    return list(EXPERIMENTS)


def run_experiment(name: str, out: str | Path, quick: bool = False) -> dict:
    """Run experiment ``name`` and write its files into ``out`` (created if missing)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment {name!r} is unknown; choose one of: {', '.join(EXPERIMENTS)}")
    module = importlib.import_module(f"{__name__}.{EXPERIMENTS[name][0]}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return module.run(out, quick=quick)
