"""Naive uniform quantization to the grid ``{step * n : n in Z}``.

This is the quantizer ``Q_delta`` of Theorem 1 of the Moniqua paper (points
``{delta n}``, unbiased with stochastic rounding): quantizing models directly
with it is the "naive quantized gossip" that Theorem 1 shows cannot converge.

Paths: ``encode``/``decode`` take the fast path (:mod:`.kernels.cpu_uniform`),
``encode_reference``/``decode_reference`` are the float64 whole-tensor code; on the
CPU the two give the same bytes and decodes. On CUDA (:mod:`.kernels.gpu_uniform`)
the arithmetic is float32 for float32/half inputs: ``x / step`` carries at most
``2^-22 |x| / step`` of a code (a code then differs from the CPU's by one, rarely)
and the decode ``(code + offset) * step`` rounds once more, so ``error_bound``
holds with the slack ``2^-21 (|x| + step)`` added; the CUDA encode reads back to
the host twice (``x``'s range with the finiteness flag, then the codes' range,
which fixes the width).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CodecKind, Payload, PayloadError, frame_count, frame_header, frame_nbytes, pack_header
from .fastpath import FastPathCodec
from .quantize import INT32_MAX, Rounded, check_numel, check_positive, check_rounding, error_bound, round_to_int
from .radix import level_width, levels_nbytes, pack_levels, pack_levels_fast, radix_applies, unpack_levels, \
    unpack_levels_fast
from .rng import draw_key

__all__ = ["UniformCodec"]

_MAX_SPAN = 2**32 - 1
_F32_MAX = float(torch.finfo(torch.float32).max)
_WORD_DTYPE = {8: torch.uint8, 16: torch.uint16}


def _radix_word(L: int) -> int:
    """Bits of the words that hold the codes handed to mixed radix: 8 up to 256 levels, 16 above
    (mixed radix applies up to 2^16 levels)."""
    return 8 if L <= 256 else 16


@dataclass(frozen=True)
class UniformCodec(Rounded, FastPathCodec):
    """``x -> n = round(x / step)`` (integers), sent at ``log2`` of their number of levels.

    Header ``<iiI``: (numel, offset = min n, top = max n - min n); data: ``n - offset``,
    ``L = max(2, top + 1)`` levels, packed by :func:`~lowbit.codecs.radix.pack_levels`
    (mixed radix for L <= 2^16 not a power of two, e.g. 1.6 bits for 3 levels; else
    ``ceil(log2 L)`` bits). L is per message, so ``bits`` is only the worst case (32);
    ``payload.nbytes`` is the honest size. Raises ValueError when the codes do
    not fit (offset outside int32, or a range wider than 32 bits), i.e. when
    ``step`` is too small for the data.

    Arithmetic is float64 internally; ``decode`` returns float32 unless
    ``dtype`` is given. Error ``|decode - x| <= error_bound`` (= ``step`` for
    stochastic rounding, ``step / 2`` for nearest), up to float rounding.

    Range: finite ``x`` whose grid points ``step n`` all fit float32 (``|x| + step`` at
    most float32's largest value, about 3.4e38), and whose codes fit the header (above).
    Encode refuses others with a ValueError; a payload whose offset and span reach beyond
    float32 is a PayloadError.
    """

    step: float
    rounding: str = "stochastic"

    name = "uniform"
    gatherable = True
    replica_safe = True
    kernel_family = "uniform"
    kind = CodecKind.PLAIN
    header_format = "iiI"

    def __post_init__(self) -> None:
        object.__setattr__(self, "step", check_positive(self.step, "step"))
        check_rounding(self.rounding)

    @classmethod
    def from_options(cls, opts) -> "UniformCodec":
        """``--codec uniform``: the step ``--delta``, stochastic rounding unless ``--rounding``."""
        return cls(step=opts.delta, rounding=opts.rounding or "stochastic")

    @property
    def bits(self) -> float:
        return 32.0

    @property
    def error_bound(self) -> float:
        return error_bound(self.step, self.rounding)

    def _offset_and_top(self, lo: float, hi: float) -> tuple[int, int]:
        """The header's offset (the smallest code) and top (the codes' span) from their range."""
        if not (-INT32_MAX - 1 <= lo <= INT32_MAX and hi - lo <= _MAX_SPAN):
            raise ValueError(
                f"step={self.step} is too small for x (or x is not finite): the codes span "
                f"[{lo:.6g}, {hi:.6g}], but the offset must fit int32 and the range 32 bits"
            )
        if self._reach(int(lo), int(hi - lo)) > _F32_MAX:
            raise ValueError(f"x is out of the uniform codec's range: its grid points reach "
                             f"{self._reach(int(lo), int(hi - lo)):.6g} (step={self.step}), beyond float32's "
                             f"largest value {_F32_MAX:.6g}")
        return int(lo), int(hi - lo)

    def _reach(self, offset: int, top: int) -> float:
        """The largest ``|step n|`` of the codes ``offset..offset + top`` (float64)."""
        return max(abs(offset), abs(offset + top)) * self.step

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, int, int]:
        """``(n, offset, top)`` of a payload, its frame checked (PayloadError)."""
        n, offset, top = frame_header(self, payload)
        frame_count(self, n, numel)
        if self._reach(offset, top) > _F32_MAX:
            raise PayloadError(self.name, f"codes whose grid points fit float32 (step={self.step})",
                               f"offset {offset} and span {top}")
        L = max(2, top + 1)
        frame_nbytes(self, payload.data, levels_nbytes(n, L), lambda: f"{n} codes of {L} levels")
        return n, offset, top

    def _empty(self, x: torch.Tensor) -> Payload:
        return Payload(header=pack_header(self.header_format, 0, 0, 0, device=x.device),
                       data=torch.empty(0, dtype=torch.uint8, device=x.device))

    def encode_fast(self, K, x: torch.Tensor, n: int, generator: torch.Generator | None) -> Payload:
        """The codes' range is bounded by ``x``'s (one statistics pass), the codes are written
        against that bound in the narrowest unsigned dtype (one pass), then re-based on the
        codes' own smallest value and packed (see ``uniform_codes`` in the kernel modules)."""
        if n == 0:
            return self._empty(x)
        stochastic = self.rounding == "stochastic"
        key = draw_key(generator) if stochastic else 0
        codes, base, lo, hi, finite = K.uniform_codes(x, self.step, stochastic, key)
        if not finite:
            raise ValueError(f"x must be finite for the uniform codec (step={self.step}): it holds NaN or inf")
        offset, top = self._offset_and_top(lo, hi)
        L = max(2, top + 1)
        if radix_applies(L):  # the re-based codes one per byte (16-bit words above 256 levels), then mixed radix
            w = _radix_word(L)
            data = pack_levels_fast(K.uniform_pack(codes, offset - base, w).view(_WORD_DTYPE[w]), L)
        else:
            data = K.uniform_pack(codes, offset - base, level_width(L))
        return Payload(header=pack_header(self.header_format, n, offset, top, device=x.device), data=data)

    def decode_fast(self, K, payload: Payload, dtype: torch.dtype | None, numel: int | None) -> torch.Tensor:
        n, offset, top = self._frame(payload, numel)
        L = max(2, top + 1)
        out = torch.float32 if dtype is None else dtype
        if radix_applies(L):  # the codes one per byte (16-bit words above 256 levels): the 8 (16)-bit packing
            w = _radix_word(L)
            codes = unpack_levels_fast(payload.data, L, n, _WORD_DTYPE[w], codec=self.name).view(torch.uint8)
            return K.uniform_decode(codes, w, n, offset, self.step, out)
        return K.uniform_decode(payload.data, level_width(L), n, offset, self.step, out)

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (the same bytes)."""
        n = check_numel(x)
        if n == 0:
            return self._empty(x)
        codes = round_to_int(x.detach().to(torch.float64) / self.step, self.rounding, generator)
        lo, hi = torch.aminmax(codes)
        lo_i, top = self._offset_and_top(float(lo), float(hi))
        data = pack_levels(codes.to(torch.int64) - lo_i, max(2, top + 1))
        return Payload(header=pack_header(self.header_format, n, lo_i, top, device=x.device), data=data)

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n, offset, top = self._frame(payload, numel)
        L = max(2, top + 1)
        codes = unpack_levels(payload.data, L, n, codec=self.name)
        x = (codes + offset).to(torch.float64) * self.step
        return x.to(torch.float32 if dtype is None else dtype)
