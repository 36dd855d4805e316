"""DecentralizedDataParallel: any lowbit algorithm around a user's own
``nn.Module`` and optimizer, under ``torchrun`` or on a given Transport.

Use (every rank runs the same code; the loop is PyTorch's own)::

    model = DecentralizedDataParallel(net, opt, algorithm="moniqua", bits=2, theta=0.05)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                          # communicate, the optimizer's update, communicate
    avg = model.averaged_module()           # collective: the average over all workers
    torch.save(model.state_dict(), "net.pt")   # the plain module's state dict: net.load_state_dict works
    model.save_checkpoint(f"ckpt/rank{model.rank}.pt")   # the full resumable checkpoint, atomic, checksummed
    model.close()                           # removes the optimizer's hooks

and to resume, on every rank: ``model.load_checkpoint(f"ckpt/rank{model.rank}.pt")``
(collective: the ranks check that they resume the same step of the same run).
A checkpoint (:meth:`~DecentralizedDataParallel.checkpoint_state`) holds only
tensors and plain values: ``torch.load(..., weights_only=True)`` reads it
(:mod:`lowbit.integrations.checkpoint`).

The wrapper registers a step pre-hook and post-hook on the optimizer
(``register_step_pre_hook`` / ``register_step_post_hook``), so every
``optimizer.step()`` runs, with the wrapper's step counter ``k`` and ``lr`` read
from the optimizer's first parameter group::

    transport.set_step(k)
    algo.before_update(k, x, g, lr)     # gossip (rewrites x) or aggregation (rewrites g),
                                        # or, overlapped, x <- the x_{k+1/2} it computed
                                        # during forward and backward
    <the optimizer's own update>
    algo.after_update(k, x, g, lr)

Overlap (``overlap=True``, the default, for an algorithm whose
:attr:`~lowbit.algorithms.Algorithm.overlap` is True: D-PSGD and naive
quantized gossip): the gossip step ``x_{k+1/2} = sum_j W_ji x_j`` reads the
model ``x_k``, never the gradient, and ``x_k`` is final once the forward of
step k starts. So the wrapper starts it there (a forward pre-hook on the
module: ``model(x)`` and ``net(x)`` alike), on a copy of ``x_k``, in a
background thread (a short-lived one per step; at most one exchange in flight), while
forward and backward compute; the step pre-hook waits for it, copies
``x_{k+1/2}`` into the parameters and the optimizer applies ``g_k``. The
arithmetic and the ledger are those of ``overlap=False``, bit for bit; it
costs one more copy of the model in memory. The exchange starts only at a
forward in training mode with gradients enabled (``module.training`` and
``torch.is_grad_enabled()``): an evaluation forward (``model.eval()`` or
``torch.no_grad()``) sends nothing, as it may not be followed by a step or
may run on one rank only. A step whose exchange no forward started (an eval
forward, gradients set by hand) communicates in its pre-hook, as with
``overlap=False`` (``stats()["overlapped"]`` is 0 then). More forwards
before the step (gradient accumulation, activation checkpointing) reuse the
exchange in flight, provided the parameters are not changed in place in
between (a RuntimeError at the step: the neighbours got the old ``x_k``).
An error in the thread is raised by the step (or :meth:`close`). Between the
forward and the step the transport is busy: run no collectives of your own
on its process group there (after ``optimizer.step()`` is fine); the
wrapper's own (``averaged_module``) wait for the exchange first, and
checkpoints are taken between steps. Several wrappers on one process group
(two models with two optimizers, as a GAN) take turns: one waits for
another's exchange in flight before it communicates, so the ranks issue the
operations in program order. The exchange is one message per
neighbour, not buckets as DDP's gradient all-reduce: all of ``x_k`` is
ready at once, so buckets would only add messages.

``model.step()`` is the same ``optimizer.step()`` (kept for older code; it does
not communicate twice). One wrapper per optimizer; :meth:`close` removes the
hooks, after which ``optimizer.step()`` is a plain local step.
``optimizer.step(closure)`` evaluates the closure (zero_grad, forward, backward) first,
under ``torch.enable_grad()``, then communicates and updates, and returns the closure's loss,
as torch's optimizers do (Lightning's automatic optimization passes one).

``x`` / ``g`` are the parameters the optimizer holds / their gradients as one
flat buffer (:class:`~lowbit.integrations.FlatParams`; parameters become views
of it, so the optimizer's references stay valid). An optimizer over a subset
of the module's trainable parameters is fine: only those are communicated;
the others are *local* (this rank's own: never sent, not averaged by
:meth:`averaged_module`; step them with an optimizer of your own). Move the
module to its device before wrapping: ``.to()`` afterwards replaces the
parameters' storage. ``optimizer.zero_grad()`` (set_to_none) works: the
gradients autograd then allocates are copied into the flat buffer at the next
step; ``model.zero_grad()`` zeroes the flat buffer in place and saves that copy.

After every step, :meth:`stats` holds the step's figures (bytes and messages
sent at the step and in total, read from the ledger; wire bits per element;
the algorithm's report, e.g. Moniqua's theta and mismatch counters), and
``on_step=callback`` is called as ``callback(step, stats)``; ready callbacks:
:class:`~lowbit.integrations.LogStats` (logging) and
:class:`~lowbit.integrations.TensorBoardStats` (live TensorBoard scalars).

Buffers (BatchNorm running statistics) are never sent during training.
``buffers="local"`` (default): each worker keeps its own, and
:meth:`averaged_module` carries this rank's. ``buffers="average"``:
:meth:`averaged_module` also averages the floating-point buffers over all
workers (integer buffers such as ``num_batches_tracked`` take the maximum).
Everything :meth:`averaged_module` sends is evaluation traffic, outside the
ledger (``transport.untracked()``), as is the initial broadcast of rank 0's
parameters (all of them: communicated, local and frozen) and buffers
(``sync_initial=True``, as DDP does at construction).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..algorithms import Algorithm, Worker, build_worker
from ..algorithms.faults import PeerPayloadError, refusal_error, refusal_text
from ..comm.base import Transport
from ..comm.inprocess import blocking
from ..comm.ledger import Ledger
from ..topology import Topology
from .checkpoint import (ALGORITHM_STATE_FIELDS, LEDGER_FIELDS, OPTIMIZER_FIELDS, RNG_FIELDS, CheckpointError,
                         agree_outcome, agree_resume, candidates, check_fields, ledger_state, load_checkpoint,
                         remove_stale_temporaries, restore_ledger, rng_state, save_checkpoint, set_rng_state)
from .flat import FlatParams

BUFFER_POLICIES = ("local", "average")


class InitialStateReplaced(UserWarning):
    """``sync_initial=True`` replaced a rank's parameters or buffers, which differed from rank 0's."""

StepCallback = Callable[[int, dict], None]  # on_step(step, stats)
_FORMAT = 2  # 2: RNG states and the ledger as tensors (weights_only=True); 1 is still read
# what a checkpoint must hold (check_fields), besides "step"; format 2 also "rng" (RNG_FIELDS)
_FIELDS = {"format": int, "rank": int, "world_size": int, "algorithm": str, "numel": int, "step": int,
           "module": dict, "optimizer": OPTIMIZER_FIELDS, "algorithm_state": ALGORITHM_STATE_FIELDS,
           "ledger?": LEDGER_FIELDS, "rng?": dict, "scheduler?": dict}


class DecentralizedDataParallel(nn.Module):
    """Wrap ``module`` and ``optimizer`` so that ``optimizer.step()`` runs ``algorithm``.

    ``optimizer``: its parameters, trainable parameters of ``module`` (all of
    them or a subset), are the ones communicated; the module's other trainable
    parameters stay local to each rank (never sent, not averaged).

    ``algorithm``: a registry name (``lowbit.algorithms.ALGORITHMS``), an
    :class:`~lowbit.algorithms.Algorithm` subclass, an instance of one (its
    options), or a :class:`~lowbit.algorithms.Worker` already bound to a
    transport (then that transport is used and no ``algorithm_options`` may be
    given). ``algorithm_options`` are the algorithm's options (``bits=2``,
    ``theta=0.05``) and the run's ``seed=`` and ``weights=`` (the mixing matrix
    of a decentralized algorithm: ``uniform`` or ``metropolis``).
    ``topology``: a name (``ring``, ``torus``, ``complete``, ``star``,
    ``exponential``) or a :class:`~lowbit.topology.Topology`, for decentralized
    algorithms only (default ring).
    ``transport``: None joins the ``torchrun`` launch (or the already initialised
    default process group) through :func:`lowbit.comm.init_from_env`.
    ``buffers``: ``"local"`` or ``"average"``, the BatchNorm statistics that
    :meth:`averaged_module` carries (see the module docstring).
    ``sync_initial``: start every rank from rank 0's parameters and buffers.
    ``on_step``: None or ``callback(step, stats)``, called after every step with
    :meth:`stats` (the attribute ``on_step`` may also be set later).
    ``overlap``: True (default): where the algorithm allows it
    (:attr:`~lowbit.algorithms.Algorithm.overlap`), its exchange runs during the
    forward and backward of the step, in a background thread (see the module
    docstring); False: the algorithm communicates in the optimizer's step
    pre-hook, after backward. The attribute ``overlap`` says which is in effect.
    ``scheduler``: None or the optimizer's LR scheduler (``torch.optim.lr_scheduler``): its
    state is then part of :meth:`checkpoint_state` and restored by the loads (step it
    yourself, as usual).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 algorithm: str | type[Algorithm] | Algorithm | Worker = "moniqua", topology: str | Topology | None = None,
                 transport: Transport | None = None, *, buffers: str = "local", sync_initial: bool = True,
                 on_step: StepCallback | None = None, overlap: bool = True, scheduler: Any = None,
                 **algorithm_options: Any):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if buffers not in BUFFER_POLICIES:
            raise ValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be a callable (step, stats) or None, got {type(on_step).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        _check_scheduler(scheduler, optimizer)
        _check_not_hooked(optimizer)
        params = _optimizer_params(module, optimizer)

        if isinstance(algorithm, Worker):
            if algorithm_options:
                raise ValueError(f"algorithm is bound to a worker; options {sorted(algorithm_options)} cannot be "
                                 "applied to it")
            if topology is not None:
                raise ValueError("algorithm is bound to a worker (it has its topology); do not pass topology")
            if transport is not None and transport is not algorithm.transport:
                raise ValueError("transport differs from the bound algorithm's transport")
            transport = algorithm.transport
        self._owns_transport = False
        if transport is None:
            from ..comm import init_from_env

            transport = init_from_env()
            self._owns_transport = transport._owns_group
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a lowbit.comm.Transport, got {type(transport).__name__}")
        self.transport = transport
        self.buffers_policy = buffers
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.module = module
        self.algorithm = algorithm if isinstance(algorithm, Worker) else \
            build_worker(algorithm, transport, topology, **algorithm_options)
        self.flat = FlatParams(module, params)
        flat_ids = {id(p) for p in self.flat.params}
        # trainable parameters the optimizer does not hold: never communicated, this rank's own
        self.local_params = [p for p in module.parameters() if p.requires_grad and id(p) not in flat_ids]
        _bound_messages(transport, len(self.flat))
        if sync_initial and transport.world_size > 1:
            _wait_channel(transport)
            self._broadcast_from_rank0()
        self.algorithm.setup(self.flat.data)
        self.step_count = 0  # k of the next step
        self.on_step = on_step
        self._closed = False
        self._in_step: tuple[int, float] | None = None  # (k, lr) between the optimizer's pre- and post-hook
        self._skip_agreed: bool | None = None  # agree_skip()'s answer for the step in progress
        self._early = False  # clip_grad_norm_ ran this step's communication (the pre-hook then does not)
        self._no_sync = False  # inside no_sync()
        self._last_stats: dict[str, float] = {}
        self._totals = _LedgerTotals()
        # overlap: the algorithm's exchange of step k runs during its forward and backward
        self.overlap = overlap and bool(getattr(self.algorithm, "overlap", False))
        self._exchange: _Exchange | None = None  # the exchange in flight (started by a forward)
        self._x_half: torch.Tensor | None = None  # where it writes x_{k+1/2}
        self._overlapped = 0  # whether the step in progress was overlapped (stats)
        self._hooks = _attach_hooks(optimizer, self)
        # the training backward passes, counted for the agreement: a rank that skips or repeats an
        # optimizer.step() (a GradScaler skips it on an inf gradient) is found at the next step
        self._pass_hook = torch.autograd.graph.register_multi_grad_hook(
            self.flat.params, _CountPasses(self.algorithm.guard), mode="any")
        if self.overlap:
            self._hooks += (module.register_forward_pre_hook(_ForwardHook(self)),)

    # ---- training ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)``, which runs the algorithm through the optimizer's
        step hooks (see the module docstring); kept for code that calls it. Returns what
        the optimizer's step returns (the closure's loss, or None)."""
        if self._closed:
            raise RuntimeError("step() after close(): the optimizer's step hooks are removed")
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    optimizer_step = step

    @contextlib.contextmanager
    def _refusals(self):
        """Around the wrapper's communication: a payload this rank refuses ends it, out of step
        with the others, so it posts the refusal first (``Transport.post_refusal``); a rank whose
        communication then fails raises that refusal, naming the sender, instead of its own
        "connection closed" (:mod:`lowbit.algorithms.faults`)."""
        try:
            yield
        except PeerPayloadError as e:
            self.transport.post_refusal(refusal_text(e))
            raise
        except (RuntimeError, threading.BrokenBarrierError) as e:  # a communication failure
            err = refusal_error(self.transport.posted_refusal(), self.world_size, self.rank, e)
            if err is None:
                raise
            raise err from e

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
        """The optimizer's step pre-hook: the closure if one is given, set_step(k), before_update
        (unless :meth:`clip_grad_norm_` has run it already for this step)."""
        with self._refusals():
            replaced = _run_closure(args, kwargs)
            if self._no_sync:
                raise RuntimeError("optimizer.step() inside ddp.no_sync(): no_sync() is for gradient accumulation "
                                   "(the backward passes inside it add up; the algorithm communicates at the "
                                   "optimizer.step() after the block); a step inside it would be a local step")
            if not self._early:
                self._pre_step_body()
            self._early = False
            self._skip_agreed = None
            return replaced

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``, for gradient accumulation: the forward and backward passes inside
        the block communicate nothing (with ``overlap=True`` no exchange starts; the first
        training forward after the block starts it), and their gradients add up in ``.grad``;
        the algorithm communicates at the next ``optimizer.step()``, after the block, with the
        accumulated gradient (centralized algorithms average it; decentralized ones gossip the
        model and apply it). ``optimizer.step()`` inside the block is a RuntimeError. Without
        ``no_sync()`` accumulation works the same (the wrapper communicates only at the step);
        the block only keeps an overlapped exchange from starting early."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def agree_skip(self, skip: bool) -> bool:
        """Collective: whether any rank skips this step (``skip`` is this rank's wish: a
        GradScaler that found an inf or NaN gradient). Every rank gets the same answer, so
        every rank then skips, or takes, the same ``optimizer.step()``, as under DDP, whose
        gradient all-reduce spreads an inf to every rank. One all-reduce of one number,
        outside the ledger (:class:`lowbit.integrations.GradScaler` calls it). A step
        skipped after :meth:`clip_grad_norm_` communicated is dropped (the algorithm's step
        ``k`` is taken again by the next ``optimizer.step()``)."""
        if self._closed:
            raise RuntimeError("agree_skip() after close()")
        self._wait_exchange()  # an exchange started by the forward stays valid: x_k is unchanged by a skip
        flag = torch.tensor([1.0 if skip else 0.0], device=self.flat.data.device)
        with self.transport.untracked():
            agreed = bool(self.transport.all_reduce(flag, "max").item() > 0)
        self._skip_agreed = agreed
        if agreed and self._early:  # the communication clip_grad_norm_ ran for this step is dropped
            self._in_step, self._early = None, False
        return agreed

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the module's parameters, with DDP's meaning:
        it clips the gradient the optimizer applies, and returns its total norm. Call it after
        backward, right before ``optimizer.step()`` (after ``scaler.unscale_(optimizer)`` under
        a GradScaler).

        - Centralized algorithms (``allreduce``, ``qsgd``, ``powersgd``, ...: the family
          that aggregates gradients): it runs the step's communication now (the optimizer's
          step then does not communicate again) and clips the *averaged* (aggregated)
          gradient, as ``clip_grad_norm_`` after DDP's backward does: with ``allreduce`` the
          result equals DDP + ``clip_grad_norm_``.
        - Decentralized algorithms (gossip of the model: ``dpsgd``, ``moniqua``, ...): there is
          no averaged gradient; each rank applies its own. It clips this rank's local gradient
          and communicates nothing (the same as the plain call).

        The plain ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` before
        ``optimizer.step()`` always clips the local gradient: under a centralized algorithm
        that is *before* the aggregation, not DDP's meaning (use this method). Local
        parameters (trainable ones the optimizer does not hold) are clipped with the others."""
        if self._closed:
            raise RuntimeError("clip_grad_norm_() after close()")
        if self.algorithm.family == "centralized" and not self._early and not self._skip_agreed:
            with self._refusals():
                self._pre_step_body()
            self._early = True
        return torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], max_norm,
                                              norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def _pre_step_body(self) -> None:
        self._restore_grad_views()
        self.flat.check_aliasing()
        k = self.step_count
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._exchange is not None:  # started by the forward: x <- x_{k+1/2}
            self._finish_exchange(check=True)
            self.flat.data.copy_(self._x_half)
            # the gradient is only applied here: a non-finite one is reported at the next agreement
            self.algorithm.guard.note(k, "gradient", self.flat.grad)
            self._overlapped = 1
        else:
            _wait_channel(self.transport)
            self.transport.set_step(k)
            self.algorithm.guard.note(k, "gradient", self.flat.grad)
            if self.algorithm.agrees_before_update:  # else before after_update, in the post-hook
                self._agree(k, 0)
            self.algorithm.before_update(k, self.flat.data, self.flat.grad, lr)
            self._overlapped = 0
        self._in_step = (k, lr)

    # ---- overlap: the exchange of step k during its forward and backward ---------------
    def _forward_pre(self, module: nn.Module, args: tuple) -> None:
        """The module's forward pre-hook: start step k's exchange on a copy of x_k (training
        forwards only; a second forward before the step reuses the exchange in flight)."""
        with self._refusals():
            self._forward_pre_body(module, args)

    def _forward_pre_body(self, module: nn.Module, args: tuple) -> None:
        if not (module.training and torch.is_grad_enabled()) or self._closed or self._no_sync:
            return
        ex = self._exchange
        if ex is not None:
            if ex.done() and ex.error is not None:
                self._finish_exchange(check=False)  # raises the thread's error now
            if ex.versions != self._versions():
                self._finish_exchange(check=True)  # raises: x changed under the exchange
            return
        k = self.step_count
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._x_half is None:
            self._x_half = torch.empty_like(self.flat.data)
        with torch.no_grad():
            self._x_half.copy_(self.flat.data)
        _wait_channel(self.transport)
        self.transport.set_step(k)
        self._agree(k, 0)
        self._exchange = _start_exchange(self.transport, self.algorithm, k, self._x_half, lr, self._versions())

    def _versions(self) -> tuple[int, ...]:
        """The in-place version counters of the flat buffer and of every parameter (views of
        it with counters of their own): they move when something writes the parameters."""
        return (self.flat.data._version, *(p._version for p in self.flat.params))

    def _finish_exchange(self, check: bool) -> None:
        """Wait for the exchange in flight (a thread worker lets another compute meanwhile),
        re-raise its error; ``check``: raise if the parameters changed since it started."""
        ex, self._exchange = self._exchange, None
        with blocking():
            ex.join()
        _release_channel(self.transport, ex)
        if ex.error is not None:
            raise ex.error
        if check and ex.versions != self._versions():
            raise RuntimeError(
                f"the parameters were changed in place between the forward of step {ex.k} (which sent x_k to "
                "the neighbours, overlap=True) and optimizer.step(); change them only through the optimizer "
                "between a training forward and the step, or pass overlap=False")

    def _wait_exchange(self) -> None:
        """Before the wrapper uses the transport between steps: wait for its exchange in flight
        (keeping the result for the step, re-raising its error) and for any other wrapper's on
        the same process group."""
        ex = self._exchange
        if ex is not None:
            with blocking():
                ex.join()
            if ex.error is not None:
                self._exchange = None
                raise ex.error
        _wait_channel(self.transport)

    def _agree(self, k: int, point: int) -> None:
        """The ranks agree that none has a non-finite gradient or model and that all are at step
        ``k``, ``point`` (:mod:`lowbit.algorithms.faults`: one tiny all-gather outside the ledger),
        or every rank raises the same :class:`~lowbit.algorithms.faults.Diverged`. An asynchronous
        algorithm has no collective per step: this rank's own fault is raised here, and its
        gossip tells the others."""
        guard = self.algorithm.guard
        guard.note(k, "model", self.flat.data)
        if self.algorithm.synchronous:
            guard.agree(k, point, self.flat.data.device)
        else:
            guard.check_local()

    def _no_exchange(self, what: str) -> None:
        if self._exchange is not None:
            raise RuntimeError(f"{what} between a training forward and optimizer.step(): the exchange of step "
                               f"{self._exchange.k} is in flight (overlap=True); call it between steps")

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """The optimizer's step post-hook: after_update, the step counter, stats, ``on_step``."""
        with self._refusals():
            self._post_step_body(optimizer, args, kwargs)

    def _post_step_body(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._in_step is None:
            raise RuntimeError("the optimizer's step post-hook ran without its pre-hook")
        k, lr = self._in_step
        self._in_step = None
        _wait_channel(self.transport)
        if self.algorithm.acts_after_update:
            self._agree(k, 1)
        self.algorithm.after_update(k, self.flat.data, self.flat.grad, lr)
        self.step_count = k + 1
        self._last_stats = self._step_stats(k, lr)
        if self.on_step is not None:
            self.on_step(k, dict(self._last_stats))

    def stats(self) -> dict[str, float]:
        """The figures of the last step (an empty dict before the first):

        - ``step``: its index k; ``lr``: the learning rate it used (group 0);
        - ``bytes_sent_step`` / ``messages_step``: what this rank sent at step k,
          ``bytes_sent`` / ``messages_sent``: since the start, all read from the
          transport's ledger (:mod:`lowbit.comm.ledger`; evaluation traffic is not in it);
        - ``wire_bits_per_element``: 8 * ``bytes_sent_step`` / the number of
          communicated elements (headers, padding and repairs included);
        - the algorithm's :meth:`~lowbit.algorithms.Algorithm.report` entries
          (Moniqua: ``theta``, ``mismatched_blocks``, ``mismatched_messages``,
          ``theta_doublings``, counters since the start).
        """
        return dict(self._last_stats)

    def _step_stats(self, k: int, lr: float) -> dict[str, float]:
        step_bytes, step_messages, total_bytes, total_messages = self._totals.update(self.transport.ledger, k)
        out: dict[str, float] = {
            "step": k, "lr": lr,
            "bytes_sent_step": step_bytes, "bytes_sent": total_bytes,
            "messages_step": step_messages, "messages_sent": total_messages,
            "wire_bits_per_element": 8.0 * step_bytes / len(self.flat),
            "overlapped": self._overlapped,
        }
        report = self.algorithm.report()
        clash = sorted(set(report) & set(out))
        if clash:
            raise RuntimeError(f"{self.algorithm.name}.report() uses the names {clash} of the wrapper's own figures")
        out.update(report)
        return out

    def _restore_grad_views(self) -> None:
        """Undo ``optimizer.zero_grad()`` (set_to_none, PyTorch's default):
        copy any gradient that autograd put in a fresh tensor into the flat
        buffer (zero where a parameter got none) and make ``.grad`` a view again."""
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

    def close(self) -> None:
        """End of training: remove the optimizer's step hooks (a later
        ``optimizer.step()`` is a plain local step), ``algorithm.finish()`` (an
        asynchronous algorithm drains its in-flight messages) and, if the wrapper
        joined the process group itself, leave it. Idempotent. The ranks first agree
        that all took the same steps and none has a non-finite model (a rank that
        skipped or repeated an ``optimizer.step()`` raises the same
        :class:`~lowbit.algorithms.faults.Diverged` on every rank here)."""
        self._close(agree=True)

    def _close(self, agree: bool) -> None:
        if self._closed:
            return
        self._closed = True
        _detach_hooks(self.optimizer, self._hooks)
        self._pass_hook.remove()
        try:
            if self._exchange is not None:  # a forward without its step: its result is dropped
                self._finish_exchange(check=False)
            if agree:
                _wait_channel(self.transport)
                with self._refusals():
                    self._agree(self.step_count, 2)
        finally:
            _wait_channel(self.transport)
            self.algorithm.finish()
            self.transport.set_step(self.step_count)
            if self._owns_transport:
                self.transport.close()

    def __enter__(self) -> "DecentralizedDataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self._close(agree=exc[0] is None)  # after an error the ranks may be anywhere: no agreement

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent so far (the ledger)."""
        return self.transport.ledger.bytes_sent

    # ---- evaluation -------------------------------------------------------------
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

    # ---- checkpoints ---------------------------------------------------------
    def state_dict(self, *args, **kwargs) -> dict:
        """The wrapped module's ``state_dict`` (same keys as ``module.state_dict()``),
        so that ``net.load_state_dict(ddp.state_dict())`` works. The resumable
        checkpoint is :meth:`checkpoint_state`."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a plain module state dict (``net.state_dict()``) into the wrapped
        module, in place: parameters stay views of the flat buffer. Only this
        rank's copy changes; nothing is sent. A full checkpoint goes to
        :meth:`load_checkpoint_state`."""
        if assign:
            raise ValueError("assign must be False: parameters stay views of the flat buffer")
        if isinstance(state_dict, dict) and "format" in state_dict and "algorithm_state" in state_dict:
            raise ValueError("state_dict is a DecentralizedDataParallel checkpoint (from checkpoint_state()); "
                             "restore it with load_checkpoint_state(), not load_state_dict()")
        return self.module.load_state_dict(state_dict, strict=strict)

    def checkpoint_state(self) -> dict:
        """This rank's checkpoint: module (parameters and buffers), optimizer,
        algorithm state, step counter, this rank's ledger (bytes and messages
        sent, so the counters continue after a resume) and this process's RNG
        states (torch, CUDA's current device, numpy, python), all as tensors or
        plain values (``torch.load(..., weights_only=True)`` reads it). lowbit's
        own randomness is derived from (seed, step, rank), so the step counter
        restores it.

        Synchronous algorithms: call it between steps; a resumed run is
        bit-identical to an uninterrupted one. Asynchronous algorithms
        (``synchronous = False``): only after :meth:`close` (a consistent cut);
        resuming then continues correctly, but the stop was a global barrier
        that an uninterrupted run does not have, so it is not bit-identical."""
        self._no_exchange("checkpoint_state()")
        if not self.algorithm.synchronous and not self._closed:
            raise RuntimeError(f"{self.algorithm.name} is asynchronous: its workers' models change while "
                               "others gossip with them, so a checkpoint is consistent only after close() "
                               "(every rank), which drains the exchanges")
        return {
            "format": _FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "algorithm": self.algorithm.name,
            "numel": len(self.flat),
            "buffers": self.buffers_policy,
            "step": self.step_count,
            "module": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "algorithm_state": self.algorithm.state_dict(),
            "ledger": ledger_state(self.transport.ledger),
            "rng": rng_state(),
            **({"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}),
        }

    def load_checkpoint_state(self, state: dict, strict: bool = True) -> None:
        """Restore what :meth:`checkpoint_state` returned on the same rank of a run
        with the same world size and algorithm; training then continues exactly
        as if never interrupted."""
        self._no_exchange("load_checkpoint_state()")
        if not isinstance(state, dict) or state.get("format") not in (1, _FORMAT):
            raise ValueError("state is not a DecentralizedDataParallel checkpoint (missing or unknown 'format')")
        check_fields(state, _fields(state), "state")
        for key, mine in (("world_size", self.world_size), ("rank", self.rank),
                          ("algorithm", self.algorithm.name), ("numel", len(self.flat))):
            if state[key] != mine:
                raise ValueError(f"checkpoint {key}={state[key]!r} does not match this run's {key}={mine!r}")
        if ("scheduler" in state) != (self.scheduler is not None):
            raise ValueError("checkpoint has a scheduler state but this wrapper has no scheduler= to restore it into"
                             if "scheduler" in state else "this wrapper has a scheduler= but the checkpoint holds no "
                             "scheduler state (saved without one)")
        self.module.load_state_dict(state["module"], strict=strict)  # copies in place: views survive
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["algorithm_state"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])
        if "ledger" in state:
            restore_ledger(self.transport.ledger, state["ledger"])
        self._totals = _LedgerTotals()
        self._last_stats = {}
        self.transport.set_step(self.step_count)
        rng = state.get("rng", {})
        if "numpy_keys" in rng:
            set_rng_state(rng)
        else:  # format 1: numpy's and python's states as their own objects
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if "numpy" in rng:
                np.random.set_state(rng["numpy"])
            if "python" in rng:
                random.setstate(rng["python"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        self.flat.check_aliasing()

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Write :meth:`checkpoint_state` to ``path`` atomically, with a checksum
        (:func:`lowbit.integrations.checkpoint.save_checkpoint`); returns the path."""
        return save_checkpoint(self.checkpoint_state(), path)

    def resume_latest(self, path: str | os.PathLike, fallback: str = "warn") -> int | None:
        """Resume from the newest step whose checkpoint verifies on *every* rank, looking at
        ``path`` and the previous checkpoint ``path.prev`` that :meth:`save_checkpoint` keeps
        (a rank killed during a save has only the older one). Collective. Returns the step
        resumed from, or None when no rank has any checkpoint file (a fresh start); a
        :class:`~lowbit.integrations.checkpoint.CheckpointError` on every rank when checkpoints
        exist but no step is common to all ranks, or one fails to load on some rank. A rank
        whose newest file was refused (corrupt, truncated, foreign, incomplete) warns
        (:class:`~lowbit.integrations.checkpoint.CheckpointFallbackWarning`, naming the file,
        why, and the step it resumes from), as does every rank that resumes an older step than
        its newest file; ``fallback="error"`` makes a refused newest file an error on every rank
        instead. Made for restarts (``torchrun --max-restarts``)."""
        self._no_exchange("resume_latest()")
        _wait_channel(self.transport)
        path = os.fspath(path)
        chosen, _ = agree_resume(candidates(path, _FIELDS), self._gather, path, self.rank, fallback)
        if chosen is None:
            return None
        self._restore_agreed(chosen.path, lambda: chosen.state)
        return chosen.step

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from ``path`` (written by :meth:`save_checkpoint` on this rank).
        Collective: every rank calls it, and the ranks check that they all resume
        the same step of a run of the same world size and algorithm; otherwise a
        :class:`~lowbit.integrations.checkpoint.CheckpointError` on every rank, with the
        same message (instead of a hang at the first exchange). A corrupt or incomplete
        file is refused (no fallback to ``path.prev``: :meth:`resume_latest` falls back)."""
        self._no_exchange("load_checkpoint()")
        _wait_channel(self.transport)
        path = os.fspath(path)

        def read() -> dict:
            remove_stale_temporaries(path)  # this rank saves to path: a killed save's leftovers go
            state = load_checkpoint(path, map_location=self.flat.data.device)
            check_fields(state, _fields(state), path)  # a missing field is named with the file
            return state

        check_resume_steps(self._restore_agreed(path, read), path)

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        with self.transport.untracked():
            return self.transport.all_gather(t.to(self.flat.data.device))

    def _restore_agreed(self, path: str, read: Callable[[], dict]) -> list[int]:
        """:meth:`load_checkpoint_state` of ``read()``, then every rank's step; collective: a
        failure on any rank (a refused file, a state that does not fit, any error of a
        ``load_state_dict``) is the same CheckpointError on every rank."""
        error = local = None
        try:
            self.load_checkpoint_state(read())
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait
            local = e
            error = str(e) if isinstance(e, CheckpointError) else \
                f"cannot resume from {path}: {type(e).__name__}: {e}"
        try:
            return agree_outcome(self._gather, self.step_count, error)
        except CheckpointError as agreed:
            raise agreed from local


def _fields(state: dict) -> dict:
    """The fields a checkpoint of ``state``'s format must hold (format 2: RNG states as tensors)."""
    return {**_FIELDS, "rng": RNG_FIELDS} if state.get("format") == _FORMAT else _FIELDS


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """``scheduler`` is None or an LR scheduler of ``optimizer`` (state_dict / load_state_dict)."""
    if scheduler is None:
        return
    if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(f"scheduler must be None or an LR scheduler with state_dict() and load_state_dict(), got "
                        f"{type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler belongs to another optimizer than the wrapper's")


def _run_closure(args: tuple, kwargs: dict) -> tuple | None:
    """``optimizer.step(closure)`` as torch's optimizers run it, but before the algorithm
    communicates: evaluate the closure (zero_grad, forward, backward) under
    ``torch.enable_grad()`` here, in the step pre-hook, and give the optimizer a closure that
    returns that loss, so that ``step`` returns it. None when no closure is given, else the
    (args, kwargs) for the optimizer. An optimizer that evaluates its closure twice per step
    (LBFGS) gets a RuntimeError: it would recompute the gradient after the communication."""
    pos = 1 if len(args) > 1 else None  # args[0] is the optimizer
    closure = args[1] if pos is not None else kwargs.get("closure")
    if closure is None:
        return None
    if not callable(closure):
        raise TypeError(f"closure must be a callable returning the loss, got {type(closure).__name__}")
    with torch.enable_grad():
        loss = closure()
    calls = [0]

    def evaluated():
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("the optimizer evaluates its closure more than once per step (as LBFGS does); under "
                               "DecentralizedDataParallel the closure runs once, before the algorithm communicates: "
                               "use an optimizer that evaluates it once (SGD, Adam, ...)")
        return loss

    if pos is not None:
        return (args[0], evaluated, *args[2:]), kwargs
    return args, {**kwargs, "closure": evaluated}


def _bound_messages(transport: Transport, numel: int) -> None:
    """A torch.distributed transport refuses a peer's stated message size above what a model of
    ``numel`` parameters can need (:func:`lowbit.comm.distributed.max_payload_nbytes`)."""
    from ..comm.distributed import TorchDistributedTransport, max_payload_nbytes

    if isinstance(transport, TorchDistributedTransport):
        transport.max_message_bytes = max_payload_nbytes(numel)


def check_resume_steps(steps: list[int], where: str) -> None:
    """Every rank's resumed step (-1: that rank failed to load) must be the same."""
    failed = [r for r, s in enumerate(steps) if s < 0]
    if failed:
        raise CheckpointError(f"cannot resume from {where}: rank(s) {failed} could not load their checkpoint")
    if len(set(steps)) > 1:
        by_step: dict[int, list[int]] = {}
        for r, s in enumerate(steps):
            by_step.setdefault(s, []).append(r)
        detail = "; ".join(f"step {s}: rank(s) {rs}" for s, rs in sorted(by_step.items()))
        raise CheckpointError(f"cannot resume from {where}: the ranks' checkpoints are of different steps "
                              f"({detail}); every rank must resume from the same step (use the checkpoints "
                              f"of one save)")


def _optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters, which must be trainable parameters of ``module``, each once."""
    ids = {id(p) for p in module.parameters() if p.requires_grad}
    seen: set[int] = set()
    out = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError("optimizer lists a parameter twice")
            if id(p) not in ids:
                raise ValueError(f"optimizer holds a parameter (group {i}, shape {tuple(p.shape)}) that is not a "
                                 "trainable parameter of module; build the optimizer over (a subset of) "
                                 "module.parameters()")
            seen.add(id(p))
            out.append(p)
    if not out:
        raise ValueError("optimizer holds no parameters")
    return out


# Optimizers whose step runs a wrapper's hooks, and that wrapper (weakly): a second wrapper on one of them
# would run two algorithms per step. Weak keys: an optimizer that is garbage collected leaves by itself.
_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref] = weakref.WeakKeyDictionary()
_HOOKED_LOCK = threading.Lock()


def _check_not_hooked(optimizer: torch.optim.Optimizer) -> None:
    with _HOOKED_LOCK:
        if optimizer in _HOOKED:
            raise ValueError("optimizer is already wrapped by another DecentralizedDataParallel (its step runs that "
                             "wrapper's algorithm); close() that wrapper first, or give this one its own optimizer")


def _attach_hooks(optimizer: torch.optim.Optimizer, ddp: DecentralizedDataParallel) -> tuple:
    """Register ``ddp``'s step pre- and post-hook on ``optimizer`` (at most one wrapper per optimizer)."""
    with _HOOKED_LOCK:
        if optimizer in _HOOKED:
            raise ValueError("optimizer is already wrapped by another DecentralizedDataParallel")
        _HOOKED[optimizer] = weakref.ref(ddp)
        return optimizer.register_step_pre_hook(ddp._pre_step), optimizer.register_step_post_hook(ddp._post_step)


def wrapper_of(optimizer: torch.optim.Optimizer) -> "DecentralizedDataParallel | None":
    """The open :class:`DecentralizedDataParallel` whose hooks ``optimizer.step()`` runs, or None."""
    with _HOOKED_LOCK:
        ref = _HOOKED.get(optimizer)
    return ref() if ref is not None else None


def _detach_hooks(optimizer: torch.optim.Optimizer, handles: tuple) -> None:
    with _HOOKED_LOCK:
        for h in handles:
            h.remove()
        _HOOKED.pop(optimizer, None)


class _CountPasses:
    """A backward pass that reaches the communicated parameters: one more for the agreement
    (:attr:`~lowbit.algorithms.faults.StepGuard.passes`)."""

    def __init__(self, guard):
        self.guard = guard

    def __call__(self, grad) -> None:
        self.guard.passes += 1


class _ForwardHook:
    """The module's forward pre-hook: the wrapper's :meth:`_forward_pre`, for this module only.
    It holds the wrapper weakly, and a copy of the module (``copy.deepcopy``, as
    :meth:`~DecentralizedDataParallel.averaged_module` or an EMA model makes; or pickled)
    shares or drops it: a copy's forward starts nothing."""

    def __init__(self, ddp: DecentralizedDataParallel | None):
        self.ddp = weakref.ref(ddp) if ddp is not None else None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        ddp = self.ddp() if self.ddp is not None else None
        if ddp is not None and module is ddp.module:
            ddp._forward_pre(module, args)

    def __deepcopy__(self, memo) -> "_ForwardHook":
        return self

    def __reduce__(self):
        return _ForwardHook, (None,)


# The last exchange started on each communication channel: a process group (the default one of
# torch.distributed, or a thread worker's rank in the in-process runtime). Another wrapper on the
# same channel (two models, two optimizers: a GAN) waits for it before it communicates, so that
# the channel never carries two operations at once and every rank issues them in program order.
_CHANNELS: dict[tuple, "_Exchange"] = {}
_CHANNELS_LOCK = threading.Lock()


def _channel(transport: Transport) -> tuple:
    from ..comm.distributed import TorchDistributedTransport
    from ..comm.inprocess import ThreadTransport

    if isinstance(transport, ThreadTransport):
        return ("thread", id(transport.world), transport.rank)
    if isinstance(transport, TorchDistributedTransport):
        return ("torch.distributed",)
    return ("transport", id(transport))


def _start_exchange(transport: Transport, algorithm, k: int, x: torch.Tensor, lr: float,
                    versions: tuple[int, ...]) -> "_Exchange":
    ex = _Exchange(algorithm, k, x, lr, versions)
    with _CHANNELS_LOCK:
        _CHANNELS[_channel(transport)] = ex
    return ex


def _wait_channel(transport: Transport) -> None:
    """Wait for the exchange in flight on ``transport``'s channel, if any (whichever wrapper
    started it: its errors are that wrapper's to raise)."""
    with _CHANNELS_LOCK:
        ex = _CHANNELS.get(_channel(transport))
    if ex is not None and not ex.done():
        with blocking():
            ex.join()


def _release_channel(transport: Transport, ex: "_Exchange") -> None:
    """Forget ``ex`` (finished) as its channel's last exchange, so that the table holds no
    finished exchange (and the model copy and the algorithm it references)."""
    with _CHANNELS_LOCK:
        key = _channel(transport)
        if _CHANNELS.get(key) is ex:
            del _CHANNELS[key]


class _Exchange:
    """One exchange in flight: ``algorithm.before_update(k, x, None, lr)`` on ``x``, a copy of
    x_k, in a thread of its own (on CUDA, on the stream current when it starts, so its kernels
    follow the copy); its error is kept for the wrapper to raise. ``versions``: the parameters'
    version counters when it started."""

    def __init__(self, algorithm, k: int, x: torch.Tensor, lr: float, versions: tuple[int, ...]):
        self.k = k
        self.versions = versions
        self.error: BaseException | None = None
        stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
        self.thread = threading.Thread(target=self._run, args=(algorithm, x, lr, stream),
                                       name=f"lowbit-overlap-{k}", daemon=True)
        self.thread.start()

    def _run(self, algorithm, x: torch.Tensor, lr: float, stream) -> None:
        try:
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                algorithm.before_update(self.k, x, None, lr)
        except BaseException as e:  # noqa: BLE001 - raised by the wrapper in the caller's thread
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join()


class _LedgerTotals:
    """The ledger's figures for step k and since the start, without re-summing every record
    at every step: steps before k - 1 are folded into running sums once (a step's records
    are complete once the next step has begun; the lag of one step leaves room for an
    asynchronous responder thread that records just as the worker moves on)."""

    def __init__(self):
        self.upto = 0  # steps < upto are folded
        self.bytes = 0
        self.messages = 0

    @staticmethod
    def of_step(ledger: Ledger, step: int) -> tuple[int, int]:
        return ledger.step_bytes(step), sum(r.messages for r in ledger.records.get(step, ()))

    def update(self, ledger: Ledger, k: int) -> tuple[int, int, int, int]:
        """(bytes at step k, messages at step k, bytes in total, messages in total)."""
        for s in range(self.upto, k - 1):
            b, m = self.of_step(ledger, s)
            self.bytes += b
            self.messages += m
        self.upto = max(self.upto, k - 1)
        open_steps = [self.of_step(ledger, s) for s in range(self.upto, k + 1)]
        step_bytes, step_messages = open_steps[-1]
        return (step_bytes, step_messages, self.bytes + sum(b for b, _ in open_steps),
                self.messages + sum(m for _, m in open_steps))
