"""Run a training job on a runtime, combine the workers' results, write them."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..comm.inprocess import pinned_threads, run_threads
from .config import TrainConfig, resolve_device
from .errors import OutputExists, classify, strict_json, unwritable
from .loop import WorkerResult, run_worker
# the clock's names stay importable from here (lowbit.train.run.step_clock, as the docs name them)
from .summary import emulated_clock, metrics_rows, overlaps_compute, step_clock, summarize  # noqa: F401


def _thread_job(cfg: TrainConfig, progress: bool, stream: str | None = None):
    with pinned_threads(1):  # n workers share the cores; thread CPU time stays per worker
        return run_threads(cfg.workers, functools.partial(run_worker, cfg=cfg, progress=progress, stream=stream),
                           device=resolve_device(cfg.device))


def _torch_worker(transport, cfg: TrainConfig, progress: bool, stream: str | None = None) -> WorkerResult:
    return run_worker(transport, cfg, progress, stream=stream)


def _torch_job(cfg: TrainConfig, progress: bool, stream: str | None = None, on_end=None):
    """The workers' results (rank order; None on torchrun ranks other than 0). Under torchrun,
    ``on_end(exc)`` is called on the liveness monitor's thread when a peer stalls or dies, or the
    ``--timeout`` passes, and must end this process (default: :func:`_end_rank` without a summary)."""
    from ..comm.launcher import is_torchrun, launch

    bandwidth, latency = cfg.shaping()
    if not is_torchrun():
        limits = dict(latency_s=latency, timeout_s=cfg.timeout, stall_timeout_s=cfg.stall_timeout,
                      collective_timeout_s=cfg.collective_timeout)
        if bandwidth is None:
            return launch(cfg.workers, _torch_worker, cfg, progress, stream, **limits)
        from ..comm.shaping import ShapedNetwork

        with ShapedNetwork(cfg.workers, bandwidth) as net:  # deleted afterwards, also on failure
            return launch(cfg.workers, _torch_worker, cfg, progress, stream, network=net, **limits)
    if bandwidth is not None:
        raise ValueError("shape_bandwidth: under torchrun the workers run on hosts lowbit does not manage; "
                         "shape their links yourself (tc), or launch without torchrun")
    # Under torchrun this process is one worker: run it, collect on rank 0.
    from ..comm.distributed import init_from_env
    from ..comm.liveness import PeerMonitor, sigterm_as_interrupt, watch_parent

    rank = os.environ.get("RANK", "?")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent started this process: leave when it is gone
        watch_parent(os.getppid(), pdeathsig=False, what=f"lowbit rank {rank}")
    op_timeout = cfg.collective_timeout if cfg.timeout is None else min(cfg.collective_timeout, cfg.timeout)
    transport = init_from_env(timeout_s=op_timeout, latency_s=latency)
    monitor = PeerMonitor(transport.rank, transport.world_size, stall_timeout_s=cfg.stall_timeout,
                          timeout_s=cfg.timeout, on_end=on_end or _end_rank)
    transport.heartbeat = monitor.beat
    with monitor, sigterm_as_interrupt(f"torchrun rank {rank}: received signal {{signum}} (SIGTERM)",
                                       ignore_while=lambda: monitor.ending):
        try:
            torch.set_num_threads(max(1, torch.get_num_threads()
                                      // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
            res = run_worker(transport, cfg, progress, stream=stream)
            monitor.finish()
            gathered = _gather_results(cfg, transport, res)
        except BaseException as e:
            verdict = monitor.explain(e)  # the run's verdict: another rank's, a peer gone, or this error
            if verdict is e:
                raise
            raise verdict from e
    transport.close()
    return gathered


# Under torchrun, rank 0 accepts a rank's result of at most (world size) x (its own result's
# length) + this: every rank runs the same model, steps and evaluations, and their ledgers differ
# only in how many peers and records each has.
RESULT_SLACK_NBYTES = 1 << 20


def _gather_results(cfg: TrainConfig, transport, res: WorkerResult) -> list[WorkerResult] | None:
    """Every rank's result on rank 0 (None elsewhere), as :mod:`lowbit.comm.wire_objects` frames
    (no pickle): the frames' lengths are all-gathered as an int64 tensor and checked against a
    bound on every rank (so that all refuse together), the frames gathered as padded uint8
    tensors, and rank 0 decodes and checks each; anything else is a BadPeerData naming the rank."""
    import torch.distributed as dist

    from ..comm.wire_objects import BadPeerData, dumps, loads

    n, rank, group = transport.world_size, transport.rank, transport.group
    dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in transport.backend else torch.device("cpu")
    payload = dumps(res)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=dev), group=group)
    lengths = [int(t.item()) for t in lengths]
    bound = n * lengths[0] + RESULT_SLACK_NBYTES
    for r, length in enumerate(lengths):
        if not 0 < length <= bound:
            raise BadPeerData(f"rank {r} stated a result of {length} bytes; the ranks accept 1..{bound} "
                              f"({n} x rank 0's {lengths[0]} + {RESULT_SLACK_NBYTES}): a corrupt or hostile peer")
    size = max(lengths)
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    frames = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(n)] if rank == 0 else None
    dist.gather(buf.to(dev), frames, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    results, error = None, None
    if rank == 0:
        try:
            results = [_checked_result(loads(f[:length].cpu().numpy().tobytes(), sender=f"rank {r}",
                                             max_nbytes=bound), r, cfg, res) for r, (f, length)
                       in enumerate(zip(frames, lengths))]
        except BadPeerData as e:
            error = e
    dist.barrier(group=group)  # no rank tears its process group down while another still reads from it
    if error is not None:
        raise error
    return results


def _checked_result(res, r: int, cfg: TrainConfig, own: WorkerResult) -> WorkerResult:
    """Rank ``r``'s decoded result, if it is one this run's summary can use (the kinds and sizes
    of rank 0's own ``own``); BadPeerData naming the rank otherwise."""
    from ..comm.wire_objects import BadPeerData

    def bad(why: str) -> BadPeerData:
        return BadPeerData(f"rank {r} sent a result that does not fit this run ({why}); refused: a corrupt or "
                           f"hostile peer")

    if not isinstance(res, WorkerResult):
        raise bad(f"a {type(res).__name__}, not a WorkerResult")
    if res.rank != r:
        raise bad(f"it says it is rank {res.rank!r}")
    if not (isinstance(res.params, torch.Tensor) and res.params.dtype == own.params.dtype
            and res.params.shape == own.params.shape):
        raise bad(f"params are not a {own.params.dtype} tensor of shape {tuple(own.params.shape)}")
    if not (isinstance(res.compute_seconds, list) and len(res.compute_seconds) == len(own.compute_seconds)
            and all(isinstance(c, float) for c in res.compute_seconds)):
        raise bad(f"compute_seconds is not a list of {len(own.compute_seconds)} floats")
    if not (isinstance(res.report, dict) and set(res.report) == set(own.report)
            and all(type(res.report[k]) is type(v) for k, v in own.report.items())):
        raise bad(f"its report's keys or kinds are not {sorted(own.report)}")
    if not (isinstance(res.ledger_rows, list) and all(
            isinstance(row, tuple) and len(row) == 6 and isinstance(row[0], int) and isinstance(row[1], str)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row[2:])
            for row in res.ledger_rows)):
        raise bad("its ledger rows are not (step, op, nbytes, sent_bytes, messages, peers) tuples")
    if not (isinstance(res.extra_memory_bytes, int) and isinstance(res.nominal_bits_per_element, float)
            and isinstance(res.evals, list) and len(res.evals) == len(own.evals)
            and all(isinstance(e, dict) for e in res.evals)):
        raise bad("its memory, bits or evaluations are not those of this run")
    return res


