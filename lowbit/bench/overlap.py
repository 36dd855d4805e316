"""``lowbit bench overlap``: the step time of :class:`~lowbit.integrations.DecentralizedDataParallel`
with its exchange overlapped with forward and backward (``overlap=True``) against the same
wrapper communicating after backward (``overlap=False``), in one run.

``workers`` real processes (:func:`lowbit.comm.launch`, gloo over loopback, optionally
behind shaped links of ``bandwidth_mbit`` each and with ``latency_ms`` per message), one
torch thread each. Every process trains two copies of an MLP (``layers`` square layers of
width ``hidden``: 4.2 M parameters by default, 16.8 MB in fp32; ``batch`` sets how long
the backward takes against the exchange) under two wrappers on the same transport, one with
overlap and one without, each with its own SGD optimizer and a fixed batch. A
user's loop: ``zero_grad``, ``loss_fn(model(x), y).backward()``, ``optimizer.step()``.

Rounds interleave the two (the order alternates from round to round): in each round each
wrapper runs ``steps`` steps; a step's time is the interval between the ends of consecutive
steps on the wall clock (``time.perf_counter``), the latest rank's, the first ``warmup``
left out; a run's time is the median of its steps. The figure is the median over rounds of
the per-round ratio overlapped / not overlapped (:mod:`lowbit.bench.timing`). Each round
also times the two parts alone: the forward and backward (no communication), and the
exchange (the algorithm's ``before_update`` on a copy of the model, both ranks together);
``hidden`` is the share of the shorter of the two that overlap took off the step,
``(t_off - t_on) / min(t_compute, t_exchange)`` (1: the overlapped step is as long as its
longer part; the parts are timed apart from the steps, so it is an estimate).
"""

from __future__ import annotations

import statistics
import time

from .timing import check_positive_int, median_ratio, spread

OVERLAP_ALGORITHMS = ("dpsgd", "naive")
_TIMINGS = ("on", "off", "compute", "exchange")  # each round's timings, per step


