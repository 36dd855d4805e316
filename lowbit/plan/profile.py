"""What ``lowbit plan`` measures of one DDP step: the device, a one-process group, a clock,
the recording hook, and the :class:`Bucket` and :class:`Profile` it fills."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available here")
    return dev


class _Clock:
    """Seconds since :meth:`start` at each :meth:`mark`: the wall clock on the CPU, CUDA events on
    the current stream (read after the step: marking does not wait for the device)."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.marks: list = []

    def start(self) -> None:
        self.marks = []
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        if self.cuda:
            return [self.t0.elapsed_time(e) / 1e3 for e in self.marks]
        return [m - self.t0 for m in self.marks]


class _Recorder:
    """DDP communication hook of the profiling run: notes when DDP calls it for each bucket (the
    bucket is ready) and which parameters the bucket holds, and returns the bucket as it is
    (the average over one process)."""

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.buckets: list[tuple[int, list, torch.Tensor | None]] = []
        self.keep = False

    def hook(self, state, bucket):
        self.clock.mark()
        buf = bucket.buffer()
        self.buckets.append((bucket.index(), list(bucket.parameters()), buf.detach().clone() if self.keep else None))
        fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
        fut.set_result(buf)
        return fut


@dataclass
class Bucket:
    """One DDP bucket as the profiling run saw it: its index, its parameters (in bucket order),
    a copy of its gradient at the last step, and when it became ready (seconds from the start of
    backward, the median over the timed steps)."""

    index: int
    params: list
    grad: torch.Tensor
    ready_seconds: float

    @property
    def numel(self) -> int:
        """Elements of the bucket."""
        return self.grad.numel()


@dataclass
class Profile:
    """What :func:`measure` measured (seconds are medians over ``repeats`` steps)."""

    workload: str
    description: str
    parameters: int
    batch_size: int | None
    device: str
    threads: int
    repeats: int
    warmup: int
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    buckets: list[Bucket]
    hook_seconds: dict  # DDP method -> [seconds of its hook per bucket]
    hook_ops: dict  # DDP method -> {workers: [[(kind, CommRecord), ...] per bucket]}
    # method -> {ring size: {"overhead_seconds", "records": [[CommRecord...] per step], "world",
    #                        "rounds": [[Round...] per step] (every transport call, untracked ones too)}}
    gossip: dict

    def to_json(self) -> dict:
        """The measurements as plain JSON values."""
        return {"workload": self.workload, "description": self.description, "parameters": self.parameters,
                "batch_size": self.batch_size, "device": self.device, "threads": self.threads,
                "repeats": self.repeats, "warmup": self.warmup, "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds, "optimizer_seconds": self.optimizer_seconds,
                "buckets": [{"index": b.index, "numel": b.numel, "bytes": b.numel * b.grad.element_size(),
                             "tensors": len(b.params), "ready_seconds": b.ready_seconds} for b in self.buckets],
                "hook_seconds": {m: v for m, v in self.hook_seconds.items()},
                "gossip_overhead_seconds": {m: {str(w): v["overhead_seconds"] for w, v in g.items()}
                                            for m, g in self.gossip.items()}}
