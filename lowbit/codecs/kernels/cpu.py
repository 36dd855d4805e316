"""numba kernels of the codecs' fast path on the CPU.

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

from ..modulo import GRID_LIMIT, grid_overflow_message
from ..modulo import HASH_HIGH as MODULO_HASH_HIGH
from ..modulo import HASH_SALT as MODULO_HASH_SALT
from ..modulo import HASH_STEP as MODULO_HASH_STEP
from ..rng import MIX_C1, MIX_C2, UNIFORM_SCALE, split_key

_jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")

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


@_jit
def centered_mod(z, a, inv_a):
    """``z mod a`` in ``[-a/2, a/2)`` (``inv_a = 1/a``), computed as
    :func:`lowbit.codecs.modulo.centered_mod`."""
    r = z - a * math.floor(z * inv_a + 0.5)
    h = a * 0.5
    return r - a if r >= h else (r + a if r < -h else r)


def keys(key: int) -> tuple[np.uint64, np.uint64]:
    k0, k1 = split_key(key)
    return np.uint64(k0), np.uint64(k1)


def np_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (bfloat16/half are not numba types:
    callers convert those first)."""
    return t.detach().contiguous().numpy()


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


# --- Moniqua's modulo codec ------------------------------------------------------------------

@_jit
def _modulo_encode(x, inv_B, levels, stochastic, k0, k1, codes):
    """Codes ``Q((x / B) mod 1) * levels mod levels`` (see ModuloCodec; ``levels`` a
    power of two); returns the non-finite flag."""
    L = float(levels)
    mask = levels - 1
    bad = False
    if stochastic:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= nonfinite(xv)
            c = round_stochastic(centered_mod(xv * inv_B, 1.0, 1.0) * L, k0, k1, i)
            codes[i] = np.uint8(np.int64(c) & mask)
    else:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= nonfinite(xv)
            c = rint(centered_mod(xv * inv_B, 1.0, 1.0) * L)
            codes[i] = np.uint8(np.int64(c) & mask)
    return bad


@_jit
def _modulo_decode(codes, B, levels, y, out):
    """Eq. (5): ``(q B/levels - y) mod B + y``, into ``out`` (``y``'s dtype)."""
    step = B / float(levels)
    inv_B = 1.0 / B
    for i in range(codes.shape[0]):
        yv = np.float64(y[i])
        out[i] = centered_mod(float(codes[i]) * step - yv, B, inv_B) + yv


# --- torch-level API (the same names and signatures as the Triton module) --------------------

def as_numba(x: torch.Tensor) -> np.ndarray:
    """A numpy view of ``x`` for the kernels; half types are widened to float32 first."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return np_view(x)


def nonfinite_error(codec: str) -> ValueError:
    return ValueError(f"x must be finite for the {codec} codec")


def pack(codes: torch.Tensor, b: int) -> torch.Tensor:
    """Pack integer codes (each < 2^b, trusted) into ``ceil(n b / 8)`` bytes."""
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


def modulo_encode(x: torch.Tensor, B: float, levels: int, stochastic: bool, key: int) -> torch.Tensor:
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    k0, k1 = keys(key)
    if _modulo_encode(as_numba(x), 1.0 / B, levels, stochastic, k0, k1, codes.numpy()):
        raise nonfinite_error("modulo")
    return codes


def modulo_decode(codes: torch.Tensor, B: float, levels: int, ref: torch.Tensor) -> torch.Tensor:
    y = ref.detach()
    out = torch.empty(codes.numel(), dtype=y.dtype if y.dtype in (torch.float32, torch.float64) else torch.float32)
    _modulo_decode(np_view(codes), float(B), levels, as_numba(y), out.numpy())
    return out.to(y.dtype)


# --- Moniqua's decode with the block hashes of its grid integers ---------------------------------

HASH_SALT = np.uint64(MODULO_HASH_SALT)
HASH_STEP = np.uint64(MODULO_HASH_STEP)
HASH_HIGH = np.uint64(MODULO_HASH_HIGH)


@_jit
def grid_element_hash(m, i):
    """Element ``i``'s term of :func:`lowbit.codecs.modulo.grid_hashes` (grid integer ``m``, int64)."""
    u = np.uint64(m)
    key = (((np.uint64(i) * HASH_STEP) & M32) ^ HASH_SALT) | np.uint64(1)
    return (((u & M32) * key) & M32) + (((u >> np.uint64(32)) * HASH_HIGH) & M32)


@_jit
def _modulo_decode_hash(data, b, n, B, levels, y, block, out, hashes):
    """:func:`_modulo_decode` of the ``n`` codes packed ``b`` bits each in ``data`` (b in 1, 2,
    4, 8: unpacked here, in the same pass), and per block of ``block`` elements the 16-bit
    hash of the grid integers ``m = code - levels k`` of the decoded values (``x_hat = m B /
    levels`` up to rounding). Returns the largest ``levels |k|`` met (the caller refuses it
    beyond 2^53: the grid integers would not be exact)."""
    step = B / float(levels)
    inv_B = 1.0 / B
    h = B * 0.5
    L = np.int64(levels)
    mask = (1 << b) - 1
    reach = 0.0
    nb = hashes.shape[0]
    for blk in range(nb):
        acc = np.uint64(0)
        for i in range(blk * block, min(n, (blk + 1) * block)):
            bit = i * b
            code = (np.int64(data[bit >> 3]) >> (bit & 7)) & mask
            yv = np.float64(y[i])
            z = float(code) * step - yv
            k = math.floor(z * inv_B + 0.5)
            r = z - B * k
            up = r >= h
            down = r < -h
            r = r - B if up else (r + B if down else r)
            k = k + 1.0 if up else (k - 1.0 if down else k)
            reach = max(reach, abs(k))
            out[i] = r + yv
            acc += grid_element_hash(code - L * np.int64(k), i)
        hashes[blk] = np.int32(mix32(acc & M32) & np.uint64(0xFFFF))
    return reach * float(levels)


def modulo_decode_hash(data: torch.Tensor, bits: int, n: int, B: float, levels: int, ref: torch.Tensor,
                       block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode of the packed ``data`` against ``ref`` and the blocks' hashes (int32)."""
    y = ref.detach()
    out = torch.empty(n, dtype=y.dtype if y.dtype in (torch.float32, torch.float64) else torch.float32)
    hashes = torch.empty((n + block - 1) // block, dtype=torch.int32)
    if bits not in (1, 2, 4, 8):
        data, bits = unpack(data, bits, n), 8  # one byte per code: the kernel reads widths 1, 2, 4 and 8
    reach = _modulo_decode_hash(np_view(data), bits, n, float(B), levels, as_numba(y), block, out.numpy(),
                                hashes.numpy())
    if reach > GRID_LIMIT:
        raise OverflowError(grid_overflow_message(reach, B, levels))
    return out.to(y.dtype), hashes


