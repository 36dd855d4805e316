"""The Transport contract: what an algorithm may ask of the network.

Public methods record every op in the rank's :class:`~lowbit.comm.ledger.Ledger`
(one place, so every transport counts the same way) and delegate the moving
of bytes to the ``_``-prefixed methods a transport implements.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from .ledger import CommRecord, Ledger
from .netmodel import op_messages_and_bytes

REDUCE_OPS = ("sum", "max", "min")


class Transport(ABC):
    """Per-rank handle on the communication runtime (SPMD: every rank calls
    the same ops in the same order)."""

    def __init__(self, rank: int, world_size: int):
        if world_size < 1:
            raise ValueError(f"workers must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size - 1}], got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.ledger = Ledger(rank=rank, world_size=world_size)

    # ---- bookkeeping ---------------------------------------------------
    def set_step(self, step: int) -> None:
        self.ledger.step = step

    @contextlib.contextmanager
    def untracked(self):
        """Ops inside are not counted (evaluation, metrics, set-up)."""
        old = self.ledger.tracking
        self.ledger.tracking = False
        try:
            yield
        finally:
            self.ledger.tracking = old

    def _record(self, op: str, nbytes: int, peers: int = 1, root: bool = False) -> None:
        messages, sent = op_messages_and_bytes(op, nbytes, self.world_size, peers=peers, root=root)
        self.ledger.record(CommRecord(op, nbytes, sent, messages, peers))

    # ---- the contract ----------------------------------------------------
    def neighbor_exchange(self, buf: torch.Tensor, neighbors: Sequence[int]) -> dict[int, torch.Tensor]:
        """Send the 1-D uint8 ``buf`` to every rank in ``neighbors`` and receive
        one buffer from each of them (sizes may differ between ranks). The
        neighbour relation must be symmetric: j lists i whenever i lists j."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise TypeError(f"neighbor_exchange sends 1-D uint8 buffers, got {buf.dtype} {tuple(buf.shape)}")
        neighbors = tuple(int(j) for j in neighbors)
        if len(set(neighbors)) != len(neighbors):
            raise ValueError(f"neighbors of rank {self.rank} must be distinct, got {neighbors}")
        for j in neighbors:
            if not 0 <= j < self.world_size or j == self.rank:
                raise ValueError(f"neighbor {j} of rank {self.rank} is not another rank in [0, {self.world_size - 1}]")
        self._record("neighbor", buf.numel(), peers=len(neighbors))
        return self._neighbor_exchange(buf, neighbors)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Element-wise reduction over ranks; returns a new tensor. Integer
        sums wrap like the dtype does: pick a dtype wide enough."""
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        self._record("all_reduce", t.numel() * t.element_size())
        return self._all_reduce(t, op)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (same shape and dtype on all ranks), in rank order."""
        self._record("all_gather", t.numel() * t.element_size())
        return self._all_gather(t)

    def _check_root(self, name: str, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name} must be a rank in [0, {self.world_size - 1}], got {root}")

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s tensor on every rank (same shape and dtype on all ranks)."""
        self._check_root("src", src)
        self._record("broadcast", t.numel() * t.element_size(), root=self.rank == src)
        return self._broadcast(t, src)

    def gather(self, t: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's tensor on ``dst`` in rank order; None elsewhere."""
        self._check_root("dst", dst)
        self._record("gather", t.numel() * t.element_size(), root=self.rank == dst)
        return self._gather(t, dst)

    def barrier(self) -> None:
        self._barrier()

    # ---- what a runtime implements ----------------------------------------
    @abstractmethod
    def _neighbor_exchange(self, buf, neighbors) -> dict[int, torch.Tensor]: ...

    @abstractmethod
    def _all_reduce(self, t, op) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, t) -> list[torch.Tensor]: ...

    @abstractmethod
    def _broadcast(self, t, src) -> torch.Tensor: ...

    @abstractmethod
    def _gather(self, t, dst): ...

    @abstractmethod
    def _barrier(self) -> None: ...

    def close(self) -> None:
        """Release runtime resources (no-op by default)."""
