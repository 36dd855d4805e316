"""Codecs whose codes cannot be added (QSGD, TernGrad, sign, DQSG...): all-gather of the packed
payloads, every rank decodes all of them (method ``allgather``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...codecs.rng import shared_generator
from .state import HOOK_STREAM, _ok


def allgather(state, codec, x, world, group, bidx, rank):
    """All-gather of the packed payloads (header included); every rank decodes all of them (a
    dithered codec with each sender's regenerated generator) and averages in rank order."""
    payload = codec.encode(x, generator=state._generator(rank, bidx))
    wire = payload.to_wire()
    bufs = [torch.empty_like(wire) for _ in range(world)]
    state._count("all_gather", wire.numel(), world, bidx)
    fut = dist.all_gather(bufs, wire, group=group, async_op=True).get_future()
    step = state.step
    needs_gen = codec.dither_on_decode
    seed = state.seed
    decoded: dict[int, torch.Tensor] = {}

    def decode_all(f):
        _ok(f)
        total = torch.zeros(x.numel(), dtype=torch.float64, device=x.device)
        for s, b in enumerate(bufs):
            gen = shared_generator(seed, step, s, HOOK_STREAM + bidx) if needs_gen else None
            d = codec.decode(codec.payload_from_wire(b), generator=gen).to(torch.float64)
            if s == rank:
                decoded["own"] = d
            total += d
        return total / world

    return fut.then(decode_all), lambda: decoded["own"]
