"""PyTorch Lightning: :class:`LowbitStrategy`, every lowbit algorithm as a Lightning strategy.

Use (``lightning`` installed; ``pip install lowbit[test]`` brings it)::

    from lowbit.integrations.lightning import LowbitStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=LowbitStrategy("moniqua", bits=2, theta=0.05))
    trainer.fit(model, datamodule)
    trainer.strategy.bytes_sent            # this rank's bytes on the wire (the ledger)

``algorithm`` is a ``lowbit train --algorithm`` name, a codec hook of
:data:`lowbit.integrations.ddp_hooks.HOOKS` or typed hook options; the options are the ones
that entry point takes (:mod:`lowbit.integrations.routing` decides the way).

* Centralized algorithms (``allreduce``, ``maxnorm``, ``qsgd``, ``powersgd``...) and the codec
  hooks (``fp16``, ``qsgd-maxnorm``...) run as torch DDP with a lowbit communication hook
  (:func:`~lowbit.integrations.ddp_hooks.make_hook`), registered on every device type (Lightning's
  own ``DDPStrategy(ddp_comm_hook=...)`` registers hooks only on CUDA: on CPU it silently sends
  plain fp32). DDP's semantics hold: ``gradient_clip_val`` clips the averaged gradient,
  ``accumulate_grad_batches`` communicates once per optimizer step (DDP's ``no_sync``), a
  GradScaler sees the same inf on every rank.
* Decentralized algorithms (``dpsgd``, ``moniqua``, ``choco``...) run under
  :class:`~lowbit.integrations.DecentralizedDataParallel`, which wraps the LightningModule and its
  one optimizer, on a process group of its own (a metric logged with ``sync_dist=True`` in
  ``training_step`` cannot interleave with the wrapper's exchange). There is no averaged
  gradient: each rank applies its own, so ``gradient_clip_val`` clips each rank's local
  gradient (what a decentralized method with clipping does, and what the wrapper's
  ``clip_grad_norm_`` does for them). Lightning's closure
  runs in the optimizer's step, before the wrapper communicates; accumulation runs in the
  wrapper's ``no_sync()`` (nothing is sent before the step). Under ``precision="16-mixed"``
  Lightning's own GradScaler skips a step on every rank when any rank's gradient overflows
  (:mod:`lowbit.integrations.amp`).

Options: ``topology``, ``overlap``, ``buffers``, ``sync_initial``, ``seed``, ``weights`` and the
algorithm's options go to the wrapper; ``seed``, ``error_feedback``, ``nonfinite``, ``bucket``,
``clip`` and the algorithm's or codec's options go to ``make_hook``. ``ddp_kwargs`` are torch
DDP's own (e.g. ``find_unused_parameters``). A bad option is refused at construction.

Checkpoints: Lightning's ``ModelCheckpoint`` and ``trainer.fit(ckpt_path=...)`` work. Besides
Lightning's file (rank 0's module), every rank writes its own lowbit state to
``<ckpt>.lowbit-rank<r>`` (:func:`~lowbit.integrations.checkpoint.save_checkpoint`: atomic,
checksummed, loads with ``weights_only=True``): for the wrapper its whole
:meth:`~lowbit.integrations.DecentralizedDataParallel.checkpoint_state` (each rank's own model,
optimizer, algorithm state, ledger), for a hook the hook state's
:meth:`~lowbit.integrations.ddp_hooks.LowbitHookState.state_dict` (step, counters, error memory,
PowerSGD's warm start, the bucket layout DDP had rebuilt, which the first restored step replays).
A resume restores each rank from its own file (the ranks check that they resume the same step),
so the curve and the byte counts continue bit for bit. ``remove_checkpoint`` removes them too.
The asynchronous algorithms (``adpsgd``, ``moniqua-async``) have no consistent cut while they
train: ``fit`` with a checkpoint callback is refused at setup (ValueError); pass
``enable_checkpointing=False`` and call ``trainer.save_checkpoint(path)`` after ``fit``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout

from .checkpoint import load_checkpoint, save_checkpoint
from .ddp_hooks.options import HookOptions
from .decentralized import DecentralizedDataParallel
from .routing import asynchronous, choose, own_transport


def side_path(filepath: str | os.PathLike, rank: int) -> str:
    """The per-rank lowbit file written beside the Lightning checkpoint ``filepath``."""
    return f"{os.fspath(filepath)}.lowbit-rank{rank}"


class LowbitStrategy(DDPStrategy):
    """A Lightning strategy that runs the lowbit ``algorithm`` (see the module docstring).

    ``algorithm``: a name of :data:`lowbit.algorithms.ALGORITHMS` or of the codec hooks
    :data:`lowbit.integrations.ddp_hooks.HOOKS`, or typed hook options
    (:mod:`lowbit.integrations.ddp_hooks.options`); :func:`lowbit.integrations.routing.choose`
    decides the way. ``options``: the algorithm's options and the wrapper's
    (:data:`~lowbit.integrations.routing.WRAPPER_OPTIONS`) or the hook's. ``ddp_kwargs``: torch
    ``DistributedDataParallel`` arguments (hook path only). ``process_group_backend``,
    ``timeout``, ``start_method``, ``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``: as ``DDPStrategy``'s.
    """

    def __init__(self, algorithm: str | HookOptions = "moniqua", *, ddp_kwargs: dict | None = None, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, **(ddp_kwargs or {}))
        self.algorithm = algorithm
        self.options = dict(options)
        self.wrapper: DecentralizedDataParallel | None = None
        pair = choose(algorithm, options)  # checks the name and the options now, before any launch
        self.hook_state, self._hook = pair if pair is not None else (None, None)
        if pair is None and ddp_kwargs:
            raise ValueError(f"ddp_kwargs are torch DDP's; {algorithm!r} runs under DecentralizedDataParallel")
        self._resume: str | None = None  # this rank's lowbit file, set by load_checkpoint
        self._restored = False  # the wrapper restored this rank's optimizer too
        self._failure: BaseException | None = None  # on_exception's, for teardown
        self._group = None  # the wrapper's process group
        self._fitting = False  # set up for fit: the hook registered or the wrapper built

    # ---- what runs ----------------------------------------------------------------------
    @property
    def uses_hook(self) -> bool:
        """True: torch DDP with a lowbit hook; False: DecentralizedDataParallel."""
        return self.hook_state is not None

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent so far (the hook state's or the wrapper's ledger; 0 before setup)."""
        if self.uses_hook:
            return self.hook_state.bytes_sent
        return self.wrapper.bytes_sent if self.wrapper is not None else 0

    def configure_ddp(self) -> None:
        """Hook path: torch DDP and the lowbit hook, on every device type. Wrapper path: nothing
        here (the wrapper needs the optimizer: :meth:`setup_optimizers`)."""
        if not self.uses_hook:
            return
        super().configure_ddp()  # torch DDP; it registers no hook here (none was given to DDPStrategy)
        # parameter names: error memory per parameter, and the bucket layout a resume replays
        self.hook_state.bind_model(self.model)
        self.model.register_comm_hook(self.hook_state, self._hook)
        self._fitting = True

    def setup_optimizers(self, trainer) -> None:
        """Lightning's optimizers; on the wrapper path, wrap the module and its one optimizer."""
        super().setup_optimizers(trainer)
        if self.uses_hook:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"{self.algorithm!r} runs under DecentralizedDataParallel, one optimizer per "
                             f"wrapper: configure_optimizers returned {len(self.optimizers)}")
        # a process group of its own: Lightning's collectives (self.log(..., sync_dist=True) in
        # training_step) cannot interleave with an exchange the wrapper runs during forward and backward
        transport = own_transport(self.algorithm)  # the default group's for an asynchronous algorithm
        self._group = transport.group
        self.wrapper = DecentralizedDataParallel(self.model, self.optimizers[0], self.algorithm, transport=transport,
                                                 **self.options)
        self.model = self.wrapper
        self._fitting = True

    def setup(self, trainer) -> None:
        """DDPStrategy's setup. An asynchronous algorithm with a checkpoint callback in ``fit``:
        ValueError, before any step."""
        if asynchronous(self.algorithm) and trainer.checkpoint_callbacks and trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(f"{self.algorithm!r} is asynchronous: its ranks' models change while a checkpoint "
                             "callback would save them (no consistent cut before close()), so LowbitStrategy cannot "
                             "checkpoint it during training; pass Trainer(enable_checkpointing=False) without a "
                             "ModelCheckpoint and call trainer.save_checkpoint(path) after fit (each rank's "
                             "consistent state, written beside it)")
        super().setup(trainer)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Gradient accumulation: DDP's ``no_sync`` (hook path) or the wrapper's."""
        if self.wrapper is None:
            with super().block_backward_sync():
                yield
        else:
            with self.wrapper.no_sync():
                yield

    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure: teardown then closes the wrapper without the ranks' agreement."""
        self._failure = exception
        super().on_exception(exception)

    def teardown(self) -> None:
        """Close the wrapper (removes its optimizer hooks; collective unless the run failed) and
        unwrap the LightningModule."""
        if self.wrapper is not None:
            failure, self._failure = self._failure, None
            if failure is None:
                self.wrapper.close()
            else:  # the other ranks may be anywhere: no agreement
                self.wrapper.__exit__(type(failure), failure, failure.__traceback__)
            self.model = self.lightning_module
        self._fitting = False
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None
        super().teardown()

    # ---- checkpoints --------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: each rank's own state is restored into the wrapper or hook state set up first."""
        return True

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        """Lightning's file (rank 0) and every rank's own lowbit state beside it."""
        state = self._lowbit_state()  # refuses before anything is written
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if state is not None:
            save_checkpoint(state, side_path(filepath, self.global_rank))

    def remove_checkpoint(self, filepath) -> None:
        """Lightning's file (rank 0) and this rank's lowbit files."""
        super().remove_checkpoint(filepath)
        side = side_path(filepath, self.global_rank)
        for path in (side, side + ".prev"):
            if os.path.exists(path):
                os.remove(path)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Lightning's checkpoint; this rank's lowbit file is restored with the model."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = side_path(checkpoint_path, self.global_rank)
        return checkpoint

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Rank 0's module from Lightning's file, or, when every rank has its lowbit file (one
        collective decision, so that no rank restores alone), the wrapper's whole state from it
        (its own module, optimizer, algorithm state and ledger; the ranks check they resume the
        same step) / the hook state's step, counters and memory."""
        path, self._resume = self._resume, None
        if path is None or not self._fitting:  # validate/test from a checkpoint: the module is all there is
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        everywhere = self.reduce_boolean_decision(os.path.exists(path), all=True)
        if everywhere and self.wrapper is not None:
            self.wrapper.load_checkpoint(path)
            self._restored = True
            return
        super().load_model_state_dict(checkpoint, strict=strict)
        if not everywhere:
            warnings.warn(f"{path} or another rank's lowbit file is missing: the lowbit state (algorithm state, "
                          "step, byte counts) starts afresh on every rank from rank 0's module", stacklevel=2)
        elif self.uses_hook:
            self.hook_state.load_state_dict(load_checkpoint(path))

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Lightning's (rank 0's) optimizer state, unless the wrapper restored this rank's own."""
        if self._restored:
            self._restored = False
            return
        super().load_optimizer_state_dict(checkpoint)

    def _lowbit_state(self) -> dict | None:
        if self.wrapper is not None:
            if self._fitting and not self.wrapper.algorithm.synchronous:
                raise RuntimeError(f"{self.algorithm} is asynchronous: a checkpoint during training would not be "
                                   "consistent; pass Trainer(enable_checkpointing=False) and call "
                                   "trainer.save_checkpoint(path) after fit")
            return self.wrapper.checkpoint_state()
        if self.uses_hook:
            return self.hook_state.state_dict()
        return None
