"""Which way a lowbit method runs inside a trainer's DDP (Lightning's strategy, Accelerate's
``prepare``): a DDP communication hook, or :class:`~lowbit.integrations.DecentralizedDataParallel`.

:func:`choose` decides and checks the options at once, before any process group exists:
a decentralized algorithm of :data:`lowbit.algorithms.ALGORITHMS` runs under the wrapper (it
gossips models; no gradient all-reduce could carry it); a centralized one, a codec hook of
:data:`~lowbit.integrations.ddp_hooks.HOOKS` (or its former spelling) or typed hook options run
as :func:`~lowbit.integrations.ddp_hooks.make_hook`'s hook on torch DDP. :func:`own_transport`
gives the wrapper a process group apart from the trainer's.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..algorithms import ALGORITHMS, from_options
from .ddp_hooks import make_hook
from .ddp_hooks.names import RENAMED_HOOKS, hook_names
from .ddp_hooks.options import HookOptions

#: options the wrapper takes besides the algorithm's own
WRAPPER_OPTIONS = ("topology", "overlap", "buffers", "sync_initial", "seed", "weights", "on_step")


def method_names() -> list[str]:
    """Every name :func:`choose` takes: the hook names and the decentralized algorithms."""
    return hook_names() + [n for n, cls in ALGORITHMS.items() if cls.family != "centralized"]


def choose(algorithm: str | HookOptions, options: dict[str, Any]) -> tuple | None:
    """``(state, hook)`` of :func:`make_hook` for a hook, None for a decentralized algorithm
    (its options and the wrapper's checked). ValueError for an unknown name (listing the
    names) or an option the method does not take (naming those it takes)."""
    if isinstance(algorithm, HookOptions):
        return make_hook(algorithm, **options)
    if not isinstance(algorithm, str):
        raise ValueError(f"algorithm must be a name ({', '.join(method_names())}) or typed hook options "
                         f"(lowbit.integrations.ddp_hooks.options), got {algorithm!r}")
    cls = ALGORITHMS.get(algorithm)
    if cls is not None and cls.family != "centralized":
        from_options(algorithm, also=WRAPPER_OPTIONS, **{k: v for k, v in options.items() if k not in WRAPPER_OPTIONS})
        return None
    if cls is None and algorithm not in hook_names() and algorithm not in RENAMED_HOOKS:
        raise ValueError(f"algorithm must be one of {', '.join(method_names())}, got {algorithm!r}")
    return make_hook(algorithm, **options)


def asynchronous(algorithm) -> bool:
    """True for the name of an asynchronous algorithm (``adpsgd``, ``moniqua-async``): no step is a
    consistent cut of the ranks' models (a checkpoint needs the wrapper closed)."""
    cls = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    return cls is not None and not cls.synchronous


def own_transport(algorithm: str | None = None):
    """A :class:`~lowbit.comm.distributed.TorchDistributedTransport` on a new process group of all
    ranks (collective: every rank calls it), for the wrapper inside a trainer: the trainer's own
    collectives (a metric synced inside the training step) then never interleave with an
    exchange the wrapper runs during forward and backward. Destroy it with
    ``torch.distributed.destroy_process_group(transport.group)``. For an asynchronous
    ``algorithm`` (``adpsgd``, ``moniqua-async``) the default group's transport (``group`` None):
    their gossip opens a group of its own and agrees on its end through the default group's store."""
    from ..comm.distributed import TorchDistributedTransport

    if not dist.is_initialized():
        raise RuntimeError("the decentralized algorithms need the trainer's distributed launch (a default process "
                           "group): start the script with several processes")
    if asynchronous(algorithm):
        return TorchDistributedTransport()
    return TorchDistributedTransport(process_group=dist.new_group())
