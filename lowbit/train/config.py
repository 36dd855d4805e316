"""One training run's configuration, validated before any worker starts.

Every field is one ``lowbit train`` option (``--name-with-dashes``; the help
text is the field's ``metadata["help"]``): the algorithms' options, declared
once in :mod:`lowbit.algorithms.options` (and checked there), and the run's own
(task, workers, steps, network, checkpoints), declared and checked here.
Options an algorithm does not use are ignored by it; options it cannot take
are rejected, before any worker starts, by building it (``from_config``: its
constructor's checks) and by its ``check_config`` (combinations with the run's
options).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

import torch

from ..algorithms import ALGORITHMS
from ..algorithms.options import AlgorithmOptions, opt
from ..comm.liveness import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S
from ..comm.netmodel import NetworkModel
from ..integrations.checkpoint import RESUME_FALLBACKS
from ..topology import TOPOLOGIES, WEIGHTINGS, make_topology
from .tasks import SPLITS, TASKS

BACKENDS = ("thread", "torch")
# The thread backend keeps one queue per ordered pair of workers (n^2) and a thread per
# worker: 512 workers took 24 s and 1.3 GB just to set up their queues here (2-core CPU).
MAX_THREAD_WORKERS = 256
LR_SCHEDULES = ("constant", "cosine")

# Per-task defaults for options left as None.
TASK_DEFAULTS = {
    "quadratic": dict(lr=0.1, momentum=0.0, weight_decay=0.0, batch_size=1),
    "digits-mlp": dict(lr=0.1, momentum=0.9, weight_decay=1e-4, batch_size=32),
    **{t: dict(lr=0.05, momentum=0.9, weight_decay=1e-4, batch_size=32)
       for t in ("fashion-lenet", "fashion-fc300", "mnist-lenet", "mnist-fc300", "kmnist-lenet", "kmnist-fc300")},
    **{t: dict(lr=0.1, momentum=0.9, weight_decay=5e-4, batch_size=32)
       for t in ("cifar10-resnet20", "cifar10-resnet110", "cifar10-vgg")},
}
TASK_DEFAULTS.update({t: dict(TASK_DEFAULTS[t[:-3]]) for t in ("fashion-lenet-tf", "mnist-lenet-tf", "kmnist-lenet-tf")})
TASK_DEFAULTS["cifar10-cifarnet"] = dict(TASK_DEFAULTS["cifar10-vgg"])

def _check_tensorboard(logdir) -> None:
    """--tensorboard DIR needs a directory name and the optional ``tensorboard`` package."""
    if not isinstance(logdir, (str, os.PathLike)) or not str(logdir):
        raise ValueError(f"tensorboard must be a directory path, got {logdir!r}")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(f"tensorboard={str(logdir)!r} needs the tensorboard package, which is not installed; "
                         f"pip install tensorboard (or omit --tensorboard)") from None


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """``auto`` is CUDA when torch sees a GPU, else the CPU. ``cuda`` (and ``auto`` on a
    GPU) puts the worker of local rank r on GPU r modulo the visible GPUs;
    ``local_rank=None`` (the thread runtime, whose workers share one process) means the
    current GPU. ``cuda:N`` is GPU N. Anything else, or CUDA where there is none, is a
    ValueError naming ``device``."""
    name = str(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if name != "auto" and name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"device={name!r} is unknown; choose one of: auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: torch sees no CUDA device here (torch.cuda.is_available() is "
                         f"False); use device=cpu or auto")
    count = torch.cuda.device_count()
    if name.startswith("cuda:"):
        index = int(name[5:])
        if index >= count:
            raise ValueError(f"device={name!r}: GPU index must be in [0, {count - 1}] ({count} visible)")
        return torch.device("cuda", index)
    index = torch.cuda.current_device() if local_rank is None else local_rank % count
    return torch.device("cuda", index)


@dataclass
class TrainConfig(AlgorithmOptions):
    """One run of ``lowbit train``: the algorithm's options (:class:`~lowbit.algorithms.options.AlgorithmOptions`)
    and the run's own (task, workers, steps, network, checkpoints...)."""

    task: str = opt("digits-mlp", f"one of: {', '.join(TASKS)}")
    workers: int = opt(8, "number of workers")
    topology: str = opt("ring", f"one of: {', '.join(TOPOLOGIES)}")
    weights: str = opt("uniform", f"mixing weights: {', '.join(WEIGHTINGS)}")
    steps: int = opt(300, "training steps")
    seed: int = opt(0, "run seed (model init, data, shared randomness)")
    backend: str = opt("thread", f"one of: {', '.join(BACKENDS)}")
    device: str = opt("auto", "where workers compute: auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    bandwidth: str = opt("100Mbit", "network model bandwidth, e.g. 100Mbit")
    latency: str = opt("1ms", "network model latency, e.g. 1ms")
    shape_bandwidth: str | None = opt(None, "torch backend, Linux, root: run the workers in network namespaces "
                                       "whose links are really rate-limited (tc tbf), e.g. 100mbit")
    shape_latency: str | None = opt(None, "torch backend: latency really added per message (in user space), "
                                     "e.g. 1ms")
    lr: float | None = opt(None, "step size (task default if omitted)")
    lr_schedule: str = opt("constant", f"one of: {', '.join(LR_SCHEDULES)}")
    momentum: float | None = opt(None, "SGD momentum (task default if omitted)")
    weight_decay: float | None = opt(None, "SGD weight decay (task default if omitted)")
    batch_size: int | None = opt(None, "minibatch per worker (task default if omitted)")
    split: str = opt("iid", f"how training data is split over workers: {', '.join(SPLITS)}")
    slow: str | None = opt(None, "slow workers down, e.g. '0:3' (rank 0 computes 3x slower; RANK:FACTOR,...)")
    tensorboard: str | None = opt(None, "also write the metrics as TensorBoard scalars into this directory "
                                   "(needs: pip install tensorboard)")
    timeout: float | None = opt(None, "torch backend: a limit in seconds on the whole run (default: none)")
    stall_timeout: float = opt(DEFAULT_STALL_TIMEOUT_S, "torch backend: end the run when a worker neither "
                                "starts a step nor communicates for this many seconds (a stopped or hung "
                                "worker)")
    collective_timeout: float = opt(DEFAULT_COLLECTIVE_TIMEOUT_S, "torch backend: the longest one collective may "
                                     "wait for its peers, in seconds (torch.distributed's process-group "
                                     "timeout; capped by --timeout)")
    checkpoint_every: int = opt(0, "save every worker's state every K steps (0: never), atomically and "
                                 "checksummed, into --checkpoint-dir (default OUT/checkpoints)")
    checkpoint_dir: str | None = opt(None, "folder of the --checkpoint-every checkpoints (rank{r}.pt)")
    resume: str | None = opt(None, "continue from the newest step every worker has a good checkpoint of in this "
                              "folder; with --checkpoint-every, an empty folder starts afresh (for torchrun "
                              "--max-restarts: the same command resumes after a restart)")
    resume_fallback: str = opt("warn", "when a worker's newest checkpoint in --resume is refused (corrupt, truncated, "
                                "incomplete): warn (naming the file and why) and resume from the newest step every "
                                "worker still has, or error; one of: " + ", ".join(RESUME_FALLBACKS))
    # --- tasks ---
    eval_every: int = opt(25, "evaluate every this many steps")
    dim: int = opt(16, "dimension of the quadratic task")
    noise: float = opt(0.0, "gradient noise of the quadratic task")
    hidden: int = opt(128, "hidden units of digits-mlp")
    data_dir: str | None = opt(None, "folder with the dataset files of an image task (default: a system copy "
                                "such as /usr/share/datasets/fashion-mnist, else the lowbit.data.download cache)")

    def __post_init__(self) -> None:
        for k, v in TASK_DEFAULTS.get(self.task, {}).items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        self.validate()

    def validate(self) -> None:
        def choice(name, options):
            if getattr(self, name) not in options:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; choose one of: {', '.join(options)}")

        choice("task", list(TASKS))
        choice("backend", BACKENDS)
        choice("weights", WEIGHTINGS)
        choice("lr_schedule", LR_SCHEDULES)
        choice("split", SPLITS)
        choice("resume_fallback", RESUME_FALLBACKS)
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self._check_workers_bound()
        self._check_floats()
        self.check_options()
        make_topology(self.topology, self.workers)  # unknown name or impossible size -> ValueError
        for name, lo in (("steps", 1), ("batch_size", 1), ("eval_every", 1), ("dim", 1), ("hidden", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed}")
        for name in ("lr",):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        for name in ("weight_decay", "noise"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        for name in ("timeout", "stall_timeout", "collective_timeout"):
            v = getattr(self, name)
            if (v is None and name == "collective_timeout") or (v is not None and not v > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v}")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an integer >= 0 (0: never), got {self.checkpoint_every!r}")
        if self.checkpoint_every and self.checkpoint_dir is None and self.resume is not None:
            self.checkpoint_dir = self.resume  # resume where the checkpoints are written (restarts)
        if self.checkpoint_every and not ALGORITHMS[self.algorithm].synchronous:
            raise ValueError(f"checkpoint_every: algorithm={self.algorithm!r} is asynchronous (its workers are never "
                             f"at one step together), so it has no consistent mid-run checkpoint")
        if self.resume is not None and not self.checkpoint_every and not os.path.isdir(str(self.resume)):
            raise ValueError(f"resume={self.resume!r} is not a folder of checkpoints")
        self.slow_factors()
        resolve_device(self.device)  # raises on a bad or unavailable device
        NetworkModel.parse(self.bandwidth, self.latency)  # raises on bad units
        if self.tensorboard is not None:
            _check_tensorboard(self.tensorboard)
        self.shaping()
        cls = ALGORITHMS[self.algorithm]
        cls.from_config(self)  # the algorithm's own checks of its options (its constructor's)
        cls.check_config(self)  # and of their combination with the run's

    def _check_workers_bound(self) -> None:
        """--workers has an upper bound per runtime (what one machine can set up)."""
        if self.backend == "thread" and self.workers > MAX_THREAD_WORKERS:
            raise ValueError(f"workers={self.workers}: the thread backend simulates at most {MAX_THREAD_WORKERS} "
                             f"workers (it keeps a queue per ordered pair of workers, n^2 of them, and a thread "
                             f"per worker in one process)")
        if self.backend == "torch":
            from ..comm.launcher import MAX_LOCAL_WORKERS, is_torchrun

            if not is_torchrun() and self.workers > MAX_LOCAL_WORKERS:
                raise ValueError(f"workers={self.workers}: --backend torch starts at most {MAX_LOCAL_WORKERS} "
                                 f"processes on this machine (each a Python process with torch loaded); use "
                                 f"torchrun over several machines for more")

    def _check_floats(self) -> None:
        """Every float option that is set must be a finite number (NaN and inf are refused by name)."""
        import typing

        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            if float not in (typing.get_args(hints[f.name]) or (hints[f.name],)):
                continue
            v = getattr(self, f.name)
            if v is None or isinstance(v, str):  # None: the default; a string: theta 'auto', checked below
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v!r}")

    def slow_factors(self) -> dict[int, float]:
        """``--slow 0:3,2:1.5`` as {rank: factor}."""
        if not self.slow:
            return {}
        out = {}
        for part in str(self.slow).split(","):
            try:
                r, f = part.split(":")
                r, f = int(r), float(f)
            except ValueError:
                raise ValueError(f"slow must look like RANK:FACTOR[,RANK:FACTOR...], got {self.slow!r}") from None
            if not 0 <= r < self.workers or not (math.isfinite(f) and f >= 1):
                raise ValueError(f"slow: rank must be in [0, {self.workers - 1}] and factor >= 1, got {part!r}")
            out[r] = f
        return out

    def lr_at(self, k: int) -> float:
        if self.lr_schedule == "cosine":
            return 0.5 * self.lr * (1 + math.cos(math.pi * k / self.steps))
        return self.lr

    def shaping(self) -> tuple[float | None, float]:
        """(--shape-bandwidth in bits/s or None, --shape-latency in seconds); ValueError where they cannot run."""
        if self.shape_bandwidth is None and self.shape_latency is None:
            return None, 0.0
        if self.backend != "torch":
            raise ValueError(f"shape_bandwidth/shape_latency need backend='torch' (real processes and sockets), "
                             f"got backend={self.backend!r}; the thread backend only models the network "
                             f"(--bandwidth/--latency)")
        bw = None
        if self.shape_bandwidth is not None:
            from ..comm.netmodel import parse_bandwidth
            from ..comm.shaping import check_shaping

            bw = parse_bandwidth(self.shape_bandwidth)
            check_shaping("shape_bandwidth")
        lat = 0.0
        if self.shape_latency is not None:
            from ..comm.netmodel import parse_latency

            lat = parse_latency(self.shape_latency)
        return bw, lat

    def network(self) -> NetworkModel:
        return NetworkModel.parse(self.bandwidth, self.latency)

    def to_dict(self) -> dict:
        return asdict(self)
