"""numba kernels of the 16-bit float codecs (fp16, bf16) on the CPU.

numba has no 16-bit float type, so the per-element conversions are LLVM
intrinsics (:func:`f32_to_f16_bits`, :func:`f16_bits_to_f32`: ``fptrunc`` /
``fpext`` through LLVM's ``half``, which the vectoriser turns into the F16C
``vcvtps2ph``/``vcvtph2ps`` instructions; :func:`f32_to_bf16_bits`: round to
nearest even on the float32 bits in 32-bit integer arithmetic). Each kernel is
one branch-free loop: the encode casts float32 to 16-bit bits and, in the same
pass, flags an all-ones exponent in the result (a NaN or inf input, or a value
that rounds to inf: the caller tells them apart on its error path only). The
results are torch's casts bit for bit (fp16: IEEE round to nearest even; bf16:
torch's round to nearest even on the bits), tested over every 16-bit pattern
and millions of float32 patterns in tests/test_fastpath_lowp.py.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .cpu import _jit, np_view

__all__ = ["half_encode", "half_decode"]

# the exponent field of a 16-bit float: all ones is inf or NaN
_EXP_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}


@intrinsic
def f32_to_f16_bits(typingctx, v):
    """The IEEE binary16 bits of a float32 (round to nearest even; inf for overflow)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f16_bits_to_f32(typingctx, v):
    """The float32 value of binary16 bits (exact)."""
    if v != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_bf16_bits(typingctx, v):
    """The bfloat16 bits of float32 bits ``v``: ``(v + 0x7FFF + lsb) >> 16`` (round to nearest
    even, as torch), a quiet NaN for NaN. 32-bit arithmetic (numba would widen to 64 bits)."""
    if v != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = args[0]

        def c(k):
            return ir.Constant(i32, k)

        lsb = builder.and_(builder.lshr(u, c(16)), c(1))
        r = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), lsb), c(16))
        isnan = builder.icmp_unsigned(">", builder.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
        qnan = builder.or_(builder.and_(builder.lshr(u, c(16)), c(0x8000)), c(0x7FC0))
        return builder.trunc(builder.select(isnan, qnan, r), ir.IntType(16))

    return types.uint16(types.uint32), codegen


@_jit
def _encode_f16(x, out):
    """``out[i]`` = the fp16 bits of float32 ``x[i]``; True when one has an all-ones exponent."""
    bad = False
    m = np.uint16(0x7C00)
    for i in range(x.shape[0]):
        h = f32_to_f16_bits(x[i])
        bad |= (h & m) == m
        out[i] = h
    return bad


@_jit
def _encode_bf16(w, out):
    """``out[i]`` = the bf16 bits of the float32 bits ``w[i]``; True when one has an all-ones exponent."""
    bad = False
    m = np.uint16(0x7F80)
    for i in range(w.shape[0]):
        h = f32_to_bf16_bits(w[i])
        bad |= (h & m) == m
        out[i] = h
    return bad


@_jit
def _decode_f16(h, out):
    for i in range(h.shape[0]):
        out[i] = f16_bits_to_f32(h[i])


@_jit
def _decode_bf16(h, out):
    """``out`` holds float32 bits: a bf16 is the top half of its float32."""
    for i in range(h.shape[0]):
        out[i] = np.uint32(h[i]) << np.uint32(16)


@_jit
def _all_ones(h, mask):
    """True when some ``h_i & mask == mask``."""
    bad = False
    for i in range(h.shape[0]):
        bad |= (h[i] & mask) == mask
    return bad


# --- torch-level API (the same names and signatures as the GPU module) ---------------------------

def half_encode(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``(h, flagged)``: ``x`` cast to ``dtype`` (fp16/bf16, a new tensor), and True when
    ``h`` holds an inf or NaN (a non-finite ``x`` or an overflow). float32 inputs take one
    fused pass; other dtypes torch's cast (its rounding) and one read of the bits."""
    n = x.numel()
    if x.dtype == torch.float32:
        h = torch.empty(n, dtype=dtype)
        bits = h.view(torch.int16).numpy().view(np.uint16)
        xs = np_view(x)
        bad = _encode_f16(xs, bits) if dtype == torch.float16 else _encode_bf16(xs.view(np.uint32), bits)
        return h, bool(bad)
    h = x.to(dtype, copy=True)
    m = np.uint16(_EXP_MASK[dtype])
    return h, bool(n) and bool(_all_ones(h.view(torch.int16).numpy().view(np.uint16), m))


def half_decode(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = h`` (``h`` fp16/bf16, ``out`` a contiguous tensor of the same length);
    one pass for a float32 ``out``, torch's cast otherwise. Returns ``out``."""
    if out.dtype != torch.float32:
        return out.copy_(h)
    bits = h.view(torch.int16).numpy().view(np.uint16)
    if h.dtype == torch.float16:
        _decode_f16(bits, out.numpy())
    else:
        _decode_bf16(bits, out.view(torch.int32).numpy().view(np.uint32))
    return out
