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

Locking: ``init(x, ctx)`` keeps a reference to the worker's flat parameter
tensor in the state, and opens the asynchronous gossip with a responder that
answers from it. Every write to it by this algorithm (the active update, the
passive update that a responder thread makes) holds the state's ``lock``
(:class:`ADPSGDState`: the lock, the responder's wiring and the schedule are
transient fields, not checkpointed); the active update
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

Variants: the two share the exchange and differ by their codec only (``ADPSGD.codec``:
fp32; ``MoniquaAsync.codec``: the modulo codec of its ``bits``, ``theta``, ``rounding``).

Memory: no state tensor between steps (extra_memory_bytes 0, as Moniqua's
Table 1 and AD-PSGD); the state counts the exchanges of each side. During one
exchange a worker holds its encoded payload and the decoded vectors
(transient, O(d)).
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import torch

from ..codecs import Codec, IdentityCodec, ModuloCodec
from ..codecs.rng import derive_seed, shared_generator
from ..comm.base import GossipFault
from .faults import check_decoded, fault_from_code, received_from
from .base import GossipAlgorithm, State, transient
from .config import BITS, ROUNDING, reads, values_from
from .moniqua import THETA_OPT, check_theta

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
        self.seed, self.slow = seed, check_slow(slow)
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
        """``rank``'s clock, ``step -> T_{rank,step}`` (what ``Transport.gossip_open`` takes)."""
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


def check_slow(slow: dict[int, float] | None) -> dict[int, float]:
    """The slow factors ``{rank: factor >= 1}`` as a dict (None: none); ValueError otherwise."""
    slow = dict(slow or {})
    for r, f in slow.items():
        if not (isinstance(r, int) and r >= 0 and isinstance(f, (int, float)) and math.isfinite(f) and f >= 1):
            raise ValueError(f"slow must map ranks >= 0 to factors >= 1, got {r!r}: {f!r}")
    return slow


@dataclass
class ADPSGDState(State):
    """An asynchronous worker's state: the exchanges it made as the active side and answered
    as the passive side (checkpointed), then what the responder needs (transient): the
    worker's parameters, the lock that guards them, whether the active side holds it through
    the optimizer step, whether the gossip is open, the codec and the virtual-time schedule."""

    exchanges: int = 0
    answered: int = 0
    x: torch.Tensor | None = transient(default=None)
    lock: threading.Lock = transient(default_factory=threading.Lock)
    held: bool = transient(default=False)
    open: bool = transient(default=False)
    codec: Codec | None = transient(default=None)
    schedule: GossipSchedule | None = transient(default=None)


