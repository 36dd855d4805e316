"""The Transport contract: what an algorithm may ask of the network.

Public methods record every op in the rank's :class:`~lowbit.comm.ledger.Ledger`
(one place, so every transport counts the same way) and delegate the moving
of bytes to the ``_``-prefixed methods a transport implements.

``all_reduce_async`` and ``all_gather_async`` are the asynchronous forms of two
collectives: they record the op when it is issued, exactly as the synchronous
form does, and return a :class:`torch.futures.Future` of what the synchronous
form returns. A transport that cannot overlap (the in-process runtime) gives a
completed future of the synchronous op; :class:`~lowbit.comm.distributed.
TorchDistributedTransport` issues the collective with ``async_op=True``.
:func:`then` chains a step on such a future (at once when it is done).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch

from .ledger import CommRecord, Ledger
from .netmodel import op_messages_and_bytes

#: element-wise reductions of :meth:`Transport.all_reduce`; ``"band"`` is the bitwise AND of
#: integer tensors (e.g. the MIN of packed bit-planes).
REDUCE_OPS = ("sum", "max", "min", "band")

# handler(src, step, request) -> reply: what a passive worker does with a gossip request.
GossipHandler = Callable[[int, int, torch.Tensor], torch.Tensor]
# clock(step) -> the virtual time of this rank's gossip at its step (in-process schedule).
GossipClock = Callable[[int], float]


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

    def _record(self, op: str, nbytes: int, peers: int = 1, root: bool = False, force: bool = False) -> None:
        messages, sent = op_messages_and_bytes(op, nbytes, self.world_size, peers=peers, root=root)
        self.ledger.record(CommRecord(op, nbytes, sent, messages, peers), force=force)

    def _checked_neighbors(self, neighbors: Sequence[int]) -> tuple[int, ...]:
        """``neighbors`` as a tuple of ints: distinct ranks other than this one (ValueError otherwise)."""
        neighbors = tuple(int(j) for j in neighbors)
        if len(set(neighbors)) != len(neighbors):
            raise ValueError(f"neighbors of rank {self.rank} must be distinct, got {neighbors}")
        for j in neighbors:
            if not 0 <= j < self.world_size or j == self.rank:
                raise ValueError(f"neighbor {j} of rank {self.rank} is not another rank in [0, {self.world_size - 1}]")
        return neighbors

    # ---- the contract ----------------------------------------------------
    def neighbor_exchange(self, buf: torch.Tensor, neighbors: Sequence[int]) -> dict[int, torch.Tensor]:
        """Send the 1-D uint8 ``buf`` to every rank in ``neighbors`` and receive
        one buffer from each of them (sizes may differ between ranks). The
        neighbour relation must be symmetric: j lists i whenever i lists j."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise TypeError(f"neighbor_exchange sends 1-D uint8 buffers, got {buf.dtype} {tuple(buf.shape)}")
        neighbors = self._checked_neighbors(neighbors)
        self._record("neighbor", buf.numel(), peers=len(neighbors))
        return self._neighbor_exchange(buf, neighbors)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Element-wise reduction over ranks (``op`` one of :data:`REDUCE_OPS`); returns a
        new tensor. Integer sums wrap like the dtype does: pick a dtype wide enough."""
        self._record_reduce(t, op)
        return self._all_reduce(t, op)

    def all_reduce_async(self, t: torch.Tensor, op: str = "sum", *, inplace: bool = False) -> torch.futures.Future:
        """:meth:`all_reduce` issued now, its result a future (recorded like it, at issue).
        ``inplace``: the caller gives ``t`` up; a backend that reduces in place may then reduce
        ``t`` itself instead of a copy (the result may be ``t``, and ``t`` is undefined after)."""
        self._record_reduce(t, op)
        return self._all_reduce_async(t, op, inplace)

    @property
    def reduce_ops(self) -> tuple[str, ...]:
        """The ops of :data:`REDUCE_OPS` this transport's backend reduces (all by default)."""
        return REDUCE_OPS

    @property
    def local_world_size(self) -> int:
        """Workers of this world on this worker's host (its node): 1 by default, every worker
        its own node (the thread runtime); a launcher's ``LOCAL_WORLD_SIZE`` on torch.distributed."""
        return 1

    @property
    def local_rank(self) -> int | None:
        """This worker's index on its host when every worker is a process of its own (its GPU is
        this index, modulo the GPUs there); None (default) when the workers share one process
        (the thread runtime: they use the process's current device)."""
        return None

    @property
    def channel(self) -> tuple:
        """A hashable key of the channel this transport's operations travel on: transports with
        equal keys share it (one process group; one rank of a thread world), and ranks must issue
        the operations on it in program order, one at a time (the wrapper's overlapped exchanges
        take turns on it). Default: this transport alone."""
        return ("transport", id(self))

    def _record_reduce(self, t: torch.Tensor, op: str) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if op not in self.reduce_ops:
            raise ValueError(f"op {op!r} is not reduced by {self!r}: it reduces {self.reduce_ops}")
        if op == "band" and (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"op 'band' (bitwise AND) needs an integer tensor, got {t.dtype}")
        self._record("all_reduce", t.numel() * t.element_size())

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (same shape and dtype on all ranks), in rank order."""
        self._record("all_gather", t.numel() * t.element_size())
        return self._all_gather(t)

    def all_gather_fixed(self, t: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`all_gather` of a tensor whose shape and dtype the program itself fixes on every
        rank (a control row, as the fault agreement's): a runtime may skip the size round it
        runs before a payload's all-gather, a round that is itself such a row (one int64)."""
        self._record("all_gather", t.numel() * t.element_size())
        return self._all_gather_fixed(t)

    def all_gather_async(self, t: torch.Tensor) -> torch.futures.Future:
        """:meth:`all_gather` issued now, its list of tensors a future (recorded like it, at issue)."""
        self._record("all_gather", t.numel() * t.element_size())
        return self._all_gather_async(t)

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

    # ---- pairwise asynchronous gossip (AD-PSGD) ---------------------------
    # Not SPMD-lockstep: a worker (active) sends a request to ONE neighbour and
    # gets that neighbour's reply; the neighbour (passive) answers with its
    # ``handler`` without taking part in the call (a background responder
    # thread on torch.distributed; in-process, the active thread runs the
    # passive's handler at the turn the seeded schedule gives the exchange).
    # Ledger: the active side counts its request and the passive side its reply,
    # each as a one-peer "neighbor" message at its own current step; the small
    # fixed header (kind, length, step) is framing and is not counted.
    # Faults: ``gossip_fault(word, step)`` tells the others that this rank stops
    # (``word``: lowbit.algorithms.faults.fault_code); every rank that hears it
    # (directly, forwarded, or in a reply) raises :class:`GossipFault` at its next
    # gossip, or in ``gossip_close``; a message kind of the header, so a fault-free
    # run sends the same bytes as before.
    def gossip_open(self, neighbors: Sequence[int], handler: GossipHandler, *,
                    clock: GossipClock | None = None) -> None:
        """Start answering gossip requests from ``neighbors`` with
        ``handler(src, step, request) -> reply`` (1-D uint8 buffers; ``step``
        is the requester's step). Every rank calls it once, at the same point
        of the program (on torch.distributed it creates a process group).
        ``clock(step)``: the virtual time of this rank's gossip at ``step``,
        which orders the exchanges of the in-process runtime (default: the
        step itself); the torch runtime ignores it (real time orders them)."""
        if getattr(self, "_gossip_peers", None) is not None:
            raise RuntimeError(f"rank {self.rank}: gossip_open called twice without gossip_close")
        peers = self._checked_neighbors(neighbors)
        if not callable(handler):
            raise TypeError(f"handler must be callable(src, step, request) -> reply, got {handler!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be callable(step) -> float or None, got {clock!r}")

        def answer(src: int, step: int, request: torch.Tensor) -> torch.Tensor:
            reply = handler(src, step, request)
            _check_u8(reply, "a gossip handler's reply")
            self._record("neighbor", reply.numel(), force=True)
            return reply

        self._gossip_peers = peers
        self._gossip_open(peers, answer, clock if clock is not None else float)

    def gossip(self, peer: int, request, step: int) -> torch.Tensor:
        """Send ``request`` (a 1-D uint8 buffer, or a callable returning one) to
        neighbour ``peer`` as this rank's gossip at ``step``; return ``peer``'s
        reply (its handler's output). A callable is called when the request
        really leaves: in-process, at the exchange's turn in the schedule, so
        the request carries the model as it is then."""
        peers = getattr(self, "_gossip_peers", None)
        if peers is None:
            raise RuntimeError(f"rank {self.rank}: call gossip_open before gossip")
        if peer not in peers:
            raise ValueError(f"peer must be one of rank {self.rank}'s gossip neighbours {peers}, got {peer!r}")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not callable(request):
            _check_u8(request, "gossip")

        def make() -> torch.Tensor:
            buf = request() if callable(request) else request
            _check_u8(buf, "gossip")
            self._record("neighbor", buf.numel(), force=True)
            return buf

        return self._gossip(peer, make, step)

    # ---- a refusal that ends the run ---------------------------------------
    #: the longest refusal text :meth:`post_refusal` keeps and :meth:`posted_refusal` reads
    MAX_REFUSAL_CHARS = 4096

    def post_refusal(self, text: str) -> None:
        """Leave ``text`` (a rank's refusal of a peer's payload, which ends this rank) where every
        rank can read it without a matching collective: the others' communication then fails
        (this rank is gone, or out of step) and :meth:`posted_refusal` tells them why. The first
        text posted wins. In-process: the world's memory; torch: the default group's store."""
        self._post_refusal(str(text)[:self.MAX_REFUSAL_CHARS])

    def posted_refusal(self) -> str | None:
        """The refusal some rank posted (:meth:`post_refusal`), or None."""
        text = self._posted_refusal()
        return None if text is None else str(text)[:self.MAX_REFUSAL_CHARS]

    def _post_refusal(self, text: str) -> None:
        self._refusal = getattr(self, "_refusal", None) or text  # a lone transport: only this rank reads it

    def _posted_refusal(self) -> str | None:
        return getattr(self, "_refusal", None)

    def gossip_fault(self, word: int, step: int) -> None:
        """This rank stops at ``step`` with the fault ``word`` (an int64): tell every gossip
        neighbour (each forwards it to its own, so it reaches every rank that gossips), who
        then raise :class:`GossipFault`; this rank's own ``gossip_close`` then returns
        without waiting on the others. No-op when the gossip is not open."""
        if getattr(self, "_gossip_peers", None) is None:
            return
        if not (isinstance(word, int) and isinstance(step, int) and 0 <= word < 1 << 62 and 0 <= step < 1 << 62):
            raise ValueError(f"word and step must be ints in [0, 2^62), got {word!r}, {step!r}")
        self._gossip_fault(word, step)

    def gossip_close(self) -> None:
        """This rank sends no more requests; keep answering until every
        neighbour has closed too, then stop answering (idempotent). After a fault
        (:meth:`gossip_fault`, or one heard and not yet raised here): raises that
        :class:`GossipFault` unless this rank has already raised it or sent it."""
        if getattr(self, "_gossip_peers", None) is None:
            return
        try:
            self._gossip_close()
        finally:
            self._gossip_peers = None

    def _gossip_open(self, neighbors, handler, clock) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support asynchronous gossip")

    def _gossip(self, peer, make, step) -> torch.Tensor:
        """Call ``make()`` for the request buffer when it is sent; return the reply."""
        raise NotImplementedError(f"{type(self).__name__} does not support asynchronous gossip")

    def _gossip_close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support asynchronous gossip")

    def _gossip_fault(self, word: int, step: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support asynchronous gossip")

    # ---- what a runtime implements ----------------------------------------
    @abstractmethod
    def _neighbor_exchange(self, buf, neighbors) -> dict[int, torch.Tensor]: ...

    @abstractmethod
    def _all_reduce(self, t, op) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, t) -> list[torch.Tensor]: ...

    def _all_reduce_async(self, t, op, inplace: bool = False) -> torch.futures.Future:
        """A completed future of :meth:`_all_reduce` (a runtime that can overlap overrides it)."""
        return completed(self._all_reduce(t, op))

    def _all_gather_fixed(self, t) -> list[torch.Tensor]:
        """:meth:`_all_gather` (a runtime that agrees sizes first overrides it)."""
        return self._all_gather(t)

    def _all_gather_async(self, t) -> torch.futures.Future:
        """A completed future of :meth:`_all_gather` (a runtime that can overlap overrides it)."""
        return completed(self._all_gather(t))

    @abstractmethod
    def _broadcast(self, t, src) -> torch.Tensor: ...

    @abstractmethod
    def _gather(self, t, dst): ...

    @abstractmethod
    def _barrier(self) -> None: ...

    def close(self) -> None:
        """Release runtime resources (no-op by default)."""


