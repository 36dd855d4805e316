"""Objects that cross a process boundary as bytes, without pickle.

A worker's result (lowbit's launcher: through a pipe; under torchrun: gathered
onto rank 0) and a worker's exception are encoded here and nothing else: the
receiver never unpickles what another process sends (an object whose
``__reduce__`` names a function would run it on the receiver).

The frame: ``MAGIC`` (8 bytes), the header's length (uint64, little endian),
the header (UTF-8 JSON), then the tensors' bytes one after another. The header
is ``{"v": value, "t": [tensor descriptions]}``. A value is JSON's own null,
booleans, numbers, strings and arrays (Python lists); every JSON object is a tag
with exactly one key: ``{"T": [...]}`` a tuple, ``{"D": [[key, value], ...]}`` a
dict, ``{"X": i}`` tensor i, ``{"C": name, "F": {...}}`` a registered dataclass
(:func:`register`; lowbit's ``WorkerResult`` is), ``{"B": "hex"}`` bytes. A tensor
description is ``[dtype name, shape, device]``; its bytes follow in order.

:func:`loads` checks everything before it builds anything: the total length
against ``max_nbytes``, the magic, the header's length, that the header is
JSON, each tag, the nesting depth, each dtype against an allowlist, each shape
against the bytes that follow (exactly: nothing left over), and a registered
dataclass's field names. A failure is :class:`BadPeerData` naming the sender.

Exceptions travel as :func:`exception_record` (type names, message, simple
arguments, traceback text) and come back through :func:`rebuild_exception` as
the nearest allowlisted class (lowbit's errors, Python's built-in ones, torch's
out-of-memory error), built from strings and numbers only.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import json
import math
import numbers
import struct
import traceback

import torch

MAGIC = b"LBWOBJ01"
_HEAD = struct.Struct("<8sQ")
MAX_DEPTH = 64

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)}

# Dataclasses a frame may name, by "module.qualname": built with their fields as keyword arguments.
_REGISTERED: dict[str, type] = {}
_LAZY = {"lowbit.train.loop.WorkerResult"}


class BadPeerData(ValueError):
    """Bytes from another process that are not a well-formed frame of this module."""


def register(cls: type) -> type:
    """Allow the dataclass ``cls`` in frames (on the sending and the receiving side: register it
    where the module defining it is imported). Returns ``cls`` (usable as a decorator)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register: {cls!r} is not a dataclass")
    _REGISTERED[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


def _registered(name: str) -> type | None:
    if name not in _REGISTERED and name in _LAZY:
        module, _, attr = name.rpartition(".")
        register(getattr(importlib.import_module(module), attr))
    return _REGISTERED.get(name)


def dumps(value) -> bytes:
    """``value`` as a frame. Encodable: None, bool, int, float, str, bytes, lists, tuples, dicts
    (keys encodable too), tensors (their values; CUDA tensors come back on the same GPU where
    there is one, else on the CPU) and registered dataclasses; anything else is a TypeError."""
    tensors: list[torch.Tensor] = []

    def enc(v, depth):
        if depth > MAX_DEPTH:
            raise TypeError(f"cannot send a value nested more than {MAX_DEPTH} levels deep")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return {"X": len(tensors) - 1}
        if isinstance(v, (bytes, bytearray)):
            return {"B": bytes(v).hex()}
        if isinstance(v, list):
            return [enc(x, depth + 1) for x in v]
        if isinstance(v, tuple):
            return {"T": [enc(x, depth + 1) for x in v]}
        if isinstance(v, dict):
            return {"D": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            name = f"{type(v).__module__}.{type(v).__qualname__}"
            if _registered(name) is not type(v):
                raise TypeError(f"cannot send a {name}: only registered dataclasses travel "
                                f"(lowbit.comm.wire_objects.register)")
            return {"C": name, "F": {f.name: enc(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v)}}
        if isinstance(v, numbers.Integral):  # numpy's integer scalars
            return int(v)
        if isinstance(v, numbers.Real):
            return float(v)
        raise TypeError(f"cannot send a {type(v).__module__}.{type(v).__qualname__}: results and errors "
                        f"travel as None, bool, int, float, str, bytes, list, tuple, dict, tensors and "
                        f"registered dataclasses (no pickle)")

    tree = enc(value, 0)
    descs, blobs = [], []
    for t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype}; supported: {', '.join(_DTYPES)}")
        c = t.detach().to("cpu").contiguous()
        descs.append([dtype, list(c.shape), str(t.device)])
        blobs.append(c.view(torch.uint8).reshape(-1).numpy().tobytes() if c.numel() else b"")
    header = json.dumps({"v": tree, "t": descs}, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, len(header)), header, *blobs])


