"""DeepSqueeze: Tang, Lian, Qiu, Yuan, Zhang, Zhang, Liu, "DeepSqueeze:
Decentralization Meets Error-Compensated Compression" (2019), Algorithm 1.

Per worker i at step t::

    1: g_t = grad F_i(x_t; xi)                                      (the loop)
    2: x_{t+1/2} = x_t - gamma g_t                                    (the optimizer step)
    3: v_t = x_{t+1/2} + delta_{t-1}                                  (error compensation)
    4: C(v_t) sent to neighbours;  delta_t = v_t - C(v_t)
    5: x_{t+1} = x_{t+1/2} + eta sum_j (W_ij - I_ij) C(v_t^(j))       (j = i included)

with delta_{-1} = 0 (lines 3-4 are :mod:`~lowbit.algorithms.feedback`'s compensate and
remember, the error feedback every algorithm shares). The error memory delta is the only extra state: d per
worker (the Theta(n d) of Table 1 in the Moniqua paper). eta, the consensus
step size, is ``--gamma`` in the CLI (in (0, 1]); default 1.0 for a lossless
codec (then step 5 is x_{t+1} = sum_j W_ij x_{t+1/2}^(j)) and 0.5 for a lossy
one (our fixed choice; the paper tunes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import Codec, MinMaxCodec
from .base import GossipAlgorithm, State
from .choco import default_gamma
from .feedback import compensate, remember
from .config import GAMMA, codec_field, reads
from .gossip import REPLICA_CODECS, check_codec, check_gamma, exchange_compressed, mix


@dataclass
class DeepSqueezeState(State):
    """DeepSqueeze's memory on worker i: the compression error delta not yet sent (zero at
    the start)."""

    delta: torch.Tensor


@dataclass(frozen=True)
class DeepSqueeze(GossipAlgorithm):
    """DeepSqueeze: each worker takes its gradient step, sends its neighbours its model
    compressed with the error of its previous compression added back, and moves its model
    towards the compressed models it received.

    Options: ``codec`` compresses the models (min-max 2 bits by default, as --bits); ``eta`` is the
    consensus step size, how far a worker moves towards its neighbours each step, in
    (0, 1] (``--gamma`` on the command line; None: 1.0 for the lossless fp32 codec, 0.5
    for a lossy one). This is Algorithm 1 of Tang et al. 2019 (see the module
    docstring). Extra memory: the error, d."""

    codec: Codec = codec_field(default_factory=lambda: MinMaxCodec(bits=2))
    eta: float | None = reads(GAMMA, build=lambda cls, cfg: cfg.gamma, default=None)  # --gamma, checked as eta
    name = "deepsqueeze"
    codecs = REPLICA_CODECS

    def __post_init__(self):
        check_codec(self.codec)
        object.__setattr__(self, "eta",
                           default_gamma(self.codec) if self.eta is None else check_gamma(self.eta, "eta (--gamma)"))

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def init(self, x, ctx):
        return DeepSqueezeState(torch.zeros_like(x))  # delta_{-1} = 0

    def after_update(self, state, ctx, k, x, g, lr):
        v = compensate(x, state.delta)                                            # line 3
        cv, received = exchange_compressed(ctx, self.codec, k, v, ctx.neighbors, self.name)  # line 4
        remember(state.delta, v, cv)
        x.add_(mix(ctx, cv, received, w_self=ctx.w_self - 1.0), alpha=self.eta)   # line 5: sum_j (W - I)_ij C(v_j)
        return state
