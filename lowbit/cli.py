"""The ``lowbit`` command line."""

from __future__ import annotations

import argparse
import sys

from .train.config import TrainConfig


def _add_train(sub) -> None:
    """The ``train`` subcommand: one option per :class:`TrainConfig` field (:mod:`lowbit.train.args`)."""
    from .train.args import add_train_arguments

    add_train_arguments(sub.add_parser(
        "train", help="train a model on n workers and write metrics.jsonl and summary.json",
        description="Train on n workers. With no options: digits-mlp, Moniqua 2-bit, 8 workers, ring."))


def _add_timing(p, size_help: str) -> None:
    """The options of the benchmarks timed with ``bench.codecs._setup`` (codecs, hooks)."""
    p.add_argument("--size", type=int, default=1_000_000, help=size_help)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (ratios are medians over rounds)")
    p.add_argument("--min-run-time", type=float, default=0.05,
                   help="seconds per timing (torch.utils.benchmark blocked_autorange)")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks measured side by side in one process, "
                       "one torch thread, interleaved rounds, medians of per-round ratios.")
    what = p.add_subparsers(dest="bench_what")
    c = what.add_parser("codecs", help="encode/decode time of every codec against memcpy, or against reference codecs",
                        description="Each codec's encode and decode against memcpy (dst.copy_(src) into a "
                                    "preallocated buffer of the same size), or with --against references its "
                                    "encode + decode against plain-torch reference codecs.")
    _add_timing(c, "elements of the fp32 input")
    c.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    c.add_argument("--clock", default="auto", help="auto (CPU: the thread's CPU time; CUDA: wall time after "
                   "synchronizing), cpu or wall")
    c.add_argument("--codecs", default=None, help="comma-separated codec families or labels (default: all)")
    c.add_argument("--against", default="memcpy", help="memcpy (default) or references")
    c.add_argument("--path", default="fast", help="against memcpy: fast (default), reference (the float64 reference "
                   "implementations) or both")
    c.add_argument("--randk-k", default=None, help="comma-separated kept counts of the RandK cases "
                   "(default: 1%% of --size and half of it)")
    c.add_argument("--json", default=None, help="also write the report to this JSON file")
    s = what.add_parser("step", help="per-step wall time of each algorithm against D-PSGD and AllReduce",
                        description="Short training runs on thread workers, interleaved rounds; each algorithm's "
                                    "step time as medians of per-round ratios to D-PSGD and AllReduce.")
    s.add_argument("--task", default="digits-mlp", help="training task (default digits-mlp)")
    s.add_argument("--workers", type=int, default=8, help="thread workers")
    s.add_argument("--steps", type=int, default=40, help="steps per run")
    s.add_argument("--warmup", type=int, default=10, help="first steps of each run left out of the timing")
    s.add_argument("--rounds", type=int, default=5, help="interleaved rounds (ratios are medians over rounds)")
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    s.add_argument("--algorithms", default=None,
                   help="comma-separated algorithms (default: all; dpsgd and allreduce always run)")
    s.add_argument("--json", default=None, help="also write the report to this JSON file")
    h = what.add_parser("hooks", help="lowbit's DDP communication hooks against torch's on one bucket",
                        description="The compute of lowbit's DDP hooks (casts, codecs, error memory, PowerSGD) "
                                    "against torch's allreduce, fp16, bf16 and PowerSGD hooks on one gradient bucket "
                                    "in a one-process group (gloo; NCCL on CUDA), interleaved rounds, medians of "
                                    "per-round ratios.")
    _add_timing(h, "elements of the bucket (a near-square weight gradient)")
    h.add_argument("--hooks", default=None, help="comma-separated lowbit hook names (default: the float, PowerSGD "
                   "and quantized hooks)")
    h.add_argument("--rank", type=int, default=2, help="PowerSGD's rank on both sides")
    h.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when present; NCCL there)")
    h.add_argument("--json", default=None, help="also write the report to this JSON file")
    o = what.add_parser("overlap", help="the wrapper's step time with its exchange overlapped with backward, and without",
                        description="DecentralizedDataParallel on real gloo processes training an MLP, overlap=True "
                                    "against overlap=False in interleaved rounds; the median of per-round ratios, "
                                    "and the forward+backward and the exchange timed alone.")
    o.add_argument("--algorithm", default="dpsgd", help="dpsgd (default) or naive")
    o.add_argument("--workers", type=int, default=2, help="processes (ring)")
    o.add_argument("--hidden", type=int, default=1024, help="MLP width")
    o.add_argument("--layers", type=int, default=4, help="MLP layers (hidden x hidden each)")
    o.add_argument("--batch", type=int, default=64, help="batch size per worker")
    o.add_argument("--steps", type=int, default=20, help="steps per run")
    o.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the timing")
    o.add_argument("--rounds", type=int, default=5, help="interleaved rounds (ratios are medians over rounds)")
    o.add_argument("--latency-ms", type=float, default=0.0, help="latency added per message (user space)")
    o.add_argument("--bandwidth-mbit", type=float, default=None,
                   help="shape each rank's link to this rate (needs Linux, root, ip and tc; default: loopback)")
    o.add_argument("--json", default=None, help="also write the report to this JSON file")
    _add_race(what)