def loads(data: bytes | bytearray | memoryview, *, sender: str, max_nbytes: int):
    """The value of the frame ``data`` sent by ``sender`` (e.g. "rank 1"), checked before any of
    it is built (see the module doc); :class:`BadPeerData` naming ``sender`` otherwise."""
    data = memoryview(data).cast("B")

    def bad(why: str) -> BadPeerData:
        return BadPeerData(f"{sender} sent a result that is not a well-formed lowbit frame ({why}); it was "
                           f"refused unread: a corrupt or hostile peer")

    head, offset = _read_header(data, max_nbytes, bad)
    tensors = _read_tensors(data, head["t"], offset, bad)
    used: set[int] = set()
    value = _decode(head["v"], 0, tensors, used, bad)
    if len(used) != len(tensors):
        raise bad(f"{len(tensors) - len(used)} of its tensors are not referenced")
    return value


def _read_header(data: memoryview, max_nbytes: int, bad) -> tuple[dict, int]:
    """The frame's JSON header, checked, and the offset of its first tensor's bytes."""
    if len(data) > max_nbytes:
        raise bad(f"{len(data)} bytes, more than the {max_nbytes} accepted")
    if len(data) < _HEAD.size:
        raise bad(f"{len(data)} bytes, shorter than the {_HEAD.size}-byte head")
    magic, hlen = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise bad(f"starts with {bytes(magic)!r}, not {MAGIC!r}")
    if hlen > len(data) - _HEAD.size:
        raise bad(f"its header states {hlen} bytes, only {len(data) - _HEAD.size} follow")
    try:
        head = json.loads(bytes(data[_HEAD.size:_HEAD.size + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"its header is not JSON: {type(e).__name__}") from None
    if not (isinstance(head, dict) and set(head) == {"v", "t"} and isinstance(head["t"], list)):
        raise bad("its header is not {\"v\": ..., \"t\": [...]}")
    return head, _HEAD.size + hlen


def _read_tensors(data: memoryview, descs: list, offset: int, bad) -> list[tuple[torch.Tensor, str]]:
    """The tensors ``descs`` describe, read from ``data`` at ``offset`` on: ``(CPU tensor, device)``;
    their bytes must fill the rest of the frame exactly."""
    tensors = []
    for i, desc in enumerate(descs):
        if not (isinstance(desc, list) and len(desc) == 3 and desc[0] in _DTYPES and isinstance(desc[1], list)
                and isinstance(desc[2], str) and len(desc[1]) <= MAX_DEPTH
                and all(type(s) is int and s >= 0 for s in desc[1])):
            raise bad(f"tensor {i}: description {str(desc)[:80]} is not [dtype, shape, device] with a known dtype "
                      f"and sizes >= 0")
        dtype = _DTYPES[desc[0]]
        nbytes = math.prod(desc[1]) * torch.empty((), dtype=dtype).element_size()
        if nbytes > len(data) - offset:
            raise bad(f"tensor {i} of shape {desc[1]} needs {nbytes} bytes, {len(data) - offset} are left")
        raw = bytearray(data[offset:offset + nbytes])
        if dtype is torch.bool and any(b > 1 for b in raw):
            raise bad(f"tensor {i}: a bool tensor holds bytes other than 0 and 1")
        t = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        tensors.append((t.reshape(desc[1]), desc[2]))
        offset += nbytes
    if offset != len(data):
        raise bad(f"{len(data) - offset} bytes follow its last tensor")
    return tensors


def _decode(v, depth: int, tensors: list, used: set, bad):
    """The value the header's tree ``v`` stands for (tensor references into ``tensors``, each used
    once: ``used`` collects them)."""
    if depth > MAX_DEPTH:
        raise bad(f"nested more than {MAX_DEPTH} levels deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v

    def dec(x):
        return _decode(x, depth + 1, tensors, used, bad)

    if isinstance(v, list):
        return [dec(x) for x in v]
    if not (isinstance(v, dict) and len(v) in (1, 2)):
        raise bad(f"an object {str(v)[:60]} is not a tag")
    (tag, body), *rest = v.items()
    if tag == "T" and not rest and isinstance(body, list):
        return tuple(dec(x) for x in body)
    if tag == "D" and not rest and isinstance(body, list):
        return _decode_dict(body, dec, bad)
    if tag == "X" and not rest and type(body) is int:
        if not 0 <= body < len(tensors) or body in used:
            raise bad(f"tensor reference {body} is not one of its {len(tensors)} tensors, each used once")
        used.add(body)
        t, device = tensors[body]
        return _on_device(t, device)
    if tag == "B" and not rest and isinstance(body, str):
        try:
            return bytes.fromhex(body)
        except ValueError:
            raise bad("a bytes value is not hex") from None
    if tag == "C" and len(rest) == 1 and rest[0][0] == "F" and isinstance(body, str) \
            and isinstance(rest[0][1], dict):
        return _decode_dataclass(body, rest[0][1], dec, bad)
    raise bad(f"an object with the keys {[k[:20] for k in v][:2]} is not a tag")


def _decode_dict(body: list, dec, bad) -> dict:
    """A dict from its ``[key, value]`` pairs."""
    out = {}
    for pair in body:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise bad("a dict entry is not a [key, value] pair")
        k = dec(pair[0])
        try:
            out[k] = dec(pair[1])
        except TypeError:
            raise bad(f"a dict key of type {type(k).__name__} cannot be hashed") from None
    return out


def _decode_dataclass(name: str, fields: dict, dec, bad):
    """An instance of the registered dataclass ``name`` from exactly its init ``fields``."""
    cls = _registered(name)
    if cls is None:
        raise bad(f"it names the type {name[:80]!r}, which is not a registered dataclass")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) != names:
        raise bad(f"its {name} has the fields {sorted(fields)[:20]}, not {sorted(names)}")
    return cls(**{k: dec(x) for k, x in fields.items()})


def _on_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """The decoded (CPU) tensor on ``device`` where that is a CUDA device this process has, else on the CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        index = device.partition(":")[2]
        if not index or (index.isdigit() and int(index) < torch.cuda.device_count()):
            return t.to(device)
    return t


def _simple(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def exception_record(e: BaseException, tb: str | None = None) -> dict:
    """What travels of the exception ``e``: its class and base classes by name, its message, its
    arguments and attributes that are None, bool, int, float or str, an OSError's errno and
    filename, and the traceback text (``tb``, default the one being handled)."""
    rec = {"types": [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__ if issubclass(c, BaseException)],
           "message": str(e), "summary": "".join(traceback.format_exception_only(type(e), e)).strip(),
           "args": list(e.args) if all(_simple(a) for a in e.args) else None,
           "attrs": {k: v for k, v in getattr(e, "__dict__", {}).items()
                     if isinstance(k, str) and not k.startswith("_") and _simple(v)},
           "traceback": tb if tb is not None else traceback.format_exc()}
    if isinstance(e, OSError):
        rec["oserror"] = [e.errno, e.strerror, None if e.filename is None else str(e.filename)]
    return rec


_MODULES = ("lowbit.algorithms.faults", "lowbit.integrations.checkpoint", "lowbit.data.errors", "lowbit.train.errors",
            "lowbit.comm.liveness", "lowbit.comm.wire_objects")


def _exception_classes() -> dict[str, type]:
    """The classes an exception record may name: Python's built-in exceptions, lowbit's own and
    torch's out-of-memory error."""
    out = {f"builtins.{n}": c for n, c in vars(builtins).items()
           if isinstance(c, type) and issubclass(c, BaseException) and not issubclass(c, BaseExceptionGroup)}
    for module in _MODULES:
        for c in vars(importlib.import_module(module)).values():
            if isinstance(c, type) and issubclass(c, BaseException) and c.__module__.startswith("lowbit."):
                out[f"{c.__module__}.{c.__qualname__}"] = c
    out[f"{torch.OutOfMemoryError.__module__}.{torch.OutOfMemoryError.__qualname__}"] = torch.OutOfMemoryError
    return out


def rebuild_exception(rec, *, sender: str) -> BaseException:
    """An exception like the one :func:`exception_record` described, built without running any of
    its classes' code but the built-in constructors: its own class if allowlisted (its arguments
    and simple attributes restored, as pickle restores an exception's, minus the pickle), else the
    first allowlisted base class with the message; BadPeerData naming ``sender`` for a record that
    is not one."""
    if not (isinstance(rec, dict) and isinstance(rec.get("types"), list) and isinstance(rec.get("message"), str)
            and rec["types"] and all(isinstance(t, str) for t in rec["types"])):
        raise BadPeerData(f"{sender} sent an error that is not an exception record; refused")
    classes = _exception_classes()
    args = rec.get("args")
    args = tuple(args) if isinstance(args, list) and all(_simple(a) for a in args) else (rec["message"],)
    attrs = rec.get("attrs")
    attrs = {k: v for k, v in attrs.items() if isinstance(k, str) and not k.startswith("_") and _simple(v)} \
        if isinstance(attrs, dict) else {}
    ose = rec.get("oserror")
    for i, name in enumerate(rec["types"]):
        cls = classes.get(name)
        if cls is None:
            continue
        if issubclass(cls, OSError) and isinstance(ose, list) and len(ose) == 3 and isinstance(ose[0], int) \
                and isinstance(ose[1], str) and (ose[2] is None or isinstance(ose[2], str)):
            return cls(*(ose if ose[2] is not None else ose[:2]))
        try:
            if i == 0:
                e = cls.__new__(cls, *args)
                e.args = args
                for k, v in attrs.items():
                    object.__setattr__(e, k, v)
                if str(e) == rec["message"]:  # what was restored is what its __str__ needs
                    return e
                continue
            return cls(rec["message"])
        except Exception:  # noqa: BLE001 - a class that cannot be built so: try its next base
            continue
    return RuntimeError(rec["message"])
