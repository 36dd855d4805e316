"""Checkpoint files: written atomically, checksummed, loaded without running code.

A checkpoint file is exactly what ``torch.save(state)`` writes (a zip archive), so
``torch.load(path, weights_only=True)`` reads it, with lowbit's checksum in the zip's
comment, at the end of the file: ``lowbit checkpoint 2 sha256:`` and the hex SHA-256 of
every byte before it (the comment's length field included). The state must hold only
tensors, numbers, strings, None, and lists/tuples/dicts of them (``weights_only=True``:
nothing in it can run code). Files of format 1 (a 52-byte ``LOWBITCK`` header before the
torch.save body) are still read.

:func:`save_checkpoint` writes ``PATH.tmp-PID``, fsyncs it, keeps the
checkpoint already at ``PATH`` (if any) as ``PATH.prev`` and renames the new
file onto ``PATH`` (then fsyncs the folder): a crash at any moment leaves
either the old or the new checkpoint complete at ``PATH``. A process killed
during a save leaves its ``PATH.tmp-PID`` (or ``PATH.prev.tmp-PID``) behind:
the next save of ``PATH``, or resume from it (:func:`candidates`, the wrapper's
``load_checkpoint``), removes those of PIDs no longer alive on this machine
(:func:`remove_stale_temporaries`). A plain :func:`load_checkpoint` removes
nothing: a reader on another machine, where the writer's PID is not visible,
must not break a save in progress.
:func:`load_checkpoint` refuses a file whose checksum is missing (truncated,
or written by another program) or wrong with a :class:`CheckpointError` naming the
file (and ``PATH.prev`` when that exists); :func:`check_fields` refuses one whose
checksum is valid but whose content lacks a field its reader needs, naming the file and the field.

Resuming is collective (:func:`agree_resume`): every rank reads its current
and previous file (:func:`candidates`), the ranks exchange the steps they have
and why a file was refused (a bounded UTF-8 note in a tensor, never a pickle),
and all take the newest step every rank has. A rank that resumes from an older
step than its newest file says so with a :class:`CheckpointFallbackWarning`
naming the refused file, why, and the step it falls back to; with
``fallback="error"`` a refused newest file on any rank is a
:class:`CheckpointError` on every rank instead. :func:`agree_outcome` makes a
failure to restore on one rank the same error on every rank.

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
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

MAGIC = b"LOWBITCK"  # format 1: this magic, a uint32 version, the body's SHA-256 and length, the body
VERSION = 1
_HEAD = struct.Struct("<8sI32sQ")
SEAL = b"lowbit checkpoint 2 sha256:"  # format 2: the zip comment, then the hex SHA-256 of the bytes before it
_EOCD = b"PK\x05\x06"  # the zip's end of central directory record: 22 bytes, its comment's length last
_SEALED = len(SEAL) + 64


def seal(body: bytes) -> bytes:
    """``body`` (the bytes ``torch.save`` wrote) with lowbit's checksum as its zip comment."""
    if len(body) < 22 or body[-22:-18] != _EOCD or body[-2:] != b"\0\0":
        raise ValueError("torch.save wrote no zip archive ending in an end-of-central-directory record without a "
                         "comment; lowbit cannot seal it")
    head = body[:-2] + struct.pack("<H", _SEALED)
    return head + SEAL + hashlib.sha256(head).hexdigest().encode()


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run resuming from it."""


class CheckpointFallbackWarning(UserWarning):
    """A resume from an older step than this rank's newest checkpoint file: that file was refused
    (corrupt, truncated, foreign or incomplete), or another rank has no good checkpoint of its step."""


# What a resume does when a rank's newest checkpoint file is refused: warn and fall back to the
# newest step every rank still has, or raise a CheckpointError on every rank.
RESUME_FALLBACKS = ("warn", "error")
MISSING, REFUSED = -1, -2  # a candidate's step when its file is absent, or present but refused


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (POSIX; one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Remove the temporaries :func:`save_checkpoint` leaves when killed during a save of
    ``path``: ``PATH.tmp-PID`` and ``PATH.prev.tmp-PID`` whose PID is not alive on this
    machine (POSIX only; nothing else in the folder is touched). Returns the removed paths."""
    if os.name != "posix":  # os.kill(pid, 0) would end the process elsewhere
        return []
    folder, base = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        for stem in (base + ".tmp-", base + ".prev.tmp-"):
            pid = name[len(stem):]
            if not (name.startswith(stem) and pid.isdigit() and pid.isascii()):
                continue
            pid = int(pid)
            if pid <= 0 or pid == os.getpid() or _alive(pid):
                continue
            try:
                os.remove(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
            except OSError:  # gone already, or a read-only folder
                pass
    return removed


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
    raw = seal(buf.getvalue())
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
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
    loaded with ``weights_only=True``; :class:`CheckpointError` otherwise. Reads only."""
    path = os.fspath(path)
    prev = path + ".prev"
    return _load(path, map_location, f"; the previous checkpoint {prev} may be used instead"
                 if os.path.isfile(prev) else "")


def _load(path: str, map_location, hint: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist{hint}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    body = _legacy_body(raw, path, hint) if raw[:8] == MAGIC else _unsealed(raw, path, hint)
    try:
        return torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything that could run code
        # torch's own text around the reason advises weights_only=False: not for a file that fails here
        parts = [p.strip() for p in str(e).split("\n\n") if p.strip()]
        why = " ".join(p for p in parts if not p.startswith(("Weights only load failed", "Check the documentation")))
        raise CheckpointError(f"checkpoint {path} holds objects that weights_only=True refuses "
                              f"({why or str(e)}); nothing in it was run") from None


def _unsealed(raw: bytes, path: str, hint: str) -> bytes:
    """The file's bytes after :func:`seal`'s checksum is verified; CheckpointError otherwise."""
    tail = raw[-_SEALED:]
    if len(raw) < 22 + _SEALED or not tail.startswith(SEAL) or raw[-_SEALED - 22:-_SEALED - 18] != _EOCD:
        raise CheckpointError(f"checkpoint {path} is truncated, or not a lowbit checkpoint (no lowbit checksum "
                              f"at its end: cut short, or written by another program){hint}")
    if hashlib.sha256(raw[:-_SEALED]).hexdigest().encode() != tail[len(SEAL):]:
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 does not match the one stored at "
                              f"save time{hint}")
    return raw


def _legacy_body(raw: bytes, path: str, hint: str) -> bytes:
    """The torch.save body of a format-1 file (the ``LOWBITCK`` header), verified."""
    if len(raw) < _HEAD.size:
        raise CheckpointError(f"checkpoint {path} is truncated: {len(raw)} bytes, shorter than its header{hint}")
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
    return body


# The fields of the parts every checkpoint format shares (see check_fields): a key ending in "?"
# may be absent; a value is the type(s) the field must have, or the fields of a dict.
OPTIMIZER_FIELDS = {"state": dict, "param_groups": list}
ALGORITHM_STATE_FIELDS = {"tensors": dict, "extra?": dict}
LEDGER_FIELDS = {"ops": list, "rows": torch.Tensor}
RNG_FIELDS = {"torch": torch.Tensor, "numpy_keys": torch.Tensor, "numpy_pos": int, "numpy_has_gauss": int,
              "numpy_gauss": (float, int), "python_version": int, "python_internal": torch.Tensor,
              "python_gauss_next": (float, type(None)), "cuda?": torch.Tensor}


def check_fields(state, fields: dict, path: str, _prefix: str = "") -> None:
    """A :class:`CheckpointError` naming ``path`` and the field when ``state`` (a loaded
    checkpoint: its checksum cannot tell a file saved without a field) lacks a field of ``fields`` or holds one of another
    type. ``fields``: name -> type, tuple of types, or the fields of a nested dict; a name
    ending in ``?`` is optional."""
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {_prefix.rstrip('.') or 'its content'} is a "
                              f"{type(state).__name__}, not a dict (written by another program or version)")
    for key, want in fields.items():
        name = key.rstrip("?")
        if name not in state:
            if key.endswith("?"):
                continue
            raise CheckpointError(f"checkpoint {path} has no field '{_prefix}{name}' (written by another "
                                  f"program or version, or edited)")
        value = state[name]
        if isinstance(want, dict):
            check_fields(value, want, path, f"{_prefix}{name}.")
            continue
        types = want if isinstance(want, tuple) else (want,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise CheckpointError(f"checkpoint {path}: field '{_prefix}{name}' is a {type(value).__name__}, "
                                  f"not a {' or '.join(t.__name__ for t in types)} (written by another program "
                                  f"or version, or edited)")


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


def newest_common_step(table: list[list[int]], where: str, refused: str = "") -> int | None:
    """The newest step that every rank has a good checkpoint of. ``table[r]``: the steps of
    rank r's candidate files (:data:`MISSING`, :data:`REFUSED`: absent, or present but
    refused, as ``refused`` says). None when no rank has any checkpoint file; a
    :class:`CheckpointError` when some do but no step is common to all (also when every
    file there was refused: starting afresh would overwrite them)."""
    why = f" (refused: {refused})" if refused else ""
    if all(s == MISSING for row in table for s in row):
        return None
    common = set.intersection(*({s for s in row if s >= 0} for row in table))
    if not common:
        raise CheckpointError(f"cannot resume from {where}: no step has a good checkpoint on every rank "
                              f"(steps per rank, current and previous file: {table}; {MISSING}: none, "
                              f"{REFUSED}: refused){why}; every rank must resume from the same step")
    return max(common)


class Candidate(NamedTuple):
    """One checkpoint file a rank may resume from: its step (or :data:`MISSING` /
    :data:`REFUSED`), its state when good, and why it was refused."""

    path: str
    step: int
    state: dict | None
    reason: str = ""


def candidates(path: str | os.PathLike, fields: dict | None = None) -> list[Candidate]:
    """The current file ``path`` and the previous checkpoint ``path.prev``, each read and
    checked (:func:`load_checkpoint`; a ``step`` >= 0 and :func:`check_fields` of ``fields``);
    a file that is absent is :data:`MISSING`, one that fails a check :data:`REFUSED` with the
    reason. For the process that resumes and then saves ``path``: removes stale temporaries
    first (:func:`remove_stale_temporaries`)."""
    path = os.fspath(path)
    remove_stale_temporaries(path)
    out = []
    for p in (path, path + ".prev"):
        if not os.path.lexists(p):
            out.append(Candidate(p, MISSING, None))
            continue
        try:
            state = _load(p, None, "")
            check_fields(state, {"step": int, **(fields or {})}, p)
            if state["step"] < 0:
                raise CheckpointError(f"checkpoint {p}: step {state['step']} is negative")
            out.append(Candidate(p, int(state["step"]), state))
        except CheckpointError as e:
            out.append(Candidate(p, REFUSED, None, str(e)))
    return out


NOTE_BYTES = 2048  # the bound on the UTF-8 note each rank sends with its numbers (agree_resume, agree_outcome)


def exchange_notes(gather: Callable[[torch.Tensor], list[torch.Tensor]], numbers: list[int],
                   note: str) -> list[tuple[list[int], str]]:
    """Collective: every rank's ``numbers`` (int64, the same count on every rank) and ``note``
    (UTF-8, cut at :data:`NOTE_BYTES`), in rank order, through one all-gather of a fixed-size
    uint8 tensor: nothing is unpickled, and a peer's stated note length is bounded.
    ``gather``: the transport's all-gather (untracked, on the device its backend needs)."""
    head = struct.Struct(f"<{len(numbers)}qI")
    text = note.encode("utf-8")[:NOTE_BYTES]
    raw = bytearray(head.size + NOTE_BYTES)
    head.pack_into(raw, 0, *numbers, len(text))
    raw[head.size:head.size + len(text)] = text
    out = []
    for t in gather(torch.frombuffer(raw, dtype=torch.uint8).clone()):
        got = t.detach().cpu().numpy().tobytes()
        if len(got) != len(raw):
            raise CheckpointError(f"a rank sent {len(got)} bytes of checkpoint agreement, not {len(raw)}")
        *nums, n = head.unpack_from(got)
        out.append((list(nums), got[head.size:head.size + min(n, NOTE_BYTES)].decode("utf-8", "replace")))
    return out


