"""Scaled sign compression: 1-bit SGD (Seide, Fu, Droppo, Li, Yu, "1-Bit
Stochastic Gradient Descent and its Application to Data-Parallel Distributed
Training of Speech DNNs", Interspeech 2014) and signSGD (Bernstein, Wang,
Azizzadenesheli, Anandkumar, ICML 2018), in the scaled form of EF-SignSGD
(Karimireddy, Rebjock, Stich, Jaggi, ICML 2019): ``C(x) = ||x||_1 / d * sign(x)``.

The codec is deterministic and *biased*. These methods only work well with
error feedback (the residual ``x - decode(encode(x))`` is added to the next
step's input); that memory is state of the optimizer, per worker and per
tensor, so it lives in the algorithm layer, not here: the codec stays a
stateless map.

Paths: ``encode`` (:mod:`.kernels.cpu_sign`) computes the sign bits, the
finiteness check and the scale's float64 sum (of ``|x_i|`` or ``x_i^2``) in one
pass, adding in the kernels' fixed lane order; ``encode_reference`` computes that sum
with :func:`~lowbit.codecs.quantize.lane_sums_reference`, the same order, so the two
send the same bytes. (Torch's
float32 CPU norm is not used: at 1e7 equal elements its 1-norm is 14% low, see
docs/KERNELS.md.) On CUDA the bits are exact and the scale is torch's norm in float32 on
the device (about 1e-6 relative to the CPU's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import CodecKind, Payload, frame_count, frame_header, frame_nbytes, frame_scale, pack_header
from .fastpath import FastPathCodec
from .packing import pack_bits, packed_nbytes, unpack_bits
from .quantize import finite_float64, lane_sums_reference

__all__ = ["SignCodec", "SIGN_SCALES"]

SIGN_SCALES = ("mean_abs", "rms", "none")
_F32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class SignCodec(FastPathCodec):
    """``decode = scale * sign(x)`` with one bit per element.

    ``scale``: ``"mean_abs"`` (default) sends ``||x||_1 / d``, the scale of
    1-bit SGD / EF-SignSGD, which minimises ``||x - c sign(x)||_2`` over ``c``;
    ``"rms"`` sends ``||x||_2 / sqrt(d)``, so that the decoded vector has the
    norm of ``x``; ``"none"`` is plain signSGD (``decode`` is ``+-1``).

    Header ``<if`` (numel, scale as float32), or ``<i`` for ``"none"``; data:
    bit ``1`` for ``x_i >= 0`` (zero is sent as ``+``), ``0`` for ``x_i < 0``,
    packed 1 bit each. Non-finite inputs and scales beyond float32 raise
    ValueError (the range: finite ``x`` whose scale fits float32; the decode is
    ``+-scale``). ``decode`` returns float32 unless ``dtype`` is given; a payload whose
    scale is not finite, negative or beyond float32, or whose data is not
    ``ceil(numel / 8)`` bytes, is a PayloadError.
    """

    scale: str = "mean_abs"

    name = "sign"
    gatherable = True
    replica_safe = True
    kernel_family = "sign"
    kind = CodecKind.PLAIN
    unbiased = False

    def __post_init__(self) -> None:
        if self.scale not in SIGN_SCALES:
            raise ValueError(f"scale must be one of {SIGN_SCALES}, got {self.scale!r}")

    @property
    def header_format(self) -> str:  # type: ignore[override]
        return "i" if self.scale == "none" else "if"

    @property
    def bits(self) -> float:
        return 1.0

    @property
    def order(self) -> int:
        """The norm the scale is built on: 1 (``mean_abs``), 2 (``rms``), 0 (``none``)."""
        return {"mean_abs": 1, "rms": 2, "none": 0}[self.scale]

    def _scale(self, total: float, n: int) -> float:
        """The scale from ``total``, the sum of ``|x_i|`` or ``x_i^2`` (see :attr:`order`)."""
        if n == 0:
            return 0.0
        return total / n if self.order == 1 else math.sqrt(total) / math.sqrt(n)

    def _payload(self, n: int, total: float, data: torch.Tensor, device) -> Payload:
        if self.scale == "none":
            return Payload(header=pack_header(self.header_format, n, device=device), data=data)
        c = self._scale(total, n)
        if c > float(torch.finfo(torch.float32).max):
            raise ValueError(f"the {self.scale} scale {c:.6g} does not fit the float32 header")
        return Payload(header=pack_header(self.header_format, n, c, device=device), data=data)

    def encode_fast(self, K, x: torch.Tensor, n: int, generator: torch.Generator | None) -> Payload:
        """One pass: the sign bits, the finiteness flag and the scale's float64 sum (in the
        reference's lane order: the same bytes)."""
        data, total, finite = K.sign_encode(x, self.order)
        if not finite:
            raise ValueError("x must be finite for the sign codec")
        return self._payload(n, total, data, x.device)

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float]:
        """``(n, scale)`` of a payload, its frame checked (PayloadError)."""
        fields = frame_header(self, payload)
        n = frame_count(self, fields[0], numel)
        c = 1.0 if self.scale == "none" else frame_scale(self, fields[1], "scale", _F32_MAX)
        frame_nbytes(self, payload.data, packed_nbytes(n, 1), lambda: f"{n} sign bits")
        return n, c

    def decode_fast(self, K, payload: Payload, dtype: torch.dtype | None, numel: int | None) -> torch.Tensor:
        n, c = self._frame(payload, numel)
        return K.sign_decode(payload.data, n, c, torch.float32 if dtype is None else dtype)

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (the same bytes): the scale's
        sum in the kernel's lane order (:func:`~lowbit.codecs.quantize.lane_sums_reference`)."""
        n, x64 = finite_float64(x, "sign")
        data = pack_bits((x64 >= 0).to(torch.int64), 1)
        total = 0.0
        if n and self.order:
            total = float(lane_sums_reference(x64.abs() if self.order == 1 else x64 * x64, n)[0])
        return self._payload(n, total, data, x.device)

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n, c = self._frame(payload, numel)
        bits = unpack_bits(payload.data, 1, n)
        x = (2 * bits - 1).to(torch.float64) * c
        return x.to(torch.float32 if dtype is None else dtype)
