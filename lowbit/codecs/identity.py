"""fp32 on the wire: the lossless baseline (D-PSGD, AllReduce SGD).

``encode`` is one copy (a cast for other dtypes), ``decode`` one copy or one cast
to the requested dtype, reading the payload in place when its bytes are aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, frame_counted, pack_header
from .kernels import empty_output, kernels_for
from .quantize import check_numel

__all__ = ["IdentityCodec", "bytes_as"]


def bytes_as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D uint8 ``data`` read as ``dtype``: a view (no copy) when the bytes are aligned
    for ``dtype``, else a view of a copy. The result may alias ``data``: callers that return
    it copy it (a decode never aliases its payload)."""
    size = dtype.itemsize
    if data.storage_offset() % size == 0 and data.is_contiguous():
        return data.view(dtype)
    return data.clone().view(dtype)


@dataclass(frozen=True)
class IdentityCodec(Codec):
    """Send ``x`` as float32 bytes (native byte order, little-endian on every
    platform torch supports in practice). Header ``<i``: numel.

    ``encode`` copies (the payload never aliases ``x``); inputs of another
    floating dtype are cast to float32, so float64 inputs lose precision.
    ``decode`` returns float32 (the wire dtype) unless ``dtype`` is given.
    """

    name = "fp32"
    float_wire = True
    replica_safe = True
    kind = CodecKind.PLAIN
    unbiased = True
    header_format = "i"

    @property
    def bits(self) -> float:
        return 32.0

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """One copy (a cast for other dtypes) of ``x``: the reference is the same."""
        n = check_numel(x)
        data = empty_output(n, torch.float32, x.device).copy_(x.detach().reshape(-1)).view(torch.uint8)
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=data)

    encode_reference = encode

    def _check(self, payload: Payload, numel: int | None) -> int:
        """The frame: header, count (``numel``), ``4 n`` data bytes (PayloadError)."""
        return frame_counted(self, payload, numel, lambda n: 4 * n, lambda n: f"{n} float32 values")

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        """One pass: a copy of the payload's floats, or their cast to ``dtype``. The values are
        the sender's as they are (a non-finite one passes on: there is no scale to check)."""
        if kernels_for(payload.data) is None:
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        n = self._check(payload, numel)
        out = empty_output(n, torch.float32 if dtype is None else dtype, payload.data.device)
        return out.copy_(bytes_as(payload.data, torch.float32))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The plain reference of :meth:`decode` (a copy, then a cast)."""
        self._check(payload, numel)
        x = payload.data.clone().view(torch.float32)
        return x if dtype is None else x.to(dtype)
