"""The algorithm contract: one paper algorithm, per worker (SPMD).

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
        the optimizer (replicas, error memory, previous iterates)."""
        return 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The persistent state, by name (counted by :meth:`extra_memory_bytes`)."""
        return {}


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


class CentralizedAlgorithm(Algorithm):
    family = "centralized"
