"""D-PSGD (Lian et al. 2017) and naive quantized gossip.

D-PSGD, eq. (3) of the Moniqua paper: ``x_{k+1,i} = sum_j x_{k,j} W_ji - a_k g_{k,i}``
with full-precision (fp32) models on the wire.

Naive quantized D-PSGD, eq. (4) of the Moniqua paper: neighbours' models go
through the quantizer directly, ``x_{k+1,i} = x_{k,i} W_ii + sum_{j!=i} Q(x_{k,j}) W_ji - a_k g``.
Theorem 1 shows it stalls at E||grad f||^2 >= phi^2 delta^2 / (8 (1 + phi^2)).
"""

from __future__ import annotations

from ..codecs import Codec, IdentityCodec, UniformCodec
from ..codecs.rng import shared_generator
from .base import GossipAlgorithm


class QuantizedGossip(GossipAlgorithm):
    """x_{k+1/2,i} = W_ii x_i + sum_j W_ji decode(encode(x_j)): D-PSGD when the
    codec is lossless (fp32), naive quantized gossip otherwise."""

    name = "naive"

    def __init__(self, transport, topology, codec: Codec, **kw):
        super().__init__(transport, topology, **kw)
        self.codec = codec

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def before_update(self, k, x, g, lr):
        gen = shared_generator(self.seed, k, self.rank)
        wire = self.codec.encode(x, generator=gen).to_wire()
        received = self.transport.neighbor_exchange(wire, self.neighbors)
        mixed = x * self.w_self
        for j in self.neighbors:
            # a dithered codec's receiver regenerates sender j's dither from the shared seed
            gen_j = shared_generator(self.seed, k, j) if self.codec.dither_on_decode else None
            xj = self.codec.decode(self.codec.payload_from_wire(received[j]), generator=gen_j)
            mixed.add_(xj.to(x.dtype), alpha=self.w[j])
        x.copy_(mixed)


class DPSGD(QuantizedGossip):
    name = "dpsgd"

    def __init__(self, transport, topology, **kw):
        super().__init__(transport, topology, IdentityCodec(), **kw)


class NaiveQuantizedDPSGD(QuantizedGossip):
    """Eq. (4) with Theorem 1's quantizer by default: unbiased, points {delta n}."""

    name = "naive"
    codecs = ("uniform", "minmax", "fp32")

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, codec=cfg.make_codec(cls.codecs), weights=cfg.weights, seed=cfg.seed)

    def __init__(self, transport, topology, codec: Codec | None = None, delta: float = 0.1, **kw):
        super().__init__(transport, topology, codec if codec is not None else UniformCodec(step=delta), **kw)
