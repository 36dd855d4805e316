"""Hugging Face Accelerate: :func:`lowbit_prepare`, ``accelerator.prepare`` with a lowbit algorithm.

Use (every rank runs the same script, e.g. ``accelerate launch --multi_gpu --num_processes 2
train.py``; on CPU with ``Accelerator(cpu=True)`` or ``ACCELERATE_USE_CPU=1``)::

    from accelerate import Accelerator
    from lowbit.integrations.accelerate import lowbit_prepare

    accelerator = Accelerator()
    model, optimizer, loader, comm = lowbit_prepare(accelerator, model, optimizer, loader,
                                                    algorithm="maxnorm", bits=4)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    comm.bytes_sent                      # this rank's bytes on the wire

``algorithm`` is a ``lowbit train --algorithm`` name, a codec hook of
:data:`lowbit.integrations.ddp_hooks.HOOKS` or typed hook options, with that entry point's
options (:mod:`lowbit.integrations.routing` decides the way).

* Centralized algorithms and codec hooks: ``accelerator.prepare`` as usual (torch DDP), then
  ``model.register_comm_hook(state, hook)`` with :func:`~lowbit.integrations.ddp_hooks.make_hook`'s
  pair (the lines to write by hand without this helper). ``comm`` is the hook state. DDP's
  semantics hold: ``accelerator.clip_grad_norm_`` clips the averaged gradient,
  ``accelerator.accumulate`` communicates once per optimizer step. In a single process
  there is no DDP model and no hook (``comm.bytes_sent`` stays 0).
* Decentralized algorithms: the model is moved to ``accelerator.device`` and wrapped in
  :class:`~lowbit.integrations.DecentralizedDataParallel` (not in torch DDP), the optimizer and
  the other objects go through ``accelerator.prepare``; ``comm`` is the wrapper (which is also the
  returned model), on a process group of its own (:func:`~lowbit.integrations.routing.own_transport`:
  ``accelerator.gather`` and the like never interleave with its exchanges;
  ``accelerator.end_training()`` destroys it with the others). The wrapper communicates in
  ``optimizer.step()``; there is no averaged gradient, so ``accelerator.clip_grad_norm_`` clips
  each rank's own; ``accelerator.accumulate`` uses the wrapper's ``no_sync()``. Under mixed
  precision the wrapper's forward runs in ``accelerator.autocast()`` with its outputs cast to
  fp32 (what ``accelerator.prepare`` does to a model); Accelerate's own fp16 scaler skips a step
  on every rank when any rank's gradient overflows (:mod:`lowbit.integrations.amp`).
  Checkpoints are per rank: ``comm.save_checkpoint(f"ckpt/rank{accelerator.process_index}.pt")``
  and ``comm.load_checkpoint`` (``accelerator.save_state`` saves rank 0's model only). On the
  hook path ``comm.state_dict()`` / ``comm.load_state_dict()`` (per rank, beside the model and
  optimizer) resume the hook bit for bit. An asynchronous algorithm's wrapper runs on the
  default group (its gossip opens one of its own); checkpoint it after ``comm.close()``.

Build the optimizer over the model's parameters before calling this, as for ``accelerator.prepare``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .ddp_hooks.options import HookOptions
from .decentralized import DecentralizedDataParallel
from .routing import choose, own_transport


def lowbit_prepare(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, *others: Any,
                   algorithm: str | HookOptions = "moniqua", **options: Any) -> tuple:
    """``(model, optimizer, *others, comm)``: ``accelerator.prepare(model, optimizer, *others)``
    with the lowbit ``algorithm`` (see the module docstring); ``comm`` has ``bytes_sent``
    (the hook state, or the DecentralizedDataParallel wrapper). ``options``: the algorithm's, and
    the hook's (``seed``, ``error_feedback``, ``nonfinite``...) or the wrapper's (``topology``,
    ``overlap``, ``seed``...). ValueError for an unknown algorithm or an option it does not take."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    pair = choose(algorithm, options)  # checks the name and the options before anything is prepared
    if pair is not None:
        state, hook = pair
        model, optimizer, *others = accelerator.prepare(model, optimizer, *others)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            state.bind_model(model)  # error memory per parameter; the bucket layout a resume replays
            model.register_comm_hook(state, hook)
        return (model, optimizer, *others, state)
    model.to(accelerator.device)  # in place: the optimizer's parameters stay the module's
    wrapper = DecentralizedDataParallel(model, optimizer, algorithm, transport=own_transport(algorithm), **options)
    if accelerator.native_amp:  # what accelerator.prepare does to a model's forward
        from accelerate.utils import convert_outputs_to_fp32

        wrapper.forward = convert_outputs_to_fp32(accelerator.autocast()(wrapper.forward))
    optimizer, *others = accelerator.prepare(optimizer, *others)
    return (wrapper, optimizer, *others, wrapper)
