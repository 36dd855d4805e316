"""numba kernels of the 16-bit float codecs (fp16, bf16) on the CPU.

numba has no 16-bit float type, so the conversions are LLVM IR written here:
fp16 by ``fptrunc`` / ``fpext`` through LLVM's ``half`` (which becomes the F16C
``vcvtps2ph`` / ``vcvtph2ps`` instructions, 16 lanes on AVX-512), bf16 by round
to nearest even on the float32 bits in 32-bit integer arithmetic. The results
are torch's casts bit for bit (fp16: IEEE round to nearest even; bf16: torch's
round to nearest even on the bits), tested over every 16-bit pattern and
millions of float32 patterns in tests/test_fastpath_lowp.py.

Each kernel is one branch-free pass. The encode casts float32 (or, for the DDP
hooks, the float32 quotient ``x / N``: ``half_encode(..., divisor=N)``) to 16-bit bits
and, in the same pass, flags an all-ones exponent in the result (a NaN or inf
input, or a value that rounds to inf: the caller tells them apart on its
error path only); the flag does not stop the vectoriser (the loop compiles to
``vcvtps2ph`` on zmm registers and a compare per 16 lanes).

The kernels take addresses (``Tensor.data_ptr()``) and lengths, not arrays: no
tensor becomes a numpy array at each call (``Tensor.numpy()`` and dtype views
are Python work that every call would pay); the torch-level functions at the
bottom check dtype, contiguity and alignment before passing an address.

Two ways to store. In cache (the default), plain stores: the result is read
again soon (a decode reads the encode's output, a training step reads the
decode's) and should still be in cache then. Streaming (``stream=True``):
nontemporal stores of whole aligned 16-lane blocks (a scalar head up to the
alignment and a scalar tail around them, then a fence so that other threads
see the stores in order). A plain store first reads the cache line it writes
(read-for-ownership), so a round trip moves 4n + 2n + 2n (encode: read, write,
line read) plus 2n + 4n + 4n (decode) = 18n bytes; streamed, 12n, the least
that reading and writing the data takes. That pays only when the written array
would not have stayed in cache anyway: by default (``stream=None``) a call
streams when the bytes it reads and writes exceed half the last-level cache
(:func:`last_level_cache_bytes`; the other half is left to other data and
other cores), never when the cache size is unknown. On the machine measured
(32 MiB L3) streaming started to pay between 1e6 and 2e6 elements per call
(6-12 MB moved), and the rule streams from 2.8e6: a margin on the safe side.
Figures and commands: lowp.py's module docstring, docs/RESULTS.md.
"""

from __future__ import annotations

import functools
import glob
import platform

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .cpu import _inline, _jit

__all__ = ["half_encode", "half_decode"]

# the exponent field of a 16-bit float: all ones is inf or NaN
_EXP_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
#: lanes of a streamed block: 16 float32 (one 64-byte line) and 16 16-bit values (32 bytes)
LANES = 16

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_I16, _I32, _F32, _HALF = ir.IntType(16), ir.IntType(32), ir.FloatType(), ir.HalfType()


def _of(t: ir.Type, lanes: int | None) -> ir.Type:
    return t if lanes is None else ir.VectorType(t, lanes)


def _const(t: ir.Type, lanes: int | None, k: int) -> ir.Constant:
    return ir.Constant(t, k) if lanes is None else ir.Constant(ir.VectorType(t, lanes), [k] * lanes)


# --- the conversions as IR, on scalars (lanes=None) or vectors -----------------------------------

def _ir_f32_to_f16(builder, v, lanes):
    """float32 -> binary16 bits (round to nearest even; inf for overflow)."""
    return builder.bitcast(builder.fptrunc(v, _of(_HALF, lanes)), _of(_I16, lanes))


def _ir_f16_to_f32(builder, h, lanes):
    """binary16 bits -> float32 (exact)."""
    return builder.fpext(builder.bitcast(h, _of(_HALF, lanes)), _of(_F32, lanes))


