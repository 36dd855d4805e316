"""D-PSGD (Lian et al. 2017) and naive quantized gossip.

D-PSGD, eq. (3) of the Moniqua paper: ``x_{k+1,i} = sum_j x_{k,j} W_ji - a_k g_{k,i}``
with full-precision (fp32) models on the wire.

Naive quantized D-PSGD, eq. (4) of the Moniqua paper: neighbours' models go
through the quantizer directly, ``x_{k+1,i} = x_{k,i} W_ii + sum_{j!=i} Q(x_{k,j}) W_ji - a_k g``.
Theorem 1 shows it stalls at E||grad f||^2 >= phi^2 delta^2 / (8 (1 + phi^2)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..codecs import Codec, IdentityCodec, UniformCodec, codec_names
from ..codecs.rng import shared_generator
from .base import GossipAlgorithm
from .faults import check_decoded, received_from
from .config import codec_field
from .gossip import check_codec, mix


@dataclass(frozen=True)
class QuantizedGossip(GossipAlgorithm):
    """x_{k+1/2,i} = W_ii x_i + sum_j W_ji decode(encode(x_j)): D-PSGD when the
    codec is lossless (fp32), naive quantized gossip otherwise. No state."""

    codec: Codec = field(default_factory=IdentityCodec)
    name = "naive"
    overlap = True  # reads x_k only, never g: the wrapper may gossip during forward/backward

    def __post_init__(self):
        check_codec(self.codec)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def before_update(self, state, ctx, k, x, g, lr):
        gen = shared_generator(ctx.seed, k, ctx.rank)
        wire = self.codec.encode(x, generator=gen).to_wire()
        received = ctx.transport.neighbor_exchange(wire, ctx.neighbors)
        decoded = {}
        for j in ctx.neighbors:
            # a dithered codec's receiver regenerates sender j's dither from the shared seed
            gen_j = shared_generator(ctx.seed, k, j) if self.codec.dither_on_decode else None
            with received_from(self.name, ctx.rank, j, k):
                decoded[j] = check_decoded(self.codec.decode(self.codec.payload_from_wire(received[j]),
                                                             generator=gen_j).to(x.dtype), x.numel())
        x.copy_(mix(ctx, x, decoded))
        return state


@dataclass(frozen=True)
class DPSGD(QuantizedGossip):
    """D-PSGD: each worker averages its model with its neighbours' models, sent in full
    precision (fp32; the codec is fixed), and takes its gradient step."""

    name = "dpsgd"

    def __post_init__(self):
        if not isinstance(self.codec, IdentityCodec):
            raise ValueError(f"dpsgd sends fp32 models; use naive for another codec, got {self.codec!r}")


@dataclass(frozen=True)
class NaiveQuantizedDPSGD(QuantizedGossip):
    """Naive quantized gossip: D-PSGD whose neighbours' models are sent quantized, which
    stalls at a noise floor set by the quantizer (the Moniqua paper's baseline).

    Eq. (4) of the Moniqua paper, with Theorem 1's quantizer by default: unbiased, points
    {delta n}, ``delta`` 0.1; ``codec`` chooses another (``--codec``)."""

    codec: Codec = codec_field(default_factory=lambda: UniformCodec(step=0.1))
    name = "naive"
    codecs = codec_names("uniform", "minmax", "fp32")
