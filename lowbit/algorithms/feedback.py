"""Error feedback, written once: the memory ``e`` of what compression left out.

Every algorithm and hook that compensates its compression error (1-bit SGD with error
feedback, PowerSGD, DeepSqueeze, the DDP hooks) does, per message::

    p = v + e          # compensate: the vector to send plus what was not sent before
    send C(p)
    e = p - C(p)       # remember what C dropped

``e`` is a tensor of the caller's state (zeros at the start); these functions only say
how it is used, so that the arithmetic, and hence the iterates, are the same everywhere.
"""

from __future__ import annotations

import torch

__all__ = ["compensate", "remember"]


def compensate(v: torch.Tensor, e: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p = v + e``: the vector to compress (a new tensor, or written into ``out``, which may
    be ``v`` itself)."""
    return v + e if out is None else torch.add(v, e, out=out)


def remember(e: torch.Tensor, p: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """``e <- p - sent`` in place (``sent`` = C(p) as every receiver decodes it; the difference
    is taken in the wider of their dtypes and rounded once into ``e``'s); returns ``e``."""
    return torch.sub(p, sent, out=e)
