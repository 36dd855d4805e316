"""Tasks: a dataset, a model, a loss, and how data is split over workers.

- ``quadratic``: Theorem 1 of the Moniqua paper, f_i(x) = ||x - (delta/2) 1||^2 / 2
  on every worker (dimension ``dim``), optional Gaussian gradient noise.
- ``digits-mlp``: scikit-learn's 8x8 digits (ships with scikit-learn, no
  download), a fixed 80/20 train/test split, a one-hidden-layer MLP.
- ``fashion-lenet``, ``fashion-fc300``, ``mnist-lenet``, ``mnist-fc300``,
  ``kmnist-lenet``, ``kmnist-fc300``: Fashion-MNIST / MNIST / KMNIST IDX
  files (``--data-dir``, the Debian package, or the cache of
  :func:`lowbit.data.download`) with LeNet-5 or FC-300-100; metrics on a
  fixed 10,000-sample training subset and the full 10,000 test set.
- ``cifar10-resnet20``, ``cifar10-resnet110``, ``cifar10-vgg``: CIFAR-10
  binary batches with ResNet-20, ResNet-110 or a small VGG; metrics on fixed
  2,000-sample train and test subsets (the full sets are slow on CPU).
Each task class builds itself from a TrainConfig with ``from_config``.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models import LeNet5, ResNetCifar, SmallVGG, fc300_100

SPLITS = ("iid", "label")


class Task(ABC):
    """Data stay on the CPU (one copy for all thread workers); minibatches and evaluation
    chunks move to ``device``, where the model is (:meth:`to`)."""

    name = "task"
    classification = False
    device = torch.device("cpu")

    def to(self, device: torch.device | str) -> "Task":
        """Compute on ``device`` from now on (the caller moves the model there)."""
        self.device = torch.device(device)
        return self

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    @classmethod
    def from_config(cls, cfg) -> "Task":
        """The task as a TrainConfig configures it."""
        return cls()

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
    """Worker i minimises f_i(x) = ||x - b_i||^2 / 2 over ``dim`` coordinates, the b_i
    spread by ``delta`` around a common point; ``noise``: the standard deviation of the
    Gaussian noise added to each stochastic gradient. A problem whose optimum and
    consensus distance are known in closed form (for tests and theory checks)."""

    name = "quadratic"

    def __init__(self, dim: int = 16, delta: float = 0.1, noise: float = 0.0):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        self.dim, self.delta, self.noise = dim, delta, noise
        self.center = torch.full((dim,), delta / 2)

    @classmethod
    def from_config(cls, cfg):
        return cls(dim=cfg.dim, delta=cfg.delta, noise=cfg.noise)

    def make_model(self):
        m = nn.Module()
        m.x = nn.Parameter(torch.zeros(self.dim))  # A4: x_0 = 0
        return m

    def to(self, device):
        super().to(device)
        self.center = self.center.to(self.device)
        return self

    def sample(self, shard, batch_size, gen):  # drawn on the CPU: the same noise on every device
        return self._dev(torch.randn(self.dim, generator=gen) * self.noise) if self.noise > 0 else None

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
        return self._dev(shard.X[idx]), self._dev(shard.y[idx])

    def loss(self, model, batch):
        X, y = batch
        return F.cross_entropy(model(X), y)

    def evaluate(self, model):
        with torch.no_grad():
            train_loss = float(F.cross_entropy(model(self._dev(self.X_train)), self._dev(self.y_train)))
            acc = float((model(self._dev(self.X_test)).argmax(1) == self._dev(self.y_test)).float().mean())
        return {"train_loss": train_loss, "test_accuracy": acc}

    def full_grad_norm_sq(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(F.cross_entropy(model(self._dev(self.X_train)), self._dev(self.y_train)), params)
        return float(sum(g.pow(2).sum() for g in grads))


class DigitsMLP(Classification):
    """scikit-learn's 8x8 digits (1,797 images, offline), an MLP with one hidden layer of
    ``hidden`` units; ``split``: how the training set is dealt to workers (``iid``, or
    ``label`` for one group of labels per worker)."""

    name = "digits-mlp"

    def __init__(self, hidden: int = 128, split: str = "iid"):
        super().__init__(*_digits(), split=split)
        self.hidden = hidden

    @classmethod
    def from_config(cls, cfg):
        return cls(hidden=cfg.hidden, split=cfg.split)

    def make_model(self):
        return nn.Sequential(nn.Linear(64, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))


@functools.lru_cache(maxsize=4)
def _image_data(dataset: str, folder: str):
    """Normalised float tensors of ``dataset`` from ``folder``, cached so the
    thread workers of one run share one copy. Images are scaled to [0, 1],
    then standardised per channel with the training set's mean and std."""
    from ..data import load_cifar10, load_mnist_like

    Xtr, ytr, Xte, yte = (load_cifar10 if dataset == "cifar10" else load_mnist_like)(folder)
    if Xtr.dim() == 3:  # [N, H, W] -> [N, 1, H, W]
        Xtr, Xte = Xtr[:, None], Xte[:, None]
    Xtr, Xte = Xtr.float().div_(255.0), Xte.float().div_(255.0)
    mean = Xtr.mean((0, 2, 3), keepdim=True)
    std = Xtr.std((0, 2, 3), keepdim=True).clamp_min(1e-6)
    return Xtr.sub_(mean).div_(std), ytr, Xte.sub_(mean).div_(std), yte


