"""Asynchronous decentralized SGD: AD-PSGD (Lian, Zhang, Zhang & Liu, "Asynchronous
Decentralized Parallel Stochastic Gradient Descent", ICML 2018) and Moniqua on
AD-PSGD (Lu & De Sa, ICML 2020, section 5, Theorem 5).

Per worker i, step k (no global barrier; other workers keep computing)::

    g      = grad f_i(x_i; xi)         computed on the model as read at the start of the step
    j      ~ a neighbour, P(j) = W_ij / (1 - W_ii), seeded by (seed, i, k)
    x_i, x_j <- pairwise mix, atomically with j:  x_i += m (x_j - x_i),  x_j += m (x_i - x_j)
    x_i    <- x_i - lr g               the optimizer step (torch.optim.SGD)

with m = 1/2 (plain averaging, the pairwise W_k of AD-PSGD). While i computes
g, neighbours may average with x_i, so g is a stale gradient, as in the paper.

``moniqua-async`` sends Moniqua's modulo codes instead of fp32 (Algorithm 1,
lines 3-6, applied to the pair): each side encodes its model, decodes its own
code and the other's against its own model as side information, and updates
``x += m (xh_other - xh_self)``. One exchange draws one stochastic-rounding
stream (seed, active rank, active step), so both sides round alike (shared
randomness of section 6).

Both sides update additively with the values that went on the wire
(``x_i += m (x_j^sent - x_i^sent)`` and the opposite on j), so with fp32 the
sum of the models is conserved (up to the rounding of the additions) even if
a third exchange changes x_i while i's request is in flight (torch runtime:
i encodes when its request leaves and applies the difference when the reply
is back). On the in-process schedule the request is encoded at the
exchange's turn and nothing else runs on x_i or x_j meanwhile, so this is
exactly (x_i + x_j) / 2 on both sides.

Locking: ``setup(x)`` keeps a reference to the worker's flat parameter
tensor. Every write to it by this algorithm (the active update, the passive
update that a responder thread makes) holds ``self.lock``; the active update
keeps the lock held from the end of ``before_update`` until ``after_update``,
so the optimizer step never interleaves with a passive update. No lock is held
while waiting on the network (a lock held there could deadlock two workers
asking each other at once). The gradient computation reads x without the lock:
like AD-PSGD it may see a model that a neighbour is averaging into.

Schedule of the in-process runtime (reproducible asynchrony): worker i's
k-th gradient takes the virtual time ``c_ik = slow_i * (0.5 + U_ik)``, U_ik
uniform on [0, 1) from a generator seeded by (seed, k, i); its k-th gossip
happens at ``T_ik = c_i0 + ... + c_ik`` and the exchanges run in the order of
(T_ik, i) (:class:`lowbit.comm.inprocess.GossipBoard`). Worker i's gradient of
step k is computed on x_i as it stood right after its own step k-1 (the
exchanges other workers make with it in between change x_i before the
gradient is applied, which is the staleness the schedule decides). The
torch runtime ignores the schedule: real time orders the exchanges, and the
partner choice is the same seeded draw.

Memory: no state between steps (extra_memory_bytes 0, as Moniqua's Table 1 and
AD-PSGD). During one exchange a worker holds its encoded payload and, for
``moniqua-async``, the decoded vectors (transient, O(d)).
"""

from __future__ import annotations

import math
import threading

import torch

from ..codecs import Codec, IdentityCodec, ModuloCodec
from ..codecs.rng import derive_seed, shared_generator
from .legacy import GossipAlgorithm

# Random streams of the asynchronous family (derive_seed's ``stream``).
STREAM_TIME, STREAM_PARTNER, STREAM_ROUNDING = 21, 22, 23


def compute_time(seed: int, rank: int, step: int, slow: float = 1.0) -> float:
    """Virtual seconds of ``rank``'s gradient at ``step``: slow * (0.5 + U), U ~ U[0, 1)."""
    u = derive_seed(seed, step, rank, STREAM_TIME) / float(1 << 63)
    return float(slow) * (0.5 + u)


