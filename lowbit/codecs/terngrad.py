"""TernGrad (Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to
Reduce Communication in Distributed Deep Learning", NeurIPS 2017), eq. (2):

    tern(g)_i = s_t * sign(g_i) * b_i,    s_t = max_j |g_j|,
    b_i ~ Bernoulli(|g_i| / s_t),

so ``E[tern(g)] = g``. The paper's layer-wise scaling corresponds to one
codec call per layer (the DDP hook does this: one message per parameter of a bucket).
Its gradient clipping (Section 3.3, ``c = 2.5``) is ``TernGradCodec(clip=c)``: every
``|g_i|`` above ``c sigma`` (``sigma`` the standard deviation of ``g``'s elements) becomes
``c sigma``, i.e. the scale is ``s_t = min(max |g|, c sigma)`` and a larger ``|g_i|`` is
sent as ``sign(g_i) s_t``. The wire format is the same; the code is then biased (by the
clipping only), and ``s_t`` no longer follows one outlier.

Paths: ``encode``/``decode`` take the fast path (:mod:`.kernels.cpu_terngrad`: one
statistics pass for ``max |g|`` and the finiteness check, then one pass that draws
and packs the codes 4 per byte; the decode unpacks, scales and checks for the code
3 in one pass), ``encode_reference``/``decode_reference`` are the float64 code; on
the CPU the two give the same bytes and decodes. On CUDA the ratio ``|g_i| / s_t``
is float32 (relative error <= 2^-22), so ``E[tern(g)]_i`` is ``g_i`` up to
``2^-22 s_t``; codes stay ternary and ``s_t`` is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import CodecKind, Payload, PayloadError, frame_count, frame_header, frame_nbytes, frame_scale, \
    pack_header
from .fastpath import FastPathCodec
from .radix import level_bits, levels_nbytes, pack_levels, unpack_levels
from .qsgd import float32_up
from .quantize import finite_float64, round_to_int
from .rng import draw_key

__all__ = ["TernGradCodec"]

_F32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class TernGradCodec(FastPathCodec):
    """Ternary stochastic quantizer; unbiased.

    Header ``<if``: (numel, scale) with ``scale = max|x|`` rounded *up* to
    float32 (so ``|x_i| / scale <= 1`` at the receiver's precision and the
    codec stays exactly unbiased); data: codes ``sign_i * b_i + 1`` in
    ``{0, 1, 2}`` packed 5 per byte in radix 3 (:mod:`lowbit.codecs.radix`: byte ``j``
    is ``sum_k code[5 j + k] 3^k``, ``ceil(n / 5)`` bytes), so ``bits`` is 1.6
    (``1.0095 log2 3``). ``decode = (code - 1) * scale``; a byte above 242 (more
    than 5 trits hold) is refused with ValueError.

    Arithmetic is float64; ``decode`` returns float32 unless ``dtype`` is
    given. Non-finite inputs and scales beyond float32 raise ValueError (the range:
    finite ``x`` with ``max |x|`` within float32; the decode is ``0`` or ``+-scale``). A
    payload whose scale is not finite, negative or beyond float32, or whose data length
    is not ``ceil(numel / 5)`` bytes, is a PayloadError.

    ``clip``: None (no clipping, the default: unbiased), or the paper's ``c`` (a finite number
    > 0; the paper uses 2.5, the DDP hooks' default
    :data:`~lowbit.integrations.ddp_hooks.HOOK_CLIP`): ``scale = min(max |x|, c sigma)``
    rounded up to float32, ``sigma`` the population standard deviation of ``x``'s elements
    (``sqrt(||x||^2 / n - mean^2)`` from torch's reductions of ``x`` in its dtype, float32 for
    16-bit input, or in float64 by two passes where that difference is below ``1e-4 ||x||^2 /
    n``: the same value on both paths), and elements beyond it
    coded as ``+-scale``. Where ``c sigma`` is 0 (a constant ``x``, one element) nothing is
    clipped.
    """

    clip: float | None = None

    name = "terngrad"
    gatherable = True
    replica_safe = True
    kernel_family = "terngrad"
    kind = CodecKind.PLAIN
    header_format = "if"

    def __post_init__(self) -> None:
        c = self.clip
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise ValueError(f"clip (TernGrad's clipping factor c: |g_i| beyond c * std(g) is clipped) must be a "
                                 f"finite number > 0 or None, got {c!r}")
            object.__setattr__(self, "clip", float(c))

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """True without clipping (eq. 2 is unbiased); clipping biases the large elements."""
        return self.clip is None

    @property
    def bits(self) -> float:
        return level_bits(3)

    def _limit(self, x: torch.Tensor, max_abs: float) -> float:
        """``max |x|``, or ``min(max |x|, c sigma)`` with clipping (``c sigma > 0``)."""
        if self.clip is None or x.numel() < 2:
            return max_abs
        xf = x.detach().reshape(-1)
        xf = xf if xf.dtype in (torch.float32, torch.float64) else xf.float()
        n = xf.numel()  # sigma^2 = ||x||^2 / n - mean^2: two fast reductions (torch.std took 6x as long)
        mean = float(xf.sum()) / n
        square = float(torch.linalg.vector_norm(xf)) ** 2 / n
        var = square - mean * mean
        if var <= 1e-4 * square:  # mostly mean: the difference would be the reductions' rounding
            var = float(torch.var(xf.to(torch.float64), correction=0))
        bound = self.clip * math.sqrt(var)
        return min(max_abs, bound) if bound > 0 else max_abs

    @staticmethod
    def _scale(max_abs: float) -> float:
        """``max |x|`` rounded up to float32 (ValueError beyond float32)."""
        return float(float32_up(torch.tensor([max_abs], dtype=torch.float64), "scale")[0])

    def encode_fast(self, K, x: torch.Tensor, n: int, generator: torch.Generator | None) -> Payload:
        scale = 0.0
        if n:
            max_abs, finite = K.terngrad_max_abs(x)
            if not finite:
                raise ValueError("x must be finite for the TernGrad codec")
            scale = self._scale(self._limit(x, max_abs))
        data = K.terngrad_encode(x, scale, draw_key(generator))
        return Payload(header=pack_header(self.header_format, n, scale, device=x.device), data=data)

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float]:
        """``(n, scale)`` of a payload, its frame checked (PayloadError)."""
        n, scale = frame_header(self, payload)
        frame_count(self, n, numel)
        frame_scale(self, scale, "scale", _F32_MAX)
        frame_nbytes(self, payload.data, levels_nbytes(n, 3), lambda: f"{n} trits")
        return n, scale

    def decode_fast(self, K, payload: Payload, dtype: torch.dtype | None, numel: int | None) -> torch.Tensor:
        n, scale = self._frame(payload, numel)
        x, valid = K.terngrad_decode(payload.data, n, scale, torch.float32 if dtype is None else dtype)
        if not valid:
            raise PayloadError(self.name, "bytes of 5 ternary digits", "a byte that is not", "malformed terngrad "
                               "payload: it holds a byte that is not 5 ternary digits (a value above 242, or above "
                               "3^r - 1 in a last byte of r digits)")
        return x

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (the same bytes)."""
        n, x64 = finite_float64(x, "TernGrad")
        scale = self._scale(self._limit(x, float(x64.abs().max()))) if n else 0.0
        ratio = (x64.abs() / scale).clamp_(max=1.0) if scale > 0 else torch.zeros_like(x64)
        b = round_to_int(ratio, "stochastic", generator).clamp_(0, 1)
        codes = (torch.where(x64 < 0, -b, b) + 1).to(torch.int64)
        return Payload(header=pack_header(self.header_format, n, scale, device=x.device), data=pack_levels(codes, 3))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n, scale = self._frame(payload, numel)
        codes = unpack_levels(payload.data, 3, n, codec=self.name)
        x = (codes - 1).to(torch.float64) * scale
        return x.to(torch.float32 if dtype is None else dtype)
