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

from ..modulo import GRID_LIMIT as MODULO_GRID_LIMIT
from ..modulo import check_grid_reach, modulo_limit, modulo_range_error
from ..modulo import HASH_HIGH as MODULO_HASH_HIGH
from ..modulo import HASH_SALT as MODULO_HASH_SALT
from ..modulo import HASH_STEP as MODULO_HASH_STEP
from ..rng import MIX_C1, MIX_C2, UNIFORM_SCALE, split_key
from . import empty_output

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


@_jit
def centered_mod(z, a, inv_a):
    """``z mod a`` in ``[-a/2, a/2)`` (``inv_a = 1/a``), computed as
    :func:`lowbit.codecs.modulo.centered_mod`."""
    r = z - a * math.floor(z * inv_a + 0.5)
    h = a * 0.5
    return r - a if r >= h else (r + a if r < -h else r)


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


# --- Moniqua's modulo codec ------------------------------------------------------------------

@_jit
def _modulo_encode(x, inv_B, levels, stochastic, k0, k1, codes):
    """Codes ``Q((x / B) mod 1) * levels mod levels`` (see ModuloCodec; ``levels`` a
    power of two); returns True when an element is not finite or out of the codec's range
    (``|x| > (2^53 / levels - 1) B``: :func:`lowbit.codecs.modulo.modulo_limit`), one comparison
    per element for both (the caller tells them apart on that error path)."""
    L = float(levels)
    lim = (MODULO_GRID_LIMIT / L - 1.0) / inv_B
    mask = levels - 1
    bad = False
    if stochastic:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= not abs(xv) <= lim  # NaN fails it too
            c = round_stochastic(centered_mod(xv * inv_B, 1.0, 1.0) * L, k0, k1, i)
            codes[i] = np.uint8(np.int64(c) & mask)
    else:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= not abs(xv) <= lim
            c = rint(centered_mod(xv * inv_B, 1.0, 1.0) * L)
            codes[i] = np.uint8(np.int64(c) & mask)
    return bad


@_jit
def _modulo_decode(codes, B, levels, y, ybits, mask, out):
    """Eq. (5): ``(q B/levels - y) mod B + y``, into ``out`` (``y``'s dtype). ``ybits``: ``y``'s
    bits as integers of its width, ``mask`` the bits of its magnitude. Returns the largest ``|y|``
    (:func:`_top_bits` of ``y``, in the same pass; NaN if ``y`` holds one) for the caller's range check:
    an integer max costs about half what a float compare per element did (``|y| > limit`` or-ed
    into a flag: 9% of the kernel's time here, this 4%); a float max does not vectorise."""
    step = B / float(levels)
    inv_B = 1.0 / B
    top = mask & 0
    for i in range(codes.shape[0]):
        yv = np.float64(y[i])
        top = max(top, ybits[i] & mask)
        out[i] = centered_mod(float(codes[i]) * step - yv, B, inv_B) + yv
    return _as_float(top, ybits, y)


# --- torch-level API (the same names and signatures as the Triton module) --------------------

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


def modulo_encode(x: torch.Tensor, B: float, levels: int, stochastic: bool, key: int) -> torch.Tensor:
    """Moniqua's codes (uint8) of ``x`` modulo ``B`` on ``levels`` levels: eq. (5), rounding stochastic with the stream
    ``key`` or to nearest."""
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    k0, k1 = keys(key)
    if _modulo_encode(as_numba(x), 1.0 / B, levels, stochastic, k0, k1, codes.numpy()):
        if not bool(torch.isfinite(x).all()):
            raise nonfinite_error("modulo")
        raise modulo_range_error("x", float(x.detach().abs().max()), B, levels)
    return codes


def modulo_decode(codes: torch.Tensor, B: float, levels: int, ref: torch.Tensor) -> torch.Tensor:
    """The point of the ``codes`` closest to ``ref`` on the grid modulo ``B`` (eq. (5) decoded against the receiver's
    model)."""
    y = ref.detach()
    out = empty_output(codes.numel(), y.dtype if y.dtype in (torch.float32, torch.float64) else torch.float32)
    yn = _as_magnitude_float(as_numba(y))
    itype, mask = _MAGNITUDE_MASK[yn.dtype]
    top = _modulo_decode(np_view(codes), float(B), levels, yn, yn.view(itype), mask, out.numpy())
    # the largest |y| (a NaN if one is there: its bits hide the rest), beyond the limit: the exact check
    lim = modulo_limit(float(B), levels)
    if not float(top) <= lim:
        a = y.abs().to(torch.float64)
        far = a > lim  # a NaN is not beyond it
        if bool(far.any()):
            raise modulo_range_error("ref", float(a[far].max()), B, levels)
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
def _modulo_decode_grid(codes, B, levels, y, out, m):
    """:func:`_modulo_decode` that also writes each element's grid integer ``m = code - levels k``
    (``k`` the lattice index eq. (5) picks; ``x_hat = m B / levels`` up to rounding). Returns the
    largest ``|k|`` (``|k|`` beyond 4e18, or a NaN, reads as 4e18: the caller's limit is far below).
    One flat loop, integer reductions only: it vectorises (a float ``max`` or packed reads in the
    loop made it 3-4x slower)."""
    step = B / float(levels)
    inv_B = 1.0 / B
    h = B * 0.5
    L = np.int64(levels)
    reach = np.int64(0)
    for i in range(codes.shape[0]):
        yv = np.float64(y[i])
        z = float(codes[i]) * step - yv
        k = math.floor(z * inv_B + 0.5)
        r = z - B * k
        up = r >= h
        down = r < -h
        r = r - B if up else (r + B if down else r)
        k = k + 1.0 if up else (k - 1.0 if down else k)
        out[i] = r + yv
        kc = np.int64(min(max(k, -4.0e18), 4.0e18)) if k == k else np.int64(4.0e18)
        reach = max(reach, abs(kc))
        m[i] = np.int64(codes[i]) - L * kc
    return reach


