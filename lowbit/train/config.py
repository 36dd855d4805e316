"""One training run's configuration, validated in one place."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ..algorithms import ALGORITHMS
from ..algorithms.moniqua import THETA_SCHEDULES
from ..codecs import ROUNDINGS, Codec, IdentityCodec, MinMaxCodec, ModuloCodec, UniformCodec
from ..comm.netmodel import NetworkModel
from ..topology import WEIGHTINGS, make_topology
from .tasks import TASKS

BACKENDS = ("thread", "torch")
# Codecs the naive quantized baseline accepts (--codec); the others send one codec only.
GOSSIP_CODECS = ("uniform", "minmax", "fp32")
FIXED_CODECS = {"allreduce": "fp32", "dpsgd": "fp32", "moniqua": "modulo"}
LR_SCHEDULES = ("constant", "cosine")

# Per-task defaults for options left as None.
TASK_DEFAULTS = {
    "quadratic": dict(lr=0.1, momentum=0.0, weight_decay=0.0, theta=0.05, batch_size=1),
    "digits-mlp": dict(lr=0.1, momentum=0.9, weight_decay=1e-4, theta=0.05, batch_size=32),
}


@dataclass
class TrainConfig:
    task: str = "digits-mlp"
    algorithm: str = "moniqua"
    bits: int = 2
    workers: int = 8
    topology: str = "ring"
    weights: str = "uniform"
    steps: int = 300
    seed: int = 0
    backend: str = "thread"
    bandwidth: str = "100Mbit"
    latency: str = "1ms"
    lr: float | None = None
    lr_schedule: str = "constant"
    momentum: float | None = None
    weight_decay: float | None = None
    batch_size: int | None = None
    theta: float | None = None
    theta_schedule: str = "constant"
    delta: float = 0.1
    codec: str | None = None
    rounding: str = "stochastic"
    shared_randomness: bool = True
    eval_every: int = 25
    dim: int = 16
    noise: float = 0.0
    hidden: int = 128

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
        choice("algorithm", list(ALGORITHMS))
        choice("backend", BACKENDS)
        choice("weights", WEIGHTINGS)
        choice("lr_schedule", LR_SCHEDULES)
        choice("rounding", ROUNDINGS)
        choice("theta_schedule", THETA_SCHEDULES)
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        make_topology(self.topology, self.workers)  # unknown name or impossible size -> ValueError
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {self.bits}")
        for name, lo in (("steps", 1), ("batch_size", 1), ("eval_every", 1), ("dim", 1), ("hidden", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed}")
        for name in ("lr", "delta"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.theta is not None and not (math.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"theta must be > 0, got {self.theta}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0 or self.noise < 0:
            raise ValueError(f"weight_decay and noise must be >= 0, got {self.weight_decay}, {self.noise}")
        NetworkModel.parse(self.bandwidth, self.latency)  # raises on bad units
        # Build the codec here so that a bad combination fails before any worker starts.
        if self.algorithm in FIXED_CODECS and self.codec not in (None, FIXED_CODECS[self.algorithm]):
            raise ValueError(f"codec={self.codec!r}: algorithm={self.algorithm!r} sends {FIXED_CODECS[self.algorithm]} only")
        if self.algorithm == "naive":
            self.gossip_codec()
        if self.algorithm == "moniqua":
            ModuloCodec(bits=self.bits, theta=self.theta, rounding=self.rounding)

    def gossip_codec(self) -> Codec:
        """The codec of the naive quantized baseline."""
        name = self.codec or "uniform"
        if name not in GOSSIP_CODECS:
            raise ValueError(f"codec={name!r} is not available for algorithm={self.algorithm!r}; "
                             f"choose one of: {', '.join(GOSSIP_CODECS)}")
        if name == "uniform":
            return UniformCodec(step=self.delta, rounding=self.rounding)
        if name == "minmax":
            return MinMaxCodec(bits=self.bits, rounding=self.rounding)
        return IdentityCodec()

    def lr_at(self, k: int) -> float:
        if self.lr_schedule == "cosine":
            return 0.5 * self.lr * (1 + math.cos(math.pi * k / self.steps))
        return self.lr

    def network(self) -> NetworkModel:
        return NetworkModel.parse(self.bandwidth, self.latency)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
