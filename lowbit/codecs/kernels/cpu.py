"""numba kernels of the "core" family on the CPU, and the primitives every CPU family shares.

The core family (:class:`~lowbit.codecs.kernels.families.CoreKernels`): bit packing
(:func:`pack`/:func:`unpack`, the little-endian stream of :mod:`lowbit.codecs.packing`)
and one-pass statistics (:func:`stats`), with the same names and signatures as
:mod:`.gpu`; :func:`within` and :func:`max_abs` are CPU-only
(:class:`~lowbit.codecs.kernels.families.CpuCoreKernels` says why).

The shared primitives (imported by the ``cpu_<family>`` modules, not part of any
family's interface): the numba decorators ``_jit``/``_inline``, the counter uniform
(:func:`uniform`, :func:`round_stochastic`, :func:`keys`), :func:`rint`,
:func:`nonfinite` and the tensor views :func:`np_view`/:func:`as_numba`.

Each kernel is one loop over the elements, reading the input once in its own
dtype and computing in float64 registers, so that it gives the reference's
results bit for bit. ``nogil=True``: thread workers run them in parallel.
Compiled on first use and cached on disk (``cache=True``).

Conventions: codes of at most 8 bits are ``uint8`` arrays; a kernel that may
meet a non-finite input returns a flag (1 when one was met) instead of
raising, and its caller raises once.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from ..rng import MIX_C1, MIX_C2, UNIFORM_SCALE, split_key

__all__ = ["pack", "unpack", "stats", "within", "max_abs"]

_jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
# helpers called per element from other kernels: inlined by numba (a plain call to a
# cached function costs ~40 ns here)
_inline = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")

M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(MIX_C1)
_C2 = np.uint64(MIX_C2)
_U = float(UNIFORM_SCALE)


@_jit
def mix32(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * _C1) & M32
    h = h ^ (h >> np.uint64(15))
    h = (h * _C2) & M32
    return h ^ (h >> np.uint64(16))


@_jit
def uniform(k0, k1, i):
    """The counter uniform of element ``i`` (see :mod:`lowbit.codecs.rng`)."""
    h = mix32((mix32(np.uint64(i) ^ k0) + k1) & M32)
    return float(h >> np.uint64(8)) * _U


@_jit
def rint(v):
    """Round half to even, as ``torch.round`` (branch-free)."""
    r = math.floor(v + 0.5)
    tie_odd = (r - v == 0.5) and (r - 2.0 * math.floor(r * 0.5) != 0.0)
    return r - 1.0 if tie_odd else r


@_jit
def round_stochastic(v, k0, k1, i):
    """``floor(v) + 1[u_i < frac(v)]``, ``u_i`` the counter uniform of element ``i``."""
    lo = math.floor(v)
    return lo + (1.0 if uniform(k0, k1, i) < v - lo else 0.0)


@_jit
def nonfinite(v):
    """1 for NaN and +-inf, else 0 (branch-free)."""
    return (v - v) != 0.0


def keys(key: int) -> tuple[np.uint64, np.uint64]:
    """The two 64-bit halves of a stream key that the counter hash takes."""
    k0, k1 = split_key(key)
    return np.uint64(k0), np.uint64(k1)


def np_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (bfloat16/half are not numba types:
    callers convert those first). Detaches and copies only when needed: at the thread
    runtime's model sizes these calls are a measurable part of a kernel call."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.numpy()


# --- packing ---------------------------------------------------------------------------

@_jit
def _pack(codes, b, out):
    """Pack ``codes`` (each < 2^b, b in 1..32) into the zeroed ``out`` (``ceil(n b / 8)`` bytes), the
    little-endian bit stream of :mod:`lowbit.codecs.packing`."""
    n = codes.shape[0]
    if b == 8:
        for i in range(n):
            out[i] = np.uint8(codes[i])
        return
    if b == 1 or b == 2 or b == 4:
        per = 8 // b
        full = n // per
        for j in range(full):
            acc = np.uint32(0)
            base = j * per
            for k in range(per):
                acc |= np.uint32(codes[base + k]) << np.uint32(k * b)
            out[j] = np.uint8(acc)
        if full * per < n:
            acc = np.uint32(0)
            for k in range(n - full * per):
                acc |= np.uint32(codes[full * per + k]) << np.uint32(k * b)
            out[full] = np.uint8(acc)
        return
    acc = np.uint64(0)
    nbits = 0
    o = 0
    for i in range(n):
        acc |= np.uint64(codes[i]) << np.uint64(nbits)
        nbits += b
        while nbits >= 8:
            out[o] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nbits -= 8
            o += 1
    if nbits > 0:
        out[o] = np.uint8(acc & np.uint64(0xFF))


@_jit
def _unpack(data, b, out):
    """Inverse of :func:`pack`: ``out.shape[0]`` codes of ``b`` bits into ``out``."""
    n = out.shape[0]
    if b == 8:
        for i in range(n):
            out[i] = data[i]
        return
    mask = (1 << b) - 1
    if b == 1 or b == 2 or b == 4:
        per = 8 // b
        full = n // per
        for j in range(full):
            d = data[j]
            base = j * per
            for k in range(per):
                out[base + k] = (d >> (k * b)) & mask
        for i in range(full * per, n):
            out[i] = (data[full] >> ((i - full * per) * b)) & mask
        return
    acc = np.uint64(0)
    nbits = 0
    o = 0
    m = np.uint64(mask)
    for i in range(n):
        while nbits < b:
            acc |= np.uint64(data[o]) << np.uint64(nbits)
            o += 1
            nbits += 8
        out[i] = acc & m
        acc >>= np.uint64(b)
        nbits -= b


# For widths 3, 5, 6 and 7 a group of 8 codes fills exactly b bytes, so one uint64 holds a
# group and no loop runs over bits (about 2x faster than the bit-stream loop above at 1e7).

@_jit
def _pack_groups(codes, b, out):
    n = codes.shape[0]
    groups = n // 8
    for g in range(groups):
        acc = np.uint64(0)
        for k in range(8):
            acc |= np.uint64(codes[8 * g + k]) << np.uint64(k * b)
        for j in range(b):
            out[g * b + j] = np.uint8((acc >> np.uint64(8 * j)) & np.uint64(0xFF))
    if groups * 8 < n:
        acc = np.uint64(0)
        for k in range(n - groups * 8):
            acc |= np.uint64(codes[8 * groups + k]) << np.uint64(k * b)
        for j in range(out.shape[0] - groups * b):
            out[groups * b + j] = np.uint8((acc >> np.uint64(8 * j)) & np.uint64(0xFF))


@_jit
def _unpack_groups(data, b, out):
    n = out.shape[0]
    groups = n // 8
    mask = np.uint64((1 << b) - 1)
    for g in range(groups):
        acc = np.uint64(0)
        for j in range(b):
            acc |= np.uint64(data[g * b + j]) << np.uint64(8 * j)
        for k in range(8):
            out[8 * g + k] = (acc >> np.uint64(k * b)) & mask
    if groups * 8 < n:
        acc = np.uint64(0)
        for j in range(data.shape[0] - groups * b):
            acc |= np.uint64(data[groups * b + j]) << np.uint64(8 * j)
        for k in range(n - groups * 8):
            out[8 * groups + k] = (acc >> np.uint64(k * b)) & mask



# --- one-pass statistics ------------------------------------------------------------------

@_jit
def _stats(x):
    """``(min, max, max |x|, sum x^2, nonfinite)`` of ``x`` in one pass, float64."""
    lo = math.inf
    hi = -math.inf
    sq = 0.0
    bad = 0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        if not math.isfinite(v):
            bad = 1
            continue
        if v < lo:
            lo = v
        if v > hi:
            hi = v
        sq += v * v
    amax = max(abs(lo), abs(hi)) if x.shape[0] > 0 else 0.0
    return lo, hi, amax, sq, bad


@_jit
def _within(a, split, head_lim, tail_lim):
    """Whether ``|a[:split]| <= head_lim`` and ``|a[split:]| <= tail_lim`` everywhere, compared in
    float64 (a NaN fails)."""
    ok = True
    for i in range(split):
        ok &= abs(np.float64(a[i])) <= head_lim
    for i in range(split, a.shape[0]):
        ok &= abs(np.float64(a[i])) <= tail_lim
    return ok


def within(a: torch.Tensor, split: int, head_lim: float, tail_lim: float) -> bool:
    """:func:`_within` of a contiguous 1-D float CPU tensor: a frame check of a few thousand values
    (PowerSGD's factors) in one call of about a microsecond, where numpy's or torch's
    reductions cost several."""
    return bool(_within(np_view(a), split, float(head_lim), float(tail_lim)))


@_jit
def _as_float(top, bits, like):
    """The float of ``like``'s dtype whose bits are the integer ``top`` (of ``bits``' dtype)."""
    one = np.empty(1, dtype=bits.dtype)
    one[0] = top
    return one.view(like.dtype)[0]


@_jit
def _top_bits(bits, mask, like):
    """The largest ``|x|`` of the float array ``like`` whose bits, as integers of its width, are
    ``bits`` (``mask``: its magnitude's bits): the largest ``bits[i] & mask`` as a float (a NaN's
    bits are above every other value's: NaN when there is one). An integer max vectorises; a
    float one does not."""
    top = mask & 0
    for i in range(bits.shape[0]):
        top = max(top, bits[i] & mask)
    return _as_float(top, bits, like)


#: numpy float dtype -> (the integer dtype of its width, the mask of its magnitude's bits)
_MAGNITUDE_MASK = {np.dtype(np.float32): (np.int32, np.int32(0x7FFFFFFF)),
                   np.dtype(np.float64): (np.int64, np.int64(0x7FFFFFFFFFFFFFFF))}


def _as_magnitude_float(a: np.ndarray) -> np.ndarray:
    """``a`` as float32 or float64 (others as float64) for :func:`_top_bits`."""
    return a if a.dtype in _MAGNITUDE_MASK else a.astype(np.float64)


def max_abs(x: torch.Tensor) -> float:
    """``max |x|`` of a CPU float tensor as a float, NaN when ``x`` holds a NaN (as torch's
    ``x.abs().max()``), 0.0 when empty: one vectorised pass, no temporary."""
    a = _as_magnitude_float(as_numba(x))
    itype, mask = _MAGNITUDE_MASK[a.dtype]
    return float(_top_bits(a.view(itype), mask, a))


# --- torch-level API (the core family; :mod:`.gpu` has the same names and signatures) ---------

def as_numba(x: torch.Tensor) -> np.ndarray:
    """A numpy view of ``x`` for the kernels; half types are widened to float32 first."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return np_view(x)


def nonfinite_error(codec: str) -> ValueError:
    """The error an encode raises when its input holds a NaN or an inf."""
    return ValueError(f"x must be finite for the {codec} codec")


def pack(codes: torch.Tensor, b: int) -> torch.Tensor:
    """Pack integer codes (each < 2^b, trusted) into ``ceil(n b / 8)`` bytes. uint8 codes of 8
    bits are their own packing: returned as they are, not copied (the codecs hand over codes
    their encode has just made)."""
    if b == 8 and codes.dtype == torch.uint8 and codes.is_contiguous():
        return codes.detach()
    n = codes.numel()
    grouped = b in (3, 5, 6, 7)
    out = torch.zeros((n * b + 7) // 8, dtype=torch.uint8) if b not in (1, 2, 4, 8) and not grouped else \
        torch.empty((n * b + 7) // 8, dtype=torch.uint8)
    if n:
        (_pack_groups if grouped else _pack)(np_view(codes), b, out.numpy())
    return out


def unpack(data: torch.Tensor, b: int, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The ``n`` codes of ``b`` bits in ``data``, as ``dtype``."""
    out = torch.empty(n, dtype=dtype)
    if n:
        (_unpack_groups if b in (3, 5, 6, 7) else _unpack)(np_view(data), b, out.numpy())
    return out


def stats(x: torch.Tensor) -> tuple[float, float, float, float, bool]:
    """``(min, max, max |x|, sum x^2, all finite)`` in one pass (finite elements only)."""
    lo, hi, amax, sq, bad = _stats(as_numba(x))
    return lo, hi, amax, sq, not bad


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a decode kernel writes: float32 or float64 directly; any other dtype is
    written as float64 and cast once (a single rounding, as the reference's)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float64
