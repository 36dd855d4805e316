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
||p||_1 / d sign(p)``, ``e <- p - C(p)``. The randomness of worker ``p`` at
step ``k`` comes from ``shared_generator(seed, k, p)``.

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

from abc import abstractmethod

import torch

from ..codecs import PowerSGDCodec, QSGDCodec, SignCodec, TernGradCodec
from ..codecs.base import Codec, Payload
from ..codecs.rng import shared_generator
from .legacy import CentralizedAlgorithm

SERVERS = ("ps", "allgather")


def check_server(server) -> str:
    if server not in SERVERS:
        raise ValueError(f"server must be one of {SERVERS}, got {server!r}")
    return server


class GatheredAlgorithm(CentralizedAlgorithm):
    """Base of the centralized algorithms whose packed payloads are gathered
    (``server="ps"``) or all-gathered (``"allgather"``) and decoded one by one."""

    def __init__(self, transport, *, server: str = "allgather", seed: int = 0):
        super().__init__(transport, seed=seed)
        self.server = check_server(server)

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, server=cfg.server, seed=cfg.seed)

    # what a subclass provides -------------------------------------------------------
    @abstractmethod
    def encode(self, k: int, g: torch.Tensor) -> Payload:
        """This worker's gradient at step k as a payload of the same size on every rank."""

    @abstractmethod
    def decode(self, k: int, sender: int, wire: torch.Tensor) -> torch.Tensor:
        """The float64 gradient of ``sender`` from its wire buffer."""

    def average(self, k: int, wires: list[torch.Tensor]) -> torch.Tensor:
        """The float64 average of the decoded payloads (rank order)."""
        acc = None
        for p, w in enumerate(wires):
            x = self.decode(k, p, w).to(torch.float64)
            acc = x if acc is None else acc + x
        return acc / len(wires)

    # the exchange ----------------------------------------------------------------------
    def exchange(self, k: int, wire: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Gather/all-gather ``wire`` and return the average (float, like ``g``)."""
        t = self.transport
        if self.server == "allgather":
            return self.average(k, t.all_gather(wire)).to(g.dtype)
        wires = t.gather(wire, dst=0)
        out = self.average(k, wires) if self.rank == 0 else torch.empty(g.shape, device=g.device)
        return t.broadcast(out.to(device=g.device, dtype=torch.float32), src=0).to(g.dtype)  # the server sends fp32

    def before_update(self, k, x, g, lr):
        payload = self.encode(k, g)
        g.copy_(self.exchange(k, payload.to_wire(), g))


class _CodecGathered(GatheredAlgorithm):
    """A stateless codec; the sender's generator is ``shared_generator(seed, k, rank)``."""

    codec: Codec

    def encode(self, k, g):
        return self.codec.encode(g, generator=shared_generator(self.seed, k, self.rank))

    def decode(self, k, sender, wire):
        return self.codec.decode(self.codec.payload_from_wire(wire), dtype=torch.float64)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)


def qsgd_levels(bits: int) -> int:
    """The QSGD levels ``s`` whose ``2s + 1`` codes fill ``bits`` bits (``bits`` in 2..8)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 2..8 for qsgd (2s + 1 codes with s >= 1), got {bits!r}")
    return (2**bits - 1) // 2


class QSGD(_CodecGathered):
    name = "qsgd"

    def __init__(self, transport, *, bits: int = 4, server: str = "allgather", seed: int = 0):
        super().__init__(transport, server=server, seed=seed)
        self.codec = QSGDCodec(levels=qsgd_levels(bits))

    @classmethod
    def check_config(cls, cfg):
        qsgd_levels(cfg.bits)

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, bits=cfg.bits, server=cfg.server, seed=cfg.seed)


class TernGrad(_CodecGathered):
    name = "terngrad"
    codec = TernGradCodec()


class OneBitEF(_CodecGathered):
    """1-bit SGD with error feedback: ``p = g + e``, send ``C(p)``, ``e = p - C(p)``."""

    name = "onebit-ef"
    codec = SignCodec("mean_abs")

    def setup(self, x):
        self.e = torch.zeros_like(x)

    def encode(self, k, g):
        p = g + self.e
        payload = self.codec.encode(p)
        self.e.copy_(p - self.codec.decode(payload, dtype=torch.float64).to(p.dtype))
        return payload

    def state_tensors(self):
        return {"error": self.e}


def orthogonalize(P: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``P`` (reduced QR, float64)."""
    return torch.linalg.qr(P.to(torch.float64), mode="reduced").Q


class PowerSGD(CentralizedAlgorithm):
    """Rank-``rank`` PowerSGD with error feedback and warm start; see the module docstring."""

    name = "powersgd"

    def __init__(self, transport, *, rank: int = 2, seed: int = 0):
        super().__init__(transport, seed=seed)
        self.codec = PowerSGDCodec(rank=rank)  # validates rank, fixes the matrix layout

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, rank=cfg.powersgd_rank, seed=cfg.seed)

    def setup(self, x):
        self.d = x.numel()
        self.n, self.m, self.r = self.codec.matrix_shape(self.d)
        self.e = torch.zeros_like(x)
        self.Q = self.codec.init_state(self.d, shared_generator(self.seed, 0, 0), device=x.device)

    def state_tensors(self):
        return {"error": self.e, "Q": self.Q}

    def nominal_bits_per_element(self):
        """32-bit factors: ``32 (n + m) r / d`` bits per element."""
        if not hasattr(self, "d"):
            raise ValueError("PowerSGD.nominal_bits_per_element needs setup(x) first (it depends on d)")
        return 32.0 * (self.n + self.m) * self.r / self.d if self.d else 0.0

    def before_update(self, k, x, g, lr):
        t, N = self.transport, self.world_size
        d, n, m = self.d, self.n, self.m
        p = g.to(torch.float64) + self.e.to(torch.float64)
        M = torch.nn.functional.pad(p, (0, n * m - d)).view(n, m)
        P = t.all_reduce((M @ self.Q.to(torch.float64)).to(torch.float32), "sum") / N
        P_hat = orthogonalize(P).to(torch.float32).to(torch.float64)  # what every worker holds
        Q_m = M.T @ P_hat
        Q = t.all_reduce(Q_m.to(torch.float32), "sum") / N
        local = (P_hat @ Q_m.to(torch.float32).to(torch.float64).T).reshape(-1)[:d]
        self.e.copy_((p - local).to(self.e.dtype))
        g.copy_((P_hat @ Q.to(torch.float64).T).reshape(-1)[:d].to(g.dtype))
        self.Q = Q.contiguous()


__all__ = ["GatheredAlgorithm", "OneBitEF", "PowerSGD", "QSGD", "SERVERS", "TernGrad", "check_server",
           "orthogonalize", "qsgd_levels"]
