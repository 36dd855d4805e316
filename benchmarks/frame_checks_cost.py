"""What issue 32's frame checks cost the codecs' fast path: each codec's encode and decode in
the tree before the checks against the tree after them, side by side.

Run (from the repository root; the "before" tree is a worktree of the commit before the
checks, made once)::

    git worktree add /work/before 6883a07
    python benchmarks/frame_checks_cost.py --before /work/before            # every case, 7 rounds
    python benchmarks/frame_checks_cost.py --before /work/before --codecs modulo,powersgd --rounds 9
    python benchmarks/frame_checks_cost.py --before /work/before --after /work/before   # A/A: the method's error
    python benchmarks/frame_checks_cost.py --size 1000 --min-run-time 0.02            # the fixed costs

Method. Each tree's ``lowbit`` runs in its own worker process (``sys.path`` puts that tree
first; the worker checks ``lowbit.__file__`` is inside it), with one torch thread
(:func:`lowbit.bench.timing.pinned_threads`) and ``NUMBA_NUM_THREADS=1``. Both workers build the
same cases, with :mod:`lowbit.bench.codecs`'s calls (``default_cases``, ``bench_data``,
``codec_calls``: the data and generators ``lowbit bench codecs`` uses) plus the codecs that list
leaves out (Bagua's min-max, entropy coding) and Moniqua's paths (``decode_hashed``, the fused
send and receive of :class:`lowbit.algorithms.moniqua.frame.ModuloFrame`). Each timing is
:func:`lowbit.bench.timing.measure` (``blocked_autorange`` median of the thread's CPU time, so
the time other processes take the core is not counted). Round by round, every (case, operation)
is timed in one worker and then at once in the other (which goes first alternates), a ratio
after / before is taken inside the round, and the table reports the median of the per-round
ratios (:func:`lowbit.bench.timing.median_ratio`) with their smallest and largest
(:func:`lowbit.bench.timing.spread`), and each side's median milliseconds. The load average is
printed before and after: the machine may be shared, which the interleaving makes fair but
noisier. An A/A run (the same tree on both sides) shows how far the harness itself reads
from 1.0 on the machine at hand: on the project's loaded 2-core machine, calls under ~0.4 ms
read up to 1.26 with identical code (each worker keeps its own allocator state and memory
layout), longer ones within 0.97-1.07 (docs/CHANGELOG.md, issue 32).

Workers talk to the driver in JSON lines (no pickle).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ---- the worker: one tree's lowbit ----------------------------------------------------------

def _worker_cases(size: int) -> dict[str, dict]:
    """{label: {operation: call}} for every case, built with this process's ``lowbit``."""
    import torch

    from lowbit import codecs as c
    from lowbit.bench.codecs import THETA, BenchCase, bench_data, codec_calls, default_cases
    from lowbit.codecs import CodecKind
    from lowbit.codecs.kernels import kernels_for
    from lowbit.algorithms.moniqua.frame import ModuloFrame

    seed = 0
    dev = torch.device("cpu")
    x, ref = bench_data(size, dev, seed)
    cases = default_cases(size)
    cases += [BenchCase(c.BaguaMinMaxCodec.name, c.BaguaMinMaxCodec),
              BenchCase(f"{c.EntropyCodedCodec.name} bz2 {c.MinMaxCodec.name} b=2",
                        lambda: c.EntropyCodedCodec(c.MinMaxCodec(bits=2))),
              BenchCase(f"{c.EntropyCodedCodec.name} ans {c.QSGDMaxNormCodec.name} b=2",
                        lambda: c.EntropyCodedCodec(c.QSGDMaxNormCodec(bits=2), method="ans"))]
    out: dict[str, dict] = {}
    for case in cases:
        codec = case.make()
        enc, dec, payload = codec_calls(codec, x, ref, seed, dev, "fast", case.decode_out)
        out[case.label] = {"encode": enc, "decode": dec}
        if isinstance(codec, c.ModuloCodec) and codec.kind is CodecKind.SIDE_INFO:
            out[case.label]["decode_hashed"] = (lambda codec=codec, payload=payload:
                                                codec.decode_hashed(payload, ref=ref, block=1024))
    # Moniqua's fused send and receive (the gossip's one-call kernels), 2 and 4 bits
    for bits in (2, 4):
        codec = c.ModuloCodec(bits=bits, theta=THETA)
        frame = ModuloFrame(bits=bits, block=1024, verify=True, entropy=None, peers=2, rank=0)
        K = frame.kernels(ref, torch.float32)
        if K is None:
            continue
        gen = lambda: c.shared_generator(seed, 0, 0)  # noqa: E731
        msg, x_hat_i = frame.send(codec, x, gen(), {}, K)
        delta = torch.zeros_like(ref)

        def receive(codec=codec, frame=frame, msg=msg, x_hat_i=x_hat_i, K=K, delta=delta):
            delta.zero_()
            return frame.receive(codec, {1: msg}, ref, K, v=None, x_hat_i=x_hat_i, w={1: 0.5}, delta=delta)

        out[f"moniqua fused b={bits}"] = {
            "send": lambda codec=codec, frame=frame, K=K: frame.send(codec, x, gen(), {}, K),
            "receive": receive}
    return out


