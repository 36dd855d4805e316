"""In-process runtime: n workers as threads of one process.

Deterministic: reductions add the ranks' tensors in rank order, and an
exchange delivers exactly the buffer that was sent. Any worker that fails
aborts the others instead of leaving them waiting.

**Run slots.** At most ``max_running`` workers compute at once (default: the
CPU cores this process may use, at most the number of workers); a worker gives
its slot up while it waits for its peers (an exchange, a collective, a gossip
turn, or :func:`blocking`) and takes one again when the wait is over. The
workers of one process share one interpreter lock: eight of them runnable on
two cores spend much of their time handing the lock and the cores to each
other (system time in futex waits and context switches), while as many
runners as cores keep every core busy with fewer hand-offs. Results do not
depend on which worker runs when, so the slots change the time a run takes,
never what it computes.

Each rank has one mailbox: a condition variable over one FIFO per sender.
A send appends and wakes the receiver; a receive waits for its sender's FIFO
(no polling: an abort wakes every waiter).

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

import collections
import contextlib
import os
import threading
import time
from typing import Callable, TypeVar

import torch

from .base import GossipFault, Transport, check_equal_sizes

T = TypeVar("T")

_TIMEOUT_S = 600.0
_current = threading.local()  # .world: the ThreadWorld whose worker this thread is


def default_max_running(world_size: int) -> int:
    """The CPU cores this process may use (its affinity mask), at most ``world_size``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(world_size, cores))


class _Aborted(threading.BrokenBarrierError):
    pass


