"""``lowbit plan``'s predictions from a :class:`~lowbit.plan.profile.Profile` (:func:`predict`),
the whole plan (:func:`plan`), and its report as text and plots."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ..comm.netmodel import NetworkModel, overlap_backward, parse_bandwidth, parse_latency
from .hooks import _rec
from .measure import measure
from .methods import (BASELINE, DDP_METHODS, DEFAULT_BANDWIDTHS, DEFAULT_LATENCY, DEFAULT_WORKERS, GOSSIP_METHODS,
                      GOSSIP_RING, METHODS, POWERSGD_RANK, _check_workers)
from .profile import Profile, _device
from .rounds import RoundCosts, calibrate, ddp_rounds, method_steps, step_seconds
from .workload import load_workload


def _ddp_prediction(p: Profile, m: str, n: int, net: NetworkModel, costs: RoundCosts | None) -> dict:
    ops = p.hook_ops[m][n]
    f = 1.0 if costs is None else costs.compute_factor
    compute = [f * c for c in p.hook_seconds[m]]
    flat = [op for bops in ops for op in bops]
    secs = iter(step_seconds(m, ddp_rounds(m, flat), n, net, costs))
    rows, sent, comm_total = [], 0, 0.0
    for b, c, bops in zip(p.buckets, compute, ops):
        timed = [(k, next(secs)) for k, _ in bops]
        sync = math.fsum(t for k, t in timed if k == "sync")
        comm = math.fsum(t for k, t in timed if k == "async")
        sent += sum(r.sent_bytes for _, r in bops)
        comm_total += sync + comm
        rows.append((f * b.ready_seconds, c, sync, comm))
    fwd, bwd, opt = f * p.forward_seconds, f * p.backward_seconds, f * p.optimizer_seconds
    bwd_end, comm_end = overlap_backward(bwd, rows)
    step = fwd + max(bwd_end, comm_end) + opt
    compute_total = math.fsum(compute)
    return {"step_seconds": step, "bytes_per_step": sent, "method_compute_seconds": compute_total,
            "comm_seconds": comm_total, "exposed_comm_seconds": step - (fwd + bwd + opt + compute_total)}


def _gossip_prediction(p: Profile, m: str, n: int, net: NetworkModel, costs: RoundCosts | None) -> dict:
    g = p.gossip[m][min(n, GOSSIP_RING)]
    steps = g["records"]
    f = 1.0 if costs is None else costs.compute_factor
    if g.get("rounds"):  # every call of the step, the ledger's and the untracked ones
        comm = statistics.fmean(math.fsum(step_seconds(m, rs, n, net, costs)) for rs in g["rounds"])
    else:
        comm = statistics.fmean(net.step_seconds(r, n) for r in steps) if steps else 0.0
    sent = statistics.fmean(sum(_rec(r.op, r.nbytes, n, r.peers).sent_bytes for r in recs) for recs in steps) \
        if steps else 0.0
    base = f * (p.forward_seconds + p.backward_seconds + p.optimizer_seconds)
    overhead = f * g["overhead_seconds"]
    return {"step_seconds": base + overhead + comm, "bytes_per_step": sent,
            "method_compute_seconds": overhead, "comm_seconds": comm, "exposed_comm_seconds": comm}


def predict(p: Profile, workers: Sequence[int], bandwidths: Sequence, latencies: Sequence,
            min_speedup: float = 1.1, costs: RoundCosts | None = None) -> list[dict]:
    """Predicted step time of every measured method for each number of ``workers``, bandwidth
    and latency: one row per setting, ``{"workers", "bandwidth", "latency_s", "methods":
    {method: {"step_seconds", "speedup", ...}}, "recommendation"}``. ``speedup`` is fp32 DDP's
    predicted step over the method's; the recommendation is the fastest method when its speedup
    is at least ``min_speedup``, else ``torch-ddp-fp32``. ``costs``: a calibration of this host's
    transport (:func:`~lowbit.plan.rounds.calibrate`): each round then costs the network model's
    time plus what the calibration measured beyond it, and compute is scaled by its factor."""
    if not (isinstance(min_speedup, (int, float)) and math.isfinite(min_speedup) and min_speedup >= 1):
        raise ValueError(f"min_speedup must be a number >= 1, got {min_speedup!r}")
    workers = _check_workers(workers)
    methods = [m for m in METHODS if m in p.hook_ops or m in p.gossip]
    missing = [n for n in workers if any(n not in p.hook_ops[m] for m in p.hook_ops)]
    if missing:
        raise ValueError(f"workers {missing} were not measured (measure with them: the integer width depends on them)")
    rows = []
    for bw in bandwidths:
        for lat in latencies:
            net = NetworkModel(parse_bandwidth(bw), parse_latency(lat))
            for n in workers:
                res = {m: (_ddp_prediction(p, m, n, net, costs) if m in DDP_METHODS
                           else _gossip_prediction(p, m, n, net, costs))
                       for m in methods}
                base = res[BASELINE]["step_seconds"]
                for r in res.values():
                    r["speedup"] = base / r["step_seconds"]
                best = min(methods, key=lambda m: res[m]["step_seconds"])
                rec = best if res[best]["speedup"] >= min_speedup else BASELINE
                rows.append({"workers": n, "bandwidth": str(bw), "bandwidth_bit_s": net.bandwidth,
                             "latency_s": net.latency, "methods": res, "recommendation": rec})
    return rows


def plan(task: str | None = None, model: str | None = None, device: str = "cpu", workers=DEFAULT_WORKERS,
         bandwidths=DEFAULT_BANDWIDTHS, latencies=(DEFAULT_LATENCY,), batch_size: int | None = None,
         repeats: int = 5, warmup: int = 2, threads: int | None = None, methods=METHODS, min_speedup: float = 1.1,
         seq_len: int | None = None, processes: int | None = None) -> dict:
    """Measure the model's step on ``device`` and predict every method's step time on each
    setting (see the module doc); the report :func:`format_plan_report` prints and ``--json``
    writes: ``{"measured": ..., "settings": [...], "assumptions": [...], "not_modelled": [...]}``.
    ``processes``: worker processes that share this host's cores (CPU only); given, each
    method's step is replayed on that many gloo processes over loopback
    (:func:`~lowbit.plan.rounds.calibrate`) and the prediction adds what each round took there
    beyond the network model, and scales compute by the measured factor (``"calibration"``)."""
    if isinstance(bandwidths, str):
        bandwidths = [b for b in bandwidths.split(",") if b.strip()]
    if isinstance(latencies, str):
        latencies = [x for x in latencies.split(",") if x.strip()]
    bandwidths, latencies = list(bandwidths), list(latencies)
    if not bandwidths or not latencies:
        raise ValueError("bandwidths and latencies must each hold at least one value")
    for b in bandwidths:
        parse_bandwidth(b)
    for x in latencies:
        parse_latency(x)
    workers = _check_workers(workers)
    if processes is not None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 2:
            raise ValueError(f"processes must be an int >= 2 (worker processes on this host), got {processes!r}")
        if _device(device).type != "cpu":
            raise ValueError(f"processes: the calibration replays steps on gloo processes of the CPU; device "
                             f"{device!r} is not the CPU (leave processes unset)")
    w = load_workload(task, model, batch_size, seq_len=seq_len)
    prof = measure(w, device, workers, methods, repeats, warmup, threads)
    costs = None
    if processes is not None:
        spec = {"task": task, "model": model, "batch_size": batch_size, "seq_len": seq_len}
        steps, work = method_steps(prof, workers[0])
        costs = calibrate(spec, steps, processes, repeats=max(repeats, 4), work=work)
    settings = predict(prof, workers, bandwidths, latencies, min_speedup, costs=costs)
    assumptions = ["every link has the bandwidth and latency of the setting; collectives are rings",
                   "the decentralized methods gossip on a ring (2 neighbours per worker)",
                   f"PowerSGD at rank {POWERSGD_RANK} (torch's hook: start_powerSGD_iter=2, min_compression_rate=2)",
                   "hook decode time is counted before the bucket's communication (it follows it in reality)"]
    if costs is not None:
        assumptions += [f"each round costs the network model's time plus what it took beyond the model between "
                        f"{processes} processes of this host over loopback (its CPU time and waits, replayed in the "
                        f"model's step; on {workers[0]} workers' sizes), whatever the number of workers",
                        f"the methods' own compute slows by the factor measured for the model's step with {processes} "
                        f"processes on this host (x{costs.compute_factor:.2f})"]
    if any(str(x) == DEFAULT_LATENCY for x in latencies):
        assumptions.append(f"latency {DEFAULT_LATENCY} per message (the default: an assumption, not measured)")
    return {"plan": "lowbit plan", "measured": prof.to_json(), "workers": list(workers),
            "bandwidths": [str(b) for b in bandwidths], "latencies_s": [parse_latency(x) for x in latencies],
            "min_speedup": min_speedup,
            "methods": {m: (DDP_METHODS[m] if m in DDP_METHODS else GOSSIP_METHODS[m])
                        for m in METHODS if m in prof.hook_ops or m in prof.gossip},
            "settings": settings, "assumptions": assumptions,
            "calibration": None if costs is None else costs.to_json(),
            "not_modelled": ["contention between communication and compute (gloo reduces on the CPU)",
                             *(["the transport's own CPU time and the waits of real processes (give processes)"]
                               if costs is None else []),
                             "stragglers", "tree or hierarchical collectives",
                             "accuracy: steps to a target may differ between methods"]}


def format_plan_report(report: dict) -> str:
    """The text ``lowbit plan`` prints: what was measured, then one table per bandwidth and
    latency (predicted step time and speedup against fp32 DDP per method and worker count,
    the recommendation)."""
    m = report["measured"]
    lines = [f"lowbit plan: {m['description']}, {m['parameters']:,} parameters, batch {m['batch_size']} per worker",
             f"measured on {m['device']} ({m['threads']} torch threads), medians of {m['repeats']} steps after "
             f"{m['warmup']} warm-up: forward {m['forward_seconds'] * 1e3:.1f} ms, backward "
             f"{m['backward_seconds'] * 1e3:.1f} ms, optimizer {m['optimizer_seconds'] * 1e3:.1f} ms",
             "DDP buckets (ready at ms of backward): " + ", ".join(
                 f"{b['bytes'] / 2**20:.1f} MiB@{b['ready_seconds'] * 1e3:.1f}" for b in m["buckets"])]
    c = report.get("calibration")
    if c:
        lines.append(f"calibrated on {c['processes']} processes of this host over {c['link']}: each method's step "
                     f"replayed, latency {c['latency_s'] * 1e6:.0f} us a message, compute x{c['compute_factor']:.2f} "
                     f"with every process computing")
    methods = list(report["methods"])
    groups: dict = {}
    for s in report["settings"]:
        groups.setdefault((s["bandwidth"], s["latency_s"]), []).append(s)
    for (bw, lat), rows in groups.items():
        lines.append("")
        lines.append(f"{bw}, latency {lat * 1e6:g} us: predicted step ms (speedup vs {BASELINE})")
        lines.append(f"{'method':<24}" + "".join(f"{'n=' + str(r['workers']):>20}" for r in rows))
        for meth in methods:
            lines.append(f"{meth:<24}" + "".join(
                f"{r['methods'][meth]['step_seconds'] * 1e3:>11.1f} ({r['methods'][meth]['speedup']:>5.2f}x)"
                for r in rows))
        lines.append(f"{'recommended':<24}" + "".join(f"{r['recommendation']:>20}" for r in rows))
    lines.append("")
    lines.append("assumptions: " + "; ".join(report["assumptions"]))
    lines.append("not modelled: " + "; ".join(report["not_modelled"]))
    return "\n".join(lines)


def plot_plan(report: dict, out) -> list:
    """One PNG per bandwidth and latency: each method's predicted speedup against fp32 DDP over
    the number of workers (log y), fp32 DDP as the dashed line at 1. ``out``: a file name; the
    setting is added to its stem (``plan.png`` -> ``plan_1Gbit_50us.png``). Returns the paths."""
    from pathlib import Path

    from ..plot import plot_series

    out = Path(out)
    groups: dict = {}
    for s in report["settings"]:
        groups.setdefault((s["bandwidth"], s["latency_s"]), []).append(s)
    paths = []
    for (bw, lat), rows in groups.items():
        series = [(meth, [r["workers"] for r in rows], [r["methods"][meth]["speedup"] for r in rows])
                  for meth in report["methods"] if meth != BASELINE]
        path = out.with_name(f"{out.stem}_{bw}_{lat * 1e6:g}us{out.suffix or '.png'}")
        paths.append(plot_series(series, "workers", f"predicted speedup vs {BASELINE}", path, logy=True,
                                 hlines=[(BASELINE, 1.0)],
                                 title=f"{report['measured']['workload']}: {bw}, {lat * 1e6:g} us"))
    return paths
