"""algorithms: one paper algorithm per file, written per worker (SPMD)."""

from __future__ import annotations

from .allreduce import AllReduceSGD
from .base import Algorithm, CentralizedAlgorithm, GossipAlgorithm
from .dpsgd import DPSGD, NaiveQuantizedDPSGD, QuantizedGossip
from .moniqua import Moniqua

ALGORITHMS = {
    "allreduce": AllReduceSGD,
    "dpsgd": DPSGD,
    "naive": NaiveQuantizedDPSGD,
    "moniqua": Moniqua,
}

__all__ = ["ALGORITHMS", "Algorithm", "AllReduceSGD", "CentralizedAlgorithm", "DPSGD", "GossipAlgorithm",
           "Moniqua", "NaiveQuantizedDPSGD", "QuantizedGossip", "check_algorithm"]


def check_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r} is unknown; choose one of: {', '.join(ALGORITHMS)}") from None
