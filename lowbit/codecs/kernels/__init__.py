"""Fast paths of the codecs: numba kernels on the CPU, Triton kernels on CUDA.

Every codec has two implementations with one wire format:

- the fast path (the default): fused per-element loops that read the input
  once, draw their uniforms from the counter hash of :mod:`lowbit.codecs.rng`,
  keep codes as ``uint8`` and pack them with shifts, and never synchronise a
  GPU with the host except where a codec says so. On the CPU the kernels are
  numba-compiled loops that run in float64 registers whatever the input dtype
  (the input is read once in its own dtype; no float64 copy is made), which is
  why they give the reference's bytes exactly. On CUDA they are Triton kernels
  computing in float32 for float32/half inputs (float64 for float64).
- the reference: the plain, float64, whole-tensor torch code that the tests
  compare the fast path against, drawing the same counter-hash uniforms.

:func:`fast_backend` picks the path for a tensor. ``LOWBIT_CODEC_PATH=reference``
(or the :func:`codec_path` context manager) forces the reference everywhere;
where numba would compile for another CPU than this one (:func:`native_target`) the CPU
takes the reference; tensors that are neither plain CPU nor plain CUDA tensors (subclasses, other
devices) take the reference; CUDA without Triton takes the reference.

The kernels come in families, one per codec module (:mod:`.families`: each family's
:class:`typing.Protocol`, its CPU-only functions and their reasons). This module is the one
place that picks a family's module for a tensor: :func:`kernels_for` (``cpu_<family>``
with numba on the CPU, ``gpu_<family>`` with Triton on CUDA, ``cpu``/``gpu`` for the
"core" family), :func:`kernels_on` for a named backend, :func:`cpu_kernels` and
:func:`gpu_kernels`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
import sys
import threading

import torch

__all__ = ["fast_backend", "kernels_for", "kernels_on", "BACKENDS", "codec_path", "PATHS", "cpu_kernels",
           "gpu_kernels", "empty_output", "native_target"]

PATHS = ("fast", "reference")
BACKENDS = ("numba", "triton")
_local = threading.local()


def _current_path() -> str:
    path = getattr(_local, "path", None)
    if path is None:
        path = os.environ.get("LOWBIT_CODEC_PATH", "fast")
        if path not in PATHS:
            raise ValueError(f"LOWBIT_CODEC_PATH must be one of {PATHS}, got {path!r}")
    return path


@contextlib.contextmanager
def codec_path(path: str):
    """Run the codecs of this thread on ``path`` ("fast" or "reference") inside the block."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    old = getattr(_local, "path", None)
    _local.path = path
    try:
        yield
    finally:
        _local.path = old


@functools.lru_cache(maxsize=None)
def _family(family: str):
    from .families import FAMILIES

    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}") from None


@functools.lru_cache(maxsize=None)
def _module(backend: str, family: str):
    """The kernel module of a codec family for a backend (:meth:`.families.Family.module_name`:
    ``cpu``/``gpu`` for the core, ``cpu_<family>``/``gpu_<family>`` for the others). None when
    the family has no module for the backend, or its compiler (numba or Triton) cannot be
    imported."""
    name = _family(family).module_name(family, backend)
    if name is None:
        return None
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        if e.name in ("numba", "triton") or (e.name or "").startswith(("numba.", "triton.")):
            return None
        raise


def cpu_kernels(family: str = "core"):
    """The numba kernel module of ``family`` (conforming to ``FAMILIES[family].cpu``), or None
    when numba cannot be imported."""
    return _module("numba", family)


def gpu_kernels(family: str = "core"):
    """The Triton kernel module of ``family`` (conforming to ``FAMILIES[family].common``), or
    None when Triton cannot be imported or the family has no GPU side (``FAMILIES[family].no_gpu``)."""
    return _module("triton", family)


