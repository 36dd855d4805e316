"""Table 2 of Moniqua (Lu & De Sa 2020): final test accuracy (mean and standard
deviation over seeds) of DCD-PSGD, ECD-PSGD, ChocoSGD, DeepSqueeze and Moniqua
at a budget of 1 and 2 bits per parameter, with fp32 D-PSGD and AllReduce as
references, and the extra memory each algorithm keeps beyond D-PSGD (Table 1's
Theta(m d) / Theta(n d) / 0, in MB per worker).

Scale (this machine: 2 shared CPU cores, no GPU). Full: ``fashion-lenet``
(LeNet-5 on Fashion-MNIST, read from Debian's ``dataset-fashion-mnist`` or
``LOWBIT_DATA``), 8 workers on a ring, 100 steps of batch 32 per worker (task
defaults: lr 0.05, momentum 0.9, weight decay 1e-4), seeds 0, 1, 2, evaluated
at step 0 and at the end only (an evaluation of 8 LeNet workers costs as much
CPU as ~100 training steps); 12 configurations x 3 seeds = 36 runs. --quick:
``digits-mlp`` (embedded), 4 workers on a ring (also degree 2), 30 steps,
seeds 0 and 1. Where a GPU is visible and CIFAR-10 is on disk, the full run
trains the paper's ``cifar10-resnet20`` instead: 8 workers on a ring, 2,000
steps of batch 32 per worker (10 epochs), seeds 0-2 (the workers run on
the GPU: ``TrainConfig.device`` auto). The paper trains ResNet-20 / ResNet-110 on CIFAR-10 for full
training runs; its numbers are kept in :data:`PAPER` and printed beside ours.

How a bit budget is met (:func:`budget_options`): Moniqua with ``--bits b``
and its defaults (at 1 bit the slack matrix gamma W + (1 - gamma) I and the
shared subtractive dither). The baselines at 1 bit: the scaled sign codec
(one bit per element and one fp32 scale, the 1-bit compressor of the CHOCO
and DeepSqueeze papers) for DCD, ChocoSGD and DeepSqueeze; ECD needs an
unbiased codec and takes the 1-bit min-max quantizer with stochastic
rounding. At 2 bits: the min-max quantizer with stochastic rounding for all,
and a consensus step of 0.1 for ChocoSGD and DeepSqueeze (why these and not
the library defaults: docs/RESULTS.md, Table 2 of Moniqua). A configuration
the run config rejects is reported with the reason instead of a number.

Divergence: a seed's run diverged when its final training loss (of the
averaged model) is not finite or is larger than the untrained model's (step
0), or when training stopped because the model left the float range (a
codec refuses non-finite values: ValueError); such a run has no accuracy,
and its extra memory is measured by :func:`probe_extra_memory`.
The accuracy of a run that diverged without stopping is reported as measured,
and the row says in how many seeds it diverged.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch

from ..comm.inprocess import run_threads
from ..data import find_dataset_dir
from ..integrations import FlatParams
from ..train.config import TrainConfig
from ..train.errors import Diverged
from ..train.loop import build_algorithm
from ..train.tasks import TASKS
from .common import curves, fmt, train_quietly, write_outputs

MB = 1_000_000  # bytes per MB in the extra-memory column

# (key, label, options, bit budget or None for fp32)
CONFIGS: list[tuple[str, str, dict, int | None]] = [
    ("allreduce", "AllReduce (fp32)", {"algorithm": "allreduce"}, None),
    ("dpsgd", "D-PSGD (fp32)", {"algorithm": "dpsgd"}, None),
]


def budget_options(alg: str, bits: int) -> dict:
    """How each algorithm meets a budget of ``bits`` per parameter (see the module docstring)."""
    opts = {"algorithm": alg, "bits": bits}
    if alg == "moniqua":
        return opts
    if bits == 1 and alg != "ecd":
        return {**opts, "codec": "sign"}  # 1 bit and one scale: the compressor of the baselines' papers
    opts["rounding"] = "stochastic"  # ECD needs an unbiased codec; all min-max runs use the same rounding
    if bits == 2 and alg in ("choco", "deepsqueeze"):
        opts["gamma"] = 0.1  # at their default 0.5 both left the float range in 100 steps at 2 bits
    return opts


CONFIGS += [(f"{alg}-{b}bit", f"{name} {b} bit", budget_options(alg, b), b)
            for b in (1, 2)
            for alg, name in (("dcd", "DCD-PSGD"), ("ecd", "ECD-PSGD"), ("choco", "ChocoSGD"),
                              ("deepsqueeze", "DeepSqueeze"), ("moniqua", "Moniqua"))]

# Table 2 of the paper (CIFAR-10), "diverge" as printed; accuracy in %, (mean, std)
PAPER = {
    "ResNet-20": {
        "dcd-1bit": "diverge", "ecd-1bit": "diverge", "choco-1bit": (90.88, 0.13),
        "deepsqueeze-1bit": (90.02, 0.22), "moniqua-1bit": (91.08, 0.19),
        "dcd-2bit": "diverge", "ecd-2bit": (36.32, 2.46), "choco-2bit": (91.09, 0.09),
        "deepsqueeze-2bit": (91.12, 0.11), "moniqua-2bit": (91.13, 0.12),
        "extra_memory_mb": {"dcd": 16.48, "ecd": 16.48, "choco": 16.48, "deepsqueeze": 8.24, "moniqua": 0.0},
    },
    "ResNet-110": {
        "dcd-1bit": "diverge", "ecd-1bit": "diverge", "choco-1bit": (91.24, 0.21),
        "deepsqueeze-1bit": (91.80, 0.27), "moniqua-1bit": (92.97, 0.23),
        "dcd-2bit": "diverge", "ecd-2bit": "diverge", "choco-2bit": (93.43, 0.12),
        "deepsqueeze-2bit": (92.96, 0.17), "moniqua-2bit": (93.47, 0.18),
        "extra_memory_mb": {"dcd": 103.68, "ecd": 103.68, "choco": 103.68, "deepsqueeze": 51.84, "moniqua": 0.0},
    },
}


def _cifar_on_gpu() -> bool:
    """A GPU is visible and CIFAR-10 is on disk (``LOWBIT_DATA`` or the download cache)."""
    if not torch.cuda.is_available():
        return False
    try:
        find_dataset_dir("cifar10")
    except FileNotFoundError:
        return False
    return True


def settings(quick: bool) -> dict:
    """The experiment's configurations: the paper's scale, or the small ``quick`` one."""
    if quick:
        return {"task": "digits-mlp", "workers": 4, "topology": "ring", "steps": 30, "eval_every": 10,
                "seeds": [0, 1]}
    if _cifar_on_gpu():  # the paper's setting, shortened: 2,000 steps of batch 32 per worker (10 epochs)
        return {"task": "cifar10-resnet20", "workers": 8, "topology": "ring", "steps": 2000, "eval_every": 500,
                "seeds": [0, 1, 2]}
    return {"task": "fashion-lenet", "workers": 8, "topology": "ring", "steps": 100, "eval_every": 100,
            "seeds": [0, 1, 2]}


def is_diverged(initial_loss: float, final_loss: float) -> bool:
    """Non-finite final loss, or a final loss above the untrained model's."""
    return not math.isfinite(final_loss) or final_loss > initial_loss


