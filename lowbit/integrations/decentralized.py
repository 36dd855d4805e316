"""DecentralizedDataParallel: any lowbit algorithm around a user's own ``nn.Module`` and
optimizer, under ``torchrun`` or on a given Transport.

Use (every rank runs the same code; the loop is PyTorch's own)::

    model = DecentralizedDataParallel(net, opt, algorithm="moniqua", bits=2, theta=0.05)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                          # communicate, the optimizer's update, communicate
    avg = model.averaged_module()           # collective: the average over all workers
    torch.save(model.state_dict(), "net.pt")   # the plain module's state dict: net.load_state_dict works
    model.save_checkpoint(f"ckpt/rank{model.rank}.pt")   # resumable, atomic, checksummed
    model.close()                           # removes the optimizer's hooks

The wrapper registers a step pre-hook and post-hook on the optimizer, so every
``optimizer.step()`` runs, with the wrapper's step counter ``k`` and ``lr`` read from the
optimizer's first parameter group::

    transport.set_step(k)
    algo.before_update(k, x, g, lr)     # gossip (rewrites x) or aggregation (rewrites g)
    <the optimizer's own update>
    algo.after_update(k, x, g, lr)

``x`` / ``g`` are the parameters the optimizer holds / their gradients as one flat buffer
(:mod:`lowbit.integrations.gradients`). An optimizer over a subset of the module's trainable
parameters is fine: only those are communicated; the others are *local* (never sent, not
averaged). One wrapper per optimizer; :meth:`~DecentralizedDataParallel.close` removes the
hooks, after which ``optimizer.step()`` is a plain local step.

DDP's idioms keep DDP's meaning: ``optimizer.step(closure)`` runs the closure first and
returns its loss; torch's ``GradScaler`` skips the same steps on every rank
(:mod:`lowbit.integrations.amp`); :meth:`~DecentralizedDataParallel.clip_grad_norm_` clips
the averaged gradient (the centralized algorithms) or the local one (gossip, which has no
averaged gradient); :meth:`~DecentralizedDataParallel.no_sync` accumulates without
communicating.

The concerns live in their modules: overlap of the exchange with forward and backward
(:mod:`lowbit.integrations.overlap`), gradient views, buffers and the averaged module
(:mod:`lowbit.integrations.gradients`), checkpoints
(:mod:`lowbit.integrations.wrapper_checkpoint`), the optimizer's hooks
(:mod:`lowbit.integrations.stepping`). After every step
:meth:`~DecentralizedDataParallel.stats` holds the step's figures, and ``on_step`` is called
with them (:class:`~lowbit.integrations.LogStats`, :class:`~lowbit.integrations.TensorBoardStats`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..algorithms import Algorithm, Worker, build_worker
from ..algorithms.faults import PeerPayloadError, refusal_error, refusal_text
from ..comm.base import Transport
from ..topology import Topology
from .amp import AmpMixin
from .flat import FlatParams
from .gradients import BUFFER_POLICIES, GradientsMixin, InitialStateReplaced
from .overlap import Exchange, ForwardHook, OverlapMixin, wait_channel
from .stepping import (CountPasses, LedgerTotals, StepState, attach_hooks, check_not_hooked, detach_hooks,
                       optimizer_params, run_closure, wrapper_of)
from .wrapper_checkpoint import CheckpointMixin, check_resume_steps, check_scheduler

__all__ = ["DecentralizedDataParallel", "InitialStateReplaced", "BUFFER_POLICIES", "check_resume_steps", "wrapper_of"]

StepCallback = Callable[[int, dict], None]  # on_step(step, stats)


class DecentralizedDataParallel(AmpMixin, OverlapMixin, GradientsMixin, CheckpointMixin, nn.Module):
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
    :meth:`averaged_module` carries (:mod:`lowbit.integrations.gradients`).
    ``sync_initial``: start every rank from rank 0's parameters and buffers.
    ``on_step``: None or ``callback(step, stats)``, called after every step with
    :meth:`stats` (the attribute ``on_step`` may also be set later).
    ``overlap``: True (default): where the algorithm allows it
    (:attr:`~lowbit.algorithms.Algorithm.overlap`), its exchange runs during the
    forward and backward of the step, in a background thread
    (:mod:`lowbit.integrations.overlap`); False: the algorithm communicates in the optimizer's step
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
        check_scheduler(scheduler, optimizer)
        check_not_hooked(optimizer)
        params = optimizer_params(module, optimizer)

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
            wait_channel(transport)
            self._broadcast_from_rank0()
        self.algorithm.setup(self.flat.data)
        # the fields that change every step (k, the step in progress, ...): a plain object, whose
        # attributes cost no Module.__setattr__ (stepping.StepState)
        self._step_state = StepState()
        self._refusals = Refusals(transport)
        self.on_step = on_step
        self._closed = False
        self._totals = LedgerTotals()
        # overlap: the algorithm's exchange of step k runs during its forward and backward
        self.overlap = overlap and bool(getattr(self.algorithm, "overlap", False))
        self._x_half: torch.Tensor | None = None  # where the exchange in flight writes x_{k+1/2}
        self._views_layout: tuple | None = None  # the parameters' and gradients' layout the last step found
        self._hooks = attach_hooks(optimizer, self)
        # the training backward passes, counted for the agreement: a rank that skips or repeats an
        # optimizer.step() is found at the next step; at the end of each, the ranks agree whether a
        # gradient overflowed, so that a GradScaler skips the same steps on every rank (amp.py)
        self._pass_hook = CountPasses(self.algorithm.guard, self.flat.params, at_end=self._backward_end)
        if self.overlap:
            self._hooks += (module.register_forward_pre_hook(ForwardHook(self)),)

    def forward(self, *args, **kwargs):
        self._note_autocast()  # fp16 autocast: a GradScaler's overflow is agreed at the end of backward
        return self._modules["module"](*args, **kwargs)  # self.module, without Module.__getattr__

    @property
    def step_count(self) -> int:
        """The index k of the next step (the number of steps taken, a resumed run's included)."""
        return self._step_state.k

    @step_count.setter
    def step_count(self, k: int) -> None:
        self._step_state.k = k

    @property
    def _exchange(self) -> Exchange | None:
        """The overlapped exchange in flight (started by a training forward), or None."""
        return self._step_state.exchange

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)``, which runs the algorithm through the optimizer's
        step hooks (see the module docstring); kept for code that calls it. Returns what
        the optimizer's step returns (the closure's loss, or None)."""
        if self._closed:
            raise RuntimeError("step() after close(): the optimizer's step hooks are removed")
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    optimizer_step = step

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
        """The optimizer's step pre-hook: the closure if one is given, set_step(k), before_update
        (unless :meth:`clip_grad_norm_` has run it already for this step)."""
        with self._refusals:
            replaced = run_closure(args, kwargs)
            s = self._step_state
            if s.no_sync:
                raise RuntimeError("optimizer.step() inside ddp.no_sync(): no_sync() is for gradient accumulation "
                                   "(the backward passes inside it add up; the algorithm communicates at the "
                                   "optimizer.step() after the block); a step inside it would be a local step")
            if not self._amp_pre_step(optimizer) and s.early != self.algorithm.guard.passes:
                self._pre_step_body()
            s.early = s.skip_agreed = None
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
        s = self._step_state
        before, s.no_sync = s.no_sync, True
        try:
            yield
        finally:
            s.no_sync = before

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
        passes, s = self.algorithm.guard.passes, self._step_state
        if self.algorithm.family == "centralized" and passes not in (s.early, s.skip_agreed):
            with self._refusals:
                self._pre_step_body()
            s.early = passes
        return torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], max_norm,
                                              norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def _pre_step_body(self) -> None:
        self._restore_grad_views()  # after it every parameter and .grad points into the flat buffers
        s, flat, algorithm = self._step_state, self.flat, self.algorithm
        k = s.k
        lr = float(self.optimizer.param_groups[0]["lr"])
        if s.exchange is not None:  # started by the forward: x <- x_{k+1/2}
            self._finish_exchange(check=True)
            flat.data.copy_(self._x_half)
            # the gradient is only applied here: a non-finite one is reported at the next agreement
            algorithm.guard.note(k, "gradient", flat.grad)
            s.overlapped = 1
        else:
            wait_channel(self.transport)
            self.transport.set_step(k)
            algorithm.guard.note(k, "gradient", flat.grad)
            if algorithm.agrees_before_update:  # else before after_update, in the post-hook
                self._agree(k, 0)
            algorithm.before_update(k, flat.data, flat.grad, lr)
            s.overlapped = 0
        s.in_step = (k, lr)

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

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """The optimizer's step post-hook: after_update, the step counter, stats, ``on_step``."""
        with self._refusals:
            self._post_step_body(optimizer, args, kwargs)

    def _post_step_body(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        s, algorithm = self._step_state, self.algorithm
        if s.skipping:  # a step the GradScaler skips (amp.py): nothing to do
            s.skipping = False
            return
        if s.in_step is None:
            raise RuntimeError("the optimizer's step post-hook ran without its pre-hook")
        k, lr = s.in_step
        s.in_step = None
        wait_channel(self.transport)
        if algorithm.acts_after_update:
            self._agree(k, 1)
        algorithm.after_update(k, self.flat.data, self.flat.grad, lr)
        s.k = k + 1
        s.stats = self._step_stats(k, lr)
        if self.on_step is not None:
            self.on_step(k, dict(s.stats))

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
        return dict(self._step_state.stats)

    def _step_stats(self, k: int, lr: float) -> dict[str, float]:
        step_bytes, step_messages, total_bytes, total_messages = self._totals.update(self.transport.ledger, k)
        out: dict[str, float] = {
            "step": k, "lr": lr,
            "bytes_sent_step": step_bytes, "bytes_sent": total_bytes,
            "messages_step": step_messages, "messages_sent": total_messages,
            "wire_bits_per_element": 8.0 * step_bytes / len(self.flat),
            "overlapped": self._step_state.overlapped,
        }
        report = self.algorithm.report()
        if report:
            clash = sorted(out.keys() & report.keys())
            if clash:
                raise RuntimeError(f"{self.algorithm.name}.report() uses the names {clash} of the wrapper's own "
                                   "figures")
            out.update(report)
        return out

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
        detach_hooks(self.optimizer, self._hooks)
        self._pass_hook.remove()
        try:
            if self._step_state.exchange is not None:  # a forward without its step: its result is dropped
                self._finish_exchange(check=False)
            if agree:
                wait_channel(self.transport)
                with self._refusals:
                    self._agree(self.step_count, 2)
        finally:
            wait_channel(self.transport)
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


class Refusals:
    """Around the wrapper's communication (``with ddp._refusals:``): a payload this rank refuses
    ends it, out of step with the others, so it posts the refusal first
    (``Transport.post_refusal``); a rank whose communication then fails raises that refusal,
    naming the sender, instead of its own "connection closed" (:mod:`lowbit.algorithms.faults`).
    A class rather than a generator's context manager: it is entered twice per step."""

    __slots__ = ("transport",)

    def __init__(self, transport: Transport):
        self.transport = transport

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if e is None:
            return False
        if isinstance(e, PeerPayloadError):
            self.transport.post_refusal(refusal_text(e))
        elif isinstance(e, (RuntimeError, threading.BrokenBarrierError)):  # a communication failure
            t = self.transport
            err = refusal_error(t.posted_refusal(), t.world_size, t.rank, e)
            if err is not None:
                raise err from e
        return False


def _bound_messages(transport: Transport, numel: int) -> None:
    """A transport that bounds the sizes its peers state (its ``max_message_bytes``: torch.distributed's)
    refuses one above what a model of ``numel`` parameters can need
    (:func:`lowbit.comm.distributed.max_payload_nbytes`)."""
    from ..comm.distributed import max_payload_nbytes

    if hasattr(transport, "max_message_bytes"):
        transport.max_message_bytes = max_payload_nbytes(numel)
