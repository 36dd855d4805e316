"""Plots of finished runs: curves from ``metrics.jsonl``, labels from ``summary.json``.

:func:`plot_runs` overlays the runs ``lowbit train --out DIR`` wrote;
:func:`plot_series` draws any list of ``(label, xs, ys)`` curves (used by the
reproductions, which add horizontal reference lines such as a theoretical floor).
Figures are drawn with matplotlib's Agg canvas, never through pyplot, so
plotting needs no display and leaves no global figure state behind.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

# --x / --y names -> the metrics.jsonl column and the axis label.
X_AXES = {
    "step": ("step", "step"),
    "seconds": ("emulated_seconds", "emulated seconds"),
    "bytes": ("bytes_sent", "bytes sent (all workers)"),
}
Y_AXES = {
    "loss": ("train_loss", "train loss (average model)"),
    "accuracy": ("test_accuracy", "test accuracy (average model)"),
}


def _check_choice(name: str, value, options: Mapping) -> None:
    if value not in options:
        raise ValueError(f"{name}={value!r} is unknown; choose one of: {', '.join(options)}")


def load_run(run_dir: str | os.PathLike) -> tuple[list[dict], dict | None]:
    """The metrics rows of ``run_dir`` and its summary (None if it has no summary.json)."""
    d = Path(run_dir)
    path = d / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"run directory {str(d)!r} has no metrics.jsonl (write one with lowbit train --out DIR)")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i} is not JSON ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path} has no rows")
    summary = None
    if (d / "summary.json").is_file():
        try:
            summary = json.loads((d / "summary.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{d / 'summary.json'} is not JSON ({e.msg})") from None
    return rows, summary


def run_label(summary: dict | None, run_dir: str | os.PathLike) -> str:
    """``algorithm, N bits/elem`` from the run's summary; the directory name without one."""
    if not summary or "config" not in summary:
        return Path(run_dir).name or str(run_dir)
    c = summary["config"]
    label = str(c.get("algorithm", Path(run_dir).name))
    bits = summary.get("nominal_bits_per_element", c.get("bits"))
    if bits is not None:
        label += f", {float(bits):g} bits/elem"
    return label


def _column(rows: list[dict], key: str, run_dir) -> list[float]:
    out = []
    for r in rows:
        if key not in r:
            raise ValueError(f"run {str(run_dir)!r}: metrics.jsonl rows have no {key!r} column")
        out.append(r[key])
    return out


def plot_series(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], xlabel: str, ylabel: str,
                out: str | os.PathLike, logy: bool = False, hlines: Sequence[tuple[str, float]] | None = None,
                title: str | None = None, styles: Sequence[Mapping] | None = None) -> Path:
    """Draw the curves ``(label, xs, ys)`` on one axis and save the figure to ``out``.

    ``hlines`` are ``(label, y)`` pairs drawn as dashed horizontal lines (e.g. a
    theoretical floor). The format follows the suffix of ``out`` (.png, .pdf,
    .svg, ...); missing parent directories are created. ``styles``: one mapping of matplotlib
    line options (``linestyle``, ``color``...) per curve, in order. Returns ``out`` as a Path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("series must hold at least one (label, xs, ys) curve, got none")
    for i, s in enumerate(series):
        if len(s) != 3:
            raise ValueError(f"series[{i}] must be (label, xs, ys), got {len(s)} items")
        label, xs, ys = s
        if len(xs) != len(ys):
            raise ValueError(f"series[{i}] ({label!r}): xs and ys must have the same length, "
                             f"got {len(xs)} and {len(ys)}")
        if len(xs) == 0:
            raise ValueError(f"series[{i}] ({label!r}) has no points")
    hlines = list(hlines or [])
    for i, h in enumerate(hlines):
        if len(h) != 2 or not isinstance(h[1], (int, float)) or not math.isfinite(h[1]):
            raise ValueError(f"hlines[{i}] must be (label, finite y), got {h!r}")
    out = Path(out)
    fig = Figure(figsize=(6.4, 4.4))
    canvas = FigureCanvasAgg(fig)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in canvas.get_supported_filetypes():
        raise ValueError(f"out={str(out)!r}: unknown image format {fmt or '(no suffix)'!r}; use one of: "
                         f"{', '.join(sorted(canvas.get_supported_filetypes()))}")
    ax = fig.add_subplot()
    if styles is not None and len(styles) != len(series):
        raise ValueError(f"styles must hold one mapping per curve ({len(series)}), got {len(styles)}")
    for i, (label, xs, ys) in enumerate(series):
        ys = [float("nan") if y is None else y for y in ys]
        ax.plot(xs, ys, **{"marker": "o" if len(xs) <= 30 else None, "markersize": 3, "label": label,
                           **(styles[i] if styles is not None else {})})
    for label, y in hlines:
        ax.axhline(y, linestyle="--", linewidth=1, color="gray")
        ax.annotate(label, xy=(0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                    color="gray")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def load_series(run_dirs: Sequence[str | os.PathLike], x: str, y: str,
                labels: Sequence[str] | None = None) -> list[tuple[str, list, list]]:
    """The ``(label, xs, ys)`` curve of each run in ``run_dirs`` (see :func:`plot_runs`)."""
    _check_choice("x", x, X_AXES)
    _check_choice("y", y, Y_AXES)
    if isinstance(run_dirs, (str, os.PathLike)) or not run_dirs:
        raise ValueError(f"run_dirs must be a non-empty list of run directories, got {run_dirs!r}")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"labels must give one label per run: {len(run_dirs)} runs, {len(labels)} labels")
    xkey, ykey = X_AXES[x][0], Y_AXES[y][0]
    series = []
    for i, d in enumerate(run_dirs):
        rows, summary = load_run(d)
        ys = _column(rows, ykey, d)
        if all(v is None for v in ys):
            task = (summary or {}).get("config", {}).get("task", "this task")
            raise ValueError(f"run {str(d)!r} has no {ykey} ({task} has no test accuracy); use --y loss")
        label = labels[i] if labels is not None else run_label(summary, d)
        series.append((label, _column(rows, xkey, d), ys))
    names = [s[0] for s in series]
    if labels is None and len(set(names)) < len(names):  # same algorithm and bits: tell them apart
        series = [(f"{lab} ({Path(d).name})", xs, ys) for (lab, xs, ys), d in zip(series, run_dirs)]
    return series


def plot_runs(run_dirs: Sequence[str | os.PathLike], x: str, y: str, out: str | os.PathLike,
              title: str | None = None, labels: Sequence[str] | None = None, logy: bool = False) -> Path:
    """Overlay the runs in ``run_dirs`` (each with a metrics.jsonl): ``x`` one of step,
    seconds, bytes; ``y`` one of loss, accuracy. Labels default to each run's algorithm
    and bits per element from its summary.json. Returns the path written."""
    series = load_series(run_dirs, x, y, labels)
    return plot_series(series, X_AXES[x][1], Y_AXES[y][1], out, logy=logy, title=title)
