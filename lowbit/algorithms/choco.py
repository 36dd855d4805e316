"""CHOCO-SGD: Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization
and Gossip Algorithms with Compressed Communication" (ICML 2019), Algorithm 1.

Per worker i at step t (line numbers of Algorithm 1)::

    3: g_t = grad F_i(x_t; xi)                                       (the loop)
    4: x_{t+1/2} = x_t - eta g_t                                       (the optimizer step)
    5: q_i = Q(x_{t+1/2} - xh_i)                                       (sent to neighbours)
    6-8: xh_j <- xh_j + q_j   for j = i and every neighbour j
    9: x_{t+1} = x_{t+1/2} + gamma sum_j w_ij (xh_j - xh_i)

with xh_j = 0 at the start (the paper's initialisation).

Memory-efficient form: line 9 only needs the weighted sum of the
neighbours' xh_j (PowerGossip's CHOCO keeps that sum). Here worker i keeps xh_i
and the consensus term e_i = sum_{j in N(i)} w_ij (xh_j - xh_i), updated from
the decoded messages of lines 6-8 as e_i <- e_i + sum_j w_ij (q_j - q_i), so
that line 9 is x <- x + gamma e_i: 2 x d of extra memory whatever the degree,
against (degree + 1) x d for one xh_j per neighbour (the Theta(m d) of Table 1
in the Moniqua paper). e_i is a consensus gap, small beside the sum of the
xh_j, so its rounding is that of small numbers. The messages are the same as
the per-neighbour form's; the iterates are the same up to float rounding, not
bitwise: e_i is a running sum whose float32 rounding persists, where the
per-neighbour form recomputes the differences every step (measured in
tests/test_choco_memory.py: within 1e-11 relative with float64 models, every
codec; within 1.4e-6 relative after 60 float32 steps with the fp32 codec;
with a lossy codec in float32 that difference flips a few rounding decisions).

gamma (the consensus step size, ``--gamma``) must be in (0, 1]. Default: 1.0
for a lossless codec (fp32; CHOCO-SGD is then D-PSGD with the gradient step
first) and ``DEFAULT_GAMMA`` = 0.5 for a lossy one (Theorem 2's gamma* needs
the compression factor delta, which a min-max quantizer does not state; 0.5
is our fixed choice, not a tuned value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import Codec, IdentityCodec, MinMaxCodec
from .base import GossipAlgorithm, State
from .config import GAMMA, codec_field, reads
from .gossip import REPLICA_CODECS, check_codec, exchange_compressed, mix

DEFAULT_GAMMA = 0.5


def default_gamma(codec: Codec) -> float:
    """The consensus step size when none is given: 1.0 for the lossless codec (fp32),
    :data:`DEFAULT_GAMMA` for a lossy one."""
    return 1.0 if isinstance(codec, IdentityCodec) else DEFAULT_GAMMA


@dataclass
class ChocoState(State):
    """CHOCO-SGD's memory on worker i: its public estimate xh_i and the consensus term
    e_i = sum_j w_ij (xh_j - xh_i) (both zero at the start)."""

    xhat: torch.Tensor       # xh_i
    consensus: torch.Tensor  # e_i


@dataclass(frozen=True)
class ChocoSGD(GossipAlgorithm):
    """CHOCO-SGD: each worker takes its gradient step, sends its neighbours a compressed
    correction of a public estimate of its model, and moves its model towards its
    neighbours' estimates.

    Options: ``codec`` compresses the corrections (min-max 2 bits by default, as --bits); ``gamma``
    is the consensus step size, how far a worker moves towards its neighbours each step,
    in (0, 1] (None: 1.0 for the lossless fp32 codec, 0.5 for a lossy one). This is
    Algorithm 1 of Koloskova et al. 2019 (see the module docstring) in its
    memory-efficient form: 2 x d of extra memory whatever the degree."""

    codec: Codec = codec_field(default_factory=lambda: MinMaxCodec(bits=2))
    gamma: float | None = reads(GAMMA, default=None)
    name = "choco"
    codecs = REPLICA_CODECS

    def __post_init__(self):
        super().__post_init__()  # gamma's check
        check_codec(self.codec)
        object.__setattr__(self, "gamma", default_gamma(self.codec) if self.gamma is None else float(self.gamma))

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def init(self, x, ctx):
        return ChocoState(torch.zeros_like(x), torch.zeros_like(x))  # xh_i = 0: the paper's start

    def after_update(self, state, ctx, k, x, g, lr):
        # x is x_{t+1/2} here (line 4 was the optimizer step)
        q_i, q = exchange_compressed(ctx, self.codec, k, x - state.xhat, ctx.neighbors, self.name)  # 5
        state.xhat.add_(q_i)                                                               # 6-8
        state.consensus.add_(mix(ctx, q_i, q, relative=True))  # e_i += sum_j w_ij (q_j - q_i): one rounding
        x.add_(state.consensus, alpha=self.gamma)                                          # 9
        return state
