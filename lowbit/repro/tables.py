"""``lowbit repro train-tables``: the ``lowbit train`` tables of ``docs/RESULTS.md``,
regenerated from their commands.

Each table is declared once below as data: its section heading in RESULTS.md,
the command every row shares (task, workers, steps, ...), its columns, and its
rows as the OPTIONS strings exactly as the table shows them. Every row is
parsed by the ``lowbit train`` parser itself (:func:`train_config`) and run
with the same training code, so a row of the table is what
``lowbit train COMMON OPTIONS`` prints. ``table.md`` holds one section per
table, under the RESULTS.md heading, in RESULTS.md's column layout; a test
checks that the OPTIONS of those RESULTS.md tables are exactly the rows
declared here.

--quick runs every row for 2 steps on digits-mlp (the fashion-lenet rows
too: their task's 10,000-image evaluations would take minutes), which checks
that each command parses and runs with its options, not its numbers.
"""

from __future__ import annotations

import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..topology import make_topology
from ..train.args import train_parser
from ..train.config import TrainConfig
from .common import fmt, markdown_table, train_quietly, write_outputs


def _acc(v) -> str:
    return f"{v:.4f}"


def _int(v) -> str:
    return f"{round(v):,}"


def _field(name: str, cell=fmt):
    """A column of one summary field of the row's first seed (fmt: 3 significant digits)."""
    return lambda runs, first: cell(runs[0][name])


def _report(key: str):
    """A column of one entry of the row's ``algorithm_report`` ("-" where the algorithm has none)."""
    return lambda runs, first: fmt(runs[0]["algorithm_report"].get(key))


def _mean_acc(runs) -> float:
    return statistics.fmean(r["final_test_accuracy"] for r in runs)


def _fan_out(summary) -> int:
    """Messages of the model a worker sends each step: its degree in the run's topology."""
    c = summary["config"]
    return make_topology(c["topology"], c["workers"]).degree(0)


def _budget_ratio(summary) -> float:
    """Wire bits against the budget: nominal bits to each of the worker's neighbours."""
    return summary["wire_bits_per_element"] / (summary["nominal_bits_per_element"] * _fan_out(summary))


# column header -> cell(runs of the row, one summary per seed; runs of the table's first row)
COLUMNS = {
    "test acc": _field("final_test_accuracy", _acc),
    "test acc (average model)": _field("final_test_accuracy", _acc),
    "test acc (local, mean)": _field("final_local_test_accuracy", _acc),
    "train loss": _field("final_train_loss", _acc),
    "bytes/step": _field("bytes_sent_per_step", _int),
    "nominal bits": _field("nominal_bits_per_element"),
    "wire bits/element": _field("wire_bits_per_element"),
    "extra memory (B)": _field("extra_memory_bytes", _int),
    "consensus distance": _field("final_consensus_distance"),
    "test acc (average model), each seed": lambda runs, first: " / ".join(_acc(r["final_test_accuracy"])
                                                                         for r in runs),
    "mean": lambda runs, first: _acc(_mean_acc(runs)),
    "spread (max - min)": lambda runs, first: _acc(max(r["final_test_accuracy"] for r in runs)
                                                   - min(r["final_test_accuracy"] for r in runs)),
    "points against the first row": lambda runs, first: f"{100 * (_mean_acc(runs) - _mean_acc(first)):+.2f}",
    "wire / (nominal x fan-out)": lambda runs, first: f"{max(_budget_ratio(r) for r in runs):.3f}",
    "theta at the end": _report("theta"),
    "blocks repaired": _report("mismatched_blocks"),
}


@dataclass(frozen=True)
class Table:
    heading: str  # the RESULTS.md section heading (without the leading #s)
    common: str  # options every row shares
    columns: tuple[str, ...]  # keys of COLUMNS, after the OPTIONS column
    rows: tuple[str, ...]  # each row's OPTIONS, exactly as the table shows them
    seeds: tuple[int, ...] = (0,)  # every row runs with each (--seed S)

    def command(self, options: str = "OPTIONS") -> str:
        seed = "" if self.seeds == (0,) else " --seed S"
        return f"lowbit train {self.common}{seed} --no-progress {options}"


