"""Figure 2 of Moniqua (Lu & De Sa 2020): Moniqua applied to D2 on decentralized
(one-label-per-worker) data, and to AD-PSGD under a slow network.

(a) D2 on non-iid data. The paper: 10 workers, each holding the samples of one
of CIFAR-10's 10 labels, VGG16; D-PSGD "can no longer converge because of the
outer variance" while Moniqua on D2 converges like D2. Here: digits-mlp
(scikit-learn digits, 10 classes, embedded) with ``--split label``, 10 workers
on a ring, D-PSGD, Moniqua (on D-PSGD), D2 and Moniqua on D2; training loss
and test accuracy of the average model against step. Setting (docs/RESULTS.md,
"Non-iid data: Moniqua on D2"): momentum 0 and weight decay 0 (D2 rejects
momentum), lr 0.5, Moniqua at 4 bits with theta 0.2 and slack gamma 0.5
(why not the paper's 2 bits, theta 0.05, lr 0.1: that section of docs/RESULTS.md).

(b) Asynchronous communication. The paper: 6 workers on a ring, ResNet-110 on
CIFAR-10, 20 Mbps and 0.15 ms, D-PSGD vs AD-PSGD vs asynchronous Moniqua,
training loss against wall-clock time. It names no slow worker, so none is
slowed here (``slow`` unset); the bit width is not named either, so 8 bits as
in the paper's wall-clock experiment (Figure 1), theta 0.2. Here: digits-mlp,
6 workers on a ring, iid data, task defaults (lr 0.1, momentum 0.9), network
model 20 Mbit / 0.15 ms. The clock is lowbit's emulated one
(:func:`lowbit.train.summary.step_clock`): measured compute and the network
model's price of what the ledger recorded. A synchronous run waits for the
slowest worker at every step, in compute and then in communication (D-PSGD:
its two ring messages on parallel links, one message time). An asynchronous
worker's step costs max(compute, round trip): AD-PSGD takes the gradient at
the model read before the exchange, so the exchange overlaps it; the round
trip is its request and then the partner's reply (two message times, the
reply cannot leave before the request has arrived); the run's clock is the
slowest worker's own. As in the paper, communication dominates (one fp32
model, 38 KB, takes 15 ms at 20 Mbps), so the overlap hides little and the
round trip of AD-PSGD costs about twice D-PSGD's one message time.

An asynchronous run evaluates only at its ends (no global barrier), so its
curve is made of runs of increasing length: each point is a complete run of N
steps per worker (its schedule, partner choices, data and rounding seeded per
(rank, step), as in the longer runs), at x = that run's emulated seconds, or a
shorter run's where that was longer (the compute of separate runs is measured
separately, so on a loaded machine a longer run can measure less).

Full scale: (a) 300 steps, evaluated every 25; (b) 300 steps, async runs every
25 steps. --quick: (a) 40 steps; (b) 30 steps in runs
of 10, 20, 30.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from ..algorithms import ALGORITHMS
from ..comm.ledger import Ledger
from ..train.config import TrainConfig
from ..train.summary import step_clock
from .common import curves, run_row, train_quietly, write_outputs
from .figure1 import priced

# ---- (a) D2 on one-label-per-worker data -----------------------------------
D2_BITS, D2_THETA, D2_GAMMA = 4, 0.2, 0.5
D2_ALGORITHMS = [
    ("D-PSGD (fp32)", {"algorithm": "dpsgd"}),
    (f"Moniqua {D2_BITS} bits", {"algorithm": "moniqua", "bits": D2_BITS, "theta": D2_THETA, "gamma": D2_GAMMA}),
    ("D2 (fp32)", {"algorithm": "d2"}),
    (f"Moniqua on D2 {D2_BITS} bits",
     {"algorithm": "moniqua-d2", "bits": D2_BITS, "theta": D2_THETA, "gamma": D2_GAMMA}),
]

# ---- (b) asynchronous, 20 Mbps ------------------------------------------------
BANDWIDTH, LATENCY = "20Mbit", "0.15ms"
ASYNC_BITS, ASYNC_THETA = 8, 0.2
ASYNC_ALGORITHMS = [
    ("D-PSGD (fp32)", {"algorithm": "dpsgd"}),
    ("AD-PSGD (fp32)", {"algorithm": "adpsgd"}),
    (f"Async Moniqua {ASYNC_BITS} bits", {"algorithm": "moniqua-async", "bits": ASYNC_BITS, "theta": ASYNC_THETA}),
]


def settings(quick: bool) -> dict:
    """The experiment's configurations: the paper's scale, or the small ``quick`` one."""
    if quick:
        d2 = {"steps": 40, "eval_every": 10}
        asyn = {"steps": 30, "eval_every": 10}
    else:
        d2 = {"steps": 300, "eval_every": 25}
        asyn = {"steps": 300, "eval_every": 25}
    return {
        "d2": {"task": "digits-mlp", "split": "label", "workers": 10, "topology": "ring", "lr": 0.5,
               "momentum": 0.0, "weight_decay": 0.0, "seed": 0, **d2},
        "async": {"task": "digits-mlp", "split": "iid", "workers": 6, "topology": "ring", "seed": 0,
                  "bandwidth": BANDWIDTH, "latency": LATENCY, **asyn},
    }


def seconds_to_loss(seconds: list[float], losses: list[float], target: float) -> float | None:
    """The first time a curve reaches ``target`` loss, linearly interpolated between
    its points (``seconds`` non-decreasing); None if it never does."""
    if len(seconds) != len(losses) or not seconds:
        raise ValueError(f"seconds and losses must be non-empty and of the same length, got {len(seconds)} "
                         f"and {len(losses)}")
    if not math.isfinite(target):
        raise ValueError(f"target must be a finite loss, got {target!r}")
    if any(b < a for a, b in itertools.pairwise(seconds)):
        raise ValueError("seconds must be non-decreasing")
    for i, (t, v) in enumerate(zip(seconds, losses)):
        if v <= target:
            if i == 0:
                return t
            t0, v0 = seconds[i - 1], losses[i - 1]
            return min(t, t0 + (t - t0) * (v0 - target) / (v0 - v))  # stays within [t0, t]
    return None


def _run_d2(base: dict) -> list[dict]:
    rows = []
    for label, opts in D2_ALGORITHMS:
        rows.append(run_row(label, opts, train_quietly(TrainConfig(**base, **opts)), "final_train_loss",
                            "final_test_accuracy", "final_local_test_accuracy", "bytes_sent",
                            "bytes_sent_per_step", "wire_bits_per_element", "algorithm_report"))
    return rows


def _network_seconds(cfg: TrainConfig, workers: list) -> float:
    """The modelled communication seconds on the run's clock, overlapped or not (the
    deterministic part: it depends on the ledger and the network model only)."""
    ledgers = [Ledger.from_rows(w.rank, cfg.workers, w.ledger_rows) for w in workers]
    return math.fsum(step_clock(cfg, workers, ledgers).comm)


def _summary_fields(s: dict) -> dict:
    return {"final_train_loss": s["final_train_loss"], "final_test_accuracy": s["final_test_accuracy"],
            "bytes_sent": s["bytes_sent"], "messages_sent": s["messages_sent"],
            "wire_bits_per_element": s["wire_bits_per_element"],
            "nominal_bits_per_element": s["nominal_bits_per_element"],
            "emulated_seconds": s["emulated_seconds"], "compute_seconds": s["emulated_compute_seconds"],
            "comm_seconds": s["emulated_comm_seconds"]}


def _run_async(base: dict) -> list[dict]:
    steps, every = base["steps"], base["eval_every"]
    rows = []
    for label, opts in ASYNC_ALGORITHMS:
        cfg = TrainConfig(**base, **opts)
        if ALGORITHMS[cfg.algorithm].synchronous:
            r = train_quietly(cfg)
            p = priced(cfg, r.workers, cfg.bandwidth, cfg.latency)  # the run's own network: its own clock
            step_total = [a + b for a, b in zip(p["compute"], p["comm"])]
            row = {"label": label, "options": opts, "synchronous": True, **_summary_fields(r.summary),
                   "network_seconds": p["comm_seconds"],  # synchronous: nothing overlaps, all of it is exposed
                   **curves(r.metrics, "train_loss"),
                   "seconds": [math.fsum(step_total[: m["step"]]) for m in r.metrics]}
        else:
            # evaluated only at its ends: one run per curve point, each N steps per worker
            ends = list(range(every, steps, every)) + [steps]
            cfgs = [TrainConfig(**{**base, "steps": n, "eval_every": n}, **opts) for n in ends]
            points = [train_quietly(c) for c in cfgs]
            last = points[-1]
            row = {"label": label, "options": opts, "synchronous": False, **_summary_fields(last.summary),
                   "network_seconds": _network_seconds(cfgs[-1], last.workers),
                   "steps": [0] + ends,
                   "train_loss": [last.metrics[0]["train_loss"]] + [p.summary["final_train_loss"] for p in points],
                   # a run of n steps is the first n steps of the longer runs (seeded per rank and step),
                   # so it cannot take longer than they do; their measured compute, taken separately on a
                   # loaded machine, can invert that order: each point is the longest time up to it
                   "seconds": [0.0, *itertools.accumulate((p.summary["emulated_seconds"] for p in points), max)]}
        rows.append(row)
    return rows


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""
    base = settings(quick)
    d2 = _run_d2(base["d2"])
    asyn = _run_async(base["async"])
    # the time each curve of (b) first reaches the highest final loss among them (a loss all reach)
    target = max(a["final_train_loss"] for a in asyn)
    for a in asyn:
        a["seconds_to_target"] = seconds_to_loss(a["seconds"], a["train_loss"], target)
    results = {"experiment": "moniqua-figure2", "quick": quick,
               "settings": {"d2": {**base["d2"], "bits": D2_BITS, "theta": D2_THETA, "gamma": D2_GAMMA},
                            "async": {**base["async"], "bits": ASYNC_BITS, "theta": ASYNC_THETA}},
               "d2": d2, "async": asyn, "async_target_loss": target}
    sa, sb = base["d2"], base["async"]
    tables = [
        (["(a) one label per worker: algorithm", "final train loss", "test acc (average model)",
          "test acc (local, mean)", "bytes/step", "wire bits/element/step"],
         [[r["label"], r["final_train_loss"], r["final_test_accuracy"], r["final_local_test_accuracy"],
           r["bytes_sent_per_step"], r["wire_bits_per_element"]] for r in d2]),
        (["(b) 20 Mbps, 0.15 ms: algorithm", "final train loss", "test acc", "emulated seconds",
          "compute s", "communication s (not overlapped)", "network s (modelled)",
          f"seconds to loss {target:.3g}", "bytes sent", "messages"],
         [[a["label"], a["final_train_loss"], a["final_test_accuracy"], a["emulated_seconds"],
           a["compute_seconds"], a["comm_seconds"], a["network_seconds"], a["seconds_to_target"],
           a["bytes_sent"], a["messages_sent"]]
          for a in asyn]),
    ]
    write_outputs(
        out, results, "Figure 2 of Moniqua: Moniqua on D2 (non-iid data) and on AD-PSGD (20 Mbps)", tables,
        notes=f"(a) {sa['task']} with split={sa['split']} (worker i holds the samples of digit i), "
              f"{sa['workers']} workers on a {sa['topology']}, {sa['steps']} steps, lr {sa['lr']}, momentum 0, "
              f"weight decay 0, seed {sa['seed']}; Moniqua at {D2_BITS} bits, theta {D2_THETA}, gamma {D2_GAMMA}. "
              f"The paper's 2 bits / theta 0.05 / lr 0.1 do not work at this scale (docs/RESULTS.md). "
              f"(b) {sb['task']}, iid split, {sb['workers']} workers on a {sb['topology']}, {sb['steps']} steps, "
              f"task defaults (lr 0.1, momentum 0.9), network model {BANDWIDTH} / {LATENCY}, no slow worker "
              f"(the paper names none); async Moniqua at {ASYNC_BITS} bits, theta {ASYNC_THETA}. Emulated "
              f"seconds: measured compute (thread CPU time) and the modelled communication of what the "
              f"ledger recorded; a synchronous run waits for the slowest worker each step, in compute and "
              f"then in communication; an asynchronous worker's step costs max(compute, round trip of its "
              f"request and the partner's reply), the gradient overlapping the exchange, and the run's clock "
              f"is its slowest worker's own. 'communication s' is the part not hidden behind compute, "
              f"'network s' all of it. Async curve "
              f"points are separate runs of {sb['eval_every']}, {2 * sb['eval_every']}, ... steps. The paper "
              f"trains VGG16 (a) and ResNet-110 (b) on CIFAR-10 on real machines.")
    from ..plot import plot_series

    plot_series([(r["label"], r["steps"], r["train_loss"]) for r in d2], "step",
                "training loss (average model)", out / "figure2a_train_loss.png", logy=True,
                title=f"(a) {sa['task']}, one label per worker, {sa['workers']} workers ring")
    plot_series([(r["label"], r["steps"], r["test_accuracy"]) for r in d2], "step",
                "test accuracy (average model)", out / "figure2a_test_accuracy.png",
                title=f"(a) {sa['task']}, one label per worker, {sa['workers']} workers ring")
    plot_series([(a["label"], a["seconds"], a["train_loss"]) for a in asyn], "emulated seconds",
                "training loss (average model)", out / "figure2b_train_loss_vs_time.png", logy=True,
                title=f"(b) {sb['task']}, {sb['workers']} workers ring, 20 Mbps, 0.15 ms")
    return results