@_jit
def _grid_hashes(m, block, hashes):
    """Per block of ``block`` elements, the 16-bit hash of the grid integers ``m``."""
    n = m.shape[0]
    for blk in range(hashes.shape[0]):
        acc = np.uint64(0)
        for i in range(blk * block, min(n, (blk + 1) * block)):
            acc += grid_element_hash(m[i], i)
        hashes[blk] = np.int32(mix32(acc & M32) & np.uint64(0xFFFF))


@_jit
def _modulo_decode_hash(data, b, n, B, levels, y, block, out, hashes):
    """:func:`_modulo_decode` of the ``n`` codes packed ``b`` bits each in ``data`` (b in 1, 2,
    4, 8), and per block of ``block`` elements the 16-bit hash of the grid integers ``m = code -
    levels k`` of the decoded values. Returns the largest ``levels |k|`` met (the caller refuses
    it beyond 2^53: the grid integers would not be exact). Three flat passes (unpack, decode,
    hash) over scratch arrays: about half the time of one fused pass, which did not vectorise."""
    codes = np.empty(n, dtype=np.uint8)
    _unpack(data, b, codes)
    m = np.empty(n, dtype=np.int64)
    reach = _modulo_decode_grid(codes, B, levels, y, out, m)
    _grid_hashes(m, block, hashes)
    return float(reach) * float(levels)


