"""What the decentralized algorithms exchange with their neighbours, written once: a
compressed vector (its own decode as any receiver decodes it, and the neighbours'), and
the initial models. The mixing rules stay with each paper's algorithm."""

from __future__ import annotations

import torch

from ..codecs import Codec
from ..codecs.rng import clone_generator, shared_generator

__all__ = ["REPLICA_CODECS", "exchange_compressed", "exchange_initial_models"]

# The --codec names the replica-based baselines accept (default first).
REPLICA_CODECS = ("minmax", "uniform", "fp32", "half", "sign", "terngrad")


def exchange_compressed(algo, codec: Codec, k: int, v: torch.Tensor, neighbors) -> tuple[torch.Tensor, dict]:
    """Send C(v) to ``neighbors`` and receive theirs. Returns (C(v) as decoded by
    any receiver, {j: C(v_j)}), all in v's dtype. Worker p's randomness at step
    k is ``shared_generator(algo.seed, k, p)``."""
    gen = shared_generator(algo.seed, k, algo.rank)
    own_gen = clone_generator(gen) if codec.dither_on_decode else None
    wire = codec.encode(v, generator=gen).to_wire()
    received = algo.transport.neighbor_exchange(wire, neighbors)
    # decode our own payload from its wire bytes exactly as a receiver does
    own = codec.decode(codec.payload_from_wire(wire), generator=own_gen).to(v.dtype)
    out = {}
    for j in neighbors:
        gen_j = shared_generator(algo.seed, k, j) if codec.dither_on_decode else None
        out[j] = codec.decode(codec.payload_from_wire(received[j]), generator=gen_j).to(v.dtype)
    return own, out


def exchange_initial_models(algo, x: torch.Tensor, neighbors) -> dict[int, torch.Tensor]:
    """x_0 of every neighbour, sent once as the raw bytes of x's own dtype
    (lossless: 4 bytes per element for a float32 model)."""
    flat = x.detach().contiguous().view(-1)
    received = algo.transport.neighbor_exchange(flat.view(torch.uint8), neighbors)
    out = {}
    for j in neighbors:
        buf = received[j]
        if buf.numel() != flat.numel() * flat.element_size():
            raise ValueError(f"rank {j} sent an initial model of {buf.numel()} bytes, expected "
                             f"{flat.numel() * flat.element_size()} (models must have one size and dtype)")
        out[j] = buf.contiguous().view(x.dtype).clone().to(x.device)
    return out