@functools.cache
def native_target() -> bool:
    """Whether numba compiles for this machine's own CPU (its default). Told to compile for
    another (``NUMBA_CPU_NAME=generic``, as one sets it for a cache shared between machines,
    with this CPU's features), LLVM crashed or the compiled kernels corrupted the heap
    (numba 0.63: an assertion in LLVM for the fp16 cast, ``free(): invalid size`` after the
    bf16 one, an abort finalising RandK's selection): there the CPU codecs take the
    reference, the same bytes (issue 28)."""
    try:
        from numba.core import config
    except ImportError:
        return False
    if config.CPU_NAME in (None, "host"):
        return True
    import llvmlite.binding as llvm

    return config.CPU_NAME == llvm.get_host_cpu_name()


def fast_backend(x: torch.Tensor) -> str | None:
    """``"numba"``, ``"triton"`` or None (the reference) for a tensor ``x``: on the CPU numba
    where it compiles for this CPU (:func:`native_target`)."""
    if _current_path() == "reference" or type(x) is not torch.Tensor:
        return None
    if x.device.type == "cpu":
        return "numba" if cpu_kernels() is not None and native_target() else None
    if x.device.type == "cuda":
        return "triton" if gpu_kernels() is not None else None
    return None


@functools.lru_cache(maxsize=None)
def _offers(backend: str, family: str, op: str) -> bool:
    """Whether ``family``'s module for ``backend`` has the function ``op``: every function of
    the family's Protocol on the CPU, all but its ``cpu_only`` ones on CUDA. ValueError for a
    name the family does not have."""
    from .families import protocol_members

    fam = _family(family)
    names = protocol_members(fam.cpu)
    if op not in names:
        raise ValueError(f"op must be one of the {family!r} family's functions {sorted(names)}, got {op!r}")
    return backend == "numba" or op not in fam.cpu_only


def kernels_on(backend: str, family: str = "core", op: str | None = None):
    """The kernel module of ``family`` for ``backend`` ("numba" or "triton"), or None where
    there is none: no module for the backend, its compiler cannot be imported, or (with
    ``op``, one of the family's functions) the backend lacks that function (a CPU-only one
    on CUDA: ``FAMILIES[family].cpu_only`` says why)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    module = _module(backend, family)
    if op is None:
        return module
    offered = _offers(backend, family, op)  # checks op's name, with or without a module
    return module if offered else None


def kernels_for(x: torch.Tensor, family: str = "core", op: str | None = None):
    """The kernel module of ``family`` (a name of :data:`.families.FAMILIES`) for ``x``'s fast
    path (numba on the CPU, Triton on CUDA: :func:`kernels_on` of :func:`fast_backend`), or
    None: take the reference. With ``op`` (one of the family's functions), None also where
    that backend lacks it."""
    backend = fast_backend(x)
    if backend is None:
        _family(family)  # an unknown name is an error on every path
        if op is not None:
            _offers("numba", family, op)
        return None
    return kernels_on(backend, family, op)


#: Allocations of this many bytes or more get a fresh mapping from glibc at every call (its
#: mmap threshold rises with the sizes freed, up to 32 MiB); smaller ones reuse freed heap
#: memory, whose pages are already in place.
HUGE_FROM = 32 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def empty_output(n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(n, dtype=dtype, device=device)`` for a decode's output (returned to the
    caller, so a new tensor every call). On the CPU, from :data:`HUGE_FROM` bytes on, glibc
    maps the buffer fresh and the kernel would fault it in 4 KiB pages on first touch: its
    2 MiB-aligned interior is advised as transparent huge pages first (Linux
    ``madvise(MADV_HUGEPAGE)``; where THP is off, or on other systems, nothing changes).
    Smaller buffers are left to the heap, which reuses freed memory. Only lowbit's own
    outputs are advised: torch's process-wide ``THP_MEM_ALLOC_ENABLE=1`` advises every
    tensor from 2 MiB, which on this project's machine made each fresh 4-32 MB tensor cost
    1-3.6 ms where heap reuse took 0.05-1.6 ms (``python benchmarks/fresh_alloc.py``; a
    fresh 40 MB one: 19 ms unadvised, 4-5 ms advised)."""
    out = torch.empty(n, dtype=dtype, device=device)
    nbytes = n * out.element_size()
    if nbytes >= HUGE_FROM and _MADVISE is not None and out.device.type == "cpu":
        start = out.data_ptr()
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)  # advice: a failure (THP compiled out) changes nothing
    return out
