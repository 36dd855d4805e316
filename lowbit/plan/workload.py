"""The step ``lowbit plan`` measures: a :class:`Workload` loaded from a task name or a
``module:function`` (:func:`load_workload`)."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class Workload:
    """One worker's training step: ``loss_fn(model, batch)`` is the scalar loss."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable
    batch_size: int | None
    description: str


def _call_with_batch(fn: Callable, what: str, batch_size: int | None, **extra):
    """``fn(batch_size=..., **extra)`` where it takes them (ValueError naming ``what`` otherwise)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {}
    if batch_size is not None:
        if "batch_size" not in params and not var_kw:
            raise ValueError(f"batch_size: {what} takes no batch_size argument; leave --batch-size out or add a "
                             "batch_size parameter to it")
        kw["batch_size"] = batch_size
    for k, v in extra.items():
        if v is None:
            continue
        if k not in params and not var_kw:
            raise ValueError(f"{k}: {what} takes no {k} argument")
        kw[k] = v
    return fn(**kw)


def _check_triple(out, what: str) -> tuple[nn.Module, Any, Callable]:
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"model: {what} must return a tuple (model, batch, loss_fn), got "
                         f"{type(out).__name__}{f' of {len(out)} items' if isinstance(out, tuple) else ''}")
    model, batch, loss_fn = out
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: the first item {what} returns must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"model: the third item {what} returns must be a callable loss_fn(model, batch), got "
                         f"{type(loss_fn).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model: the module {what} returns has no trainable parameters")
    _check_batch(batch, what)
    return model, batch, loss_fn


def _check_batch(batch, what: str) -> None:
    if isinstance(batch, torch.Tensor):
        return
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else None
    if items is None:
        raise ValueError(f"model: the batch {what} returns must be a tensor or a tuple, list or dict of tensors, "
                         f"got {type(batch).__name__}")
    for b in items:
        _check_batch(b, what)


def load_model_function(spec: str) -> Callable:
    """The function ``module:function`` names (``module`` importable, e.g. ``mypkg.models``,
    from ``sys.path`` or the current directory, as ``python -m`` finds it; a dotted attribute
    path after the colon is allowed). ValueError naming what is wrong."""
    import os
    import sys

    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"model must be 'module:function' (e.g. mypkg.nets:build), got {spec!r}")
    mod_name, attr = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"model: cannot import module {mod_name!r} ({e})") from None
    obj = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"model: module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"model: {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def load_workload(task: str | None = None, model: str | None = None, batch_size: int | None = None,
                  seq_len: int | None = None, task_options: dict | None = None) -> Workload:
    """The step to plan: a ``task`` (a name of :data:`lowbit.plan_models.PLAN_MODELS` or a
    ``lowbit train`` task) or ``model``, ``'module:function'``.

    The function's contract: called with no argument (or ``batch_size=B`` when ``batch_size``
    is given; it must then take that keyword), it returns ``(model, batch, loss_fn)``: an
    ``nn.Module``, one worker's minibatch (a tensor, or a tuple/list/dict of tensors; moved
    to the device with the model) and ``loss_fn(model, batch)``, the scalar loss whose
    backward gives the gradient DDP averages. ``task_options``: keyword arguments of a ``lowbit
    train`` task (e.g. ``{"hidden": 1024}`` for digits-mlp)."""
    from ..plan_models import PLAN_MODELS

    if (task is None) == (model is None):
        raise ValueError("give exactly one of task (a name) or model ('module:function')")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if seq_len is not None and task != "gpt2-small":
        raise ValueError("seq_len is for the gpt2-small task only")
    if model is not None:
        fn = load_model_function(model)
        net, batch, loss_fn = _check_triple(_call_with_batch(fn, model, batch_size), model)
        return Workload(model, net, batch, loss_fn, _leading_dim(batch) if batch_size is None else batch_size,
                        f"{model} (a user's function)")
    if task in PLAN_MODELS:
        fn, default_batch, what = PLAN_MODELS[task]
        b = default_batch if batch_size is None else batch_size
        net, batch, loss_fn = _check_triple(_call_with_batch(fn, task, b, seq_len=seq_len), task)
        if seq_len is not None:
            what += f", sequences of {seq_len} tokens"
        return Workload(task, net, batch, loss_fn, b, what)
    from ..train.tasks import TASKS, make_task

    if task_options and task not in TASKS:
        raise ValueError("task_options are for the lowbit train tasks")
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of: {', '.join([*PLAN_MODELS, *TASKS])}")
    t = make_task(task, **(task_options or {}))
    b = 32 if batch_size is None else batch_size
    torch.manual_seed(0)
    net = t.make_model()
    batch = t.sample(t.shard(0, 1, 0), b, torch.Generator().manual_seed(0))
    return Workload(task, net, batch, t.loss, b, f"lowbit train task {task}")


def _leading_dim(batch) -> int | None:
    """The batch size a batch shows: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = list(batch.values()) if isinstance(batch, dict) else list(batch)
    return _leading_dim(items[0]) if items else None


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return type(batch)(_to(b, device) for b in batch)
