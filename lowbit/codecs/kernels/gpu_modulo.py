"""Triton kernels of the "modulo" family on CUDA (optional: needs ``triton``): Moniqua's
codec (ModuloCodec, eq. (5)) and its verified exchange, one kernel per message.

The same names and signatures as :mod:`.cpu_modulo`
(:class:`~lowbit.codecs.kernels.families.ModuloKernels`). The encode computes in the
input's precision; the decodes that hash the grid integers compute in float64, as the
numba kernels do, so both ends of a message agree on the hashes. Results that the caller
checks (non-finite flags, the largest lattice index) stay on the device until one host
read (:func:`to_host` serves every neighbour of a step).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .. import modulo
from ..modulo import check_grid_reach
from ..rng import split_key
from .gpu import BLOCK, GROUPS, _grid, _mix32, _pack_kernel, div, is_nonfinite, load_work, nonfinite_flag, pack, \
    raise_if_flagged, round_grid, unpack

__all__ = ["pack", "unpack", "modulo_encode", "modulo_decode", "modulo_decode_hash", "moniqua_send", "moniqua_receive",
           "to_host"]

# constexpr globals, as in :mod:`.gpu`
HASH_STEP = tl.constexpr(modulo.HASH_STEP)
HASH_SALT = tl.constexpr(modulo.HASH_SALT)
HASH_HIGH = tl.constexpr(modulo.HASH_HIGH)


@triton.jit
def _modulo_code(x, offs, inv_B, k0, k1, LEVELS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Eq. (5)'s code of ``x`` (in x's precision) as int32 in ``[0, LEVELS)``: rounding stochastic
    with the counter uniforms of element indices ``offs``, or to nearest."""
    t = x * inv_B + 0.5
    r = t - tl.floor(t) - 0.5
    ci = round_grid(r * LEVELS, offs, k0, k1, STOCHASTIC).to(tl.int32)
    return ci - LEVELS * tl.where(ci >= LEVELS, 1, 0) + LEVELS * tl.where(ci < 0, 1, 0)


@triton.jit
def _grid_decode(code, yf, B, step, inv_B):
    """Eq. (5) decoded against ``yf`` in float64, as the numba kernel computes it: the offset
    ``r`` (the decoded value is ``r + yf``) and the lattice index ``k``."""
    z = code.to(tl.float64) * step - yf
    k = tl.floor(z * inv_B + 0.5)
    r = z - B * k
    up = r >= B * 0.5
    down = r < -B * 0.5
    r = tl.where(up, r - B, tl.where(down, r + B, r))
    k = tl.where(up, k + 1.0, tl.where(down, k - 1.0, k))
    return r, k