def modulo_decode_hash(data: torch.Tensor, bits: int, n: int, B: float, levels: int, ref: torch.Tensor,
                       block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode of the packed ``data`` against ``ref`` and the blocks' hashes (int32)."""
    y = ref.detach()
    out = empty_output(n, y.dtype if y.dtype in (torch.float32, torch.float64) else torch.float32)
    hashes = torch.empty((n + block - 1) // block, dtype=torch.int32)
    if bits not in (1, 2, 4, 8):
        data, bits = unpack(data, bits, n), 8  # one byte per code: the kernel reads widths 1, 2, 4 and 8
    reach = _modulo_decode_hash(np_view(data), bits, n, float(B), levels, as_numba(y), block, out.numpy(),
                                hashes.numpy())
    check_grid_reach(reach, B, levels)
    return out.to(y.dtype), hashes




# --- Moniqua's verified exchange in one call per message ------------------------------------------
#
# A message is ``codes | [repair requests] | block hashes (<u2 each) | control byte`` (see
# lowbit.algorithms.moniqua). The sender's call encodes, packs the codes into the message, decodes its
# own x_hat against its model and writes the hashes; the receiver's call decodes one neighbour's codes,
# hashes them, compares with the hashes sent and, when every block agrees, adds the neighbour's term
# ``w (x_hat_j - x_hat_i)`` of line 6 into the mix. One kernel call each instead of a dozen torch and
# numba calls: at the model sizes of the thread runtime the calls, not the elements, are the cost.

@numba.extending.intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (IEEE fused multiply-add; float32 or float64 alike): the
    arithmetic of torch's ``add_(other, alpha=...)`` on the CPU, so that a kernel that mixes
    gives torch's bits."""
    if not (a == b == c and a in (numba.types.float32, numba.types.float64)):
        return None

    def codegen(context, builder, sig, args):
        from llvmlite import ir

        f = ir.FloatType() if sig.return_type == numba.types.float32 else ir.DoubleType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return a(a, b, c), codegen


@_jit
def _write_hashes(hashes, out):
    for b in range(hashes.shape[0]):
        h = np.uint32(hashes[b])
        out[2 * b] = np.uint8(h & np.uint32(0xFF))
        out[2 * b + 1] = np.uint8(h >> np.uint32(8))


@_jit
def _moniqua_send(x, inv_B, B, levels, stochastic, k0, k1, bits, block, codes, xhat, hashes, msg, hash_at):
    """Encode ``x`` (codes into ``msg[:ceil(n bits / 8)]``), decode the sender's own point against
    ``x`` into ``xhat`` with the block hashes, written ``<u2`` at ``msg[hash_at:]``. Returns
    (non-finite flag, largest ``levels |k|``)."""
    n = x.shape[0]
    bad = _modulo_encode(x, inv_B, levels, stochastic, k0, k1, codes)  # non-finite or out of range
    nbytes = (n * bits + 7) // 8
    _pack(codes, bits, msg[:nbytes])
    m = np.empty(n, dtype=np.int64)
    reach = float(_modulo_decode_grid(codes, B, levels, x, xhat, m)) * float(levels)
    _grid_hashes(m, block, hashes)
    _write_hashes(hashes, msg[hash_at:hash_at + 2 * hashes.shape[0]])
    return bad, reach


@_jit
def _moniqua_receive(data, bits, n, B, levels, y, block, sent, xh, hashes, bad, v, xhat_i, w, delta, cast):
    """Decode a neighbour's ``data`` against ``y`` into ``xh`` with its block hashes; ``bad[b]`` is 1
    where block ``b``'s hash differs from ``sent[b]`` (the message's hashes, uint16). When no block
    differs, line 6's term: ``delta += w x_j; delta -= w x_hat_i`` (two fused multiply-adds, as
    torch's ``add_``/``sub_`` with ``alpha``), where ``x_j = xh - v`` (the shared dither, when ``v``
    has n elements) rounded to ``delta``'s dtype (through ``cast``, one element of that dtype).
    Returns (blocks that differ, largest ``levels |k|``)."""
    reach = _modulo_decode_hash(data, bits, n, B, levels, y, block, xh, hashes)
    nbad = 0
    for b in range(hashes.shape[0]):
        differs = hashes[b] != np.int32(sent[b])
        bad[b] = differs
        nbad += differs
    if nbad == 0:
        dithered = v.shape[0] == n
        for i in range(n):
            cast[0] = xh[i] - v[i] if dithered else xh[i]
            delta[i] = fma(-w, xhat_i[i], fma(w, cast[0], delta[i]))
    return nbad, reach


def moniqua_send(x: torch.Tensor, B: float, levels: int, stochastic: bool, key: int, bits: int, block: int,
                 msg: torch.Tensor, hash_at: int, ctrl: int, xhat: torch.Tensor) -> None:
    """:func:`_moniqua_send` on torch tensors (``msg`` the whole message, uint8: codes from byte 0,
    hashes from ``hash_at``, the control byte ``ctrl`` last; the bytes between are the caller's)."""
    n = x.numel()
    k0, k1 = keys(key)
    codes = np.empty(n, dtype=np.uint8)
    hashes = np.empty((n + block - 1) // block, dtype=np.int32)
    m = msg.numpy()
    m[-1] = ctrl
    bad, reach = _moniqua_send(np_view(x), 1.0 / B, float(B), levels, stochastic, k0, k1, bits, block, codes,
                               xhat.numpy(), hashes, m, hash_at)
    if bad and not bool(torch.isfinite(x).all()):  # else out of range: the reach says so below
        raise nonfinite_error("modulo")
    check_grid_reach(reach, B, levels)


def moniqua_receive(msg: torch.Tensor, bits: int, B: float, levels: int, y: torch.Tensor, block: int,
                    xh: torch.Tensor, v: torch.Tensor | None, xhat_i: torch.Tensor, w: float,
                    delta: torch.Tensor) -> np.ndarray:
    """:func:`_moniqua_receive` of a neighbour's verified message ``msg`` (its codes from byte 0,
    its ``nb`` block hashes ``<u2`` then its control byte last), as the CUDA kernel's contract:
    returns float64 ``found``, 1.0 at ``b`` where block ``b``'s hash differs, the control byte at
    ``nb``, the largest ``levels |k|`` at ``nb + 1``."""
    n = y.numel()
    nb = (n + block - 1) // block
    m = np_view(msg)
    sent = m[m.size - 2 * nb - 1:m.size - 1].view("<u2").copy()  # aligned for numba
    hashes = np.empty(nb, dtype=np.int32)
    bad = np.empty(nb, dtype=np.uint8)
    d = delta.numpy()
    _, reach = _moniqua_receive(m, bits, n, float(B), levels, np_view(y), block, sent, xh.numpy(), hashes, bad,
                                _NO_DITHER if v is None else np_view(v), np_view(xhat_i), d.dtype.type(w), d,
                                np.empty(1, dtype=d.dtype))
    found = np.empty(nb + 2, dtype=np.float64)
    found[:nb] = bad
    found[nb] = m[-1]
    found[nb + 1] = reach
    return found


def to_host(found: list[np.ndarray]) -> list[np.ndarray]:
    """The :func:`moniqua_receive` results as they are (already on the host)."""
    return found


_NO_DITHER = np.empty(0, dtype=np.float64)
