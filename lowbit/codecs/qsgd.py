"""QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient
SGD via Gradient Quantization and Encoding", NeurIPS 2017), the stochastic
quantizer ``Q_s`` of Section 3.1.

For a vector (or a bucket of it) ``v`` with ``||v||_2 > 0`` and ``s`` levels:

    Q_s(v_i) = ||v||_2 * sign(v_i) * xi_i / s,

where ``xi_i`` is ``|v_i| / ||v|| * s`` stochastically rounded to one of its
two neighbouring integers, so ``E[Q_s(v)] = v`` (unbiased) and (Lemma 3.1)

    E ||Q_s(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2    (n = len(v)).

The paper's Elias coding of the levels is not done here; the levels are sent
at a fixed width, and :mod:`lowbit.codecs.entropy` can compress them further.

Arithmetic (the reference, ``encode_reference``/``decode_reference``, float64):
``norm_j = sqrt(sum of x_i^2 over bucket j)``, the squares added in the CPU kernels'
fixed order (:func:`~lowbit.codecs.quantize.lane_sums_reference`: 8 interleaved
float64 lanes from the bucket's start, added pairwise), rounded up to float32; ``xi_i`` is the stochastic rounding (counter
uniforms, :mod:`lowbit.codecs.rng`) of ``min(|x_i| f_j, s)`` with ``f_j =
s / norm_j`` computed once per bucket; the decode is ``(code - s) (norm_j / s)``.
The CPU fast path (numba, :mod:`.kernels.cpu_qsgd`) performs the same float64
operations element by element: the same bytes and decodes exactly. The CUDA
fast path (Triton) computes in float32 for float32/half input (float64 for
float64): the sums of squares are accumulated in float64 (block partial sums
added atomically, so in no fixed order: the norm may differ from the
reference's in its last float64 bits, which changes the float32 norm only
when the exact one lies within ~1e-16 relative of a float32 boundary), a level
may differ from the reference's by one on a tiny fraction of elements (the
float32 rounding of ``|x_i| f_j``), and the code stays unbiased up to that
rounding: ``|E[Q(v_i)] - v_i| <= 2 eps32 |v_i|`` (``eps32 = 2^-24``) plus the
uniforms' ``2^-24`` of a step.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from .base import Codec, CodecKind, Payload, frame_count, frame_header, frame_nbytes, frame_output, frame_scale, \
    frame_scales, pack_header
from .kernels import kernels_for
from .radix import level_bits, levels_nbytes, pack_levels, pack_levels_fast, unpack_levels, unpack_levels_fast
from .quantize import INT32_MAX, check_int_range, check_numel, finite_float64, lane_sums_reference, round_to_int
from .rng import draw_key

__all__ = ["QSGDCodec", "float32_up", "round_up_float32", "exact_ratio"]

_F32_MAX = float(torch.finfo(torch.float32).max)


def round_up_float32(v: torch.Tensor) -> torch.Tensor:
    """The smallest float32 values ``>= v`` (non-negative), as float32 (inf beyond the
    float32 range), on ``v``'s device without a host read."""
    f = v.to(torch.float32)
    return torch.where(f.to(v.dtype) < v, torch.nextafter(f, torch.full_like(f, math.inf)), f)


def float32_up(v: torch.Tensor, field: str = "norm") -> torch.Tensor:
    """Round non-negative float64 values up to float32 (the smallest float32
    ``>= v``), returned as float64. Scales sent as float32 are rounded this way
    so that ``|x_i| / scale <= 1`` still holds at the receiver's precision.
    Raises ValueError when a value does not fit float32."""
    v = v.to(torch.float64)
    if v.numel() and float(v.max()) > _F32_MAX:
        raise ValueError(f"x is out of the codec's range: the {field} {float(v.max()):.6g} does not fit the float32 "
                         "sent on the wire")
    return round_up_float32(v).to(torch.float64)


