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
to it. :meth:`setup` here sends x_0 once, uncompressed, to each neighbour (counted in
the ledger at step 0), so the replicas are exact even when the x_0 differ.

Randomness of a stochastic C: worker p at step k draws from
``shared_generator(seed, k, p)``; receivers regenerate it for codecs with
``dither_on_decode``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..codecs import Codec, MinMaxCodec
from .legacy import GossipAlgorithm
from .gossip import REPLICA_CODECS, exchange_compressed, exchange_initial_models

def check_unbiased(codec: Codec) -> None:
    """ECD-PSGD's analysis needs E[C(z)] = z (Assumption 1 of the paper)."""
    if not codec.unbiased:
        raise ValueError(f"ECD-PSGD needs an unbiased codec; {codec!r} is biased "
                         f"(use rounding='stochastic' for minmax, or uniform, terngrad, fp32)")


class _ReplicaGossip(GossipAlgorithm):
    """Shared by DCD/ECD/Bagua: a codec, neighbour replicas set up from x_0."""

    codecs = REPLICA_CODECS

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, codec=cfg.make_codec(cls.codecs), weights=cfg.weights, seed=cfg.seed)

    def __init__(self, transport, topology, *, codec: Codec | None = None, **kw):
        super().__init__(transport, topology, **kw)
        if codec is not None and not isinstance(codec, Codec):
            raise TypeError(f"codec must be a lowbit Codec, got {type(codec).__name__}")
        self.codec = codec if codec is not None else MinMaxCodec(bits=8)
        self.replicas: dict[int, torch.Tensor] = {}
        self._x_t: torch.Tensor | None = None  # x_t within one step (not kept between steps)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def state_tensors(self):
        return {f"xhat_{j}": r for j, r in sorted(self.replicas.items())}

    def _mix(self, x: torch.Tensor, own: torch.Tensor) -> None:
        """x <- W_ii own + sum_j W_ij xh^(j) (W symmetric)."""
        mixed = own * self.w_self
        for j in self.neighbors:
            mixed.add_(self.replicas[j], alpha=self.w[j])
        x.copy_(mixed)


class DCDPSGD(_ReplicaGossip):
    """DCD-PSGD, Algorithm 1 of Tang et al. 2018 (see the module docstring).

    Extra memory: one replica per neighbour, degree x d (the own replica is the
    model itself)."""

    name = "dcd"

    def setup(self, x):
        self.replicas = exchange_initial_models(self, x, self.neighbors)

    def before_update(self, k, x, g, lr):
        self._x_t = x.detach().clone()
        self._mix(x, self._x_t)                                             # line 2

    def after_update(self, k, x, g, lr):
        x_t, self._x_t = self._x_t, None
        cz, received = exchange_compressed(self, self.codec, k, x - x_t, self.neighbors)  # line 4
        x.copy_(x_t + cz)                                                   # line 5
        for j in self.neighbors:                                            # line 6
            self.replicas[j].add_(received[j])


class ECDPSGD(_ReplicaGossip):
    """ECD-PSGD, Algorithm 2 of Tang et al. 2018 (see the module docstring).

    Extra memory: the estimates y of the neighbours and of itself,
    (degree + 1) x d. The step counter t is checkpointed in extra_state."""

    name = "ecd"
    codecs = ("minmax", "uniform", "terngrad", "fp32")

    @classmethod
    def _codec(cls, cfg) -> Codec:
        codec = cfg.make_codec(cls.codecs)
        if cfg.rounding is None and isinstance(codec, MinMaxCodec):
            codec = dataclasses.replace(codec, rounding="stochastic")  # the paper needs an unbiased C
        return codec

    @classmethod
    def check_config(cls, cfg):
        check_unbiased(cls._codec(cfg))

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, codec=cls._codec(cfg), weights=cfg.weights, seed=cfg.seed)

    def __init__(self, transport, topology, *, codec: Codec | None = None, **kw):
        codec = codec if codec is not None else MinMaxCodec(bits=8, rounding="stochastic")
        check_unbiased(codec)
        super().__init__(transport, topology, codec=codec, **kw)
        self.y_self: torch.Tensor | None = None
        self.t = 1  # the paper's iteration counter, starting at 1

    def setup(self, x):
        self.replicas = exchange_initial_models(self, x, self.neighbors)
        self.y_self = x.detach().clone()

    def state_tensors(self):
        out = super().state_tensors()
        if self.y_self is not None:
            out[f"xhat_{self.rank}"] = self.y_self
        return out

    def extra_state(self):
        return {"t": self.t}

    def load_extra_state(self, extra):
        if "t" in extra:
            self.t = int(extra["t"])

    def before_update(self, k, x, g, lr):
        self._x_t = x.detach().clone()
        self._mix(x, self.y_self)                                           # line 2

    def after_update(self, k, x, g, lr):
        x_t, self._x_t = self._x_t, None
        t = self.t
        z = x_t * (1 - 0.5 * t) + x * (0.5 * t)                             # line 4
        cz, received = exchange_compressed(self, self.codec, k, z, self.neighbors)
        a = 2.0 / t
        self.y_self.mul_(1 - a).add_(cz, alpha=a)                            # line 5
        for j in self.neighbors:
            self.replicas[j].mul_(1 - a).add_(received[j], alpha=a)
        self.t += 1
