"""A Bagua-shaped entry point, so that Bagua code runs on lowbit with its
import changed::

    from lowbit.bagua import LowPrecisionDecentralizedAlgorithm

    algorithm = LowPrecisionDecentralizedAlgorithm()      # hierarchical=True, communication_interval=1
    model = model.with_bagua([optimizer], algorithm)      # as in Bagua
    ...
    loss.backward()
    optimizer.step()                                      # as in Bagua, the step hooks communicate

Importing this module installs ``torch.nn.Module.with_bagua``, as importing Bagua does (where
a ``with_bagua`` attribute exists already, Bagua's own, it is left alone); the function
:func:`with_bagua` (``with_bagua(model, [optimizer], algorithm)``) is the same without the
method. ``with_bagua`` returns a :class:`~lowbit.integrations.DecentralizedDataParallel`
running :class:`lowbit.algorithms.lowprec.LowPrecisionDecentralized`, which
computes what Bagua's ``LowPrecisionDecentralizedAlgorithm`` computes: its
MinMaxUInt8 quantizer per bucket (:class:`~lowbit.codecs.BaguaMinMaxCodec`;
the buckets from the module's parameters, in reverse order, ``bucket_bytes``
each as Bagua's 10 MiB default), the ring with weights 1/3 (2 nodes: 1/3
self, 2/3 peer), the step after ``optimizer.step()``, no model sent at step 0,
``hierarchical`` (average inside a node, ring of node leaders, broadcast back;
a node is ``LOCAL_WORLD_SIZE`` consecutive ranks under torchrun, or
``node_size``) and ``communication_interval``. With every rank on one node (one host under
torchrun), ``hierarchical=True`` averages the whole model in fp32 inside the node and sends
nothing quantized: ``with_bagua`` warns, naming ``hierarchical=False`` (8-bit gossip between
the ranks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .algorithms.lowprec import BAGUA_BUCKET_BYTES, LowPrecisionDecentralized, default_node_size
from .comm.base import Transport
from .integrations.decentralized import DecentralizedDataParallel


@dataclass(frozen=True)
class LowPrecisionDecentralizedAlgorithm:
    """Bagua's ``LowPrecisionDecentralizedAlgorithm(hierarchical=True, communication_interval=1)``.

    lowbit's extra keyword options: ``node_size`` (workers per node; None:
    ``LOCAL_WORLD_SIZE`` under torchrun, 1 on a given in-process transport),
    ``bucket_bytes`` (Bagua's default 10 MiB) and ``seed``. They are checked
    here, by :class:`~lowbit.algorithms.lowprec.LowPrecisionDecentralized` (bad values
    raise ValueError); what depends on the workers (``node_size`` dividing their number)
    when the model is wrapped."""

    hierarchical: bool = True
    communication_interval: int = 1
    node_size: int | None = None
    bucket_bytes: int = BAGUA_BUCKET_BYTES
    seed: int = 0

    def __post_init__(self):
        self.build()

    def build(self, param_sizes: Sequence[int] | None = None) -> LowPrecisionDecentralized:
        """The lowbit algorithm this stands for; ``param_sizes``: the element counts of the
        module's parameters, which Bagua's buckets hold."""
        return LowPrecisionDecentralized(hierarchical=self.hierarchical,
                                         communication_interval=self.communication_interval,
                                         node_size=self.node_size, bucket_bytes=self.bucket_bytes,
                                         param_sizes=param_sizes)


def trainable_sizes(model: nn.Module) -> list[int]:
    """Element counts of the parameters ``FlatParams`` lays out, in its order (Bagua's tensors)."""
    return [p.numel() for p in model.parameters() if p.requires_grad]


def with_bagua(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
               algorithm: LowPrecisionDecentralizedAlgorithm, *, transport: Transport | None = None,
               buffers: str = "local") -> DecentralizedDataParallel:
    """Bagua's ``model.with_bagua([optimizer], algorithm)`` as a function: the
    wrapped model (``optimizer.step()`` after ``loss.backward()`` communicates). ``transport``
    None joins the torchrun launch."""
    if isinstance(optimizers, torch.optim.Optimizer) or len(optimizers) != 1:
        raise ValueError("optimizers must be a list holding exactly one optimizer, as in with_bagua([optimizer], ...)")
    if not isinstance(algorithm, LowPrecisionDecentralizedAlgorithm):
        raise ValueError(f"algorithm must be a lowbit.bagua.LowPrecisionDecentralizedAlgorithm, got {algorithm!r}")
    ddp = DecentralizedDataParallel(model, optimizers[0], algorithm.build(trainable_sizes(model)), topology="ring",
                                    transport=transport, buffers=buffers, seed=algorithm.seed)
    n = ddp.transport.world_size
    node = default_node_size(ddp.transport) if algorithm.node_size is None else algorithm.node_size
    if algorithm.hierarchical and n > 1 and node == n:
        warnings.warn(f"hierarchical=True with all {n} ranks on one node (node_size {node}): the model is averaged "
                      f"in fp32 inside the node and nothing is sent quantized: twice the bytes of 8-bit gossip or more "
                      f"(rank 0 sends 32 bits per element per step on 2 ranks, 96 on 4, against 16 with "
                      f"hierarchical=False); pass LowPrecisionDecentralizedAlgorithm(hierarchical=False) to gossip 8-bit "
                      f"between the ranks", UserWarning, stacklevel=2)
    return ddp


def _module_with_bagua(self: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                       algorithm: LowPrecisionDecentralizedAlgorithm, **options) -> DecentralizedDataParallel:
    """Bagua's ``model.with_bagua([optimizer], algorithm)``: :func:`with_bagua` of this module
    (``transport``, ``buffers`` as there)."""
    return with_bagua(self, optimizers, algorithm, **options)


if not hasattr(nn.Module, "with_bagua"):  # Bagua's own, when Bagua is imported too, stays
    nn.Module.with_bagua = _module_with_bagua


__all__ = ["LowPrecisionDecentralizedAlgorithm", "with_bagua", "trainable_sizes"]