class GossipSchedule:
    """The virtual times ``T_ik`` of the in-process schedule (see module doc)."""

    def __init__(self, seed: int, slow: dict[int, float] | None = None):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        slow = dict(slow or {})
        for r, f in slow.items():
            if not (isinstance(r, int) and r >= 0 and isinstance(f, (int, float)) and math.isfinite(f) and f >= 1):
                raise ValueError(f"slow must map ranks >= 0 to factors >= 1, got {r!r}: {f!r}")
        self.seed, self.slow = seed, slow
        self._cum: dict[int, list[float]] = {}

    def time(self, rank: int, step: int) -> float:
        """T_{rank,step}: when ``rank``'s gossip of ``step`` happens."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        cum = self._cum.setdefault(rank, [])
        while len(cum) <= step:
            k = len(cum)
            cum.append((cum[-1] if cum else 0.0) + compute_time(self.seed, rank, k, self.slow.get(rank, 1.0)))
        return cum[step]

    def clock(self, rank: int):
        return lambda step: self.time(rank, step)


def choose_partner(seed: int, rank: int, step: int, neighbors, W) -> int:
    """The neighbour ``rank`` gossips with at ``step``: P(j) proportional to W[rank, j]."""
    neighbors = tuple(neighbors)
    weights = [float(W[rank, j]) for j in neighbors]
    total = sum(weights)
    if not neighbors or total <= 0:
        raise ValueError(f"rank {rank} has no neighbour with a positive mixing weight")
    u = derive_seed(seed, step, rank, STREAM_PARTNER) / float(1 << 63) * total
    acc = 0.0
    for j, w in zip(neighbors, weights):
        acc += w
        if u < acc:
            return j
    return neighbors[-1]


class ADPSGD(GossipAlgorithm):
    """AD-PSGD with fp32 models on the wire (the codec hook serves moniqua-async)."""

    name = "adpsgd"
    synchronous = False

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, weights=cfg.weights, seed=cfg.seed, slow=cfg.slow_factors())

    def __init__(self, transport, topology, *, mix: float = 0.5, slow: dict[int, float] | None = None, **kw):
        super().__init__(transport, topology, **kw)
        if not (isinstance(mix, (int, float)) and 0 < mix <= 0.5):
            raise ValueError(f"mix must be in (0, 0.5] (0.5: the pair averages), got {mix!r}")
        self.mix = float(mix)
        self.schedule = GossipSchedule(self.seed, slow)
        self.lock = threading.Lock()
        self.x: torch.Tensor | None = None
        self._held = False
        self._open = False
        self.exchanges = 0  # as the active side
        self.answered = 0  # as the passive side

    # ---- what goes on the wire -------------------------------------------
    def _codec(self) -> Codec:
        return IdentityCodec()

    def _encode(self, x: torch.Tensor, gen_step: int, gen_rank: int):
        """(wire buffer, this side's own term xh_self, the reference to decode against)."""
        c = self._codec()
        payload = c.encode(x)
        # the model as it went on the wire (fp32): both sides mix wire values, so the sum is conserved
        return payload.to_wire(), c.decode(payload).to(x.dtype), None

    def _decode(self, wire: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        c = self._codec()
        return c.decode(c.payload_from_wire(wire)).to(self.x.dtype)

    # ---- the contract ------------------------------------------------------
    def setup(self, x):
        self.x = x
        if self.neighbors:
            self.transport.gossip_open(self.neighbors, self._answer, clock=self.schedule.clock(self.rank))
            self._open = True

    def partner(self, k: int) -> int:
        return choose_partner(self.seed, self.rank, k, self.neighbors, self.W)

    def before_update(self, k, x, g, lr):
        if self.x is None:
            raise RuntimeError(f"{self.name}: call setup(x) before the first step")
        if x.data_ptr() != self.x.data_ptr():
            raise ValueError(f"{self.name}: before_update got another parameter tensor than setup(x)")
        if self.neighbors:
            j = self.partner(k)
            sent = {}

            def request():  # called when the request leaves (in-process: at the exchange's turn)
                with self.lock:
                    wire, sent["mine"], sent["ref"] = self._encode(x, k, self.rank)
                return wire

            reply = self.transport.gossip(j, request, k)  # no lock held while waiting
            mine, ref = sent["mine"], sent["ref"]
            self.lock.acquire()  # held through the optimizer step, released in after_update
            self._held = True
            theirs = self._decode(reply, ref)  # against the model as sent (line 5 uses x_{k,i})
            x.add_(theirs - mine, alpha=self.mix)
            self.exchanges += 1
        else:
            self.lock.acquire()
            self._held = True

    def after_update(self, k, x, g, lr):
        if self._held:
            self._held = False
            self.lock.release()

    def _answer(self, src: int, step: int, request: torch.Tensor) -> torch.Tensor:
        """The passive side (a responder thread, or the active thread in-process)."""
        x = self.x
        with self.lock:
            wire, mine, ref = self._encode(x, step, src)
            theirs = self._decode(request, ref)
            x.add_(theirs - mine, alpha=self.mix)
            self.answered += 1
        return wire

    def finish(self):
        if self._held:
            self._held = False
            self.lock.release()
        if self._open:
            self._open = False
            self.transport.gossip_close()

    def extra_memory_bytes(self):
        return 0


# moniqua-async's theta when none is given: it has no verification to drive theta="auto"
ASYNC_THETA = 0.05


class MoniquaAsync(ADPSGD):
    """Moniqua on AD-PSGD: the pairwise exchange sends modulo codes (see module doc)."""

    name = "moniqua-async"

    @classmethod
    def _theta(cls, theta):
        if theta == "auto":
            raise ValueError("theta='auto' is for the synchronous variants (moniqua); moniqua-async needs a "
                             "number: give --theta a value > 0")
        if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta)
                and theta > 0):
            raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
        return float(theta)

    @classmethod
    def check_config(cls, cfg):
        ModuloCodec(bits=cfg.bits, theta=cls._theta(ASYNC_THETA if cfg.theta is None else cfg.theta),
                    rounding=cfg.rounding or "stochastic")

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, bits=cfg.bits, theta=ASYNC_THETA if cfg.theta is None else cfg.theta,
                   rounding=cfg.rounding or "stochastic", weights=cfg.weights, seed=cfg.seed,
                   slow=cfg.slow_factors())

    def __init__(self, transport, topology, *, bits: int = 8, theta: float = ASYNC_THETA, rounding: str = "stochastic",
                 **kw):
        super().__init__(transport, topology, **kw)
        self.codec = ModuloCodec(bits=bits, theta=self._theta(theta), rounding=rounding)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def _codec(self):
        return self.codec

    def _encode(self, x, gen_step, gen_rank):
        # One rounding stream per exchange: (seed, active step, active rank), on both sides.
        gen = shared_generator(self.seed, gen_step, gen_rank, STREAM_ROUNDING)
        ref = x.detach().clone()
        payload = self.codec.encode(ref, generator=gen)                                # line 3
        return payload.to_wire(), self.codec.decode(payload, ref=ref), ref           # line 4: xh_self

    def _decode(self, wire, ref):
        return self.codec.decode(self.codec.payload_from_wire(wire), ref=ref)  # line 5
