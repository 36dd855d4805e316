"""algorithms: one paper algorithm per file, written per worker (SPMD)."""

from __future__ import annotations

from .allreduce import AllReduceSGD
from .compressed import QSGD, OneBitEF, PowerSGD, TernGrad
from .dqsg import DQSG, NDQSG
from .maxnorm import GlobalRandKMaxNormMultiScaleSGD, GlobalRandKMaxNormSGD, MaxNormMultiScaleSGD, MaxNormSGD
from .base import Algorithm, CentralizedAlgorithm, GossipAlgorithm
from .dpsgd import DPSGD, NaiveQuantizedDPSGD, QuantizedGossip
from .moniqua import Moniqua
from .d2 import D2, MoniquaD2
from .choco import ChocoSGD
from .dcd import DCDPSGD, ECDPSGD
from .deepsqueeze import DeepSqueeze
from .lowprec import LowPrecisionDecentralized
from .adpsgd import ADPSGD, MoniquaAsync

ALGORITHMS = {
    "allreduce": AllReduceSGD,
    "dpsgd": DPSGD,
    "naive": NaiveQuantizedDPSGD,
    "moniqua": Moniqua,
    "d2": D2,
    "moniqua-d2": MoniquaD2,
    "choco": ChocoSGD,
    "dcd": DCDPSGD,
    "ecd": ECDPSGD,
    "deepsqueeze": DeepSqueeze,
    "lowprec-decentralized": LowPrecisionDecentralized,
    "dqsg": DQSG,
    "ndqsg": NDQSG,
    "qsgd": QSGD,
    "terngrad": TernGrad,
    "onebit-ef": OneBitEF,
    "maxnorm": MaxNormSGD,
    "maxnorm-multiscale": MaxNormMultiScaleSGD,
    "grandk-maxnorm": GlobalRandKMaxNormSGD,
    "grandk-maxnorm-multiscale": GlobalRandKMaxNormMultiScaleSGD,
    "powersgd": PowerSGD,
    "adpsgd": ADPSGD,
    "moniqua-async": MoniquaAsync,
}

__all__ = ["ALGORITHMS", "Algorithm", "AllReduceSGD", "CentralizedAlgorithm", "DPSGD", "GossipAlgorithm",
           "Moniqua", "D2", "MoniquaD2", "NaiveQuantizedDPSGD", "QuantizedGossip", "check_algorithm",
           "DQSG", "NDQSG", "QSGD", "TernGrad", "OneBitEF", "PowerSGD", "MaxNormSGD", "MaxNormMultiScaleSGD",
           "GlobalRandKMaxNormSGD", "GlobalRandKMaxNormMultiScaleSGD",
           "ChocoSGD", "DCDPSGD", "ECDPSGD", "DeepSqueeze", "LowPrecisionDecentralized", "ADPSGD", "MoniquaAsync"]


def check_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r} is unknown; choose one of: {', '.join(ALGORITHMS)}") from None
