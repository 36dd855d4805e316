"""``torch.distributed`` runtime: one process per rank, gloo (CPU) or NCCL (CUDA).

Same contract as the in-process runtime (:mod:`lowbit.comm.inprocess`): every
op returns new tensors on the device of the tensor handed in, collectives list
ranks in rank order, and a neighbour exchange carries buffers whose sizes may
differ from rank to rank. Neighbour sets must be symmetric (``j`` in
``neighbors`` of ``i`` iff ``i`` in ``neighbors`` of ``j``), as in the
in-process runtime; a rank may list no neighbours at all.

Where the bytes travel is chosen by the backend of the default process group:
NCCL moves CUDA tensors (a CPU tensor is copied to the current CUDA device and
the result copied back), gloo moves CPU tensors (a CUDA tensor is staged
through the CPU).

Floating-point sums: gloo and NCCL add the ranks' tensors in their own order
(ring chunks), so a float ``all_reduce(..., "sum")`` can differ from the
in-process runtime in the last bits. ``deterministic=True`` makes floating sums
all-gather the tensors and add them in rank order, bit for bit what the
in-process runtime computes (at the cost of the all-gather's traffic; the
ledger still counts an all-reduce). Integer sums, max and min are exact either
way.

Asynchronous pairwise gossip (``Transport.gossip``, AD-PSGD) runs on a gloo process group
of its own: :mod:`lowbit.comm.gloo_gossip` describes the protocol.

A refusal another rank posts (``Transport.post_refusal``) ends every blocking wait of a gloo
transport within about a second, even while the refusing rank lives on
(:mod:`lowbit.comm.refusal_watch`).

Process group: the default one, or the group given as ``process_group``; ``rank``
and ``world_size`` are this rank's in that group, and neighbour ranks are group
ranks (translated to global ranks for point-to-point sends). Asynchronous gossip
needs the default group.

Futures: ``all_reduce_async`` and ``all_gather_async`` issue the collective with
``async_op=True`` and return ``work.get_future()`` chained to the same result as
the synchronous form (a new tensor on the input's device; with ``deterministic``,
a float sum all-gathers and adds in rank order in the future's callback). The
``latency_s`` delay is slept before the collective is issued, as for the
synchronous forms.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import time

import torch
import torch.distributed as dist

from .base import Transport, check_equal_sizes, then
from .gloo_gossip import GlooGossip
from .refusal_watch import REFUSAL_KEY, RefusalWatch, break_gloo, default_store, read_refusal

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND}
_ENV_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_NOT_WATCHED = contextlib.nullcontext()


class TorchDistributedTransport(GlooGossip, Transport):
    """Transport over an initialised ``torch.distributed`` process group.

    ``process_group``: the group its collectives run on (None: the default group); this
    rank must belong to it.
    ``owns_group``: :meth:`close` destroys the process group (set by
    :func:`init_from_env` when it created the group itself).
    ``deterministic``: float sums are reduced in rank order (see module doc).
    ``latency_s``: seconds added in user space before each op, once per
    message round of the alpha-beta model (:mod:`lowbit.comm.netmodel`):
    1 for a neighbour exchange (the neighbours' messages go in parallel),
    2(n-1) for an all-reduce, n-1 for an all-gather, ceil(log2 n) for a
    broadcast, 1 for a gather; for real links without ``netem``. Asynchronous
    gossip is not delayed.
    """

    def __init__(self, *, owns_group: bool = False, deterministic: bool = False, latency_s: float = 0.0,
                 process_group=None):
        if not (isinstance(latency_s, (int, float)) and 0 <= latency_s < math.inf):
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributedTransport needs an initialised torch.distributed default process group; "
                "call lowbit.comm.init_from_env() under torchrun, or use lowbit.comm.launch()"
            )
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError(f"process_group: global rank {dist.get_rank()} is not in the group it was given")
        if owns_group and process_group is not None:
            raise ValueError("owns_group: a transport owns only the default group it created (process_group=None)")
        super().__init__(rank, dist.get_world_size(process_group))
        self.group = process_group
        self.backend = str(dist.get_backend(process_group)).lower()
        self.deterministic = bool(deterministic)
        self.latency_s = float(latency_s)
        self._owns_group = owns_group
        self._nccl = "nccl" in self.backend
        self._cpu_ok = "gloo" in self.backend or "mpi" in self.backend or not self._nccl
        # Liveness: called with the step at set_step and with no argument whenever this rank
        # communicates (lowbit.comm.launch installs one that writes into shared memory).
        self.heartbeat = None
        # The largest buffer a peer may state in a neighbour exchange or gossip before this
        # rank allocates it (None: unbounded). lowbit's training loop and the wrapper set it
        # from the model's size (max_payload_nbytes); a larger stated size is a ValueError.
        self.max_message_bytes: int | None = None
        # A refusal another rank posts ends this rank's waits (lowbit.comm.refusal_watch), on gloo.
        self._watch = None
        if "gloo" in self.backend and self.world_size > 1:
            self._watch = RefusalWatch(functools.partial(read_refusal, self.MAX_REFUSAL_CHARS),
                                       functools.partial(break_gloo, process_group, (rank + 1) % self.world_size),
                                       rank)

    @property
    def reduce_ops(self) -> tuple[str, ...]:
        """NCCL has no bitwise AND: ``"band"`` only where gloo (or MPI) reduces."""
        return tuple(op for op in super().reduce_ops if op != "band" or not self._nccl)

    @property
    def local_world_size(self) -> int:
        """``LOCAL_WORLD_SIZE`` as torchrun sets it (1 if unset)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` as torchrun sets it (this rank if unset)."""
        return int(os.environ.get("LOCAL_RANK", self.rank))

    @property
    def channel(self) -> tuple:
        """The default process group of this process (:attr:`~lowbit.comm.base.Transport.channel`)."""
        return ("torch.distributed",)

    def __repr__(self) -> str:
        return f"TorchDistributedTransport(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    def set_step(self, step: int) -> None:
        super().set_step(step)
        if self.heartbeat is not None:
            self.heartbeat(step)

    def _beat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat()

    def _check_stated(self, n: int, src: int, what: str) -> int:
        """A size stated by peer ``src``, checked before anything is allocated for it."""
        limit = self.max_message_bytes
        if n < 0 or (limit is not None and n > limit):
            raise ValueError(f"rank {self.rank}: rank {src} stated a {what} of {n} bytes; this rank accepts "
                             f"0..{limit if limit is not None else 'any'} bytes (max_message_bytes, from the "
                             f"model's size): a corrupt or hostile peer")
        return n

    # ---- where the bytes travel ---------------------------------------------
    def _device(self, t: torch.Tensor) -> torch.device:
        """The device the backend moves ``t`` on."""
        if t.device.type == "cuda" and self._nccl:
            return t.device
        if self._cpu_ok:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _staged(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        """``t`` on the comm device, contiguous (a fresh copy if ``copy``)."""
        x = t.detach().to(self._device(t), copy=copy)
        return x if x.is_contiguous() else x.contiguous()

    def _delay(self, rounds: int) -> None:
        if self.latency_s > 0 and rounds > 0 and self.world_size > 1:
            time.sleep(rounds * self.latency_s)

    # ---- the runtime --------------------------------------------------------
    def _neighbor_exchange(self, buf, neighbors):
        peers = list(neighbors)  # distinct: checked by Transport.neighbor_exchange
        if not peers:
            return {}
        self._beat()
        self._delay(1)
        dev = self._device(buf)
        send = self._staged(buf, copy=False)  # only read
        with self._waiting("a neighbour exchange"):
            # 1) sizes: every buffer size is known before its bytes are posted.
            my_size = torch.tensor([send.numel()], dtype=torch.int64, device=dev)
            sizes = {j: torch.zeros(1, dtype=torch.int64, device=dev) for j in peers}
            _run_p2p([self._p2p(dist.irecv, sizes[j], j, 1) for j in peers]
                     + [self._p2p(dist.isend, my_size, j, 1) for j in peers])
            # 2) payloads; an empty buffer is not put on the wire (both sides know).
            stated = {j: self._check_stated(int(sizes[j].item()), j, "neighbour-exchange message") for j in peers}
            recv = {j: torch.empty(stated[j], dtype=torch.uint8, device=dev) for j in peers}
            _run_p2p([self._p2p(dist.irecv, recv[j], j, 2) for j in peers if recv[j].numel() > 0]
                     + [self._p2p(dist.isend, send, j, 2) for j in peers if send.numel() > 0])
        return {j: recv[j].to(buf.device) for j in peers}

    def _p2p(self, fn, t: torch.Tensor, peer: int, tag: int):
        """A point-to-point op with group rank ``peer`` (its global rank on the wire)."""
        if self.group is not None:
            peer = dist.get_global_rank(self.group, peer)
        return dist.P2POp(fn, t, peer, group=self.group, tag=tag)

    def _waiting(self, what: str):
        """The context around a blocking wait: a refusal another rank posts ends it
        (:class:`~lowbit.comm.refusal_watch.RefusalWatch`; gloo only)."""
        return _NOT_WATCHED if self._watch is None else self._watch.waiting(what)

    def _all_reduce(self, t, op):
        with self._waiting("an all-reduce"):
            return _wait(*self._start_all_reduce(t, op, async_op=False))

    def _all_reduce_async(self, t, op, inplace: bool = False):
        with self._waiting("an all-reduce"):
            return _future(*self._start_all_reduce(t, op, async_op=True, inplace=inplace), self._watch,
                           "an all-reduce")

    def _start_all_reduce(self, t, op, async_op: bool, inplace: bool = False):
        """Issue the all-reduce: (its work, None when synchronous; a function giving the result
        once it is done). ``inplace``: ``t`` itself is reduced where it is on the comm device
        and contiguous (else a copy, as always)."""
        self._beat()
        self._delay(2 * (self.world_size - 1))
        if self.deterministic and op == "sum" and t.is_floating_point() and self.world_size > 1:
            work, parts = self._start_gather_all(t, async_op)
            return work, lambda: _rank_order_sum(parts())
        x = self._staged(t, copy=not inplace)
        return dist.all_reduce(x, op=_REDUCE[op], group=self.group, async_op=async_op), lambda: x.to(t.device)

    def _all_gather(self, t):
        self._beat()
        self._delay(self.world_size - 1)
        with self._waiting("an all-gather"):
            return _wait(*self._start_gather_all(t, async_op=False))

    def _all_gather_fixed(self, t):
        self._beat()
        self._delay(self.world_size - 1)
        with self._waiting("an all-gather"):
            return _wait(*self._start_gather_all(t, async_op=False, agree_sizes=False))

    def _all_gather_async(self, t):
        self._beat()
        self._delay(self.world_size - 1)
        with self._waiting("an all-gather"):
            return _future(*self._start_gather_all(t, async_op=True), self._watch, "an all-gather")

    def _agree_sizes(self, x: torch.Tensor, what: str) -> None:
        """Before a collective whose every rank must hand in the same number of bytes (all-gather,
        gather): all-gather each rank's byte count (one int64; framing, not in the ledger, as a
        neighbour exchange's length prefix) and raise the same ValueError on every rank, naming
        the rank whose size differs from the most common one, instead of letting gloo abort the
        process ("Received data size doesn't match expected size")."""
        if self.world_size == 1:
            return
        mine = torch.tensor([x.numel() * x.element_size()], dtype=torch.int64, device=x.device)
        sizes = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(sizes, mine, group=self.group)
        check_equal_sizes(self.rank, [int(v) for v in torch.cat(sizes).tolist()], what)

    def _start_gather_all(self, t, async_op: bool, agree_sizes: bool = True):
        """Issue an all-gather of ``t`` (no delay, no beat; the sizes agreed first, synchronously,
        unless ``agree_sizes`` is False: a shape fixed by the program, :meth:`all_gather_fixed`):
        (its work, None when synchronous; a function giving every rank's tensor in rank order on
        ``t``'s device once it is done)."""
        x = self._staged(t, copy=False)
        if agree_sizes:
            self._agree_sizes(x, "an all-gather payload")
        outs = [torch.empty_like(x) for _ in range(self.world_size)]
        work = dist.all_gather(outs, x, group=self.group, async_op=async_op)
        return work, lambda: [o.to(t.device) for o in outs]

    def _broadcast(self, t, src):
        self._beat()
        self._delay(math.ceil(math.log2(self.world_size)) if self.world_size > 1 else 0)
        if self.rank == src:
            x = self._staged(t, copy=True)
        else:
            x = torch.empty(t.shape, dtype=t.dtype, device=self._device(t))
        with self._waiting("a broadcast"):
            dist.broadcast(x, self._global(src), group=self.group)
        return x.to(t.device)

    def _gather(self, t, dst):
        self._beat()
        self._delay(1)
        if self._nccl:  # NCCL gather support varies by version: all-gather, keep dst's copy
            parts = _wait(*self._start_gather_all(t, async_op=False))
            return parts if self.rank == dst else None
        x = self._staged(t, copy=False)
        with self._waiting("a gather"):
            self._agree_sizes(x, "a gather payload")
            outs = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
            dist.gather(x, outs, dst=self._global(dst), group=self.group)
        return [o.to(t.device) for o in outs] if outs is not None else None

    def _barrier(self):
        self._beat()
        if self._nccl and torch.cuda.is_available():
            dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        else:
            with self._waiting("a barrier"):
                dist.barrier(group=self.group)

    def _global(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (a root of broadcast and gather)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # ---- a refusal that ends the run: the default group's store ---------------
    def _store(self):
        return default_store()

    def _post_refusal(self, text):
        store = self._store()
        if store is None:
            return super()._post_refusal(text)
        try:
            store.compare_set(REFUSAL_KEY, "", text)
        except RuntimeError:  # the store is gone: the others learn it from their failure alone
            pass

    def _posted_refusal(self):
        if self._store() is None:
            return super()._posted_refusal()
        return read_refusal(self.MAX_REFUSAL_CHARS)

    def close(self) -> None:
        """Stop the refusal watch; destroy the process group if this transport created it
        (idempotent)."""
        if self._watch is not None:
            self._watch.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _wait(work, result):
    """``result()`` once ``work`` is done: a synchronous op (``work`` None; torch waited, as with
    ``async_op=False``, which an exit right after a run needs: waiting on the work of an
    ``async_op=True`` op instead left gloo aborting at exit in 1-3 of 12 two-process runs of
    tests/wrapper_user_loop.py) or an asynchronous one waited for here (its error raised)."""
    if work is not None:
        work.wait()
    return result()


def _future(work, result, watch: RefusalWatch | None = None, what: str = "") -> torch.futures.Future:
    """The future of ``result()`` once ``work`` has finished (its error re-raised in the future),
    through :func:`~lowbit.comm.base.then`: an NCCL collective's future is done once its kernels
    are queued, so the result is read at once after ``wait()``, without a ``Future.then`` hop
    and its CUDA events (the DDP hooks chain one more step on this future). With a ``watch``
    (gloo), unfinished work is tracked, and a refusal that ended it is the future's error."""
    fut = work.get_future()
    if watch is None or fut.done():
        return then(fut, lambda _: result())
    watch.track(work)

    def done(f):
        try:
            f.value()
        except RuntimeError as e:
            watch.check(what, e)
            raise
        watch.check(what)
        return result()

    return fut.then(done)


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts`` added in rank order (what the in-process runtime computes)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc


def _run_p2p(ops) -> None:
    """Start ``ops`` in order and wait for all. Callers list every receive before any
    send. With the sends first, gloo let two simultaneous transfers between a pair go
    one after the other in every other exchange (measured over a shaped 5 Mbit/s link:
    614 KB exchanges took 1.02 s and 2.24 s alternately; with the receives posted
    first, 1.02 s each, as the network model says)."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def default_backend() -> str:
    """``nccl`` when CUDA is present and this host's processes (torchrun's
    ``LOCAL_WORLD_SIZE``, 1 if unset) do not outnumber its visible GPUs, so each
    process has a GPU of its own; else ``gloo``, under which processes share the
    GPUs (local rank r computes on GPU r modulo their number; gloo stages CUDA
    tensors through the CPU)."""
    if not torch.cuda.is_available():
        return "gloo"
    local_world = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else 1
    return "nccl" if local_world <= torch.cuda.device_count() else "gloo"


def init_from_env(
    backend: str | None = None, *, timeout_s: float | None = None, deterministic: bool = False, latency_s: float = 0.0
) -> TorchDistributedTransport:
    """Join a ``torchrun``-style launch and return this rank's transport.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (required)
    and ``LOCAL_RANK`` (the CUDA device for NCCL; default ``RANK`` modulo the
    number of visible GPUs). ``backend``: :func:`default_backend` if None
    (``"nccl"`` with a GPU per process, else ``"gloo"``). If the default process group already exists it is reused
    (and not destroyed by :meth:`~TorchDistributedTransport.close`).
    ``latency_s``: user-space latency per message (see the transport).
    """
    if dist.is_initialized():
        return TorchDistributedTransport(owns_group=False, deterministic=deterministic, latency_s=latency_s)
    missing = [v for v in _ENV_REQUIRED if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env: environment variable(s) {', '.join(missing)} not set; "
            f"it needs {', '.join(_ENV_REQUIRED)} (and LOCAL_RANK): start the script with torchrun "
            "or run it through lowbit.comm.launch()"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} / WORLD_SIZE={world_size}: need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE")
    if backend is None:
        backend = default_backend()
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=float(timeout_s))
    if "nccl" in backend.lower():
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend={backend!r} needs CUDA, which is not available here; use backend='gloo'")
        count = torch.cuda.device_count()
        local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank % count
        local_world = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else None
        if not 0 <= local < count or (local_world is not None and local_world > count):
            procs = f"{local_world} processes on this host" if local_world is not None else f"LOCAL_RANK={local}"
            raise ValueError(
                f"backend={backend!r}: {procs} but only {count} CUDA device(s) visible, and NCCL needs a GPU of "
                f"its own for each process. Start at most {count} per host (torchrun --nproc-per-node {count}), "
                f"make more GPUs visible (CUDA_VISIBLE_DEVICES), or use backend='gloo', which shares the GPUs "
                f"(the default when processes outnumber GPUs)")
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A torchrun restart reuses the agent's store, where the previous attempt's ranks left
        # their gloo addresses: a restarted rank could read a dead peer's address and fail to
        # connect. Each attempt gets its own key space.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), world_size, is_master=False,
                              timeout=kwargs.get("timeout", datetime.timedelta(minutes=30)))
        store = dist.PrefixStore(f"lowbit/attempt_{restart}/", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    return TorchDistributedTransport(owns_group=True, deterministic=deterministic, latency_s=latency_s)


def max_payload_nbytes(numel: int) -> int:
    """The bound a receiver puts on a buffer a peer states for a model of ``numel``
    parameters: 8 bytes per element (twice an fp32 model, the widest message a lowbit
    algorithm sends to a neighbour: fp32 gossip or repair values; entropy coding's
    worst-case growth and Moniqua's hashes and requests fit in the rest) plus 64 KiB
    for headers."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    return 8 * numel + 65536