def exact_ratio(num: float, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` element-wise in float64, 0 where ``den == 0`` (``den >= 0``), correctly
    rounded (numpy's division; torch's ``scalar / tensor`` multiplies by a rounded
    reciprocal), on ``den``'s device. The per-part factors of the references and of the
    CPU fast path: one computation, passed to both."""
    d = den.detach().to(torch.float64).cpu().numpy()
    r = np.zeros_like(d)
    np.divide(float(num), d, out=r, where=d > 0)
    return torch.from_numpy(r).to(den.device)


def scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """Scales as little-endian float32 bytes (a CPU uint8 tensor)."""
    return torch.from_numpy(scales.detach().cpu().numpy().astype("<f4").view(np.uint8).copy())


def float32_header(n: int, scales32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header <if: (n, scales32[0]), scales32[1:] as bytes)`` built on the scales' device
    from the values already there (no host read; little-endian host, as torch's CPU)."""
    head = torch.full((1,), n, dtype=torch.int32, device=scales32.device).view(torch.uint8)
    return torch.cat([head, scales32[:1].view(torch.uint8)]), scales32[1:].view(torch.uint8)


@dataclass(frozen=True)
class QSGDCodec(Codec):
    """QSGD with ``levels = s >= 1`` and an optional ``bucket`` size.

    Wire format. Each element becomes the code ``sign_i * xi_i + s`` in
    ``0..2s``; the ``2s + 1`` levels are packed by :func:`~lowbit.codecs.radix.pack_levels`
    (mixed radix at about ``log2(2s + 1)`` bits for ``2s + 1 <= 2^16``, e.g. 1.6 bits for
    ``s = 1``; ``code_bits = ceil(log2(2s + 1))`` bits each beyond).

    * ``bucket=None`` (one norm for the whole vector): header ``<if``
      (numel, norm as float32); data = the packed codes.
    * ``bucket=d``: header ``<i`` (numel); data = ``ceil(numel / d)`` norms as
      float32 (4 bytes each, one per bucket of ``d`` consecutive elements, the
      last one possibly shorter), then the packed codes.

    Each norm is rounded *up* to float32 before quantizing, and both ends use
    that float32 value, so the codec stays exactly unbiased (up to float64
    rounding) and every ``xi_i <= s``. A zero norm gives all-zero levels.
    ``bits`` is :func:`~lowbit.codecs.radix.level_bits` ``(2s + 1)`` (the codes' bits per
    element on the wire) plus ``32 / bucket`` for the per-bucket norms.

    Arithmetic is float64; ``decode`` returns float32 unless ``dtype`` is
    given. Non-finite inputs, and norms beyond float32, raise ValueError (the range:
    finite ``x`` whose bucket norms fit float32; the decode is within ``+-norm``). A
    payload whose norms are not finite, negative or beyond float32, or whose data
    length does not match its count, is a PayloadError.
    """

    levels: int
    bucket: int | None = None

    name = "qsgd"
    gatherable = True
    kernel_family = "qsgd"
    kind = CodecKind.PLAIN
    unbiased = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", check_int_range(self.levels, "levels", 1, INT32_MAX))
        if self.bucket is not None:
            object.__setattr__(self, "bucket", check_int_range(self.bucket, "bucket", 1, INT32_MAX))

    @property
    def header_format(self) -> str:  # type: ignore[override]
        return "if" if self.bucket is None else "i"

    @property
    def code_bits(self) -> int:
        """Width of one packed (sign, level) code: ``ceil(log2(2s + 1))``."""
        return (2 * self.levels).bit_length()

    @property
    def bits(self) -> float:
        return level_bits(self.num_codes) + (32.0 / self.bucket if self.bucket is not None else 0.0)

    @property
    def num_codes(self) -> int:
        """Number of codes, ``2s + 1``."""
        return 2 * self.levels + 1

    def variance_bound(self, n: int) -> float:
        """Lemma 3.1's factor ``min(n / s^2, sqrt(n) / s)`` for vectors (or
        buckets) of ``n`` elements: ``E||Q(v) - v||^2 <= factor * ||v||^2``."""
        s = self.levels
        return min(n / s**2, math.sqrt(n) / s)

    def _num_buckets(self, n: int) -> int:
        return 1 if self.bucket is None else -(-n // self.bucket)

    def _bucket(self, n: int) -> int:
        return max(1, n) if self.bucket is None else self.bucket

    def _frame(self, payload: Payload, numel: int | None) -> int:
        """The payload's count, its header and count checked (PayloadError)."""
        fields = frame_header(self, payload)
        frame_count(self, fields[0], numel)
        if self.bucket is None:
            frame_scale(self, fields[1], "norm", _F32_MAX)
        return fields[0]

    def _norms_of(self, payload: Payload, n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(float32 norms, packed codes, largest norm)`` of a payload whose header :meth:`_frame`
        checked, on the data's device, the data's length and the norms checked (PayloadError)."""
        data = payload.data
        if self.bucket is None:
            frame_nbytes(self, data, levels_nbytes(n, self.num_codes), lambda: f"{n} codes of {self.num_codes} levels")
            norm = payload.header[4:8].to(data.device).clone().view(torch.float32)
            return norm, data, struct.unpack("<f", payload.header[4:8].cpu().numpy().tobytes())[0]
        k = self._num_buckets(n)
        frame_nbytes(self, data, 4 * k + levels_nbytes(n, self.num_codes),
                     lambda: f"{k} bucket norms and {n} codes of {self.num_codes} levels")
        norms = data[: 4 * k].clone().view(torch.float32)
        return norms, data[4 * k:], frame_scales(self, norms, "bucket norm", _F32_MAX)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """``Q_s`` of each bucket: norms (rounded up to float32), then the codes."""
        n = check_numel(x)
        K = kernels_for(x, self.kernel_family)
        if K is None or n == 0:
            return self.encode_reference(x, generator=generator)
        bucket = self._bucket(n)
        sq, finite = K.qsgd_sumsq(x, bucket)
        norms32 = round_up_float32(torch.sqrt(sq))
        finite, nmax = K.host_values(finite, norms32.max())  # the one host read on CUDA
        if not finite:
            raise ValueError("x must be finite for the QSGD codec")
        if not math.isfinite(nmax):
            raise ValueError(f"x is out of the QSGD codec's range: the norm {float(torch.sqrt(sq).max()):.6g} does not "
                             "fit the float32 sent on the wire")
        codes = K.qsgd_encode(x, K.ratio(self.levels, norms32), bucket, self.levels, self.code_bits,
                              draw_key(generator))
        packed = pack_levels_fast(codes, self.num_codes)
        if self.bucket is None:
            header, _ = float32_header(n, norms32)
            return Payload(header=header, data=packed)
        header = torch.full((1,), n, dtype=torch.int32, device=x.device).view(torch.uint8)
        return Payload(header=header, data=torch.cat([norms32.view(torch.uint8), packed]))

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        """``(code - s) norm / s``."""
        n = self._frame(payload, numel)
        K = kernels_for(payload.data, self.kernel_family)
        if K is None or n == 0:
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        norms32, data, top = self._norms_of(payload, n)
        codes = unpack_levels_fast(data, self.num_codes, n, K.code_dtype(self.code_bits), codec=self.name)
        return frame_output(self, K.qsgd_decode(codes, norms32.to(torch.float64) / self.levels, self._bucket(n),
                                                self.levels, torch.float32 if dtype is None else dtype), top)

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (same bytes on the CPU)."""
        n, x64 = finite_float64(x, "QSGD")
        s = self.levels
        bucket = self._bucket(n)
        norms = float32_up(torch.sqrt(lane_sums_reference(x64 * x64, bucket))) if n else \
            torch.zeros(self._num_buckets(n), dtype=torch.float64, device=x.device)
        factor = exact_ratio(s, norms).repeat_interleave(bucket)[:n]  # s / norm, 0 for a zero bucket
        xi = round_to_int((x64.abs() * factor).clamp_(max=s), "stochastic", generator)
        codes = (torch.where(x64 < 0, -xi, xi) + s).to(torch.int64)
        data = pack_levels(codes, self.num_codes) if n else torch.empty(0, dtype=torch.uint8, device=x.device)
        if self.bucket is None:
            header = pack_header(self.header_format, n, float(norms[0]), device=x.device)
        else:
            header = pack_header(self.header_format, n, device=x.device)
            data = torch.cat([norms.to(torch.float32).contiguous().view(torch.uint8), data])
        return Payload(header=header, data=data)

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n = self._frame(payload, numel)
        norms32, data, top = self._norms_of(payload, n)
        step = (norms32.to(torch.float64) / self.levels).repeat_interleave(self._bucket(n))[:n]
        codes = unpack_levels(data, self.num_codes, n, codec=self.name) if n else \
            torch.empty(0, dtype=torch.int64, device=data.device)
        x = (codes - self.levels).to(torch.float64) * step
        return frame_output(self, x.to(torch.float32 if dtype is None else dtype), top)
