"""DQSG and NDQSG ("Nested Dithered Quantization for Communication Reduction in
Distributed Training", ICLR 2019 submission), Algorithms 1 and 2.

DQSG (Algorithm 1). Worker ``p`` at step ``k`` draws its dither ``u_p`` from
``shared_generator(seed, k, p)`` (the seed ``s_p``, renewed every step), sends
``kappa_p = ||g_p||_inf`` and the indices ``q_p = round(g_p / kappa_p / Delta +
u_p / Delta)`` (:class:`~lowbit.codecs.DitheredCodec`, ``Delta = 1/M``); the
server regenerates ``u_p`` from the same seed, reconstructs ``g~_p = kappa_p
(Delta q_p - u_p)``, averages and broadcasts. Placement ``server``: ``"ps"``
(rank 0 gathers the packed payloads and broadcasts the fp32 average) or
``"allgather"`` (every worker decodes every payload), as in
:class:`~lowbit.algorithms.compressed.GatheredAlgorithm`.

NDQSG (Algorithm 2). The workers are split into ``P1`` (the first
``P - n2`` ranks; DQSG with ``M`` levels) and ``P2`` (the last ``n2 =
round(nested_fraction P)`` ranks, at most ``P - 1``): a ``P2`` worker sends its
gradient with the nested dithered quantizer (:class:`~lowbit.codecs.
NestedDitheredCodec`, fine step ``Delta1``, coarse ``Delta2 = k Delta1``,
shrinkage ``alpha``; ``ceil(log2 k)`` bits per element). The decoder first
averages the ``P1`` reconstructions into ``g_bar``, then decodes the ``P2``
workers in rank order, each with ``g_bar`` as side information
(``r = s_p - u_p - alpha g_bar``, ``g^_p = g_bar + alpha (r - Q2(r))``), and
updates ``g_bar`` to the running average of everything decoded so far. The
result is the average over all ``P`` workers.

Normalisation. As DQSG's ``Delta`` is relative to ``kappa_p``, a ``P2`` worker
quantizes ``g_p / kappa_p`` (``kappa_p = ||g_p||_inf``, rounded up to float32,
sent in front of the nested payload) against the side information
``g_bar / kappa_p``; ``Delta1`` and Theorem 6's ``sigma_z`` are therefore in
units of ``kappa_p``.

The default (the auto setting: ``--algorithm ndqsg`` with no nested option) is the
paper's recommendation after Theorem 6: the nested quantizer keeps DQSG's variance while
it sends ``log2(Delta2 / Delta1)`` bits instead of about ``log2(2 / Delta)``, provided
``Delta2`` is wide enough for the side information's noise ``sigma_z``. So:

* ``P1`` is DQSG at the run's ``M`` (``bits = 2``: ``M = 1``, 3 levels); half the
  workers are in ``P2``, with ``k = 2`` (one bit: the only nested quantizer that sends
  fewer bits than 3 DQSG levels).
* ``Delta1`` and ``Delta2 = k Delta1`` come from Theorem 6 every step (:func:`theorem6_codec`),
  with ``alpha = 1`` (DQSG's variance at step ``Delta1`` as for the matched alpha, and each
  correctly decoded gradient unbiased): ``Delta1`` is the smallest whose decoding-failure
  probability ``Pr(|z + u| > Delta2 / 2)`` is ``nested_failure`` for Gaussian ``z``.
* ``sigma_z`` is measured: the decoder inverts the mean square of ``g^_p - g_bar =
  alpha (alpha z - e)`` (:func:`measured_sigma`) and the worker uses the previous step's
  (``"ps"``: the server appends the ``n2`` values to the average it broadcasts). Before
  the first measurement a ``P2`` worker sends a DQSG payload. An auto payload starts with
  ``(Delta1, alpha)`` as float32 (``Delta1 = 0``: DQSG follows): no decoder state.

``--nested-delta1`` (with ``--nested-k``, ``--nested-alpha``) gives a fixed
codec instead: the paper's Figure 6 setting is ``M = 2`` (``Delta = 0.5``) for
``P1`` and ``Delta1 = 1/3``, ``Delta2 = 1`` (``k = 3``) for ``P2``.
``--nested-sigma S`` applies Theorem 6 once, for a fixed ``sigma_z = S``.

Wire. ``P1`` and ``P2`` payloads differ in size, so NDQSG moves them with
``neighbor_exchange`` (buffers may differ by rank): ``"allgather"``, every
rank sends its payload to every other rank (the bytes an all-gather counts);
``"ps"``, every rank but 0 sends its payload to rank 0 (rank 0 answers with an
empty buffer), then rank 0 broadcasts the fp32 average.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..codecs import DitheredCodec, NestedDitheredCodec, choose_nested_parameters
from ..codecs.base import Payload, pack_header, unpack_header
from ..codecs.dithered import _float32_up
from ..codecs.quantize import check_int_range
from ..codecs.rng import shared_generator
from .faults import received_from
from .base import State
from .compressed import GatheredAlgorithm
from .config import BITS, Option, parse_theta, reads


def dqsg_levels(levels, bits) -> int:
    """DQSG's ``M``: ``levels`` if given, else the largest ``M`` with ``2M + 1 <= 2^bits``."""
    if levels is not None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 2**15:
            raise ValueError(f"levels (DQSG's M, 2M + 1 indices) must be an integer in 1..32768, got {levels!r}")
        return levels
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"bits must be an integer in 2..16 for dqsg/ndqsg (2M + 1 indices with M >= 1), "
                         f"got {bits!r}; or give levels")
    return (2**bits - 1) // 2