def _end_rank(e: BaseException, summary_path: Path | None = None, cfg: TrainConfig | None = None,
              writes=lambda e: True) -> None:
    """End this torchrun rank with the run's verdict ``e`` (on the liveness monitor's thread; the main
    thread may be blocked in a collective): write ``summary_path`` if given and ``writes(e)``
    (:func:`_writes_summary`), print the one-line error as ``lowbit`` does, and exit with the kind's code."""
    import sys

    from .errors import EXIT_CODES

    kind, message = classify(e)
    if summary_path is not None and cfg is not None and writes(e):
        try:
            write_atomic(summary_path, to_json(_failure_summary(cfg, e), indent=2) + "\n")
        except OSError as w:
            print(f"lowbit: could not write {summary_path}: {w}", file=sys.stderr)
    first = (message or str(e) or type(e).__name__).splitlines()[0]
    print(f"lowbit: error: {first}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODES.get(kind, 1))


def write_tensorboard(logdir: str | os.PathLike, run: Run) -> None:
    """What a run knows only at its end, beside the ``metrics/<column>`` scalars the loop's
    rank 0 wrote live (:class:`~lowbit.integrations.TensorBoardStats`): each evaluated
    step's ``metrics/emulated_seconds``, the summary's numbers as ``final/<key>`` and the
    config as text."""
    from ..integrations import TensorBoardStats

    tb = TensorBoardStats(logdir, prefix="metrics")
    try:
        for row in run.metrics:
            tb(row["step"], {"emulated_seconds": row["emulated_seconds"]})
        tb.prefix = "final"
        tb(run.summary["steps"], run.summary)
        tb.writer.add_text("config", "```\n" + json.dumps(run.summary["config"], indent=2) + "\n```")
    finally:
        tb.close()


@dataclass
class Run:
    summary: dict
    metrics: list[dict]
    workers: list[WorkerResult]


RUN_FILES = ("metrics.jsonl", "summary.json")


def prepare_out(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check ``--out`` before any training: a folder (made if missing) that this process can
    write, holding no previous run unless ``overwrite``. Raises OSError subclasses naming
    ``--out`` (:class:`~lowbit.train.errors.OutputExists` for a previous run)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder; choose a folder name")
    previous = [f for f in RUN_FILES if (out / f).exists()]
    if previous and not overwrite:
        raise OutputExists(f"--out {out} holds a previous run ({', '.join(previous)}); pass --overwrite to "
                           f"replace it, or choose another --out")
    _check_writable(out, "--out")
    return out


# What the write test at the start of a run writes (and removes): a full filesystem refuses it.
PROBE_NBYTES = 4096


def _check_writable(folder: Path, option: str) -> None:
    """Make ``folder`` (``option``'s) if missing and write, fsync and remove a small file in it;
    an OSError naming ``option`` and the cause otherwise (read-only, no permission, full)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".lowbit-write-test-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(bytes(PROBE_NBYTES))
                f.flush()
                os.fsync(f.fileno())
        finally:
            if probe.exists():
                probe.unlink()
    except OSError as e:
        raise unwritable(option, folder, e) from None


def prepare_checkpoint_dir(cfg: TrainConfig) -> Path:
    """Check the folder of ``--checkpoint-every``'s checkpoints before any training (every
    torchrun rank checks its own host's): a folder (made if missing) that this process can
    write, on a filesystem with room; an OSError naming the option otherwise."""
    folder = Path(cfg.checkpoint_dir)
    option = "--resume" if cfg.checkpoint_dir == cfg.resume else "--checkpoint-dir"
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{option} {folder} is a file, not a folder; choose a folder name")
    _check_writable(folder, option)
    return folder


def write_atomic(path: Path, text: str, option: str = "--out") -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it and rename it onto ``path``:
    a reader sees the old file or the new one, never a truncated one. A failed write (a full
    filesystem) is an OSError naming ``path`` and ``option``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise unwritable(option, path, e) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def to_json(value, indent: int | None = None) -> str:
    """Strict JSON (no NaN/Infinity): a non-finite number is null and the keys replaced are
    listed under ``non_finite`` (when ``value`` is a dict)."""
    clean, replaced = strict_json(value)
    if replaced and isinstance(clean, dict):
        clean["non_finite"] = replaced
    return json.dumps(clean, indent=indent, allow_nan=False)


def _failure_summary(cfg: TrainConfig, e: BaseException) -> dict:
    """What summary.json says about a run that ended early (its metrics so far are in metrics.jsonl)."""
    from ..comm.launcher import WorkerFailed
    from .errors import Diverged

    kind, message = classify(e)
    cause = e.cause if isinstance(e, WorkerFailed) and e.cause is not None else e
    out = {"status": "diverged" if isinstance(cause, Diverged) else "failed", "error_kind": kind,
           "error": message or f"{type(e).__name__}", "config": cfg.to_dict()}
    if isinstance(cause, Diverged):
        out["diverged_at_step"] = cause.step
    return out


def _writes_summary(lead: bool, out: Path | None, e: BaseException) -> bool:
    """Whether this process writes the failure summary of ``e`` into ``out``: rank 0 (or the only
    process); under torchrun rank 1 too when the run's verdict is that rank 0 died, if it sees ``out``."""
    from ..comm.liveness import WorkerDied

    if out is None:
        return False
    if lead:
        return True
    return os.environ.get("RANK") == "1" and isinstance(e, WorkerDied) and getattr(e, "rank", None) == 0 \
        and out.is_dir()


def train(cfg: TrainConfig, out: str | os.PathLike | None = None, progress: bool = False,
          overwrite: bool = False) -> Run | None:
    """Run ``cfg`` and return its :class:`Run` (None on non-zero torchrun
    ranks); write ``metrics.jsonl`` and ``summary.json`` into ``out`` if given.

    ``out`` is checked before training (:func:`prepare_out`; a previous run there needs
    ``overwrite``, or ``cfg.resume``), and so is ``cfg.checkpoint_dir`` when checkpoints
    are saved (:func:`prepare_checkpoint_dir`). Rank 0 appends each evaluation to
    ``metrics.jsonl`` as the run goes; the finished run's rows (with the emulated clock)
    and ``summary.json`` are then written atomically. A run that ends early (divergence,
    a dead or stalled worker, ...) keeps its metrics so far, writes a summary saying why
    (``status``), and re-raises. Under torchrun, a rank whose peer stalls or dies, or whose
    ``--timeout`` passes, while it is blocked in a collective is ended from its liveness
    monitor's thread (:class:`~lowbit.comm.liveness.PeerMonitor`): the summary is written,
    the one-line error printed and the process exits with the error's code."""
    from ..comm.launcher import is_torchrun

    if cfg.backend == "thread" and is_torchrun():
        raise ValueError("backend='thread' simulates all workers in one process; under torchrun use --backend torch")
    lead = not is_torchrun() or os.environ.get("RANK", "0") == "0"
    stream = None
    if out is not None:
        out = Path(out)
        if lead:
            prepare_out(out, overwrite=overwrite or cfg.resume is not None)
            (out / "metrics.jsonl").write_text("")  # rank 0's worker appends from here on
        stream = str(out / "metrics.jsonl")
    if cfg.checkpoint_every and cfg.checkpoint_dir is None:
        if out is None:
            raise ValueError("checkpoint_every needs --checkpoint-dir DIR (or --out, whose checkpoints/ it uses)")
        cfg = dataclasses.replace(cfg, checkpoint_dir=str(out / "checkpoints"))
    if cfg.checkpoint_every:
        prepare_checkpoint_dir(cfg)
    writes = functools.partial(_writes_summary, lead, out)
    on_end = functools.partial(_end_rank, cfg=cfg, summary_path=None if out is None else out / "summary.json",
                               writes=writes)
    t0 = time.perf_counter()
    try:
        results = _thread_job(cfg, progress, stream) if cfg.backend == "thread" else _torch_job(cfg, progress, stream,
                                                                                                on_end)
    except BaseException as e:
        if writes(e):
            try:
                write_atomic(out / "summary.json", to_json(_failure_summary(cfg, e), indent=2) + "\n")
            except OSError as w:  # e.g. the full filesystem that ended the run: report the run's own error
                logging.getLogger("lowbit").warning("%s", w)
        raise
    wall = time.perf_counter() - t0
    if results is None:
        return None
    run = Run(summarize(cfg, results, wall), metrics_rows(cfg, results), results)
    if out is not None:
        write_atomic(out / "metrics.jsonl", "".join(to_json(row) + "\n" for row in run.metrics))
        write_atomic(out / "summary.json", to_json({"status": "finished", **run.summary}, indent=2) + "\n")
    if cfg.tensorboard is not None:
        write_tensorboard(cfg.tensorboard, run)
    return run
