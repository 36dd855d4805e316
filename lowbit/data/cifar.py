"""The CIFAR-10 binary format: each record is 1 label byte then 3072 pixel
bytes (the 32x32 red plane, then green, then blue, row-major). The training
set is ``data_batch_1.bin`` .. ``data_batch_5.bin``, the test set
``test_batch.bin`` (10,000 records each in the official release)."""

from __future__ import annotations

import glob
import os

import numpy as np
import torch

from .errors import DataError

RECORD = 1 + 3 * 32 * 32


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N,3,32,32], labels int64 [N]) from one binary batch file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read CIFAR-10 batch ({e})") from e
    if len(raw) == 0 or len(raw) % RECORD:
        raise DataError(f"{path}: {len(raw)} bytes is not a positive multiple of the {RECORD}-byte CIFAR-10 record")
    rec = np.frombuffer(raw, dtype=np.uint8).reshape(-1, RECORD)
    labels = rec[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise DataError(f"{path}: label {labels.max()} out of range 0..9 (is this CIFAR-100?)")
    return rec[:, 1:].reshape(-1, 3, 32, 32).copy(), labels


def write_cifar_batch(path: str, images, labels) -> None:
    """Write images uint8 [N,3,32,32] and labels in 0..9 as a binary batch."""
    X, y = np.asarray(images), np.asarray(labels)
    if X.dtype != np.uint8 or X.ndim != 4 or X.shape[1:] != (3, 32, 32):
        raise ValueError(f"images must be uint8 [N,3,32,32], got {X.dtype} {X.shape}")
    if y.shape != (len(X),) or (len(y) and (y.min() < 0 or y.max() > 9)):
        raise ValueError(f"labels must be {len(X)} integers in 0..9")
    rec = np.concatenate([y.astype(np.uint8)[:, None], X.reshape(len(X), -1)], axis=1)
    with open(path, "wb") as f:
        f.write(rec.tobytes())


def load_cifar10(root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X_train uint8 [N,3,32,32], y_train, X_test, y_test) from a folder of
    data_batch_*.bin and test_batch.bin (or its ``cifar-10-batches-bin`` subfolder)."""
    sub = os.path.join(root, "cifar-10-batches-bin")
    if os.path.isdir(sub):
        root = sub
    train = sorted(glob.glob(os.path.join(root, "data_batch_*.bin")))
    test = os.path.join(root, "test_batch.bin")
    if not train or not os.path.isfile(test):
        raise FileNotFoundError(f"{root}: need data_batch_*.bin and test_batch.bin (CIFAR-10 binary version)")
    parts = [read_cifar_batch(p) for p in train]
    Xte, yte = read_cifar_batch(test)
    return (torch.from_numpy(np.concatenate([p[0] for p in parts])),
            torch.from_numpy(np.concatenate([p[1] for p in parts])), torch.from_numpy(Xte), torch.from_numpy(yte))
