"""algorithms: one paper algorithm per file, written per worker (SPMD)."""

from __future__ import annotations

from .allreduce import AllReduceSGD
from .compressed import QSGD, OneBitEF, PowerSGD, TernGrad
from .dqsg import DQSG, NDQSG
from .maxnorm import GlobalRandKMaxNormMultiScaleSGD, GlobalRandKMaxNormSGD, MaxNormMultiScaleSGD, MaxNormSGD
from .base import Algorithm, CentralizedAlgorithm, Context, GossipAlgorithm, State, Worker, make_worker
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

__all__ = ["ALGORITHMS", "Algorithm", "Context", "State", "Worker", "build_worker", "from_options", "make_worker", "AllReduceSGD", "CentralizedAlgorithm", "DPSGD", "GossipAlgorithm",
           "Moniqua", "D2", "MoniquaD2", "NaiveQuantizedDPSGD", "QuantizedGossip", "check_algorithm",
           "DQSG", "NDQSG", "QSGD", "TernGrad", "OneBitEF", "PowerSGD", "MaxNormSGD", "MaxNormMultiScaleSGD",
           "GlobalRandKMaxNormSGD", "GlobalRandKMaxNormMultiScaleSGD",
           "ChocoSGD", "DCDPSGD", "ECDPSGD", "DeepSqueeze", "LowPrecisionDecentralized", "ADPSGD", "MoniquaAsync"]


def check_algorithm(name: str) -> type:
    """The algorithm class registered as ``name``; a ValueError listing the names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r} is unknown; choose one of: {', '.join(ALGORITHMS)}") from None


def build_worker(algorithm, transport, topology=None, **options):
    """One worker of ``algorithm`` on ``transport``: the entry point of the wrapper and of
    tests. ``algorithm`` is

    - a registry name: ``options`` are option names of
      :class:`~lowbit.algorithms.options.AlgorithmOptions` (``bits``, ``theta``,
      ``codec``...: the ``lowbit train`` options, with the same defaults), and only those the
      algorithm reads (its ``options``);
    - an Algorithm subclass: built as ``cls(**options)`` (its own dataclass fields);
    - an instance: its options (then no ``options`` may be given).

    ``topology`` (a :class:`~lowbit.topology.Topology` or a name, default ring) is for
    decentralized algorithms only; ``seed``, ``weights`` and ``W`` go to the worker's
    :class:`Context`."""
    from ..topology import Topology, make_topology

    if isinstance(algorithm, str):
        cls = check_algorithm(algorithm)
    elif isinstance(algorithm, type) and issubclass(algorithm, Algorithm):
        cls = algorithm
    elif isinstance(algorithm, Algorithm):
        cls = type(algorithm)
    else:
        raise ValueError(f"algorithm must be a registry name ({', '.join(ALGORITHMS)}), an Algorithm subclass "
                         f"or instance, or a bound Worker, got {algorithm!r}")
    if cls.family == "decentralized":
        topo = topology if topology is not None else "ring"
        if isinstance(topo, str):
            topo = make_topology(topo, transport.world_size)
        elif not isinstance(topo, Topology):
            raise ValueError(f"topology must be a topology name or a lowbit.topology.Topology, got {topo!r}")
    else:
        if topology is not None:
            raise ValueError(f"topology is for decentralized algorithms; {cls.name} is {cls.family or 'not'}")
        topo = None
    run = {k: options.pop(k) for k in ("seed", "weights", "W") if k in options}
    if isinstance(algorithm, str):
        algorithm = from_options(algorithm, **options)
    elif isinstance(algorithm, Algorithm):
        if options:
            raise ValueError(f"algorithm is an instance; options {sorted(options)} cannot be applied to it")
    else:
        try:
            algorithm = cls(**options)
        except TypeError as e:
            raise ValueError(f"algorithm {cls.name!r} does not take options {sorted(options)}: {e}") from e
    if topo is None and ("weights" in run or "W" in run):
        raise ValueError(f"weights and W are for decentralized algorithms; {cls.name} is {cls.family or 'not'}")
    return make_worker(algorithm, transport, topo, **run)


def from_options(name: str, *, also: tuple[str, ...] = (), **options) -> Algorithm:
    """The algorithm registered as ``name`` with ``options`` (option names of
    :class:`~lowbit.algorithms.options.AlgorithmOptions`, checked there; the others keep
    their defaults, the same as ``lowbit train``'s). An option the algorithm does not read
    is a ValueError that lists those it does (and ``also``: what the caller itself takes)."""
    from .options import AlgorithmOptions

    cls = check_algorithm(name)
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        known = AlgorithmOptions.option_names()
        what = [o if o in known else f"{o} (not an option of any algorithm)" for o in unknown]
        raise ValueError(f"algorithm {name!r} does not take option(s) {', '.join(what)}; it takes: "
                         f"{', '.join(cls.options) or 'no options'}"
                         + (f" (and the caller's {', '.join(also)})" if also else ""))
    opts = AlgorithmOptions(algorithm=name, **options)
    opts.check_options()
    return cls.from_config(opts)
