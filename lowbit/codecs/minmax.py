"""Bagua's min-max quantizer (low precision decentralized SGD).

The input's range ``[min, max]`` is split into ``2^b - 1`` equal intervals and
each element is sent as the index of a grid point (``b = 8`` in Bagua, with
deterministic rounding).

Paths: ``encode``/``decode`` take the fast path (:mod:`.kernels.cpu_minmax`: one
statistics pass for the header's min and max and the finiteness check, one
quantize pass to uint8 codes, packing), ``encode_reference``/``decode_reference``
are the float64 whole-tensor code; on the CPU the two give the same bytes and
decodes. On CUDA (:mod:`.kernels.gpu_minmax`) the arithmetic is float32 for
float32/half inputs: ``(x - min) * scale`` then carries at most ``3 eps32 levels``
of a code and the decode ``code / scale + min`` ``2 eps32 (max - min) + eps32
max(|min|, |max|)`` (``eps32 = 2^-24``), so the error bounds below hold with the
slack ``6 eps32 (max - min) + 2 eps32 max(|min|, |max|)`` added.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from .base import CodecKind, Payload, frame_count, frame_header, frame_nbytes, frame_scale, pack_header
from .fastpath import FastPathCodec
from .packing import pack_bits, packed_nbytes, unpack_bits
from .quantize import Rounded, check_int_range, check_numel, check_rounding, round_to_int
from .rng import draw_key

__all__ = ["MinMaxCodec"]

_F32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class MinMaxCodec(Rounded, FastPathCodec):
    """Header ``<iff``: (numel, min, max) with min/max as float32; data: codes
    ``round((x - min) * scale)`` in ``0..2^b - 1``, ``scale = (2^b - 1) / (max - min)``,
    packed ``b`` bits each (all codes 0 when ``max == min``).
    ``decode = codes / scale + min``.

    ``scale`` is computed (in float64) from the float32 header values, the same
    way on both ends. Error: ``<= (max - min) / (2^b - 1) / 2`` with ``nearest``
    rounding (Bagua's choice, biased), ``< (max - min) / (2^b - 1)`` and
    unbiased with ``stochastic``. ``decode`` returns float32 unless ``dtype`` is
    given. Range: finite ``x`` whose min and max fit float32 (others raise ValueError
    on encode); the decode lies in ``[min, max]``. A payload whose min/max are not finite
    or out of order, or whose data length does not match, is a PayloadError.
    """

    bits: int = 8
    rounding: str = "nearest"

    name = "minmax"
    gatherable = True
    replica_safe = True
    kernel_family = "minmax"
    kind = CodecKind.PLAIN
    header_format = "iff"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int_range(self.bits, "bits", 1, 8))
        check_rounding(self.rounding)

    @classmethod
    def from_options(cls, opts) -> "MinMaxCodec":
        """``--codec minmax``: ``--bits`` bits, nearest rounding unless ``--rounding``."""
        return cls(bits=opts.bits, rounding=opts.rounding or "nearest")

    @property
    def levels(self) -> int:
        """Largest code, ``2^bits - 1``."""
        return (1 << self.bits) - 1

    def _scale(self, lo: float, hi: float) -> float:
        return self.levels / (hi - lo) if hi > lo else 0.0

    def _header_range(self, lo: float, hi: float, finite: bool) -> tuple[float, float]:
        """The float32 values of ``lo``/``hi`` that the receiver will see; ValueError when x
        is not finite or its range does not fit float32."""
        if not finite:
            raise ValueError("x must be finite for the min-max codec, got NaN or inf")
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"x must be finite for the min-max codec, got range [{lo}, {hi}]")
        try:
            return struct.unpack("<ff", struct.pack("<ff", lo, hi))
        except OverflowError:
            raise ValueError(f"the range of x [{lo}, {hi}] does not fit the float32 header") from None

    def _empty(self, x: torch.Tensor) -> Payload:
        return Payload(header=pack_header(self.header_format, 0, 0.0, 0.0, device=x.device),
                       data=torch.empty(0, dtype=torch.uint8, device=x.device))

    def encode_fast(self, K, x: torch.Tensor, n: int, generator: torch.Generator | None) -> Payload:
        if n == 0:
            return self._empty(x)
        lo, hi = self._header_range(*K.minmax_range(x))
        stochastic = self.rounding == "stochastic"
        data = K.minmax_encode(x, lo, self._scale(lo, hi), self.bits, stochastic,
                               draw_key(generator) if stochastic else 0)
        return Payload(header=pack_header(self.header_format, n, lo, hi, device=x.device), data=data)

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float, float]:
        """``(n, min, max)`` of a payload, its frame checked (PayloadError)."""
        n, lo, hi = frame_header(self, payload)
        frame_count(self, n, numel)
        frame_scale(self, lo, "min", _F32_MAX, -_F32_MAX)
        frame_scale(self, hi, "max", _F32_MAX, lo)
        frame_nbytes(self, payload.data, packed_nbytes(n, self.bits), lambda: f"{n} codes of {self.bits} bits")
        return n, lo, hi

    def decode_fast(self, K, payload: Payload, dtype: torch.dtype | None, numel: int | None) -> torch.Tensor:
        n, lo, hi = self._frame(payload, numel)
        dtype = torch.float32 if dtype is None else dtype
        scale = self._scale(lo, hi)
        if scale == 0:
            return torch.full((n,), lo, dtype=dtype, device=payload.data.device)
        return K.minmax_decode(payload.data, self.bits, n, lo, scale, dtype)

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (the same bytes)."""
        n = check_numel(x)
        if n == 0:
            return self._empty(x)
        x64 = x.detach().to(torch.float64)
        lo, hi = torch.aminmax(x.detach())
        lo, hi = self._header_range(float(lo), float(hi), True)
        header = pack_header(self.header_format, n, lo, hi, device=x.device)
        scale = self._scale(lo, hi)
        codes = round_to_int((x64 - lo) * scale, self.rounding, generator).clamp_(0, self.levels)
        return Payload(header=header, data=pack_bits(codes.to(torch.int64), self.bits))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n, lo, hi = self._frame(payload, numel)
        codes = unpack_bits(payload.data, self.bits, n).to(torch.float64)
        scale = self._scale(lo, hi)
        x = codes / scale + lo if scale > 0 else torch.full_like(codes, lo)
        return x.to(torch.float32 if dtype is None else dtype)
