"""fp32 on the wire: the lossless baseline (D-PSGD, AllReduce SGD)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, check_flat, pack_header, unpack_header
from .quantize import check_numel

__all__ = ["IdentityCodec"]


@dataclass(frozen=True)
class IdentityCodec(Codec):
    """Send ``x`` as float32 bytes (native byte order, little-endian on every
    platform torch supports in practice). Header ``<i``: numel.

    ``encode`` copies (the payload never aliases ``x``); inputs of another
    floating dtype are cast to float32, so float64 inputs lose precision.
    ``decode`` returns float32 (the wire dtype) unless ``dtype`` is given.
    """

    name = "fp32"
    kind = CodecKind.PLAIN
    unbiased = True
    header_format = "i"

    @property
    def bits(self) -> float:
        return 32.0

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        check_flat(x)
        n = check_numel(x)
        data = x.detach().to(torch.float32, copy=True).contiguous().view(torch.uint8)
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=data)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        (n,) = unpack_header(self.header_format, payload.header)
        if payload.data.numel() != 4 * n:
            raise ValueError(f"fp32 payload of {n} elements needs {4 * n} data bytes, got {payload.data.numel()}")
        x = payload.data.clone().view(torch.float32)
        return x if dtype is None else x.to(dtype)
