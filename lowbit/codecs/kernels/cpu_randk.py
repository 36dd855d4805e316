"""numba kernels of the "randk" family on the CPU (:class:`~lowbit.codecs.kernels.families.RandKKernels`,
the same names and signatures as :mod:`.gpu_randk`): the random-k selection (a keyed Feistel
permutation, see :mod:`lowbit.codecs.randk`) in 32-bit lanes, and the decode's scatter.

numba widens every integer operation to 64 bits, and 64-bit multiplies vectorise
poorly; the selection's values fit 32 bits (``d < 2^31``: ``hb <= 16``,
``a <= 2^15``). :func:`feistel32` is therefore an LLVM intrinsic: the whole
permutation (all rounds unrolled, ``mix32`` as 32-bit wrapping multiplies, the
``mod a`` reduction as the high half of ``h a``, built from two 32-bit products since
``a < 2^16``: 35% faster than one widened 64-bit product, same integers) in ``i32``, which
the loop vectoriser turns into 16-lane AVX-512 (8-lane AVX2) code. It computes
exactly the integers of :func:`lowbit.codecs.randk.select_reference` and of the
64-bit kernel :func:`select_sparse` (tested). The dense selection evaluates
it a block at a time, then walks the rare cycle (values ``>= d``) and compacts
the kept indices in order: one pass over ``[0, d)``, already sorted
(:func:`select`; sparse selections take the 64-bit inverse, :func:`select_sparse`); an encode's gather of the kept values rides on the
compaction (one sequential read of ``x``). The compaction is a second intrinsic
(:func:`_compactor`): 16 lanes at a time, LLVM's vector compress (AVX-512's
``vpcompressd`` into a register, then one full store; the store form is slow on some
CPUs), or the same stores lane by lane on an LLVM without it; numba's own scalar loop
tested every signed index for wraparound (docs/CHANGELOG.md, issue 10, has the bench before and after).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..rng import MIX_C1, MIX_C2
from . import empty_output
from .cpu import _inline, _jit, as_numba, max_abs, mix32, np_view

__all__ = ["select", "scatter"]

_BLOCK = 1024
#: Lanes of one compaction step (:func:`_compactor`); the kernel's outputs have this much slack.
_LANES = 16
#: ``llvm.experimental.vector.compress`` (LLVM 19 and later; AVX-512's ``vpcompressd``): the
#: compaction's 16 lanes in a few vector instructions. Older LLVMs get the same stores lane by
#: lane. Read when a kernel is compiled.
VECTOR_COMPRESS = llvm.llvm_version_info >= (19,)


@intrinsic
def feistel32(typingctx, v, a, hb, keys):
    """``sigma(v)`` (forward) on uint32 values: ``len(keys)`` rounds (even), see
    :func:`lowbit.codecs.randk._feistel_torch`."""
    if not (v == types.uint32 and a == types.uint32 and hb == types.uint32 and isinstance(keys, types.UniTuple)
            and keys.dtype == types.uint32):
        return None
    nkeys = keys.count

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        vv, A, sb, ktup = args

        def c(k):
            return ir.Constant(i32, k)

        def mix(h):
            h = builder.xor(h, builder.lshr(h, c(16)))
            h = builder.mul(h, c(MIX_C1))
            h = builder.xor(h, builder.lshr(h, c(15)))
            h = builder.mul(h, c(MIX_C2 - (1 << 32)))
            return builder.xor(h, builder.lshr(h, c(16)))

        st = builder.sub(c(32), sb)
        bmask = builder.sub(builder.shl(c(1), sb), c(1))
        L = builder.lshr(vv, sb)
        R = builder.and_(vv, bmask)
        for r in range(nkeys):
            key = builder.extract_value(ktup, r)
            h = mix(builder.xor(R, key))
            if r % 2 == 0:  # (L, R) -> (R, (L + F(R)) mod a), F(R) = (h a) >> 32 < a
                # (h a) >> 32 from two 32-bit products (a <= 2^15 < 2^16, so nothing overflows):
                # (hH a + ((hL a) >> 16)) >> 16 with h = hH 2^16 + hL, exactly
                hi = builder.mul(builder.lshr(h, c(16)), A)
                lo = builder.lshr(builder.mul(builder.and_(h, c(0xFFFF)), A), c(16))
                f = builder.lshr(builder.add(hi, lo), c(16))
                t = builder.add(L, f)
                ge = builder.icmp_unsigned(">=", t, A)
                L, R = R, builder.select(ge, builder.sub(t, A), t)
            else:  # (L, R) -> (R, (L + F(R)) mod 2^hb), F(R) = h >> (32 - hb)
                L, R = R, builder.and_(builder.add(L, builder.lshr(h, st)), bmask)
        return builder.or_(builder.shl(L, sb), R)

    return types.uint32(v, a, hb, keys), codegen


def _popcount(builder, mask, lanes: int):
    """How many of the ``lanes`` bits of the ``<lanes x i1>`` ``mask`` are set, as an i64."""
    bits = builder.bitcast(mask, ir.IntType(lanes))
    fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(lanes)])
    return builder.zext(builder.call(fn, [bits]), ir.IntType(64))


def _compactor(gather: bool):
    """A numba intrinsic ``(buf, t, base, K, out, c, x, vals) -> c'``: of the lanes
    ``l < 16`` with ``buf[t + l] < K``, in order, store ``base + t + l`` (int32) at
    ``out[c:]`` and, with ``gather``, ``x[base + t + l]`` at ``vals[c:]``; returns ``c``
    plus their count. All 16 lanes are stored (``out`` and ``vals`` need 16 elements of
    slack). With :data:`VECTOR_COMPRESS` one vector compress per output, else the same
    stores lane by lane, branch-free."""

    @intrinsic
    def compact(typingctx, buf, t, base, K, out, c, x, vals):
        if not (isinstance(buf, types.Array) and buf.dtype == types.uint32 and isinstance(out, types.Array)
                and out.dtype == types.int32 and isinstance(x, types.Array) and isinstance(vals, types.Array)
                and x.dtype == vals.dtype and x.dtype in (types.float32, types.float64) and K == types.uint32
                and all(isinstance(v, types.Integer) for v in (t, base, c))):
            return None

        def codegen(context, builder, sig, args):
            bufa, oa, xa, va = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 4, 6, 7))
            i64, i32, i1 = ir.IntType(64), ir.IntType(32), ir.IntType(1)
            tt, bb, cc = (context.cast(builder, args[j], sig.args[j], types.int64) for j in (1, 2, 5))
            fx = context.get_value_type(sig.args[6].dtype)
            v32, vx = ir.VectorType(i32, _LANES), ir.VectorType(fx, _LANES)
            def splat(value):  # value (i32) in all 16 lanes
                one = builder.insert_element(ir.Constant(v32, None), value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(v32, None), ir.Constant(v32, [0] * _LANES))

            b = builder.load(builder.bitcast(builder.gep(bufa.data, [tt]), v32.as_pointer()), align=4)
            mask = builder.icmp_unsigned("<", b, splat(args[3]))
            idx = builder.add(splat(builder.trunc(builder.add(bb, tt), i32)), ir.Constant(v32, list(range(_LANES))))
            outs = [(idx, oa.data, v32, 4)]
            if gather:
                xv = builder.load(builder.bitcast(builder.gep(xa.data, [builder.add(bb, tt)]), vx.as_pointer()),
                                  align=sig.args[6].dtype.bitwidth // 8)
                outs.append((xv, va.data, vx, sig.args[6].dtype.bitwidth // 8))
            if VECTOR_COMPRESS:
                for vec, base_ptr, vty, align in outs:
                    # vectors of 512 bits (wider ones crash LLVM's x86 lowering): float64 in two halves
                    width = min(_LANES, 512 // (8 * align))
                    pos = cc
                    for h in range(0, _LANES, width):
                        part = ir.Constant(ir.VectorType(i32, width), list(range(h, h + width)))
                        pty = ir.VectorType(vty.element, width)
                        pv = builder.shuffle_vector(vec, ir.Constant(vty, None), part)
                        pm = builder.shuffle_vector(mask, ir.Constant(mask.type, None), part)
                        fn = builder.module.declare_intrinsic(
                            f"llvm.experimental.vector.compress.v{width}{vty.element.intrinsic_name}", (),
                            ir.FunctionType(pty, [pty, ir.VectorType(i1, width), pty]))
                        packed = builder.call(fn, [pv, pm, ir.Constant(pty, None)])
                        builder.store(packed, builder.bitcast(builder.gep(base_ptr, [pos]), pty.as_pointer()),
                                      align=align)
                        if h + width < _LANES:
                            pos = builder.add(pos, _popcount(builder, pm, width))
                return builder.add(cc, _popcount(builder, mask, _LANES))
            pos = cc
            for lane in range(_LANES):
                for vec, base_ptr, _, align in outs:
                    builder.store(builder.extract_element(vec, ir.Constant(i32, lane)), builder.gep(base_ptr, [pos]),
                                  align=align)
                pos = builder.add(pos, builder.zext(builder.extract_element(mask, ir.Constant(i32, lane)), i64))
            return pos

        return types.int64(buf, t, base, K, out, c, x, vals), codegen

    return compact


_compact_indices = _compactor(False)
_compact_gather = _compactor(True)


@_jit
def _walk(v, D, A, HB, keys):
    while v >= D:
        v = feistel32(v, A, HB, keys)
    return v


@_jit
def _select_dense(d, k, a, hb, keys, out, gather, x, vals):
    """``out[:c]`` = the sorted ``i < d`` with ``sigma(i) < k``; returns ``c`` (= k). With
    ``gather``, also ``vals[:c] = x[out[:c]]`` in the same pass. Per block: the permutation
    (vectorised), the rare cycle walks (values ``>= d``, only in a block that has one),
    then the compaction, 16 lanes at a time (:func:`_compactor`). ``out`` and ``vals``
    need :data:`_LANES` elements of slack."""
    D = np.uint32(d)
    K = np.uint32(k)
    A = np.uint32(a)
    HB = np.uint32(hb)
    buf = np.empty(_BLOCK, dtype=np.uint32)
    c = 0
    for base in range(0, d, _BLOCK):
        m = min(_BLOCK, d - base)
        over = False
        for t in range(m):
            v = feistel32(np.uint32(base + t), A, HB, keys)
            over |= v >= D
            buf[t] = v
        if over:
            for t in range(m):
                if buf[t] >= D:
                    buf[t] = _walk(buf[t], D, A, HB, keys)
        whole = m - m % _LANES
        if gather:
            for t in range(0, whole, _LANES):
                c = _compact_gather(buf, t, base, K, out, c, x, vals)
        else:
            for t in range(0, whole, _LANES):
                c = _compact_indices(buf, t, base, K, out, c, x, vals)
        for t in range(whole, m):  # the last block's tail
            out[c] = np.int32(base + t)
            if gather:
                vals[c] = x[base + t]
            c += 1 if buf[t] < K else 0
    return c


def select(d: int, k: int, a: int, hb: int, round_keys, dense: bool, device=None, x: torch.Tensor | None = None):
    """The sorted indices ``{i < d : sigma(i) < k}`` on the CPU (see :mod:`lowbit.codecs.randk`;
    int32 from the 32-bit kernel, int64 otherwise): the 32-bit kernel for a dense selection,
    else :func:`select_sparse` (``sigma^-1`` on ``j < k`` and a sort). With ``x``
    (``d`` elements): ``(indices, x's kept values)``, gathered in the selection's pass when the
    32-bit kernel runs on a float32/float64 ``x``."""
    if not dense or d <= 1:  # d = 1 (hb = 0, no permutation to run): index 0 is kept when k >= 1
        idx = select_sparse(d, k, a, hb, round_keys)
        return idx if x is None else (idx, x.index_select(0, idx))
    keys = tuple(np.uint32(int(v)) for v in round_keys)
    out = torch.empty(k + _LANES, dtype=torch.int32)  # d < 2^31; half the bytes of int64 to write and read
    gather = x is not None and x.dtype in (torch.float32, torch.float64)
    xs = np_view(x) if gather else np.empty(0, dtype=np.float32)
    vals = torch.empty(k + _LANES, dtype=x.dtype) if gather else torch.empty(0)
    c = _select_dense(d, k, a, hb, keys, out.numpy(), gather, xs, vals.numpy())
    if c != k:
        raise RuntimeError(f"the Feistel selection kept {c} of {d} coordinates instead of {k}")
    idx = out[:k]
    if x is None:
        return idx
    return idx, (vals[:k] if gather else x.index_select(0, idx))


# --- random-k: a keyed Feistel permutation of [0, d) -------------------------------------------

@_inline
def _feistel(v, a, hb, keys, forward):
    """One evaluation of the permutation of ``[0, a 2^hb)`` (or its inverse): ``v = L 2^hb + R``,
    rounds alternate ``(L, R) -> (R, L + F(R) mod a)`` and ``(L, R) -> (R, L + F(R) mod 2^hb)``
    (``len(keys)`` rounds, even; ``keys`` a tuple: no reference counting in the loop). All arithmetic is uint64 on values below 2^48."""
    s32 = np.uint64(32)
    sb = np.uint64(hb)
    st = np.uint64(32 - hb)
    bmask = (np.uint64(1) << sb) - np.uint64(1)
    A = np.uint64(a)
    L = np.uint64(v) >> sb
    R = np.uint64(v) & bmask
    npairs = len(keys) // 2
    if forward:
        for p in range(npairs):
            # even round: L in [0, a), R in [0, 2^hb)  ->  (R, (L + F) mod a)
            t = L + ((mix32(R ^ keys[2 * p]) * A) >> s32)
            L2 = R
            R2 = t - A if t >= A else t
            # odd round: L2 in [0, 2^hb), R2 in [0, a)  ->  (R2, (L2 + F) mod 2^hb)
            L = R2
            R = (L2 + (mix32(R2 ^ keys[2 * p + 1]) >> st)) & bmask
    else:
        for q in range(npairs):
            p = npairs - 1 - q
            # undo the odd round: (L, R) = (R2, (L2 + F(R2)) mod 2^hb)
            R2 = L
            L2 = (R - (mix32(R2 ^ keys[2 * p + 1]) >> st)) & bmask
            # undo the even round: (L2, R2) = (R_old, (L_old + F(R_old)) mod a)
            t = R2 + A - ((mix32(L2 ^ keys[2 * p]) * A) >> s32)
            L = t - A if t >= A else t
            R = L2
    return (L << sb) | R


@_jit
def _walk_on(v, D, a, hb, keys, forward):
    """The rest of a cycle walk (rare: the domain exceeds d by less than 2 sqrt(d) + 1)."""
    while v >= D:
        v = _feistel(v, a, hb, keys, forward)
    return v


@_jit
def _select_sparse(d, k, a, hb, keys, out):
    """``out[j] = sigma^-1(j)`` for ``j < k`` (unsorted)."""
    D = np.uint64(d)
    for j in range(k):
        out[j] = np.int64(_feistel(np.uint64(j), a, hb, keys, False))
    for j in range(k):
        v = np.uint64(out[j])
        if v >= D:
            out[j] = np.int64(_walk_on(v, D, a, hb, keys, False))


_SCATTER_BLOCK = 2048  # output elements zeroed and filled while they sit in the L1 cache


@_jit
def _scatter(vals, idx, factor, out):
    """``out`` = zeros with ``out[idx[j]] = vals[j] * factor`` (float64 product, stored in
    out's dtype), for ``idx`` strictly increasing in ``[0, len(out))`` (the selection makes it
    so, and :class:`lowbit.codecs.RandKCodec` checks indices it reads from a message; an index
    at or beyond ``len(out)`` ends the loop: nothing is written out of bounds). Each block of
    ``out`` is zeroed and then receives its kept values while it is in the cache, so ``out`` is
    written to memory once (zeros and then a scatter write it twice); unsigned indices spare
    numba's wraparound test on every access."""
    n = np.uint64(out.shape[0])
    k = np.uint64(idx.shape[0])
    blk = np.uint64(_SCATTER_BLOCK)
    j = np.uint64(0)
    for base in range(np.uint64(0), n, blk):
        end = min(base + blk, n)
        for p in range(base, end):
            out[p] = 0
        while j < k:
            i = np.uint64(idx[j])
            if i >= end:
                break
            out[i] = np.float64(vals[j]) * factor
            j += np.uint64(1)


# --- torch-level API (the randk family; :mod:`.gpu_randk` has the same names and signatures) ------

def select_sparse(d: int, k: int, a: int, hb: int, round_keys: np.ndarray) -> torch.Tensor:
    """The sorted int64 indices ``{i < d : sigma(i) < k}`` (see :mod:`lowbit.codecs.randk`) as
    ``sigma^-1(j)`` for ``j < k``, sorted: the selection when ``k`` is small against ``d``
    (the dense one is :func:`.cpu_randk.select`'s 32-bit pass)."""
    out = torch.empty(k, dtype=torch.int64)
    _select_sparse(d, k, a, hb, tuple(np.uint64(v) for v in round_keys), out.numpy())
    return out.sort().values


def scatter(vals: torch.Tensor, idx: torch.Tensor, n: int, factor: float, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """Zeros of ``n`` elements with ``vals * factor`` (float64 products, cast to ``dtype``) at
    ``idx`` (strictly increasing in ``[0, n)``), and whether a product is beyond ``dtype``'s
    largest finite value (or NaN)."""
    direct = dtype in (torch.float32, torch.float64)
    out = empty_output(n, dtype if direct else torch.float64)
    _scatter(as_numba(vals), np_view(idx), float(factor), out.numpy())
    # the products grow with |vals|: the largest one decides (a NaN makes it NaN, which fails too).
    # One vectorised pass over vals: the same test per element in the scatter's scalar loop cost
    # 27% of its time here, this 11%
    far = not abs(max_abs(vals) * float(factor)) <= float(torch.finfo(dtype).max)
    return (out if direct else out.to(dtype)), far
