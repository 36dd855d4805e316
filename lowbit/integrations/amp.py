"""Mixed precision under :class:`~lowbit.integrations.DecentralizedDataParallel`: torch's own
``torch.amp.GradScaler`` skips the same steps on every rank, as under DDP.

A GradScaler skips ``optimizer.step()`` on a rank whose gradients hold an inf or a NaN, and
``update()`` then backs the scale off. Under DDP the gradient all-reduce in backward has spread
one rank's inf to every rank, so every rank's scaler skips the same step and keeps the same
scale. The wrapper communicates inside ``optimizer.step()``, after the scaler has looked, so it
spreads the overflow itself, at the same point (:class:`AmpMixin`): at the end of a backward
pass whose forward ran through the wrapper under fp16 autocast (``torch.autocast(...,
dtype=torch.float16)``: Lightning's ``16-mixed``, Accelerate's fp16, torch's AMP recipe), the
ranks agree whether any rank's gradient is non-finite (one all-reduce of one number, outside
the ledger), and if one is, every rank's gradient becomes NaN. So torch's scaler, unmodified,
finds the overflow on every rank, with ``scaler.unscale_(optimizer)`` and
:meth:`~lowbit.integrations.DecentralizedDataParallel.clip_grad_norm_` before ``scaler.step``
too (the clip then communicates nothing for the skipped step), and with an optimizer that
unscales in its own step (``fused=True``: the wrapper unscales the gradient before the
algorithm sends it; a step the scaler skips runs no algorithm)::

    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(ddp(x), y)
    scaler.scale(loss).backward()           # the ranks agree here whether any overflowed
    scaler.unscale_(optimizer)              # optional; then clip:
    ddp.clip_grad_norm_(1.0)
    scaler.step(optimizer)                  # skipped on every rank, or taken on every rank
    scaler.update()                         # the same scale on every rank

Without a scaler, a step on an agreed non-finite gradient raises the same
:class:`~lowbit.algorithms.faults.Diverged` on every rank, naming the first rank whose gradient
was not finite. Nothing is agreed (so a skip stays one rank's, and the next step's agreement
raises ``Diverged``, "ranks out of step"): without fp16 autocast at the wrapper's forward (fp32
and bf16 cost no extra round), for backward passes inside ``no_sync()`` (as under DDP; the
first backward after the block agrees on the accumulated gradient), for the asynchronous
algorithms (no collective per step: each rank's scaler skips its own steps), and for thread
workers sharing a GPU in one process (autograd ends their backward passes on one device thread,
where the agreement would wait for ever: a warning instead).
:class:`GradScaler` is torch's scaler, kept for the code that names it.
"""

from __future__ import annotations

import warnings

import torch

from ..algorithms.faults import Diverged, non_finite


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler``, unchanged: under
    :class:`~lowbit.integrations.DecentralizedDataParallel` torch's own scaler skips the same
    steps on every rank (see the module docstring), so this name is kept only for the code that
    uses it; same arguments and methods as torch's."""


class AmpMixin:
    """The wrapper's side of a GradScaler (see the module docstring): the agreement at the end
    of a backward pass and the step of an optimizer that unscales in its own step. Used by
    :class:`~lowbit.integrations.DecentralizedDataParallel`."""

    def _note_autocast(self) -> None:
        """In the wrapper's forward: whether this training forward runs under fp16 autocast."""
        if torch.is_grad_enabled():
            device = self.flat.data.device.type
            self._step_state.fp16 = torch.is_autocast_enabled(device) and \
                torch.get_autocast_dtype(device) == torch.float16

    def _backward_end(self) -> None:
        """The end of a training backward pass (``CountPasses``' ``at_end``): after a forward
        under fp16 autocast, outside ``no_sync()``, for a synchronous algorithm, the ranks
        agree whether any rank's gradient is non-finite; if one is, every rank's gradient
        becomes NaN (DDP's all-reduce would have spread it), and the pass is remembered
        (``skip_agreed``)."""
        s = self._step_state
        if not s.fp16 or self._closed or s.no_sync or not self.algorithm.synchronous:
            return
        if self.transport.local_rank is None and self.flat.grad.device.type != "cpu":
            # thread workers of one process on a GPU: autograd ends their passes on its one device
            # thread, where waiting for the other ranks would wait for ever
            if not getattr(self, "_amp_warned", False):
                self._amp_warned = True
                warnings.warn("the GradScaler overflow agreement does not run for thread workers sharing a GPU "
                              "(autograd ends their backward passes on one thread): a skipped step stays one "
                              "rank's; run one process per rank (torchrun) for it", stacklevel=2)
            return
        with self._refusals:
            self._wait_exchange()  # the transport is free (an exchange started by the forward is kept)
            self._restore_grad_views()  # the optimizer's gradients are the flat buffer (as the step makes them)
            grad = self.flat.grad
            t = self.transport
            bad = non_finite(grad)
            # the lowest rank whose gradient is non-finite: world_size - rank, maximised; 0: none
            flag = torch.as_tensor(bad, dtype=torch.float32, device=grad.device) * float(t.world_size - t.rank)
            with t.untracked():
                top = int(t.all_reduce(flag.reshape(1), "max").item())
            if top == 0:
                s.skip_agreed = s.overflow_from = None
                return
            s.skip_agreed, s.overflow_from = self.algorithm.guard.passes, t.world_size - top
            if t.world_size - top != t.rank and not bool(bad):
                grad.fill_(float("nan"))

    def _amp_pre_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """In the step pre-hook: True if this ``optimizer.step()`` is one that a GradScaler
        skips (an optimizer that unscales in its own step, given ``found_inf`` by torch's
        scaler); then no algorithm runs. Such an optimizer's gradient still scaled
        (``grad_scale``) is unscaled here, before the algorithm communicates it. A step on a
        gradient the ranks agreed is not finite, with no scaler skipping it: ``Diverged``."""
        s = self._step_state
        found = getattr(optimizer, "found_inf", None)
        if isinstance(found, torch.Tensor):  # torch's GradScaler, for an optimizer that handles the scaling
            if bool(found.item()):  # the optimizer skips the update itself
                s.in_step = None  # a communication clip_grad_norm_ ran for this step is dropped
                s.skipping = True
                return True
            scale = getattr(optimizer, "grad_scale", None)
            if isinstance(scale, torch.Tensor):
                self._restore_grad_views()
                inv = scale.double().reciprocal().float()  # as torch's unscale_ computes it
                found_here = torch.zeros((), dtype=torch.float32, device=scale.device)
                torch._amp_foreach_non_finite_check_and_unscale_([self.flat.grad], found_here, inv)
                optimizer.grad_scale = None  # unscaled: the optimizer's step must not unscale again
            return False
        if s.skip_agreed is not None and s.skip_agreed == self.algorithm.guard.passes:
            raise Diverged(s.k, "gradient", s.overflow_from)
        return False
