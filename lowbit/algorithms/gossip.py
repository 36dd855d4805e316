"""What the decentralized algorithms exchange with their neighbours and how they mix it,
written once: a compressed vector (its own decode as any receiver decodes it, and the
neighbours'), the initial models, and the neighbour mix with the weights of the mixing
matrix W. Every function takes the worker's :class:`~lowbit.algorithms.base.Context`."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..codecs import Codec, codec_names
from ..codecs.rng import clone_generator, shared_generator
from .base import Context
from .faults import check_decoded, received_from

__all__ = ["REPLICA_CODECS", "check_codec", "check_gamma", "exchange_compressed", "exchange_initial_models", "mix"]

# The --codec names the replica-based baselines accept (default first): the codecs that declare
# replica_safe (a neighbour keeps an exact replica of what it decodes), in registry order.
REPLICA_CODECS = codec_names(replica_safe=True)


def check_codec(codec) -> Codec:
    """``codec`` if it is a lowbit Codec; a TypeError naming the argument otherwise."""
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a lowbit.codecs.Codec, got {type(codec).__name__}")
    return codec


def check_gamma(gamma, name: str = "gamma") -> float:
    """``gamma`` as a float if it is a number in (0, 1] (a consensus step size: CHOCO's
    gamma, DeepSqueeze's eta, Moniqua's slack); a
    ValueError naming ``name`` and the range otherwise."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) \
            or not 0 < gamma <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {gamma!r}")
    return float(gamma)


def mix(ctx: Context, x_i: torch.Tensor, received: Mapping[int, torch.Tensor], *, relative: bool = False,
        w_self: float | None = None, w: Mapping[int, float] | None = None) -> torch.Tensor:
    """Worker i's neighbour mix of the vectors ``received`` ({j: x_j}, summed in that
    order) with its row of W (``ctx.w_self`` = W_ii, ``ctx.w[j]`` = W_ij), as a new tensor:

    - ``relative=False``: ``sum_j W_ij x_j`` with j = i included, i.e.
      ``W_ii x_i + sum_{j in N(i)} W_ij x_j`` (the gossip average, X W);
    - ``relative=True``: ``sum_{j in N(i)} W_ij (x_j - x_i)`` (the consensus term, X (W - I)).

    ``w_self`` and ``w`` replace W_ii and the W_ij (e.g. ``w_self = W_ii - 1`` gives
    ``sum_j (W - I)_ij x_j`` summed as written; a pairwise exchange weighs 1/2 and 1/2)."""
    w = ctx.w if w is None else w
    if relative:
        out = torch.zeros_like(x_i)
        for j, x_j in received.items():
            out.add_(x_j - x_i, alpha=w[j])
        return out
    out = x_i * (ctx.w_self if w_self is None else w_self)
    for j, x_j in received.items():
        out.add_(x_j, alpha=w[j])
    return out


def exchange_compressed(ctx: Context, codec: Codec, k: int, v: torch.Tensor, neighbors,
                        name: str = "gossip") -> tuple[torch.Tensor, dict]:
    """Send C(v) to ``neighbors`` and receive theirs. Returns (C(v) as decoded by
    any receiver, {j: C(v_j)} in ``neighbors`` order), all in v's dtype. Worker p's
    randomness at step k is ``shared_generator(ctx.seed, k, p)``. A payload that does not
    decode to v's size is a :class:`~lowbit.algorithms.faults.PeerPayloadError` naming
    the algorithm ``name``, the sender and the step."""
    gen = shared_generator(ctx.seed, k, ctx.rank)
    own_gen = clone_generator(gen) if codec.dither_on_decode else None
    wire = codec.encode(v, generator=gen).to_wire()
    received = ctx.transport.neighbor_exchange(wire, neighbors)
    # decode our own payload from its wire bytes exactly as a receiver does
    own = codec.decode(codec.payload_from_wire(wire), generator=own_gen).to(v.dtype)
    out = {}
    for j in neighbors:
        gen_j = shared_generator(ctx.seed, k, j) if codec.dither_on_decode else None
        with received_from(name, ctx.rank, j, k):
            out[j] = check_decoded(codec.decode(codec.payload_from_wire(received[j]), generator=gen_j).to(v.dtype),
                                   v.numel())
    return own, out


def exchange_initial_models(ctx: Context, x: torch.Tensor, neighbors) -> dict[int, torch.Tensor]:
    """x_0 of every neighbour ({j: x_0^(j)} in ``neighbors`` order), sent once as the raw
    bytes of x's own dtype (lossless: 4 bytes per element for a float32 model)."""
    flat = x.detach().contiguous().view(-1)
    received = ctx.transport.neighbor_exchange(flat.view(torch.uint8), neighbors)
    out = {}
    for j in neighbors:
        buf = received[j]
        if buf.numel() != flat.numel() * flat.element_size():
            raise ValueError(f"rank {j} sent an initial model of {buf.numel()} bytes, expected "
                             f"{flat.numel() * flat.element_size()} (models must have one size and dtype)")
        out[j] = buf.contiguous().view(x.dtype).clone().to(x.device)
    return out
