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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, pack_header, unpack_header
from .packing import pack_bits, unpack_bits
from .quantize import finite_float64

__all__ = ["SignCodec", "SIGN_SCALES"]

SIGN_SCALES = ("mean_abs", "rms", "none")


@dataclass(frozen=True)
class SignCodec(Codec):
    """``decode = scale * sign(x)`` with one bit per element.

    ``scale``: ``"mean_abs"`` (default) sends ``||x||_1 / d``, the scale of
    1-bit SGD / EF-SignSGD, which minimises ``||x - c sign(x)||_2`` over ``c``;
    ``"rms"`` sends ``||x||_2 / sqrt(d)``, so that the decoded vector has the
    norm of ``x``; ``"none"`` is plain signSGD (``decode`` is ``+-1``).

    Header ``<if`` (numel, scale as float32), or ``<i`` for ``"none"``; data:
    bit ``1`` for ``x_i >= 0`` (zero is sent as ``+``), ``0`` for ``x_i < 0``,
    packed 1 bit each. Non-finite inputs and scales beyond float32 raise
    ValueError. ``decode`` returns float32 unless ``dtype`` is given.
    """

    scale: str = "mean_abs"

    name = "sign"
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

    def _scale_of(self, x64: torch.Tensor) -> float:
        if x64.numel() == 0:
            return 0.0
        if self.scale == "mean_abs":
            return float(x64.abs().mean())
        return float(torch.linalg.vector_norm(x64)) / math.sqrt(x64.numel())

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        n, x64 = finite_float64(x, "sign")
        data = pack_bits((x64 >= 0).to(torch.int64), 1)
        if self.scale == "none":
            return Payload(header=pack_header(self.header_format, n, device=x.device), data=data)
        c = self._scale_of(x64)
        if c > float(torch.finfo(torch.float32).max):
            raise ValueError(f"the {self.scale} scale {c:.6g} does not fit the float32 header")
        return Payload(header=pack_header(self.header_format, n, c, device=x.device), data=data)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        fields = unpack_header(self.header_format, payload.header)
        n = fields[0]
        c = 1.0 if self.scale == "none" else fields[1]
        bits = unpack_bits(payload.data, 1, n)
        x = (2 * bits - 1).to(torch.float64) * c
        return x.to(torch.float32 if dtype is None else dtype)
