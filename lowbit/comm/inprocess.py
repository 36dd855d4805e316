"""In-process runtime: n workers as threads of one process.

Deterministic: reductions add the ranks' tensors in rank order, and an
exchange delivers exactly the buffer that was sent. Any worker that fails
aborts the others instead of leaving them waiting.

Asynchronous gossip (``Transport.gossip``) is made reproducible by a schedule
in virtual time (:class:`GossipBoard`): rank i's gossip at step k happens at
the virtual time ``clock_i(k)`` its ``gossip_open`` gave; exchanges run one at
a time in the order of (time, rank), the active thread running the passive
neighbour's handler, and an exchange waits until its passive neighbour is
parked (waiting for its own next exchange, or finished), so no exchange ever
changes a model while its owner computes a gradient on it. Independent
exchanges and the workers' computations still overlap; the result depends
only on the clocks, not on thread timing.
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
        self.board = GossipBoard(world_size)

    def transport(self, rank: int) -> "ThreadTransport":
        return ThreadTransport(self, rank)

    def abort(self) -> None:
        """Release every worker waiting in a collective or an exchange."""
        self.aborted.set()
        self.barrier_.abort()
        with self.board.cond:
            self.board.cond.notify_all()


class GossipBoard:
    """The in-process sequencer of asynchronous gossip.

    Per rank: whether it has opened, its handler and clock, the key
    ``(clock(k), rank)`` of its next exchange (None once closed), and whether it
    is *parked* (its thread waits inside ``gossip``/``gossip_close``, so its
    model is quiet). The exchange with the smallest key runs once every rank
    has opened and its passive neighbour is parked; then the active rank's
    key moves to its next step and it is no longer parked (it updates its own
    model and computes its next gradient meanwhile). A rank's close waits
    until all its neighbours have closed: until then they may still gossip
    with it.
    """

    def __init__(self, world_size: int):
        n = world_size
        self.cond = threading.Condition()
        self.opened = [False] * n
        self.handlers: list = [None] * n
        self.clocks: list = [None] * n
        self.neighbors: list[tuple[int, ...]] = [()] * n
        self.key: list[tuple[float, int] | None] = [None] * n
        self.parked = [False] * n
        self.closed = [False] * n
        self.log: list[tuple[float, int, int, int]] = []  # (time, active, step, passive), in order

    def next_key(self) -> tuple[float, int] | None:
        keys = [k for k, c in zip(self.key, self.closed) if not c and k is not None]
        return min(keys) if keys else None


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

    # ---- asynchronous gossip on the virtual-time schedule ----------------------
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait on the board (its lock held) until ``ready()``."""
        b = self.world.board
        deadline = time.monotonic() + _TIMEOUT_S
        while not ready():
            if self.world.aborted.is_set():
                raise threading.BrokenBarrierError(f"rank {self.rank}: another worker failed") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank} waited {_TIMEOUT_S}s for {what}")
            b.cond.wait(timeout=0.05)

    def _time(self, step: int) -> float:
        t = float(self.world.board.clocks[self.rank](step))
        if t != t:
            raise ValueError(f"rank {self.rank}: clock({step}) is NaN")
        return t

    def _gossip_open(self, neighbors, handler, clock):
        b = self.world.board
        with b.cond:
            if b.closed[self.rank]:
                raise RuntimeError(f"rank {self.rank}: the in-process gossip board was already closed by this rank")
            b.handlers[self.rank] = handler
            b.clocks[self.rank] = clock
            b.neighbors[self.rank] = tuple(neighbors)
            b.key[self.rank] = (self._time(0), self.rank)
            b.opened[self.rank] = True
            b.cond.notify_all()

    def _gossip(self, peer, make, step):
        b, me = self.world.board, self.rank
        with b.cond:
            key = (self._time(step), me)
            prev = b.key[me]
            if prev is not None and key < prev:
                raise ValueError(f"rank {me}: clock({step}) = {key[0]} is earlier than this rank's previous gossip")
            b.key[me] = key
            b.parked[me] = True
            b.cond.notify_all()
            self._wait(lambda: all(b.opened) and b.next_key() == key and b.parked[peer],
                       f"its turn to gossip with rank {peer} at step {step}")
            if me not in b.neighbors[peer]:
                raise ValueError(f"rank {peer} does not list rank {me} as a gossip neighbour (neighbours must be symmetric)")
            b.log.append((key[0], me, step, peer))
            reply = b.handlers[peer](me, step, make().clone())
            b.parked[me] = False
            b.key[me] = (self._time(step + 1), me)  # a lower bound of this rank's next exchange
            b.cond.notify_all()
        return reply.clone()

    def _gossip_close(self):
        b, me = self.world.board, self.rank
        with b.cond:
            b.closed[me] = True
            b.key[me] = None
            b.parked[me] = True
            b.cond.notify_all()
            self._wait(lambda: all(b.closed[j] for j in b.neighbors[me]), "its neighbours to finish gossiping")


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
