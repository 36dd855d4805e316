"""Bagua's low precision decentralized SGD (``LowPrecisionDecentralizedAlgorithm``;
source document ``seeds/001``), computed as Bagua computes it.

The text (worker i, step t)::

    1: g_t = grad F_i(x_t)
    2: x_{t+1/2} = sum_j W_ij xh_t^(j) - gamma g_t     (the text's ``x_{t+1}`` inside
                   the sum is a known slip for the replicas xh^(j); xh^(i) = x_t)
    3: z_t = x_{t+1/2} - x_t,  Q(z_t)                  (min-max, 8 bits)
    4: x_{t+1} = x_t + Q(z_t)
    5: send Q(z_t) to the peers; xh_{t+1}^(j) = xh_t^(j) + Q(z_t^(j))

Bagua's implementation (``peer_selection="all"`` here), which this class follows
operation by operation:

* **After the optimizer step.** Bagua's hook runs after ``optimizer.step()``:
  the optimizer has turned the model ``w`` into ``x = w - gamma d(g)`` (``d``:
  SGD with its momentum and weight decay, applied at ``w``), then, per bucket,
  in float32 with float32 factors::

      t = x + left / 3 + right / 3 - 5/3 w     (= (left + w + right)/3 + (x - w) - w: z_t)
      send Q(t) to the left and to the right ring neighbour, receive theirs
      left += Q(t_left);  right += Q(t_right);  w = Q(t) + w;  x = w

  ``w``, ``left``, ``right``: this worker's model and its replicas of its ring
  neighbours, as of the last communication (all start as the initial model).
* **The ring, with weights 1/3.** On 2 nodes the one peer is both the left and
  the right neighbour: it receives the message twice and is mixed twice, i.e.
  weights 1/3 self, 2/3 peer. On 1 node the worker is its own neighbour
  (nothing is sent; the step is ``w += Q(x - w)``).
* **Buckets.** Bagua groups the parameters, in reverse order, into buckets of
  at least ``bucket_bytes`` (10 MiB by default; a tensor is never split) and
  quantizes each bucket with its own min and max: one message per bucket and
  neighbour. ``param_sizes`` (element counts of the module's parameters, in
  the flat vector's order) gives the tensors; without it the flat vector is cut
  into consecutive slices of ``bucket_bytes``.
* **Step 0.** No model is sent before training: Bagua starts every replica from
  the worker's own initial model, assuming all workers start equal (it
  broadcasts rank 0's model). :meth:`setup` checks that assumption (an
  untracked max/min all-reduce) and raises if the models differ.
* **Hierarchical** (``hierarchical=True``, Bagua's default): the workers of a
  node (``node_size`` consecutive ranks; under torchrun ``LOCAL_WORLD_SIZE``)
  average ``x`` at the node's first rank (the leader), the leaders run the step
  above on the ring of nodes, and each leader sends the result back to its
  node. Here the average and the broadcast go by neighbour exchanges between
  the leader and its node's workers (the leader gathers the members' ``x``
  and sends ``w`` back; the other direction of each exchange is empty); only
  leaders keep ``w``, ``left`` and ``right``.
* **communication_interval** ``I``: steps ``k`` with ``k % I == 0`` communicate;
  between them each worker only takes its optimizer steps.
* **Wire** (the ledger): per bucket of ``n`` elements and neighbour one
  message of ``32 + align32(n)`` bytes (:class:`~lowbit.codecs.BaguaMinMaxCodec`),
  on 2 nodes twice to the same peer, as Bagua sends it.

``codec``: Bagua's ``BaguaMinMaxCodec`` by default; lowbit's ``MinMaxCodec``
(any ``bits``, ``rounding``) or the lossless ``IdentityCodec`` may replace it.

``peer_selection="shift_one"`` is lowbit's own variant: Bagua has no
low-precision shift_one (its ``shift_one`` exists only at full precision). See
:class:`ShiftOneLowPrecision`.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from ..codecs import Codec, IdentityCodec, MinMaxCodec
from ..codecs.bagua_minmax import BaguaMinMaxCodec
from ..codecs.quantize import check_rounding
from ..codecs.rng import shared_generator
from .legacy import Algorithm
from .dcd import DCDPSGD
from .gossip import exchange_compressed, exchange_initial_models

PEER_SELECTIONS = ("all", "shift_one")
BAGUA_BUCKET_BYTES = 10 * 1024 ** 2  # Bagua's default bucket size
THIRD = float(np.float32(1.0 / 3.0))  # Bagua's factors, as the float32 its kernel receives
MINUS_FIVE_THIRDS = float(np.float32(-5.0 / 3.0))


def shift_one_peer(rank: int, n: int, step: int) -> int:
    """Bagua's shift_one peer of ``rank`` at communication step ``step`` (n even)."""
    if n < 2 or n % 2:
        raise ValueError(f"peer_selection='shift_one' needs an even number of workers >= 2, got {n}")
    h = n // 2
    if rank < h:
        return h + (step + rank) % h
    return (rank - h - step) % h


