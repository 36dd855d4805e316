"""``lowbit bench hooks``: what lowbit's DDP communication hooks cost on one gradient bucket,
against torch's own hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook``), in one process.

The collective runs in a process group of this one process (made here over a ``HashStore``
when no group exists: gloo on the CPU, NCCL on CUDA where torch has it), so what is timed is
each hook's own work: its casts, encode and
decode, error memory, PowerSGD's products, the issue of the collective and its future's
callbacks (a one-process all-reduce is a copy). The network is what compression saves; this
bench says what it costs.

The bucket holds one weight gradient of ``rows x cols`` elements (``size`` as a near-square
matrix: PowerSGD compresses it at rank ``rank``). Every call refills the bucket with the same
gradient (``buffer.copy_(g)``: a hook overwrites its bucket with the average) and then runs
the hook to its result (``hook(state, bucket).wait()``); each round also times the refill
alone, and a hook's time is its call's minus the refill's. Rounds interleave the contenders;
figures are medians of per-round ratios (:mod:`lowbit.bench.timing`), on the wall clock (part
of a hook runs in the backend's thread; on CUDA read after synchronizing the device) with one
torch thread.

torch's ``powerSGD_hook`` cannot run on a CPU bucket where CUDA is available (its last callback
calls ``torch.cuda.synchronize`` on the bucket's device, and that raises for ``cpu``): on such
a machine the CPU bench leaves ``powersgd`` out of the default hooks and says so in its report
(``skipped``), and refuses it when asked for by name.

Pairs: lowbit's ``fp32``, ``fp16``, ``bf16`` and ``powersgd`` (at the same rank, error
feedback and warm start on both sides) against torch's hook doing the same; every other lowbit
hook against torch's ``allreduce_hook``, the uncompressed hook it would replace. ``error``
is ``|avg - g| / |g|`` of the hook's first result (a one-process average is the rank's own
decoded gradient: the compression error of one step).
"""

from __future__ import annotations

import math
import statistics

import torch

from ..integrations.ddp_hooks.replay import GradBucketStandIn  # noqa: F401 -- the stand-in the hooks replay with
from .table import Column, span_column, table_lines
from .timing import check_positive_int, measure, median_ratio, pinned_threads, spread

__all__ = ["TORCH_PAIRS", "DEFAULT_HOOKS", "GradBucketStandIn", "one_process_group", "bench_hooks",
           "format_hooks_report"]

#: lowbit hook name -> the torch hook computing the same thing
TORCH_PAIRS = {"fp32": "allreduce", "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd"}
#: the lowbit hooks timed by default (``make_hook`` names)
DEFAULT_HOOKS = ("fp32", "fp16", "bf16", "powersgd", "qsgd-maxnorm", "qsgd-maxnorm-multiscale", "qsgd", "terngrad",
                 "sign", "dithered")


#: why the CPU bench cannot time torch's PowerSGD hook on a machine with CUDA
_TORCH_POWERSGD_ON_CPU = ("torch's powerSGD_hook, which fails on a CPU bucket where CUDA is available "
                          "(its callback calls torch.cuda.synchronize on the bucket's device)")


class one_process_group:
    """A process group of this one process (gloo; NCCL on CUDA where torch has it, made over a
    ``HashStore``) for the ``with`` block, unless one exists, which must have one rank
    (ValueError naming ``who``): DDP and torch's hooks need one."""

    def __init__(self, dev: torch.device, who: str = "this bench") -> None:
        self.dev = dev
        self.who = who
        self.own = False

    def __enter__(self):
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != 1:
                raise ValueError(f"{self.who} one process: the default process group has "
                                 f"{dist.get_world_size()} ranks")
            return self
        nccl = self.dev.type == "cuda" and dist.is_nccl_available()
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
        dist.init_process_group("nccl" if nccl else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": self.dev} if nccl else {}))
        self.own = True
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        if self.own:
            dist.destroy_process_group()


def matrix_of(size: int) -> tuple[int, int]:
    """``(rows, cols)``, ``rows * cols == size``, ``rows`` the largest divisor ``<= sqrt(size)``."""
    rows = math.isqrt(size)
    while size % rows:
        rows -= 1
    return rows, size // rows


def _torch_hook(name: str, rank: int):
    """(hook, state) of torch's hook ``name``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    if name == "allreduce":
        return dh.allreduce_hook, None
    if name == "fp16":
        return dh.fp16_compress_hook, None
    if name == "bf16":
        return dh.bf16_compress_hook, None
    state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                             min_compression_rate=1, use_error_feedback=True, warm_start=True)
    return ph.powerSGD_hook, state


def _lowbit_hook(name: str, rank: int):
    from ..integrations.ddp_hooks import make_hook

    state, hook = make_hook(name, **({"powersgd_rank": rank} if name == "powersgd" else {}))
    return hook, state


def _hook_names(hooks, dev: torch.device) -> tuple[list[str], dict]:
    """The lowbit hooks to time (``hooks`` checked) and those left out, with why."""
    from ..integrations.ddp_hooks.names import RENAMED_HOOKS, hook_names

    names = list(DEFAULT_HOOKS) if hooks is None else \
        [h.strip() for h in (hooks.split(",") if isinstance(hooks, str) else hooks) if h.strip()]
    known = set(hook_names()) | set(RENAMED_HOOKS)  # a former name: make_hook warns
    bad = [h for h in names if h not in known]
    if bad or not names:
        raise ValueError(f"hooks must name lowbit hooks ({', '.join(sorted(known))}), got {hooks!r}")
    skipped = {}
    if dev.type == "cpu" and torch.cuda.is_available() and "powersgd" in names:
        if hooks is not None:
            raise ValueError(f"hooks: powersgd is timed against {_TORCH_POWERSGD_ON_CPU}: bench it with "
                             "device='cuda', or with the GPUs hidden (CUDA_VISIBLE_DEVICES=)")
        names.remove("powersgd")
        skipped["powersgd"] = _TORCH_POWERSGD_ON_CPU
    return names, skipped


def _time_contenders(contenders: dict, bucket: GradBucketStandIn, dev, rounds: int, min_run_time: float,
                     threads: int, clock: str) -> tuple[list[dict], dict]:
    """Per round, each hook's seconds beyond the refill of its bucket (and the refill's own);
    each hook's error after three warm-up calls."""
    g = bucket.grad

    def call(hook, state):
        bucket.refill()
        return hook(state, bucket).wait()

    error = {}
    for key, (hook, state) in contenders.items():
        for _ in range(3):  # torch's PowerSGD runs plain all-reduce before start_powerSGD_iter
            out = call(hook, state)
        error[key] = float((out - g).norm() / g.norm())
    calls = {"refill": bucket.refill}
    calls.update({k: (lambda h=h, s=s: call(h, s)) for k, (h, s) in contenders.items()})
    timings = []
    for i in range(rounds):
        t = {k: measure(f, dev, min_run_time, threads, clock) for k, f in calls.items()}
        refill = t["refill"]
        timings.append({k: (v - refill if k != "refill" else v) for k, v in t.items()})
        if any(v <= 0 for v in timings[-1].values()):
            raise RuntimeError(f"round {i}: a hook timed no longer than refilling its bucket ({timings[-1]}); "
                               "raise min_run_time or size")
    return timings, error


