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
units of ``kappa_p``. The paper's Figure 6 setting is ``M = 2`` (``Delta =
0.5``) for ``P1`` and ``Delta1 = 1/3``, ``Delta2 = 1`` (``k = 3``) for ``P2``.

Wire. ``P1`` and ``P2`` payloads differ in size, so NDQSG moves them with
``neighbor_exchange`` (buffers may differ by rank): ``"allgather"``, every
rank sends its payload to every other rank (the bytes an all-gather counts);
``"ps"``, every rank but 0 sends its payload to rank 0 (rank 0 answers with an
empty buffer), then rank 0 broadcasts the fp32 average.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..codecs import DitheredCodec, NestedDitheredCodec, choose_nested_parameters
from ..codecs.base import Payload, pack_header, unpack_header
from ..codecs.dithered import _float32_up
from ..codecs.rng import shared_generator
from .compressed import GatheredAlgorithm


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


class DQSG(GatheredAlgorithm):
    """Algorithm 1: subtractive dithered quantization, ``M`` levels (``Delta = 1/M``)."""

    name = "dqsg"

    def __init__(self, transport, *, levels: int = 2, server: str = "allgather", seed: int = 0):
        super().__init__(transport, server=server, seed=seed)
        self.codec = DitheredCodec(levels=dqsg_levels(levels, None), subtractive=True)

    @classmethod
    def check_config(cls, cfg):
        dqsg_levels(cfg.levels, cfg.bits)

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, levels=dqsg_levels(cfg.levels, cfg.bits), server=cfg.server, seed=cfg.seed)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def encode(self, k, g):
        return self.codec.encode(g, generator=shared_generator(self.seed, k, self.rank))

    def decode(self, k, sender, wire):
        gen = shared_generator(self.seed, k, sender)  # the server regenerates u_p
        return self.codec.decode(self.codec.payload_from_wire(wire), generator=gen, dtype=torch.float64)


def nested_group_size(world_size: int, fraction) -> int:
    """``n2 = round(fraction P)``, at most ``P - 1`` (P1 must provide the first side information)."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction < 1:
        raise ValueError(f"nested_fraction must be a number in [0, 1), got {fraction!r}")
    return min(world_size - 1, int(math.floor(fraction * world_size + 0.5)))


def nested_codec(*, delta1=None, k: int = 3, alpha=None, sigma=None, failure=0.05) -> NestedDitheredCodec:
    """The P2 workers' quantizer: given ``(delta1, k, alpha)`` (default the paper's Figure 6:
    ``Delta1 = 1/3``, ``k = 3``, ``alpha = 1``), or from Theorem 6 for side-information noise
    of std ``sigma`` (relative to kappa) and per-element failure probability ``failure``."""
    if sigma is not None:
        if delta1 is not None:
            raise ValueError("give nested_delta1 or nested_sigma (Theorem 6 chooses delta1), not both")
        par = choose_nested_parameters(sigma, failure, k=k, alpha="matched" if alpha is None else alpha)
        return par.codec()
    return NestedDitheredCodec(delta1=1 / 3 if delta1 is None else delta1, k=k, alpha=1.0 if alpha is None else alpha)


class NDQSG(DQSG):
    """Algorithm 2: P1 sends DQSG, P2 sends nested dithered codes decoded against ``g_bar``."""

    name = "ndqsg"
    _KAPPA = "f"  # the P2 worker's float32 scale, in front of the nested payload

    def __init__(self, transport, *, levels: int = 2, nested: NestedDitheredCodec | None = None,
                 nested_fraction: float = 0.5, server: str = "allgather", seed: int = 0):
        super().__init__(transport, levels=levels, server=server, seed=seed)
        self.nested = nested if nested is not None else nested_codec()
        if not isinstance(self.nested, NestedDitheredCodec):
            raise ValueError(f"nested must be a NestedDitheredCodec, got {type(self.nested).__name__}")
        self.n2 = nested_group_size(self.world_size, nested_fraction)
        self.n1 = self.world_size - self.n2

    @classmethod
    def _nested_from(cls, cfg):
        return nested_codec(delta1=cfg.nested_delta1, k=cfg.nested_k, alpha=cfg.nested_alpha,
                            sigma=cfg.nested_sigma, failure=cfg.nested_failure)

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        cls._nested_from(cfg)
        nested_group_size(cfg.workers, cfg.nested_fraction)

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, levels=dqsg_levels(cfg.levels, cfg.bits), nested=cls._nested_from(cfg),
                   nested_fraction=cfg.nested_fraction, server=cfg.server, seed=cfg.seed)

    def in_p2(self, rank: int) -> bool:
        return rank >= self.n1

    def nominal_bits_per_element(self):
        return float(self.nested.bits if self.in_p2(self.rank) else self.codec.bits)

    def encode(self, k, g):
        if not self.in_p2(self.rank):
            return super().encode(k, g)
        x64 = g.detach().to(torch.float64)
        kappa = float(_float32_up(x64.abs().amax().reshape(1))[0]) if x64.numel() else 0.0
        v = x64 / kappa if kappa > 0 else torch.zeros_like(x64)
        inner = self.nested.encode(v, generator=shared_generator(self.seed, k, self.rank))
        return Payload(header=torch.cat([pack_header(self._KAPPA, kappa, device=g.device), inner.header]),
                       data=inner.data)

    def decode_nested(self, k, sender, wire, g_bar):
        (kappa,) = unpack_header(self._KAPPA, wire[:4])
        if kappa == 0:
            return torch.zeros_like(g_bar)
        inner = self.nested.payload_from_wire(wire[4:])
        gen = shared_generator(self.seed, k, sender)
        return self.nested.decode(inner, ref=g_bar / kappa, generator=gen) * kappa

    def average(self, k, wires):
        g_bar = sum(self.decode(k, p, wires[p]) for p in range(self.n1)) / self.n1
        for i, p in enumerate(range(self.n1, self.world_size)):
            g_p = self.decode_nested(k, p, wires[p], g_bar)
            g_bar = (g_bar * (self.n1 + i) + g_p) / (self.n1 + i + 1)  # the running average, Algorithm 2
        return g_bar

    def exchange(self, k, wire, g):
        t, n = self.transport, self.world_size
        if self.server == "allgather":
            others = [j for j in range(n) if j != self.rank]
            got = t.neighbor_exchange(wire, others) if others else {}
            got[self.rank] = wire
            return self.average(k, [got[j] for j in range(n)]).to(g.dtype)
        if self.rank == 0:
            got = t.neighbor_exchange(torch.empty(0, dtype=torch.uint8, device=wire.device), list(range(1, n))) \
                if n > 1 else {}
            got[0] = wire
            out = self.average(k, [got[j] for j in range(n)])
        else:
            t.neighbor_exchange(wire, [0])
            out = torch.empty(g.shape, device=g.device)
        return t.broadcast(out.to(device=g.device, dtype=torch.float32), src=0).to(g.dtype)  # fp32 average


__all__ = ["DQSG", "NDQSG", "dqsg_levels", "nested_codec", "nested_group_size"]