def bagua_buckets(numel: int, element_size: int, bucket_bytes: int,
                  param_sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The (start, end) slices of the flat vector that Bagua's buckets hold.

    With ``param_sizes`` (the tensors' element counts in flat order): the tensors
    taken in reverse order, a bucket closed once it holds >= ``bucket_bytes``
    (``split_bucket_by_bucket_size``); the slices come in Bagua's bucket order.
    Without: consecutive slices of ``ceil(bucket_bytes / element_size)`` elements."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    if param_sizes is None:
        step = -(-bucket_bytes // element_size)
        return [(s, min(s + step, numel)) for s in range(0, numel, step)]
    sizes = [int(s) for s in param_sizes]
    if any(s < 1 for s in sizes) or sum(sizes) != numel:
        raise ValueError(f"param_sizes must be positive element counts summing to the model's {numel} "
                         f"elements, got {len(sizes)} sizes summing to {sum(sizes)}")
    ends = np.cumsum(sizes).tolist()
    out, end, held = [], None, 0
    for i in reversed(range(len(sizes))):
        if end is None:
            end = ends[i]
        held += sizes[i] * element_size
        if held >= bucket_bytes:
            out.append((ends[i] - sizes[i], end))
            end, held = None, 0
    if end is not None:
        out.append((0, end))
    return out


def default_node_size(transport) -> int:
    """Workers per node: ``LOCAL_WORLD_SIZE`` on a torch.distributed transport (torchrun
    sets it), else 1 (the thread runtime: every worker its own node unless told)."""
    from ..comm.distributed import TorchDistributedTransport

    if isinstance(transport, TorchDistributedTransport):
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return 1


class LowPrecisionDecentralized(Algorithm):
    """Bagua's ``LowPrecisionDecentralizedAlgorithm`` (see the module docstring).

    Options: ``hierarchical`` (Bagua's default True), ``communication_interval``
    (>= 1), ``node_size`` (workers per node; None: ``LOCAL_WORLD_SIZE`` under
    torchrun, else 1), ``bucket_bytes`` (Bagua's 10 MiB), ``param_sizes``,
    ``codec`` (Bagua's MinMaxUInt8 by default), ``peer_selection``
    (``"all"``: Bagua's ring; ``"shift_one"``: lowbit's own variant).
    ``bits``/``rounding`` build lowbit's ``MinMaxCodec`` when given other than
    Bagua's (8, "nearest") and no codec is passed.

    Extra memory on a leader: ``w``, ``left``, ``right``: 3 x d (Bagua's states);
    0 on the other workers of a node."""

    name = "lowprec-decentralized"
    family = "decentralized"
    codecs = ("bagua_minmax", "minmax", "fp32")

    @classmethod
    def check_config(cls, cfg):
        if cfg.peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"peer_selection must be one of {PEER_SELECTIONS}, got {cfg.peer_selection!r}")
        if cfg.peer_selection == "shift_one":
            shift_one_peer(0, cfg.workers, 0)  # n even
        if (cfg.codec or cls.codecs[0]) == "bagua_minmax" and cfg.rounding not in (None, "nearest"):
            raise ValueError(f"rounding={cfg.rounding!r}: Bagua's min-max codec rounds to nearest; "
                             f"use --codec minmax for stochastic rounding")
        for name, lo in (("communication_interval", 1), ("bucket_bytes", 1)):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        L = cfg.node_size
        if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1 or cfg.workers % L):
            raise ValueError(f"node_size must be an int >= 1 dividing workers={cfg.workers}, got {L!r}")
        if cfg.topology != "ring":
            raise ValueError(f"topology={cfg.topology!r}: Bagua's low precision decentralized SGD gossips on a ring")
        if cfg.weights != "uniform":
            raise ValueError(f"weights={cfg.weights!r}: Bagua's ring weights are uniform (1/3)")

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, codec=cfg.make_codec(cls.codecs), peer_selection=cfg.peer_selection,
                   seed=cfg.seed, hierarchical=cfg.hierarchical,
                   communication_interval=cfg.communication_interval, node_size=cfg.node_size,
                   bucket_bytes=cfg.bucket_bytes)

    def __init__(self, transport, topology=None, *, bits: int = 8, rounding: str = "nearest",
                 peer_selection: str = "all", codec: Codec | None = None, weights: str = "uniform",
                 seed: int = 0, hierarchical: bool = True, communication_interval: int = 1,
                 node_size: int | None = None, bucket_bytes: int = BAGUA_BUCKET_BYTES,
                 param_sizes: Sequence[int] | None = None):
        super().__init__(transport, seed=seed)
        if peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"peer_selection must be one of {PEER_SELECTIONS}, got {peer_selection!r}")
        check_rounding(rounding)
        if codec is None:
            bagua = (bits, rounding) == (8, "nearest")
            codec = BaguaMinMaxCodec() if bagua else MinMaxCodec(bits=bits, rounding=rounding)
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a lowbit Codec, got {type(codec).__name__}")
        if not isinstance(codec, (BaguaMinMaxCodec, MinMaxCodec, IdentityCodec)):
            raise ValueError(f"codec must be BaguaMinMaxCodec, MinMaxCodec or IdentityCodec, got {codec!r}")
        if topology is not None and (topology.name != "ring" or topology.n != self.world_size):
            raise ValueError(f"topology must be a ring of the {self.world_size} workers (Bagua gossips on a ring), "
                             f"got {topology.name} of {topology.n}")
        if weights != "uniform":
            raise ValueError(f"weights must be 'uniform' (Bagua's ring weights 1/3), got {weights!r}")
        if not isinstance(hierarchical, bool):
            raise ValueError(f"hierarchical must be True or False, got {hierarchical!r}")
        if isinstance(communication_interval, bool) or not isinstance(communication_interval, int) \
                or communication_interval < 1:
            raise ValueError(f"communication_interval must be an int >= 1, got {communication_interval!r}")
        bagua_buckets(0, 4, bucket_bytes)  # validates bucket_bytes
        self.codec = codec
        self.bits = bits
        self.rounding = rounding
        self.peer_selection = peer_selection
        self.hierarchical = bool(hierarchical)
        self.communication_interval = communication_interval
        self.bucket_bytes = bucket_bytes
        self.param_sizes = None if param_sizes is None else tuple(int(s) for s in param_sizes)
        n = self.world_size
        if peer_selection == "shift_one":
            if self.hierarchical and (node_size or 1) > 1:
                raise ValueError("peer_selection='shift_one' (lowbit's own) has no hierarchical mode; "
                                 "pass hierarchical=False or node_size=1")
            if communication_interval != 1:
                raise ValueError("peer_selection='shift_one' (lowbit's own) communicates every step: "
                                 "communication_interval must be 1")
            self._shift = ShiftOneLowPrecision(transport, codec=codec, seed=seed)
            self.node_size = 1
            return
        self._shift = None
        L = default_node_size(transport) if node_size is None else node_size
        if isinstance(L, bool) or not isinstance(L, int) or L < 1 or n % L:
            raise ValueError(f"node_size must be an int >= 1 dividing the {n} workers, got {L!r}")
        self.node_size = L if self.hierarchical else 1
        L = self.node_size
        self.node, self.local_rank = divmod(self.rank, L)
        self.nodes = n // L
        self.leader = self.node * L
        self.members = tuple(range(self.leader + 1, self.leader + L))  # the leader's workers
        m, v = self.nodes, self.node
        self.left = ((v - 1) % m) * L   # the leaders of the neighbour nodes on the ring of nodes
        self.right = ((v + 1) % m) * L
        self.w: torch.Tensor | None = None
        self.left_w: torch.Tensor | None = None
        self.right_w: torch.Tensor | None = None
        self.buckets: list[tuple[int, int]] = []

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def state_tensors(self):
        if self._shift is not None:
            return self._shift.state_tensors()
        if self.w is None:
            return {}
        return {"weight": self.w, "left_peer_weight": self.left_w, "right_peer_weight": self.right_w}

    def setup(self, x):
        if self._shift is not None:
            return self._shift.setup(x)
        with self.transport.untracked():  # Bagua's assumption: every worker starts from one model
            same = self.world_size == 1 or torch.equal(self.transport.all_reduce(x.detach(), "max"),
                                                       self.transport.all_reduce(x.detach(), "min"))
        if not same:
            raise ValueError("lowprec-decentralized: the workers' initial models differ; Bagua starts every "
                             "replica from the worker's own model and sends none (with_bagua broadcasts rank 0's "
                             "model first): start all workers from the same parameters")
        self.buckets = bagua_buckets(x.numel(), x.element_size(), self.bucket_bytes, self.param_sizes)
        if self.is_leader:
            self.w, self.left_w, self.right_w = (x.detach().clone() for _ in range(3))

    def before_update(self, k, x, g, lr):
        if self._shift is not None:
            self._shift.before_update(k, x, g, lr)

    def after_update(self, k, x, g, lr):
        if self._shift is not None:
            return self._shift.after_update(k, x, g, lr)
        if k % self.communication_interval:
            return
        stochastic = getattr(self.codec, "rounding", None) == "stochastic"
        gen = shared_generator(self.seed, k, self.rank) if stochastic else None
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        for s, e in self.buckets:
            xb = x[s:e]
            if self.node_size == 1:
                self._ring_step(xb, s, e, gen)
            elif self.is_leader:
                parts = self.transport.neighbor_exchange(empty, self.members)  # reduce (average)
                t = xb.detach().clone()
                for j in self.members:
                    t.add_(parts[j].view(x.dtype).to(x.device))
                xb.copy_(t.div_(self.node_size))
                self._ring_step(xb, s, e, gen)
                self.transport.neighbor_exchange(xb.detach().contiguous().view(torch.uint8), self.members)  # broadcast
            else:
                self.transport.neighbor_exchange(xb.detach().contiguous().view(torch.uint8), (self.leader,))
                got = self.transport.neighbor_exchange(empty, (self.leader,))[self.leader]
                xb.copy_(got.view(x.dtype).to(x.device))

    def _decode(self, wire: torch.Tensor, numel: int, dtype) -> torch.Tensor:
        payload = self.codec.payload_from_wire(wire)
        if isinstance(self.codec, BaguaMinMaxCodec):
            return self.codec.decode(payload, numel=numel, dtype=dtype)
        return self.codec.decode(payload).to(dtype)

    def _ring_step(self, xb: torch.Tensor, s: int, e: int, gen) -> None:
        """Bagua's kernel on one bucket, on the ring of nodes (this rank a leader)."""
        w, lw, rw = self.w[s:e], self.left_w[s:e], self.right_w[s:e]
        t = xb.detach().clone()   # products rounded, then added: the same numbers on every device
        t.add_(lw * THIRD)
        t.add_(rw * THIRD)
        t.add_(w * MINUS_FIVE_THIRDS)
        wire = self.codec.encode(t, generator=gen).to_wire()
        if self.nodes == 1:       # its own left and right neighbour: nothing crosses the wire
            from_left = from_right = wire
        elif self.nodes == 2:     # the one peer is the left and the right neighbour: two messages
            from_left = self.transport.neighbor_exchange(wire, (self.left,))[self.left]
            from_right = self.transport.neighbor_exchange(wire, (self.right,))[self.right]
        else:
            got = self.transport.neighbor_exchange(wire, (self.left, self.right))
            from_left, from_right = got[self.left], got[self.right]
        n, dt = e - s, xb.dtype
        lw.add_(self._decode(from_left, n, dt))
        rw.add_(self._decode(from_right, n, dt))
        t = self._decode(wire, n, dt)
        t.add_(w)
        w.copy_(t)
        xb.copy_(t)


