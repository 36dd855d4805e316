"""DCD-PSGD and ECD-PSGD: Tang, Gan, Zhang, Zhang, Liu, "Communication
Compression for Decentralized Training" (NeurIPS 2018).

Both keep, on worker i, a replica of every neighbour's model and send one
compressed vector C(.) per step to every neighbour.

**DCD-PSGD** (Algorithm 1, difference compression), per worker i at step t::

    1: g_t = grad F_i(x_t; xi)                                   (the loop)
    2: x_{t+1/2} = sum_j W_ij xh_t^(j)        (xh_t^(i) = x_t^(i), own model)
    3: x_{t+1/2} <- x_{t+1/2} - gamma g_t                          (the optimizer step)
    4: z_t = x_{t+1/2} - x_t,  C(z_t)                               (sent to neighbours)
    5: x_{t+1} = x_t + C(z_t)
    6: xh_{t+1}^(j) = xh_t^(j) + C(z_t^(j))   for every neighbour j

Every worker applies to its own model exactly the C(z) its neighbours add to
their replicas, so the replicas stay equal to the neighbours' models
(bitwise: the same float operations on the same numbers).

**ECD-PSGD** (Algorithm 2, extrapolation compression), with t = k + 1 for the
loop's step k = 0, 1, ...::

    2: x_{t+1/2} = sum_j W_ij y_t^(j)         (y^(i): this worker's own estimate)
    3: x_{t+1} = x_{t+1/2} - gamma g_t                              (the optimizer step)
    4: z_{t+1} = (1 - t/2) x_t + (t/2) x_{t+1},  C(z_{t+1})         (sent)
    5: y_{t+1}^(j) = (1 - 2/t) y_t^(j) + (2/t) C(z_{t+1}^(j))  for j = i and every neighbour

With a lossless C, y_{t+1} = x_{t+1} exactly; with an unbiased C the 2/t
weight averages the compression noise away. ECD needs an unbiased
compressor (the paper's assumption): its default min-max rounding is
"stochastic", and biased codecs (nearest rounding, sign, fp16) are rejected.

Both papers assume a common x_0 on all workers and initialise the replicas
to it. ``init`` here sends x_0 once, uncompressed, to each neighbour (counted in
the ledger at step 0), so the replicas are exact even when the x_0 differ.

Randomness of a stochastic C: worker p at step k draws from
``shared_generator(seed, k, p)``; receivers regenerate it for codecs with
``dither_on_decode``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..codecs import Codec, MinMaxCodec, codec_names
from .base import Context, GossipAlgorithm, State, transient
from .config import CODEC_OPTIONS, codec_field, reads
from .gossip import REPLICA_CODECS, check_codec, exchange_compressed, exchange_initial_models, mix


def check_unbiased(codec: Codec) -> None:
    """ECD-PSGD's analysis needs E[C(z)] = z (Assumption 1 of the paper)."""
    if not codec.unbiased:
        raise ValueError(f"ECD-PSGD needs an unbiased codec; {codec!r} is biased "
                         f"(use rounding='stochastic' for minmax, or uniform, terngrad, fp32)")


def send_difference(ctx: Context, codec: Codec, k: int, x: torch.Tensor, ref: torch.Tensor,
                    xhat: dict[int, torch.Tensor], peers, name: str = "dcd") -> None:
    """DCD-PSGD's lines 4-6 towards ``peers``: z = x - ref, send C(z); x <- ref + C(z) (the
    model as the peers know it); xh^(j) <- xh^(j) + C(z^(j)) for every peer j."""
    cz, received = exchange_compressed(ctx, codec, k, x - ref, peers, name)  # line 4
    x.copy_(ref + cz)                                                    # line 5
    for j in peers:                                                      # line 6
        xhat[j].add_(received[j])


def _unbiased(codec: Codec, rounding: str | None) -> Codec:
    """ECD-PSGD's codec from the options: the min-max codec rounds stochastically unless
    ``rounding`` says otherwise (the paper needs an unbiased C)."""
    if rounding is None and isinstance(codec, MinMaxCodec):
        return dataclasses.replace(codec, rounding="stochastic")
    return codec