def _add_race(what) -> None:
    """``lowbit bench race``: its options default to the full race's (lowbit.bench.race.FULL)."""
    from .bench.race import FULL, METHODS, NETWORKS, QUICK

    r = what.add_parser("race", help="time to a target accuracy on real shaped links, against torch's DDP",
                        description="Every method trains the same model from the same start on the same batches, "
                                    "in real processes, each behind a tc tbf link (100Mbit, 1Gbit) or on loopback; "
                                    "reports seconds and steps to the target accuracy, final accuracy, bytes per "
                                    "step and each step's split, and plots accuracy against wall-clock. Defaults: "
                                    f"{FULL['task']}, {FULL['workers']} workers, {FULL['steps']} steps, target "
                                    f"{FULL['target']}; --quick: {QUICK['task']} (hidden "
                                    f"{QUICK['task_options']['hidden']}), {QUICK['workers']} workers, "
                                    f"{QUICK['steps']} steps, target {QUICK['target']}.")
    r.add_argument("--quick", action="store_true", help="the CI-sized race (minutes, 2 workers, still shaped)")
    r.add_argument("--task", default=None, help="a classification task of lowbit train")
    r.add_argument("--workers", type=int, default=None, help="processes")
    r.add_argument("--networks", default=None, help=f"comma-separated, from {', '.join(NETWORKS)} (default all)")
    r.add_argument("--methods", default=None, help=f"comma-separated, from {', '.join(METHODS)} (default all)")
    r.add_argument("--steps", type=int, default=None, help="training steps of every method")
    r.add_argument("--eval-every", type=int, default=None, help="steps between two evaluations")
    r.add_argument("--target", type=float, default=None, help="target test accuracy in (0, 1]")
    r.add_argument("--batch", type=int, default=None, help="batch size per worker")
    r.add_argument("--lr", type=float, default=None, help="learning rate of every method (default: the race's, and a method's own where it "
                   "was tuned for the task: lowbit.bench.race.METHODS)")
    r.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    r.add_argument("--eval-samples", type=int, default=None, help="test images of the evaluations during training")
    r.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per worker)")
    r.add_argument("--seed", type=int, default=0, help="seed of the model, the data order and the codecs")
    r.add_argument("--repeats", type=int, default=1, help="runs of every method on every network, interleaved "
                   "(the order rotated each repeat); a row is the median run")
    r.add_argument("--plot-dir", default=None, help="write race-NETWORK.png there (default: beside --json)")
    r.add_argument("--json", default=None, help="also write the report to this JSON file")


def _add_plot(sub) -> None:
    from .plot import X_AXES, Y_AXES

    p = sub.add_parser("plot", help="overlay the curves of finished runs in one figure",
                       description="Overlay runs written by lowbit train --out DIR (their metrics.jsonl; "
                                   "legend from each summary.json).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--x", default="step", help=f"x axis: {', '.join(X_AXES)} (default step)")
    p.add_argument("--y", default="loss", help=f"y axis: {', '.join(Y_AXES)} (default loss)")
    p.add_argument("--out", required=True, help="image file to write (.png, .pdf, .svg)")
    p.add_argument("--logy", action="store_true", help="log-scale y axis (useful for loss)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--label", action="append", default=None, dest="labels",
                   help="legend label of each run, in order (repeat once per run)")


def _plot(args) -> int:
    from .plot import plot_runs

    path = plot_runs(args.runs, args.x, args.y, args.out, title=args.title, labels=args.labels, logy=args.logy)
    print(f"wrote {path}")
    return 0


