"""TernGrad (Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to
Reduce Communication in Distributed Deep Learning", NeurIPS 2017), eq. (2):

    tern(g)_i = s_t * sign(g_i) * b_i,    s_t = max_j |g_j|,
    b_i ~ Bernoulli(|g_i| / s_t),

so ``E[tern(g)] = g``. The paper's layer-wise scaling corresponds to one
codec call per layer; its gradient clipping (Section 3.3) changes the
gradient, not the wire format, and belongs to the training algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, pack_header, unpack_header
from .packing import pack_bits, unpack_bits
from .qsgd import float32_up
from .quantize import finite_float64, round_to_int

__all__ = ["TernGradCodec"]


@dataclass(frozen=True)
class TernGradCodec(Codec):
    """Ternary stochastic quantizer; unbiased.

    Header ``<if``: (numel, scale) with ``scale = max|x|`` rounded *up* to
    float32 (so ``|x_i| / scale <= 1`` at the receiver's precision and the
    codec stays exactly unbiased); data: codes ``sign_i * b_i + 1`` in
    ``{0, 1, 2}`` packed 2 bits each. ``decode = (code - 1) * scale``.

    Arithmetic is float64; ``decode`` returns float32 unless ``dtype`` is
    given. Non-finite inputs and scales beyond float32 raise ValueError.
    """

    name = "terngrad"
    kind = CodecKind.PLAIN
    unbiased = True
    header_format = "if"

    @property
    def bits(self) -> float:
        return 2.0

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        n, x64 = finite_float64(x, "TernGrad")
        scale = float(float32_up(x64.abs().max().reshape(1), "scale")[0]) if n else 0.0
        ratio = (x64.abs() / scale).clamp_(max=1.0) if scale > 0 else torch.zeros_like(x64)
        b = round_to_int(ratio, "stochastic", generator).clamp_(0, 1)
        codes = (torch.where(x64 < 0, -b, b) + 1).to(torch.int64)
        return Payload(header=pack_header(self.header_format, n, scale, device=x.device), data=pack_bits(codes, 2))

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        n, scale = unpack_header(self.header_format, payload.header)
        codes = unpack_bits(payload.data, 2, n)
        if n and int(codes.max()) > 2:
            raise ValueError("TernGrad payload holds the code 3, which is not a ternary value")
        x = (codes - 1).to(torch.float64) * scale
        return x.to(torch.float32 if dtype is None else dtype)
