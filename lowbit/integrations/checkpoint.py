"""Checkpoint files: written atomically, checksummed, loaded without running code.

File layout: the 8-byte magic ``LOWBITCK``, a little-endian uint32 format
version, the 32-byte SHA-256 of the body, the body's length (uint64), then the
body: ``torch.save`` of the state, which must hold only tensors, numbers,
strings, None, and lists/tuples/dicts of them (so that it loads with
``torch.load(..., weights_only=True)``: nothing in it can run code).

:func:`save_checkpoint` writes ``PATH.tmp-PID``, fsyncs it, keeps the
checkpoint already at ``PATH`` (if any) as ``PATH.prev`` and renames the new
file onto ``PATH`` (then fsyncs the folder): a crash at any moment leaves
either the old or the new checkpoint complete at ``PATH``.
:func:`load_checkpoint` refuses a file whose magic, length or checksum is
wrong with a :class:`CheckpointError` naming the file (and ``PATH.prev`` when
that exists).

Random number generator states are stored as tensors (:func:`rng_state`,
:func:`set_rng_state`): torch's and CUDA's byte tensors, numpy's MT19937 key
and position, Python's Mersenne Twister state.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import struct

import numpy as np
import torch

MAGIC = b"LOWBITCK"
VERSION = 1
_HEAD = struct.Struct("<8sI32sQ")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run resuming from it."""


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(state: dict, path: str | os.PathLike) -> str:
    """Write ``state`` to ``path`` atomically with its checksum (see the module doc); returns the path."""
    path = os.fspath(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, hashlib.sha256(body).digest(), len(body)))
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):  # keep the previous checkpoint; PATH itself is never absent
            prev_tmp = f"{path}.prev.tmp-{os.getpid()}"
            if os.path.exists(prev_tmp):
                os.remove(prev_tmp)
            os.link(path, prev_tmp)
            os.replace(prev_tmp, path + ".prev")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(folder)
    return path


def load_checkpoint(path: str | os.PathLike, map_location=None) -> dict:
    """The state :func:`save_checkpoint` wrote to ``path``, checked against its checksum and
    loaded with ``weights_only=True``; :class:`CheckpointError` otherwise."""
    path = os.fspath(path)
    prev = path + ".prev"
    hint = f"; the previous checkpoint {prev} may be used instead" if os.path.isfile(prev) else ""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist{hint}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    if len(raw) < _HEAD.size or raw[:8] != MAGIC:
        raise CheckpointError(f"checkpoint {path} is not a lowbit checkpoint (no {MAGIC.decode()} header: "
                              f"written by another program, or truncated){hint}")
    _, version, digest, length = _HEAD.unpack_from(raw)
    if version != VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this lowbit reads {VERSION}")
    body = raw[_HEAD.size:]
    if len(body) != length:
        raise CheckpointError(f"checkpoint {path} is truncated or padded: body of {len(body)} bytes, header "
                              f"says {length}{hint}")
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 does not match the one stored at "
                              f"save time{hint}")
    try:
        return torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything that could run code
        raise CheckpointError(f"checkpoint {path} holds objects that weights_only=True refuses ({e})") from None


def rng_state() -> dict:
    """This process's RNG states as tensors (torch, CUDA's current device when initialised, numpy, python)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    if kind != "MT19937":
        raise ValueError(f"numpy's global generator is {kind}, not MT19937")
    version, internal, gauss_next = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos), "numpy_has_gauss": int(has_gauss), "numpy_gauss": float(gauss),
        "python_version": int(version),
        "python_internal": torch.tensor(internal, dtype=torch.int64),
        "python_gauss_next": gauss_next,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_internal"].tolist()),
                     state["python_gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


_OPS = ("neighbor", "all_reduce", "all_gather", "broadcast", "gather", "gossip")


def ledger_state(ledger) -> dict:
    """A transport ledger's records as tensors (so that bytes and messages continue after a resume)."""
    rows = ledger.to_rows()
    ops = sorted({r[1] for r in rows} | set(_OPS))
    table = torch.tensor([[s, ops.index(op), nb, sent, msgs, peers] for s, op, nb, sent, msgs, peers in rows],
                         dtype=torch.int64).reshape(-1, 6)
    return {"ops": ops, "rows": table}


def restore_ledger(ledger, state: dict) -> None:
    """Put :func:`ledger_state`'s records back into ``ledger`` (replacing what it held)."""
    from ..comm.ledger import CommRecord

    ops = state["ops"]
    ledger.records.clear()
    for s, op, nb, sent, msgs, peers in state["rows"].tolist():
        ledger.records[s].append(CommRecord(ops[op], nb, sent, msgs, peers))


def newest_common_step(table: list[list[int]], where: str) -> int | None:
    """The newest step that every rank has a good checkpoint of. ``table[r]``: the steps of
    rank r's candidate files (-1: missing or corrupt). None when no rank has any checkpoint;
    a :class:`CheckpointError` when some do but no step is common to all."""
    if all(s < 0 for row in table for s in row):
        return None
    common = set.intersection(*({s for s in row if s >= 0} for row in table))
    if not common:
        raise CheckpointError(f"cannot resume from {where}: no step has a good checkpoint on every rank "
                              f"(steps per rank, current and previous file: {table}); every rank must "
                              f"resume from the same step")
    return max(common)


def candidates(path: str | os.PathLike) -> list[tuple[int, dict | None]]:
    """(step, state) of ``path`` and of the previous checkpoint ``path.prev``; (-1, None)
    for a file that is missing, corrupt or has no step."""
    path = os.fspath(path)
    out: list[tuple[int, dict | None]] = []
    for p in (path, path + ".prev"):
        try:
            state = load_checkpoint(p)
            out.append((int(state["step"]), state))
        except (CheckpointError, KeyError, TypeError, ValueError):
            out.append((-1, None))
    return out
