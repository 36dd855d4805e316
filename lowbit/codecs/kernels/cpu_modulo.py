"""numba kernels of the "modulo" family on the CPU: Moniqua's codec (ModuloCodec, eq. (5))
and its verified exchange (one kernel call per message: encode, pack, own decode and block
hashes on the sender; decode, hash check and line 6's mixing term on the receiver).

Kernels as in :mod:`.cpu`: one loop over the elements in float64 registers, giving the
reference's bytes exactly; a non-finite or out-of-range input sets a flag that the caller
raises once. The torch-level API is :class:`~lowbit.codecs.kernels.families.ModuloKernels`,
the same names and signatures as :mod:`.gpu_modulo`.
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
from . import empty_output
from .cpu import (M32, _MAGNITUDE_MASK, _as_float, _as_magnitude_float, _jit, _pack, _unpack, as_numba, keys,
                  mix32, nonfinite_error, np_view, pack, rint, round_stochastic, unpack)

__all__ = ["pack", "unpack", "modulo_encode", "modulo_decode", "modulo_decode_hash", "moniqua_send", "moniqua_receive",
           "to_host"]


@_jit
def centered_mod(z, a, inv_a):
    """``z mod a`` in ``[-a/2, a/2)`` (``inv_a = 1/a``), computed as
    :func:`lowbit.codecs.modulo.centered_mod`."""
    r = z - a * math.floor(z * inv_a + 0.5)
    h = a * 0.5
    return r - a if r >= h else (r + a if r < -h else r)


# --- Moniqua's modulo codec ------------------------------------------------------------------

@_jit
def _modulo_encode(x, inv_B, levels, stochastic, k0, k1, codes, i0=0):
    """Codes ``Q((x / B) mod 1) * levels mod levels`` (see ModuloCodec; ``levels`` a
    power of two; ``x[0]`` is element ``i0`` of the stochastic rounding's stream); returns True
    when an element is not finite or out of the codec's range (``|x| > (2^53 / levels - 1) B``:
    :func:`lowbit.codecs.modulo.modulo_limit`), one comparison per element for both (the caller
    tells them apart on that error path)."""
    L = float(levels)
    lim = (MODULO_GRID_LIMIT / L - 1.0) / inv_B
    mask = levels - 1
    bad = False
    if stochastic:
        for i in range(x.shape[0]):
            xv = np.float64(x[i])
            bad |= not abs(xv) <= lim  # NaN fails it too
            c = round_stochastic(centered_mod(xv * inv_B, 1.0, 1.0) * L, k0, k1, i0 + i)
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
def _grid_hashes(m, i0, block, hashes):
    """Per block of ``block`` elements, the 16-bit hash of the grid integers ``m`` (``m[0]`` is
    element ``i0``, the first of a block)."""
    n = m.shape[0]
    for blk in range(hashes.shape[0]):
        acc = np.uint64(0)
        for i in range(blk * block, min(n, (blk + 1) * block)):
            acc += grid_element_hash(m[i], i0 + i)
        hashes[blk] = np.int32(mix32(acc & M32) & np.uint64(0xFFFF))


#: elements per chunk of the decode-and-hash kernels (rounded to whole blocks and bytes): their
#: scratch codes and grid integers (9 bytes an element) stay in the core's caches
CHUNK = 4096


@_jit
def _chunk(block):
    """Elements per chunk: whole blocks (each chunk's hashes are its own) and a multiple of 8
    (its codes start on a byte at any width), about :data:`CHUNK`."""
    step = block
    while step % 8:
        step += block
    return step * max(1, CHUNK // step)


@_jit
def _modulo_decode_hash(data, b, n, B, levels, y, block, out, hashes):
    """:func:`_modulo_decode` of the ``n`` codes packed ``b`` bits each in ``data`` (b in 1, 2,
    4, 8), and per block of ``block`` elements the 16-bit hash of the grid integers ``m = code -
    levels k`` of the decoded values. Returns the largest ``levels |k|`` met (the caller refuses
    it beyond 2^53: the grid integers would not be exact). Three flat passes (unpack, decode,
    hash) per :func:`_chunk` of elements over scratch that stays in cache: one fused pass did
    not vectorise."""
    c = _chunk(block)
    codes = np.empty(min(n, c), dtype=np.uint8)
    m = np.empty(min(n, c), dtype=np.int64)
    reach = np.int64(0)
    for s in range(0, n, c):
        e = min(n, s + c)
        cc, mc = codes[:e - s], m[:e - s]
        _unpack(data[s * b // 8:], b, cc)
        reach = max(reach, _modulo_decode_grid(cc, B, levels, y[s:e], out[s:e], mc))
        _grid_hashes(mc, s, block, hashes[s // block:(e + block - 1) // block])
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
def _moniqua_send(x, inv_B, B, levels, stochastic, k0, k1, bits, block, xhat, hashes, msg, hash_at):
    """Encode ``x`` (codes into ``msg[:ceil(n bits / 8)]``), decode the sender's own point against
    ``x`` into ``xhat`` with the block hashes, written ``<u2`` at ``msg[hash_at:]``; per
    :func:`_chunk` of elements. Returns (non-finite flag, largest ``levels |k|``)."""
    n = x.shape[0]
    c = _chunk(block)
    codes = np.empty(min(n, c), dtype=np.uint8)
    m = np.empty(min(n, c), dtype=np.int64)
    bad = False  # non-finite or out of range
    reach = np.int64(0)
    for s in range(0, n, c):
        e = min(n, s + c)
        cc, mc, xc = codes[:e - s], m[:e - s], x[s:e]
        bad |= _modulo_encode(xc, inv_B, levels, stochastic, k0, k1, cc, s)
        _pack(cc, bits, msg[s * bits // 8:((e * bits + 7) // 8)])
        reach = max(reach, _modulo_decode_grid(cc, B, levels, xc, xhat[s:e], mc))
        _grid_hashes(mc, s, block, hashes[s // block:(e + block - 1) // block])
    _write_hashes(hashes, msg[hash_at:hash_at + 2 * hashes.shape[0]])
    return bad, float(reach) * float(levels)


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
    hashes = np.empty((n + block - 1) // block, dtype=np.int32)
    m = msg.numpy()
    m[-1] = ctrl
    bad, reach = _moniqua_send(np_view(x), 1.0 / B, float(B), levels, stochastic, k0, k1, bits, block,
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
