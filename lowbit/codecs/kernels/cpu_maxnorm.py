"""numba kernels of the "maxnorm" family on the CPU: QSGDMaxNorm, its bucketed and
multi-scale variants (:class:`~lowbit.codecs.kernels.families.CpuMaxNormKernels`; the
same names and signatures as :mod:`.gpu_maxnorm`, which lacks the bucketed variant).

Each kernel is one branch-free loop over the elements that reads its input
once in its own dtype and computes in float64 registers. Note: numba types
``float(x[i])`` of a float32 element as float32, so the kernels widen with
``np.float64(x[i])``.

Error flags (one int returned by an encode kernel, raised once by the caller):
``FLAG_NONFINITE`` (NaN or inf in x), ``FLAG_OVER`` (some ``|x_i|`` above the
shared norm), ``FLAG_INDEX`` (a scale index outside ``0..N-1``), ``FLAG_LEVEL``
(a scale index finer than this worker's admissible one: a code above ``s_min``).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import empty_output
from .cpu import _inline, _jit, as_numba, keys, np_view, round_stochastic

__all__ = ["FLAG_NONFINITE", "FLAG_OVER", "FLAG_INDEX", "FLAG_LEVEL", "as_scale", "norm_stats", "code_dtype",
           "qsgd_encode", "qsgd_decode", "ms_index", "ms_encode_int", "ms_encode_words", "ms_decode_sum",
           "ms_decode_words", "bucket_norms", "qsgd_encode_buckets",
           "qsgd_decode_buckets"]

FLAG_NONFINITE = 1
FLAG_OVER = 2
FLAG_INDEX = 4
FLAG_LEVEL = 8


_DBL_MAX = float(np.finfo(np.float64).max)
LANES = 8  # the fixed-order sum of squares: 8 interleaved float64 lanes, combined pairwise


# --- the norm -----------------------------------------------------------------------------

@intrinsic
def _norm_groups(typingctx, x, groups, lanes):
    """Over the ``groups`` whole groups of 8 elements at the start of ``x`` (float32 or
    float64): ``lanes[l] += x_i^2`` (float64) for ``i = l mod 8`` in index order, and the
    largest ``|x_i|`` as a float64 (NaN or inf when one ``x_i`` is: ``|x_i|``'s bits as an
    unsigned integer, whose order is the order of the magnitudes and puts every NaN and inf
    above the finite values). The loop is written in LLVM IR on vectors of 8 lanes (a float64
    vector accumulator, an integer max), which numba's loops do not vectorise: one pass at
    memory speed, the same float64 sums as the scalar loop of the reference."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype in (types.float32, types.float64)
            and isinstance(groups, types.Integer) and isinstance(lanes, types.Array) and lanes.dtype == types.float64):
        return None

    def codegen(context, builder, sig, args):
        xa = context.make_array(sig.args[0])(context, builder, args[0])
        la = context.make_array(sig.args[2])(context, builder, args[2])
        n = context.cast(builder, args[1], sig.args[1], types.int64)
        i64 = ir.IntType(64)
        width = sig.args[0].dtype.bitwidth
        iw = ir.IntType(width)
        fx = context.get_value_type(sig.args[0].dtype)
        d8, x8, b8 = ir.VectorType(ir.DoubleType(), LANES), ir.VectorType(fx, LANES), ir.VectorType(iw, LANES)
        lp = builder.bitcast(la.data, d8.as_pointer())
        acc0 = builder.load(lp, align=8)
        entry = builder.block
        loop = builder.append_basic_block("groups")
        done = builder.append_basic_block("groups_done")
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        acc = builder.phi(d8)
        top = builder.phi(b8)
        v = builder.load(builder.bitcast(builder.gep(xa.data, [builder.mul(i, ir.Constant(i64, LANES))]),
                                         x8.as_pointer()), align=width // 8)
        vd = builder.fpext(v, d8) if width == 32 else v
        acc_next = builder.fadd(acc, builder.fmul(vd, vd))
        mag = builder.and_(builder.bitcast(v, b8), ir.Constant(b8, [(1 << (width - 1)) - 1] * LANES))
        top_next = builder.select(builder.icmp_unsigned(">", mag, top), mag, top)
        i_next = builder.add(i, ir.Constant(i64, 1))
        builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
        zero = ir.Constant(b8, [0] * LANES)
        i.add_incoming(ir.Constant(i64, 0), entry)
        i.add_incoming(i_next, loop)
        acc.add_incoming(acc0, entry)
        acc.add_incoming(acc_next, loop)
        top.add_incoming(zero, entry)
        top.add_incoming(top_next, loop)
        builder.position_at_end(done)
        acc_out = builder.phi(d8)
        acc_out.add_incoming(acc0, entry)
        acc_out.add_incoming(acc_next, loop)
        top_out = builder.phi(b8)
        top_out.add_incoming(zero, entry)
        top_out.add_incoming(top_next, loop)
        builder.store(acc_out, lp, align=8)
        m = builder.extract_element(top_out, ir.Constant(ir.IntType(32), 0))
        for l in range(1, LANES):
            e = builder.extract_element(top_out, ir.Constant(ir.IntType(32), l))
            m = builder.select(builder.icmp_unsigned(">", e, m), e, m)
        f = builder.bitcast(m, fx)
        return builder.fpext(f, ir.DoubleType()) if width == 32 else f

    return types.float64(x, groups, lanes), codegen


@_jit
def _norm_stats(x):
    """``(max |x|, sum x^2, nonfinite)``; the sum in the fixed order of
    :func:`lowbit.codecs.maxnorm.sum_squares_reference` (lane ``i mod 8``, then pairwise)."""
    n = x.shape[0]
    full = n - n % LANES
    lanes = np.zeros(LANES)
    amax = _norm_groups(x, full // LANES, lanes)
    for i in range(full, n):
        v = np.float64(x[i])
        lanes[i - full] += v * v
        a = abs(v)
        amax = a if (a > amax or a != a) else amax
    sq = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    return amax, sq, not amax <= _DBL_MAX


# --- QSGDMaxNorm ---------------------------------------------------------------------------

@_inline
def _checked(xi, W):
    """``(v, |v|, flags)`` for ``v`` = x_i widened to float64: FLAG_NONFINITE, FLAG_OVER
    (``|v|`` above the shared norm W)."""
    v = np.float64(xi)
    a = abs(v)
    return v, a, (FLAG_NONFINITE if (v - v) != 0.0 else 0) | (FLAG_OVER if a > W else 0)


@_inline
def _scale_index(idx_i, N):
    """``(j, out of range)``: the scale index ``idx_i`` as an int64, 0 where it lies outside ``0..N-1``."""
    j = np.int64(idx_i)
    out = j < 0 or j >= N
    return (0 if out else j), out


@_jit
def _qsgd_encode(x, W, Wdiv, s, offset, k0, k1, codes):
    """``codes[i] = sign(x_i) * sround(|x_i| / W * s) + offset``; returns the error flags."""
    S = float(s)
    flags = 0
    for i in range(x.shape[0]):
        v, a, f = _checked(x[i], W)
        flags |= f
        mag = np.int64(round_stochastic((a / Wdiv) * S, k0, k1, i))
        codes[i] = (-mag if v < 0.0 else mag) + offset
    return flags


@_jit
def _qsgd_decode(codes, offset, f, m, out):
    """``out[i] = (codes[i] - offset) * f / m`` (``f = W / s``)."""
    for i in range(codes.shape[0]):
        out[i] = (float(np.int64(codes[i]) - offset) * f) / m


# --- QSGDMaxNorm in buckets (one shared norm per bucket of ``bucket`` consecutive elements) -------

@_jit
def _bucket_norms(x, bucket, linf, out):
    """``out[j]`` = bucket ``j``'s norm: ``max |x_i|`` (``linf``) or ``max(sqrt(sum x_i^2), max |x_i|)``,
    each bucket's sum in :func:`_norm_stats`'s fixed lane order counted from the bucket's start;
    returns the non-finite flag."""
    n = x.shape[0]
    bad = False
    for j in range(out.shape[0]):
        start = j * bucket
        stop = min(n, start + bucket)
        amax, sq, nonfinite = _norm_stats(x[start:stop])
        bad |= nonfinite
        r = np.sqrt(sq)
        out[j] = amax if (linf or amax > r) else r
    return bad


@_jit
def _qsgd_encode_buckets(x, W, Wdiv, bucket, s, offset, k0, k1, codes):
    """:func:`_qsgd_encode` with bucket ``j``'s own norm ``W[j]`` (``Wdiv[j]``: ``W[j]``, 1 where it
    is 0); the uniforms are indexed by the element's position in ``x``, as there."""
    S = float(s)
    n = x.shape[0]
    flags = 0
    for j in range(W.shape[0]):
        Wj = W[j]
        Dj = Wdiv[j]
        start = j * bucket
        xs, cs = x[start:min(n, start + bucket)], codes[start:min(n, start + bucket)]
        for i in range(xs.shape[0]):  # one contiguous slice per bucket: the loop vectorises
            v, a, f = _checked(xs[i], Wj)
            flags |= f
            mag = np.int64(round_stochastic((a / Dj) * S, k0, k1, start + i))
            cs[i] = (-mag if v < 0.0 else mag) + offset
    return flags


@_jit
def _qsgd_decode_buckets(codes, offset, f, bucket, m, out):
    """``out[i] = (codes[i] - offset) * f[j] / m`` for ``i`` in bucket ``j`` (``f[j] = W[j] / s``)."""
    n = codes.shape[0]
    for j in range(f.shape[0]):
        fj = f[j]
        start = j * bucket
        cs, os = codes[start:min(n, start + bucket)], out[start:min(n, start + bucket)]
        for i in range(cs.shape[0]):
            os[i] = (float(np.int64(cs[i]) - offset) * fj) / m


# --- multi-scale ------------------------------------------------------------------------------

@_inline
def _admissible(a, levels, s_min):
    """The index of the largest scale ``s_j`` with ``a s_j <= s_min`` (eq. 11); ``levels`` ascending."""
    j = 0
    for k in range(1, levels.shape[0]):
        j += 1 if a * levels[k] <= s_min else 0
    return j


@_jit
def _ms_index(x, W, Wdiv, levels, idx):
    """Per-coordinate admissible scale index (uint8); returns the error flags."""
    s_min = levels[0]
    flags = 0
    for i in range(x.shape[0]):
        v, a, f = _checked(x[i], W)
        flags |= f
        idx[i] = np.uint8(_admissible(a / Wdiv, levels, s_min))
    return flags


@_jit
def _ms_encode_int(x, W, Wdiv, levels, idx, k0, k1, codes):
    """Signed codes against the agreed per-coordinate scale ``levels[idx[i]]``."""
    s_min = levels[0]
    N = levels.shape[0]
    flags = 0
    badidx = False
    level = False
    for i in range(x.shape[0]):
        v, a, f = _checked(x[i], W)
        flags |= f
        j, out_of_range = _scale_index(idx[i], N)
        badidx |= out_of_range
        t = (a / Wdiv) * levels[j]
        level |= t > s_min
        mag = np.int64(round_stochastic(t, k0, k1, i))
        codes[i] = -mag if v < 0.0 else mag
    return flags | (FLAG_INDEX if badidx else 0) | (FLAG_LEVEL if level else 0)


@_jit
def _ms_encode_words(x, W, Wdiv, levels, code_bits, k0, k1, words):
    """One message with this worker's own scale indices: ``(j << code_bits) | (code + s_min)``.
    ``levels`` is a tuple (its length a compile-time constant: the scale choice unrolls and
    the loop stays branch-free); the chosen scale is tracked with the index, no gather."""
    s_min = levels[0]
    off = np.int64(s_min)
    flags = 0
    for i in range(x.shape[0]):
        v, a, f = _checked(x[i], W)
        flags |= f
        r = a / Wdiv
        j = 0
        lev = s_min
        for k in range(1, len(levels)):  # ascending: the admissible scales are a prefix (eq. 11)
            ok = r * levels[k] <= s_min
            j += 1 if ok else 0
            lev = levels[k] if ok else lev
        mag = np.int64(round_stochastic(r * lev, k0, k1, i))
        words[i] = (np.int64(j) << code_bits) | ((-mag if v < 0.0 else mag) + off)
    return flags


@_jit
def _ms_decode_sum(codes, idx, W, levels, m, out):
    """``codes * W / levels[idx] / m``; returns True when an index lies outside ``0..N-1``."""
    N = levels.shape[0]
    badidx = False
    for i in range(codes.shape[0]):
        j, out_of_range = _scale_index(idx[i], N)
        badidx |= out_of_range
        out[i] = ((float(codes[i]) * W) / levels[j]) / m
    return badidx


@_jit
def _ms_decode_words(words, code_bits, W, levels, out):
    """One message: ``(w & mask) - s_min`` on the scale ``levels[w >> code_bits]``."""
    off = np.int64(levels[0])
    mask = (np.int64(1) << code_bits) - 1
    N = levels.shape[0]
    badidx = False
    for i in range(words.shape[0]):
        w = np.int64(words[i])
        j = w >> code_bits
        out_of_range = j >= N
        badidx |= out_of_range
        out[i] = (float((w & mask) - off) * W) / levels[0 if out_of_range else j]
    return badidx


# --- torch-level API (the same names and signatures as the Triton module) ----------------------

def _W(W) -> tuple[float, float]:
    W = float(W)
    return W, (W if W > 0 else 1.0)


def as_scale(W: float, x: torch.Tensor) -> torch.Tensor:
    """The shared-scale tensor ``[W]`` (float32) on x's device."""
    return torch.tensor([W], dtype=torch.float32, device=x.device)


def norm_stats(x: torch.Tensor) -> tuple[float, float, bool]:
    """``(max |x|, sum x^2 in the fixed 8-lane order, all finite)``."""
    amax, sq, bad = _norm_stats(as_numba(x))
    return amax, sq, not bad


def code_dtype(bits: int) -> torch.dtype:
    """The narrowest dtype of the offset (non-negative) codes of ``bits`` bits on the wire."""
    return torch.uint8 if bits <= 8 else (torch.int32 if bits <= 31 else torch.int64)


def qsgd_encode(x: torch.Tensor, W, levels: int, offset: int, key: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(codes, flags)``: ``sign(x) sround(|x| / W * levels) + offset`` as ``dtype``."""
    W, Wdiv = _W(W)
    codes = torch.empty(x.numel(), dtype=dtype)
    k0, k1 = keys(key)
    flags = _qsgd_encode(as_numba(x), W, Wdiv, levels, offset, k0, k1, codes.numpy())
    return codes, flags


def qsgd_decode(codes: torch.Tensor, offset: int, W, levels: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """``(codes - offset) * (W / levels) / m`` in float64 registers, stored as ``dtype``."""
    direct = dtype in (torch.float32, torch.float64)
    out = empty_output(codes.numel(), dtype if direct else torch.float64)
    _qsgd_decode(np_view(codes), offset, float(W) / levels, float(m), out.numpy())
    return out if direct else out.to(dtype)


def bucket_norms(x: torch.Tensor, bucket: int, linf: bool) -> tuple[torch.Tensor, bool]:
    """``(float64 norm of each bucket of bucket elements, all finite)``; one zero for an empty x."""
    out = torch.empty(max(1, -(-x.numel() // bucket)), dtype=torch.float64)
    bad = _bucket_norms(as_numba(x), bucket, linf, out.numpy())
    return out, not bad


def qsgd_encode_buckets(x: torch.Tensor, W: torch.Tensor, bucket: int, levels: int, offset: int, key: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(codes, flags)``: :func:`qsgd_encode` with bucket ``j``'s norm ``W[j]`` (float64)."""
    W = W.to(torch.float64).contiguous()
    Wdiv = torch.where(W > 0, W, torch.ones_like(W))
    codes = torch.empty(x.numel(), dtype=dtype)
    k0, k1 = keys(key)
    flags = _qsgd_encode_buckets(as_numba(x), W.numpy(), Wdiv.numpy(), bucket, levels, offset, k0, k1, codes.numpy())
    return codes, flags


def qsgd_decode_buckets(codes: torch.Tensor, offset: int, W: torch.Tensor, bucket: int, levels: int, m: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """:func:`qsgd_decode` with bucket ``j``'s norm ``W[j]`` (float64)."""
    direct = dtype in (torch.float32, torch.float64)
    out = empty_output(codes.numel(), dtype if direct else torch.float64)
    f = (W.to(torch.float64) / levels).contiguous()
    _qsgd_decode_buckets(np_view(codes), offset, f.numpy(), bucket, float(m), out.numpy())
    return out if direct else out.to(dtype)


def ms_index(x: torch.Tensor, W, levels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(uint8 index of the admissible scale, flags)``; ``levels`` float64 ascending."""
    W, Wdiv = _W(W)
    idx = torch.empty(x.numel(), dtype=torch.uint8)
    return idx, _ms_index(as_numba(x), W, Wdiv, np_view(levels), idx.numpy())


def ms_encode_int(x: torch.Tensor, W, levels: torch.Tensor, idx: torch.Tensor, key: int,
                  dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, int]:
    """``(signed codes on the scales levels[idx] as dtype, flags)``."""
    W, Wdiv = _W(W)
    codes = torch.empty(x.numel(), dtype=dtype)
    k0, k1 = keys(key)
    flags = _ms_encode_int(as_numba(x), W, Wdiv, np_view(levels), np_view(idx), k0, k1, codes.numpy())
    return codes, flags


def ms_encode_words(x: torch.Tensor, W, levels: torch.Tensor, code_bits: int, key: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(words (j << code_bits) | (code + s_min) with this worker's own indices j, flags)``."""
    W, Wdiv = _W(W)
    words = torch.empty(x.numel(), dtype=dtype)
    k0, k1 = keys(key)
    lev = tuple(float(v) for v in levels.tolist())
    return words, _ms_encode_words(as_numba(x), W, Wdiv, lev, code_bits, k0, k1, words.numpy())


def ms_decode_sum(codes: torch.Tensor, idx: torch.Tensor, W, levels: torch.Tensor, m: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(codes * W / levels[idx] / m as dtype, flags)`` (FLAG_INDEX for an index outside 0..N-1)."""
    direct = dtype in (torch.float32, torch.float64)
    out = empty_output(codes.numel(), dtype if direct else torch.float64)
    bad = _ms_decode_sum(np_view(codes), np_view(idx), float(W), np_view(levels), float(m), out.numpy())
    return (out if direct else out.to(dtype)), (FLAG_INDEX if bad else 0)


def ms_decode_words(words: torch.Tensor, code_bits: int, W, levels: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(one message's decode as dtype, flags)``."""
    direct = dtype in (torch.float32, torch.float64)
    out = empty_output(words.numel(), dtype if direct else torch.float64)
    bad = _ms_decode_words(np_view(words), code_bits, float(W), np_view(levels), out.numpy())
    return (out if direct else out.to(dtype)), (FLAG_INDEX if bad else 0)