@dataclass(frozen=True)
class _ReplicaGossip(GossipAlgorithm):
    """The options DCD-PSGD and ECD-PSGD share: the codec C of the messages."""

    codec: Codec = codec_field(default_factory=lambda: MinMaxCodec(bits=2))
    codecs = REPLICA_CODECS

    def __post_init__(self):
        check_codec(self.codec)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)


@dataclass
class DCDState(State):
    """DCD-PSGD's memory on worker i: a replica xh^(j) of every neighbour's model."""

    xhat: dict[int, torch.Tensor]
    x_t: torch.Tensor | None = transient(default=None)  # x_t between the two phases of a step


@dataclass(frozen=True)
class DCDPSGD(_ReplicaGossip):
    """DCD-PSGD: each worker averages its model with replicas of its neighbours' models,
    takes its gradient step, and sends its neighbours the compressed change of its model,
    which it applies to its own model too so that the replicas stay exact.

    Option: ``codec``, how the model changes are compressed (min-max 2 bits by default, as --bits).
    This is Algorithm 1 (difference compression) of Tang et al. 2018 (see the module
    docstring). Extra memory: one replica per neighbour, degree x d (the own replica is
    the model itself)."""

    name = "dcd"

    def init(self, x, ctx):
        return DCDState(exchange_initial_models(ctx, x, ctx.neighbors))

    def before_update(self, state, ctx, k, x, g, lr):
        state.x_t = x.detach().clone()
        x.copy_(mix(ctx, state.x_t, state.xhat))                           # line 2
        return state

    def after_update(self, state, ctx, k, x, g, lr):
        x_t, state.x_t = state.x_t, None
        send_difference(ctx, self.codec, k, x, x_t, state.xhat, ctx.neighbors)  # lines 4-6
        return state


@dataclass
class ECDState(State):
    """ECD-PSGD's memory on worker i: the estimates y^(j) of its own model (j = i) and of
    its neighbours', and the paper's step counter t (from 1)."""

    y: dict[int, torch.Tensor]
    t: int = 1
    x_t: torch.Tensor | None = transient(default=None)  # x_t between the two phases of a step


@dataclass(frozen=True)
class ECDPSGD(_ReplicaGossip):
    """ECD-PSGD: each worker averages its model with estimates of its neighbours' models,
    takes its gradient step, and sends a compressed extrapolation of its model from
    which every receiver updates its estimate, averaging the compression noise away.

    Option: ``codec``, how the extrapolations are compressed; it must be unbiased (min-max
    2 bits (as --bits) with stochastic rounding by default). This is Algorithm 2 (extrapolation
    compression) of Tang et al. 2018 (see the module docstring). Extra memory: the
    estimates of the neighbours and of itself, (degree + 1) x d; the state keeps t."""

    codec: Codec = reads(*CODEC_OPTIONS, build=lambda cls, cfg: _unbiased(cfg.make_codec(cls.codecs), cfg.rounding),
                         default_factory=lambda: MinMaxCodec(bits=2, rounding="stochastic"))
    name = "ecd"
    codecs = codec_names("minmax", "uniform", "terngrad", "fp32")

    def __post_init__(self):
        check_unbiased(check_codec(self.codec))


    def init(self, x, ctx):
        y = {ctx.rank: x.detach().clone()}
        y.update(exchange_initial_models(ctx, x, ctx.neighbors))
        return ECDState(y)

    def before_update(self, state, ctx, k, x, g, lr):
        state.x_t = x.detach().clone()
        y = state.y
        x.copy_(mix(ctx, y[ctx.rank], {j: y[j] for j in ctx.neighbors}))  # line 2
        return state

    def after_update(self, state, ctx, k, x, g, lr):
        x_t, state.x_t = state.x_t, None
        t = state.t
        z = x_t * (1 - 0.5 * t) + x * (0.5 * t)                             # line 4
        cz, received = exchange_compressed(ctx, self.codec, k, z, ctx.neighbors, self.name)
        a = 2.0 / t
        for j, c in ((ctx.rank, cz), *received.items()):                    # line 5
            state.y[j].mul_(1 - a).add_(c, alpha=a)
        state.t += 1
        return state