class _FrozenBatchStats:
    """Evaluation of BatchNorm models: normalise with each chunk's batch
    statistics (as in training) without touching the running averages. The
    averaged model x-bar that the loop evaluates never ran forward passes, so
    its running statistics would be meaningless."""

    def __init__(self, model: nn.Module):
        self.bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.model = model

    def __enter__(self):
        self.saved = [(m.training, m.momentum) for m in self.bns]
        self.mode = self.model.training
        self.model.eval()
        for m in self.bns:
            m.train()
            m.momentum = 0.0  # running = 1 * running + 0 * batch: unchanged
        return self

    def __exit__(self, *exc):
        self.model.train(self.mode)
        for m, (training, momentum) in zip(self.bns, self.saved):
            m.train(training)
            m.momentum = momentum


class ImageClassification(Classification):
    """An image dataset read from disk plus a model. Metrics use fixed subsets
    (the first ``eval_train`` training and ``eval_test`` test samples of a
    fixed permutation) evaluated in chunks of ``eval_chunk``, so that
    evaluation stays affordable on CPU."""

    dataset = "mnist"
    eval_train = 10000
    eval_test = 10000
    eval_chunk = 1000

    def __init__(self, data_dir: str | None = None, split: str = "iid"):
        from ..data import find_dataset_dir

        folder = find_dataset_dir(self.dataset, data_dir)
        super().__init__(*_image_data(self.dataset, os.path.abspath(folder)), split=split)
        g = torch.Generator().manual_seed(54321)
        self.eval_tr = torch.randperm(len(self.y_train), generator=g)[:self.eval_train]
        self.eval_te = torch.randperm(len(self.y_test), generator=g)[:self.eval_test]

    @classmethod
    def from_config(cls, cfg):
        return cls(data_dir=cfg.data_dir, split=cfg.split)

    def _chunks(self, X, y, idx):
        """(inputs, labels) of ``idx`` in chunks of ``eval_chunk``, on the task's device."""
        for c in torch.split(idx, self.eval_chunk):
            yield self._dev(X[c]), self._dev(y[c])

    def evaluate(self, model):
        loss_sum, correct = 0.0, 0
        with torch.no_grad(), _FrozenBatchStats(model):
            for X, y in self._chunks(self.X_train, self.y_train, self.eval_tr):
                loss_sum += float(F.cross_entropy(model(X), y, reduction="sum"))
            for X, y in self._chunks(self.X_test, self.y_test, self.eval_te):
                correct += int((model(X).argmax(1) == y).sum())
        return {"train_loss": loss_sum / len(self.eval_tr), "test_accuracy": correct / len(self.eval_te)}

    def full_grad_norm_sq(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        with _FrozenBatchStats(model):
            for X, y in self._chunks(self.X_train, self.y_train, self.eval_tr):
                loss = F.cross_entropy(model(X), y, reduction="sum") / len(self.eval_tr)
                for t, g in zip(total, torch.autograd.grad(loss, params)):
                    t += g
        return float(sum(t.pow(2).sum() for t in total))


class FashionLeNet(ImageClassification):
    """LeNet-5 on Fashion-MNIST (28x28 grey images, 10 classes)."""

    name, dataset = "fashion-lenet", "fashion-mnist"

    def make_model(self):
        return LeNet5(in_channels=1, size=self.X_train.shape[-1])


class FashionFC300(ImageClassification):
    """The FC 300-100 net on Fashion-MNIST."""

    name, dataset = "fashion-fc300", "fashion-mnist"

    def make_model(self):
        return fc300_100(in_features=self.X_train[0].numel())


class MnistLeNet(FashionLeNet):
    """LeNet-5 on MNIST."""

    name, dataset = "mnist-lenet", "mnist"


class MnistFC300(FashionFC300):
    """The FC 300-100 net on MNIST."""

    name, dataset = "mnist-fc300", "mnist"


class KmnistLeNet(FashionLeNet):
    """LeNet-5 on Kuzushiji-MNIST."""

    name, dataset = "kmnist-lenet", "kmnist"


class KmnistFC300(FashionFC300):
    """The FC 300-100 net on Kuzushiji-MNIST."""

    name, dataset = "kmnist-fc300", "kmnist"


class Cifar10ResNet20(ImageClassification):
    """ResNet-20 on CIFAR-10 (evaluated on 2,000 training and 2,000 test images)."""

    name, dataset = "cifar10-resnet20", "cifar10"
    eval_train = eval_test = 2000
    eval_chunk = 500

    def make_model(self):
        return ResNetCifar(20)


class Cifar10ResNet110(Cifar10ResNet20):
    """ResNet-110 on CIFAR-10."""

    name = "cifar10-resnet110"

    def make_model(self):
        return ResNetCifar(110)


class Cifar10VGG(Cifar10ResNet20):
    """A small VGG (BatchNorm) on CIFAR-10."""

    name = "cifar10-vgg"

    def make_model(self):
        return SmallVGG()


TASKS = {"quadratic": Quadratic, "digits-mlp": DigitsMLP,
         **{c.name: c for c in (FashionLeNet, FashionFC300, MnistFC300, MnistLeNet, KmnistLeNet, KmnistFC300,
                                      Cifar10ResNet20, Cifar10ResNet110, Cifar10VGG)}}


def make_task(name: str, **kwargs) -> Task:
    """The task registered as ``name`` (``lowbit.train.tasks.TASKS``), built with ``kwargs``."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"task={name!r} is unknown; choose one of: {', '.join(TASKS)}") from None
    return cls(**kwargs)


# The NDQSG paper's (002) models: its "LeNet" on the MNIST-like sets, CifarNet on CIFAR-10.
from ..models import CifarNet, LeNetTF  # noqa: E402


class FashionLeNetTF(ImageClassification):
    """The NDQSG paper's LeNet (1,663,370 parameters) on Fashion-MNIST."""

    name, dataset = "fashion-lenet-tf", "fashion-mnist"

    def make_model(self):
        return LeNetTF(in_channels=1, size=self.X_train.shape[-1])


class MnistLeNetTF(FashionLeNetTF):
    """The NDQSG paper's LeNet on MNIST."""

    name, dataset = "mnist-lenet-tf", "mnist"


class KmnistLeNetTF(FashionLeNetTF):
    """The NDQSG paper's LeNet on Kuzushiji-MNIST."""

    name, dataset = "kmnist-lenet-tf", "kmnist"


class Cifar10CifarNet(Cifar10ResNet20):
    """The TensorFlow tutorial's CifarNet (1,068,298 parameters) on CIFAR-10."""

    name = "cifar10-cifarnet"

    def make_model(self):
        return CifarNet()


TASKS.update({c.name: c for c in (FashionLeNetTF, MnistLeNetTF, KmnistLeNetTF, Cifar10CifarNet)})
