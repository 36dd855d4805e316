"""Writing an experiment's files: raw JSON and a markdown table."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ..train import train


def fmt(v, digits: int = 3) -> str:
    """A table cell: "-" for None, floats to ``digits`` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def train_quietly(cfg):
    """``lowbit.train.train(cfg)`` without the RuntimeWarnings of Moniqua's repaired blocks:
    an experiment reports those counts from each run's ``algorithm_report`` instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return train(cfg)


def curves(metrics: list[dict], *keys: str) -> dict:
    """A run's evaluations as curves for results.json: ``steps`` and one list per metric key."""
    return {"steps": [m["step"] for m in metrics], **{k: [m[k] for m in metrics] for k in keys}}


def run_row(label: str, opts: dict, run, *summary_keys: str) -> dict:
    """One trained configuration for results.json: its label and options, the named
    fields of its summary, and its training-loss and test-accuracy curves."""
    return {"label": label, "options": opts, **{k: run.summary[k] for k in summary_keys},
            **curves(run.metrics, "train_loss", "test_accuracy")}


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table of ``rows`` under ``headers`` (cells by :func:`fmt`)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, results: dict, title: str, tables: list[tuple[list[str], list[list]]],
                  notes: str = "") -> None:
    """``results.json`` and ``table.md`` (a title, the tables, then the notes)."""
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    parts = [f"# {title}\n"] + [markdown_table(h, r) for h, r in tables]
    if notes:
        parts.append(notes.rstrip() + "\n")
    (out / "table.md").write_text("\n".join(parts))
