"""Bagua's ``MinMaxUInt8`` quantizer, computed as Bagua's CUDA kernel computes it.

For one bucket ``x`` (float32) with ``lo = min(x)``, ``hi = max(x)``::

    scale = 255 / (hi - lo + 1e-7)
    upper = rint(hi * scale);  lower = upper - 255
    code  = min(rint(x * scale), upper) - lower          (uint8)
    x^    = (code + lower) / scale

every operation in float32 (``rint``: round half to even). The grid is anchored
at 0, not at ``lo``: a level is ``rint(x * scale)``, and the codes are those
levels offset by ``lower``. So an exact zero is decoded as an exact zero
whenever ``lo <= 0 <= hi``, and the round trip differs from lowbit's
``minmax`` codec (grid anchored at ``lo``, float64, no epsilon) by about one
grid step on many elements. Bagua clamps the level at the top only
(``min(level, upper)``); a level below ``lower`` can arise only by float
rounding of ``hi * scale - lo * scale`` past 255, where the GPU's float to
uint8 conversion saturates to 0; here that saturation is explicit.

Wire layout (what Bagua's kernel puts in one message, ``n`` elements): a
32-byte block that opens with ``min`` and ``max`` as float32, then ``align32(n)``
code bytes (``align32(n)``: n rounded up to a multiple of 32, the padding codes
0). Bagua leaves the block's other 24 bytes unused; lowbit writes the element
count there (int32, then 20 zero bytes), so the payload is self-describing
at Bagua's exact size, ``32 + align32(n)`` bytes.

Everything is vectorised torch on the input's device: ``encode`` never reads a
value back to the host (a non-finite ``x`` is caught by an asynchronous device
assert on CUDA, a ValueError on the CPU), and ``decode(payload, numel=n)`` does
not either (without ``numel`` it reads the count from the header: one host read).
No float64 copy is made; a float64 input is quantized in float32, as Bagua's
kernel supports float32 (and float16) only.

Range: finite ``x`` whose grid Bagua's float32 arithmetic can hold: ``hi - lo``, ``scale``,
``hi * scale``, ``lo * scale`` and the decoded ends ``lower / scale``, ``(lower + 255) / scale``
all finite (:meth:`BaguaMinMaxCodec.grid_ok`; a constant bucket of 3e38 and the range
+-3.4e38 are outside it). Encode raises ValueError naming ``x`` beyond it (an asynchronous
device assert on CUDA); a payload whose ``min``/``max`` are outside it or out of order, or
whose count or code length do not match, is a PayloadError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import Codec, CodecKind, Payload, PayloadError, check_numel_arg, frame_count, frame_header, frame_nbytes
from .quantize import check_numel

__all__ = ["BaguaMinMaxCodec", "align32", "BAGUA_EPS", "BAGUA_BLOCK_BYTES"]

BAGUA_EPS = float(np.float32(1e-7))  # Bagua's ``const float eps = 1e-7``, exactly as float32
BAGUA_BLOCK_BYTES = 32  # the min/max block of one message
LEVELS = 255


#: With ``lo <= hi`` both within this, Bagua's grid is finite: ``hi - lo + eps`` lies in
#: ``[1e-7, 2e28]``, so ``scale`` in ``[1.2e-26, 2.6e9]``, ``|lo|, |hi| * scale <= 2.6e37`` and the
#: decoded ends within ``3e28``, all below float32's 3.4e38 (:meth:`BaguaMinMaxCodec.grid_ok_host`).
_SAFE_END = 1e28


def align32(n: int) -> int:
    """``n`` rounded up to a multiple of 32 (Bagua's alignment of the code bytes)."""
    return (n + 31) // 32 * 32


@dataclass(frozen=True)
class BaguaMinMaxCodec(Codec):
    """Bagua's MinMaxUInt8 (see the module docstring). 8 bits, deterministic
    (nearest, half to even), biased; one min and max per call (one bucket)."""

    name = "bagua-minmax"
    kind = CodecKind.PLAIN
    unbiased = False
    header_format = "ffi20x"  # min, max (float32), numel (int32), 20 bytes unused: Bagua's 32-byte block

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 8

    @staticmethod
    def grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, lower) from float32 ``lo`` and ``hi`` (0-d tensors), as Bagua's kernel."""
        scale = LEVELS / (hi - lo + BAGUA_EPS)
        lower = torch.round(hi * scale) - LEVELS
        return scale, lower

    @classmethod
    def grid_ok(cls, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor: ``lo <= hi`` and every float32 quantity of the grid finite (the
        codec's range, module docstring): ``hi - lo``, ``scale``, ``lo * scale``, ``hi * scale``
        and the decodes of codes 0 and 255. On ``lo``'s device, no host read."""
        scale, lower = cls.grid(lo, hi)
        vals = torch.stack([hi - lo, scale, lo * scale, hi * scale, lower / scale, (lower + LEVELS) / scale])
        return (lo <= hi) & torch.isfinite(vals).all()

    @staticmethod
    def grid_ok_host(lo: float, hi: float) -> bool:
        """:meth:`grid_ok` of float32 values held on the host, in numpy's float32 scalars: the same
        IEEE float32 operations as torch's (``LEVELS / t`` is torch's ``t.reciprocal() * LEVELS``;
        ``np.round`` rounds half to even as ``torch.round``), in a few microseconds where torch's 0-d
        tensor operations took about fifty, a decode's whole fixed cost."""
        if -_SAFE_END <= lo <= hi <= _SAFE_END:
            return True  # every quantity is finite there (see _SAFE_END): nothing to compute
        lo32, hi32, levels = np.float32(lo), np.float32(hi), np.float32(LEVELS)
        with np.errstate(all="ignore"):
            scale = (np.float32(1) / (hi32 - lo32 + np.float32(BAGUA_EPS))) * levels
            lower = np.round(hi32 * scale) - levels
            vals = (hi32 - lo32, scale, lo32 * scale, hi32 * scale, lower / scale, (lower + levels) / scale)
        return bool(lo32 <= hi32) and all(np.isfinite(v) for v in vals)

    def _range_error(self, lo: float, hi: float) -> ValueError:
        return ValueError(f"x is out of Bagua's min-max codec's range: its range [{lo:.6g}, {hi:.6g}] does not give "
                          "a finite float32 grid (hi - lo, scale = 255 / (hi - lo + 1e-7), hi * scale and the decoded "
                          "ends must all be finite)")

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        n = check_numel(x)
        dev = x.device
        count = torch.full((1,), n, dtype=torch.int32, device=dev).view(torch.uint8)  # a fill, not a host copy
        if n == 0:
            header = torch.cat([torch.zeros(8, dtype=torch.uint8, device=dev), count,
                                torch.zeros(20, dtype=torch.uint8, device=dev)])
            return Payload(header=header, data=torch.empty(0, dtype=torch.uint8, device=dev))
        x32 = x.detach().to(torch.float32)  # no copy when x is float32 already
        lo, hi = torch.aminmax(x32)
        if dev.type == "cpu":
            lo_f, hi_f = float(lo), float(hi)
            if not (np.isfinite(lo_f) and np.isfinite(hi_f)):
                raise ValueError(f"x must be finite for Bagua's min-max codec, got range [{lo_f}, {hi_f}]")
            if not self.grid_ok_host(lo_f, hi_f):
                raise self._range_error(lo_f, hi_f)
        else:
            ok = torch.isfinite(lo) & torch.isfinite(hi) & self.grid_ok(lo, hi)
            torch._assert_async(ok, "x must be finite and within the range of Bagua's min-max codec")
        scale, lower = self.grid(lo, hi)
        level = torch.minimum(torch.round(x32 * scale), lower + LEVELS)  # Bagua: min(level, upper)
        data = torch.zeros(align32(n), dtype=torch.uint8, device=dev)
        data[:n] = (level - lower).clamp_(min=0).to(torch.uint8)
        header = torch.cat([torch.stack([lo, hi]).view(torch.uint8), count,
                            torch.zeros(20, dtype=torch.uint8, device=dev)])
        return Payload(header=header, data=data)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, numel: int | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded bucket (float32 unless ``dtype``). ``numel``: the element count the
        receiver expects (no host read; checked against the code length); None reads it
        from the header."""
        if payload.header.numel() != BAGUA_BLOCK_BYTES:
            raise PayloadError(self.name, f"a {BAGUA_BLOCK_BYTES}-byte opening block (Bagua's)",
                               f"{payload.header.numel()} bytes")
        if check_numel_arg(numel) is not None:
            frame_nbytes(self, payload.data, align32(numel), lambda: f"align32({numel}) codes")
        if numel is None or payload.header.device.type == "cpu":  # a host header: read it
            lo, hi, n = frame_header(self, payload)
            numel = frame_count(self, n, numel)
            if numel and not self.grid_ok_host(lo, hi):
                raise PayloadError(self.name, "min <= max giving a finite float32 grid (the codec's range)",
                                   f"[{lo!r}, {hi!r}]")
            frame_nbytes(self, payload.data, align32(numel), lambda: f"align32({numel}) codes")
        out_dtype = torch.float32 if dtype is None else dtype
        if numel == 0:
            return torch.empty(0, dtype=out_dtype, device=payload.data.device)
        lohi = payload.header[:8].clone().view(torch.float32).to(payload.data.device)
        if payload.header.device.type != "cpu":  # a device header with numel given: checked without a host read
            torch._assert_async(self.grid_ok(lohi[0], lohi[1]), "malformed bagua_minmax payload: min/max outside "
                                "the codec's range")
        scale, lower = self.grid(lohi[0], lohi[1])
        x = (payload.data[:numel].to(torch.float32) + lower) / scale
        return x.to(out_dtype)