def _by_text(items: list[tuple[int, str]]) -> str:
    """``text (rank(s) [0, 1])`` when the ranks agree, else ``rank(s) [0, 2]: text; rank(s) [1]: other``."""
    groups: dict[str, list[int]] = {}
    for r, text in items:
        groups.setdefault(text, []).append(r)
    if len(groups) == 1:
        (text, ranks), = groups.items()
        return f"{text} (rank(s) {ranks})"
    return "; ".join(f"rank(s) {ranks}: {text}" for text, ranks in groups.items())


def agree_resume(found: list[Candidate], gather: Callable[[torch.Tensor], list[torch.Tensor]], where: str,
                 rank: int, fallback: str = "warn") -> tuple[Candidate | None, dict]:
    """Collective: the candidate (of :func:`candidates`) of the newest step that every rank has a
    good checkpoint of, and what happened (``{"resumed_from_step", "fell_back", "refused"}``,
    the same on every rank); ``(None, {})`` when no rank has any checkpoint file.

    A rank that resumes from an older step than its newest file (refused, or of a step another
    rank lacks), or that refused a file, says so with a :class:`CheckpointFallbackWarning`
    naming the file, why, and the step it resumes from. ``fallback="error"``: a refused newest
    file on any rank is a :class:`CheckpointError` on every rank instead. ``where``: the
    checkpoint folder or file, for the messages."""
    if fallback not in RESUME_FALLBACKS:
        raise ValueError(f"resume fallback={fallback!r} is unknown; choose one of: {', '.join(RESUME_FALLBACKS)}")
    mine = "; ".join(c.reason for c in found if c.step == REFUSED)  # each names its file
    rows = exchange_notes(gather, [c.step for c in found], mine)
    table = [nums for nums, _ in rows]
    refused = _by_text([(r, text) for r, (nums, text) in enumerate(rows) if REFUSED in nums])
    newest_refused = [r for r, row in enumerate(table) if row[0] == REFUSED]
    if fallback == "error" and newest_refused:
        raise CheckpointError(f"cannot resume: the newest checkpoint of rank(s) {newest_refused} was refused "
                              f"({refused}); resume fallback='error' does not fall back to an older step "
                              f"(fallback='warn' does, with a warning)")
    step = newest_common_step(table, where, refused)
    if step is None:
        return None, {}
    chosen = next(c for c in found if c.step == step)
    info = {"resumed_from_step": step, "fell_back": any(row[0] != step for row in table),
            "refused": refused}
    newest = found[0]
    if newest is not chosen and newest.step != MISSING:
        if newest.step == REFUSED:
            why = f"{newest.path} was refused: {newest.reason}"
        else:
            lacking = [r for r, row in enumerate(table) if newest.step not in row]
            why = (f"{newest.path} is of step {newest.step}, which rank(s) {lacking} have no good checkpoint of"
                   + (f" (refused: {refused})" if refused else ""))
        warnings.warn(f"rank {rank}: resuming from step {step} ({chosen.path}), not from its newest checkpoint: "
                      f"{why}", CheckpointFallbackWarning, stacklevel=3)
    elif any(c.step == REFUSED for c in found):
        warnings.warn(f"rank {rank}: resuming from step {step} ({chosen.path}); {mine}", CheckpointFallbackWarning,
                      stacklevel=3)
    return chosen, info


def agree_outcome(gather: Callable[[torch.Tensor], list[torch.Tensor]], step: int, error: str | None) -> list[int]:
    """Collective: every rank's resumed ``step``, or a :class:`CheckpointError` on every rank, with
    the same message, when a rank failed (``error``: why, naming its file). One all-gather
    (:func:`exchange_notes`), so no rank is left waiting for one that raised."""
    rows = exchange_notes(gather, [MISSING if error is not None else step], error or "")
    failed = [(r, text) for r, (nums, text) in enumerate(rows) if nums[0] < 0]
    if failed:
        raise CheckpointError(_by_text(failed))
    return [nums[0] for nums, _ in rows]