LEVELS_OPT = Option("levels", None, "DQSG/NDQSG: M (2M+1 indices, Delta = 1/M); default the largest M with "
                    "2M+1 <= 2^bits", int | None)


def dqsg_field():
    """The ``levels`` field of DQSG and NDQSG: ``levels``, or the largest M that ``bits`` holds."""
    return reads(BITS, LEVELS_OPT, build=lambda cls, cfg: dqsg_levels(cfg.levels, cfg.bits), default=1)


def dqsg_codec(levels: int) -> DitheredCodec:
    """DQSG's quantizer (NDQSG's P1): ``M = levels``, subtractive dither."""
    return DitheredCodec(levels=levels, subtractive=True)


def dqsg_encode(codec: DitheredCodec, ctx, k: int, g: torch.Tensor) -> Payload:
    """Algorithm 1, worker p at step k: ``kappa_p`` and the indices of ``g`` with the dither ``u_p``
    drawn from ``shared_generator(seed, k, p)``."""
    return codec.encode(g, generator=shared_generator(ctx.seed, k, ctx.rank))


def dqsg_decode(codec: DitheredCodec, ctx, k: int, sender: int, wire: torch.Tensor) -> torch.Tensor:
    """Algorithm 1, the server: ``sender``'s gradient in float64, its dither ``u_p`` regenerated."""
    gen = shared_generator(ctx.seed, k, sender)
    return codec.decode(codec.payload_from_wire(wire), generator=gen, dtype=torch.float64)


@dataclass(frozen=True)
class DQSG(GatheredAlgorithm):
    """DQSG: every worker sends its gradient quantized with a random dither that the server
    regenerates and subtracts (subtractive dithered quantization), and all workers apply the
    average of the decoded gradients.

    ``levels``: ``M``, the indices per sign (``2M + 1`` in all, step ``Delta = 1/M`` of the
    gradient's largest magnitude; ``lowbit train`` takes the largest ``M`` that ``bits``
    holds unless ``levels`` is given). ``server``: see :class:`GatheredAlgorithm`.
    Algorithm 1 of the paper: ``DitheredCodec``, the dither ``u_p`` from ``shared_generator(seed,
    k, p)``."""

    levels: int = dqsg_field()
    name = "dqsg"

    def __post_init__(self):
        super().__post_init__()
        dqsg_levels(self.levels, None)

    @property
    def codec(self) -> DitheredCodec:
        """The quantizer: ``M`` levels, subtractive dither."""
        return dqsg_codec(self.levels)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def encode(self, state, ctx, k, g):
        return dqsg_encode(self.codec, ctx, k, g)

    def decode(self, ctx, k, sender, wire):
        return dqsg_decode(self.codec, ctx, k, sender, wire)