@dataclass(frozen=True)
class ADPSGD(GossipAlgorithm):
    """Asynchronous decentralized SGD: after each gradient a worker averages its model with one
    neighbour, drawn at random, without waiting for the others; fp32 models on the wire.

    Parameters:
        mix: how far each side of an exchange moves towards the other's model, in (0, 0.5]
            (0.5: the pair averages, as AD-PSGD).
        slow: ``{rank: factor >= 1}``, workers whose gradients take that many times longer in
            the in-process runtime's virtual-time schedule (None: none); the torch runtime
            runs in real time and ignores it.

    AD-PSGD, Lian et al. 2018 (the module docstring has the exchange and its locking)."""

    mix: float = 0.5
    slow: dict[int, float] | None = None
    name = "adpsgd"
    synchronous = False

    def __post_init__(self):
        super().__post_init__()  # the options' own checks
        if isinstance(self.mix, bool) or not (isinstance(self.mix, (int, float)) and 0 < self.mix <= 0.5):
            raise ValueError(f"mix must be in (0, 0.5] (0.5: the pair averages), got {self.mix!r}")
        check_slow(self.slow)

    @property
    def codec(self) -> Codec:
        """What goes on the wire: the model in fp32."""
        return IdentityCodec()

    @classmethod
    def from_config(cls, cfg):
        # slow: the run's slow workers (a TrainConfig's --slow), when cfg has them
        return cls(**values_from(cls, cfg), slow=cfg.slow_factors() if hasattr(cfg, "slow_factors") else None)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def init(self, x, ctx):
        """The state, and the gossip opened: from now on neighbours may average with ``x``."""
        state = ADPSGDState(x=x, codec=self.codec, schedule=GossipSchedule(ctx.seed, self.slow))
        if ctx.neighbors:
            ctx.transport.gossip_open(ctx.neighbors, lambda src, step, request: self._answer(
                state, ctx, src, step, request), clock=state.schedule.clock(ctx.rank))
            state.open = True
        return state

    def _encode(self, state: ADPSGDState, ctx, x: torch.Tensor, gen_step: int, gen_rank: int):
        """(wire buffer, this side's own term xh_self, the reference to decode against): line 3
        and 4 for Moniqua. One rounding stream per exchange, (seed, active step, active rank), on
        both sides (shared randomness). The reference is x as sent, so that both sides mix the
        values that went on the wire and, with fp32, the sum of the models is conserved."""
        gen = shared_generator(ctx.seed, gen_step, gen_rank, STREAM_ROUNDING)
        ref = x.detach().clone()
        payload = state.codec.encode(ref, generator=gen)
        return payload.to_wire(), state.codec.decode(payload, ref=ref).to(x.dtype), ref

    def _decode(self, state: ADPSGDState, ctx, sender: int, step: int, wire: torch.Tensor, mine: torch.Tensor,
                ref: torch.Tensor) -> torch.Tensor:
        """``sender``'s model, decoded against ``ref`` (line 5 for Moniqua). Its message must be as
        long as this side's own ``mine`` (one codec, one model size) and decode to the model's
        size: a :class:`~lowbit.algorithms.faults.PeerPayloadError` naming the sender and the step
        otherwise, before anything is decoded."""
        with received_from(self.name, ctx.rank, sender, step, "gossip message"):
            if wire.numel() != mine.numel():
                raise ValueError(f"{wire.numel()} bytes, this worker's messages have {mine.numel()}")
            return check_decoded(state.codec.decode(state.codec.payload_from_wire(wire), ref=ref).to(ref.dtype),
                                 ref.numel())

    def before_update(self, state, ctx, k, x, g, lr):
        """The active side: exchange with the partner of step k, x += mix (x_j - x_i); the lock
        is then held through the optimizer step (released by :meth:`after_update`)."""
        if x.data_ptr() != state.x.data_ptr():
            raise ValueError(f"{self.name}: before_update got another parameter tensor than init(x)")
        if ctx.neighbors:
            j = choose_partner(ctx.seed, ctx.rank, k, ctx.neighbors, ctx.W)
            sent = {}

            def request():  # called when the request leaves (in-process: at the exchange's turn)
                with state.lock:
                    sent["wire"], sent["mine"], sent["ref"] = self._encode(state, ctx, x, k, ctx.rank)
                return sent["wire"]

            with _faults(ctx):
                reply = ctx.transport.gossip(j, request, k)  # no lock held while waiting
            state.lock.acquire()  # held through the optimizer step, released in after_update
            state.held = True
            # against the model as sent (line 5 uses x_{k,i})
            theirs = self._decode(state, ctx, j, k, reply, sent["wire"], sent["ref"])
            x.add_(theirs - sent["mine"], alpha=self.mix)
            state.exchanges += 1
        else:
            state.lock.acquire()
            state.held = True
        return state

    def after_update(self, state, ctx, k, x, g, lr):
        _release(state)
        return state

    def _answer(self, state: ADPSGDState, ctx, src: int, step: int, request: torch.Tensor) -> torch.Tensor:
        """The passive side (a responder thread, or the active thread in-process)."""
        x = state.x
        with state.lock:
            wire, mine, ref = self._encode(state, ctx, x, step, src)
            theirs = self._decode(state, ctx, src, step, request, wire, ref)
            x.add_(theirs - mine, alpha=self.mix)
            state.answered += 1
        return wire

    def finish(self, state, ctx):
        """Release the lock and close the gossip (after the neighbours' last exchanges)."""
        _release(state)
        if state.open:
            state.open = False
            with _faults(ctx):
                ctx.transport.gossip_close()
        return state


@contextlib.contextmanager
def _faults(ctx):
    """A fault another rank sent through the gossip (it stopped at a non-finite value) is raised
    here as the same :class:`~lowbit.algorithms.faults.Diverged` it raised."""
    try:
        yield
    except GossipFault as e:
        raise fault_from_code(e.word, e.step, ctx.world_size, e.src) from None


def _release(state: ADPSGDState) -> None:
    if state.held:
        state.held = False
        state.lock.release()


# moniqua-async's theta when none is given: it has no verification to drive theta="auto"
ASYNC_THETA = 0.05


@dataclass(frozen=True)
class MoniquaAsync(ADPSGD):
    """AD-PSGD whose exchanges send Moniqua's modulo codes, ``bits`` per element, instead of fp32.

    Parameters (and ADPSGD's ``mix`` and ``slow``):
        bits: bits sent per element (1 to 8; default 2, as --bits).
        theta: the largest difference between the two models of an exchange, element by
            element, that decoding tolerates (a number > 0: no verification drives "auto" here).
        rounding: ``"stochastic"`` or ``"nearest"`` rounding of the codes.

    Moniqua on AD-PSGD, section 5 and Theorem 5 of the Moniqua paper: Algorithm 1's lines
    3-6 applied to the pair."""

    bits: int = reads(BITS, default=2)
    theta: float = reads(THETA_OPT, default=ASYNC_THETA)
    rounding: str = reads(ROUNDING, default="stochastic")
    name = "moniqua-async"

    def __post_init__(self):
        super().__post_init__()
        _check_theta(self.theta)
        self.codec  # validates bits, rounding and delta < 1/2

    @property
    def codec(self) -> ModuloCodec:
        """What goes on the wire: the modulo codes of ``bits``, ``theta`` and ``rounding``."""
        return ModuloCodec(bits=self.bits, theta=float(self.theta), rounding=self.rounding)



def _check_theta(theta) -> float:
    if theta == "auto":
        raise ValueError("theta='auto' is for the synchronous variants (moniqua); moniqua-async needs a "
                         "number: give --theta a value > 0")
    return float(check_theta(theta, auto=False))
