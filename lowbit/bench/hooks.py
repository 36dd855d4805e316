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

from .timing import check_positive_int, measure, median_ratio, pinned_threads, spread

__all__ = ["TORCH_PAIRS", "DEFAULT_HOOKS", "bench_hooks", "format_hooks_report"]

#: lowbit hook name -> the torch hook computing the same thing
TORCH_PAIRS = {"fp32": "allreduce", "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd"}
#: the lowbit hooks timed by default (``make_hook`` names)
DEFAULT_HOOKS = ("fp32", "fp16", "bf16", "powersgd", "qsgd_maxnorm", "qsgd_maxnorm_multiscale", "qsgd", "terngrad",
                 "sign", "dithered")


#: why the CPU bench cannot time torch's PowerSGD hook on a machine with CUDA
_TORCH_POWERSGD_ON_CPU = ("torch's powerSGD_hook, which fails on a CPU bucket where CUDA is available "
                          "(its callback calls torch.cuda.synchronize on the bucket's device)")


class _Bucket:
    """What the hooks read of a ``torch.distributed.GradBucket``: one weight gradient."""

    def __init__(self, g: torch.Tensor, rows: int, cols: int) -> None:
        self._buf = g.clone()
        self._param = torch.nn.Parameter(torch.empty(rows, cols, device=g.device))

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list:
        return [self._param]

    def gradients(self) -> list:
        return [self._buf.view(self._param.shape)]


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


def bench_hooks(size: int = 1_000_000, rounds: int = 5, hooks: str | list[str] | None = None, rank: int = 2,
                min_run_time: float = 0.05, seed: int = 0, device: str = "cpu") -> dict:
    """Each lowbit hook of ``hooks`` (``make_hook`` names, default :data:`DEFAULT_HOOKS`)
    against its torch counterpart (:data:`TORCH_PAIRS`, else torch's ``allreduce_hook``) on a
    bucket of ``size`` fp32 elements on ``device`` (see the module doc)."""
    import torch.distributed as dist

    from ..integrations.ddp_hooks import HOOKS, centralized_names
    from .codecs import _setup

    dev, clock = _setup(size, rounds, min_run_time, device, seed, "wall")
    check_positive_int(rank, "rank")
    names = list(DEFAULT_HOOKS) if hooks is None else \
        [h.strip() for h in (hooks.split(",") if isinstance(hooks, str) else hooks) if h.strip()]
    known = set(HOOKS) | set(centralized_names())
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
    own_group = not dist.is_initialized()
    if own_group:
        nccl = dev.type == "cuda" and dist.is_nccl_available()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if nccl else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": dev} if nccl else {}))
    elif dist.get_world_size() != 1:
        raise ValueError("bench_hooks times one process: the default process group has "
                         f"{dist.get_world_size()} ranks")
    backend = str(dist.get_backend())
    try:
        with pinned_threads(1) as threads:
            rows, cols = matrix_of(size)
            g = (torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 0.01).to(dev)
            bucket = _Bucket(g, rows, cols)
            buf = bucket.buffer()

            def call(hook, state):
                buf.copy_(g)
                return hook(state, bucket).wait()

            contenders = {f"torch {t}": _torch_hook(t, rank) for t in
                          dict.fromkeys(TORCH_PAIRS.get(h, "allreduce") for h in names)}
            contenders.update({f"lowbit {h}": _lowbit_hook(h, rank) for h in names})
            error = {}
            for key, (hook, state) in contenders.items():
                for _ in range(3):  # torch's PowerSGD runs plain all-reduce before start_powerSGD_iter
                    out = call(hook, state)
                error[key] = float((out - g).norm() / g.norm())
            calls = {"refill": lambda: buf.copy_(g)}
            calls.update({k: (lambda h=h, s=s: call(h, s)) for k, (h, s) in contenders.items()})
            timings = []
            for _ in range(rounds):
                t = {k: measure(f, dev, min_run_time, threads, clock) for k, f in calls.items()}
                refill = t["refill"]
                timings.append({k: (v - refill if k != "refill" else v) for k, v in t.items()})
    finally:
        if own_group:
            dist.destroy_process_group()
    for i, r in enumerate(timings):
        if any(v <= 0 for v in r.values()):
            raise RuntimeError(f"round {i}: a hook timed no longer than refilling its bucket ({r}); "
                               "raise min_run_time or size")
    out_rows = []
    for h in names:
        ref = f"torch {TORCH_PAIRS.get(h, 'allreduce')}"
        key = f"lowbit {h}"
        lo, hi = spread(timings, key, ref)
        out_rows.append({"hook": h, "torch": ref, "x_torch": median_ratio(timings, key, ref), "x_torch_range": [lo, hi],
                         "ms": 1e3 * statistics.median(r[key] for r in timings),
                         "torch_ms": 1e3 * statistics.median(r[ref] for r in timings),
                         "x_refill": median_ratio(timings, key, "refill"),
                         "torch_x_refill": median_ratio(timings, ref, "refill"),
                         "error": error[key], "torch_error": error[ref]})
    return {"benchmark": "hooks", "device": str(dev), "backend": backend, "size": size, "rows": rows, "cols": cols,
            "rank": rank, "rounds": rounds,
            "threads": threads, "min_run_time": min_run_time, "clock": clock,
            "refill_ms": 1e3 * statistics.median(r["refill"] for r in timings), "hooks": out_rows,
            "skipped": skipped}


def format_hooks_report(report: dict) -> str:
    """The report of :func:`bench_hooks` as the text ``lowbit bench hooks`` prints."""
    lines = [f"DDP hook compute on one bucket of {report['size']} fp32 elements ({report['rows']} x {report['cols']} "
             f"weight gradient) on {report['device']}, a one-process {report['backend']} group, {report['threads']} "
             f"torch thread, {report['rounds']} "
             f"interleaved rounds, medians of per-round ratios (wall clock; each call refills the bucket first, "
             f"refill {report['refill_ms']:.3f} ms, subtracted); PowerSGD rank {report['rank']}",
             "x refill: the hook's time in bucket refills (a copy of the bucket: memcpy); error: |avg - g| / |g|",
             f"{'lowbit hook':<24} {'torch hook':<16} {'lowbit/torch':>12} {'range':>11} {'lowbit ms':>10} "
             f"{'torch ms':>9} {'x refill':>9} {'torch x':>8} {'error':>9} {'torch err':>9}"]
    for r in report["hooks"]:
        a, b = r["x_torch_range"]
        lines.append(f"{r['hook']:<24} {r['torch']:<16} {r['x_torch']:>12.2f} {f'{a:.2f}-{b:.2f}':>11} "
                     f"{r['ms']:>10.3f} {r['torch_ms']:>9.3f} {r['x_refill']:>9.1f} {r['torch_x_refill']:>8.1f} "
                     f"{r['error']:>9.2e} {r['torch_error']:>9.2e}")
    lines += [f"{h}: not timed, {why}" for h, why in report.get("skipped", {}).items()]
    return "\n".join(lines)
