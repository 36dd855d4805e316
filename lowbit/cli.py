"""The ``lowbit`` command line."""

from __future__ import annotations

import argparse
import sys

from .algorithms import ALGORITHMS
from .topology import TOPOLOGIES, WEIGHTINGS
from .train.config import BACKENDS, LR_SCHEDULES, TrainConfig
from .train.tasks import TASKS


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model on n workers and write metrics.jsonl and summary.json",
                       description="Train on n workers. With no options: digits-mlp, Moniqua 2-bit, 8 workers, ring.")
    d = TrainConfig.__dataclass_fields__
    p.add_argument("--task", default=d["task"].default, help=f"one of: {', '.join(TASKS)}")
    p.add_argument("--algorithm", default=d["algorithm"].default, help=f"one of: {', '.join(ALGORITHMS)}")
    p.add_argument("--bits", type=int, default=d["bits"].default, help="bits per element (1..8)")
    p.add_argument("--workers", type=int, default=d["workers"].default)
    p.add_argument("--topology", default=d["topology"].default, help=f"one of: {', '.join(TOPOLOGIES)}")
    p.add_argument("--weights", default=d["weights"].default, help=f"mixing weights: {', '.join(WEIGHTINGS)}")
    p.add_argument("--steps", type=int, default=d["steps"].default)
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--backend", default=d["backend"].default, help=f"one of: {', '.join(BACKENDS)}")
    p.add_argument("--bandwidth", default=d["bandwidth"].default, help="network model bandwidth, e.g. 100Mbit")
    p.add_argument("--latency", default=d["latency"].default, help="network model latency, e.g. 1ms")
    p.add_argument("--lr", type=float, default=None, help="step size (task default if omitted)")
    p.add_argument("--lr-schedule", default=d["lr_schedule"].default, help=f"one of: {', '.join(LR_SCHEDULES)}")
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--theta", type=float, default=None, help="Moniqua's a priori bound theta (> 0)")
    p.add_argument("--theta-schedule", default=d["theta_schedule"].default, help="constant, or lr (theta_k ~ lr_k)")
    p.add_argument("--delta", type=float, default=d["delta"].default,
                   help="quadratic offset and the naive quantizer's step (Theorem 1)")
    p.add_argument("--codec", default=None, help="codec of the naive baseline: uniform, minmax, fp32")
    p.add_argument("--rounding", default=d["rounding"].default, help="stochastic or nearest")
    p.add_argument("--shared-randomness", action=argparse.BooleanOptionalAction, default=True,
                   help="Moniqua: all workers use the same stochastic-rounding offsets each step")
    p.add_argument("--eval-every", type=int, default=d["eval_every"].default)
    p.add_argument("--dim", type=int, default=d["dim"].default, help="dimension of the quadratic task")
    p.add_argument("--noise", type=float, default=d["noise"].default, help="gradient noise of the quadratic task")
    p.add_argument("--hidden", type=int, default=d["hidden"].default, help="hidden units of digits-mlp")
    p.add_argument("--out", default=None, help="directory for metrics.jsonl and summary.json")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks measured side by side in one process.")
    what = p.add_subparsers(dest="bench_what")
    c = what.add_parser("codecs", help="encode/decode throughput of every codec against memcpy")
    c.add_argument("--size", type=int, default=1_000_000, help="elements of the fp32 input")
    c.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median is shown)")
    c.add_argument("--device", default="cpu", help="cpu or cuda")
    c.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _bench(args) -> int:
    import json

    from .bench import bench_codecs, format_rows

    if args.bench_what != "codecs":
        print("lowbit: error: choose what to benchmark: lowbit bench codecs", file=sys.stderr)
        return 2
    rows = bench_codecs(size=args.size, repeats=args.repeats, device=args.device)
    print(format_rows(rows, args.size))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _print_summary(s: dict) -> None:
    rows = [("test accuracy (average model)", s["final_test_accuracy"]),
            ("test accuracy (local models)", s["final_local_test_accuracy"]),
            ("train loss", s["final_train_loss"]),
            ("mean ||grad f(x_i)||^2", s["final_grad_norm_sq"]),
            ("consensus distance", s["final_consensus_distance"]),
            ("bytes sent (all workers)", s["bytes_sent"]),
            ("bytes per step", s["bytes_sent_per_step"]),
            ("bits/element/message", s["bits_per_element_per_message"]),
            ("extra memory per worker (B)", s["extra_memory_bytes"]),
            ("emulated seconds", s["emulated_seconds"]),
            ("wall seconds", s["wall_seconds"])]
    width = max(len(k) for k, _ in rows)
    c = s["config"]
    print(f"{c['algorithm']} on {c['task']}: {c['workers']} workers, {c['topology']}, {s['steps']} steps, "
          f"backend {c['backend']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {_fmt(v)}")


def _train(args) -> int:
    from .train import train

    opts = {k: v for k, v in vars(args).items() if k in TrainConfig.option_names()}
    cfg = TrainConfig(**opts)
    run = train(cfg, out=args.out, progress=not args.no_progress)
    if run is not None:
        _print_summary(run.summary)
        if args.out:
            print(f"wrote {args.out}/metrics.jsonl and {args.out}/summary.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowbit", description="Distributed training with few bits on the wire.")
    sub = parser.add_subparsers(dest="command")
    _add_train(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _train(args) if args.command == "train" else _bench(args)
    except ValueError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
