"""The optimizer's step hooks of :class:`~lowbit.integrations.DecentralizedDataParallel`:
at most one wrapper per optimizer, the closure of ``optimizer.step(closure)``, the wrapper's
per-step fields, the count of backward passes, and the ledger's running totals for ``stats()``.

Every ``optimizer.step()`` runs through here, so the per-step work is kept to plain attribute
reads and writes: the fields that change every step live in a :class:`StepState` (setting an
attribute of an ``nn.Module`` runs ``Module.__setattr__``'s registry checks, about 1.3 us on
this project's machine, against 10 ns for a slot), and the open wrappers are a tuple read
without a lock."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm.ledger import Ledger

if TYPE_CHECKING:
    from .decentralized import DecentralizedDataParallel


def run_closure(args: tuple, kwargs: dict) -> tuple | None:
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


def optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
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
# The same wrappers' weak references, for open_wrappers(): replaced (never changed) under the lock, read without it
_OPEN: tuple[weakref.ref, ...] = ()
_HOOKED_LOCK = threading.Lock()


def check_not_hooked(optimizer: torch.optim.Optimizer) -> None:
    """A ValueError if a wrapper's hooks are on ``optimizer`` already."""
    with _HOOKED_LOCK:
        if optimizer in _HOOKED:
            raise ValueError("optimizer is already wrapped by another DecentralizedDataParallel (its step runs that "
                             "wrapper's algorithm); close() that wrapper first, or give this one its own optimizer")


def attach_hooks(optimizer: torch.optim.Optimizer, ddp: DecentralizedDataParallel) -> tuple:
    """Register ``ddp``'s step pre- and post-hook on ``optimizer`` (at most one wrapper per optimizer)."""
    global _OPEN
    with _HOOKED_LOCK:
        if optimizer in _HOOKED:
            raise ValueError("optimizer is already wrapped by another DecentralizedDataParallel")
        ref = _HOOKED[optimizer] = weakref.ref(ddp)
        _OPEN = (*(r for r in _OPEN if r() is not None), ref)  # a collected wrapper leaves here
        return optimizer.register_step_pre_hook(ddp._pre_step), optimizer.register_step_post_hook(ddp._post_step)


def wrapper_of(optimizer: torch.optim.Optimizer) -> "DecentralizedDataParallel | None":
    """The open :class:`DecentralizedDataParallel` whose hooks ``optimizer.step()`` runs, or None."""
    with _HOOKED_LOCK:
        ref = _HOOKED.get(optimizer)
    return ref() if ref is not None else None


def detach_hooks(optimizer: torch.optim.Optimizer, handles: tuple) -> None:
    """Remove the hooks :func:`attach_hooks` registered; ``optimizer`` is free for a new wrapper."""
    global _OPEN
    with _HOOKED_LOCK:
        for h in handles:
            h.remove()
        ref = _HOOKED.pop(optimizer, None)
        _OPEN = tuple(r for r in _OPEN if r is not ref and r() is not None)


def open_wrappers() -> list["DecentralizedDataParallel"]:
    """The wrappers whose hooks are on an optimizer now (not closed, not collected)."""
    return [w for w in (r() for r in _OPEN) if w is not None]


class StepState:
    """The wrapper's fields that change at every step, in a plain object (see the module
    docstring): ``k``, the index of the next step (the wrapper's ``step_count``);
    ``in_step``, ``(k, lr)`` between the optimizer's pre- and post-hook; ``early`` /
    ``skip_agreed``, the backward pass (``guard.passes``) at which ``clip_grad_norm_`` ran the
    step's communication / the ranks agreed that a gradient overflowed (valid for those
    gradients only; :mod:`lowbit.integrations.amp`); ``overflow_from``, the first rank whose
    gradient overflowed then; ``skipping``, the optimizer's step in progress is one a
    GradScaler skips; ``fp16``, the last training forward ran under fp16 autocast;
    ``no_sync``, inside ``no_sync()``; ``exchange``, the overlapped exchange in flight;
    ``overlapped``, whether the step in progress was overlapped; ``stats``, the last step's
    figures."""

    __slots__ = ("k", "in_step", "early", "skip_agreed", "overflow_from", "skipping", "fp16", "no_sync",
                 "exchange", "overlapped", "stats")

    def __init__(self):
        self.k = 0
        self.in_step: tuple[int, float] | None = None
        self.early: int | None = None
        self.skip_agreed: int | None = None
        self.overflow_from: int | None = None
        self.skipping = False
        self.fp16 = False
        self.no_sync = False
        self.exchange = None
        self.overlapped = 0
        self.stats: dict[str, float] = {}


class CountPasses:
    """The backward passes that reach the communicated parameters, one more each for the
    agreement (:attr:`~lowbit.algorithms.faults.StepGuard.passes`): a hook on every parameter
    counts a pass (autograd's graph task) the first time one of its hooks runs in it, as
    ``torch.autograd.graph.register_multi_grad_hook(mode="any")`` does. That one takes a lock
    and keeps a dict entry per pass, never freed; here the next parameter of the pass just
    counted costs one comparison, and the passes remembered are the last :attr:`REMEMBERED`
    (passes run by other threads at the same time are counted once each). ``at_end``, if
    given (a bound method, held weakly), is called with no arguments at the end of every pass
    counted (autograd's ``queue_callback``: after every gradient of the pass is accumulated,
    inside ``backward()``, which raises what it raises). :meth:`remove` removes the hooks."""

    REMEMBERED = 64

    def __init__(self, guard, params, at_end=None):
        self.guard = guard
        self.at_end = weakref.WeakMethod(at_end) if at_end is not None else None
        self.last = -1  # the graph task whose hook ran last
        self.seen: dict[int, None] = {}  # the graph tasks counted, oldest first
        self.lock = threading.Lock()
        self.handles = [p.register_hook(self) for p in params if p.requires_grad]

    def __call__(self, grad) -> None:
        task = torch._C._current_graph_task_id()
        if task == self.last:
            return
        with self.lock:
            self.last = task
            if task in self.seen:
                return
            self.seen[task] = None
            if len(self.seen) > self.REMEMBERED:
                del self.seen[next(iter(self.seen))]
            self.guard.passes += 1
        at_end = self.at_end() if self.at_end is not None else None
        if at_end is not None:
            torch.autograd.Variable._execution_engine.queue_callback(at_end)

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()


class LedgerTotals:
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
        """(bytes, messages) the ledger holds for ``step`` (its records' ``sent_bytes`` and
        ``messages``, summed in one pass)."""
        b = m = 0
        for r in ledger.records.get(step, ()):
            b += r.sent_bytes
            m += r.messages
        return b, m

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
