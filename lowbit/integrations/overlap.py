"""Overlap: the exchange of step k runs during its forward and backward, in a thread.

For an algorithm whose :attr:`~lowbit.algorithms.Algorithm.overlap` is True (D-PSGD,
naive quantized gossip) the gossip step ``x_{k+1/2} = sum_j W_ji x_j`` reads the model
``x_k``, never the gradient, and ``x_k`` is final once the forward of step k starts. So
:class:`~lowbit.integrations.DecentralizedDataParallel` (``overlap=True``) starts it there
(a forward pre-hook on the module, :class:`ForwardHook`), on a copy of ``x_k``, in a
background thread (:class:`Exchange`: one per step, at most one in flight), while forward and
backward compute; the step pre-hook waits for it, copies ``x_{k+1/2}`` into the parameters
and the optimizer applies ``g_k``. The arithmetic and the ledger are those of
``overlap=False``, bit for bit; it costs one more copy of the model.

The exchange starts only at a forward in training mode with gradients enabled (not inside
``no_sync()``): an evaluation forward sends nothing. A step whose exchange no forward started
communicates in its pre-hook, as with ``overlap=False``. More forwards before the step
(accumulation, activation checkpointing) reuse the exchange in flight, provided the
parameters are not changed in place in between (a RuntimeError at the step). An error in the
thread is raised by the step (or ``close``).

Channels: the transport names the channel its operations travel on
(:attr:`~lowbit.comm.base.Transport.channel`: a process group, a thread world's rank). Several
wrappers on one channel (two models with two optimizers, as a GAN) take turns: before it
communicates, a wrapper waits for every exchange in flight of the open wrappers on its
channel (:func:`wait_channel`), so the ranks issue the operations in program order. Each
wrapper holds its own exchange; nothing is kept at module level. Between the forward and the
step the transport is busy: run no collectives of your own on its process group there.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm.base import Transport
from ..comm.inprocess import blocking
from .stepping import open_wrappers

if TYPE_CHECKING:
    from .decentralized import DecentralizedDataParallel


class OverlapMixin:
    """The wrapper's overlap (see the module docstring): the forward pre-hook that starts an
    exchange, and the waits for it. Used by :class:`~lowbit.integrations.DecentralizedDataParallel`."""

    def _forward_pre(self, module: nn.Module, args: tuple) -> None:
        """The module's forward pre-hook: start step k's exchange on a copy of x_k (training
        forwards only; a second forward before the step reuses the exchange in flight)."""
        with self._refusals:
            self._forward_pre_body(module, args)

    def _forward_pre_body(self, module: nn.Module, args: tuple) -> None:
        s = self._step_state
        if not (module.training and torch.is_grad_enabled()) or self._closed or s.no_sync:
            return
        ex = s.exchange
        if ex is not None:
            if ex.done() and ex.error is not None:
                self._finish_exchange(check=False)  # raises the thread's error now
            if ex.versions != self._versions():
                self._finish_exchange(check=True)  # raises: x changed under the exchange
            return
        k = s.k
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._x_half is None:
            self._x_half = torch.empty_like(self.flat.data)
        with torch.no_grad():
            self._x_half.copy_(self.flat.data)
        wait_channel(self.transport)
        self.transport.set_step(k)
        self._agree(k, 0)
        s.exchange = Exchange(self.algorithm, k, self._x_half, lr, self._versions())

    def _versions(self) -> tuple[int, ...]:
        """The in-place version counters of the flat buffer and of every parameter (views of
        it with counters of their own): they move when something writes the parameters."""
        return (self.flat.data._version, *(p._version for p in self.flat.params))

    def _finish_exchange(self, check: bool) -> None:
        """Wait for the exchange in flight (a thread worker lets another compute meanwhile),
        re-raise its error; ``check``: raise if the parameters changed since it started."""
        s = self._step_state
        ex, s.exchange = s.exchange, None
        with blocking():
            ex.join()
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
        s = self._step_state
        ex = s.exchange
        if ex is not None:
            with blocking():
                ex.join()
            if ex.error is not None:
                s.exchange = None
                raise ex.error
        wait_channel(self.transport)

    def _no_exchange(self, what: str) -> None:
        ex = self._step_state.exchange
        if ex is not None:
            raise RuntimeError(f"{what} between a training forward and optimizer.step(): the exchange of step "
                               f"{ex.k} is in flight (overlap=True); call it between steps")


def wait_channel(transport: Transport) -> None:
    """Wait for the exchanges in flight of the open wrappers on ``transport``'s channel (their
    errors are those wrappers' to raise)."""
    key = None
    for ddp in open_wrappers():
        ex = ddp._step_state.exchange
        if ex is not None and not ex.done():
            if key is None:
                key = transport.channel
            if ddp.transport.channel == key:
                with blocking():
                    ex.join()


class ForwardHook:
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

    def __deepcopy__(self, memo) -> "ForwardHook":
        return self

    def __reduce__(self):
        return ForwardHook, (None,)


class Exchange:
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
        """Whether the thread has ended."""
        return not self.thread.is_alive()

    def join(self) -> None:
        """Wait for the thread to end."""
        self.thread.join()
