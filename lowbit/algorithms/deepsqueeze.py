"""DeepSqueeze: Tang, Lian, Qiu, Yuan, Zhang, Zhang, Liu, "DeepSqueeze:
Decentralization Meets Error-Compensated Compression" (2019), Algorithm 1.

Per worker i at step t::

    1: g_t = grad F_i(x_t; xi)                                      (the loop)
    2: x_{t+1/2} = x_t - gamma g_t                                    (the optimizer step)
    3: v_t = x_{t+1/2} + delta_{t-1}                                  (error compensation)
    4: C(v_t) sent to neighbours;  delta_t = v_t - C(v_t)
    5: x_{t+1} = x_{t+1/2} + eta sum_j (W_ij - I_ij) C(v_t^(j))       (j = i included)

with delta_{-1} = 0. The error memory delta is the only extra state: d per
worker (the Theta(n d) of Table 1 in the Moniqua paper). eta, the consensus
step size, is ``--gamma`` in the CLI (in (0, 1]); default 1.0 for a lossless
codec (then step 5 is x_{t+1} = sum_j W_ij x_{t+1/2}^(j)) and 0.5 for a lossy
one (our fixed choice; the paper tunes it).
"""

from __future__ import annotations

import torch

from ..codecs import Codec, MinMaxCodec
from .legacy import GossipAlgorithm
from .choco import check_gamma, default_gamma
from .gossip import REPLICA_CODECS, exchange_compressed


class DeepSqueeze(GossipAlgorithm):
    name = "deepsqueeze"
    codecs = REPLICA_CODECS

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, codec=cfg.make_codec(cls.codecs), eta=cfg.gamma,
                   weights=cfg.weights, seed=cfg.seed)

    def __init__(self, transport, topology, *, codec: Codec | None = None, eta: float | None = None, **kw):
        super().__init__(transport, topology, **kw)
        self.codec = codec if codec is not None else MinMaxCodec(bits=8)
        self.eta = check_gamma(eta, "eta (--gamma)") if eta is not None else default_gamma(self.codec)
        self.delta: torch.Tensor | None = None

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def setup(self, x):
        self.delta = torch.zeros_like(x)

    def state_tensors(self):
        return {} if self.delta is None else {"delta": self.delta}

    def after_update(self, k, x, g, lr):
        v = x + self.delta                                                         # line 3
        cv, received = exchange_compressed(self, self.codec, k, v, self.neighbors)  # line 4
        self.delta.copy_(v - cv)
        step = cv * (self.w_self - 1.0)                                            # line 5, j = i
        for j in self.neighbors:
            step.add_(received[j], alpha=self.w[j])
        x.add_(step, alpha=self.eta)
