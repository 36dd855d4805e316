"""A Bagua-shaped entry point, so that Bagua code runs on lowbit with its
import changed::

    from lowbit.bagua import LowPrecisionDecentralizedAlgorithm, with_bagua

    algorithm = LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=1)
    model = with_bagua(model, [optimizer], algorithm)     # Bagua: model.with_bagua([optimizer], algorithm)
    ...
    loss.backward()
    model.step()                                          # Bagua hooks optimizer.step(); lowbit is explicit

``with_bagua`` returns a :class:`~lowbit.integrations.DecentralizedDataParallel`
running :class:`lowbit.algorithms.lowprec.LowPrecisionDecentralized` (min-max
8-bit quantized model differences, neighbour replicas; source document 001) on
a ring, as Bagua does. What lowbit does not implement is refused rather than
ignored: ``hierarchical=True`` (Bagua's intra-node averaging before the
inter-node gossip; lowbit treats every rank as one node) and
``communication_interval != 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .comm.base import Transport
from .integrations.decentralized import DecentralizedDataParallel


@dataclass(frozen=True)
class LowPrecisionDecentralizedAlgorithm:
    """Bagua's ``LowPrecisionDecentralizedAlgorithm(hierarchical, communication_interval)``.

    Bagua's default is ``hierarchical=True``; lowbit has no node hierarchy, so
    the default here is False and True raises. The extra keyword options are
    lowbit's (``LowPrecisionDecentralized``): ``bits`` (8 in Bagua),
    ``rounding``, ``peer_selection``, ``weights``, ``seed``, and ``topology``
    (Bagua gossips on a ring).
    """

    hierarchical: bool = False
    communication_interval: int = 1
    bits: int = 8
    rounding: str = "nearest"
    peer_selection: str = "all"
    weights: str = "uniform"
    seed: int = 0
    topology: str = "ring"

    def __post_init__(self):
        if self.hierarchical:
            raise ValueError("hierarchical=True is not supported by lowbit (every rank is its own node); "
                             "pass hierarchical=False")
        if isinstance(self.communication_interval, bool) or self.communication_interval != 1:
            raise ValueError(f"communication_interval must be 1 (lowbit communicates every step), "
                             f"got {self.communication_interval!r}")

    def options(self) -> dict[str, Any]:
        """The constructor options of ``LowPrecisionDecentralized``."""
        return dict(bits=self.bits, rounding=self.rounding, peer_selection=self.peer_selection,
                    weights=self.weights, seed=self.seed)

    def algorithm_class(self):
        try:
            from .algorithms.lowprec import LowPrecisionDecentralized
        except ImportError as e:  # pragma: no cover - depends on the installed algorithms
            raise RuntimeError("lowbit.algorithms.lowprec.LowPrecisionDecentralized is not available") from e
        return LowPrecisionDecentralized


def with_bagua(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
               algorithm: LowPrecisionDecentralizedAlgorithm, *, transport: Transport | None = None,
               buffers: str = "local") -> DecentralizedDataParallel:
    """Bagua's ``model.with_bagua([optimizer], algorithm)`` as a function: the
    wrapped model (call ``.step()`` after ``loss.backward()``). ``transport``
    None joins the torchrun launch."""
    if isinstance(optimizers, torch.optim.Optimizer) or len(optimizers) != 1:
        raise ValueError("optimizers must be a list holding exactly one optimizer, as in with_bagua([optimizer], ...)")
    if not isinstance(algorithm, LowPrecisionDecentralizedAlgorithm):
        raise ValueError(f"algorithm must be a lowbit.bagua.LowPrecisionDecentralizedAlgorithm, got {algorithm!r}")
    return DecentralizedDataParallel(model, optimizers[0], algorithm.algorithm_class(), topology=algorithm.topology,
                                     transport=transport, buffers=buffers, **algorithm.options())


__all__ = ["LowPrecisionDecentralizedAlgorithm", "with_bagua"]