DECENTRALIZED_COLUMNS = ("test acc (average model)", "test acc (local, mean)", "bytes/step", "nominal bits",
                         "wire bits/element", "extra memory (B)", "consensus distance")

TABLES: tuple[Table, ...] = (
    Table("The decentralized family on digits-mlp (8 workers, ring, 300 steps)",
          "--task digits-mlp --workers 8 --steps 300", DECENTRALIZED_COLUMNS, (
              "--algorithm allreduce",
              "--algorithm dpsgd",
              "--algorithm naive",
              "--algorithm moniqua --bits 2",
              "--algorithm moniqua --bits 2 --theta 0.05",
              "--algorithm moniqua --bits 2 --theta 0.05 --no-verify",
              "--algorithm moniqua --bits 2 --no-shared-randomness",
              "--algorithm moniqua --bits 2 --gamma 1",
              "--algorithm moniqua --bits 1",
              "--algorithm moniqua --bits 1 --theta 0.05 --no-verify",
              "--algorithm moniqua --bits 8",
              "--algorithm moniqua --bits 2 --theta 0.5 --no-verify",
              "--algorithm moniqua --bits 2 --theta 0.5 --no-verify --entropy ans",
              "--algorithm choco --bits 8",
              "--algorithm choco --bits 2",
              "--algorithm dcd --bits 8",
              "--algorithm dcd --bits 2",
              "--algorithm ecd --bits 8",
              "--algorithm ecd --bits 2",
              "--algorithm deepsqueeze --bits 8",
              "--algorithm deepsqueeze --bits 2",
              "--algorithm lowprec-decentralized",
              "--algorithm lowprec-decentralized --codec minmax --bits 2",
              "--algorithm lowprec-decentralized --peer-selection shift_one",
              "--algorithm lowprec-decentralized --node-size 2",
              "--algorithm lowprec-decentralized --node-size 2 --communication-interval 4",
              "--algorithm adpsgd",
              "--algorithm moniqua-async --bits 8",
              "--algorithm moniqua-async --bits 2 --theta 0.5",
          )),
    Table("The centralized family on digits-mlp (8 workers, 300 steps)",
          "--task digits-mlp --workers 8 --steps 300",
          ("test acc", "train loss", "bytes/step", "nominal bits", "wire bits/element", "extra memory (B)"), (
              "--algorithm allreduce",
              "--algorithm maxnorm --bits 8",
              "--algorithm maxnorm --bits 4",
              "--algorithm maxnorm --bits 2",
              "--algorithm maxnorm-multiscale --scales 2,6",
              "--algorithm grandk-maxnorm --bits 4 --k 0.1",
              "--algorithm grandk-maxnorm-multiscale --scales 2,6 --k 0.1",
              "--algorithm qsgd --bits 2",
              "--algorithm terngrad",
              "--algorithm onebit-ef",
              "--algorithm powersgd --rank 1",
              "--algorithm powersgd --rank 2",
          )),
    Table("Fashion-MNIST, LeNet-5 (first real-data runs)",
          "--task fashion-lenet --workers 8 --steps 300 --eval-every 100",
          ("test acc (average model)", "test acc (local, mean)", "bytes/step", "wire bits/element"), (
              "--algorithm dpsgd",
              "--algorithm moniqua --bits 2",
          )),
)


TARGET_COLUMNS = ("test acc (average model), each seed", "mean", "spread (max - min)",
                  "points against the first row", "wire bits/element", "wire / (nominal x fan-out)")
THETA_COLUMNS = ("test acc (average model)", "test acc (local, mean)", "points against the first row",
                 "wire bits/element", "wire / (nominal x fan-out)", "theta at the end", "blocks repaired")
DIGITS = "--task digits-mlp --workers 8 --steps 300"
FASHION = "--task fashion-lenet --workers 8 --steps 300 --eval-every 100"

