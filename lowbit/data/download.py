"""Fetching datasets into a local cache, with checksums.

``download(name)`` puts the files of ``name`` into ``CACHE_DIR/name`` (the
``LOWBIT_DATA`` environment variable, else ``~/.cache/lowbit``), verifies each
against its published digest and returns the folder. Nothing in the test
suite calls it. ``find_dataset_dir(name, data_dir)`` says where a task reads
the data from: ``data_dir`` if given, else a system copy (Debian's
``dataset-fashion-mnist`` package installs /usr/share/datasets/fashion-mnist),
else the cache; it raises FileNotFoundError with instructions otherwise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request

_MNIST_NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")

# name -> base URL, {file: (hash algorithm, hex digest)}, system copies, format.
# Digests are the MD5s published for the upstream files (by the datasets'
# authors, and the same that torchvision checks). Debian's copy of
# Fashion-MNIST is recompressed, so its .gz files have other digests: system
# copies are read as they are, only downloads are checked.
DATASETS = {
    "mnist": dict(url="https://ossci-datasets.s3.amazonaws.com/mnist/", format="idx", system=(), files=dict(zip(
        _MNIST_NAMES, [("md5", "f68b3c2dcbeaaa9fbdd348bbdeb94873"), ("md5", "d53e105ee54ea40749a09fcbcd1e9432"),
                       ("md5", "9fb629c4189551a2d022fa330f9573f3"), ("md5", "ec29112dd5afa0611ce80d1b7f02629c")]))),
    "fashion-mnist": dict(url="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/", format="idx",
                          system=("/usr/share/datasets/fashion-mnist",), files=dict(zip(
                              _MNIST_NAMES, [("md5", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
                                             ("md5", "25c81989df183df01b3e8a0aad5dffbe"),
                                             ("md5", "bef4ecab320f06d8554ea6380940ec79"),
                                             ("md5", "bb300cfdad3c16e7a12a480ee83cd310")]))),
    "kmnist": dict(url="http://codh.rois.ac.jp/kmnist/dataset/kmnist/", format="idx", system=(), files=dict(zip(
        _MNIST_NAMES, [("md5", "bdb82020997e1d708af4cf47b453dcf7"), ("md5", "e144d726b3acfaa3e44228e80efcd344"),
                       ("md5", "5c965bf0a639b31b8f53240b1b52f4d7"), ("md5", "7320c461ea6c1c855c0b718fb2a4b134")]))),
    "cifar10": dict(url="https://www.cs.toronto.edu/~kriz/", format="cifar", system=(), files={
        "cifar-10-binary.tar.gz": ("md5", "c32a1d4ab5d03f1284b67883e8d87530")}),
}

CACHE_DIR = os.environ.get("LOWBIT_DATA", os.path.join(os.path.expanduser("~"), ".cache", "lowbit"))


def _check_name(name: str) -> dict:
    if name not in DATASETS:
        raise ValueError(f"dataset={name!r} is unknown; choose one of: {', '.join(DATASETS)}")
    return DATASETS[name]


def file_digest(path: str, algorithm: str) -> str:
    """The hex digest of the file at ``path`` under ``algorithm`` (a hashlib name, e.g. ``sha256``)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _marker(folder: str, archive: str) -> str:
    """The file written after ``archive`` was extracted completely into ``folder``."""
    return os.path.join(folder, f".{archive}.extracted")


def _extracted(folder: str, archive: str, digest: str) -> bool:
    """Whether ``archive`` (of this digest) was extracted to the end: an interrupted
    extraction leaves no marker, and is redone."""
    try:
        with open(_marker(folder, archive)) as f:
            return f.read().strip() == digest
    except OSError:
        return False


_CIFAR_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6)) + ("test_batch.bin",)


def _complete(folder: str, spec: dict) -> bool:
    if spec["format"] == "cifar":
        archives = [(f, d) for f, (_, d) in spec["files"].items() if f.endswith(".tar.gz")]
        if any(os.path.isfile(os.path.join(folder, f)) and not _extracted(folder, f, d) for f, d in archives):
            return False  # an archive whose extraction did not finish
        return any(all(os.path.isfile(os.path.join(base, f)) for f in _CIFAR_FILES)
                   for base in (os.path.join(folder, "cifar-10-batches-bin"), folder))
    return all(os.path.isfile(os.path.join(folder, f)) or os.path.isfile(os.path.join(folder, f[:-3]))
               for f in spec["files"])


def download(name: str, cache_dir: str | None = None, timeout: float = 60.0) -> str:
    """Download ``name`` into ``cache_dir/name`` (skipping files already there
    and verified); returns the folder. Offline -> RuntimeError naming the URL;
    a digest mismatch -> ValueError (the bad file is not kept)."""
    spec = _check_name(name)
    folder = os.path.join(cache_dir or CACHE_DIR, name)
    os.makedirs(folder, exist_ok=True)
    for fname, (algo, digest) in spec["files"].items():
        dest = os.path.join(folder, fname)
        if os.path.isfile(dest) and file_digest(dest, algo) == digest:
            if fname.endswith(".tar.gz") and not _extracted(folder, fname, digest):
                _extract(dest, folder, fname, digest)  # verified archive, interrupted extraction: redo it
            continue
        url = spec["url"] + fname
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
                shutil.copyfileobj(resp, out)
            got = file_digest(tmp, algo)
            if got != digest:
                raise ValueError(f"{url}: {algo} {got} does not match the published {digest}")
            os.replace(tmp, dest)
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"cannot download {url} ({e}); fetch it by hand into {folder} "
                               f"or pass --data-dir") from e
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        if fname.endswith(".tar.gz"):
            _extract(dest, folder, fname, digest)
    return folder


def _extract(archive_path: str, folder: str, fname: str, digest: str) -> None:
    """Extract (path traversal blocked by the "data" filter); the marker is written,
    fsynced and renamed into place only after the last member is out."""
    marker = _marker(folder, fname)
    if os.path.exists(marker):
        os.remove(marker)
    with tarfile.open(archive_path, "r:gz") as tar:
        tar.extractall(folder, filter="data")
    tmp = marker + ".tmp"
    with open(tmp, "w") as f:
        f.write(digest + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)


def find_dataset_dir(name: str, data_dir: str | None = None) -> str:
    """The folder a task reads ``name`` from (see the module docstring)."""
    spec = _check_name(name)
    if data_dir is not None:
        if not os.path.isdir(data_dir):
            raise FileNotFoundError(f"data_dir={data_dir!r} is not a folder")
        return data_dir
    for folder in (*spec["system"], os.path.join(CACHE_DIR, name)):
        if os.path.isdir(folder) and _complete(folder, spec):
            return folder
    raise FileNotFoundError(f"no local copy of {name}: pass --data-dir, or run "
                            f"`python -c \"from lowbit.data import download; download('{name}')\"` "
                            f"(fetches from {spec['url']} into {os.path.join(CACHE_DIR, name)})")
