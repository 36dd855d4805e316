"""In-process runtime: n workers as threads of one process.

Deterministic: reductions add the ranks' tensors in rank order, and an
exchange delivers exactly the buffer that was sent. Any worker that fails
aborts the others instead of leaving them waiting.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, TypeVar

import torch

from .base import Transport

T = TypeVar("T")

_TIMEOUT_S = 600.0


class ThreadWorld:
    """Shared state of n thread workers: one FIFO queue per directed link and
    a slot table for collectives."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"workers must be >= 1, got {world_size}")
        self.world_size = world_size
        self.links = {(i, j): queue.Queue() for i in range(world_size) for j in range(world_size) if i != j}
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier_ = threading.Barrier(world_size, timeout=_TIMEOUT_S)
        self.aborted = threading.Event()

    def transport(self, rank: int) -> "ThreadTransport":
        return ThreadTransport(self, rank)

    def abort(self) -> None:
        """Release every worker waiting in a collective or an exchange."""
        self.aborted.set()
        self.barrier_.abort()


class ThreadTransport(Transport):
    def __init__(self, world: ThreadWorld, rank: int):
        super().__init__(rank, world.world_size)
        self.world = world

    def _sync(self) -> None:
        self.world.barrier_.wait()

    def _collect(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``t``, wait for all, copy out everyone's, wait again."""
        w = self.world
        w.slots[self.rank] = t
        self._sync()
        got = [s.clone() for s in w.slots]
        self._sync()
        return got

    def _neighbor_exchange(self, buf, neighbors):
        for j in neighbors:
            self.world.links[(self.rank, j)].put(buf.clone())
        return {j: self._receive(j) for j in neighbors}

    def _receive(self, j: int) -> torch.Tensor:
        link = self.world.links[(j, self.rank)]
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            try:
                return link.get(timeout=0.05)
            except queue.Empty:
                if self.world.aborted.is_set():
                    raise threading.BrokenBarrierError(f"rank {self.rank}: another worker failed") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank} waited {_TIMEOUT_S}s for rank {j}") from None

    def _all_reduce(self, t, op):
        parts = self._collect(t)
        acc = parts[0].clone()
        for p in parts[1:]:
            if op == "sum":
                acc += p
            elif op == "max":
                torch.maximum(acc, p, out=acc)
            else:
                torch.minimum(acc, p, out=acc)
        return acc

    def _all_gather(self, t):
        return self._collect(t)

    def _broadcast(self, t, src):
        return self._collect(t)[src]

    def _gather(self, t, dst):
        parts = self._collect(t)
        return parts if self.rank == dst else None

    def _barrier(self):
        self._sync()


def run_threads(world_size: int, fn: Callable[[Transport], T]) -> list[T]:
    """Run ``fn(transport)`` on ``world_size`` thread workers; results in rank order.

    The first exception raised by any worker is re-raised here (after the
    others have been released from their waits).
    """
    world = ThreadWorld(world_size)
    results: list = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.transport(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            world.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"lowbit-worker-{r}", daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results
