"""Codecs whose codes cannot be added (QSGD, TernGrad, sign, DQSG...): all-gather of the packed
payloads, every rank decodes all of them (method ``allgather``): the exchange of
:class:`~lowbit.algorithms.compressed.GatheredAlgorithm`,
:func:`~lowbit.algorithms.compressed.gathered_exchange` with
:func:`~lowbit.algorithms.compressed.decode_average`.

Per layer (``LowbitHookState(per_layer=True)``, TernGrad's default: the paper scales each
layer by its own ``max |g|``): each parameter's gradient in the bucket is one message of the
codec, the messages of a bucket are concatenated into the one wire buffer that is gathered,
and a receiver splits a sender's buffer at this rank's own message lengths (the same on every
rank: the bucket layout is, and these codecs' message lengths depend on the count only),
decoding each message with its parameter's count checked.

The method: ````allgather`` -- codecs whose codes cannot be added (QSGD, TernGrad, sign, DQSG
dithered, min-max, uniform, RandK with explicit indices): every rank all-gathers
the packed wire payloads (``payload.to_wire()``, header included) and decodes all
of them, a subtractive-dither decode with the sender's regenerated generator
``shared_generator(seed, step, sender, stream)``, then averages.
"""

from __future__ import annotations

import torch

from ...algorithms.compressed import decode_average, gathered_exchange
from ...codecs.kernels import empty_output
from ...codecs.rng import shared_generator
from .state import HOOK_STREAM


def allgather(state, t, codec, x, bidx, sizes: list[int] | None = None):
    """All-gather of the packed payloads (header included) over the transport ``t``; every rank
    decodes all of them (a dithered codec with each sender's regenerated generator) and
    averages in rank order: (future of the float64 average, this rank's own decoded payload,
    float32). ``sizes``: the element counts of consecutive segments of ``x`` (its layers), one
    message each (a codec without decode-side dither), or None for one message."""
    rank, step, seed = t.rank, state.step, state.seed
    gen = state._generator(rank, bidx)
    decoded: dict[int, torch.Tensor] = {}
    if sizes is None:
        needs_gen = codec.dither_on_decode

        def decode(sender: int, w: torch.Tensor) -> torch.Tensor:
            g = shared_generator(seed, step, sender, HOOK_STREAM + bidx) if needs_gen else None
            d = codec.decode(codec.payload_from_wire(w), generator=g)
            if sender == rank:
                decoded["own"] = d
            return d

        fut = gathered_exchange(t, codec.encode(x, generator=gen).to_wire(), lambda ws: decode_average(ws, decode))
        return fut, lambda: decoded["own"]
    wires, offset = [], 0
    for size in sizes:  # every draw from the one generator, in layer order
        wires.append(codec.encode(x[offset:offset + size], generator=gen).to_wire())
        offset += size
    lengths = [w.numel() for w in wires]

    def average(ws: list[torch.Tensor]) -> torch.Tensor:
        """The float64 average in rank order, each message added into its layer's slice (no
        concatenation of the decoded layers); this rank's own messages kept for its memory."""
        acc = empty_output(x.numel(), torch.float64, x.device)
        for sender, w in enumerate(ws):
            at = offset = 0
            own = [] if sender == rank else None
            for size, length in zip(sizes, lengths):
                d = codec.decode(codec.payload_from_wire(w[at:at + length]), numel=size)
                part = acc[offset:offset + size]
                part.copy_(d) if sender == 0 else part.add_(d)
                if own is not None:
                    own.append(d)
                at += length
                offset += size
            if own is not None:
                decoded["own"] = own
        return acc.div_(len(ws))

    fut = gathered_exchange(t, torch.cat(wires), average)
    return fut, lambda: torch.cat(decoded["own"])
