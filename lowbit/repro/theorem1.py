"""Theorem 1 of Moniqua (Lu & De Sa 2020): naive quantized gossip stalls above
phi^2 delta^2 / (8 (1 + phi^2)); Moniqua at 2 bits does not.

The quadratic f_i(x) = ||x - (delta/2) 1||^2 / 2 (dimension 16, delta = 0.1)
on 8 workers on a ring with uniform weights (phi = 1/3), 400 steps (--quick:
80). The figure is the mean over workers of ||grad f(x_i)||^2 at the end.
"""

from __future__ import annotations

from pathlib import Path

from ..topology import make_topology, smallest_nonzero_weight
from ..train.config import TrainConfig
from .common import train_quietly, write_outputs

BASE = {"task": "quadratic", "workers": 8, "topology": "ring", "weights": "uniform", "dim": 16, "delta": 0.1, "bits": 2}

# (label, options beyond BASE)
ROWS = [
    ("naive, lr 0.02", {"algorithm": "naive", "lr": 0.02}),
    ("naive, lr 0.5", {"algorithm": "naive", "lr": 0.5}),
    ("naive, lr 0.1 cosine", {"algorithm": "naive", "lr": 0.1, "lr_schedule": "cosine"}),
    ("moniqua 2 bits, theta 0.05 (shared randomness)", {"algorithm": "moniqua", "theta": 0.05}),
    ("moniqua 2 bits, cosine, theta 0.02 ~ lr, no shared randomness",
     {"algorithm": "moniqua", "lr_schedule": "cosine", "theta": 0.02, "theta_schedule": "lr", "shared_randomness": False}),
    ("dpsgd (fp32)", {"algorithm": "dpsgd"}),
]


def floor(workers: int, topology: str, weights: str, delta: float) -> tuple[float, float]:
    """(phi, Theorem 1's floor phi^2 delta^2 / (8 (1 + phi^2)))."""
    W = make_topology(topology, workers).mixing_matrix(weights)
    phi = smallest_nonzero_weight(W)
    return phi, phi ** 2 * delta ** 2 / (8 * (1 + phi ** 2))


def run(out: Path, quick: bool = False) -> dict:
    """Run this experiment (``quick``: the small digits version CI runs), write
    ``results.json``, ``table.md`` and its plots into ``out``, and return the results."""

    steps, eval_every = (80, 20) if quick else (400, 25)
    phi, bound = floor(BASE["workers"], BASE["topology"], BASE["weights"], BASE["delta"])
    rows = []
    for label, opts in ROWS:
        cfg = TrainConfig(**BASE, **opts, steps=steps, eval_every=eval_every, seed=0)
        run_ = train_quietly(cfg)  # Moniqua's first steps without shared randomness are repaired
        s = run_.summary
        rows.append({"label": label, "options": opts, "final_grad_norm_sq": s["final_grad_norm_sq"],
                         "below_floor": s["final_grad_norm_sq"] < bound,
                         "wire_bits_per_element": s["wire_bits_per_element"],
                         "steps": [m["step"] for m in run_.metrics],
                         "grad_norm_sq": [m["grad_norm_sq"] for m in run_.metrics]})
    results = {"experiment": "moniqua-theorem1", "quick": quick, "settings": {**BASE, "steps": steps},
                   "phi": phi, "floor": bound, "rows": rows}
    write_outputs(
        out, results, "Theorem 1 of Moniqua: naive quantized gossip vs Moniqua on the quadratic",
        [(["algorithm and options", "mean over workers of ‖∇f(x_i)‖²", "below the floor",
           "wire bits/element/step"],
          [[r["label"], r["final_grad_norm_sq"], "yes" if r["below_floor"] else "no", r["wire_bits_per_element"]]
           for r in rows])],
        notes=f"Quadratic, dimension {BASE['dim']}, delta = {BASE['delta']}, {BASE['workers']} workers on a "
              f"{BASE['topology']} ({BASE['weights']} weights, phi = {phi:.4g}), {steps} steps. Theorem 1's floor "
              f"for naive quantized gossip: phi^2 delta^2 / (8 (1 + phi^2)) = {bound:.3g}.")
    from ..plot import plot_series

    plot_series([(r["label"], r["steps"], r["grad_norm_sq"]) for r in rows], "step",
                "mean ||grad f(x_i)||^2", out / "grad_norm_sq.png", logy=True,
                hlines=[("Theorem 1 floor", bound)])
    return results
