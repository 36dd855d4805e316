"""Moniqua on D-PSGD: Algorithm 1 of Lu & De Sa, "Moniqua: Modulo Quantized
Communication in Decentralized SGD" (ICML 2020).

Per worker i at step k (line numbers of Algorithm 1)::

    3: q_{k,i}  = Q_delta((x_{k,i} / B_theta) mod 1)                   (sent)
    4: xh_{k,i} = (q_{k,i} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (local biased term)
    5: xh_{k,j} = (q_{k,j} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (neighbour j, decoded against x_{k,i})
    6: x_{k+1/2,i} = x_{k,i} + sum_j (xh_{k,j} - xh_{k,i}) W_ji
    7: x_{k+1,i} = x_{k+1/2,i} - alpha_k g_{k,i}                        (the optimizer step)

with B_theta = 2 theta / (1 - 2 delta) (Lemma 2). Decoding is exact to
delta * B_theta as long as |x_{k,j} - x_{k,i}| < theta element-wise.
With ``shared_randomness`` (the default; section 6, "More efficient
Moniqua") all workers use the same stochastic-rounding offsets u at step k,
which makes the errors of nearby models cancel in line 6.
theta may follow the step size (theta_k proportional to alpha_k, as in
Theorem 2) with ``theta_schedule="lr"``. Moniqua keeps no state between
steps: its extra memory is 0 (Table 1 of the paper).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..codecs import ModuloCodec
from ..codecs.rng import shared_generator
from .base import GossipAlgorithm

THETA_SCHEDULES = ("constant", "lr")


class Moniqua(GossipAlgorithm):
    name = "moniqua"

    @classmethod
    def check_config(cls, cfg):
        ModuloCodec(bits=cfg.bits, theta=cfg.theta, rounding=cfg.rounding or "stochastic")

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, bits=cfg.bits, theta=cfg.theta, rounding=cfg.rounding or "stochastic",
                   theta_schedule=cfg.theta_schedule, shared_randomness=cfg.shared_randomness,
                   weights=cfg.weights, seed=cfg.seed)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def __init__(self, transport, topology, *, bits: int = 2, theta: float = 0.5,
                 rounding: str = "stochastic", theta_schedule: str = "constant",
                 shared_randomness: bool = True, **kw):
        super().__init__(transport, topology, **kw)
        if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
        if theta_schedule not in THETA_SCHEDULES:
            raise ValueError(f"theta_schedule must be one of {THETA_SCHEDULES}, got {theta_schedule!r}")
        self.codec = ModuloCodec(bits=bits, theta=float(theta), rounding=rounding)  # validates bits
        self.theta = float(theta)
        self.theta_schedule = theta_schedule
        self.shared_randomness = bool(shared_randomness)
        self._lr0: float | None = None

    def theta_at(self, lr: float) -> float:
        """theta_k: constant, or theta * alpha_k / alpha_0."""
        if self._lr0 is None:
            self._lr0 = lr
        if self.theta_schedule == "lr" and self._lr0 > 0:
            return self.theta * lr / self._lr0
        return self.theta

    def before_update(self, k, x, g, lr):
        codec = dataclasses.replace(self.codec, theta=self.theta_at(lr))
        # Shared randomness ("More efficient Moniqua", section 6): every worker draws the
        # same rounding offsets u at step k, so nearby models round alike.
        sender = 0 if self.shared_randomness else self.rank + 1
        gen = shared_generator(self.seed, k, sender, device=x.device)
        payload = codec.encode(x, generator=gen)                                   # line 3
        received = self.transport.neighbor_exchange(payload.to_wire(), self.neighbors)
        x_hat_i = codec.decode(payload, ref=x)                                     # line 4
        delta = torch.zeros_like(x)
        for j in self.neighbors:
            x_hat_j = codec.decode(codec.payload_from_wire(received[j]), ref=x)    # line 5
            delta.add_(x_hat_j.to(x.dtype) - x_hat_i.to(x.dtype), alpha=self.w[j])
        x.add_(delta)                                                              # line 6

