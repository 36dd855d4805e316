"""The algorithm contract being replaced (see ``base.py``): an object per worker that
holds its transport and keeps its state in attributes. Algorithms move to ``base.py`` one
family at a time; this module goes when the last one has moved.

Old contract: one paper algorithm, per worker (SPMD).

An algorithm works on a flat parameter vector ``x`` and its flat gradient
``g`` (all model parameters in one contiguous buffer). The training loop
calls, once per step k::

    loss.backward()                      # g = stochastic gradient at x_k
    algo.before_update(k, x, g, lr)      # communicate
    optimizer.step()                     # local update x <- x - lr * d(g)
    algo.after_update(k, x, g, lr)       # (algorithms that act after the update)

Centralized algorithms replace ``g`` by the aggregate of all workers'
gradients in ``before_update``; decentralized (gossip) algorithms replace
``x`` by ``x_{k+1/2}`` (the mixed model) there, so that the optimizer step
gives ``x_{k+1} = x_{k+1/2} - lr * g_k`` as in D-PSGD.
"""

from __future__ import annotations

from abc import ABC

import numpy as np
import torch

from ..comm.base import Transport
from ..topology import Topology, check_mixing_matrix


class Algorithm(ABC):
    name: str = "algorithm"
    family: str = ""  # "centralized" or "decentralized"
    # False for asynchronous algorithms (AD-PSGD family): no step is a global
    # barrier, so the training loop evaluates only before the first step and
    # after finish().
    synchronous: bool = True
    # Codec names (lowbit.codecs.CODECS) a run may choose with --codec; the
    # first is the default. Empty: the algorithm sends one fixed format.
    codecs: tuple[str, ...] = ()

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ValueError for options of the run config ``cfg`` (a
        ``lowbit.train.TrainConfig``) that this algorithm cannot take. Called
        before any worker starts."""

    @classmethod
    def from_config(cls, cfg, transport: Transport, topology: Topology | None):
        """Build this worker's instance from the run config."""
        return cls(transport, seed=cfg.seed)

    def __init__(self, transport: Transport, *, seed: int = 0):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.seed = seed

    def setup(self, x: torch.Tensor) -> None:
        """Called once with the initial flat parameters (allocate state here)."""

    def before_update(self, k: int, x: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        """Communication before the local optimizer step (in place on x or g)."""

    def after_update(self, k: int, x: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        """Work after the local optimizer step (in place on x)."""

    def extra_memory_bytes(self) -> int:
        """Bytes of state this worker keeps between steps beyond the model and
        the optimizer (replicas, error memory, previous iterates): by default
        the size of :meth:`state_tensors`."""
        return tensors_nbytes(self.state_tensors().values())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The persistent state, by name (counted by :meth:`extra_memory_bytes`)."""
        return {}

    def finish(self) -> None:
        """Called once after the last step, before the final evaluation (an
        asynchronous algorithm drains its in-flight traffic here)."""

    def report(self) -> dict[str, int | float]:
        """Figures of this run worth reporting (e.g. Moniqua's final theta and its
        mismatch counters). A run's summary sums the int entries over workers
        (counters) and takes the float entries from rank 0 (settings all share)."""
        return {}

    @classmethod
    def run_warning(cls, report: dict) -> str | None:
        """What a whole run's combined :meth:`report` should warn the user of (logged
        once per run by :func:`lowbit.train.run.summarize`), or None."""
        return None

    def nominal_bits_per_element(self) -> float:
        """Bits per element of the code before any framing (the paper's count)."""
        return 32.0

    def state_dict(self) -> dict:
        """Everything needed to continue exactly after a restart: the state
        tensors plus :meth:`extra_state` (scalars such as a tuned theta)."""
        return {"tensors": {k: v.detach().clone() for k, v in self.state_tensors().items()},
                "extra": self.extra_state()}

    def load_state_dict(self, state: dict) -> None:
        tensors = self.state_tensors()
        missing = set(tensors) ^ set(state["tensors"])
        if missing:
            raise ValueError(f"{self.name} state_dict: tensors {sorted(missing)} do not match this algorithm's state")
        for k, t in tensors.items():
            src = state["tensors"][k]
            if src.shape != t.shape:
                raise ValueError(f"{self.name} state_dict: {k} has shape {tuple(src.shape)}, expected {tuple(t.shape)}")
            t.copy_(src)
        self.load_extra_state(state.get("extra", {}))

    def extra_state(self) -> dict:
        """Non-tensor state (python scalars) to checkpoint; see :meth:`state_dict`."""
        return {}

    def load_extra_state(self, extra: dict) -> None:
        """Restore what :meth:`extra_state` returned."""


def tensors_nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class GossipAlgorithm(Algorithm):
    """Base of the decentralized family: a worker, its neighbours on a
    topology, and its row of the symmetric doubly stochastic mixing matrix W."""

    family = "decentralized"

    def __init__(self, transport: Transport, topology: Topology, *, weights: str = "uniform",
                 W: np.ndarray | None = None, seed: int = 0):
        super().__init__(transport, seed=seed)
        if topology.n != transport.world_size:
            raise ValueError(f"topology has {topology.n} workers but the transport has {transport.world_size}")
        self.topology = topology
        self.W = topology.mixing_matrix(weights) if W is None else np.asarray(W, dtype=np.float64)
        check_mixing_matrix(self.W)
        self.neighbors = topology.neighbors(self.rank)
        for j in range(topology.n):
            if j != self.rank and self.W[self.rank, j] != 0 and j not in self.neighbors:
                raise ValueError(f"W[{self.rank},{j}] != 0 but {j} is not a neighbour of {self.rank} on {topology.name}")
        # W is symmetric: W_ji (what i takes from j, in the paper's notation) equals W_ij.
        self.w_self = float(self.W[self.rank, self.rank])
        self.w = {j: float(self.W[j, self.rank]) for j in self.neighbors}

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, weights=cfg.weights, seed=cfg.seed)


class CentralizedAlgorithm(Algorithm):
    family = "centralized"