class ShiftOneLowPrecision(DCDPSGD):
    """lowbit's own low-precision shift_one (Bagua has none: its shift_one is
    full precision only). n must be even. At step k worker r mixes with exactly
    one peer, Bagua's pairing of the lower half with the upper half::

        r <  n/2:  peer = n/2 + (k + r) mod (n/2)
        r >= n/2:  peer = (r - n/2 - k) mod (n/2)

    with weights 1/2 self, 1/2 peer, before the optimizer step (DCD's place).
    A replica of a peer is exact only if the peer's difference is taken against
    what *this* worker last received, so worker i keeps, for each of the n/2
    workers it can be paired with, the replica xh^(j) and the mirror m^(j)
    (i's model as j knows it), and at the end of step k, with p = peer(k + 1)::

        z = x_{t+1/2} - m^(p);  x_{t+1} = m^(p) + Q(z);  m^(p) = x_{t+1};  send Q(z) to p
        xh^(p) <- xh^(p) + Q(z^(p))

    One message per step for the whole model (no buckets); the replicas start
    from x_0 sent once, uncompressed, in :meth:`setup`. Extra memory: n x d."""

    name = "lowprec-decentralized"

    def __init__(self, transport, *, codec: Codec, seed: int = 0):
        from ..topology import make_topology

        n = transport.world_size
        shift_one_peer(transport.rank, n, 0)  # n even
        super().__init__(transport, make_topology("ring", n), codec=codec, seed=seed)
        h = n // 2
        self.partners = tuple(range(h, n)) if self.rank < h else tuple(range(h))
        self.mirrors: dict[int, torch.Tensor] = {}

    def peer(self, k: int) -> int:
        return shift_one_peer(self.rank, self.world_size, k)

    def state_tensors(self):
        out = super().state_tensors()
        out.update({f"mirror_{j}": m for j, m in sorted(self.mirrors.items())})
        return out

    def setup(self, x):
        self.replicas = exchange_initial_models(self, x, self.partners)
        self.mirrors = {j: x.detach().clone() for j in self.partners}

    def before_update(self, k, x, g, lr):
        x.mul_(0.5).add_(self.replicas[self.peer(k)], alpha=0.5)

    def after_update(self, k, x, g, lr):
        p = self.peer(k + 1)
        m = self.mirrors[p]
        q, received = exchange_compressed(self, self.codec, k, x - m, (p,))
        x.copy_(m + q)
        m.copy_(x)
        self.replicas[p].add_(received[p])