def _ir_u32_to_bf16(builder, u, lanes):
    """float32 bits -> bfloat16 bits: ``(u + 0x7FFF + lsb) >> 16`` (round to nearest even, as
    torch), a quiet NaN for NaN; in 32-bit arithmetic (numba would widen to 64 bits)."""
    def c(k):
        return _const(_I32, lanes, k)

    lsb = builder.and_(builder.lshr(u, c(16)), c(1))
    r = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), lsb), c(16))
    isnan = builder.icmp_unsigned(">", builder.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
    qnan = builder.or_(builder.and_(builder.lshr(u, c(16)), c(0x8000)), c(0x7FC0))
    return builder.trunc(builder.select(isnan, qnan, r), _of(_I16, lanes))


def _ir_bf16_to_u32(builder, h, lanes):
    """bfloat16 bits -> float32 bits: the top half of the float32."""
    return builder.shl(builder.zext(h, _of(_I32, lanes)), _const(_I32, lanes, 16))


def _ir_f32_to_bf16(builder, v, lanes):
    """float32 -> bfloat16 bits (:func:`_ir_u32_to_bf16` on the value's bits)."""
    return _ir_u32_to_bf16(builder, builder.bitcast(v, _of(_I32, lanes)), lanes)


_CONVERSIONS = {  # name: (IR, numba source type, numba result type)
    "f32_to_f16": (_ir_f32_to_f16, types.float32, types.uint16),
    "f32_to_bf16": (_ir_f32_to_bf16, types.float32, types.uint16),
    "f16_to_f32": (_ir_f16_to_f32, types.uint16, types.float32),
    "u32_to_bf16": (_ir_u32_to_bf16, types.uint32, types.uint16),
    "bf16_to_u32": (_ir_bf16_to_u32, types.uint16, types.uint32),
}


def _scalar(name: str):
    """The conversion ``name`` on one value, as a numba intrinsic."""
    ir_fn, src, dst = _CONVERSIONS[name]

    @intrinsic
    def convert(typingctx, v):
        if v != src:
            return None

        def codegen(context, builder, sig, args):
            return ir_fn(builder, args[0], None)

        return dst(src), codegen

    return convert


def _stream_block(name: str, flag_mask: int | None, scale: str | None = None):
    """The conversion ``name`` on the ``LANES`` values ``src[i:i + LANES]``, stored with one
    nontemporal store at ``dst[i:]`` (which must be aligned to the block's bytes: the caller's
    head loop sees to it), as a numba intrinsic ``(src, dst, i, q)``. With ``flag_mask``: returns
    True when one result ``r`` has ``r & flag_mask == flag_mask``. With ``scale``: converts
    ``src[i:i + LANES] / q`` (``"div"``) or ``* q`` (``"mul"``) in float32 (IEEE), else ``q``
    is not read."""
    ir_fn, src_t, dst_t = _CONVERSIONS[name]

    @intrinsic
    def block(typingctx, src, dst, i, q):
        if not (src == types.CPointer(src_t) and dst == types.CPointer(dst_t) and isinstance(i, types.Integer)
                and (q == types.float32 or scale is None)):
            return None

        def codegen(context, builder, sig, args):
            s, d, k, qv = args
            k = context.cast(builder, k, sig.args[2], types.intp)
            src_v = ir.VectorType(context.get_value_type(src_t), LANES)
            dst_v = ir.VectorType(context.get_value_type(dst_t), LANES)
            v = builder.load(builder.bitcast(builder.gep(s, [k]), src_v.as_pointer()), align=src_t.bitwidth // 8)
            if scale is not None:
                lane = builder.insert_element(ir.Constant(src_v, ir.Undefined), qv, ir.Constant(_I32, 0))
                splat = builder.shuffle_vector(lane, lane, _const(_I32, LANES, 0))
                v = builder.fdiv(v, splat) if scale == "div" else builder.fmul(v, splat)
            r = ir_fn(builder, v, LANES)
            store = builder.store(r, builder.bitcast(builder.gep(d, [k]), dst_v.as_pointer()),
                                  align=LANES * dst_t.bitwidth // 8)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
            if flag_mask is None:
                return context.get_constant(types.boolean, False)
            m = _const(_I16, LANES, flag_mask)
            hits = builder.bitcast(builder.icmp_unsigned("==", builder.and_(r, m), m), ir.IntType(LANES))
            return builder.icmp_unsigned("!=", hits, ir.Constant(ir.IntType(LANES), 0))

        return types.boolean(src, dst, i, q), codegen

    return block




@intrinsic
def _pointer(typingctx, addr, dtype):
    """The address ``addr`` (an integer) as a pointer to ``dtype`` (a numba number class)."""
    if not (isinstance(addr, types.Integer) and isinstance(dtype, types.NumberClass)):
        return None
    ptr = types.CPointer(dtype.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, dtype), codegen


@intrinsic
def _store_fence(typingctx):
    """Nontemporal stores are weakly ordered: this fence (x86: ``sfence``; elsewhere a full
    fence) puts them before anything the thread stores after the kernel (a lock release
    that hands the result to another thread)."""
    def codegen(context, builder, sig, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=fnty), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@_jit
def _head(addr, itemsize, n):
    """Elements before ``addr + i * itemsize`` is aligned to a block of ``LANES`` items (at most ``n``)."""
    block = LANES * itemsize
    return min(n, ((block - addr % block) % block) // itemsize)


# --- kernels: (source address, result address, n, stream) -> flag ------------------------------

def _flagger(flag_mask: int | None):
    """``r -> r & flag_mask == flag_mask`` for a 16-bit result (an encode's all-ones exponent);
    always False without a mask (a decode)."""
    if flag_mask is None:
        @_jit
        def flagged(r):
            return False
    else:
        m = np.uint16(flag_mask)

        @_jit
        def flagged(r):
            return (r & m) == m
    return flagged


def _kernel(name: str, flag_mask: int | None, scale: str | None = None):
    """The conversion ``name`` over ``n`` values: ``dst[i] = convert(src[i])`` (``scale``
    ``"div"``: ``convert(src[i] / q)``, ``"mul"``: ``convert(src[i] * q)``, in float32 with a
    float32 ``q``; else ``q`` is not read),
    returning True when a result is flagged (:func:`_flagger`). In cache, one loop from 0
    (indices known >= 0, so it vectorises); streamed, a scalar head up to the destination's
    block alignment, whole nontemporal blocks, a fence, a scalar tail."""
    _, src_t, dst_t = _CONVERSIONS[name]
    src_np, dst_np = np.dtype(src_t.name).type, np.dtype(dst_t.name).type
    dst_size = dst_t.bitwidth // 8
    convert, block, flagged = _scalar(name), _stream_block(name, flag_mask, scale), _flagger(flag_mask)

    if scale == "div":
        @_inline
        def value(v, q):
            return v / q
    elif scale == "mul":
        @_inline
        def value(v, q):
            return v * q
    else:
        @_inline
        def value(v, q):
            return v

    @_jit
    def kernel(sa, da, n, stream, q=1.0):
        sp, dp = _pointer(sa, src_np), _pointer(da, dst_np)
        src, dst = numba.carray(sp, n), numba.carray(dp, n)
        bad = False
        if not stream:
            for i in range(n):
                r = convert(value(src[i], q))
                bad |= flagged(r)
                dst[i] = r
            return bad
        start = _head(da, dst_size, n)
        for i in range(start):
            r = convert(value(src[i], q))
            bad |= flagged(r)
            dst[i] = r
        while start + LANES <= n:
            bad |= block(sp, dp, start, q)
            start += LANES
        _store_fence()
        for i in range(start, n):
            r = convert(value(src[i], q))
            bad |= flagged(r)
            dst[i] = r
        return bad

    return kernel


# fp16 from float32 values; bf16 from float32 bits (``w``: the float32 input viewed as uint32)
_encode_f16 = _kernel("f32_to_f16", _EXP_MASK[torch.float16])
_encode_bf16 = _kernel("u32_to_bf16", _EXP_MASK[torch.bfloat16])
_decode_f16 = _kernel("f16_to_f32", None)
_decode_bf16 = _kernel("bf16_to_u32", None)  # a bf16 is the top half of its float32's bits
# the cast of a float32 quotient ``x / q`` (the DDP hooks' share of the average), and of a
# product ``x * q`` (the same quotient where ``q = 1 / N`` is exact: ``N`` a power of two)
_divide_f16 = _kernel("f32_to_f16", _EXP_MASK[torch.float16], scale="div")
_divide_bf16 = _kernel("f32_to_bf16", _EXP_MASK[torch.bfloat16], scale="div")
_scale_f16 = _kernel("f32_to_f16", _EXP_MASK[torch.float16], scale="mul")
_scale_bf16 = _kernel("f32_to_bf16", _EXP_MASK[torch.bfloat16], scale="mul")


@_jit
def _all_ones(ha, n, mask):
    """True when some ``h_i & mask == mask`` (``h``: ``n`` uint16 at address ``ha``)."""
    h = numba.carray(_pointer(ha, np.uint16), n)
    bad = False
    for i in range(n):
        bad |= (h[i] & mask) == mask
    return bad


# --- when to stream ------------------------------------------------------------------------------

def cache_size_bytes(text: str) -> int | None:
    """A sysfs cache ``size`` entry (``"32768K"``, ``"1M"``, ``"512"``) in bytes; None when
    it is not one."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else None


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size in bytes, from Linux's sysfs (``cpu0``'s cache
    entries); None where it cannot be read (other systems): then no call streams."""
    sizes = []
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(entry) as f:
                size = cache_size_bytes(f.read())
        except OSError:
            continue
        if size:
            sizes.append(size)
    return max(sizes) if sizes else None


def streams(nbytes: int) -> bool:
    """Whether a call that reads and writes ``nbytes`` in all streams its stores: when that
    exceeds half the last-level cache (module doc); never when its size is unknown."""
    llc = last_level_cache_bytes()
    return llc is not None and 2 * nbytes > llc


# --- torch-level API (the same names and signatures as the GPU module, plus ``stream``) ----------

def _aligned(t: torch.Tensor, itemsize: int, name: str) -> torch.Tensor:
    """``t`` (checked to be a CPU tensor, named ``name`` in the error) contiguous, at an
    address aligned for its ``itemsize``-byte elements (a copy where it is not:
    ``torch.frombuffer`` can give any address). The kernels get its address."""
    if not t.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor for the numba kernels, got one on {t.device}")
    if not t.is_contiguous() or t.data_ptr() % itemsize:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def half_encode(x: torch.Tensor, dtype: torch.dtype, stream: bool | None = None,
                divisor: int | None = None, check: bool = True) -> tuple[torch.Tensor, bool]:
    """``(h, flagged)``: ``x`` (or ``x / divisor``, computed in ``x``'s dtype as torch's
    ``x / divisor`` on the CPU computes it: IEEE division) cast to ``dtype`` (fp16/bf16, a new
    tensor), and True when ``h`` holds an inf or NaN (a non-finite ``x`` or an overflow).
    float32 inputs take one fused pass (``stream``: nontemporal stores, None: by size, see
    :func:`streams`); other dtypes torch's division and cast (its rounding) and one read of
    the bits. ``check=False``: ``flagged`` is False (the GPU module's option; here the flag
    comes with the pass)."""
    n = x.numel()
    if x.dtype == torch.float32:
        x = _aligned(x, 4, "x")
        h = torch.empty(n, dtype=dtype)
        stream = streams(6 * n) if stream is None else bool(stream)
        if divisor is None:
            kernel = _encode_f16 if dtype == torch.float16 else _encode_bf16
            return h, bool(kernel(x.data_ptr(), h.data_ptr(), n, stream)) and check
        if divisor & (divisor - 1) == 0:  # 1 / N is exact, and x * (1 / N) the quotient's bits
            kernel, q = (_scale_f16 if dtype == torch.float16 else _scale_bf16), np.float32(1.0 / divisor)
        else:  # a float32 division (slower than the product where the data is in cache)
            kernel, q = (_divide_f16 if dtype == torch.float16 else _divide_bf16), np.float32(divisor)
        return h, bool(kernel(x.data_ptr(), h.data_ptr(), n, stream, q)) and check
    h = (x.detach() if divisor is None else x.detach() / divisor).to(dtype, copy=True)
    return h, check and bool(_all_ones(h.data_ptr(), n, np.uint16(_EXP_MASK[dtype])))


def half_decode(h: torch.Tensor, out: torch.Tensor, stream: bool | None = None) -> torch.Tensor:
    """``out[:] = h`` (``h`` fp16/bf16 on the CPU, ``out`` a tensor of the same length); one
    pass for a contiguous float32 CPU ``out`` at a float32-aligned address (``stream`` as
    in :func:`half_encode`), torch's cast otherwise. Returns ``out``."""
    n = h.numel()
    if out.numel() != n:
        raise ValueError(f"out must have h's {n} elements, got {out.numel()}")
    if out.dtype != torch.float32 or not out.is_contiguous() or out.data_ptr() % 4 or not out.is_cpu:
        return out.copy_(h)
    h = _aligned(h, 2, "h")
    kernel = _decode_f16 if h.dtype == torch.float16 else _decode_bf16
    kernel(h.data_ptr(), out.data_ptr(), n, streams(6 * n) if stream is None else bool(stream))
    return out
