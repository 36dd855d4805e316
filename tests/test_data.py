"""Dataset loaders (IDX, CIFAR-10 binary), models, and the image tasks."""

import os

import numpy as np
import pytest
import torch

from lowbit.data import find_dataset_dir, load_cifar10, load_mnist_like, read_cifar_batch, read_idx, write_idx
from lowbit.data.cifar import write_cifar_batch
from lowbit.data.download import DATASETS
from lowbit.models import LeNet5, SmallVGG, count_parameters, fc300_100, resnet
from lowbit.train import TrainConfig, train
from lowbit.train.tasks import TASKS

torch.set_num_threads(1)
FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((3, 4, 5)) * 100).astype(dtype)
    path = str(tmp_path / f"a.idx{suffix}")
    write_idx(path, a)
    b = read_idx(path)
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_idx_header_is_big_endian(tmp_path):
    path = str(tmp_path / "x")
    write_idx(path, np.array([1, 258], dtype=np.int32))
    assert open(path, "rb").read() == bytes([0, 0, 0x0C, 1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 1, 2])


def test_idx_bad_files(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x01\x00\x08\x01")
    with pytest.raises(ValueError, match="not an IDX"):
        read_idx(str(p))
    p.write_bytes(b"\x00\x00\x07\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValueError, match="type code 0x07"):
        read_idx(str(p))
    p.write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x03\x05")
    with pytest.raises(ValueError, match="body has 1 bytes"):
        read_idx(str(p))
    g = tmp_path / "bad.gz"
    g.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="cannot read"):
        read_idx(str(g))
    with pytest.raises(ValueError, match="no IDX type"):
        write_idx(str(tmp_path / "c"), np.zeros(2, dtype=np.complex64))


def _write_mnist(folder, n_train=200, n_test=50, gz=True, seed=0):
    """Synthetic MNIST-format data whose class is readable from the image."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for part, n in (("train", n_train), ("t10k", n_test)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        X = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(y):
            X[i, 2 * c:2 * c + 3, :] = 250
        sfx = ".gz" if gz else ""
        write_idx(os.path.join(folder, f"{part}-images-idx3-ubyte{sfx}"), X)
        write_idx(os.path.join(folder, f"{part}-labels-idx1-ubyte{sfx}"), y)
    return folder


@pytest.mark.parametrize("gz", [True, False])
def test_load_mnist_like(tmp_path, gz):
    folder = _write_mnist(str(tmp_path), gz=gz)
    Xtr, ytr, Xte, yte = load_mnist_like(folder)
    sfx = ".gz" if gz else ""
    assert torch.equal(Xtr, torch.from_numpy(read_idx(os.path.join(folder, f"train-images-idx3-ubyte{sfx}"))))
    assert Xtr.shape == (200, 28, 28) and ytr.dtype == torch.int64 and Xte.shape == (50, 28, 28)
    os.remove(os.path.join(folder, f"t10k-labels-idx1-ubyte{sfx}"))
    with pytest.raises(FileNotFoundError, match="t10k-labels"):
        load_mnist_like(folder)


def test_load_mnist_like_mismatch(tmp_path):
    folder = _write_mnist(str(tmp_path))
    write_idx(os.path.join(folder, "train-labels-idx1-ubyte.gz"), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        load_mnist_like(folder)


def _write_cifar(folder, n=20, batches=2, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    out = []
    for name in [f"data_batch_{i + 1}.bin" for i in range(batches)] + ["test_batch.bin"]:
        X = rng.integers(0, 256, (n, 3, 32, 32)).astype(np.uint8)
        y = rng.integers(0, 10, n)
        write_cifar_batch(os.path.join(folder, name), X, y)
        out.append((X, y))
    return out


def test_cifar_round_trip_and_layout(tmp_path):
    written = _write_cifar(str(tmp_path))
    Xtr, ytr, Xte, yte = load_cifar10(str(tmp_path))
    assert torch.equal(Xtr, torch.from_numpy(np.concatenate([written[0][0], written[1][0]])))
    assert torch.equal(ytr, torch.from_numpy(np.concatenate([written[0][1], written[1][1]])))
    assert torch.equal(Xte, torch.from_numpy(written[2][0])) and torch.equal(yte, torch.from_numpy(written[2][1]))
    raw = open(tmp_path / "test_batch.bin", "rb").read()  # record: label, R plane, G plane, B plane
    assert raw[0] == written[2][1][0] and raw[1 + 1024] == written[2][0][0, 1, 0, 0]


def test_cifar_bad_files(tmp_path):
    p = tmp_path / "b.bin"
    p.write_bytes(b"\x00" * 3000)
    with pytest.raises(ValueError, match="3073-byte"):
        read_cifar_batch(str(p))
    p.write_bytes(bytes([12]) + b"\x00" * 3072)
    with pytest.raises(ValueError, match="out of range"):
        read_cifar_batch(str(p))
    with pytest.raises(FileNotFoundError, match="data_batch"):
        load_cifar10(str(tmp_path))
    with pytest.raises(ValueError, match="uint8"):
        write_cifar_batch(str(p), np.zeros((1, 3, 32, 32), np.float32), [0])


def test_model_parameter_counts_and_shapes():
    x1, x3 = torch.randn(2, 1, 28, 28), torch.randn(2, 3, 32, 32)
    assert count_parameters(fc300_100()) == 266_610
    assert count_parameters(LeNet5()) == 61_706
    assert count_parameters(resnet(20)) == 269_722
    assert count_parameters(resnet(110)) == 1_727_962
    assert count_parameters(SmallVGG()) == 539_178
    assert fc300_100()(x1).shape == LeNet5()(x1).shape == (2, 10)
    assert resnet(20)(x3).shape == SmallVGG()(x3).shape == (2, 10)
    assert LeNet5(in_channels=3, size=32)(x3).shape == (2, 10)
    with pytest.raises(ValueError, match="6n\\+2"):
        resnet(21)
    with pytest.raises(ValueError, match="layout"):
        SmallVGG(layout=("M",))


def test_dataset_lookup(tmp_path):
    with pytest.raises(ValueError, match="dataset="):
        find_dataset_dir("imagenet")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        find_dataset_dir("mnist", str(tmp_path / "missing"))
    assert find_dataset_dir("mnist", str(tmp_path)) == str(tmp_path)
    assert set(DATASETS) == {"mnist", "fashion-mnist", "kmnist", "cifar10"}
    for spec in DATASETS.values():
        for algo, digest in spec["files"].values():
            assert len(digest) == {"sha256": 64, "md5": 32}[algo]


def test_fashion_lenet_trains_on_synthetic_data(tmp_path):
    folder = _write_mnist(str(tmp_path / "fm"), n_train=400, n_test=100)
    cfg = TrainConfig(task="fashion-lenet", data_dir=folder, workers=2, steps=20, algorithm="dpsgd",
                      eval_every=10)
    run = train(cfg)
    assert run is not None
    task = TASKS["fashion-lenet"].from_config(cfg)
    assert task.X_train.shape == (400, 1, 28, 28)
    assert abs(float(task.X_train.mean())) < 1e-4 and abs(float(task.X_train.std()) - 1) < 1e-3


def test_resnet_task_evaluation_leaves_batchnorm_stats(tmp_path):
    _write_cifar(str(tmp_path), n=30)
    task = TASKS["cifar10-resnet20"](data_dir=str(tmp_path))
    torch.manual_seed(0)
    model = task.make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = task.evaluate(model)
    assert 0 <= m["test_accuracy"] <= 1 and m["train_loss"] > 0 and task.full_grad_norm_sq(model) > 0
    assert model.training
    for k, v in model.state_dict().items():
        if "num_batches_tracked" not in k:
            assert torch.equal(v, before[k]), k


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="Debian dataset-fashion-mnist not installed")
def test_debian_fashion_mnist():
    Xtr, ytr, Xte, yte = load_mnist_like(FASHION)
    assert Xtr.shape == (60000, 28, 28) and Xte.shape == (10000, 28, 28)
    assert torch.equal(torch.bincount(ytr), torch.full((10,), 6000))


def test_kmnist_and_resnet110_tasks(tmp_path):
    folder = _write_mnist(str(tmp_path / "km"), n_train=50, n_test=20)
    task = TASKS["kmnist-fc300"](data_dir=folder)
    assert task.dataset == "kmnist" and sum(p.numel() for p in task.make_model().parameters()) == 266_610
    assert TASKS["kmnist-lenet"].dataset == "kmnist"
    _write_cifar(str(tmp_path / "c"), n=10)
    n = sum(p.numel() for p in TASKS["cifar10-resnet110"](data_dir=str(tmp_path / "c")).make_model().parameters())
    assert 1.70e6 < n < 1.75e6  # He et al.: ResNet-110 has 1.7M parameters


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_has_training_defaults(name):
    """``lowbit train --task NAME`` needs no other option: lr, momentum, weight decay and batch are defaulted."""
    cfg = TrainConfig(task=name)
    assert cfg.lr > 0 and 0 <= cfg.momentum < 1 and cfg.weight_decay >= 0 and cfg.batch_size >= 1
