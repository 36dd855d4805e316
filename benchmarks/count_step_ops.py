"""Count the work one worker's algorithm issues per step: torch (aten) ops and Triton kernel
launches inside its ``before_update`` and ``after_update`` hooks (the optimizer step and
the model's forward and backward are not counted), on thread workers (digits-mlp, rank 0 of
a ring of 4; the first ``--skip`` steps, which set things up, are left out).

On a GPU a thread worker's step is bound by launching work from Python threads that share
one interpreter, so these counts are what to cut there. ``--path cuda`` counts the CUDA
code path without a GPU: the Triton kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, one worker computing at a time, since the interpreter is not
thread-safe), and the ops the interpreter itself runs are left out.

Run: ``python benchmarks/count_step_ops.py moniqua bits=2 --path cuda`` (any algorithm and
``key=value`` options of ``lowbit train``; ``--path cpu`` for the numba path).
"""

import argparse
import collections
import os
import sys
import threading

COUNTED = threading.local()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("algorithm")
    ap.add_argument("options", nargs="*", help="key=value TrainConfig options, e.g. bits=2")
    ap.add_argument("--path", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--steps", type=int, default=4, help="steps counted")
    ap.add_argument("--skip", type=int, default=2, help="steps run first and not counted")
    ap.add_argument("--where", action="store_true", help="also count by the lowbit source line that issued each")
    args = ap.parse_args()
    if args.path == "cuda":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import lowbit.codecs.kernels as kernels
    from lowbit.comm.inprocess import run_threads
    from lowbit.train.config import TrainConfig
    from lowbit.train.loop import run_worker

    counts: collections.Counter = collections.Counter()
    lines: collections.Counter = collections.Counter()

    def issued(what: str) -> None:
        counts[what] += 1
        if args.where:
            lines[(what, _caller())] += 1

    if args.path == "cuda":
        from triton.runtime.interpreter import InterpretedFunction

        current = kernels._current_path
        kernels.fast_backend = lambda x: None if current() == "reference" or type(x) is not torch.Tensor else "triton"
        run = InterpretedFunction.run

        def counted_run(self, *a, **k):
            on = getattr(COUNTED, "on", False)
            if on:
                issued("triton " + self.fn.__name__)
            COUNTED.on = False  # the interpreter's own torch calls are not the kernel's
            try:
                return run(self, *a, **k)
            finally:
                COUNTED.on = on

        InterpretedFunction.run = counted_run

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), k=None):
            if getattr(COUNTED, "on", False):
                issued("aten " + func.overloadpacket.__name__)
            return func(*a, **(k or {}))

    options = {}
    for item in args.options:
        key, _, value = item.partition("=")
        options[key] = _value(value)
    total = args.skip + args.steps
    cfg = TrainConfig(task="digits-mlp", workers=4, steps=total, device="cpu", seed=0,
                      eval_every=total + 1, backend="thread", algorithm=args.algorithm, **options)
    calls = collections.Counter()

    def instrument(algo) -> None:
        if algo.rank != 0:
            return
        for hook in ("before_update", "after_update"):
            setattr(algo, hook, counted(getattr(algo, hook)))

    def counted(fn):
        def call(*a, **k):
            calls[fn.__name__] += 1
            if calls[fn.__name__] <= args.skip:
                return fn(*a, **k)
            COUNTED.on = True
            try:
                with Count():
                    return fn(*a, **k)
            finally:
                COUNTED.on = False

        return call

    run_threads(4, lambda t: run_worker(t, cfg, evaluate=False, instrument=instrument),
                max_running=1 if args.path == "cuda" else None)
    launches = sum(v for k, v in counts.items() if k.startswith("triton"))
    ops = sum(v for k, v in counts.items() if k.startswith("aten"))
    print(f"{args.algorithm} {options} on the {args.path} path, per step of rank 0: "
          f"{launches / args.steps:.1f} Triton launches, {ops / args.steps:.1f} torch ops")
    for name, v in counts.most_common():
        print(f"  {name:<40} {v / args.steps:6.1f}")
    if args.where:
        print("by the lowbit line that issued them:")
        for (name, where), v in sorted(lines.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            print(f"  {where:<48} {name:<36} {v / args.steps:6.1f}")


def _caller() -> str:
    """The innermost frame of the lowbit package on the stack, as path:line."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "/lowbit/" in path:
            return f"{path[path.rindex('/lowbit/') + 1:]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _value(text: str):
    """A command-line option value: a bool, an int, a float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    main()
