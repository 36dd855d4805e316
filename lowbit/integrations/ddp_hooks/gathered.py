"""Codecs whose codes cannot be added (QSGD, TernGrad, sign, DQSG...): all-gather of the packed
payloads, every rank decodes all of them (method ``allgather``): the exchange of
:class:`~lowbit.algorithms.compressed.GatheredAlgorithm`,
:func:`~lowbit.algorithms.compressed.gathered_exchange` with
:func:`~lowbit.algorithms.compressed.decode_average`."""

from __future__ import annotations

import torch

from ...algorithms.compressed import decode_average, gathered_exchange
from ...codecs.rng import shared_generator
from .state import HOOK_STREAM


def allgather(state, t, codec, x, bidx):
    """All-gather of the packed payloads (header included) over the transport ``t``; every rank
    decodes all of them (a dithered codec with each sender's regenerated generator) and
    averages in rank order: (future of the float64 average, this rank's own decoded payload,
    float32)."""
    rank, step, seed = t.rank, state.step, state.seed
    payload = codec.encode(x, generator=state._generator(rank, bidx))
    needs_gen = codec.dither_on_decode
    decoded: dict[int, torch.Tensor] = {}

    def decode(sender: int, wire: torch.Tensor) -> torch.Tensor:
        gen = shared_generator(seed, step, sender, HOOK_STREAM + bidx) if needs_gen else None
        d = codec.decode(codec.payload_from_wire(wire), generator=gen)
        if sender == rank:
            decoded["own"] = d
        return d

    fut = gathered_exchange(t, payload.to_wire(), lambda wires: decode_average(wires, decode))
    return fut, lambda: decoded["own"]