def _mlp(hidden: int, layers: int, seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _worker(transport, cfg: dict) -> dict:
    """One rank of :func:`bench_overlap`: per round, each wrapper's step times and the parts' times."""
    import torch
    from torch import nn

    from ..integrations import DecentralizedDataParallel

    g = torch.Generator().manual_seed(1000 + transport.rank)  # one torch thread: launch() sets it
    x = torch.randn(cfg["batch"], cfg["hidden"], generator=g)
    y = torch.randint(0, cfg["hidden"], (cfg["batch"],), generator=g)
    wrappers = {}
    for overlap in (True, False):
        net = _mlp(cfg["hidden"], cfg["layers"], cfg["seed"])
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        wrappers[overlap] = DecentralizedDataParallel(net, opt, cfg["algorithm"], topology="ring", transport=transport,
                                                      overlap=overlap)
    if not wrappers[True].overlap:
        raise ValueError(f"{cfg['algorithm']} does not overlap its exchange (Algorithm.overlap is False)")

    def steps(ddp, n: int) -> list[float]:
        ends = []
        for _ in range(n):
            ddp.optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            ddp.optimizer.step()
            ends.append(time.perf_counter())
        return [b - a for a, b in zip(ends[cfg["warmup"] - 1:], ends[cfg["warmup"]:])]

    def parts(ddp, n: int) -> tuple[list[float], list[float]]:
        """Forward and backward alone (``ddp`` does not overlap: its module has no forward
        hook), then the exchange alone, untracked, on a copy of the model."""
        compute, exchange = [], []
        copy = ddp.flat.data.clone()
        for i in range(n):
            t0 = time.perf_counter()
            ddp.optimizer.zero_grad()
            nn.functional.cross_entropy(ddp.module(x), y).backward()
            t1 = time.perf_counter()
            transport.barrier()
            t2 = time.perf_counter()
            copy.copy_(ddp.flat.data)
            with transport.untracked():
                ddp.algorithm.before_update(10**6 + i, copy, None, 0.01)
            t3 = time.perf_counter()
            compute.append(t1 - t0)
            exchange.append(t3 - t2)
        return compute, exchange

    rounds = []
    for r in range(cfg["rounds"]):
        order = (True, False) if r % 2 == 0 else (False, True)
        times = {}
        for overlap in order:
            transport.barrier()
            times[overlap] = steps(wrappers[overlap], cfg["steps"])
        transport.barrier()
        compute, exchange = parts(wrappers[False], cfg["steps"] - cfg["warmup"])
        rounds.append({"on": times[True], "off": times[False], "compute": compute, "exchange": exchange})
    numel = len(wrappers[True].flat)
    for ddp in wrappers.values():
        ddp.close()
    return {"rounds": rounds, "numel": numel}


def bench_overlap(algorithm: str = "dpsgd", workers: int = 2, hidden: int = 1024, layers: int = 4, batch: int = 64,
                  steps: int = 20, warmup: int = 5, rounds: int = 5, latency_ms: float = 0.0,
                  bandwidth_mbit: float | None = None, seed: int = 0) -> dict:
    """Step seconds with and without overlap, interleaved rounds (module doc); the report's
    ``x_off`` is the median of the per-round ratios overlapped / not overlapped."""
    from ..comm import launch

    if algorithm not in OVERLAP_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {OVERLAP_ALGORITHMS} (those that overlap), got {algorithm!r}")
    check_positive_int(workers, "workers", 2)
    for name, v in (("hidden", hidden), ("layers", layers), ("batch", batch), ("rounds", rounds)):
        check_positive_int(v, name)
    check_positive_int(steps, "steps", 3)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 1 <= warmup < steps - 1:
        raise ValueError(f"warmup must be an integer in [1, steps - 2] = [1, {steps - 2}], got {warmup!r}")
    if not (isinstance(latency_ms, (int, float)) and 0 <= latency_ms < float("inf")):
        raise ValueError(f"latency_ms must be a finite number >= 0, got {latency_ms!r}")
    if bandwidth_mbit is not None and not (isinstance(bandwidth_mbit, (int, float)) and 0 < bandwidth_mbit < float("inf")):
        raise ValueError(f"bandwidth_mbit must be a finite number > 0 or None, got {bandwidth_mbit!r}")
    cfg = dict(algorithm=algorithm, hidden=hidden, layers=layers, batch=batch, steps=steps, warmup=warmup,
               rounds=rounds, seed=seed)
    if bandwidth_mbit is None:
        results = launch(workers, _worker, cfg, latency_s=latency_ms / 1e3)
    else:
        from ..comm.shaping import ShapedNetwork, shaping_unavailable_reason

        why = shaping_unavailable_reason()
        if why is not None:
            raise RuntimeError(f"bandwidth_mbit needs real shaping, unavailable here: {why}")
        with ShapedNetwork(workers, bandwidth_mbit * 1e6) as net:
            results = launch(workers, _worker, cfg, latency_s=latency_ms / 1e3, network=net)
    # per round and timing: the median step, a step ending when its latest rank ends it (the ranks
    # meet at every exchange, so the max over ranks per step)
    per_round = [{key: statistics.median(max(res["rounds"][r][key][i] for res in results)
                                         for i in range(steps - warmup)) for key in _TIMINGS}
                 for r in range(rounds)]
    med = {k: statistics.median(r[k] for r in per_round) for k in _TIMINGS}
    hidden_share = [(r["off"] - r["on"]) / min(r["compute"], r["exchange"]) for r in per_round]
    return {"benchmark": "overlap", "algorithm": algorithm, "workers": workers, "params": results[0]["numel"],
            "model_mb": 4 * results[0]["numel"] / 1e6, "hidden": hidden, "layers": layers, "batch": batch,
            "steps": steps, "warmup": warmup, "rounds": rounds, "latency_ms": latency_ms,
            "bandwidth_mbit": bandwidth_mbit, "threads": 1,
            "step_ms_overlap": 1e3 * med["on"], "step_ms_no_overlap": 1e3 * med["off"],
            "compute_ms": 1e3 * med["compute"], "exchange_ms": 1e3 * med["exchange"],
            "x_no_overlap": median_ratio(per_round, "on", "off"),
            "x_no_overlap_range": spread(per_round, "on", "off"),
            "hidden_share": statistics.median(hidden_share),
            "per_round": per_round}


def format_overlap_report(report: dict) -> str:
    """The report of :func:`bench_overlap` as the text ``lowbit bench overlap`` prints."""
    net = "loopback" if report["bandwidth_mbit"] is None else f"shaped links of {report['bandwidth_mbit']:g} Mbit/s"
    if report["latency_ms"]:
        net += f" + {report['latency_ms']:g} ms per message"
    lo, hi = report["x_no_overlap_range"]
    return "\n".join([
        f"DecentralizedDataParallel({report['algorithm']}, ring), {report['workers']} gloo processes over {net}"
        f", 1 torch thread each; "
        f"MLP {report['layers']}x{report['hidden']} ({report['params'] / 1e6:.2f} M parameters, "
        f"{report['model_mb']:.1f} MB fp32), batch {report['batch']}; steps {report['warmup']}..{report['steps'] - 1} "
        f"of each run, {report['rounds']} interleaved rounds, medians",
        f"  forward+backward alone   {report['compute_ms']:9.2f} ms",
        f"  exchange alone           {report['exchange_ms']:9.2f} ms",
        f"  step, overlap=False      {report['step_ms_no_overlap']:9.2f} ms",
        f"  step, overlap=True       {report['step_ms_overlap']:9.2f} ms",
        f"  overlap / no overlap     {report['x_no_overlap']:9.3f}   (per-round range {lo:.3f}-{hi:.3f})",
        f"  hidden / min(fwd+bwd, exchange) {report['hidden_share']:5.2f}",
    ])
