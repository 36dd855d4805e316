"""Centralized SGD with compressed gradients whose codes cannot be summed:
QSGD, TernGrad, 1-bit SGD with error feedback; and PowerSGD.

Every worker encodes its gradient; the packed payloads travel by one of two
placements (``server``):

* ``"ps"``: rank 0 is also the parameter server. ``gather`` of the packed
  payloads to rank 0, which decodes each, averages, and ``broadcast``s the
  fp32 average (rank 0 quantizes its own gradient too, as every worker does).
* ``"allgather"``: ``all_gather`` of the packed payloads; every worker decodes
  all of them and averages in rank order (the same numbers on every worker).

Payloads must have one size on every rank (gather/all-gather); the codecs
used here have a fixed-width header and fixed-width packing, so they do.

QSGD (Alistarh et al. 2017): ``QSGDCodec(levels=s)``, ``s = (2^bits - 1) // 2``
so the ``2s + 1`` codes fill ``bits`` bits. TernGrad (Wen et al. 2017, eq. 2):
``TernGradCodec``. 1-bit SGD with error feedback (Seide et al. 2014, in the
scaled-sign form of EF-SignSGD): per worker, ``p = g + e``, send ``C(p) =
||p||_1 / d sign(p)``, ``e <- p - C(p)`` (:mod:`.feedback`). The randomness of
worker ``p`` at step ``k`` comes from ``shared_generator(seed, k, p)``.

PowerSGD (Vogels, Karimireddy, Jaggi 2019, Algorithms 1 and 2): the flat
gradient plus the error memory, ``M = reshape(g + e)`` (``n x m`` as
:class:`~lowbit.codecs.PowerSGDCodec` lays it out), ``P = M Q`` all-reduced
(mean), ``P_hat = orthogonalize(P)`` (reduced QR), ``Q = M^T P_hat``
all-reduced (mean), aggregate ``P_hat Q^T``; error memory
``e = M - P_hat Q_m^T`` (what this worker's own compression missed); the mean
``Q`` warm-starts the next step. ``Q_0`` is drawn from
``shared_generator(seed, 0, 0)`` so every worker starts from the same one.
P and Q travel as float32.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..codecs import PowerSGDCodec, QSGDCodec, SignCodec, TernGradCodec
from ..codecs.base import Codec, Payload
from ..codecs.kernels import empty_output
from ..codecs.powersgd import orthogonalize, times_thin, transpose_times_thin
from ..codecs.rng import shared_generator
from ..comm.base import Transport, completed, then
from .base import CentralizedAlgorithm, State
from .config import BITS, Option, int_at_least, reads
from .faults import received_from
from .feedback import compensate, remember

SERVERS = ("ps", "allgather")


def check_server(server) -> str:
    """``server`` if it is a placement of :data:`SERVERS` (``"ps"`` or ``"allgather"``);
    a ValueError naming the choices otherwise."""
    if server not in SERVERS:
        raise ValueError(f"server must be one of {SERVERS}, got {server!r}")
    return server


SERVER_OPT = Option("server", "allgather", f"DQSG/NDQSG placement: {', '.join(SERVERS)}", str, check_server)
POWERSGD_RANK_OPT = Option("powersgd_rank", 2, "PowerSGD: the rank of its gradient approximation (--rank for short)",
                           int, int_at_least("powersgd_rank", 1), {"aliases": ("--rank",)})


def decode_average(wires: list[torch.Tensor], decode: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The float64 average of ``decode(sender, wire)`` over the ranks' wire buffers, added in
    rank order (the same numbers on every rank), in one accumulator (:func:`empty_output`: a
    large one is mapped in huge pages; a fresh 52 MB float64 tensor took 28 ms to fill, this
    one 7 ms)."""
    acc = None
    for p, w in enumerate(wires):
        x = decode(p, w)
        acc = empty_output(x.numel(), torch.float64, x.device).copy_(x) if acc is None else acc.add_(x)
    return acc.div_(len(wires))