def _hook_row(h: str, timings: list[dict], error: dict) -> dict:
    """The report's row of lowbit hook ``h`` against its torch counterpart."""
    ref = f"torch {TORCH_PAIRS.get(h, 'allreduce')}"
    key = f"lowbit {h}"
    lo, hi = spread(timings, key, ref)
    return {"hook": h, "torch": ref, "x_torch": median_ratio(timings, key, ref), "x_torch_range": [lo, hi],
            "ms": 1e3 * statistics.median(r[key] for r in timings),
            "torch_ms": 1e3 * statistics.median(r[ref] for r in timings),
            "x_refill": median_ratio(timings, key, "refill"),
            "torch_x_refill": median_ratio(timings, ref, "refill"),
            "error": error[key], "torch_error": error[ref]}


def bench_hooks(size: int = 1_000_000, rounds: int = 5, hooks: str | list[str] | None = None, rank: int = 2,
                min_run_time: float = 0.05, seed: int = 0, device: str = "cpu") -> dict:
    """Each lowbit hook of ``hooks`` (``make_hook`` names, default :data:`DEFAULT_HOOKS`)
    against its torch counterpart (:data:`TORCH_PAIRS`, else torch's ``allreduce_hook``) on a
    bucket of ``size`` fp32 elements on ``device`` (see the module doc)."""
    import torch.distributed as dist

    from .codecs import _setup

    dev, clock = _setup(size, rounds, min_run_time, device, seed, "wall")
    check_positive_int(rank, "rank")
    names, skipped = _hook_names(hooks, dev)
    with one_process_group(dev, "bench_hooks times"), pinned_threads(1) as threads:
        backend = str(dist.get_backend())
        rows, cols = matrix_of(size)
        g = (torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 0.01).to(dev)
        bucket = GradBucketStandIn([torch.nn.Parameter(torch.empty(rows, cols, device=dev))], g)
        contenders = {f"torch {t}": _torch_hook(t, rank) for t in
                      dict.fromkeys(TORCH_PAIRS.get(h, "allreduce") for h in names)}
        contenders.update({f"lowbit {h}": _lowbit_hook(h, rank) for h in names})
        timings, error = _time_contenders(contenders, bucket, dev, rounds, min_run_time, threads, clock)
    return {"benchmark": "hooks", "device": str(dev), "backend": backend, "size": size, "rows": rows, "cols": cols,
            "rank": rank, "rounds": rounds,
            "threads": threads, "min_run_time": min_run_time, "clock": clock,
            "refill_ms": 1e3 * statistics.median(r["refill"] for r in timings),
            "hooks": [_hook_row(h, timings, error) for h in names], "skipped": skipped}


def format_hooks_report(report: dict) -> str:
    """The report of :func:`bench_hooks` as the text ``lowbit bench hooks`` prints."""
    lines = [f"DDP hook compute on one bucket of {report['size']} fp32 elements ({report['rows']} x {report['cols']} "
             f"weight gradient) on {report['device']}, a one-process {report['backend']} group, {report['threads']} "
             f"torch thread, {report['rounds']} "
             f"interleaved rounds, medians of per-round ratios (wall clock; each call refills the bucket first, "
             f"refill {report['refill_ms']:.3f} ms, subtracted); PowerSGD rank {report['rank']}",
             "x refill: the hook's time in bucket refills (a copy of the bucket: memcpy); error: |avg - g| / |g|"]
    cols = [Column("lowbit hook", 24, "hook", left=True), Column("torch hook", 16, "torch", left=True),
            Column("lowbit/torch", 12, "x_torch", ".2f"), span_column("x_torch_range", ".2f", 11),
            Column("lowbit ms", 10, "ms", ".3f"), Column("torch ms", 9, "torch_ms", ".3f"),
            Column("x refill", 9, "x_refill", ".1f"), Column("torch x", 8, "torch_x_refill", ".1f"),
            Column("error", 9, "error", ".2e"), Column("torch err", 9, "torch_error", ".2e")]
    lines += table_lines(cols, report["hooks"])
    lines += [f"{h}: not timed, {why}" for h, why in report.get("skipped", {}).items()]
    return "\n".join(lines)
