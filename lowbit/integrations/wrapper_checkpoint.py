"""The checkpoints of :class:`~lowbit.integrations.DecentralizedDataParallel`.

``ddp.state_dict()`` is the plain module's (``net.load_state_dict`` takes it). The resumable
checkpoint, :meth:`~CheckpointMixin.checkpoint_state`, holds the module, the optimizer, the
LR scheduler (``scheduler=``), the algorithm's state, the step counter, this rank's ledger and
the RNG states, all as tensors and plain values; :meth:`~CheckpointMixin.save_checkpoint`
writes it atomically with a checksum, in a file ``torch.load(path, weights_only=True)`` reads
(:mod:`lowbit.integrations.checkpoint`)::

    ddp.save_checkpoint(f"ckpt/rank{ddp.rank}.pt")
    ddp.load_checkpoint(f"ckpt/rank{ddp.rank}.pt")     # collective: every rank, the same step
    ddp.resume_latest(f"ckpt/rank{ddp.rank}.pt")       # collective: the newest step all ranks have

Loads are collective: the ranks check that they resume the same step of a run of the same
world size and algorithm, or every rank raises the same
:class:`~lowbit.integrations.checkpoint.CheckpointError`.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .checkpoint import (ALGORITHM_STATE_FIELDS, LEDGER_FIELDS, OPTIMIZER_FIELDS, RNG_FIELDS, CheckpointError,
                         agree_outcome, agree_resume, candidates, check_fields, ledger_state, load_checkpoint,
                         remove_stale_temporaries, restore_ledger, rng_state, save_checkpoint, set_rng_state)
from .overlap import wait_channel
from .stepping import LedgerTotals

_FORMAT = 2  # 2: RNG states and the ledger as tensors (weights_only=True); 1 is still read
# what a checkpoint must hold (check_fields), besides "step"; format 2 also "rng" (RNG_FIELDS)
_FIELDS = {"format": int, "rank": int, "world_size": int, "algorithm": str, "numel": int, "step": int,
           "module": dict, "optimizer": OPTIMIZER_FIELDS, "algorithm_state": ALGORITHM_STATE_FIELDS,
           "ledger?": LEDGER_FIELDS, "rng?": dict, "scheduler?": dict}


class CheckpointMixin:
    """The wrapper's checkpoints (see the module docstring). Used by
    :class:`~lowbit.integrations.DecentralizedDataParallel`."""

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
        self._totals = LedgerTotals()
        self._step_state.stats = {}
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
        wait_channel(self.transport)
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
        wait_channel(self.transport)
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


def checkpoint_fields(extra: dict | None = None) -> dict:
    """The fields (:func:`~lowbit.integrations.checkpoint.check_fields`) a checkpoint of the current
    format must hold, with ``extra``: the fields a driver saves beside the wrapper's in the same file
    (``lowbit train``: its config, data stream, compute times and evaluations)."""
    return {**_FIELDS, "rng": RNG_FIELDS, **(extra or {})}


def _fields(state: dict) -> dict:
    """The fields a checkpoint of ``state``'s format must hold (format 2: RNG states as tensors)."""
    return checkpoint_fields() if state.get("format") == _FORMAT else _FIELDS


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """``scheduler`` is None or an LR scheduler of ``optimizer`` (state_dict / load_state_dict)."""
    if scheduler is None:
        return
    if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(f"scheduler must be None or an LR scheduler with state_dict() and load_state_dict(), got "
                        f"{type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler belongs to another optimizer than the wrapper's")


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