def _add_plan(sub) -> None:
    from .plan import DEFAULT_BANDWIDTHS, DEFAULT_LATENCY, DEFAULT_WORKERS, METHODS
    from .plan_models import PLAN_MODELS

    p = sub.add_parser("plan", help="will compression pay for my model on my cluster? predicted step times",
                       description="Measure one worker's step of a model on this device (forward, backward, when "
                                   "each DDP bucket is ready, each method's encode/decode or hook time on those "
                                   "buckets) and predict each method's step time and speedup against torch DDP fp32 "
                                   "for each number of workers, bandwidth and latency (lowbit's network model).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", default=None, help=f"a model: {', '.join(PLAN_MODELS)} (synthetic inputs) or a "
                      "lowbit train task (e.g. fashion-lenet-tf)")
    what.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                      help="a function returning (model, batch, loss_fn): an nn.Module, one worker's minibatch (a "
                           "tensor or a tuple/list/dict of tensors) and loss_fn(model, batch) -> scalar loss; called "
                           "with batch_size=B when --batch-size is given")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)),
                   help="comma-separated numbers of workers (default %(default)s)")
    p.add_argument("--bandwidth", default=",".join(DEFAULT_BANDWIDTHS),
                   help="comma-separated link bandwidths, e.g. 1Gbit,10Gbit (default %(default)s)")
    p.add_argument("--latency", default=DEFAULT_LATENCY,
                   help="comma-separated latencies per message, e.g. 50us,1ms (default %(default)s, an assumption)")
    p.add_argument("--batch-size", type=int, default=None, help="minibatch per worker (default: the model's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (gpt2-small only; default 1024)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps (and hook rounds); medians over them")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--methods", default=None, help=f"comma-separated methods (default all: {', '.join(METHODS)})")
    p.add_argument("--min-speedup", type=float, default=1.1,
                   help="recommend a method only when predicted this many times faster than DDP fp32")
    p.add_argument("--processes", type=int, default=None,
                   help="worker processes sharing this host's cores (CPU): replay each method's step on that many "
                        "gloo processes here and add what each round costs beyond the network model, and scale compute "
                        "by the measured slow-down (default: not calibrated)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.add_argument("--plot", default=None, help="PNG path: one plot per bandwidth and latency (default: beside "
                   "--json, when given)")


def _plan(args) -> int:
    import json
    from pathlib import Path

    from .plan import METHODS, format_plan_report, plan, plot_plan

    report = plan(task=args.task, model=args.model, device=args.device, workers=args.workers,
                  bandwidths=args.bandwidth, latencies=args.latency, batch_size=args.batch_size,
                  repeats=args.repeats, warmup=args.warmup, threads=args.threads,
                  methods=METHODS if args.methods is None else args.methods, min_speedup=args.min_speedup,
                  seq_len=args.seq_len, processes=args.processes)
    print(format_plan_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        for path in plot_plan(report, plot):
            print(f"wrote {path}")
    return 0


def _add_repro(sub) -> None:
    from .repro import EXPERIMENTS

    p = sub.add_parser("repro", help="reproduce one of the papers' experiments",
                       description="Run one experiment; write DIR/results.json, DIR/table.md and PNG plots. "
                                   "Experiments: " + "; ".join(f"{k}: {v[1]}" for k, v in EXPERIMENTS.items()))
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(EXPERIMENTS)}")
    p.add_argument("--out", required=True, help="directory for results.json, table.md and the plots")
    p.add_argument("--quick", action="store_true", help="a short version (fewer steps) for a smoke test")


def _repro(args) -> int:
    from .repro import run_experiment

    run_experiment(args.name, args.out, quick=args.quick)
    print(f"wrote {args.out}/results.json, {args.out}/table.md and plots")
    return 0


def _bench(args) -> int:
    import json

    from .bench import AGAINST, bench_codecs, bench_references, format_report
    from .bench.step import bench_step, format_step_report

    if args.bench_what == "codecs":
        if args.against not in AGAINST:
            raise ValueError(f"against={args.against!r} is unknown; choose one of: {', '.join(AGAINST)}")
        kw = {}
        if args.against == "memcpy":
            randk_k = None
            if args.randk_k is not None:
                try:
                    randk_k = [int(k) for k in args.randk_k.split(",") if k.strip()]
                except ValueError:
                    raise ValueError(f"--randk-k must be comma-separated integers, got {args.randk_k!r}") from None
            kw = {"path": args.path, "randk_k": randk_k}
        elif args.path != "fast" or args.randk_k is not None:
            raise ValueError("--path and --randk-k apply to --against memcpy only")
        run = bench_codecs if args.against == "memcpy" else bench_references
        report = run(size=args.size, rounds=args.rounds, device=args.device, codecs=args.codecs,
                     min_run_time=args.min_run_time, clock=args.clock, **kw)
        print(format_report(report))
    elif args.bench_what == "overlap":
        from .bench.overlap import bench_overlap, format_overlap_report

        report = bench_overlap(algorithm=args.algorithm, workers=args.workers, hidden=args.hidden, layers=args.layers,
                               batch=args.batch, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                               latency_ms=args.latency_ms, bandwidth_mbit=args.bandwidth_mbit)
        print(format_overlap_report(report))
    elif args.bench_what == "hooks":
        from .bench.hooks import bench_hooks, format_hooks_report

        report = bench_hooks(size=args.size, rounds=args.rounds, hooks=args.hooks, rank=args.rank,
                             min_run_time=args.min_run_time, device=args.device)
        print(format_hooks_report(report))
    elif args.bench_what == "race":
        import os

        from .bench.race import bench_race, format_race_report

        plot_dir = args.plot_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else None)
        report = bench_race(task=args.task, workers=args.workers, networks=args.networks, methods=args.methods,
                            steps=args.steps, eval_every=args.eval_every, target=args.target, batch=args.batch,
                            lr=args.lr, momentum=args.momentum, quick=args.quick, backend=args.backend,
                            seed=args.seed, eval_samples=args.eval_samples, plot_dir=plot_dir, repeats=args.repeats,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_race_report(report))
        for net, path in report.get("plots", {}).items():
            print(f"wrote {path}")
    elif args.bench_what == "step":
        report = bench_step(task=args.task, workers=args.workers, steps=args.steps, warmup=args.warmup,
                            rounds=args.rounds, device=args.device, algorithms=args.algorithms)
        print(format_step_report(report))
    else:
        print("lowbit: error: choose what to benchmark: lowbit bench codecs | lowbit bench step | "
              "lowbit bench hooks | lowbit bench overlap | lowbit bench race", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _print_summary(s: dict) -> None:
    from .repro.common import fmt

    rows = [("test accuracy (average model)", s["final_test_accuracy"]),
            ("test accuracy (local models)", s["final_local_test_accuracy"]),
            ("train loss", s["final_train_loss"]),
            ("mean ||grad f(x_i)||^2", s["final_grad_norm_sq"]),
            ("consensus distance", s["final_consensus_distance"]),
            ("bytes sent (all workers)", s["bytes_sent"]),
            ("bytes per step", s["bytes_sent_per_step"]),
            ("nominal bits/element", s["nominal_bits_per_element"]),
            ("wire bits/element/step", s["wire_bits_per_element"]),
            ("extra memory per worker (B)", s["extra_memory_bytes"]),
            *((f"{k.replace('_', ' ')}", v) for k, v in s["algorithm_report"].items()),
            ("emulated seconds", s["emulated_seconds"]),
            ("wall seconds", s["wall_seconds"])]
    width = max(len(k) for k, _ in rows)
    c = s["config"]
    print(f"{c['algorithm']} on {c['task']}: {c['workers']} workers, {c['topology']}, {s['steps']} steps, "
          f"backend {c['backend']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {fmt(v, 4)}")


def _written_options(argv: list[str]) -> set[str]:
    """The :class:`TrainConfig` fields that ``lowbit train``'s arguments ``argv`` set (rather than
    leave at their defaults)."""
    from .train.args import train_parser

    parser, unset = train_parser(), object()
    parser.set_defaults(**{name: unset for name in TrainConfig.option_names()})
    return {k for k, v in vars(parser.parse_args(argv)).items() if v is not unset}


def _train(args, argv: list[str]) -> int:
    from .algorithms import from_options
    from .algorithms.options import AlgorithmOptions
    from .train import train

    opts = {k: v for k, v in vars(args).items() if k in TrainConfig.option_names()}
    # an algorithm option the algorithm does not read is refused, by the library's one check
    written = _written_options(argv) & set(AlgorithmOptions.option_names()) - {"algorithm"}
    from_options(opts["algorithm"], **{k: opts[k] for k in written})
    cfg = TrainConfig(**opts)
    run = train(cfg, out=args.out, progress=not args.no_progress, overwrite=args.overwrite)
    if run is not None:
        _print_summary(run.summary)
        if args.out:
            print(f"wrote {args.out}/metrics.jsonl and {args.out}/summary.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``lowbit`` command: parse ``argv`` (default ``sys.argv[1:]``), run, return the exit status."""
    parser = argparse.ArgumentParser(prog="lowbit", description="Distributed training with few bits on the wire.")
    sub = parser.add_subparsers(dest="command")
    _add_train(sub)
    _add_bench(sub)
    _add_plot(sub)
    _add_repro(sub)
    _add_plan(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "plot":
            return _plot(args)
        if args.command == "repro":
            return _repro(args)
        if args.command == "plan":
            return _plan(args)
        return _train(args, argv[argv.index("train") + 1:]) if args.command == "train" else _bench(args)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - expected failures: one line and an exit code
        from .train.errors import EXIT_CODES, classify

        kind, message = classify(e)
        if kind is None:
            raise  # a bug: show its traceback
        first = message.splitlines()[0] if message else type(e).__name__
        print(f"lowbit: error: {first}", file=sys.stderr)
        return EXIT_CODES[kind]


if __name__ == "__main__":
    sys.exit(main())
