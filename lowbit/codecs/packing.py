"""Bit packing: integer codes of width ``b`` -> a dense ``uint8`` byte string.

Layout (the same for every width, so ``pack_bits`` and ``pack_wide`` agree on
widths 1..8): the codes form one little-endian bit stream, code ``k`` occupying
stream bits ``[k*b, (k+1)*b)`` with its least significant bit first, and stream
bit ``i`` is bit ``i % 8`` of byte ``i // 8``. ``n`` codes take exactly
``ceil(n*b/8)`` bytes; the unused high bits of the last byte are zero.

Everything is vectorised torch and runs on the device of its input.
"""

from __future__ import annotations

import torch

from .base import PayloadError

__all__ = ["packed_nbytes", "check_packed", "check_wire_bytes", "pack_bits", "unpack_bits", "pack_wide", "unpack_wide"]

_MAX_NARROW = 8
_MAX_WIDE = 32


def _check_width(b, hi: int) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= hi:
        raise ValueError(f"bits must be in 1..{hi}, got {b!r}")
    return b


def packed_nbytes(n: int, b: int) -> int:
    """Bytes taken by ``n`` codes of ``b`` bits: ``ceil(n*b/8)``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    _check_width(b, _MAX_WIDE)
    return (n * b + 7) // 8


def _as_codes(codes: torch.Tensor, b: int) -> torch.Tensor:
    """Flat int64 view of ``codes``, after checking they lie in ``[0, 2^b)``."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    c = codes.reshape(-1).to(torch.int64)
    if c.numel():
        lo, hi = torch.aminmax(c)  # one reduction, one host sync
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= (1 << b):
            raise ValueError(f"codes must lie in [0, 2^{b}) = [0, {(1 << b) - 1}] for bits={b}, got range [{lo}, {hi}]")
    return c


def check_packed(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """``data`` is a 1-D uint8 tensor of exactly the ``ceil(n b / 8)`` bytes that ``n`` codes of
    ``b`` bits take (TypeError / ValueError otherwise), checked before anything is allocated."""
    return check_wire_bytes(data, packed_nbytes(n, b), f"{n} codes of {b} bits")


def check_wire_bytes(data: torch.Tensor, need: int, what: str) -> torch.Tensor:
    """``data`` is a 1-D uint8 tensor of exactly ``need`` bytes, the size of ``what`` (a phrase
    such as "5 codes of 3 bits"); a TypeError, or a PayloadError (a ValueError) for a wrong length."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        desc = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"packed data must be a 1-D uint8 tensor, got {desc}")
    if data.numel() != need:
        raise PayloadError("packed data", f"exactly {need} bytes for {what}", f"{data.numel()}",
                           f"{what} need exactly {need} bytes, got {data.numel()}")
    return data


# The general path works on groups of 8 codes, which fill exactly ``b`` bytes.
# For each (code i, byte j) of a group whose bits overlap, ``s = b*i - 8*j`` is
# the position of the code's bit 0 relative to the byte's bit 0. A byte is the
# OR of its shifted, masked overlapping codes, and a code the OR of its shifted,
# masked overlapping bytes. The Python loops run over the <= 40 (i, j) pairs of
# a group, never over elements: each step is one whole-column tensor op.


def _overlaps(b: int):
    return [(i, j, b * i - 8 * j) for i in range(8) for j in range(b) if b * i < 8 * (j + 1) and 8 * j < b * (i + 1)]


def _shifted(v: torch.Tensor, s: int) -> torch.Tensor:
    return v << s if s >= 0 else v >> -s


def _pack_general(c: torch.Tensor, b: int) -> torch.Tensor:
    n = c.numel()
    groups = (n + 7) // 8
    c = torch.nn.functional.pad(c, (0, groups * 8 - n)).view(groups, 8)
    out = torch.zeros(groups, b, dtype=torch.int64, device=c.device)
    for i, j, s in _overlaps(b):
        out[:, j] |= _shifted(c[:, i], s)
    return (out & 0xFF).view(-1)[: packed_nbytes(n, b)].to(torch.uint8)


def _unpack_general(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    groups = (n + 7) // 8
    d = torch.nn.functional.pad(data.to(torch.int64), (0, groups * b - data.numel())).view(groups, b)
    out = torch.zeros(groups, 8, dtype=torch.int64, device=data.device)
    for i, j, s in _overlaps(b):
        out[:, i] |= _shifted(d[:, j], -s)
    return (out & ((1 << b) - 1)).view(-1)[:n]


def _pack_fast(c: torch.Tensor, b: int) -> torch.Tensor:
    """b in {1, 2, 4}: ``8/b`` codes per byte, reshape + shifts."""
    per = 8 // b
    n = c.numel()
    m = (n + per - 1) // per
    c = torch.nn.functional.pad(c, (0, m * per - n)).view(m, per)
    out = c[:, 0].clone()
    for k in range(1, per):
        out |= c[:, k] << (b * k)
    return out.to(torch.uint8)


def _unpack_fast(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, b, dtype=torch.int64, device=data.device)
    return ((data.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << b) - 1)).view(-1)[:n]


def _pack_bytes(c: torch.Tensor, b: int) -> torch.Tensor:
    """b in {16, 24, 32}: each code is ``b/8`` whole bytes, little-endian."""
    shifts = torch.arange(0, b, 8, dtype=torch.int64, device=c.device)
    return ((c.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).view(-1)


def _unpack_bytes(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    d = data.to(torch.int64).view(n, b // 8)
    out = d[:, 0].clone()
    for k in range(1, b // 8):
        out |= d[:, k] << (8 * k)
    return out


def _pack(codes: torch.Tensor, b: int) -> torch.Tensor:
    c = _as_codes(codes, b)
    if c.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=c.device)
    if b == 8:
        return c.to(torch.uint8)
    if b in (1, 2, 4):
        return _pack_fast(c, b)
    if b % 8 == 0:
        return _pack_bytes(c, b)
    return _pack_general(c, b)


def _unpack(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    data = check_packed(data, b, n)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if b == 8:
        return data.to(torch.int64)
    if b in (1, 2, 4):
        return _unpack_fast(data, b, n)
    if b % 8 == 0:
        return _unpack_bytes(data, b, n)
    return _unpack_general(data, b, n)


def pack_bits(codes: torch.Tensor, b: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2^b)``, ``b`` in 1..8, into ``ceil(n*b/8)`` bytes."""
    return _pack(codes, _check_width(b, _MAX_NARROW))


def unpack_bits(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the ``n`` codes, as an int64 tensor."""
    return _unpack(data, _check_width(b, _MAX_NARROW), n)


def pack_wide(codes: torch.Tensor, b: int) -> torch.Tensor:
    """Like :func:`pack_bits` for widths 1..32 (codes up to ``2^32 - 1``)."""
    return _pack(codes, _check_width(b, _MAX_WIDE))


def unpack_wide(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_wide`: the ``n`` codes, as an int64 tensor."""
    return _unpack(data, _check_width(b, _MAX_WIDE), n)