def _stopped_by_blowup(err: ValueError) -> bool:
    """The codecs' refusals of a model that left the float range (min-max: non-finite
    values or a range beyond the float32 header)."""
    msg = str(err)
    return "finite" in msg or "float32 header" in msg


def probe_extra_memory(cfg: TrainConfig) -> int:
    """The extra memory of ``cfg``'s algorithm without training (for a run that stopped
    before its summary): every worker builds the algorithm as the training loop does and
    runs its ``setup`` on the task's initial model; the largest ``extra_memory_bytes()``."""
    task = TASKS[cfg.task].from_config(cfg)
    torch.manual_seed(cfg.seed)
    x0 = FlatParams(task.make_model()).data.detach().clone()

    def probe(transport) -> int:
        algo = build_algorithm(cfg, transport)
        algo.setup(x0.clone())
        return algo.extra_memory_bytes()

    return max(run_threads(cfg.workers, probe))


def run_seed(cfg: TrainConfig) -> dict:
    """One training run, as a per-seed record of results.json."""
    t0 = time.perf_counter()
    try:
        r = train_quietly(cfg)
    except (ValueError, Diverged) as e:
        if not (isinstance(e, Diverged) or _stopped_by_blowup(e)):
            raise
        return {"seed": cfg.seed, "final_test_accuracy": None, "final_train_loss": None,
                "initial_train_loss": None, "diverged": True, "stopped": f"training stopped: {e}",
                "extra_memory_bytes": probe_extra_memory(cfg), "wall_seconds": time.perf_counter() - t0}
    s = r.summary
    initial, final = r.metrics[0]["train_loss"], s["final_train_loss"]
    return {"seed": cfg.seed, "final_test_accuracy": s["final_test_accuracy"], "final_train_loss": final,
            "initial_train_loss": initial, "diverged": is_diverged(initial, final), "stopped": None,
            "extra_memory_bytes": s["extra_memory_bytes"], "parameters": s["parameters"],
            "nominal_bits_per_element": s["nominal_bits_per_element"],
            "wire_bits_per_element": s["wire_bits_per_element"], "algorithm_report": s["algorithm_report"],
            **curves(r.metrics, "test_accuracy", "train_loss"), "wall_seconds": s["wall_seconds"]}


