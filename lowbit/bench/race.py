"""``lowbit bench race``: time to a target accuracy, real processes on real shaped links, torch's own
``DistributedDataParallel`` as the anchor.

One launch of ``workers`` real processes (:func:`lowbit.comm.launch`, ``backend`` gloo on the CPU,
NCCL where chosen) runs every method (:data:`METHODS`) on every network (:data:`NETWORKS`:
``100Mbit``, ``1Gbit``, ``loopback``) one after the other in the same processes
(:mod:`lowbit.bench.race_worker`), so a process's start-up is paid once. When a shaped network is
in the race each rank sits in its own network namespace behind a ``tc tbf`` link
(:class:`~lowbit.comm.shaping.ShapedNetwork`, the machinery of ``lowbit train --shape-bandwidth``),
and each rank sets its own link to the next network's rate when the network changes
(:func:`~lowbit.bench.race_worker.set_link`); ``loopback`` is then the same links with the tbf taken
off (a veth pair and a bridge in one kernel), and the real loopback interface when no shaped
network runs. Where shaping is unavailable (not root, no ``ip``/``tc``) the shaped networks are
skipped, and said so. No latency is added in user space (``latency_ms`` 0 for every contender:
torch's DDP issues its collectives in C++, where no per-message delay can be added without a hook
that would change the anchor); the links' own delay is what the kernel's veth, bridge and tbf
queue give.

Same conditions for every method: the same initial model (``torch.manual_seed(seed)``), the same
minibatches on each rank (a generator seeded by ``seed`` and the rank, over the rank's iid shard),
SGD with ``momentum`` at a constant learning rate (``lr`` when given, for every method; else the
race's, or a method's own where :data:`METHODS` gives one for the task; reported as ``lr``), ``steps`` steps of ``batch`` samples per rank.

Measured per method and network (JSON keys):

- ``seconds_to_target`` / ``steps_to_target``: the training wall-clock seconds and the steps at the
  first evaluation (every ``eval_every`` steps) where rank 0's accuracy on ``eval_samples`` fixed
  test images reaches ``target``; ``null`` when it never does (:func:`time_to_target`). The clock
  is rank 0's and stops during evaluation (the ranks meet at a barrier, the clock stops, rank 0
  evaluates, the ranks meet again, the clock restarts); a decentralized method is evaluated on the
  average of the workers' models (``averaged_module``, outside the ledger and the clock).
- ``final_accuracy``: the final model's accuracy on the whole test set.
- ``bytes_per_step``: what one rank sends per step. lowbit's methods: the ledger (the hook state's
  ``bytes_sent``, the wrapper's ``stats()``); torch's hooks: every ``torch.distributed.all_reduce``
  their hook issues, counted by a wrapper around that function while the method trains; torch's
  DDP without a hook: one all-reduce of each of DDP's buckets (their sizes from DDP's logging
  data). Every all-reduce of ``m`` bytes counts as the ring's ``2(n-1)/n * m``, as lowbit's ledger
  counts (:func:`lowbit.comm.netmodel.op_messages_and_bytes`).
- ``step_seconds``: the median wall time of a step (end to end, the first ``warmup`` steps left
  out), the slowest rank's; and its split: ``compute_seconds``, the median step of the plain
  module with no communication (forward, backward, optimizer step; timed on every rank at once
  after the method's run); ``encode_decode_seconds``, the process CPU seconds per race step beyond
  the compute-only step's (encoding, decoding, casts, error memory, the backend's copies: CPU work
  the method adds, in any thread); ``comm_wait_seconds``, the rest of the step (waiting for the
  network, and for the CPU where ranks outnumber cores). The split is an estimate from two
  clocks, not a trace. ``compute_cpu_seconds``, the compute-only step's CPU seconds, shows how
  much of ``compute_seconds`` was waiting for a core (on a loaded machine, most of it);
  ``loadavg``, the machine's 1-minute load average when the method started and ended.

A method that fails (its launch dies) is reported with ``failed`` (the reason) and ``null``
figures; the methods after it run in a new launch.

``repeats`` > 1 runs the whole race that many times in the same launch, interleaved: each
repeat runs every network's methods once, in an order rotated by one method per repeat, so that a
change of the machine's load falls on every method alike. A method's row is then its median run
(by ``seconds_to_target``, a run that never reaches the target counting as the slowest; its
curve, step and bytes are that run's), with ``repeats_seconds_to_target`` and
``repeats_step_seconds`` listing every run's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from .table import Column, header_line, row_line
from .timing import check_positive_int

#: network name -> link rate in bits/s (None: unshaped loopback)
NETWORKS: dict[str, float | None] = {"100Mbit": 100e6, "1Gbit": 1e9, "loopback": None}


@dataclass(frozen=True)
class RaceMethod:
    """A contender: ``kind`` ``torch`` (torch DDP, ``hook`` one of torch's hooks or None),
    ``hook`` (torch DDP with lowbit's hook ``hook`` of :func:`~lowbit.integrations.ddp_hooks.make_hook`)
    or ``decentralized`` (:class:`~lowbit.integrations.DecentralizedDataParallel` running
    ``algorithm``, ring); ``options`` go to the hook or the algorithm; ``lr``: the method's own
    learning rate on the tasks it was tuned for (task name -> lr; the race's elsewhere)."""

    kind: str
    description: str
    hook: str | None = None
    algorithm: str | None = None
    options: dict = field(default_factory=dict)
    lr: dict = field(default_factory=dict)


#: PowerSGD's rank, torch's hook and lowbit's alike (``lowbit plan`` assumes it too). At rank 2
#: lowbit's hook reached the target at step 135 and ended 4.6 points below DDP fp32; at rank 4 at
#: step 90, 0.5 below (loopback, seed 0, 2026-11-28: benchmarks/race_sweep.py --option powersgd_rank)
POWERSGD_RANK = 4

#: the race's contenders, by the names ``lowbit plan`` uses too
METHODS: dict[str, RaceMethod] = {
    "torch-ddp-fp32": RaceMethod("torch", "torch DDP, fp32, default buckets and overlap, no hook (the anchor)"),
    "torch-fp16": RaceMethod("torch", "torch DDP + fp16_compress_hook", hook="fp16"),
    "torch-powersgd": RaceMethod("torch", f"torch DDP + powerSGD_hook, rank {POWERSGD_RANK} (error feedback, warm "
                                 "start; on gloo each bucket's future awaited in the hook, see "
                                 "race_worker.powersgd_hook_in_order)",
                                 hook="powersgd"),
    # lr tuned on the full race's task, loopback, 150 steps (2026-11-27): 0.05 (the race's) fell to
    # chance, 0.01 reached 0.80 at step 120 (0.826 at 150), 0.003 reached 0.754 at 150
    "lowbit-qsgd-maxnorm-2": RaceMethod("hook", "DDP + lowbit QSGDMaxNorm hook, 2 bits", hook="qsgd-maxnorm",
                                        options={"bits": 2}, lr={"fashion-lenet-tf": 0.01}),
    # one norm per 64 coordinates, not the hook's default 512 (QSGD's d): final accuracy minus DDP
    # fp32's over seeds 0, 1, 2 was -1.8, +1.3, -1.2 points at 512, +0.3, +1.0, -1.0 at 128, +0.5,
    # +0.5, -0.6 at 64, +0.7, -0.1, 0.0 at 32 (loopback, lr 0.05, 2026-11-28: benchmarks/race_sweep.py
    # --method lowbit-qsgd-maxnorm-4 --option bucket --values 512,128,64,32); the norms cost 0.5 bit
    # per coordinate at 64
    "lowbit-qsgd-maxnorm-4": RaceMethod("hook", "DDP + lowbit QSGDMaxNorm hook, 4 bits, one norm per 64 "
                                        "coordinates", hook="qsgd-maxnorm", options={"bits": 4, "bucket": 64}),
    "lowbit-multiscale": RaceMethod("hook", "DDP + lowbit multi-scale max-norm hook (scales 2, 6)",
                                    hook="qsgd-maxnorm-multiscale"),
    "lowbit-fp16": RaceMethod("hook", "DDP + lowbit fp16 hook", hook="fp16"),
    "lowbit-powersgd": RaceMethod("hook", f"DDP + lowbit PowerSGD hook (error feedback), rank {POWERSGD_RANK}",
                                  hook="powersgd", options={"powersgd_rank": POWERSGD_RANK}),
    "moniqua-2": RaceMethod("decentralized", "Moniqua, 2 bits, ring (DecentralizedDataParallel)",
                            algorithm="moniqua", options={"bits": 2}),
    # not hierarchical: every rank is a host behind its own link (Bagua's default, hierarchical,
    # would average all the ranks of this one machine in fp32 first: DDP's bytes exactly)
    "lowprec": RaceMethod("decentralized", "Bagua's low-precision decentralized SGD (8-bit min-max), ring, "
                          "each rank its own node (DecentralizedDataParallel)", algorithm="lowprec-decentralized",
                          options={"hierarchical": False}),
    "choco": RaceMethod("decentralized", "CHOCO-SGD, ring (DecentralizedDataParallel)", algorithm="choco"),
}

#: untimed steps each method first runs on a throwaway model (kernel compilation, first calls)
JIT_STEPS = 3

#: the settings of the full race and of ``--quick``
FULL = dict(task="fashion-lenet-tf", workers=4, steps=150, eval_every=15, target=0.8, batch=32, lr=0.05,
            eval_samples=1000)
QUICK = dict(task="digits-mlp", workers=2, steps=60, eval_every=10, target=0.95, batch=32, lr=0.1, eval_samples=1000,
             task_options={"hidden": 1024})


def time_to_target(curve, target: float) -> tuple[float | None, int | None]:
    """``(seconds, steps)`` at the first point ``(step, seconds, accuracy)`` of ``curve`` (in
    step order) whose accuracy is at least ``target``; ``(None, None)`` when none is. Points whose
    accuracy is None (not evaluated) are skipped."""
    if not (isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target <= 1):
        raise ValueError(f"target must be an accuracy in (0, 1], got {target!r}")
    prev = -1
    for step, seconds, acc in curve:
        if step < prev:
            raise ValueError(f"curve must be in step order, got step {step} after {prev}")
        prev = step
        if acc is not None and acc >= target:
            return float(seconds), int(step)
    return None, None


def _names(value, known, what: str) -> list[str]:
    if value is None or value == "all":
        return list(known)
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(v).strip() for v in items if str(v).strip()]
    bad = [v for v in names if v not in known]
    if bad or not names:
        raise ValueError(f"{what} must be 'all' or comma-separated names from {', '.join(known)}; got {value!r}")
    return list(dict.fromkeys(names))


def _check_lr(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _settings(quick: bool, task_options, given: dict) -> tuple[dict, dict]:
    """The race's settings: the ``given`` ones, the preset's (:data:`FULL` or :data:`QUICK`) for
    those unset; and the task's options (the preset's go with the preset's task only)."""
    base = dict(QUICK if quick else FULL)
    preset_options = dict(base.pop("task_options", {}))
    if task_options is None:
        task_options = preset_options if given["task"] in (None, base["task"]) else {}
    if not isinstance(task_options, dict):
        raise ValueError(f"task_options must be a dict of the task's keyword arguments, got {task_options!r}")
    return {k: (v if v is not None else base[k]) for k, v in given.items()}, task_options


def _check_settings(s: dict, task_options: dict, compute_steps, warmup, momentum, backend, seed) -> int:
    """Check the settings before any process starts (the task's data set on disk included);
    the warm-up steps (default ``min(5, steps // 4)``)."""
    from ..train.tasks import TASKS

    if s["task"] not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {s['task']!r}")
    if not getattr(TASKS[s["task"]], "classification", False):
        raise ValueError(f"task must be a classification task (the race times an accuracy), got {s['task']!r}")
    if isinstance(getattr(TASKS[s["task"]], "dataset", None), str):  # a data set on disk: say so before starting
        from ..data import find_dataset_dir

        find_dataset_dir(TASKS[s["task"]].dataset, (task_options or {}).get("data_dir"))
    check_positive_int(s["workers"], "workers", 2)
    check_positive_int(s["steps"], "steps", 2)
    check_positive_int(s["eval_every"], "eval_every")
    check_positive_int(s["batch"], "batch")
    check_positive_int(s["eval_samples"], "eval_samples")
    check_positive_int(compute_steps, "compute_steps", 2)
    if warmup is None:
        warmup = min(5, s["steps"] // 4)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < s["steps"]:
        raise ValueError(f"warmup must be an integer in [0, steps) = [0, {s['steps']}), got {warmup!r}")
    time_to_target([], s["target"])  # checks target
    _check_lr(s["lr"], "lr")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return warmup


def _runnable(nets: list[str], why: str | None, report: dict) -> list[str]:
    """The networks that run (a shaped one is skipped, with why, where shaping is unavailable);
    ``report["shaping"]`` says how the links are shaped."""
    runnable = []
    for net in nets:
        if NETWORKS[net] is not None and why is not None:
            report["skipped_networks"][net] = f"real shaping unavailable: {why}"
        else:
            runnable.append(net)
    shaped = any(NETWORKS[n] is not None for n in runnable)
    if not shaped:
        report["shaping"] = "none: loopback only" + (f" (shaping unavailable: {why})" if why else "")
    elif "loopback" in runnable:
        report["shaping"] += "; loopback: the same links with the tbf taken off"
    return runnable


def bench_race(task: str | None = None, workers: int | None = None, networks=None, methods=None,
               steps: int | None = None, eval_every: int | None = None, target: float | None = None,
               batch: int | None = None, lr: float | None = None, momentum: float = 0.9, quick: bool = False,
               backend: str = "gloo", seed: int = 0, warmup: int | None = None, compute_steps: int = 5,
               eval_samples: int | None = None, task_options: dict | None = None, plot_dir: str | None = None,
               progress=print, repeats: int = 1) -> dict:
    """Run the race (module doc) and return its report: ``{"networks": {NETWORK: {METHOD: {...}}},
    "settings": {...}, "methods": {...}, "shaping": ...}``. Unset arguments take the full race's
    settings (:data:`FULL`), or ``--quick``'s (:data:`QUICK`) with ``quick``. ``plot_dir``: write
    ``race-NETWORK.png`` (accuracy against training seconds) there. ``progress``: a callable taking
    one line of text (None: silent). ``warmup``: the first steps left out of ``step_seconds``
    (default ``min(5, steps // 4)``). ``task_options``: keyword arguments of the task (default: the
    preset's, e.g. ``--quick``'s MLP width, when its task is the preset's). ``repeats``: runs of
    each method on each network, interleaved; a row is the median run (module doc)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    s, task_options = _settings(quick, task_options, dict(
        task=task, workers=workers, steps=steps, eval_every=eval_every, target=target, batch=batch, lr=lr,
        eval_samples=eval_samples))
    warmup = _check_settings(s, task_options, compute_steps, warmup, momentum, backend, seed)
    nets = _names(networks, list(NETWORKS), "networks")
    chosen = _names(methods, list(METHODS), "methods")
    say = progress or (lambda line: None)

    from ..comm.shaping import shaping_unavailable_reason

    why = shaping_unavailable_reason() if any(NETWORKS[n] is not None for n in nets) else None
    if why is not None:
        say(f"race: real shaping is unavailable ({why}): the shaped networks are SKIPPED, only loopback runs")
    specs = {}
    for name in chosen:
        m = METHODS[name]
        specs[name] = {"kind": m.kind, "hook": m.hook, "algorithm": m.algorithm, "options": dict(m.options),
                       "lr": float(m.lr.get(s["task"], s["lr"]) if lr is None else s["lr"])}
    cfg = dict(task=s["task"], task_options=task_options, steps=s["steps"], eval_every=s["eval_every"],
               batch=s["batch"], momentum=float(momentum), seed=seed, warmup=warmup, compute_steps=compute_steps,
               eval_samples=s["eval_samples"], powersgd_rank=POWERSGD_RANK, powersgd_start=2, jit_steps=JIT_STEPS)
    report = {"benchmark": "race", "settings": {**s, "task_options": task_options, "momentum": momentum,
                                                "backend": backend, "seed": seed, "warmup": warmup,
                                                "compute_steps": compute_steps, "latency_ms": 0.0, "untimed_warmup_steps": JIT_STEPS,
                                                "powersgd_rank": POWERSGD_RANK, "torch_powersgd_start_iter": 2,
                                                "schedule": "constant learning rate", "optimizer": "SGD + momentum",
                                                "quick": quick, "cpu_count": os.cpu_count(),
                                                "loadavg_start": _loadavg()},
              "methods": {n: {"description": METHODS[n].description, "lr": specs[n]["lr"]} for n in chosen},
              "shaping": why or "tc tbf per rank (network namespaces)", "networks": {}, "skipped_networks": {}}
    runnable = _runnable(nets, why, report)
    shaped = any(NETWORKS[n] is not None for n in runnable)
    t0 = time.perf_counter()
    say(f"race: {', '.join(runnable)}: {len(chosen)} methods on {s['workers']} {backend} processes ...")
    report["settings"]["repeats"] = repeats
    records = _race(runnable, s["workers"], backend, cfg, specs, shaped, say, repeats)
    report["wall_seconds"] = time.perf_counter() - t0
    for net in runnable:
        report["networks"][net] = {name: _median_run([_summarise(records[net, name, r], s["target"])
                                                      for r in range(repeats)]) for name in chosen}
        if repeats > 1 and "torch-ddp-fp32" in chosen:  # the median of the per-repeat ratios
            anchor = report["networks"][net]["torch-ddp-fp32"]["repeats_seconds_to_target"]
            for row in report["networks"][net].values():
                ratios = [a / t for a, t in zip(anchor, row["repeats_seconds_to_target"]) if a and t]
                row["x_ddp_median"] = statistics.median(ratios) if len(ratios) == repeats else None
        if plot_dir is not None:
            report.setdefault("plots", {})[net] = str(plot_race(report, net, plot_dir))
    report["settings"]["loadavg_end"] = _loadavg()
    return report


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _median_run(rows: list[dict]) -> dict:
    """The median of one method's runs on one network by seconds to the target (a run that never
    reaches it, or failed, the slowest), with every run's seconds to target and step seconds."""
    if len(rows) == 1:
        return rows[0]
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["seconds_to_target"] is None, rows[i]["seconds_to_target"]
                                                   or 0.0, rows[i].get("failed") is not None))
    out = dict(rows[order[(len(rows) - 1) // 2]])
    out["repeats_seconds_to_target"] = [r["seconds_to_target"] for r in rows]
    out["repeats_step_seconds"] = [r["step_seconds"] for r in rows]
    return out


def _race(nets: list[str], workers: int, backend: str, cfg: dict, specs: dict, shaped: bool, say,
          repeats: int = 1) -> dict:
    """Every ``(network, method, repeat)``'s per-rank records, from one launch (shaped: each rank
    in its namespace, its link set to each network's rate in turn), or more when a method fails:
    a failed run is recorded with the launch's reason and the runs after it go on in a new
    launch. Each repeat runs every network's methods, their order rotated by the repeat."""
    from ..comm import launch
    from ..comm.liveness import WorkerDied, WorkerFailed, WorkerStalled

    records: dict[tuple[str, str, int], dict] = {}
    names = list(specs)
    remaining = [(net, name, r) for r in range(repeats) for net in nets
                 for name in names[r % len(names):] + names[:r % len(names)]]
    while remaining:
        tmp = tempfile.mkdtemp(prefix="lowbit-race-")
        try:
            run_cfg = {**cfg, "methods": specs, "record_dir": tmp, "shaped": shaped,
                       "runs": [(net, NETWORKS[net], name, r) for net, name, r in remaining]}
            failure = None
            try:
                if not shaped:
                    launch(workers, _worker_entry, run_cfg, backend=backend)
                else:
                    from ..comm.shaping import ShapedNetwork

                    first = next((NETWORKS[n] for n, _, _ in remaining if NETWORKS[n] is not None), 1e9)
                    with ShapedNetwork(workers, first) as net:
                        launch(workers, _worker_entry, run_cfg, backend=backend, network=net)
            except (WorkerFailed, WorkerDied, WorkerStalled) as e:
                failure = e
            for key in list(remaining):
                per_rank = _read_records(tmp, ".".join(map(str, key)), workers)
                if per_rank is not None:
                    records[key] = {"ranks": per_rank}
                    remaining.remove(key)
            if failure is not None:
                started = [k for k in remaining if any(os.path.exists(
                    os.path.join(tmp, f"{'.'.join(map(str, k))}.rank{r}.started")) for r in range(workers))]
                if not started:  # the launch failed before any method: nothing to blame on a method
                    raise failure
                bad = started[0]
                reason = _first_line(failure)
                records[bad] = {"failed": reason}
                remaining.remove(bad)
                say(f"  {bad[0]} {bad[1]}: FAILED: {reason}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return records


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e.__cause__
    text = str(cause) if cause is not None else (getattr(e, "error", "") or str(e))
    return text.strip().splitlines()[-1][:500] if text.strip() else type(e).__name__


def _worker_entry(transport, cfg):
    from .race_worker import race_worker

    return race_worker(transport, cfg)


def _read_records(folder: str, name: str, workers: int) -> list[dict] | None:
    """The per-rank JSON records of ``name`` (written by this race's own workers), or None."""
    out = []
    for r in range(workers):
        path = os.path.join(folder, f"{name}.rank{r}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            out.append(json.load(f))
    return out


def _summarise(rec: dict, target: float) -> dict:
    """One method's row on one network from its per-rank records."""
    if "failed" in rec:
        return {"seconds_to_target": None, "steps_to_target": None, "final_accuracy": None, "bytes_per_step": None,
                "step_seconds": None, "failed": rec["failed"]}
    ranks = rec["ranks"]
    r0 = ranks[0]
    secs, steps = time_to_target(r0["curve"], target)
    step_s = max(r["step_seconds"] for r in ranks)
    compute = max(r["compute_seconds"] for r in ranks)
    codec = max(max(r["cpu_seconds_per_step"] - r["compute_cpu_seconds"], 0.0) for r in ranks)
    codec = min(codec, max(step_s - compute, 0.0))
    out = {"seconds_to_target": secs, "steps_to_target": steps, "final_accuracy": r0["final_accuracy"],
           "bytes_per_step": statistics.mean(r["bytes_per_step"] for r in ranks), "step_seconds": step_s,
           "compute_seconds": compute, "compute_cpu_seconds": max(r["compute_cpu_seconds"] for r in ranks),
           "encode_decode_seconds": codec,
           "comm_wait_seconds": max(step_s - compute - codec, 0.0),
           "train_seconds": r0["train_seconds"], "lr": r0["lr"],
           "curve": [{"step": k, "seconds": t, "accuracy": a} for k, t, a in r0["curve"]]}
    for extra in ("fp32_bytes_per_step", "loadavg"):
        if extra in r0:
            out[extra] = r0[extra]
    return out


def plot_race(report: dict, network: str, folder: str):
    """``folder/race-NETWORK.png``: each method's accuracy against training wall-clock seconds on
    ``network``, the target as a dashed line. Returns the path."""
    from ..plot import plot_series

    rows = report["networks"][network]
    shown = [m for m, r in rows.items() if r.get("curve")]
    series = [(m, [p["seconds"] for p in rows[m]["curve"]], [p["accuracy"] for p in rows[m]["curve"]])
              for m in shown]
    # torch's contenders dashed, lowbit's hooks solid, the decentralized methods dotted; the anchor black
    dash = {"torch": "--", "hook": "-", "decentralized": ":"}
    styles = [{"linestyle": dash.get(METHODS[m].kind, "-") if m in METHODS else "-",
               **({"color": "black"} if m == "torch-ddp-fp32" else {})} for m in shown]
    st = report["settings"]
    return plot_series(series, "training wall-clock seconds (evaluation excluded)", "test accuracy",
                       os.path.join(folder, f"race-{network}.png"),
                       hlines=[(f"target {st['target']:g}", float(st["target"]))],
                       title=f"{st['task']}, {st['workers']} workers, {network}", styles=styles)


def _ms(key: str):
    return lambda r: None if r[key] is None else 1e3 * r[key]


_RACE_COLUMNS = (
    Column("method", 24, "method", left=True), Column("lr", 6, "lr", "g"),
    Column("s to target", 11, "seconds_to_target", ".1f", missing="never"), Column("x ddp", 6, "x_ddp", ".2f"),
    Column("steps", 6, "steps_to_target", "d"), Column("final acc", 9, "final_accuracy", ".4f"),
    Column("MB/step", 9, lambda r: r["bytes_per_step"] / 1e6, ".3f"), Column("step ms", 8, _ms("step_seconds"), ".1f"),
    Column("compute", 8, _ms("compute_seconds"), ".1f"), Column("enc/dec", 8, _ms("encode_decode_seconds"), ".1f"),
    Column("comm wait", 9, _ms("comm_wait_seconds"), ".1f"),
    Column("load", 10, lambda r: "-".join("-" if v is None else f"{v:.1f}" for v in r.get("loadavg") or ()) or "-"))


def format_race_report(report: dict) -> str:
    """The report of :func:`bench_race` as the table ``lowbit bench race`` prints."""
    st = report["settings"]
    lines = [f"race: {st['task']}, {st['workers']} {st['backend']} processes, {st['steps']} steps of batch "
             f"{st['batch']} per rank, SGD momentum {st['momentum']}, constant lr; target accuracy {st['target']} "
             f"(evaluated every {st['eval_every']} steps on {st['eval_samples']} test images; final accuracy on the "
             f"whole test set); latency added: {st['latency_ms']} ms; shaping: {report['shaping']}; "
             f"load average at start {st['loadavg_start']}, at end {st.get('loadavg_end')} on {st['cpu_count']} CPUs"]
    for net, rows in report["networks"].items():
        anchor = rows.get("torch-ddp-fp32", {}).get("seconds_to_target")
        lines.append(f"\n{net}" + ("" if anchor is None else f"  (torch-ddp-fp32 reaches the target in {anchor:.1f} s)"))
        lines.append(header_line(_RACE_COLUMNS))
        for m, r in rows.items():
            if r.get("failed"):
                lines.append(f"{m:<24} FAILED: {r['failed']}")
                continue
            x = None if anchor is None or r["seconds_to_target"] is None else anchor / r["seconds_to_target"]
            lines.append(row_line(_RACE_COLUMNS, {**r, "method": m, "x_ddp": r.get("x_ddp_median", x)}))
            if r.get("repeats_seconds_to_target"):
                lines.append(f"{'':<24} runs' s to target: " + ", ".join(
                    "-" if t is None else f"{t:.1f}" for t in r["repeats_seconds_to_target"]))
    for net, why in report.get("skipped_networks", {}).items():
        lines.append(f"{net}: SKIPPED ({why})")
    lines.append("x ddp: torch-ddp-fp32's seconds to target / the method's (above 1: sooner; with --repeats, "
                 "the median of the runs' ratios, - where a run missed the target, and each row the method's "
                 "median run). step ms: median step, "
                 "slowest rank; compute: the same step with no communication; enc/dec: CPU seconds per step beyond "
                 "compute's; comm wait: the rest; load: the machine's load average when the method started and ended.")
    return "\n".join(lines)
