"""Tasks: a dataset, a model, a loss, and how data is split over workers.

- ``quadratic``: Theorem 1 of the Moniqua paper, f_i(x) = ||x - (delta/2) 1||^2 / 2
  on every worker (dimension ``dim``), optional Gaussian gradient noise.
- ``digits-mlp``: scikit-learn's 8x8 digits (ships with scikit-learn, no
  download), a fixed 80/20 train/test split, a one-hidden-layer MLP.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SPLITS = ("iid", "label")


class Task(ABC):
    name = "task"
    classification = False

    @abstractmethod
    def make_model(self) -> nn.Module:
        """A fresh model (same initial weights for every worker under one torch seed)."""

    def shard(self, rank: int, world_size: int, seed: int):
        """This worker's part of the training data."""
        return None

    def sample(self, shard, batch_size: int, gen: torch.Generator):
        """A minibatch from the shard."""
        return None

    @abstractmethod
    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The minibatch loss whose gradient is the stochastic gradient."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Full-data metrics of one model: train_loss, test_accuracy (None if n/a)."""

    @abstractmethod
    def full_grad_norm_sq(self, model: nn.Module) -> float:
        """||grad f(x)||^2 of the global objective f = (1/n) sum_i f_i at the model."""


class Quadratic(Task):
    name = "quadratic"

    def __init__(self, dim: int = 16, delta: float = 0.1, noise: float = 0.0):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        self.dim, self.delta, self.noise = dim, delta, noise
        self.center = torch.full((dim,), delta / 2)

    def make_model(self):
        m = nn.Module()
        m.x = nn.Parameter(torch.zeros(self.dim))  # A4: x_0 = 0
        return m

    def sample(self, shard, batch_size, gen):
        return torch.randn(self.dim, generator=gen) * self.noise if self.noise > 0 else None

    def loss(self, model, batch):
        f = 0.5 * (model.x - self.center).pow(2).sum()
        return f if batch is None else f + (batch * model.x).sum()  # grad = x - c + noise

    def evaluate(self, model):
        with torch.no_grad():
            return {"train_loss": float(0.5 * (model.x - self.center).pow(2).sum()), "test_accuracy": None}

    def full_grad_norm_sq(self, model):
        with torch.no_grad():
            return float((model.x - self.center).pow(2).sum())


@functools.lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    X = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(12345))  # fixed split
    n_test = len(y) // 5
    te, tr = perm[:n_test], perm[n_test:]
    mean = X[tr].mean(0)
    return X[tr] - mean, y[tr], X[te] - mean, y[te]


@dataclass
class Shard:
    X: torch.Tensor
    y: torch.Tensor


class Classification(Task):
    """A supervised classification task on tensors held in memory."""

    classification = True

    def __init__(self, X_train, y_train, X_test, y_test, split: str = "iid"):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is unknown; choose one of: {', '.join(SPLITS)}")
        self.X_train, self.y_train, self.X_test, self.y_test = X_train, y_train, X_test, y_test
        self.split = split

    def shard(self, rank, world_size, seed):
        """iid: a random 1/n of the samples. label: worker i holds the classes
        c with c mod n == i (one class each when n equals the number of
        classes); when workers outnumber classes, the workers that share a
        class (i mod C == c) split its samples."""
        if world_size > len(self.y_train):
            raise ValueError(f"workers={world_size} exceeds the {len(self.y_train)} training samples")
        perm = torch.randperm(len(self.y_train), generator=torch.Generator().manual_seed(seed))
        if self.split == "iid":
            idx = torch.tensor_split(perm, world_size)[rank]
            return Shard(self.X_train[idx], self.y_train[idx])
        classes = torch.unique(self.y_train).tolist()
        y = self.y_train[perm]
        if world_size <= len(classes):
            mine = [c for i, c in enumerate(classes) if i % world_size == rank]
            idx = perm[torch.isin(y, torch.tensor(mine))]
        else:
            c = classes[rank % len(classes)]
            sharing = [i for i in range(world_size) if i % len(classes) == rank % len(classes)]
            idx = torch.tensor_split(perm[y == c], len(sharing))[sharing.index(rank)]
        return Shard(self.X_train[idx], self.y_train[idx])

    def sample(self, shard, batch_size, gen):
        idx = torch.randint(len(shard.y), (batch_size,), generator=gen)
        return shard.X[idx], shard.y[idx]

    def loss(self, model, batch):
        X, y = batch
        return F.cross_entropy(model(X), y)

    def evaluate(self, model):
        with torch.no_grad():
            train_loss = float(F.cross_entropy(model(self.X_train), self.y_train))
            acc = float((model(self.X_test).argmax(1) == self.y_test).float().mean())
        return {"train_loss": train_loss, "test_accuracy": acc}

    def full_grad_norm_sq(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(F.cross_entropy(model(self.X_train), self.y_train), params)
        return float(sum(g.pow(2).sum() for g in grads))


class DigitsMLP(Classification):
    name = "digits-mlp"

    def __init__(self, hidden: int = 128, split: str = "iid"):
        super().__init__(*_digits(), split=split)
        self.hidden = hidden

    def make_model(self):
        return nn.Sequential(nn.Linear(64, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))


TASKS = {"quadratic": Quadratic, "digits-mlp": DigitsMLP}


def make_task(name: str, **kwargs) -> Task:
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"task={name!r} is unknown; choose one of: {', '.join(TASKS)}") from None
    return cls(**kwargs)