def aggregate(per_seed: list[dict]) -> dict:
    """Mean and sample standard deviation (n - 1) of the seeds' final test accuracy
    (over the seeds that have one), how many seeds diverged, the extra memory."""
    accs = [p["final_test_accuracy"] for p in per_seed if p["final_test_accuracy"] is not None
            and math.isfinite(p["final_test_accuracy"])]
    mem = {p["extra_memory_bytes"] for p in per_seed if "extra_memory_bytes" in p}
    if len(mem) > 1:
        raise ValueError(f"extra memory differs between seeds: {sorted(mem)}")
    mem_bytes = mem.pop() if mem else None
    return {"accuracy_mean": statistics.fmean(accs) if accs else None,
            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else None,
            "seeds_with_accuracy": len(accs),
            "diverged_seeds": sum(p["diverged"] for p in per_seed),
            "extra_memory_bytes": mem_bytes,
            "extra_memory_mb": None if mem_bytes is None else mem_bytes / MB}


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _accuracy_cell(row: dict) -> str:
    if row.get("not_runnable"):
        return "cannot run"
    a = row["aggregate"]
    if a["accuracy_mean"] is None:
        return "no accuracy"
    std = "" if a["accuracy_std"] is None else f" ± {_pct(a['accuracy_std'])}"
    return f"{_pct(a['accuracy_mean'])}{std} %"


def _diverged_cell(row: dict) -> str:
    if row.get("not_runnable"):
        return row["not_runnable"]
    n, k = len(row["seeds"]), row["aggregate"]["diverged_seeds"]
    return f"diverged {k}/{n}" if k else "no"


def _paper_cell(net: str, key: str) -> str:
    v = PAPER[net].get(key)
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{v[0]:.2f} ± {v[1]:.2f} %"


def check_data(task: str) -> None:
    """Full mode reads Fashion-MNIST from disk; say how to get it when it is missing."""
    if not task.startswith("fashion-"):
        return
    try:
        find_dataset_dir("fashion-mnist")
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"moniqua-table2 (full) trains {task} and needs Fashion-MNIST: `apt-get install "
            f"dataset-fashion-mnist` (Debian), or put the four IDX files in $LOWBIT_DATA/fashion-mnist; "
            f"--quick needs no files. ({e})") from None


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""
    base = settings(quick)
    check_data(base["task"])
    t0 = time.perf_counter()
    rows = [_run_row(key, label, opts, budget, base, quick, t0) for key, label, opts, budget in CONFIGS]
    total = time.perf_counter() - t0
    d = next((p["parameters"] for r in rows for p in r["seeds"] if "parameters" in p), None)
    results = {"experiment": "moniqua-table2", "quick": quick, "settings": base, "parameters": d,
               "mb_bytes": MB, "wall_seconds": total, "rows": rows, "paper": PAPER}
    write_outputs(out, results, "Table 2 of Moniqua: test accuracy at 1 and 2 bits per parameter, extra memory",
                  [_table(rows)], notes=_notes(base, d, total))
    _plot(rows, base, out)
    return results


