"""QSGDMaxNormMultiScale (:class:`MultiScaleMaxNormCodec`): see :mod:`lowbit.codecs.maxnorm`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Payload, PayloadError, SummableCodec, check_world_size, frame_output, pack_header
from ..kernels import kernels_for
from ..packing import pack_wide, packed_nbytes, unpack_wide
from ..quantize import check_int_range, round_to_int
from ..rng import draw_key
from .shared import (FAMILY, fast_encode_int, _MAX_SCALES, _check_norm, _f32_up, _as_float64, _local_statistic,
                     _level_error, _index_error, _raise_flags, _fast_norm, _out_dtype, _levels_on, _norm_value, _ratios,
                     _signed, _check_int_sum, _kernels, _x_kernels, _frame, _lemma_bound)


@dataclass(frozen=True)
class MultiScaleMaxNormCodec(SummableCodec):
    """QSGDMaxNormMultiScale (section 3.2). ``scales``: the precisions ``p_j`` (log2 of
    levels) of the ``N`` scales, e.g. ``(2, 6)`` for the paper's two-scale (2, 6):
    levels ``s_j = 2^p_j - 1`` = ``(3, 63)``. Stored sorted ascending; distinct.

    Bits per coordinate: ``min p_j + 1`` (sign + magnitude, magnitudes never exceed
    ``s_min``) plus ``ceil(log2 N)`` for the scale index. Unbiased; kind SUMMABLE with
    two scale rounds: ``shared_scale(x)`` -> ``[W_m]`` combined by ``max``; then
    ``shared_scale(x, (W,))`` -> per-coordinate index (uint8) of the largest scale
    admissible by eq. 11 for this worker, combined by ``min``. ``scale = (W, index)``.
    """

    scales: tuple = (2, 6)
    norm: str = "l2"

    name = "qsgd-maxnorm-multiscale"
    kernel_family = FAMILY
    unbiased = True
    header_format = "if"
    scale_reduce_ops = ("max", "min")

    def __post_init__(self) -> None:
        sc = self.scales
        if isinstance(sc, (str, bytes)) or not hasattr(sc, "__iter__"):
            raise ValueError(f"scales must be a tuple of ints (precisions in bits), got {sc!r}")
        sc = tuple(sc)
        if not 1 <= len(sc) <= _MAX_SCALES:
            raise ValueError(f"scales must hold 1..{_MAX_SCALES} precisions, got {len(sc)}: {sc!r}")
        sc = tuple(sorted(check_int_range(p, f"scales[{i}]", 1, 31) for i, p in enumerate(sc)))
        if len(set(sc)) != len(sc):
            raise ValueError(f"scales must be distinct, got {self.scales!r}")
        object.__setattr__(self, "scales", sc)
        _check_norm(self.norm)
        # distinct precisions <= 31 keep min p + 1 + ceil(log2 N) <= 32: one pack_wide word

    @property
    def levels(self) -> tuple:
        """``s_j = 2^p_j - 1`` for each scale, ascending."""
        return tuple((1 << p) - 1 for p in self.scales)

    @property
    def index_bits(self) -> int:
        """``ceil(log2 N)`` bits of scale index per coordinate (0 for one scale)."""
        return (len(self.scales) - 1).bit_length()

    @property
    def code_bits(self) -> int:
        """Bits of the signed code: ``min p_j + 1``."""
        return self.scales[0] + 1

    @property
    def bits(self) -> int:  # type: ignore[override]
        """Bits per coordinate on the wire: the paper's ``ceil(log2 s_min) + 1 + ceil(log2 N)``."""
        return self.code_bits + self.index_bits

    @property
    def max_code(self) -> int:
        return self.levels[0]

    def scale_nbytes(self, numel: int) -> int:
        """4 bytes of norm, then ``ceil(numel * ceil(log2 N) / 8)`` bytes of packed indices."""
        return 4 + (numel * self.index_bits + 7) // 8

    def variance_bound(self, numel: int, scale) -> float:
        """Lemma 2: Lemma 1's bound with ``s_hat = min_j s_j``."""
        W = _norm_value(scale[0] if isinstance(scale, (tuple, list)) else scale)
        return _lemma_bound(numel, self.levels[0], W, self.norm)

    def _levels_tensor(self, device) -> torch.Tensor:
        return _levels_on(self.levels, torch.device(device))

    def _split_scale(self, scale, n: int, device) -> tuple[float, torch.Tensor]:
        if not isinstance(scale, (tuple, list)) or len(scale) != 2:
            raise ValueError("scale must be the pair (norm, index) agreed in the two scale rounds")
        W = _norm_value(scale[0], "scale[0]")
        idx = scale[1]
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.numel() != n \
                or idx.is_floating_point() or idx.is_complex():
            desc = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"scale[1] (the scale index) must be a 1-D integer tensor of {n} elements, got {desc}")
        idx = idx.to(device=device, dtype=torch.int64)
        if n and (int(idx.min()) < 0 or int(idx.max()) >= len(self.scales)):
            raise ValueError(f"scale[1] (the scale index) must lie in 0..{len(self.scales) - 1}")
        return W, idx

    def _fast_split(self, scale, x: torch.Tensor) -> tuple[float, torch.Tensor]:
        """``(W, index)`` of an agreed scale, the index's shape checked (its range is
        checked by the kernel that reads it)."""
        if not isinstance(scale, (tuple, list)) or len(scale) != 2:
            raise ValueError("scale must be the pair (norm, index) agreed in the two scale rounds")
        W = _norm_value(scale[0], "scale[0]")
        idx = scale[1]
        n = x.numel()
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.numel() != n \
                or idx.is_floating_point() or idx.is_complex():
            desc = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"scale[1] (the scale index) must be a 1-D integer tensor of {n} elements, got {desc}")
        return W, idx.to(x.device).contiguous()

    # --- the summable protocol (fast path) --------------------------------------------

    def shared_scale(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        K = _x_kernels(x)
        if K is None:
            return self.shared_scale_reference(x, agreed)
        if len(agreed) == 0:
            return K.as_scale(_fast_norm(K, x, self.norm), x)
        if len(agreed) != 1:
            raise ValueError(f"{type(self).__name__} has two scale rounds; agreed must hold 0 or 1 tensors, got {len(agreed)}")
        W = _norm_value(agreed[0], "agreed[0]")
        idx, flags = K.ms_index(x, W, self._levels_tensor(x.device))
        _raise_flags(K, flags, x, W, self.norm)
        return idx

    def encode_int(self, x: torch.Tensor, scale, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
        dtype, K, codes = fast_encode_int(self, x, scale, generator, dtype)
        if codes is not None:
            return codes
        W, idx = self._fast_split(scale, x)
        codes, flags = K.ms_encode_int(x, W, self._levels_tensor(x.device), idx, draw_key(generator), dtype)
        _raise_flags(K, flags, x, W, self.norm, len(self.scales))
        return codes

    def decode_sum(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        K = _kernels(int_sum)
        if K is None:
            return self.decode_sum_reference(int_sum, scale, world_size, numel=numel, dtype=dtype)
        _check_int_sum(int_sum, numel)
        m = check_world_size(world_size)
        W, idx = self._fast_split(scale, int_sum)
        out, flags = K.ms_decode_sum(int_sum, idx, W, self._levels_tensor(int_sum.device), m, _out_dtype(dtype))
        if int(flags):
            raise _index_error(len(self.scales))
        return out

    # --- one message (fast path) ------------------------------------------------------------

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        """One worker's message; ``scale``: the agreed ``(W, index)`` (default: this worker's own)."""
        K = _x_kernels(x)
        if K is None:
            return self.encode_reference(x, generator=generator, scale=scale)
        levels = self._levels_tensor(x.device)
        dt = K.code_dtype(self.bits)
        if scale is None:  # this worker's own norm and indices, chosen in the encode's pass
            W = _fast_norm(K, x, self.norm)
            words, flags = K.ms_encode_words(x, W, levels, self.code_bits, draw_key(generator), dt)
            _raise_flags(K, flags, x, W, self.norm)
        else:
            W, idx = self._fast_split(scale, x)
            codes, flags = K.ms_encode_int(x, W, levels, idx, draw_key(generator))
            _raise_flags(K, flags, x, W, self.norm, len(self.scales))
            words = ((idx.to(torch.int64) << self.code_bits) | (codes + self.levels[0])).to(dt)
        header = pack_header(self.header_format, x.numel(), W, device=x.device)
        return Payload(header=header, data=kernels_for(x).pack(words, self.bits))

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float]:
        return _frame(self, payload, numel, lambda n: packed_nbytes(n, self.bits))

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        K = _kernels(payload.data)
        if K is None:
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        n, W = self._frame(payload, numel)
        words = kernels_for(payload.data).unpack(payload.data, self.bits, n, K.code_dtype(self.bits))
        out, flags = K.ms_decode_words(words, self.code_bits, W, self._levels_tensor(words.device), _out_dtype(dtype))
        if int(flags):
            raise self._bad_index()
        return frame_output(self, out, W)

    def _bad_index(self) -> PayloadError:
        return PayloadError(self.name, f"scale indices, which must lie in 0..{len(self.scales) - 1}", "a larger one")

    # --- the float64 references -------------------------------------------------------------

    def shared_scale_reference(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        x64 = _as_float64(x)
        if len(agreed) == 0:
            W = _f32_up(_local_statistic(x64, self.norm))
            return torch.tensor([W], dtype=torch.float32, device=x.device)
        if len(agreed) != 1:
            raise ValueError(f"{type(self).__name__} has two scale rounds; agreed must hold 0 or 1 tensors, got {len(agreed)}")
        a = _ratios(x64, _norm_value(agreed[0], "agreed[0]"), self.norm)
        s_min = float(self.levels[0])
        idx = torch.zeros(a.shape, dtype=torch.uint8, device=x.device)
        for j, s in enumerate(self.levels):  # ascending: the last admissible scale wins (eq. 11)
            idx[(a * float(s)) <= s_min] = j
        return idx

    def encode_int_reference(self, x: torch.Tensor, scale, generator: torch.Generator | None = None) -> torch.Tensor:
        x64 = _as_float64(x)
        W, idx = self._split_scale(scale, x64.numel(), x64.device)
        t = _ratios(x64, W, self.norm) * self._levels_tensor(x64.device)[idx]
        if t.numel() and float(t.max()) > self.levels[0]:
            raise _level_error()
        return _signed(x64, round_to_int(t, "stochastic", generator))

    def decode_sum_reference(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
        n = _check_int_sum(int_sum, numel)
        m = check_world_size(world_size)
        W, idx = self._split_scale(scale, n, int_sum.device)
        out = int_sum.to(torch.float64) * W / self._levels_tensor(int_sum.device)[idx] / m
        return out.to(_out_dtype(dtype))

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        if scale is None:
            W = self.shared_scale_reference(x)
            scale = (W, self.shared_scale_reference(x, (W,)))
        W, idx = self._split_scale(scale, x.numel(), x.device)
        codes = self.encode_int_reference(x, (W, idx), generator)
        words = (idx << self.code_bits) | (codes + self.levels[0])
        header = pack_header(self.header_format, codes.numel(), W, device=x.device)
        return Payload(header=header, data=pack_wide(words, self.bits))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        n, W = self._frame(payload, numel)
        words = unpack_wide(payload.data, self.bits, n)
        if n and int((words >> self.code_bits).max()) >= len(self.scales):
            raise self._bad_index()
        codes = (words & ((1 << self.code_bits) - 1)) - self.levels[0]
        return frame_output(self, self.decode_sum_reference(codes, (W, words >> self.code_bits), 1, dtype=dtype), W)
