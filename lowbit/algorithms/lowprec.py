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
  broadcasts rank 0's model). ``init`` checks that assumption (an
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

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..codecs import Codec, IdentityCodec, MinMaxCodec, codec_name, codec_names
from ..codecs.bagua_minmax import BaguaMinMaxCodec
from ..codecs.quantize import check_rounding
from ..codecs.rng import shared_generator
from .base import GossipAlgorithm, State, transient
from .config import BITS, CODEC, ROUNDING, Option, reads
from .faults import check_decoded, received_from
from .dcd import send_difference
from .gossip import check_codec, exchange_initial_models, mix

PEER_SELECTIONS = ("all", "shift_one")
BAGUA_BUCKET_BYTES = 10 * 1024 ** 2  # Bagua's default bucket size
THIRD = float(np.float32(1.0 / 3.0))  # Bagua's factors, as the float32 its kernel receives
MINUS_FIVE_THIRDS = float(np.float32(-5.0 / 3.0))


def _check_bool(name: str):
    def check(v):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    return check


def _check_node_size(L) -> None:
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise ValueError(f"node_size must be an int >= 1 dividing the number of workers, got {L!r}")


def _check_interval(v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"communication_interval must be an int >= 1, got {v!r}")


def _check_peer_selection(v) -> None:
    if v not in PEER_SELECTIONS:
        raise ValueError(f"peer_selection must be one of {PEER_SELECTIONS}, got {v!r}")


PEER_SELECTION_OPT = Option("peer_selection", "all", "lowprec-decentralized: Bagua's peer selection, all or shift_one",
                            str, _check_peer_selection)
HIERARCHICAL_OPT = Option("hierarchical", True, "lowprec-decentralized: Bagua's hierarchical mode (average inside a "
                          "node, gossip between node leaders, broadcast back)", bool, _check_bool("hierarchical"))
COMMUNICATION_INTERVAL_OPT = Option("communication_interval", 1, "lowprec-decentralized: communicate every this many "
                                    "steps (Bagua's)", int, _check_interval)
NODE_SIZE_OPT = Option("node_size", None, "lowprec-decentralized: workers per node (default: LOCAL_WORLD_SIZE on the "
                       "torch backend, 1 on the thread backend)", int | None, _check_node_size)
BUCKET_BYTES_OPT = Option("bucket_bytes", BAGUA_BUCKET_BYTES, "lowprec-decentralized: bytes per bucket, each "
                          "quantized with its own min and max (Bagua's default 10 MiB)", int,
                          lambda v: bagua_buckets(0, 4, v))


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
    """Workers per node: the transport's :attr:`~lowbit.comm.base.Transport.local_world_size`
    (``LOCAL_WORLD_SIZE`` on torch.distributed, as torchrun sets it; 1 on the thread runtime:
    every worker its own node unless told)."""
    return transport.local_world_size


def check_node_size(L, n: int) -> int:
    """``L`` if it is a number of workers per node that divides the ``n`` workers; a
    ValueError naming ``node_size`` otherwise."""
    if isinstance(L, bool) or not isinstance(L, int) or L < 1 or n % L:
        raise ValueError(f"node_size must be an int >= 1 dividing the {n} workers, got {L!r}")
    return L


class NodeLayout(NamedTuple):
    """Where a worker sits in Bagua's hierarchy: ``size`` workers per node (consecutive
    ranks), its ``node`` and ``local_rank`` there, the number of ``nodes``, its node's
    ``leader`` and (on a leader) the other ``members``, and the leaders of the ``left``
    and ``right`` neighbour nodes on the ring of nodes."""

    size: int
    node: int
    local_rank: int
    nodes: int
    leader: int
    members: tuple[int, ...]
    left: int
    right: int

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0


def node_layout(rank: int, n: int, size: int) -> NodeLayout:
    """The :class:`NodeLayout` of ``rank`` among ``n`` workers in nodes of ``size``."""
    node, local_rank = divmod(rank, size)
    nodes, leader = n // size, node * size
    return NodeLayout(size, node, local_rank, nodes, leader, tuple(range(leader + 1, leader + size)),
                      ((node - 1) % nodes) * size, ((node + 1) % nodes) * size)


@dataclass
class LowPrecisionState(State):
    """Bagua's states on a node leader: its model ``weight`` (w) and its replicas of the
    ring neighbours' models (``left_peer_weight``, ``right_peer_weight``), as of the last
    communication; None on the other workers of a node. The buckets and the node layout
    follow from the options and the context."""

    weight: torch.Tensor | None
    left_peer_weight: torch.Tensor | None
    right_peer_weight: torch.Tensor | None
    buckets: list[tuple[int, int]] = transient(default_factory=list)
    layout: NodeLayout | None = transient(default=None)