def nested_group_size(world_size: int, fraction) -> int:
    """``n2 = round(fraction P)``, at most ``P - 1`` (P1 must provide the first side information)."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction < 1:
        raise ValueError(f"nested_fraction must be a number in [0, 1), got {fraction!r}")
    return min(world_size - 1, int(math.floor(fraction * world_size + 0.5)))


AUTO = "auto"
DEFAULT_K = 2  # one bit per element: DQSG's default M = 1 sends 3 levels, so only k = 2 sends fewer
DEFAULT_FAILURE = 0.001  # Theorem 6's per-element decoding-failure target of the auto setting


def nested_codec(*, delta1=None, k: int = DEFAULT_K, alpha=None, sigma=None,
                 failure=DEFAULT_FAILURE) -> NestedDitheredCodec | None:
    """The P2 workers' quantizer, or ``None`` for the auto setting (the default).

    * ``delta1`` given: that fixed codec, ``(delta1, k, alpha)``, ``alpha`` default 1 (the
      paper's Figure 6 is ``delta1 = 1/3, k = 3``);
    * ``sigma`` a number: Theorem 6 once, for side-information noise of std ``sigma``
      (relative to kappa): failure probability ``failure`` for Gaussian noise, ``alpha``
      matched unless given;
    * neither, or ``sigma="auto"``: ``None``; :class:`NDQSG` then chooses the codec by
      Theorem 6 at every step from the noise it measured at the previous one."""
    auto = sigma is None or isinstance(sigma, str)
    if isinstance(sigma, str) and sigma != AUTO:
        raise ValueError(f"nested_sigma must be a number > 0 or 'auto', got {sigma!r}")
    if sigma == AUTO and delta1 is not None:
        raise ValueError("give nested_delta1 (a fixed codec) or nested_sigma='auto', not both")
    check_int_range(k, "nested_k", 2, 2**32)
    check_failure(failure)
    if not auto:
        if delta1 is not None:
            raise ValueError("give nested_delta1 or nested_sigma (Theorem 6 chooses delta1), not both")
        par = choose_nested_parameters(sigma, failure, k=k, alpha="matched" if alpha is None else alpha,
                                       method="gaussian")
        return par.codec()
    if delta1 is None:
        if alpha is not None:
            raise ValueError("nested_alpha: the auto setting uses Theorem 6's matched alpha; give nested_delta1 "
                             "(a fixed codec) or nested_sigma (Theorem 6 once) with it")
        return None
    return NestedDitheredCodec(delta1=delta1, k=k, alpha=1.0 if alpha is None else alpha)


def check_failure(failure) -> float:
    """``failure`` as a float if it is a probability in (0, 1); a ValueError otherwise."""
    if isinstance(failure, bool) or not isinstance(failure, numbers.Real) or not 0 < failure < 1:
        raise ValueError(f"nested_failure must be a number in (0, 1), got {failure!r}")
    return float(failure)


NESTED_FRACTION_OPT = Option("nested_fraction", 0.5, "NDQSG: fraction of workers in P2 (nested quantizer), in "
                             "[0, 1)", float, lambda v: nested_group_size(2, v))
NESTED_DELTA1_OPT = Option("nested_delta1", None, "NDQSG: a fixed fine step Delta1 relative to ||g||_inf (default: "
                           "auto, see --nested-sigma)", float | None)
NESTED_K_OPT = Option("nested_k", DEFAULT_K, "NDQSG: Delta2 = k Delta1, k >= 2 (ceil(log2 k) bits per element; "
                      "default 2, one bit)", int, lambda v: check_int_range(v, "nested_k", 2, 2**32))
NESTED_ALPHA_OPT = Option("nested_alpha", None, "NDQSG: shrinkage alpha in (0, 1] with --nested-delta1 (default 1) "
                          "or --nested-sigma (default matched)", float | None)
NESTED_SIGMA_OPT = Option("nested_sigma", None, "NDQSG: 'auto' (the default unless --nested-delta1): Theorem 6 "
                          "every step for the side-information noise measured at the previous one; or a fixed noise "
                          "std (relative to ||g||_inf)", float | str | None, None, {"type": parse_theta})
NESTED_FAILURE_OPT = Option("nested_failure", DEFAULT_FAILURE, "NDQSG: Theorem 6 target decoding-failure "
                            "probability per element, for Gaussian side-information noise (auto or --nested-sigma)",
                            float, check_failure)


def _nested_from(cls, cfg) -> NestedDitheredCodec | None:
    """NDQSG's ``nested`` from the options (:func:`nested_codec`; None: the auto setting)."""
    return nested_codec(delta1=cfg.nested_delta1, k=cfg.nested_k, alpha=cfg.nested_alpha, sigma=cfg.nested_sigma,
                        failure=cfg.nested_failure)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def theorem6_codec(sigma_z: float, k: int, failure: float) -> NestedDitheredCodec:
    """The auto setting's codec for side-information noise of std ``sigma_z`` (relative to
    kappa): Theorem 6 with ``alpha = 1`` (eq. (9) is then ``Delta1^2 / 12``, DQSG's variance at
    step ``Delta1``, and a correctly decoded ``g^_p = g_p - e`` is unbiased) and the smallest
    ``Delta1`` whose failure probability ``Pr(|z + u| > Delta2 / 2)`` is ``failure`` for
    Gaussian ``z`` (the paper's model of the SG noise, footnote 2). ``Delta1`` (and ``alpha``)
    are rounded to float32, as they travel in the payload's header."""
    par = choose_nested_parameters(sigma_z, failure, k=k, alpha=1.0, method="gaussian")
    return NestedDitheredCodec(delta1=_f32(par.delta1), k=k, alpha=_f32(par.alpha))


def measured_sigma(g_hat: torch.Tensor, g_bar: torch.Tensor, kappa: float, delta1: float, alpha: float):
    """Side-information noise std ``sigma_z`` (relative to ``kappa``) from one decoded P2
    gradient ``g_hat`` and the side information ``g_bar`` it was decoded against.

    With correct decoding (appendix E) ``g_hat - g_bar = alpha (alpha z - e)``, ``e`` uniform of
    variance ``Delta1^2 / 12`` and independent of ``z``, so ``m^2 = mean((g_hat - g_bar)^2) /
    kappa^2 = alpha^2 (alpha^2 sigma_z^2 + Delta1^2 / 12)`` and ``sigma_z^2 = (m^2 / alpha^2 -
    Delta1^2 / 12) / alpha^2``. A DQSG payload is ``alpha = 1``, ``Delta1 = 1/M``. ``None``
    when ``kappa`` is 0 (a zero gradient says nothing)."""
    if kappa <= 0 or g_hat.numel() == 0:
        return None
    m2 = float(((g_hat - g_bar).to(torch.float64) / kappa).square().mean())
    s2 = (m2 / alpha**2 - delta1**2 / 12) / alpha**2
    return math.sqrt(max(s2, _SIGMA_FLOOR**2))


_SIGMA_FLOOR = 1e-6  # relative to kappa: the side information can never be trusted beyond this


@dataclass
class NDQSGState(State):
    """What an NDQSG worker remembers: in the auto setting, the side-information noise
    ``sigma_z`` (relative to kappa) that its last nested payload showed (None before the
    first measurement, and always on a P1 worker)."""

    sigma_z: float | None = None


@dataclass(frozen=True)
class NDQSG(GatheredAlgorithm):
    """NDQSG: like DQSG, but a group of workers sends fewer bits with a nested (coarse-modulo)
    dithered quantizer that the server decodes against the average of the gradients it has
    already decoded (side information).

    ``levels``: DQSG's ``M`` for the first group (P1). ``nested``: the second group's (P2's)
    quantizer, or None for the auto setting (Theorem 6 every step, from the noise measured at
    the previous one). ``nested_fraction``: the share of workers in P2 (the last ranks), in
    [0, 1). ``k``: the auto setting's ``Delta2 / Delta1`` (``ceil(log2 k)`` bits per element).
    ``failure``: the auto setting's per-element decoding-failure target. ``server``: see
    :class:`GatheredAlgorithm`. Algorithm 2 of the paper; see the module docstring."""

    levels: int = dqsg_field()
    nested: NestedDitheredCodec | None = reads(NESTED_DELTA1_OPT, NESTED_K_OPT, NESTED_ALPHA_OPT, NESTED_SIGMA_OPT,
                                               NESTED_FAILURE_OPT, build=_nested_from, default=None)
    nested_fraction: float = reads(NESTED_FRACTION_OPT, default=0.5)
    k: int = reads(NESTED_K_OPT, default=DEFAULT_K)
    failure: float = reads(NESTED_FAILURE_OPT, default=DEFAULT_FAILURE)
    name = "ndqsg"
    _KAPPA = "f"  # the P2 worker's float32 scale, in front of the nested payload
    _AUTO = "ff"  # auto setting: (Delta1, alpha) of this payload's codec; Delta1 = 0: a DQSG payload follows

    def __post_init__(self):
        super().__post_init__()
        dqsg_levels(self.levels, None)
        if self.nested is not None and not isinstance(self.nested, NestedDitheredCodec):
            raise ValueError(f"nested must be a NestedDitheredCodec or None (auto), got {type(self.nested).__name__}")
        if self.nested is not None:
            object.__setattr__(self, "k", self.nested.k)  # the fixed codec's k
        object.__setattr__(self, "failure", float(self.failure))

    @property
    def codec(self) -> DitheredCodec:
        """P1's quantizer: DQSG's, ``M`` levels, subtractive dither."""
        return dqsg_codec(self.levels)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def decode(self, ctx, k, sender, wire):
        """A P1 payload (DQSG's)."""
        return dqsg_decode(self.codec, ctx, k, sender, wire)

    @property
    def auto(self) -> bool:
        return self.nested is None

    @classmethod
    def check_config(cls, cfg):
        nested_group_size(cfg.workers, cfg.nested_fraction)

    def init(self, x, ctx):
        return NDQSGState()

    def n1(self, ctx) -> int:
        """The size of P1 (the first ranks) among ``ctx.world_size`` workers."""
        return ctx.world_size - nested_group_size(ctx.world_size, self.nested_fraction)

    def in_p2(self, ctx, rank: int) -> bool:
        """Whether ``rank`` is in P2 (sends nested codes)."""
        return rank >= self.n1(ctx)

    def worker_bits_per_element(self, state, ctx):
        """P2: the nested codec's bits per element, which depend on ``k`` alone (the auto setting's
        first step, which sends DQSG, is not counted)."""
        if not self.in_p2(ctx, ctx.rank):
            return float(self.codec.bits)
        return float((self.nested or NestedDitheredCodec(delta1=1.0, k=self.k)).bits)

    # --- P2 encode ----------------------------------------------------------------------------
    def _encode_nested(self, ctx, k, g, codec: NestedDitheredCodec) -> Payload:
        x64 = g.detach().to(torch.float64)
        kappa = float(_float32_up(x64.abs().amax().reshape(1))[0]) if x64.numel() else 0.0
        v = x64 / kappa if kappa > 0 else torch.zeros_like(x64)
        inner = codec.encode(v, generator=shared_generator(ctx.seed, k, ctx.rank))
        return Payload(header=torch.cat([pack_header(self._KAPPA, kappa, device=g.device), inner.header]),
                       data=inner.data)

    def encode(self, state, ctx, k, g):
        if not self.in_p2(ctx, ctx.rank):
            return dqsg_encode(self.codec, ctx, k, g)
        if not self.auto:
            return self._encode_nested(ctx, k, g, self.nested)
        if state.sigma_z is None:  # nothing measured yet: this step's payload is DQSG's
            inner, d1, alpha = dqsg_encode(self.codec, ctx, k, g), 0.0, 0.0
        else:
            codec = theorem6_codec(state.sigma_z, self.k, self.failure)
            inner, d1, alpha = self._encode_nested(ctx, k, g, codec), codec.delta1, codec.alpha
        return Payload(header=torch.cat([pack_header(self._AUTO, d1, alpha, device=g.device), inner.header]),
                       data=inner.data)

    # --- decode ------------------------------------------------------------------------------
    def decode_nested(self, ctx, k, sender, wire, g_bar, codec: NestedDitheredCodec | None = None):
        """Eq. (7) against ``g_bar``; returns the decoded gradient and the sender's kappa."""
        codec = self.nested if codec is None else codec
        (kappa,) = unpack_header(self._KAPPA, wire[:4])
        if kappa == 0:
            return torch.zeros_like(g_bar), 0.0
        inner = codec.payload_from_wire(wire[4:])
        gen = shared_generator(ctx.seed, k, sender)
        return codec.decode(inner, ref=g_bar / kappa, generator=gen) * kappa, kappa

    def decode_p2(self, ctx, k, sender, wire, g_bar):
        """A P2 payload against ``g_bar``: the gradient and, in the auto setting, the
        side-information noise it shows (:func:`measured_sigma`; ``None`` otherwise)."""
        if not self.auto:
            return self.decode_nested(ctx, k, sender, wire, g_bar)[0], None
        d1, alpha = unpack_header(self._AUTO, wire[:8])
        rest = wire[8:]
        if d1 == 0:  # a DQSG payload (the sender had measured nothing yet)
            g_p = self.decode(ctx, k, sender, rest)
            _, kappa = unpack_header(self.codec.header_format, self.codec.payload_from_wire(rest).header)[:2]
            return g_p, measured_sigma(g_p, g_bar, kappa, self.codec.step, 1.0)
        codec = NestedDitheredCodec(delta1=d1, k=self.k, alpha=alpha)
        g_p, kappa = self.decode_nested(ctx, k, sender, rest, g_bar, codec)
        return g_p, measured_sigma(g_p, g_bar, kappa, d1, alpha)

    def average_measured(self, ctx, k, wires):
        """Algorithm 2's decoder: the average over all workers and, per P2 rank, the noise its
        payload showed."""
        n1 = self.n1(ctx)

        def peer(p, decode):  # a peer's payload that does not decode is named with its sender
            if p == ctx.rank:
                return decode()
            with received_from(self.name, ctx.rank, p, k):
                return decode()

        g_bar = sum(peer(p, lambda: self.decode(ctx, k, p, wires[p])) for p in range(n1)) / n1
        sigmas = {}
        for i, p in enumerate(range(n1, ctx.world_size)):
            g_p, sigmas[p] = peer(p, lambda: self.decode_p2(ctx, k, p, wires[p], g_bar))
            with received_from(self.name, ctx.rank, p, k):
                if g_p.shape != g_bar.shape:
                    raise ValueError(f"it decodes to {g_p.numel()} elements, the receiver expects {g_bar.numel()}")
            g_bar = (g_bar * (n1 + i) + g_p) / (n1 + i + 1)  # the running average, Algorithm 2
        return g_bar, sigmas

    def average(self, ctx, k, wires):
        return self.average_measured(ctx, k, wires)[0]

    @staticmethod
    def _keep_sigma(state: NDQSGState, sigma) -> None:
        if sigma is not None and math.isfinite(sigma):
            state.sigma_z = sigma

    def exchange(self, state, ctx, k, wire, g):
        t, n, rank, n1 = ctx.transport, ctx.world_size, ctx.rank, self.n1(ctx)
        if self.server == "allgather":
            others = [j for j in range(n) if j != rank]
            got = t.neighbor_exchange(wire, others) if others else {}
            got[rank] = wire
            avg, sigmas = self.average_measured(ctx, k, [got[j] for j in range(n)])
            self._keep_sigma(state, sigmas.get(rank))  # every rank decodes the same: its own noise is known
            return avg.to(g.dtype)
        if rank == 0:
            got = t.neighbor_exchange(torch.empty(0, dtype=torch.uint8, device=wire.device), list(range(1, n))) \
                if n > 1 else {}
            got[0] = wire
            avg, sigmas = self.average_measured(ctx, k, [got[j] for j in range(n)])
            out = avg.reshape(-1)
            if self.auto:  # the server tells each P2 worker its measured noise (float32, NaN: none)
                tail = torch.tensor([math.nan if sigmas[p] is None else sigmas[p] for p in range(n1, n)],
                                    dtype=torch.float64, device=out.device)
                out = torch.cat([out, tail])
        else:
            t.neighbor_exchange(wire, [0])
            out = torch.empty(g.numel() + (n - n1 if self.auto else 0), device=g.device)
        out = t.broadcast(out.to(device=g.device, dtype=torch.float32), src=0)  # fp32 average (and noises)
        if self.auto and self.in_p2(ctx, rank):
            self._keep_sigma(state, float(out[g.numel() + rank - n1]))
        return out[: g.numel()].reshape(g.shape).to(g.dtype)


__all__ = ["AUTO", "DQSG", "NDQSG", "NDQSGState", "check_failure", "dqsg_levels", "measured_sigma", "nested_codec",
           "nested_group_size",
           "theorem6_codec"]
