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
from .profile import Profile
from .workload import load_workload


def _ddp_prediction(p: Profile, m: str, n: int, net: NetworkModel) -> dict:
    ops = p.hook_ops[m][n]
    compute = p.hook_seconds[m]
    rows, sent, comm_total = [], 0, 0.0
    for b, c, bops in zip(p.buckets, compute, ops):
        sync = math.fsum(net.op_seconds(r, n) for k, r in bops if k == "sync")
        comm = math.fsum(net.op_seconds(r, n) for k, r in bops if k == "async")
        sent += sum(r.sent_bytes for _, r in bops)
        comm_total += sync + comm
        rows.append((b.ready_seconds, c, sync, comm))
    bwd_end, comm_end = overlap_backward(p.backward_seconds, rows)
    step = p.forward_seconds + max(bwd_end, comm_end) + p.optimizer_seconds
    compute_total = math.fsum(compute)
    return {"step_seconds": step, "bytes_per_step": sent, "method_compute_seconds": compute_total,
            "comm_seconds": comm_total,
            "exposed_comm_seconds": step - (p.forward_seconds + p.backward_seconds + p.optimizer_seconds + compute_total)}


def _gossip_prediction(p: Profile, m: str, n: int, net: NetworkModel) -> dict:
    g = p.gossip[m][min(n, GOSSIP_RING)]
    steps = g["records"]
    comm = statistics.fmean(net.step_seconds(r, n) for r in steps) if steps else 0.0
    sent = statistics.fmean(sum(_rec(r.op, r.nbytes, n, r.peers).sent_bytes for r in recs) for recs in steps) \
        if steps else 0.0
    base = p.forward_seconds + p.backward_seconds + p.optimizer_seconds
    return {"step_seconds": base + g["overhead_seconds"] + comm, "bytes_per_step": sent,
            "method_compute_seconds": g["overhead_seconds"], "comm_seconds": comm, "exposed_comm_seconds": comm}


def predict(p: Profile, workers: Sequence[int], bandwidths: Sequence, latencies: Sequence,
            min_speedup: float = 1.1) -> list[dict]:
    """Predicted step time of every measured method for each number of ``workers``, bandwidth
    and latency: one row per setting, ``{"workers", "bandwidth", "latency_s", "methods":
    {method: {"step_seconds", "speedup", ...}}, "recommendation"}``. ``speedup`` is fp32 DDP's
    predicted step over the method's; the recommendation is the fastest method when its speedup
    is at least ``min_speedup``, else ``torch-ddp-fp32``."""
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
                res = {m: (_ddp_prediction(p, m, n, net) if m in DDP_METHODS else _gossip_prediction(p, m, n, net))
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
         seq_len: int | None = None) -> dict:
    """Measure the model's step on ``device`` and predict every method's step time on each
    setting (see the module doc); the report :func:`format_plan_report` prints and ``--json``
    writes: ``{"measured": ..., "settings": [...], "assumptions": [...], "not_modelled": [...]}``."""
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
    w = load_workload(task, model, batch_size, seq_len=seq_len)
    prof = measure(w, device, workers, methods, repeats, warmup, threads)
    settings = predict(prof, workers, bandwidths, latencies, min_speedup)
    assumptions = ["every link has the bandwidth and latency of the setting; collectives are rings",
                   "the decentralized methods gossip on a ring (2 neighbours per worker)",
                   f"PowerSGD at rank {POWERSGD_RANK} (torch's hook: start_powerSGD_iter=2, min_compression_rate=2)",
                   "hook decode time is counted before the bucket's communication (it follows it in reality)"]
    if any(str(x) == DEFAULT_LATENCY for x in latencies):
        assumptions.append(f"latency {DEFAULT_LATENCY} per message (the default: an assumption, not measured)")
    return {"plan": "lowbit plan", "measured": prof.to_json(), "workers": list(workers),
            "bandwidths": [str(b) for b in bandwidths], "latencies_s": [parse_latency(x) for x in latencies],
            "min_speedup": min_speedup,
            "methods": {m: (DDP_METHODS[m] if m in DDP_METHODS else GOSSIP_METHODS[m])
                        for m in METHODS if m in prof.hook_ops or m in prof.gossip},
            "settings": settings, "assumptions": assumptions,
            "not_modelled": ["contention between communication and compute (gloo reduces on the CPU)",
                             "the transport's own CPU time", "stragglers", "tree or hierarchical collectives",
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
             f"DDP buckets (ready at ms of backward): " + ", ".join(
                 f"{b['bytes'] / 2**20:.1f} MiB@{b['ready_seconds'] * 1e3:.1f}" for b in m["buckets"])]
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