@dataclass(frozen=True)
class LowPrecisionDecentralized(GossipAlgorithm):
    """Bagua's low precision decentralized SGD: after each optimizer step, each worker
    sends its two ring neighbours the 8-bit quantized difference between its ring average
    and its last communicated model, and keeps exact replicas of theirs.

    Options, as Bagua's ``LowPrecisionDecentralizedAlgorithm`` (see the module docstring):
    ``hierarchical`` (True, Bagua's default: the workers of a node average first and only
    the node leaders gossip), ``communication_interval`` (communicate every this many
    steps, >= 1), ``node_size`` (workers per node; None: ``LOCAL_WORLD_SIZE`` under
    torchrun, else 1), ``bucket_bytes`` (bytes per bucket, each quantized with its own min
    and max; Bagua's 10 MiB), ``param_sizes`` (the module's parameter sizes, from which
    the buckets are cut), ``codec`` (Bagua's MinMaxUInt8 by default), ``peer_selection``
    (``"all"``: Bagua's ring; ``"shift_one"``: lowbit's own variant, which constructing
    this class with it returns, a :class:`ShiftOneLowPrecision`). ``bits``/``rounding`` build lowbit's ``MinMaxCodec``
    when given other than Bagua's (8, "nearest") and no codec is passed.

    Extra memory on a leader: ``w``, ``left``, ``right``: 3 x d (Bagua's states);
    0 on the other workers of a node."""

    bits: int = 8
    rounding: str = "nearest"
    peer_selection: str = reads(PEER_SELECTION_OPT, default="all")
    codec: Codec | None = reads(CODEC, BITS, ROUNDING, build=lambda cls, cfg: cfg.make_codec(cls.codecs), default=None)
    hierarchical: bool = reads(HIERARCHICAL_OPT, default=True)
    communication_interval: int = reads(COMMUNICATION_INTERVAL_OPT, default=1)
    node_size: int | None = reads(NODE_SIZE_OPT, default=None)
    bucket_bytes: int = reads(BUCKET_BYTES_OPT, default=BAGUA_BUCKET_BYTES)
    param_sizes: Sequence[int] | None = None
    name = "lowprec-decentralized"
    codecs = codec_names("bagua-minmax", "minmax", "fp32")

    def __new__(cls, *args, **kwargs):
        """``peer_selection="shift_one"`` is another algorithm: construct :class:`ShiftOneLowPrecision`."""
        if cls is LowPrecisionDecentralized and kwargs.get("peer_selection") == "shift_one":
            cls = ShiftOneLowPrecision
        return super().__new__(cls)

    def __post_init__(self):
        super().__post_init__()  # each option's own check
        check_rounding(self.rounding)
        codec = self.codec
        if codec is None:
            bagua = (self.bits, self.rounding) == (8, "nearest")
            codec = BaguaMinMaxCodec() if bagua else MinMaxCodec(bits=self.bits, rounding=self.rounding)
            object.__setattr__(self, "codec", codec)
        if not isinstance(check_codec(codec), (BaguaMinMaxCodec, MinMaxCodec, IdentityCodec)):
            raise ValueError(f"codec must be BaguaMinMaxCodec, MinMaxCodec or IdentityCodec, got {codec!r}")
        if self.param_sizes is not None:
            object.__setattr__(self, "param_sizes", tuple(int(s) for s in self.param_sizes))

    @classmethod
    def check_config(cls, cfg):
        if codec_name(cfg.codec or cls.codecs[0]) == BaguaMinMaxCodec.name and cfg.rounding not in (None, "nearest"):
            raise ValueError(f"rounding={cfg.rounding!r}: Bagua's min-max codec rounds to nearest; "
                             f"use --codec minmax for stochastic rounding")
        algo = cls.from_config(cfg)
        # what init checks against the workers, before any worker starts
        if algo.peer_selection == "shift_one":
            shift_one_peer(0, cfg.workers, 0)  # n even
        elif algo.node_size is not None:
            check_node_size(algo.node_size, cfg.workers)
        if cfg.topology != "ring":
            raise ValueError(f"topology={cfg.topology!r}: Bagua's low precision decentralized SGD gossips on a ring")
        if cfg.weights != "uniform":
            raise ValueError(f"weights={cfg.weights!r}: Bagua's ring weights are uniform (1/3)")

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    @staticmethod
    def _check_ring(ctx) -> None:
        """The context Bagua gossips on: a ring of every worker with uniform weights."""
        n = ctx.world_size
        if ctx.topology.name != "ring" or ctx.topology.n != n:
            raise ValueError(f"topology must be a ring of the {n} workers (Bagua gossips on a ring), "
                             f"got {ctx.topology.name} of {ctx.topology.n}")
        if not np.array_equal(ctx.W, ctx.topology.mixing_matrix("uniform")):
            raise ValueError("weights must be 'uniform' (Bagua's ring weights 1/3)")

    def init(self, x, ctx):
        self._check_ring(ctx)
        n = ctx.world_size
        L = check_node_size(default_node_size(ctx.transport) if self.node_size is None else self.node_size, n)
        layout = node_layout(ctx.rank, n, L if self.hierarchical else 1)
        with ctx.transport.untracked():  # Bagua's assumption: every worker starts from one model
            same = n == 1 or torch.equal(ctx.transport.all_reduce(x.detach(), "max"),
                                         ctx.transport.all_reduce(x.detach(), "min"))
        if not same:
            raise ValueError("lowprec-decentralized: the workers' initial models differ; Bagua starts every "
                             "replica from the worker's own model and sends none (with_bagua broadcasts rank 0's "
                             "model first): start all workers from the same parameters")
        buckets = bagua_buckets(x.numel(), x.element_size(), self.bucket_bytes, self.param_sizes)
        w = [x.detach().clone() for _ in range(3)] if layout.is_leader else [None] * 3
        return LowPrecisionState(*w, buckets=buckets, layout=layout)

    def before_update(self, state, ctx, k, x, g, lr):
        """Nothing: Bagua's hook runs after the optimizer step (the drivers still agree on faults
        before the update, as they always have for this algorithm)."""
        return state

    def after_update(self, state, ctx, k, x, g, lr):
        if k % self.communication_interval:
            return state
        nodes, transport = state.layout, ctx.transport
        stochastic = getattr(self.codec, "rounding", None) == "stochastic"
        gen = shared_generator(ctx.seed, k, ctx.rank) if stochastic else None
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        for s, e in state.buckets:
            xb = x[s:e]
            if nodes.size == 1:
                self._ring_step(state, ctx, k, xb, s, e, gen)
            elif nodes.is_leader:
                parts = transport.neighbor_exchange(empty, nodes.members)  # reduce (average)
                t = xb.detach().clone()
                for j in nodes.members:
                    t.add_(self._raw(ctx, k, j, parts[j], xb))
                xb.copy_(t.div_(nodes.size))
                self._ring_step(state, ctx, k, xb, s, e, gen)
                transport.neighbor_exchange(xb.detach().contiguous().view(torch.uint8), nodes.members)  # broadcast
            else:
                transport.neighbor_exchange(xb.detach().contiguous().view(torch.uint8), (nodes.leader,))
                got = transport.neighbor_exchange(empty, (nodes.leader,))[nodes.leader]
                xb.copy_(self._raw(ctx, k, nodes.leader, got, xb))
        return state

    def _raw(self, ctx, k: int, sender: int, buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A bucket ``sender`` sent in ``like``'s dtype (within a node: the reduce and the broadcast),
        checked to be ``like``'s size."""
        with received_from(self.name, ctx.rank, sender, k, "bucket"):
            if buf.numel() != like.numel() * like.element_size():
                raise ValueError(f"{buf.numel()} bytes, the bucket has {like.numel() * like.element_size()}")
            return buf.view(like.dtype).to(like.device)

    def _decode(self, wire: torch.Tensor, numel: int, dtype, ctx=None, k: int = 0, sender: int | None = None):
        """The ``numel`` elements of a bucket's payload; from a peer (``sender``), a malformed one
        is a :class:`~lowbit.algorithms.faults.PeerPayloadError` naming it and the step."""
        if sender is None:
            return self._decode_payload(wire, numel, dtype)
        with received_from(self.name, ctx.rank, sender, k):
            return check_decoded(self._decode_payload(wire, numel, dtype), numel)

    def _decode_payload(self, wire: torch.Tensor, numel: int, dtype) -> torch.Tensor:
        payload = self.codec.payload_from_wire(wire)
        if isinstance(self.codec, BaguaMinMaxCodec):
            return self.codec.decode(payload, numel=numel, dtype=dtype)
        return self.codec.decode(payload).to(dtype)

    def _ring_step(self, state: LowPrecisionState, ctx, k: int, xb: torch.Tensor, s: int, e: int, gen) -> None:
        """Bagua's kernel on one bucket, on the ring of nodes (this rank a leader)."""
        nodes = state.layout
        w, lw, rw = state.weight[s:e], state.left_peer_weight[s:e], state.right_peer_weight[s:e]
        t = xb.detach().clone()   # products rounded, then added: the same numbers on every device
        t.add_(lw * THIRD)
        t.add_(rw * THIRD)
        t.add_(w * MINUS_FIVE_THIRDS)
        wire = self.codec.encode(t, generator=gen).to_wire()
        if nodes.nodes == 1:      # its own left and right neighbour: nothing crosses the wire
            from_left = from_right = wire
        elif nodes.nodes == 2:    # the one peer is the left and the right neighbour: two messages
            from_left = ctx.transport.neighbor_exchange(wire, (nodes.left,))[nodes.left]
            from_right = ctx.transport.neighbor_exchange(wire, (nodes.right,))[nodes.right]
        else:
            got = ctx.transport.neighbor_exchange(wire, (nodes.left, nodes.right))
            from_left, from_right = got[nodes.left], got[nodes.right]
        n, dt = e - s, xb.dtype
        lw.add_(self._decode(from_left, n, dt, ctx, k, None if nodes.nodes == 1 else nodes.left))
        rw.add_(self._decode(from_right, n, dt, ctx, k, None if nodes.nodes == 1 else nodes.right))
        t = self._decode(wire, n, dt)
        t.add_(w)
        w.copy_(t)
        xb.copy_(t)


@dataclass
class ShiftOneState(State):
    """The shift_one memory on worker i: for each worker j it can be paired with, the
    replica xh^(j) of j's model and the mirror m^(j), i's model as j knows it."""

    xhat: dict[int, torch.Tensor]
    mirror: dict[int, torch.Tensor]


@dataclass(frozen=True)
class ShiftOneLowPrecision(LowPrecisionDecentralized):
    """lowbit's own low-precision shift_one: each step a worker averages its model with one
    peer's, and sends the next step's peer the compressed change of its model since that
    peer last heard from it (Bagua has no such mode: its shift_one is full precision only).

    ``codec`` compresses the changes. n must be even. At step k worker r mixes with
    exactly one peer, Bagua's pairing of the lower half with the upper half::

        r <  n/2:  peer = n/2 + (k + r) mod (n/2)
        r >= n/2:  peer = (r - n/2 - k) mod (n/2)

    with weights 1/2 self, 1/2 peer, before the optimizer step (DCD's place).
    A replica of a peer is exact only if the peer's difference is taken against
    what *this* worker last received, so worker i keeps, for each of the n/2
    workers it can be paired with, the replica xh^(j) and the mirror m^(j)
    (i's model as j knows it), and at the end of step k, with p = peer(k + 1),
    DCD-PSGD's difference step (:func:`~lowbit.algorithms.dcd.send_difference`)
    against m^(p)::

        z = x_{t+1/2} - m^(p);  x_{t+1} = m^(p) + Q(z);  m^(p) = x_{t+1};  send Q(z) to p
        xh^(p) <- xh^(p) + Q(z^(p))

    One message per step for the whole model (no buckets); the replicas start
    from x_0 sent once, uncompressed, in ``init``. Extra memory: n x d. It takes
    :class:`LowPrecisionDecentralized`'s options (``codec``, or ``bits`` and ``rounding``;
    no hierarchy, every step) and is what ``LowPrecisionDecentralized(peer_selection="shift_one")``
    (``lowbit train --algorithm lowprec-decentralized --peer-selection shift_one``) builds."""

    peer_selection: str = reads(PEER_SELECTION_OPT, default="shift_one")

    def __post_init__(self):
        if self.peer_selection != "shift_one":
            raise ValueError(f"peer_selection must be 'shift_one' for ShiftOneLowPrecision, got "
                             f"{self.peer_selection!r} (LowPrecisionDecentralized is Bagua's ring)")
        super().__post_init__()
        if self.hierarchical and (self.node_size or 1) > 1:
            raise ValueError("peer_selection='shift_one' (lowbit's own) has no hierarchical mode; "
                             "pass hierarchical=False or node_size=1")
        if self.communication_interval != 1:
            raise ValueError("peer_selection='shift_one' (lowbit's own) communicates every step: "
                             "communication_interval must be 1")

    def init(self, x, ctx):
        self._check_ring(ctx)
        n, h = ctx.world_size, ctx.world_size // 2
        shift_one_peer(ctx.rank, n, 0)  # n even
        partners = tuple(range(h, n)) if ctx.rank < h else tuple(range(h))
        return ShiftOneState(exchange_initial_models(ctx, x, partners), {j: x.detach().clone() for j in partners})

    def before_update(self, state, ctx, k, x, g, lr):
        p = shift_one_peer(ctx.rank, ctx.world_size, k)
        x.copy_(mix(ctx, x, {p: state.xhat[p]}, w_self=0.5, w={p: 0.5}))
        return state

    def after_update(self, state, ctx, k, x, g, lr):
        p = shift_one_peer(ctx.rank, ctx.world_size, k + 1)
        m = state.mirror[p]
        send_difference(ctx, self.codec, k, x, m, state.xhat, (p,), self.name)
        m.copy_(x)
        return state