class GossipFault(Exception):
    """A rank that gossips stopped on a fault: ``word`` (what
    :meth:`Transport.gossip_fault` was given; :func:`lowbit.algorithms.faults.fault_from_code`
    reads it) at ``step``, heard from neighbour ``src``."""

    def __init__(self, word: int, step: int, src: int):
        super().__init__(word, step, src)
        self.word, self.step, self.src = word, step, src

    def __str__(self) -> str:
        return f"a gossip fault (word {self.word}, step {self.step}) heard from rank {self.src}"


def completed(value) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def then(fut: torch.futures.Future, fn: Callable) -> torch.futures.Future:
    """The future of ``fn(fut's value)``. When ``fut`` is already done (the in-process runtime),
    ``fn`` runs at once and an error it raises propagates here with its own type (inside a
    ``.then`` callback it would reach ``wait()`` as a RuntimeError); otherwise ``fut.then``.
    A done future is read with ``wait()``, not ``value()``: an NCCL collective's future is done
    once its kernels are queued, and only ``wait()`` makes the current CUDA stream wait for them
    (reading the gathered payloads without it decoded stale memory: on an H200, 1-5 of 21 DDP
    hook tests a run)."""
    if fut.done():
        return completed(fn(fut.wait()))
    return fut.then(lambda f: fn(f.value()))


def check_equal_sizes(rank: int, sizes: list[int], what: str) -> None:
    """Rank ``rank``'s check of every rank's byte count ``sizes`` (rank order) of a collective
    that needs one size on all ranks: the same ValueError on every rank when they differ,
    naming the rank whose size differs from the most common one (ties: the lowest rank's)."""
    if len(set(sizes)) <= 1:
        return
    common = max(sizes, key=lambda v: (sizes.count(v), -sizes.index(v)))
    odd = next(r for r, v in enumerate(sizes) if v != common)
    others = [r for r, v in enumerate(sizes) if v == common]
    who = f"rank {others[0]} handed" if len(others) == 1 else f"the other ranks ({', '.join(map(str, others))}) handed"
    raise ValueError(f"rank {rank}: rank {odd} handed {what} of {sizes[odd]} bytes while {who} {common} bytes "
                     f"(all sizes by rank: {sizes}); every rank must hand in the same size: a corrupt or hostile peer")


def _check_u8(buf, what: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise TypeError(f"{what} sends 1-D uint8 buffers, got {got}")