@triton.jit
def _hash_term(code, k, offs, LEVELS: tl.constexpr):
    """Element ``offs``'s term (uint32, summed modulo 2^32 over a block) of the block hash of
    its grid integer ``m = code - LEVELS k``."""
    m = code.to(tl.int64) - LEVELS * k.to(tl.int64)
    lo = (m & 0xFFFFFFFF).to(tl.uint32)
    hi = ((m >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = ((offs.to(tl.uint32) * HASH_STEP) ^ HASH_SALT) | 1
    return lo * key + hi * HASH_HIGH


@triton.jit
def _block_hash(acc):
    """A block's 16-bit hash (int32) from its lanes' sums of :func:`_hash_term` (uint32)."""
    total = tl.sum(acc.to(tl.uint64), axis=0) & 0xFFFFFFFF
    return (_mix32(total.to(tl.uint32)) & 0xFFFF).to(tl.int32)


@triton.jit
def _modulo_encode_kernel(x_ptr, codes_ptr, bad_ptr, n, inv_B, k0, k1, LEVELS: tl.constexpr,
                          STOCHASTIC: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = load_work(x_ptr, offs, mask)
    ci = _modulo_code(x, offs, inv_B, k0, k1, LEVELS, STOCHASTIC)
    tl.store(codes_ptr + offs, ci.to(tl.uint8), mask=mask)
    nonfinite = tl.sum(tl.where(mask & is_nonfinite(x), 1, 0), axis=0)
    tl.atomic_max(bad_ptr, nonfinite)


@triton.jit
def _modulo_decode_kernel(codes_ptr, y_ptr, out_ptr, n, B, step, LEVELS: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    yf = y if y.dtype == tl.float64 else y.to(tl.float32)
    q = tl.load(codes_ptr + offs, mask=mask, other=0).to(yf.dtype) * step
    t = div(q - yf, B) + 0.5
    r = (t - tl.floor(t) - 0.5) * B
    tl.store(out_ptr + offs, (r + yf).to(y.dtype), mask=mask)


@triton.jit
def _decode_hash_block(codes_ptr, y_ptr, out_ptr, start, end, B, step, LEVELS: tl.constexpr, LEN: tl.constexpr,
                       CHUNK: tl.constexpr, BITS: tl.constexpr):
    """Elements ``start..end-1`` (``end - start <= LEN``): eq. (5) as the numba kernel computes it
    (lattice index k, then the grid integers m = code - LEVELS k), stored into ``out``; returns the
    block's 16-bit hash of m and its largest |k|. ``codes_ptr``: one uint8 code per element
    (``BITS`` 8) or the codes packed ``BITS`` (1, 2 or 4) to a byte, read as they lie in the
    message. The loop's bounds are constexpr: Triton 3.6's interpreter cannot take a tensor as a
    ``range`` bound."""
    acc = tl.zeros([CHUNK], dtype=tl.uint32)
    reach = tl.zeros([CHUNK], dtype=tl.float64)
    inv_B = 1.0 / tl.cast(B, tl.float64)  # IEEE in float64, as the numba kernel's 1 / B
    for s in range(0, LEN, CHUNK):
        offs = start + s + tl.arange(0, CHUNK)
        mask = offs < end
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
        yf = y.to(tl.float64)
        if BITS == 8:
            code = tl.load(codes_ptr + offs, mask=mask, other=0)
        else:  # little-endian bit order within a byte (lowbit.codecs.packing)
            byte = tl.load(codes_ptr + offs // (8 // BITS), mask=mask, other=0)
            code = (byte >> ((offs % (8 // BITS)) * BITS).to(tl.uint8)) & ((1 << BITS) - 1)
        r, k = _grid_decode(code, yf, B, step, inv_B)
        tl.store(out_ptr + offs, (r + yf).to(y.dtype), mask=mask)
        reach = tl.maximum(reach, tl.where(mask, tl.abs(k), 0.0))
        acc += tl.where(mask, _hash_term(code, k, offs, LEVELS), 0).to(tl.uint32)
    return _block_hash(acc), tl.max(reach, axis=0)


@triton.jit
def _modulo_decode_hash_kernel(codes_ptr, y_ptr, out_ptr, hash_ptr, reach_ptr, n, B, step,
                               LEVELS: tl.constexpr, BLOCK_LEN: tl.constexpr, CHUNK: tl.constexpr,
                               BITS: tl.constexpr):
    """One program per hashed block of ``BLOCK_LEN`` elements: the decode, the block's hash and
    its largest |k|."""
    b = tl.program_id(0)
    h, reach = _decode_hash_block(codes_ptr, y_ptr, out_ptr, b * BLOCK_LEN, tl.minimum(b * BLOCK_LEN + BLOCK_LEN, n),
                                  B, step, LEVELS, BLOCK_LEN, CHUNK, BITS)
    tl.store(hash_ptr + b, h)
    tl.store(reach_ptr + b, reach)


@triton.jit
def _moniqua_send_kernel(x_ptr, msg_ptr, xh_ptr, found_ptr, n, inv_B, B, step, k0, k1, hash_at, last, ctrl,
                         LEVELS: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_LEN: tl.constexpr,
                         CHUNK: tl.constexpr, BITS: tl.constexpr):
    """One program per hashed block of ``BLOCK_LEN`` elements (a multiple of ``8 // BITS``, so no
    byte of codes spans two blocks): :func:`_modulo_encode_kernel`'s codes packed into the
    message, the sender's own decode (:func:`_decode_hash_block`'s, against ``x`` itself) into
    ``xh``, the block's hash into the message (``<u2`` at ``hash_at + 2 b``), and into ``found``
    the block's count of non-finite elements (``b``) and its largest ``LEVELS |k|``
    (``nb + b``); program 0 writes ``ctrl`` at byte ``last``. Works byte by byte: element
    ``G j + i`` of the block is bit field ``i`` of its byte ``j`` (``G = 8 // BITS``)."""
    G: tl.constexpr = 8 // BITS
    CB: tl.constexpr = CHUNK // G
    b = tl.program_id(0)
    start = b * BLOCK_LEN
    end = tl.minimum(start + BLOCK_LEN, n)
    acc = tl.zeros([CB], dtype=tl.uint32)
    reach = tl.zeros([CB], dtype=tl.float64)
    bad = tl.zeros([CB], dtype=tl.int32)
    inv_B64 = 1.0 / tl.cast(B, tl.float64)
    for s in range(0, BLOCK_LEN // G, CB):
        j = s + tl.arange(0, CB)
        byte = tl.zeros([CB], dtype=tl.uint32)
        for i in tl.static_range(G):
            offs = start + j * G + i
            mask = offs < end
            x = load_work(x_ptr, offs, mask)
            ci = tl.where(mask, _modulo_code(x, offs, inv_B, k0, k1, LEVELS, STOCHASTIC), 0)
            bad += tl.where(mask & is_nonfinite(x), 1, 0)
            byte = byte | (ci.to(tl.uint32) << (i * BITS))
            xf = x.to(tl.float64)  # the own decode and hash, in float64
            r, k = _grid_decode(ci, xf, B, step, inv_B64)
            tl.store(xh_ptr + offs, (r + xf).to(xh_ptr.dtype.element_ty), mask=mask)
            reach = tl.maximum(reach, tl.where(mask, tl.abs(k), 0.0))
            acc += tl.where(mask, _hash_term(ci, k, offs, LEVELS), 0).to(tl.uint32)
        tl.store(msg_ptr + start // G + j, byte.to(tl.uint8), mask=start + j * G < end)
    h = _block_hash(acc)
    tl.store(msg_ptr + hash_at + 2 * b, (h & 0xFF).to(tl.uint8))
    tl.store(msg_ptr + hash_at + 2 * b + 1, (h >> 8).to(tl.uint8))
    nb = tl.num_programs(0)
    tl.store(found_ptr + b, tl.sum(bad, axis=0).to(tl.float64))
    tl.store(found_ptr + nb + b, tl.max(reach, axis=0) * LEVELS)
    if b == 0:
        tl.store(msg_ptr + last, ctrl)  # stored as the message's uint8


@triton.jit
def _moniqua_receive_kernel(msg_ptr, y_ptr, xh_ptr, found_ptr, v_ptr, xhi_ptr, delta_ptr, n, hash_at, last,
                            B, step, w_ptr, LEVELS: tl.constexpr, BLOCK_LEN: tl.constexpr, CHUNK: tl.constexpr,
                            DITHER: tl.constexpr, BITS: tl.constexpr):
    """One program per hashed block of a neighbour's message (``msg``: its codes from byte 0,
    its blocks' ``<u2`` hashes from byte ``hash_at``, its control byte at ``last``): the decode
    into ``xh``, the hash compared with the one sent, and for a block that agrees line 6's term
    ``delta += w x_j; delta -= w x_hat_i`` (fused multiply-adds; ``x_j = xh - v`` with the
    shared dither; ``w`` one element of delta's dtype: a float argument would be rounded to
    float32). ``found``: 1.0 at ``b`` where block ``b`` differs, the control byte at ``nb``, the
    block's largest ``LEVELS |k|`` at ``nb + 1 + b``."""
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    start = b * BLOCK_LEN
    end = tl.minimum(start + BLOCK_LEN, n)
    h, reach = _decode_hash_block(msg_ptr, y_ptr, xh_ptr, start, end, B, step, LEVELS, BLOCK_LEN, CHUNK, BITS)
    sent = tl.load(msg_ptr + hash_at + 2 * b).to(tl.int32) | (tl.load(msg_ptr + hash_at + 2 * b + 1).to(tl.int32) << 8)
    differs = h != sent
    tl.store(found_ptr + b, differs.to(tl.float64))
    tl.store(found_ptr + nb + 1 + b, reach * LEVELS)
    if b == 0:
        tl.store(found_ptr + nb, tl.load(msg_ptr + last).to(tl.float64))
    tl.debug_barrier()  # this program's stores of xh are visible to its loads below
    if not differs:
        wd = tl.load(w_ptr)
        for s in range(0, BLOCK_LEN, CHUNK):
            offs = start + s + tl.arange(0, CHUNK)
            mask = offs < end
            d = tl.load(delta_ptr + offs, mask=mask, other=0.0)
            xj = tl.load(xh_ptr + offs, mask=mask, other=0.0)
            if DITHER:
                xj = xj - tl.load(v_ptr + offs, mask=mask, other=0.0)
            xi = tl.load(xhi_ptr + offs, mask=mask, other=0.0)
            d = tl.fma(xj.to(d.dtype), wd, d)
            tl.store(delta_ptr + offs, tl.fma(xi, -wd, d), mask=mask)


def _decode_hash(codes: torch.Tensor, y: torch.Tensor, out: torch.Tensor, block: int, B: float,
                 levels: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode of the ``n`` ``codes`` (unpacked, or packed ``bits`` < 8 to a byte) into ``out``
    and, on the device, the blocks' hashes (int32) and each block's largest ``|k|`` (float64;
    the caller reads them back with what else it reads and takes the maximum on the host)."""
    n = y.numel()
    nb = -(-n // block)
    hashes = torch.empty(nb, dtype=torch.int32, device=y.device)
    reach = torch.zeros(max(nb, 1), dtype=torch.float64, device=y.device)
    if n:
        _modulo_decode_hash_kernel[(nb,)](codes, y, out, hashes, reach, n, float(B), float(B) / levels, LEVELS=levels,
                                          BLOCK_LEN=block, CHUNK=min(1024, triton.next_power_of_2(block)), BITS=bits)
    return hashes, reach


def modulo_decode_hash(data: torch.Tensor, bits: int, n: int, B: float, levels: int, ref: torch.Tensor,
                       block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`modulo_decode` of the ``n`` codes packed ``bits`` each in ``data``, in float64
    arithmetic (the grid integers must be exact), and the 16-bit hash of each block of ``block``
    grid integers, as the numba kernel: the hashes come back as an int32 CPU tensor (they go into
    the message), with the overflow check in the same host read."""
    y = ref.detach().contiguous()
    out = torch.empty(n, dtype=y.dtype, device=y.device)
    if bits in (1, 2, 4, 8):  # read as packed
        hashes, reach = _decode_hash(data.contiguous(), y, out, block, B, levels, bits)
    else:
        hashes, reach = _decode_hash(unpack(data, bits, n), y, out, block, B, levels)
    host = torch.cat([hashes.to(torch.float64), reach]).cpu().numpy()  # the one host read
    nb = hashes.numel()
    check_grid_reach(float(host[nb:].max()) * levels, B, levels)
    return out, torch.from_numpy(host[:nb].astype(np.int32))


def moniqua_send(x: torch.Tensor, B: float, levels: int, stochastic: bool, key: int, bits: int, block: int,
                 msg: torch.Tensor, hash_at: int, ctrl: int, xhat: torch.Tensor) -> None:
    """Moniqua's message on the device (the numba ``moniqua_send``'s contract): the codes packed
    into ``msg`` from byte 0, the sender's own decode into ``xhat``, the blocks' hashes ``<u2`` into
    ``msg`` from ``hash_at``, ``ctrl`` last. One kernel where no byte of codes spans two blocks
    (``block`` a multiple of ``8 // bits``; else an encode, a pack and a decode), and one host
    read: the non-finite flag with the overflow check."""
    x = x.contiguous()
    n = x.numel()
    nb = -(-n // block)
    if n and block % (8 // bits) == 0:
        found = torch.empty(2 * nb, dtype=torch.float64, device=x.device)
        _moniqua_send_kernel[(nb,)](x, msg, xhat, found, n, 1.0 / B, float(B), float(B) / levels, *split_key(key),
                                    hash_at, msg.numel() - 1, ctrl, LEVELS=levels, STOCHASTIC=bool(stochastic),
                                    BLOCK_LEN=block, CHUNK=min(1024, triton.next_power_of_2(block)), BITS=bits)
        host = found.cpu().numpy()  # the one host read
        raise_if_flagged(host[:nb].max(), "modulo")
        check_grid_reach(float(host[nb:].max()), B, levels)
        return
    codes, flag = _modulo_codes(x, B, levels, stochastic, key)
    if n:  # packed straight into the message's first ceil(n bits / 8) bytes
        _pack_kernel[_grid(triton.cdiv(n, 8), GROUPS)](codes, msg, n, (n * bits + 7) // 8, B=bits, G=GROUPS)
    hashes, reach = _decode_hash(codes, x, xhat, block, B, levels)
    host = torch.cat([flag.to(torch.float64), reach]).cpu().numpy()  # the one host read
    raise_if_flagged(host[0], "modulo")
    check_grid_reach(float(host[1:].max()) * levels, B, levels)
    # the 16-bit hashes little-endian: int32 -> int16 keeps the low 16 bits (CUDA is little-endian)
    msg[hash_at:hash_at + 2 * hashes.numel()] = hashes.to(torch.int16).view(torch.uint8)
    msg[-1] = ctrl


def moniqua_receive(msg: torch.Tensor, bits: int, B: float, levels: int, y: torch.Tensor, block: int,
                    xh: torch.Tensor, v: torch.Tensor | None, xhat_i: torch.Tensor, w: float,
                    delta: torch.Tensor) -> torch.Tensor:
    """The numba ``moniqua_receive``'s contract on the device: decode a neighbour's verified
    message ``msg`` (codes from byte 0, its ``nb`` hashes ``<u2`` then its control byte last) into
    ``xh`` and compare its blocks' hashes with the ones sent; the blocks that agree add their
    line-6 term to ``delta`` (when some block differs the caller rebuilds ``delta``, as on the
    CPU, where the kernel adds nothing then). Returns, on the device and not read back (one
    host read, :func:`to_host`, serves every neighbour), float64 ``found``: 1.0 at ``b`` where
    block ``b`` differs, the control byte at ``nb``, then the largest ``levels |k|``."""
    n = y.numel()
    nb = -(-n // block)
    found = torch.empty(2 * nb + 1, dtype=torch.float64, device=y.device)  # every element written
    if n:
        msg = msg.contiguous()
        _moniqua_receive_kernel[(nb,)](msg, y.contiguous(), xh, found, y if v is None else v.contiguous(), xhat_i,
                                       delta, n, msg.numel() - 2 * nb - 1, msg.numel() - 1, float(B),
                                       float(B) / levels, _scalar_on(w, delta.dtype, y.device), LEVELS=levels,
                                       BLOCK_LEN=block, CHUNK=min(1024, triton.next_power_of_2(block)),
                                       DITHER=v is not None, BITS=bits)
    else:
        found[nb] = msg[-1]
    return found


def to_host(found: list[torch.Tensor]) -> list[np.ndarray]:
    """Device tensors as numpy arrays, in one host read."""
    if not found:
        return []
    flat = torch.cat(found).cpu().numpy()
    return np.split(flat, np.cumsum([f.numel() for f in found])[:-1])


@functools.lru_cache(maxsize=256)
def _scalar_on(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` as a one-element tensor of ``dtype`` on ``device`` (a kernel reads it; never
    written): made once per value, not copied to the device at every message."""
    return torch.tensor([value], dtype=dtype).to(device)


def _modulo_codes(x: torch.Tensor, B: float, levels: int, stochastic: bool,
                  key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`modulo_encode`'s codes and its non-finite flag, both on the device (no host read)."""
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    flag = nonfinite_flag(x)
    k0, k1 = split_key(key)
    if n:
        _modulo_encode_kernel[_grid(n, BLOCK)](x, codes, flag, n, 1.0 / B, k0, k1, LEVELS=levels,
                                               STOCHASTIC=bool(stochastic), BLOCK_=BLOCK)
    return codes, flag


def modulo_encode(x: torch.Tensor, B: float, levels: int, stochastic: bool, key: int) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_modulo.modulo_encode`: Moniqua's codes (uint8) of ``x`` modulo ``B`` on
    ``levels`` levels: eq. (5), rounding stochastic with the stream ``key`` or to nearest."""
    codes, flag = _modulo_codes(x.detach().contiguous(), B, levels, stochastic, key)
    raise_if_flagged(flag, "modulo")
    return codes


def modulo_decode(codes: torch.Tensor, B: float, levels: int, ref: torch.Tensor) -> torch.Tensor:
    """CUDA twin of :func:`lowbit.codecs.kernels.cpu_modulo.modulo_decode`: the point of the ``codes`` closest to ``ref`` on
    the grid modulo ``B`` (eq. (5) decoded against the receiver's model)."""
    y = ref.detach().contiguous()
    n = codes.numel()
    out = torch.empty(n, dtype=y.dtype, device=y.device)
    if n:
        _modulo_decode_kernel[_grid(n, BLOCK)](codes, y, out, n, B, B / levels, LEVELS=levels, BLOCK_=BLOCK)
    return out
