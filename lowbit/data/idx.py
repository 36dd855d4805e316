"""IDX files (the MNIST format): a 4-byte magic ``0 0 <type> <ndim>``, ``ndim``
big-endian uint32 sizes, then the array in big-endian C order. Files whose
name ends in ``.gz`` are gzip-compressed."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import torch

from .errors import DataError

# IDX type code -> numpy dtype (big-endian on disk).
IDX_DTYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_CODES = {v.newbyteorder("=") if v.itemsize > 1 else v: k for k, v in IDX_DTYPES.items()}

MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
               "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def _open(path: str):
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """The array stored in an IDX file (native byte order). Raises ValueError
    naming the file when the header or the length is wrong."""
    try:
        with _open(path) as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read IDX file ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: not an IDX file (magic must start with two zero bytes)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise DataError(f"{path}: unknown IDX type code 0x{code:02x}; valid: "
                         f"{', '.join(f'0x{c:02x}' for c in IDX_DTYPES)}")
    if ndim < 1:
        raise DataError(f"{path}: IDX file has ndim=0, must be >= 1")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, need {head})")
    shape = struct.unpack(f">{ndim}I", raw[4:head])
    dtype = IDX_DTYPES[code]
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - head != need:
        raise DataError(f"{path}: IDX body has {len(raw) - head} bytes, header {shape} of {dtype} needs {need}")
    return np.frombuffer(raw, dtype=dtype, offset=head).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str, array) -> None:
    """Write ``array`` as an IDX file (gzip when ``path`` ends in ``.gz``)."""
    a = np.asarray(array)
    key = a.dtype.newbyteorder("=") if a.dtype.itemsize > 1 else a.dtype
    if key not in _CODES:
        raise ValueError(f"array dtype {a.dtype} has no IDX type; valid: uint8, int8, int16, int32, float32, float64")
    if a.ndim < 1 or a.ndim > 255:
        raise ValueError(f"array ndim must be in 1..255, got {a.ndim}")
    code = _CODES[key]
    body = a.astype(IDX_DTYPES[code]).tobytes()
    data = bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + body
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(data)


def _find(root: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        p = os.path.join(root, name)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"{root}: missing {stem} (or {stem}.gz)")


NUM_CLASSES = 10  # MNIST, Fashion-MNIST, KMNIST


def load_mnist_like(root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X_train uint8 [N,28,28], y_train int64, X_test, y_test) from a folder
    with the four MNIST-named IDX files (plain or .gz)."""
    a = {k: read_idx(_find(root, stem)) for k, stem in MNIST_FILES.items()}
    for part in ("train", "test"):
        X, y = a[f"{part}_images"], a[f"{part}_labels"]
        if X.ndim != 3 or y.ndim != 1 or len(X) != len(y):
            raise DataError(f"{root}: {part} images {X.shape} and labels {y.shape} do not match "
                             "(need [N,H,W] images and N labels)")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= NUM_CLASSES):
            bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
            raise DataError(f"{root}: {part} label {bad} is out of range 0..{NUM_CLASSES - 1} (not an "
                             f"MNIST-like dataset of {NUM_CLASSES} classes?)")
    return (torch.from_numpy(a["train_images"].copy()), torch.from_numpy(a["train_labels"].astype(np.int64)),
            torch.from_numpy(a["test_images"].copy()), torch.from_numpy(a["test_labels"].astype(np.int64)))
