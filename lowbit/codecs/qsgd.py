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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, pack_header, unpack_header
from .packing import pack_wide, packed_nbytes, unpack_wide
from .quantize import INT32_MAX, check_int_range, finite_float64, round_to_int

__all__ = ["QSGDCodec", "float32_up"]

_F32_MAX = float(torch.finfo(torch.float32).max)


def float32_up(v: torch.Tensor, field: str = "norm") -> torch.Tensor:
    """Round non-negative float64 values up to float32 (the smallest float32
    ``>= v``), returned as float64. Scales sent as float32 are rounded this way
    so that ``|x_i| / scale <= 1`` still holds at the receiver's precision.
    Raises ValueError when a value does not fit float32."""
    v = v.to(torch.float64)
    if v.numel() and float(v.max()) > _F32_MAX:
        raise ValueError(f"the {field} {float(v.max()):.6g} does not fit the float32 sent on the wire")
    f = v.to(torch.float32)
    low = f.to(torch.float64) < v
    f = torch.where(low, torch.nextafter(f, torch.full_like(f, math.inf)), f)
    return f.to(torch.float64)


@dataclass(frozen=True)
class QSGDCodec(Codec):
    """QSGD with ``levels = s >= 1`` and an optional ``bucket`` size.

    Wire format. Each element becomes the code ``sign_i * xi_i + s`` in
    ``0..2s``, packed with :func:`~lowbit.codecs.packing.pack_wide` in
    ``code_bits = ceil(log2(2s + 1))`` bits.

    * ``bucket=None`` (one norm for the whole vector): header ``<if``
      (numel, norm as float32); data = the packed codes.
    * ``bucket=d``: header ``<i`` (numel); data = ``ceil(numel / d)`` norms as
      float32 (4 bytes each, one per bucket of ``d`` consecutive elements, the
      last one possibly shorter), then the packed codes.

    Each norm is rounded *up* to float32 before quantizing, and both ends use
    that float32 value, so the codec stays exactly unbiased (up to float64
    rounding) and every ``xi_i <= s``. A zero norm gives all-zero levels.
    ``bits`` is ``code_bits`` plus ``32 / bucket`` for the per-bucket norms.

    Arithmetic is float64; ``decode`` returns float32 unless ``dtype`` is
    given. Non-finite inputs, and norms beyond float32, raise ValueError.
    """

    levels: int
    bucket: int | None = None

    name = "qsgd"
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
        return float(self.code_bits) + (32.0 / self.bucket if self.bucket is not None else 0.0)

    def variance_bound(self, n: int) -> float:
        """Lemma 3.1's factor ``min(n / s^2, sqrt(n) / s)`` for vectors (or
        buckets) of ``n`` elements: ``E||Q(v) - v||^2 <= factor * ||v||^2``."""
        s = self.levels
        return min(n / s**2, math.sqrt(n) / s)

    def _num_buckets(self, n: int) -> int:
        return 1 if self.bucket is None else -(-n // self.bucket)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        n, x64 = finite_float64(x, "QSGD")
        s = self.levels
        if self.bucket is None:
            norms = float32_up(torch.linalg.vector_norm(x64).reshape(1))
            per_elem = norms.expand(n)
        else:
            k = self._num_buckets(n)
            padded = torch.nn.functional.pad(x64, (0, k * self.bucket - n)).view(k, self.bucket)
            norms = float32_up(torch.linalg.vector_norm(padded, dim=1))
            per_elem = norms.repeat_interleave(self.bucket)[:n]
        ratio = torch.where(per_elem > 0, x64.abs() / torch.where(per_elem > 0, per_elem, 1.0), 0.0)
        xi = round_to_int(ratio.clamp_(max=1.0) * s, "stochastic", generator).clamp_(0, s)
        codes = (torch.where(x64 < 0, -xi, xi) + s).to(torch.int64)
        data = pack_wide(codes, self.code_bits) if n else torch.empty(0, dtype=torch.uint8, device=x.device)
        if self.bucket is None:
            header = pack_header(self.header_format, n, float(norms[0]), device=x.device)
        else:
            header = pack_header(self.header_format, n, device=x.device)
            data = torch.cat([norms.to(torch.float32).contiguous().view(torch.uint8), data])
        return Payload(header=header, data=data)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        fields = unpack_header(self.header_format, payload.header)
        n = fields[0]
        data = payload.data
        if self.bucket is None:
            norms = torch.tensor([fields[1]], dtype=torch.float64, device=data.device)
            per_elem = norms.expand(n)
        else:
            k = self._num_buckets(n)
            need = 4 * k + packed_nbytes(n, self.code_bits)
            if data.numel() != need:
                raise ValueError(f"QSGD payload of {n} elements in {k} buckets needs {need} data bytes, got {data.numel()}")
            norms = data[: 4 * k].clone().view(torch.float32).to(torch.float64)
            data = data[4 * k:]
            per_elem = norms.repeat_interleave(self.bucket)[:n]
        codes = unpack_wide(data, self.code_bits, n) if n else torch.empty(0, dtype=torch.int64, device=data.device)
        x = (codes - self.levels).to(torch.float64) * (per_elem / self.levels)
        return x.to(torch.float32 if dtype is None else dtype)
