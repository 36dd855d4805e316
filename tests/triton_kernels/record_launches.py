"""A pytest plugin for the interpreter run (``-p record_launches``): every Triton kernel
launch is recorded -- the kernel, each argument's kind and dtype or value -- and written as
JSON to ``$LOWBIT_TRITON_LAUNCHES`` at exit, for ``compile_launches.py`` to compile each
specialization for a real GPU (the interpreter accepts code the compiler refuses)."""

import atexit
import json
import os

import torch
from triton.runtime.interpreter import InterpretedFunction

_seen: dict[str, dict] = {}
_run = InterpretedFunction.run


def _describe(v):
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).removeprefix("torch.")]
    for kind in (bool, int, float):  # bool first: it is an int
        if isinstance(v, kind):
            return [kind.__name__, v]
    return ["none", None] if v is None else ["other", repr(v)]


def _recording_run(self, *args, grid, warmup, **kwargs):
    values = dict(zip(self.arg_names, args), **kwargs)
    rec = {"module": self.fn.__module__, "name": self.fn.__name__,
           "args": {k: _describe(v) for k, v in values.items()}}
    _seen[json.dumps(rec, sort_keys=True)] = rec
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


InterpretedFunction.run = _recording_run


@atexit.register
def _write():
    with open(os.environ["LOWBIT_TRITON_LAUNCHES"], "w") as f:
        json.dump(list(_seen.values()), f)
