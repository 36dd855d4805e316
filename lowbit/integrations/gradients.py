"""Gradient views and buffers of :class:`~lowbit.integrations.DecentralizedDataParallel`.

The parameters the optimizer holds are views of one flat buffer
(:class:`~lowbit.integrations.FlatParams`), their gradients views of a second one: the
algorithms send one flat vector per step. ``optimizer.zero_grad()`` (set_to_none, torch's
default) works: the gradients autograd then allocates are copied into the flat buffer at the
next step (:meth:`GradientsMixin._restore_grad_views`); ``ddp.zero_grad()`` zeroes the flat
buffer in place. Move the module to its device before wrapping: ``.to()`` afterwards replaces
the parameters' storage.

Buffers (BatchNorm running statistics) are never sent during training. ``buffers="local"``
(default): each worker keeps its own, and :meth:`~GradientsMixin.averaged_module` carries this
rank's. ``buffers="average"``: it also averages the floating-point buffers over all workers
(integer buffers such as ``num_batches_tracked`` take the maximum). Everything
``averaged_module`` sends is evaluation traffic, outside the ledger, as is the initial
broadcast of rank 0's parameters and buffers (``sync_initial=True``, as DDP does; a rank whose
state differed gets an :class:`InitialStateReplaced` warning).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

BUFFER_POLICIES = ("local", "average")


class InitialStateReplaced(UserWarning):
    """``sync_initial=True`` replaced a rank's parameters or buffers, which differed from rank 0's."""


class GradientsMixin:
    """The wrapper's flat gradient views, its averaged module and its initial broadcast (see the
    module docstring). Used by :class:`~lowbit.integrations.DecentralizedDataParallel`."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer (and, in place, the gradients of the
        module's local parameters, those the optimizer does not hold).
        ``set_to_none=True`` is refused: the gradients stay views of the flat
        buffer. (``optimizer.zero_grad()`` works too; the gradients autograd
        then allocates are copied into the flat buffer at the next step.)"""
        if set_to_none:
            raise ValueError("set_to_none must be False: gradients are views of one flat buffer")
        self.flat.zero_grad()
        for p in self.local_params:
            if p.grad is not None:
                p.grad.zero_()

    def _restore_grad_views(self) -> None:
        """Undo ``optimizer.zero_grad()`` (set_to_none, PyTorch's default):
        copy any gradient that autograd put in a fresh tensor into the flat
        buffer (zero where a parameter got none) and make ``.grad`` a view again.
        Afterwards every parameter and every ``.grad`` points into the flat buffers
        (what :meth:`~lowbit.integrations.FlatParams.check_aliasing` checks).

        Where nothing moved since the last call (every parameter's and gradient's address
        and dtype as they were then: the usual step, after ``ddp.zero_grad()``), there
        is nothing to undo, and the walk over the parameters is skipped."""
        layout = self._grad_layout()
        if layout == self._views_layout:
            return
        self._restore_grad_views_walk()
        self._views_layout = self._grad_layout()

    def _grad_layout(self) -> tuple:
        """Where the flat buffers and every parameter and gradient are: their addresses (None
        for a missing gradient) and the parameters' dtypes."""
        flat = self.flat
        ps = flat.params
        return (flat.data.data_ptr(), flat.grad.data_ptr(), [p.data_ptr() for p in ps],
                [None if (g := p.grad) is None else g.data_ptr() for p in ps], [p.dtype for p in ps])

    def _restore_grad_views_walk(self) -> None:
        data = self.flat.data
        lo, hi = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
        if any(not (lo <= p.data_ptr() < hi) or p.dtype != data.dtype for p in self.flat.params):
            raise RuntimeError("a parameter no longer points into the flat parameter buffer (was the module "
                               "moved with .to()/.cuda()/.double() after wrapping? move it before)")
        base = self.flat.grad
        start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        offset = 0
        for p in self.flat.params:
            n = p.numel()
            view = base[offset:offset + n].view_as(p)
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif not (start <= p.grad.data_ptr() < end):
                view.copy_(p.grad)
                p.grad = view
            offset += n

    def averaged_module(self) -> nn.Module:
        """A copy of the module whose communicated parameters (the optimizer's)
        are the average over all workers; local parameters (trainable ones the
        optimizer does not hold) are this rank's, buffers per the ``buffers``
        policy. A collective: every rank must call it. Not counted in the ledger.
        Between a training forward and the step it first waits for the exchange in flight."""
        self._wait_exchange()
        self._agree(self.step_count, 2)  # a rank that skipped or repeated a step is named here
        n = self.transport.world_size
        with self.transport.untracked():
            avg = self.transport.all_reduce(self.flat.data.detach().clone(), "sum") / n
            bufs = {name: b for name, b in self.module.named_buffers()}
            if self.buffers_policy == "average":
                bufs = {name: self._average_buffer(b) for name, b in bufs.items()}
        out = copy.deepcopy(self.module)
        flat_ids = {id(p) for p in self.flat.params}
        flat_names = [name for name, p in self.module.named_parameters() if id(p) in flat_ids]
        copies = dict(out.named_parameters())
        offset = 0
        for name in flat_names:  # the module's order, which is the flat buffer's
            p = copies[name]
            k = p.numel()
            p.data = avg[offset:offset + k].view_as(p).clone()
            offset += k
        for p in out.parameters():
            p.grad = None
        for name, b in out.named_buffers():
            b.copy_(bufs[name])
        return out

    def _average_buffer(self, b: torch.Tensor) -> torch.Tensor:
        if b.is_floating_point():
            return self.transport.all_reduce(b.detach().clone(), "sum") / self.transport.world_size
        return self.transport.all_reduce(b.detach().clone(), "max")

    def _broadcast_from_rank0(self) -> None:
        """Start every worker from rank 0's parameters and buffers (set-up, untracked)."""
        flat_ids = {id(p) for p in self.flat.params}
        replaced = False
        with self.transport.untracked(), torch.no_grad():
            for mine in (self.flat.data, *(p for p in self.module.parameters() if id(p) not in flat_ids),
                         *self.module.buffers()):  # local and frozen parameters too, as DDP does
                theirs = self.transport.broadcast(mine.detach(), 0)
                replaced = replaced or not torch.equal(theirs, mine)
                mine.copy_(theirs)
        if replaced:
            warnings.warn(f"rank {self.rank}: sync_initial=True replaced this rank's parameters and buffers with rank "
                          "0's, which differed (a state loaded into the module before wrapping, or another random "
                          "initialisation, is discarded); to resume, load on every rank or after wrapping "
                          "(load_checkpoint, load_state_dict), or pass sync_initial=False to keep each rank's own",
                          InitialStateReplaced, stacklevel=3)