def _run_row(key: str, label: str, opts: dict, budget, base: dict, quick: bool, t0: float) -> dict:
    """One configuration's row: its runs over the seeds (or why it cannot run) and their aggregate."""
    common = {k: v for k, v in base.items() if k != "seeds"}
    row = {"key": key, "label": label, "options": opts, "bits": budget, "seeds": []}
    for seed in base["seeds"]:
        try:
            cfg = TrainConfig(**common, **opts, seed=seed)
        except ValueError as e:  # the algorithm rejects this bit budget: say so, no number
            row["not_runnable"] = str(e)
            break
        row["seeds"].append(run_seed(cfg))
        if not quick:  # a long job: one line per run in the log
            p = row["seeds"][-1]
            print(f"moniqua-table2: {label} seed {seed}: accuracy {fmt(p['final_test_accuracy'])}, "
                  f"diverged {p['diverged']}, {p['wall_seconds']:.0f} s (total {time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    row["aggregate"] = aggregate(row["seeds"])
    return row


def _table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """The headers and cells of table.md."""
    headers = ["algorithm", "options", "test accuracy (mean ± std)", "per seed", "diverged", "extra memory (MB/worker)",
               "wire bits/element/step", "wrong blocks repaired", "paper ResNet-20", "paper ResNet-110"]
    table = []
    for r in rows:
        per_seed = ", ".join(_pct(p["final_test_accuracy"]) if p["stopped"] is None else "stopped"
                             for p in r["seeds"]) or "-"
        wire = [p["wire_bits_per_element"] for p in r["seeds"] if "wire_bits_per_element" in p]
        wrong = [p["algorithm_report"]["mismatched_blocks"] for p in r["seeds"]
                 if "mismatched_blocks" in p.get("algorithm_report", {})]
        opts = " ".join(f"{k}={v}" for k, v in r["options"].items() if k not in ("algorithm", "bits")) or "-"
        table.append([r["label"], opts, _accuracy_cell(r), per_seed, _diverged_cell(r),
                      fmt(r["aggregate"]["extra_memory_mb"], 4), fmt(statistics.fmean(wire)) if wire else "-",
                      sum(wrong) if wrong else "-",
                      _paper_cell("ResNet-20", r["key"]),
                      _paper_cell("ResNet-110", r["key"])])
    return headers, table


def _notes(base: dict, d: int | None, total: float) -> str:
    """The notes under the table: the settings, and what each column means."""
    mem_paper = ", ".join(f"{a} {m:g}" for a, m in PAPER["ResNet-20"]["extra_memory_mb"].items())
    return (f"Task {base['task']}, {base['workers']} workers on a {base['topology']}, {base['steps']} steps, "
            f"seeds {base['seeds']}, task defaults for lr/momentum/weight decay/batch, d = {d} parameters. "
            f"Accuracy: the averaged model's final test accuracy; mean and sample standard deviation over the "
            f"seeds that produced one. Diverged: final training loss not finite or above the untrained "
            f"model's (step 0), or training stopped because the model left the float range ('stopped'). "
            f"Budgets: Moniqua with --bits b and its defaults (at 1 bit the slack matrix and shared dither); "
            f"the baselines at 1 bit with the scaled sign codec (ECD: 1-bit min-max, stochastic rounding), "
            f"at 2 bits with min-max and stochastic rounding, ChocoSGD and DeepSqueeze with consensus "
            f"step 0.1 there (the options column). "
            f"Extra memory: the run summary's extra_memory_bytes (state kept between steps beyond D-PSGD's "
            f"model and optimizer, per worker) / 10^6. Wire bits: 8 x bytes a worker really sent per step / d, "
            f"all its neighbours together (2 on a ring), with DCD/ECD's one fp32 copy of x_0 at step 0 and "
            f"Moniqua's hashes and repairs included. Wrong blocks repaired: Moniqua's verification "
            f"(mismatched_blocks, summed over workers and seeds): blocks recovered wrong because theta was "
            f"below the models' distance there, left out of that step's mix and repaired (16-bit) the next step. "
            f"The paper's columns are CIFAR-10 with ResNet-20 / "
            f"ResNet-110 trained to the end (extra memory there, ResNet-20: {mem_paper} MB), not comparable "
            f"in absolute value with this short run. Total wall time {total:.0f} s.")


def _plot(rows: list[dict], base: dict, out: Path) -> None:
    """accuracy_vs_bits.png: each algorithm's mean accuracy at its bit budgets, the references as lines."""
    from ..plot import plot_series

    series = []
    for alg, name in (("dcd", "DCD-PSGD"), ("ecd", "ECD-PSGD"), ("choco", "ChocoSGD"),
                      ("deepsqueeze", "DeepSqueeze"), ("moniqua", "Moniqua")):
        pts = [(r["bits"], r["aggregate"]["accuracy_mean"]) for r in rows
               if r["options"]["algorithm"] == alg and r["bits"] is not None
               and r["aggregate"]["accuracy_mean"] is not None]
        if pts:
            series.append((name, [b for b, _ in pts], [a for _, a in pts]))
    refs = [(r["label"], r["aggregate"]["accuracy_mean"]) for r in rows
            if r["bits"] is None and r["aggregate"]["accuracy_mean"] is not None]
    if series:
        plot_series(series, "bits per parameter", "final test accuracy (mean over seeds)",
                    out / "accuracy_vs_bits.png", hlines=refs,
                    title=f"{base['task']}, {base['workers']} workers ring, {base['steps']} steps")