# Moniqua's targets of issue 11 (section "Moniqua's targets (issue 11)" of RESULTS.md).
TABLES += (
    Table("Accuracy and wire bits against fp32 D-PSGD: digits-mlp, seeds 0, 1, 2", DIGITS, TARGET_COLUMNS,
          ("--algorithm dpsgd", "--algorithm moniqua --bits 2", "--algorithm moniqua --bits 1"), seeds=(0, 1, 2)),
    Table("Accuracy and wire bits against fp32 D-PSGD: fashion-lenet, seeds 0, 1, 2", FASHION, TARGET_COLUMNS,
          ("--algorithm dpsgd", "--algorithm moniqua --bits 2", "--algorithm moniqua --bits 1"), seeds=(0, 1, 2)),
    Table("theta auto against hand-tuned theta at 2 bits: digits-mlp", DIGITS, THETA_COLUMNS,
          ("--algorithm moniqua --bits 2", *(f"--algorithm moniqua --bits 2 --theta {t}"
                                             for t in ("0.01", "0.02", "0.05", "0.1", "0.2")))),
    Table("theta auto against hand-tuned theta at 2 bits: fashion-lenet", FASHION, THETA_COLUMNS,
          ("--algorithm moniqua --bits 2", *(f"--algorithm moniqua --bits 2 --theta {t}"
                                             for t in ("0.02", "0.05", "0.1", "0.2")))),
)


def train_config(options: str, **override) -> TrainConfig:
    """The TrainConfig that ``lowbit train OPTIONS`` runs (same parser, same defaults);
    ``override`` replaces fields after parsing (the --quick scale)."""
    try:
        args, unknown = train_parser().parse_known_args(shlex.split(options))
    except SystemExit:  # argparse has printed why (a bad value)
        raise ValueError(f"options {options!r} are not valid lowbit train options (see the message above)") from None
    if unknown:
        raise ValueError(f"options {options!r}: lowbit train has no option {' '.join(unknown)}")
    args = vars(args)
    opts = {k: v for k, v in args.items() if k in TrainConfig.option_names()}
    return TrainConfig(**{**opts, **override})


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""
    override = {"steps": 2, "eval_every": 2, "task": "digits-mlp"} if quick else {}
    keys = ("final_test_accuracy", "final_local_test_accuracy", "final_train_loss", "final_consensus_distance",
            "bytes_sent_per_step", "nominal_bits_per_element", "wire_bits_per_element", "extra_memory_bytes",
            "algorithm_report", "wall_seconds", "config")
    done: dict[str, dict] = {}  # a configuration shared by several tables runs once

    def summary(options: str, seed: int) -> dict:
        cfg = train_config(options, **override, seed=seed)
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if key not in done:
            done[key] = {k: v for k, v in train_quietly(cfg).summary.items() if k in keys}
        return done[key]

    results = {"experiment": "train-tables", "quick": quick, "override": override, "tables": []}
    body = []
    for table in TABLES:
        runs = {o: [summary(f"{table.common} {o}", s) for s in table.seeds] for o in table.rows}
        first = runs[table.rows[0]]
        results["tables"].append({"heading": table.heading, "command": table.command(), "seeds": table.seeds,
                                  "rows": [{"options": o, "runs": r} for o, r in runs.items()]})
        cells = [[f"`{o}`"] + [COLUMNS[c](r, first) for c in table.columns] for o, r in runs.items()]
        seeds = "" if table.seeds == (0,) else f", S = {', '.join(map(str, table.seeds))}"
        body += [f"## {table.heading}\n", f"`{table.command()}`{seeds}"
                 + (f" (--quick: {override})" if quick else "") + "\n",
                 markdown_table(["OPTIONS", *table.columns], cells)]
    seconds = [r["wall_seconds"] for r in done.values()]
    body.append(f"{len(seconds)} runs, {sum(seconds) / 60:.1f} minutes of training "
                f"(median {statistics.median(seconds):.1f} s a run), thread backend.")
    body.append("Bytes per step are summed over the workers; wire bits are 8 x bytes a worker sent per step / d "
                "(of a row's first seed); wire / (nominal x fan-out) divides them by the nominal bits sent to each "
                "neighbour (the largest over a row's seeds); points against the first row compare mean accuracies.")
    write_outputs(out, results, "The `lowbit train` tables of docs/RESULTS.md", [], notes="\n".join(body))
    return results