class RunSlots:
    """At most ``limit`` holders at once; waiters are woken by a release or an abort
    (no polling). Take with :meth:`take`, give back with :meth:`give`."""

    def __init__(self, limit: int, aborted: threading.Event):
        self.limit = limit
        self.running = 0
        self.cond = threading.Condition()
        self.aborted = aborted

    def take(self, rank: int) -> None:
        with self.cond:
            deadline = time.monotonic() + _TIMEOUT_S
            while self.running >= self.limit:
                if self.aborted.is_set():
                    raise _Aborted(f"rank {rank}: another worker failed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {rank} waited {_TIMEOUT_S}s for a run slot "
                                       f"({self.limit} workers kept computing)")
                self.cond.wait(left)
            self.running += 1

    def give(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify()

    def wake_all(self) -> None:
        with self.cond:
            self.cond.notify_all()


class _Mailbox:
    """What rank r has received and not yet taken: one FIFO per sender, one condition."""

    def __init__(self):
        self.cond = threading.Condition()
        self.fifo: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def put(self, src: int, t: torch.Tensor) -> None:
        with self.cond:
            self.fifo[src].append(t)
            self.cond.notify_all()

    def take(self, src: int, me: int, aborted: threading.Event) -> torch.Tensor:
        with self.cond:
            q = self.fifo[src]
            deadline = time.monotonic() + _TIMEOUT_S
            while not q:
                if aborted.is_set():
                    raise _Aborted(f"rank {me}: another worker failed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {me} waited {_TIMEOUT_S}s for rank {src}")
                self.cond.wait(left)
            return q.popleft()


class ThreadWorld:
    """Shared state of n thread workers: a mailbox per rank, a slot table for
    collectives, the run slots and the gossip board."""

    def __init__(self, world_size: int, max_running: int | None = None):
        if world_size < 1:
            raise ValueError(f"workers must be >= 1, got {world_size}")
        if max_running is None:
            max_running = default_max_running(world_size)
        if not isinstance(max_running, int) or isinstance(max_running, bool) or max_running < 1:
            raise ValueError(f"max_running must be an int >= 1 (workers computing at once), got {max_running!r}")
        self.world_size = world_size
        self.mailboxes = [_Mailbox() for _ in range(world_size)]
        # two tables of collective slots, used in turn (see ThreadTransport._collect)
        self.slots: tuple[list, list] = ([None] * world_size, [None] * world_size)
        self.collectives = [0] * world_size  # per rank: collectives entered (picks the table)
        self.barrier_ = threading.Barrier(world_size, timeout=_TIMEOUT_S)
        self.aborted = threading.Event()
        self.run_slots = RunSlots(min(max_running, world_size), self.aborted)
        self.board = GossipBoard(world_size)
        self.refusal: str | None = None  # Transport.post_refusal: the first posted
        self._refusal_lock = threading.Lock()

    def transport(self, rank: int) -> "ThreadTransport":
        return ThreadTransport(self, rank)

    def abort(self) -> None:
        """Release every worker waiting in a collective, an exchange or for a run slot."""
        self.aborted.set()
        self.barrier_.abort()
        for box in self.mailboxes:
            with box.cond:
                box.cond.notify_all()
        self.run_slots.wake_all()
        with self.board.cond:
            self.board.cond.notify_all()


@contextlib.contextmanager
def _waiting(world: ThreadWorld | None, rank: int):
    """Give this worker's run slot up for the duration (it waits, it does not compute)."""
    if world is None or getattr(_current, "world", None) is not world:
        yield  # not one of this world's running workers (a transport used outside run_threads)
        return
    world.run_slots.give()
    _current.holding = False
    try:
        yield
    finally:
        world.run_slots.take(rank)
        _current.holding = True


@contextlib.contextmanager
def blocking():
    """Wrap a wait that does not compute (a ``time.sleep``): a thread worker gives its
    run slot to another worker meanwhile. Elsewhere it does nothing."""
    world = getattr(_current, "world", None)
    with _waiting(world, getattr(_current, "rank", 0)):
        yield


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
    with it. A fault (``gossip_fault``) is kept as ``(word, step, rank)``: every
    rank waiting on the board, or reaching it, then raises it (as
    :class:`~lowbit.comm.base.GossipFault`), except the rank that sent it.
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
        self.fault: tuple[int, int, int] | None = None  # (word, step, rank): the first fault sent

    def next_key(self) -> tuple[float, int] | None:
        keys = [k for k, c in zip(self.key, self.closed) if not c and k is not None]
        return min(keys) if keys else None


class ThreadTransport(Transport):
    """The transport of one thread worker of a :class:`ThreadWorld` (rank ``rank``): its
    collectives and neighbour exchanges meet the other threads' in shared memory."""

    def __init__(self, world: ThreadWorld, rank: int):
        super().__init__(rank, world.world_size)
        self.world = world
        self._fault_known = False  # the board's fault was sent or raised by this rank

    @property
    def channel(self) -> tuple:
        """This rank of this thread world (:attr:`~lowbit.comm.base.Transport.channel`)."""
        return ("thread", id(self.world), self.rank)

    def _sync(self) -> None:
        with _waiting(self.world, self.rank):
            self.world.barrier_.wait()

    def _collect(self, t: torch.Tensor, copy: bool = True) -> list[torch.Tensor]:
        """Publish a copy of ``t``, wait for all, return everyone's (copies again unless
        ``copy=False``: then the caller must not write them, the other ranks read the same).
        One barrier: collective c uses slot table c % 2, and a rank writes that table again only
        at collective c + 2, past collective c + 1's barrier, which every rank reaches after it
        has read collective c's. The published copy leaves the caller free to write ``t`` as
        soon as this returns."""
        w = self.world
        table = w.slots[w.collectives[self.rank] % 2]
        w.collectives[self.rank] += 1
        table[self.rank] = t.clone()
        self._sync()
        return [s.clone() for s in table] if copy else list(table)

    def _neighbor_exchange(self, buf, neighbors):
        w, me = self.world, self.rank
        for j in neighbors:
            w.mailboxes[j].put(me, buf.clone())
        box = w.mailboxes[me]
        with box.cond:  # everything already here: no wait, the slot is kept
            ready = all(box.fifo[j] for j in neighbors)
        if ready:
            return {j: box.take(j, me, w.aborted) for j in neighbors}
        with _waiting(w, me):
            return {j: box.take(j, me, w.aborted) for j in neighbors}

    def _all_reduce(self, t, op):
        parts = self._collect(t, copy=False)  # read only: the sum is a new tensor
        acc = parts[0].clone()
        for p in parts[1:]:
            if op == "sum":
                acc += p
            elif op == "max":
                torch.maximum(acc, p, out=acc)
            elif op == "band":
                torch.bitwise_and(acc, p, out=acc)
            else:
                torch.minimum(acc, p, out=acc)
        return acc

    def _all_gather(self, t):
        parts = self._collect(t)
        check_equal_sizes(self.rank, [p.numel() * p.element_size() for p in parts], "an all-gather payload")
        return parts

    def _broadcast(self, t, src):
        return self._collect(t, copy=False)[src].clone()

    def _gather(self, t, dst):
        parts = self._collect(t)
        check_equal_sizes(self.rank, [p.numel() * p.element_size() for p in parts], "a gather payload")
        return parts if self.rank == dst else None

    def _barrier(self):
        self._sync()

    # ---- asynchronous gossip on the virtual-time schedule ----------------------
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait on the board (its lock held) until ``ready()``."""
        b = self.world.board
        deadline = time.monotonic() + _TIMEOUT_S
        while not ready():
            self._raise_fault()
            if self.world.aborted.is_set():
                raise _Aborted(f"rank {self.rank}: another worker failed") from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank} waited {_TIMEOUT_S}s for {what}")
            b.cond.wait(left)

    def _post_refusal(self, text):
        with self.world._refusal_lock:
            self.world.refusal = self.world.refusal or text

    def _posted_refusal(self):
        return self.world.refusal

    def _raise_fault(self) -> None:
        """Raise the board's fault as a GossipFault (board lock held), once per rank."""
        fault = self.world.board.fault
        if fault is not None and not self._fault_known:
            self._fault_known = True
            raise GossipFault(*fault)

    def _gossip_fault(self, word, step):
        b = self.world.board
        with b.cond:
            self._fault_known = True
            if b.fault is None:
                b.fault = (word, step, self.rank)
            b.cond.notify_all()

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
        with _waiting(self.world, self.rank):
            return self._gossip_turn(peer, make, step)

    def _gossip_turn(self, peer, make, step):
        b, me = self.world.board, self.rank
        with b.cond:
            self._raise_fault()
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
        with _waiting(self.world, self.rank):
            self._gossip_close_wait()

    def _gossip_close_wait(self):
        b, me = self.world.board, self.rank
        with b.cond:
            b.closed[me] = True
            b.key[me] = None
            b.parked[me] = True
            b.cond.notify_all()
            self._raise_fault()
            if b.fault is None:  # after a fault, the others stop without closing
                self._wait(lambda: all(b.closed[j] for j in b.neighbors[me]), "its neighbours to finish gossiping")


@contextlib.contextmanager
def pinned_threads(n: int = 1):
    """``torch.set_num_threads(n)`` for the block, restored afterwards (thread workers share the
    cores, and a benchmark times one thread); yields ``n``."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


def run_threads(world_size: int, fn: Callable[[Transport], T], *, max_running: int | None = None,
                device: torch.device | str | None = None) -> list[T]:
    """Run ``fn(transport)`` on ``world_size`` thread workers; results in rank order.

    ``max_running``: how many workers compute at once (see the module's run slots;
    default :func:`default_max_running`). ``device``: where the workers compute, if
    known; on CUDA, torch's lazily loaded CUDA linear algebra is loaded here, in the
    calling thread, before any worker starts (threads that load it at once fail with
    "lazy wrapper should be called at most once"). It is also loaded when the caller
    has already initialised CUDA.

    The first exception raised by any worker is re-raised here (after the
    others have been released from their waits).
    """
    world = ThreadWorld(world_size, max_running)
    prepare_cuda(device)
    results: list = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            world.run_slots.take(rank)
        except BaseException as e:  # noqa: BLE001 - aborted before it started
            errors[rank] = e
            return
        _current.world, _current.rank, _current.holding = world, rank, True
        try:
            results[rank] = fn(world.transport(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            world.abort()
        finally:
            _current.world = None
            if _current.holding:  # not when taking it back failed (an abort)
                world.run_slots.give()

    threads = [threading.Thread(target=body, args=(r,), name=f"lowbit-worker-{r}", daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results


_CUDA_LINALG_READY: set[int] = set()
_CUDA_LINALG_LOCK = threading.Lock()


def prepare_cuda(device: torch.device | str | None = None) -> None:
    """Load torch's CUDA linear-algebra library once per GPU, in this thread: torch
    loads it on the first linalg call, and worker threads making that call at the
    same time race its one-time loader. ``device``: a CUDA device to prepare; None
    prepares the current GPU only when CUDA is already initialised. No-op on the CPU."""
    if device is None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _CUDA_LINALG_LOCK:
        if device.index in _CUDA_LINALG_READY:
            return
        torch.linalg.qr(torch.eye(2, device=device))
        torch.cuda.synchronize(device)
        _CUDA_LINALG_READY.add(device.index)
