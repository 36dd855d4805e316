"""Figure 1 of Moniqua (Lu & De Sa 2020): training loss against wall-clock time
under four networks (200 Mbps / 0.15 ms, 100 Mbps / 0.15 ms, 100 Mbps / 1 ms,
1 Mbps / 1 ms) for AllReduce, D-PSGD (both fp32), DCD-PSGD, ECD-PSGD,
ChocoSGD, DeepSqueeze and Moniqua (all at 8 bits).

The task is digits-mlp (scikit-learn digits, embedded) on 8 workers on a ring,
300 steps (--quick: 4 workers, 30 steps); image tasks are not used here. The
clock is lowbit's emulated one: each step's measured compute (thread CPU time,
the slowest worker) plus the network model's price of what the ledger records
for that step. What a run sends does not depend on the network model, so each
algorithm trains ONCE (under the first network) and its ledger is re-priced
under every network with the same clock ``lowbit train`` uses
(:func:`lowbit.train.summary.emulated_clock`); only the bandwidth and latency change.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ..comm.ledger import Ledger
from ..train.config import TrainConfig
from ..train.summary import emulated_clock
from .common import curves, train_quietly, write_outputs

# (label, bandwidth, latency), as in Figure 1's four panels
NETWORKS = [
    ("200 Mbps, 0.15 ms", "200Mbit", "0.15ms"),
    ("100 Mbps, 0.15 ms", "100Mbit", "0.15ms"),
    ("100 Mbps, 1 ms", "100Mbit", "1ms"),
    ("1 Mbps, 1 ms", "1Mbit", "1ms"),
]

BITS = 8
# (label, options); the quantized ones at BITS bits
ALGORITHMS = [
    ("AllReduce (fp32)", {"algorithm": "allreduce"}),
    ("D-PSGD (fp32)", {"algorithm": "dpsgd"}),
    ("DCD-PSGD 8 bits", {"algorithm": "dcd"}),
    ("ECD-PSGD 8 bits", {"algorithm": "ecd"}),
    ("ChocoSGD 8 bits", {"algorithm": "choco"}),
    ("DeepSqueeze 8 bits", {"algorithm": "deepsqueeze"}),
    ("Moniqua 8 bits", {"algorithm": "moniqua"}),
]


def settings(quick: bool) -> dict:
    """The experiment's configurations: the paper's scale, or the small ``quick`` one."""
    if quick:
        return {"task": "digits-mlp", "workers": 4, "topology": "ring", "steps": 30, "eval_every": 5, "seed": 0}
    return {"task": "digits-mlp", "workers": 8, "topology": "ring", "steps": 300, "eval_every": 25, "seed": 0}


def priced(cfg: TrainConfig, workers: list, bandwidth: str, latency: str) -> dict:
    """The clock of a finished run re-priced under another network model: per-step
    compute and communication seconds (``emulated_clock`` with only bandwidth/latency replaced)."""
    net_cfg = dataclasses.replace(cfg, bandwidth=bandwidth, latency=latency)
    ledgers = [Ledger.from_rows(r.rank, cfg.workers, r.ledger_rows) for r in workers]
    compute, comm = emulated_clock(net_cfg, workers, ledgers)
    return {"compute": compute, "comm": comm,
            "compute_seconds": math.fsum(compute), "comm_seconds": math.fsum(comm),
            "emulated_seconds": math.fsum(compute) + math.fsum(comm)}


def _slug(label: str) -> str:
    return label.replace(" Mbps, ", "mbps_").replace(" ms", "ms").replace(".", "p")


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""
    base = settings(quick)
    algos = []
    for label, opts in ALGORITHMS:
        cfg = TrainConfig(**base, **opts, bits=BITS, bandwidth=NETWORKS[0][1], latency=NETWORKS[0][2])
        r = train_quietly(cfg)
        s = r.summary
        evals = r.metrics
        per_net = {}
        for net_label, bw, lat in NETWORKS:
            p = priced(cfg, r.workers, bw, lat)
            step_total = [a + b for a, b in zip(p["compute"], p["comm"])]
            per_net[net_label] = {
                "emulated_seconds": p["emulated_seconds"], "compute_seconds": p["compute_seconds"],
                "comm_seconds": p["comm_seconds"],
                "seconds_at_eval": [math.fsum(step_total[: m["step"]]) for m in evals]}
        algos.append({"label": label, "options": opts, "final_train_loss": s["final_train_loss"],
                          "final_test_accuracy": s["final_test_accuracy"], "bytes_sent": s["bytes_sent"],
                          "wire_bits_per_element": s["wire_bits_per_element"],
                          "nominal_bits_per_element": s["nominal_bits_per_element"],
                          "algorithm_report": s["algorithm_report"],
                          **curves(evals, "train_loss"),
                          "networks": per_net})
    results = {"experiment": "moniqua-figure1", "quick": quick, "settings": {**base, "bits": BITS},
                   "networks": [{"label": n, "bandwidth": b, "latency": l} for n, b, l in NETWORKS],
                   "algorithms": algos}
    tables = [(["algorithm", "final train loss", "test accuracy", "wire bits/element/step",
                *[f"seconds, {n}" for n, _, _ in NETWORKS]],
               [[a["label"], a["final_train_loss"], a["final_test_accuracy"], a["wire_bits_per_element"],
                 *[a["networks"][n]["emulated_seconds"] for n, _, _ in NETWORKS]] for a in algos])]
    for n, _, _ in NETWORKS:
        tables.append(([f"{n}: algorithm", "final train loss", "emulated seconds to finish", "compute s",
                        "communication s"],
                       [[a["label"], a["final_train_loss"], a["networks"][n]["emulated_seconds"],
                         a["networks"][n]["compute_seconds"], a["networks"][n]["comm_seconds"]] for a in algos]))
    write_outputs(
        out, results, "Figure 1 of Moniqua: training loss against emulated wall-clock under four networks",
        tables,
        notes=f"Task {base['task']} only (scikit-learn digits, MLP; no image dataset or GPU used here), "
              f"{base['workers']} workers on a {base['topology']}, {base['steps']} steps, seed {base['seed']}, "
              f"task defaults for lr/momentum/batch; quantized algorithms at {BITS} bits with their default "
              f"codecs. Each algorithm trains once; its ledger (what each worker really sent each step) is "
              f"re-priced under each network by the network model of `lowbit train` (the clock of "
              f"lowbit.train.run). Emulated seconds = per step, the slowest worker's measured compute "
              f"(thread CPU time on this machine, the same for all four networks) plus the step's modelled "
              f"communication. The paper's Figure 1 trains ResNet-20 on CIFAR-10 on real hardware.")
    from ..plot import plot_series

    for n, _, _ in NETWORKS:
        plot_series([(a["label"], a["networks"][n]["seconds_at_eval"], a["train_loss"]) for a in algos],
                    "emulated seconds", "training loss", out / f"figure1_{_slug(n)}.png", logy=True,
                    title=f"{base['task']}, {base['workers']} workers ring, {n}")
    return results
