"""The plan against the race: ``lowbit plan``'s predicted step beside ``lowbit bench race``'s
measured one (:func:`compare_with_race`), with the latency and each method's rounds measured on
the race's links (:func:`~lowbit.plan.rounds.calibrate`)."""

from __future__ import annotations

from ..bench.table import Column, header_line, row_line
from ..comm.netmodel import parse_latency
from .measure import measure
from .methods import METHODS
from .predict import predict
from .workload import load_workload


def measure_latency(workers: int, rate: float | None, samples: int = 50) -> float:
    """The effective latency of one message between ``workers`` gloo processes, each behind a
    ``tc tbf`` link of ``rate`` bits/s (None: unshaped loopback), as the race runs them: the
    median time of a 4-byte ring all-reduce divided by its ``2 (n - 1)`` messages. It holds the
    links' own delay and gloo's fixed cost per message, and on a loaded machine the wait for the
    peer process to be scheduled."""
    from ..comm import launch
    from .rounds import _ping

    if rate is None:
        t = launch(workers, _ping, samples)
    else:
        from ..comm.shaping import ShapedNetwork

        with ShapedNetwork(workers, rate) as net:
            t = launch(workers, _ping, samples, network=net)
    return max(t) / (2 * (workers - 1))


def compare_with_race(race: dict | None = None, quick: bool = True, networks=("100Mbit", "1Gbit"),
                      latency: str | None = None, repeats: int = 20, calibrate: bool = True,
                      calibration_repeats: int = 20, progress=print) -> dict:
    """The plan's predicted step time against ``lowbit bench race``'s measured one, for every
    contender on each shaped network: ``{"errors": {"NETWORK/METHOD": (predicted - measured) /
    measured}, "errors_model_only": {...}, "rows": [...], "plan": ..., "latency_s": {NETWORK:
    seconds}, "calibration": {NETWORK: ...}}``. ``race``: a race report (``bench race
    --json``), or None to run the race here (``quick``: its CI-sized settings). The plan measures
    the race's model, batch and workers with one torch thread, as each race worker runs.
    ``calibrate``: replay every method's step on the race's number of processes behind each
    network's links (:func:`~lowbit.plan.rounds.calibrate`, ``calibration_repeats`` steps of
    each method in 4 runs):
    the prediction then prices each round with what it measured there, and compute by the
    measured factor of that many processes sharing this host; ``errors_model_only`` keeps the
    network model's prediction alone (with the latency measured there) beside it. Without it,
    ``errors`` is that prediction. ``latency``: per message; None measures it on each network
    (the race adds none, its links and gloo have their own)."""
    if race is None:
        from ..bench.race import bench_race

        race = bench_race(quick=quick, networks=list(networks), progress=progress)
    st = race["settings"]
    nets = [n for n in networks if n in race["networks"]]
    if not nets:
        raise ValueError(f"the race has none of the networks {list(networks)} (skipped: "
                         f"{race.get('skipped_networks')})")
    from ..bench.race import NETWORKS
    from .rounds import calibrate as run_calibration, method_steps

    spec = {"task": st["task"], "batch_size": st["batch"], "task_options": st.get("task_options") or None}
    w = load_workload(**spec)
    methods = [m for m in METHODS if any(m in race["networks"][n] for n in nets)]
    prof = measure(w, "cpu", [st["workers"]], methods, repeats=repeats, warmup=2, threads=1)
    n = st["workers"]
    costs, lat = {}, {}
    for net in nets:
        if calibrate:
            if progress:
                progress(f"plan: replaying {len(methods)} methods' steps on {n} processes behind {net} links ...")
            steps, work = method_steps(prof, n)
            costs[net] = run_calibration(spec, steps, n, NETWORKS[net], repeats=calibration_repeats, work=work,
                                         warmup=1)
        lat[net] = (parse_latency(latency) if latency is not None
                    else costs[net].latency_s if calibrate else measure_latency(n, NETWORKS[net]))
    rows = {net: predict(prof, [n], [NETWORKS[net]], [lat[net]], costs=costs.get(net))[0] for net in nets}
    alone = {net: predict(prof, [n], [NETWORKS[net]], [lat[net]])[0] for net in nets} if calibrate else rows
    errors, errors_alone, table = {}, {}, []
    for net in nets:
        for m in methods:
            got = race["networks"][net].get(m) or {}
            measured = got.get("step_seconds")
            pred = rows[net]["methods"][m]["step_seconds"]
            pred_alone = alone[net]["methods"][m]["step_seconds"]
            err = None if not measured else (pred - measured) / measured
            if err is not None:
                errors[f"{net}/{m}"] = err
                errors_alone[f"{net}/{m}"] = (pred_alone - measured) / measured
            table.append({"network": net, "method": m, "predicted_step_seconds": pred,
                          "model_only_step_seconds": pred_alone,
                          "measured_step_seconds": measured, "relative_error": err,
                          "predicted_bytes_per_step": rows[net]["methods"][m]["bytes_per_step"],
                          "measured_bytes_per_step": got.get("bytes_per_step"),
                          "measured_compute_seconds": got.get("compute_seconds"), "failed": got.get("failed")})
    return {"errors": errors, "errors_model_only": errors_alone, "rows": table, "plan": prof.to_json(),
            "race_settings": st, "latency_s": lat, "calibration": {k: c.to_json() for k, c in costs.items()}}


_COMPARISON_COLUMNS = (
    Column("network", 8, "network", left=True), Column("method", 24, "method", left=True),
    Column("plan ms", 9, lambda r: r["predicted_step_seconds"] * 1e3, ".2f"),
    Column("model ms", 9, lambda r: r["model_only_step_seconds"] * 1e3, ".2f"),
    Column("race ms", 9, lambda r: None if r["measured_step_seconds"] is None else r["measured_step_seconds"] * 1e3,
           ".2f"),
    Column("error", 7, "relative_error", "+.0%"), Column("plan B/step", 12, "predicted_bytes_per_step", ".0f"),
    Column("race B/step", 12, lambda r: None if r["measured_bytes_per_step"] is None
           else round(r["measured_bytes_per_step"])))


def format_race_comparison(cmp: dict) -> str:
    """The table of :func:`compare_with_race`: predicted and measured step and bytes per method."""
    lines = ["latency per message (measured): " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in cmp["latency_s"].items())]
    for net, c in cmp.get("calibration", {}).items():
        lines.append(f"{net}: {c['processes']} processes replayed each method's step; compute x{c['compute_factor']:.2f} "
                     f"({c['compute_shared_seconds'] * 1e3:.2f} ms with every process computing, "
                     f"{c['compute_solo_seconds'] * 1e3:.2f} ms alone)")
    lines.append("plan ms: the plan's prediction; model ms: the network model alone (no calibration)")
    lines.append(header_line(_COMPARISON_COLUMNS))
    lines += [row_line(_COMPARISON_COLUMNS, r) + (f"  race FAILED: {r['failed']}" if r["failed"] else "")
              for r in cmp["rows"]]
    return "\n".join(lines)