def gathered_exchange(t: Transport, wire: torch.Tensor, average: Callable[[list[torch.Tensor]], torch.Tensor],
                      server: str = "allgather", like: torch.Tensor | None = None) -> torch.futures.Future:
    """The packed payloads of all ranks to where they are decoded: the future of
    ``average(wires)`` (``wires`` in rank order). ``"allgather"``: one asynchronous all-gather,
    every rank averages. ``"ps"``: gather to rank 0, which averages and broadcasts the fp32
    result (synchronous; a completed future), ``like`` giving its shape and device. Shared by
    :class:`GatheredAlgorithm` and the DDP hook (with :func:`decode_average`)."""
    if server == "allgather":
        return then(t.all_gather_async(wire), average)
    wires = t.gather(wire, dst=0)
    out = average(wires) if t.rank == 0 else torch.empty(like.shape, device=like.device)
    return completed(t.broadcast(out.to(device=like.device, dtype=torch.float32), src=0))  # the server sends fp32


@dataclass
class ErrorState(State):
    """The error-feedback memory ``e`` of one worker (zeros at the start)."""

    error: torch.Tensor


@dataclass(frozen=True)
class GatheredAlgorithm(CentralizedAlgorithm, abc.ABC):
    """Base of the centralized algorithms whose packed payloads are gathered
    (``server="ps"``) or all-gathered (``"allgather"``) and decoded one by one.

    ``server``: where the payloads are decoded, on rank 0 acting as parameter server
    (``"ps"``, which broadcasts the fp32 average) or on every worker (``"allgather"``)."""

    server: str = reads(SERVER_OPT, default="allgather")

    # what a subclass provides -------------------------------------------------------
    @abc.abstractmethod
    def encode(self, state: State, ctx, k: int, g: torch.Tensor) -> Payload:
        """This worker's gradient at step k as a payload of the same size on every rank."""

    @abc.abstractmethod
    def decode(self, ctx, k: int, sender: int, wire: torch.Tensor) -> torch.Tensor:
        """The float64 gradient of ``sender`` from its wire buffer."""

    def average(self, ctx, k: int, wires: list[torch.Tensor]) -> torch.Tensor:
        """The float64 average of the decoded payloads (rank order; :func:`decode_average`)."""
        return decode_average(wires, lambda p, w: self.decode_from(ctx, k, p, w, wires[ctx.rank]))

    def decode_from(self, ctx, k: int, sender: int, wire: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` of ``sender``'s wire, which must be as long as this rank's own ``own`` (every
        rank's payload has one size) and decode to as many elements as this rank's; a
        :class:`~lowbit.algorithms.faults.PeerPayloadError` naming the sender and the step otherwise."""
        if sender == ctx.rank:
            return self.decode(ctx, k, sender, wire)
        with received_from(self.name, ctx.rank, sender, k):
            if wire.numel() != own.numel():
                raise ValueError(f"{wire.numel()} bytes, this rank's payload has {own.numel()}")
            return self.decode(ctx, k, sender, wire)

    # the exchange ----------------------------------------------------------------------
    def exchange(self, state: State, ctx, k: int, wire: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Gather/all-gather ``wire`` and return the average (float, like ``g``):
        :func:`gathered_exchange`, waited for."""
        return gathered_exchange(ctx.transport, wire, lambda ws: self.average(ctx, k, ws), self.server,
                                 g).wait().to(g.dtype)

    def before_update(self, state, ctx, k, x, g, lr):
        payload = self.encode(state, ctx, k, g)
        g.copy_(self.exchange(state, ctx, k, payload.to_wire(), g))
        return state


@dataclass(frozen=True)
class _CodecGathered(GatheredAlgorithm):
    """A stateless codec; the sender's generator is ``shared_generator(seed, k, rank)``."""

    codec: ClassVar[Codec]

    def encode(self, state, ctx, k, g):
        return self.codec.encode(g, generator=shared_generator(ctx.seed, k, ctx.rank))

    def decode(self, ctx, k, sender, wire):
        return self.codec.decode(self.codec.payload_from_wire(wire), dtype=torch.float64)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)


def qsgd_levels(bits: int) -> int:
    """The QSGD levels ``s`` whose ``2s + 1`` codes fill ``bits`` bits (``bits`` in 2..8)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 2..8 for qsgd (2s + 1 codes with s >= 1), got {bits!r}")
    return (2**bits - 1) // 2


@dataclass(frozen=True)
class QSGD(_CodecGathered):
    """QSGD: every worker sends its gradient stochastically rounded to one of ``2s + 1`` levels
    of its own norm (unbiased), and all workers apply the average of the decoded gradients.

    ``bits``: the width of one code, 2..8; the levels are ``s = (2^bits - 1) // 2``.
    ``server``: see :class:`GatheredAlgorithm`. Alistarh et al. 2017 (``QSGDCodec``)."""

    bits: int = reads(BITS, default=2)
    name = "qsgd"

    def __post_init__(self):
        super().__post_init__()
        qsgd_levels(self.bits)

    @property
    def codec(self) -> Codec:
        return QSGDCodec(levels=qsgd_levels(self.bits))


@dataclass(frozen=True)
class TernGrad(_CodecGathered):
    """TernGrad: every worker sends its gradient stochastically rounded to {-1, 0, +1} times its
    largest magnitude (unbiased, 2 bits), and all workers apply the average of the decoded
    gradients. ``server``: see :class:`GatheredAlgorithm`. Wen et al. 2017, eq. (2)."""

    codec: ClassVar[Codec] = TernGradCodec()
    name = "terngrad"


@dataclass(frozen=True)
class OneBitEF(_CodecGathered):
    """1-bit SGD with error feedback: every worker sends the sign of its gradient plus the error
    it left out before, scaled by the mean magnitude, and remembers what this message left out.

    Per worker ``p = g + e``, send ``C(p) = ||p||_1 / d sign(p)``, ``e = p - C(p)``.
    ``server``: see :class:`GatheredAlgorithm`. Seide et al. 2014, in EF-SignSGD's scaled form."""

    codec: ClassVar[Codec] = SignCodec("mean_abs")
    name = "onebit-ef"

    def init(self, x, ctx):
        return ErrorState(torch.zeros_like(x))

    def encode(self, state, ctx, k, g):
        p = compensate(g, state.error)
        payload = self.codec.encode(p)
        remember(state.error, p, self.codec.decode(payload, dtype=torch.float64).to(p.dtype))
        return payload


# One power step of PowerSGD in three parts, around its two all-reduces (of P, then of Q), and the
# step over a transport (power_step); the algorithm below and the DDP hook
# (lowbit.integrations.ddp_hooks, per gradient matrix) both use them.

def power_p(M: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """``P = M Q`` (the product in ``M``'s dtype with the float32 ``Q``, streaming M:
    :func:`~lowbit.codecs.powersgd.times_thin`), float32 as it travels."""
    return times_thin(M, Q.to(M.dtype)).to(torch.float32)


def power_q(M: torch.Tensor, P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the all-reduced ``P``: ``P_hat = orthogonalize(P)`` as every worker holds it (float32
    values, in ``M``'s dtype) and this worker's ``Q_m = M^T P_hat`` (in ``M``'s dtype)."""
    P_hat = orthogonalize(P.to(torch.float64)).to(torch.float32).to(M.dtype)
    return P_hat, transpose_times_thin(M, P_hat)


def power_product(P_hat: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """``P_hat Q^T`` of ``Q`` as it travels (float32), flattened, in ``P_hat``'s dtype."""
    return (P_hat @ Q.to(torch.float32).to(P_hat.dtype).T).reshape(-1)


def power_step(t: Transport, Ms: list[torch.Tensor], Qs: list[torch.Tensor], rider: torch.Tensor | None = None):
    """One power step for the matrices ``Ms`` (``n x m``; float64 in :class:`PowerSGD`, the
    bucket's float32 in the DDP hook: the products are in their dtype) warm-started from ``Qs``
    (``m x r``) over the transport ``t``: every ``P = M Q`` in one SUM all-reduce, together with
    ``rider`` (a float32 vector summed as it is, e.g. the DDP hook's uncompressed vectors already
    divided by N), each ``P`` averaged (synchronous: ``P_hat`` needs it); ``P_hat`` and this
    worker's ``Q_m = M^T P_hat``; the ``Q_m`` in one SUM all-reduce (asynchronous), averaged.

    Returns ``(future, P_hats, Q_ms)``: the future of ``(Qs, rider_sum)`` (the averaged ``Q``
    of every matrix, float32, and the summed rider), the ``P_hat`` and this worker's ``Q_m``
    (in the ``Ms``' dtype; ``power_product(P_hat, Q_m)`` is its own contribution)."""
    n_w = t.world_size
    Ps = [power_p(M, Q) for M, Q in zip(Ms, Qs)]
    first = t.all_reduce(torch.cat([P.reshape(-1) for P in Ps] + ([rider] if rider is not None else [])), "sum")
    P_hats, Q_ms, pos = [], [], 0
    for M, P in zip(Ms, Ps):
        P_hat, Q_m = power_q(M, first[pos:pos + P.numel()].view(P.shape) / n_w)
        P_hats.append(P_hat)
        Q_ms.append(Q_m)
        pos += P.numel()
    rider_sum = first[pos:]
    if not Q_ms:  # nothing low-rank: the first all-reduce was all
        return completed(([], rider_sum)), P_hats, Q_ms

    def split(total: torch.Tensor):
        out, at = [], 0
        for Q_m in Q_ms:
            out.append(total[at:at + Q_m.numel()].view(Q_m.shape) / n_w)
            at += Q_m.numel()
        return out, rider_sum

    fut = t.all_reduce_async(torch.cat([Q_m.to(torch.float32).reshape(-1) for Q_m in Q_ms]), "sum")
    return then(fut, split), P_hats, Q_ms


@dataclass
class PowerSGDState(State):
    """PowerSGD's memory: the error ``e`` (like ``x``) and the warm-start ``Q`` (``m x r``)."""

    error: torch.Tensor
    Q: torch.Tensor


@dataclass(frozen=True)
class PowerSGD(CentralizedAlgorithm):
    """PowerSGD: the workers agree on a rank-``rank`` approximation of their average gradient
    by one step of power iteration per SGD step, warm-started from the previous step, with
    error feedback; only the two thin factors travel (see the module docstring).

    ``rank``: the rank r of the approximation (CLI ``--rank``); more is closer and costs
    ``32 (n + m) r`` bits per step for an ``n x m`` matrix. Vogels et al. 2019, Algorithms 1-2."""

    rank: int = reads(POWERSGD_RANK_OPT, default=2)
    name = "powersgd"

    def __post_init__(self):
        super().__post_init__()
        PowerSGDCodec(rank=self.rank)  # validates rank

    @property
    def codec(self) -> PowerSGDCodec:
        """The codec fixing the matrix layout and the rank (``codec.matrix_shape``)."""
        return PowerSGDCodec(rank=self.rank)

    def init(self, x, ctx):
        Q = self.codec.init_state(x.numel(), shared_generator(ctx.seed, 0, 0), device=x.device)
        return PowerSGDState(torch.zeros_like(x), Q)

    def worker_bits_per_element(self, state, ctx):
        """32-bit factors: ``32 (n + m) r / d`` bits per element."""
        if state is None:
            raise ValueError("PowerSGD's bits per element need setup(x) first (they depend on d)")
        d = state.error.numel()
        n, m, r = self.codec.matrix_shape(d)
        return 32.0 * (n + m) * r / d if d else 0.0

    def before_update(self, state, ctx, k, x, g, lr):
        d = g.numel()
        n, m, _ = self.codec.matrix_shape(d)
        p = compensate(g.to(torch.float64), state.error.to(torch.float64))
        M = torch.nn.functional.pad(p, (0, n * m - d)).view(n, m)
        fut, (P_hat,), (Q_m,) = power_step(ctx.transport, [M], [state.Q])
        remember(state.error, p, power_product(P_hat, Q_m)[:d])  # e = M - P_hat Q_m^T
        (Q,), _ = fut.wait()
        g.copy_(power_product(P_hat, Q)[:d].to(g.dtype))
        state.Q = Q.contiguous()
        return state


__all__ = ["ErrorState", "GatheredAlgorithm", "OneBitEF", "PowerSGD", "PowerSGDState", "QSGD", "SERVERS",
           "TernGrad", "check_server", "decode_average", "gathered_exchange", "orthogonalize", "power_p", "power_product",
           "power_q", "power_step", "qsgd_levels"]
