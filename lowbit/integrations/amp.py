"""Mixed precision under :class:`~lowbit.integrations.DecentralizedDataParallel`: a GradScaler
whose skipped steps every rank skips together, as under DDP.

``torch.amp.GradScaler`` skips ``optimizer.step()`` on a rank whose gradients hold an inf or
NaN. Under DDP the gradient all-reduce has spread that inf to every rank, so every rank skips
the same step. The wrapper communicates inside ``optimizer.step()``, after the scaler's check,
so with torch's scaler the overflowing rank skips alone and the ranks fall out of step (the
wrapper's agreement then stops every rank with a ``Diverged`` "ranks out of step" naming it).
:class:`GradScaler` is torch's, with one change: after it checks this rank's gradients
(``unscale_``), the ranks agree (:meth:`DecentralizedDataParallel.agree_skip`, one all-reduce
of one number outside the ledger), and every rank's ``found_inf`` becomes the agreed one. So
every rank skips the same steps and ``scaler.update()`` sets the same scale everywhere::

    scaler = lowbit.integrations.GradScaler("cuda")    # torch.amp.GradScaler's arguments
    ...
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                        # optional; then clip:
    ddp.clip_grad_norm_(1.0)
    scaler.step(optimizer)
    scaler.update()

An optimizer that no wrapper holds behaves exactly as under torch's scaler. Optimizers that
handle the scaling themselves (``_step_supports_amp_scaling``: the fused ones) are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from .stepping import wrapper_of


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose skip decision is agreed by every rank of the
    :class:`~lowbit.integrations.DecentralizedDataParallel` that holds the optimizer (see the
    module docstring); same arguments and methods as torch's."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``unscale_``, then the ranks agree whether this step is skipped."""
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        ddp = wrapper_of(optimizer)
        if ddp is None:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = any(bool(v.item()) for v in found.values())
        agreed = ddp.agree_skip(local)
        for v in found.values():
            v.fill_(1.0 if agreed else 0.0)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """torch's ``step`` (the skip decision agreed in :meth:`unscale_`)."""
        if self.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False) \
                and wrapper_of(optimizer) is not None:
            raise ValueError(f"{type(optimizer).__name__} scales its gradients itself (a fused optimizer): "
                             "lowbit.integrations.GradScaler cannot agree its skipped steps across ranks; "
                             "use it with fused=False")
        return super().step(optimizer, *args, **kwargs)
