"""D2 (Tang et al. 2018, "D^2: Decentralized Training over Decentralized
Data") with exact (fp32) gossip, and Moniqua on D2 (section 5 of the Moniqua
paper, Theorem 4).

In matrix form (columns are workers)::

    X_{k+1/2} = 2 X_k - X_{k-1} - a_k G_k + a_{k-1} G_{k-1}
    X_{k+1}   = X_{k+1/2} W                                  (d2: fp32 on the wire)
    X_{k+1}   = X_{k+1/2} W + (Xh_{k+1/2} - X_{k+1/2})(W - I) (moniqua-d2: modulo gossip)

with X_{-1} = X_0 and G_{-1} = 0 (so the first step is D-PSGD's; the paper's
convention X_{-1} = 0 is the same under its x_0 = 0). The extrapolation
cancels the outer variance of non-identical local data, which D-PSGD cannot.

In the training loop: ``before_update`` stores X_k and sets
``x <- 2 x_k - x_{k-1} + u_{k-1}``; the optimizer then subtracts a_k g_k;
``after_update`` records the step it actually took, ``u_k = x_pre - x_post``
(= a_k g_k for plain SGD), and gossips x_{k+1/2}. Because u_k is the step
actually taken, weight decay is exact (it is D2 on f + wd |x|^2 / 2).
Momentum is rejected: the heavy-ball step depends on past gradients, so the
correction ``- u_k + u_{k-1}`` would no longer cancel the outer variance as
D2's equations require.

State: X_{k-1} and u_{k-1} (two vectors of d, ``state_tensors``). Moniqua-D2
is D2 with :class:`~lowbit.algorithms.moniqua.Moniqua` as its gossip (theta, auto
theta, slack matrix, verification, entropy coding); with ``theta="auto"``
the first theta comes from the first step actually taken, u_0 (Theorem 4's
constant (6 D_1 n + 8) depends on eigenvalue constants D_1 the paper defines
only in its supplement), and verification's wrong blocks move it after that.

Stability: D2 needs lambda_min(W) > -1/3 (Tang et al. 2018); the uniform
ring (weights 1/3) has lambda_min = -1/3 exactly for even n, a marginal mode
that fp32 D2 survives but that accumulates Moniqua's quantization noise.
moniqua-d2 therefore wants the slack matrix (gamma < 1 moves lambda_min to
1 - 4 gamma / 3) and a small quantization error (4 bits, small theta): on
digits-mlp with a label split, bits=4, theta=0.2, gamma=0.5 trains as fp32
D2 does while bits=2 with theta 0.5-4 diverges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import GossipAlgorithm, State
from .config import options_of, reads
from .dpsgd import DPSGD
from .moniqua import Moniqua


def check_d2_config(cfg) -> None:
    """Reject run options D2's recursion cannot take (momentum)."""
    if cfg.momentum != 0:
        raise ValueError(f"momentum must be 0 for algorithm={cfg.algorithm!r} (got {cfg.momentum}): D2's "
                         f"correction -a_k g_k + a_(k-1) g_(k-1) cancels the outer variance only for plain "
                         f"gradient steps; pass --momentum 0")


def extrapolate(prev_x: torch.Tensor, prev_step: torch.Tensor, x: torch.Tensor) -> None:
    """Before the optimizer step: x <- 2 x_k - x_{k-1} + u_{k-1}; prev_x <- x_k; prev_step
    holds x_pre until :func:`step_taken` (the optimizer then subtracts a_k g_k)."""
    pre = x * 2 - prev_x + prev_step
    prev_x.copy_(x)
    x.copy_(pre)
    prev_step.copy_(x)


def step_taken(prev_step: torch.Tensor, x: torch.Tensor) -> None:
    """After the optimizer step: u_k = x_pre - x_{k+1/2}, the step it actually took."""
    prev_step.sub_(x)


@dataclass
class D2State(State):
    """D2's memory: the previous iterate, the previous step and the mixing rule's state."""

    prev_x: torch.Tensor     # X_{k-1}
    prev_step: torch.Tensor  # u_{k-1} = a_{k-1} G_{k-1} (x_pre between the two phases)
    gossip: State            # the mixing rule's own state


@dataclass(frozen=True)
class D2(GossipAlgorithm):
    """D2: decentralized SGD that extrapolates each model from its last two iterates and
    steps before mixing, which cancels the spread that workers' different local data cause.

    ``gossip`` is the mixing rule it wraps (a decentralized algorithm whose
    ``before_update`` applies X W): fp32 D-PSGD gossip by default. The gossip's
    ``before_update`` runs after the optimizer step on x_{k+1/2}, with the step taken,
    u_k, in place of the gradient."""

    gossip: GossipAlgorithm = field(default_factory=DPSGD)
    name = "d2"

    def __post_init__(self):
        if not isinstance(self.gossip, GossipAlgorithm):
            raise TypeError(f"gossip must be a decentralized lowbit algorithm, got {type(self.gossip).__name__}")

    @classmethod
    def check_config(cls, cfg):
        check_d2_config(cfg)

    def nominal_bits_per_element(self):
        return self.gossip.nominal_bits_per_element()

    def init(self, x, ctx):
        # X_{-1} = X_0, a_{-1} G_{-1} = 0
        return D2State(x.detach().clone(), torch.zeros_like(x), self.gossip.init(x, ctx))

    def before_update(self, state, ctx, k, x, g, lr):
        extrapolate(state.prev_x, state.prev_step, x)
        return state

    def after_update(self, state, ctx, k, x, g, lr):
        step_taken(state.prev_step, x)
        # the gossip's "gradient" is the step just taken, u_k (Moniqua's theta="auto" takes
        # theta_0 from u_0; D-PSGD's mixing reads none)
        state.gossip = self.gossip.before_update(state.gossip, ctx, k, x, state.prev_step, lr)
        return state

    def report(self, state):
        return self.gossip.report(state.gossip)


@dataclass(frozen=True, init=False)
class MoniquaD2(D2):
    """D2 whose models travel as Moniqua's modulo codes: D2's extrapolation around Moniqua's gossip.

    ``MoniquaD2(bits=2, theta=0.2, gamma=0.5)`` takes :class:`~lowbit.algorithms.moniqua.Moniqua`'s
    options (what each means is said there) and is ``D2(gossip=Moniqua(bits=2, theta=0.2,
    gamma=0.5))``; ``MoniquaD2(gossip=Moniqua(...))`` is the same. Section 5 of the Moniqua
    paper, Theorem 4: Algorithm 1's lines 3-6 applied to X_{k+1/2}."""

    gossip: Moniqua = reads(*options_of(Moniqua), build=lambda cls, cfg: Moniqua.from_config(cfg),
                            default_factory=Moniqua)
    name = "moniqua-d2"

    def __init__(self, gossip: Moniqua | None = None, **moniqua_options):
        if gossip is not None and moniqua_options:
            raise ValueError(f"give gossip=Moniqua(...) or Moniqua's options {sorted(moniqua_options)}, not both")
        object.__setattr__(self, "gossip", Moniqua(**moniqua_options) if gossip is None else gossip)
        self.__post_init__()

    def __post_init__(self):
        if not isinstance(self.gossip, Moniqua):
            raise TypeError(f"gossip must be a lowbit.algorithms.Moniqua, got {type(self.gossip).__name__}")

    @classmethod
    def run_warning(cls, report):
        return Moniqua.run_warning(report)  # the report is its gossip's