def selected(label: str, codecs: list[str] | None) -> bool:
    """Whether ``--codecs`` (families, the first word of a label, or whole labels) takes ``label``."""
    return codecs is None or label.split()[0] in codecs or label in codecs


def worker(tree: str, size: int, min_run_time: float, codecs: list[str] | None = None) -> None:
    """Serve timings of ``tree``'s lowbit on stdin/stdout, one JSON object a line (only the
    cases ``codecs`` selects are built and warmed)."""
    sys.path.insert(0, tree)
    import torch

    import lowbit
    from lowbit.bench.timing import measure, pinned_threads

    where = os.path.realpath(lowbit.__file__)
    if not where.startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"worker for {tree} imported lowbit from {where}")
    dev = torch.device("cpu")
    with pinned_threads(1) as threads:
        cases = {k: v for k, v in _worker_cases(size).items() if selected(k, codecs)}
        for ops in cases.values():  # compile and warm every kernel before the first timing
            for fn in ops.values():
                fn()
        print(json.dumps({"lowbit": where, "threads": threads,
                          "cases": {k: list(v) for k, v in cases.items()}}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            if req.get("cmd") == "quit":
                return
            fn = cases[req["label"]][req["op"]]
            print(json.dumps({"s": measure(fn, dev, min_run_time, threads, "cpu")}), flush=True)


# ---- the driver ---------------------------------------------------------------------------------

class Worker:
    """One tree's worker process."""

    def __init__(self, tree: str, size: int, min_run_time: float, codecs: list[str] | None = None):
        env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", tree, "--size", str(size),
                                      "--min-run-time", str(min_run_time)]
                                     + (["--codecs", ",".join(codecs)] if codecs else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd="/")

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.tree} ended (exit {self.proc.wait()})")
        return json.loads(line)

    def time(self, label: str, op: str) -> float:
        self.proc.stdin.write(json.dumps({"cmd": "time", "label": label, "op": op}) + "\n")
        self.proc.stdin.flush()
        return self.read()["s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=60)


def run(before: str, after: str, size: int, rounds: int, min_run_time: float, codecs: list[str] | None) -> dict:
    """Time every selected (case, operation) in both trees, ``rounds`` interleaved rounds."""
    from lowbit.bench.timing import median_ratio, spread  # the driver's (the after tree's) helpers

    load_start = os.getloadavg()
    workers = {side: Worker(tree, size, min_run_time, codecs) for side, tree in (("before", before), ("after", after))}
    try:
        info = {k: w.read() for k, w in workers.items()}
        common = [(label, op) for label, ops in info["before"]["cases"].items()
                  for op in ops if op in info["after"]["cases"].get(label, ())]
        if codecs:
            unknown = [n for n in codecs if not any(selected(label, [n]) for label, _ in common)]
            if unknown:
                raise SystemExit(f"--codecs: no case is named {unknown} (a family is a label's first word: fp32, "
                                 "modulo, dithered, ...; or give a whole label)")
        timings: dict[tuple[str, str], list[dict]] = {key: [] for key in common}
        loads = []
        t0 = time.time()
        for r in range(rounds):
            for i, key in enumerate(common):
                order = ("before", "after") if (r + i) % 2 == 0 else ("after", "before")
                timings[key].append({side: workers[side].time(*key) for side in order})
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{rounds} done at {time.time() - t0:.0f} s, load {loads[-1]:.2f}",
                  file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for (label, op), rs in timings.items():
        lo, hi = spread(rs, "after", "before")
        rows.append({"case": label, "op": op, "ratio": median_ratio(rs, "after", "before"), "min": lo, "max": hi,
                     "before_ms": 1e3 * statistics.median(t["before"] for t in rs),
                     "after_ms": 1e3 * statistics.median(t["after"] for t in rs), "rounds": rs})
    return {"size": size, "rounds": rounds, "min_run_time": min_run_time, "before": info["before"]["lowbit"],
            "after": info["after"]["lowbit"], "threads": info["after"]["threads"], "load_start": load_start,
            "load_per_round": loads, "cpus": os.cpu_count(), "rows": rows}


def format_report(rep: dict) -> str:
    """The report as a table: after / before per (case, operation)."""
    lines = [f"{rep['size']} fp32 elements, {rep['threads']} torch thread, NUMBA_NUM_THREADS=1, {rep['rounds']} "
             f"interleaved rounds; median of per-round ratios after/before (thread CPU time, blocked_autorange, "
             f"min_run_time {rep['min_run_time']} s)",
             f"before: {rep['before']}", f"after:  {rep['after']}",
             f"load average at start {rep['load_start'][0]:.2f} on {rep['cpus']} CPUs; after each round: "
             + " ".join(f"{v:.2f}" for v in rep["load_per_round"]),
             f"{'case':<30} {'op':<14} {'after/before':>12} {'range':>13} {'before ms':>10} {'after ms':>10}"]
    for r in rep["rows"]:
        flag = "  <-- above 1.02" if r["ratio"] > 1.02 else ""
        span = f"{r['min']:.3f}-{r['max']:.3f}"
        lines.append(f"{r['case']:<30} {r['op']:<14} {r['ratio']:>12.3f} {span:>13} {r['before_ms']:>10.3f} "
                     f"{r['after_ms']:>10.3f}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The command line (module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default="/work/before", help="the tree before the frame checks (a worktree of 6883a07)")
    p.add_argument("--after", default=REPO, help="the tree after them (default: this repository)")
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--min-run-time", type=float, default=0.05)
    p.add_argument("--codecs", default=None, help="comma-separated families or labels (default: all)")
    p.add_argument("--json", default=None, help="also write the report, with every round's timings, here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.size < 1 or a.rounds < 1 or not a.min_run_time > 0:
        raise SystemExit("--size and --rounds must be >= 1 and --min-run-time > 0")
    if a.worker:
        worker(a.worker, a.size, a.min_run_time, [n.strip() for n in a.codecs.split(",")] if a.codecs else None)
        return
    for t in (a.before, a.after):
        if not os.path.isfile(os.path.join(t, "lowbit", "__init__.py")):
            raise SystemExit(f"{t} holds no lowbit package (make the before tree with: git worktree add {a.before} "
                             "6883a07)")
    codecs = [n.strip() for n in a.codecs.split(",") if n.strip()] if a.codecs else None
    rep = run(os.path.abspath(a.before), os.path.abspath(a.after), a.size, a.rounds, a.min_run_time, codecs)
    print(format_report(rep))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
