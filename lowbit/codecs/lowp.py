"""16-bit floats on the wire: the usual "half-precision communication" baseline.

``fp16`` (IEEE binary16): 11 significant bits, largest finite value 65504,
normal down to ``2^-14``, subnormal down to ``2^-24``. ``bf16`` (bfloat16):
8 significant bits, float32's exponent range. Casting rounds to nearest
(ties to even), a deterministic and hence biased rounding.

``encode`` is one pass (:mod:`lowbit.codecs.kernels.cpu_lowp` on the CPU,
:mod:`~lowbit.codecs.kernels.gpu_lowp` on CUDA): the cast, and in the same pass
a flag on any all-ones exponent in the 16-bit result (an inf or NaN: a
non-finite input or an overflow, told apart only on that error path);
``decode`` is one cast of the payload into a fresh float32 tensor or into the
caller's ``out=`` buffer (a codec that runs every step reuses one buffer and
saves the allocation and first touch of a new one, see :meth:`HalfCodec.decode`).
``encode_reference``/``decode_reference`` (a finiteness scan, the cast, an
overflow scan, copies) give the same bytes and values on every device.

How fast it can be on the CPU, against torch's ``fp16_compress_hook`` (whose
compute is ``x.to(float16)`` and ``buffer.copy_(h)``:
:class:`lowbit.bench.references.HalfReference`). Both directions are bound by
memory traffic, not arithmetic (the casts are F16C instructions, 16 lanes on
AVX-512). A round trip must read ``4n`` bytes and write ``2n`` (encode), then
read ``2n`` and write ``4n`` (decode): ``12n``, against a memcpy's ``4n + 4n``.
A plain store first reads the line it writes (read-for-ownership), so the
hook's two casts move ``18n`` and a memcpy ``12n``: no fp16 round trip can take
less than one memcpy, and the hook takes about 1.5. Being 2x faster than the
hook would need ``9n`` bytes, fewer than the round trip has to move: the 2x of
issue 10 is out of reach, at 1e6 and at 1e7 elements alike.

* Beyond the last-level cache (1e7 elements, 100 MB touched): the kernels
  stream their stores (nontemporal, no read-for-ownership, see
  :mod:`~lowbit.codecs.kernels.cpu_lowp`) and move the ``12n`` bytes: a round
  trip takes one memcpy (1.0-1.1x) and 0.69-0.78 of the hook, its floor being
  about 2/3.
* Inside it (1e6 elements, 10 MB): streamed stores would go to memory and be
  read back from there, so the kernels store plainly, like torch, and run as
  fast as torch's casts (the same instructions and the same traffic: 0.81 of
  the hook into kept buffers, torch's own two casts 0.84, the floor). What
  lowbit adds on top is per-call Python work, which runs with caches just
  emptied by the pass before it: mostly generic (``kernels_for`` twice,
  ``pack_header``, ``unpack_header``, ``Payload``), with this codec's own
  checks, one allocation and two kernel calls. The round trip ends at
  1.2-1.5x the hook there.

Figures and the commands that reproduce them: docs/RESULTS.md, "Codec
throughput against memcpy".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, frame_counted, pack_header
from .identity import bytes_as
from .kernels import empty_output, kernels_for
from .quantize import check_numel

__all__ = ["HalfCodec", "HALF_DTYPES", "check_out"]

_FAMILY = "lowp"
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_out(out, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A decode's ``out=`` buffer: a contiguous 1-D torch tensor of ``n`` elements, of the
    decode's ``dtype``, on ``device`` (the payload's); otherwise a ValueError or TypeError
    that names ``out`` and what it must be."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 1 or out.numel() != n:
        raise ValueError(f"out must be a 1-D tensor of the payload's {n} elements, got shape {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"out must have the decode's dtype {dtype} (dtype=, default float32), got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out must be on the payload's device {device}, got {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


@dataclass(frozen=True)
class HalfCodec(Codec):
    """Send ``x`` cast to ``fp16`` or ``bf16``: header ``<i`` (numel), data
    ``2 * numel`` bytes (the 16-bit values, native byte order).

    Errors, for ``x`` inside the format's normal range: relative
    ``|decode - x| <= 2^-11 |x|`` (fp16) or ``2^-8 |x|`` (bf16) (half an ulp).
    Below it, values become subnormal or zero: absolute error at most half the
    smallest subnormal (``2^-25`` for fp16, ``2^-134`` for bf16) -- tiny
    values are flushed, never an error. Above it (``|x| >= 65520`` for fp16,
    i.e. any value that would round to ``inf``) ``encode`` raises ValueError:
    nothing silently becomes ``inf``. Non-finite inputs raise ValueError too.
    ``decode`` returns float32 unless ``dtype`` is given.
    """

    dtype: str = "fp16"

    name = "fp16"
    float_wire = True
    replica_safe = True
    kernel_family = _FAMILY
    kind = CodecKind.PLAIN
    unbiased = False
    header_format = "i"

    def __post_init__(self) -> None:
        if self.dtype not in HALF_DTYPES:
            raise ValueError(f"dtype must be one of {tuple(HALF_DTYPES)}, got {self.dtype!r}")

    @property
    def bits(self) -> float:
        return 16.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return HALF_DTYPES[self.dtype]

    @property
    def rel_error(self) -> float:
        """Half an ulp relative to the value, in the normal range."""
        return 2.0**-11 if self.dtype == "fp16" else 2.0**-8

    @property
    def abs_error(self) -> float:
        """Largest error on values below the normal range (half the smallest subnormal)."""
        return 2.0**-25 if self.dtype == "fp16" else 2.0**-134

    def _overflow_error(self, x: torch.Tensor, h: torch.Tensor) -> ValueError:
        """The error for an ``x`` whose cast ``h`` holds inf or NaN (non-finite, or too large)."""
        if not bool(torch.isfinite(x).all()):
            return ValueError(f"x must be finite for the {self.dtype} codec")
        worst = float(x[torch.isinf(h)].abs().max())
        limit = float(torch.finfo(self.torch_dtype).max)
        return ValueError(
            f"x overflows {self.dtype}: |x| reaches {worst:.6g} but the largest {self.dtype} value is {limit:.6g}; "
            "scale x down or use another codec"
        )

    def cast(self, x: torch.Tensor, *, divisor: int | None = None, check: bool = True) -> torch.Tensor:
        """The 16-bit values :meth:`encode` sends for ``x``, without the header: for callers
        that send them themselves (the DDP hooks' all-reduce). ``divisor``: the values of
        ``x / divisor``, the quotient as torch computes it on ``x``'s device, in ``x``'s dtype
        (on the fast path in the same pass as the cast). ``check=False``: torch's cast,
        unchecked (an inf or NaN passes on); else :meth:`encode`'s errors.

        Fast path: one pass, the cast and a check of the 16-bit result's exponents: an inf or
        NaN there is a non-finite input or an overflow (told apart only on that error path)."""
        check_numel(x)
        K = kernels_for(x, _FAMILY)
        if K is None:
            share = x.detach() if divisor is None else x.detach() / divisor
            if not check:
                return share.to(self.torch_dtype)
            return self.encode_reference(share).data.view(self.torch_dtype)
        h, flagged = K.half_encode(x, self.torch_dtype, divisor=divisor, check=check)
        if flagged:
            raise self._overflow_error(x.detach() if divisor is None else x.detach() / divisor, h)
        return h

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """:meth:`cast`'s values of ``x`` behind the header."""
        h = self.cast(x)
        return Payload(header=pack_header(self.header_format, x.numel(), device=x.device), data=h.view(torch.uint8))

    def _check(self, payload: Payload, numel: int | None) -> int:
        """The frame: header, count (``numel``), ``2 n`` data bytes (PayloadError)."""
        return frame_counted(self, payload, numel, lambda n: 2 * n, lambda n: f"{n} {self.dtype} values")

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None, numel: int | None = None) -> torch.Tensor:
        """One cast of the payload's 16-bit floats (read in place when aligned) into a new
        tensor, or into ``out`` (a contiguous 1-D tensor of ``numel`` elements of the decode's
        dtype on the payload's device, checked), which is returned."""
        K = kernels_for(payload.data, _FAMILY)
        if K is None:
            return self.decode_reference(payload, dtype=dtype, out=out, numel=numel)
        n = self._check(payload, numel)
        dtype = torch.float32 if dtype is None else dtype
        if out is None:
            out = empty_output(n, dtype, payload.data.device)
        else:
            check_out(out, n, dtype, payload.data.device)
        return K.half_decode(bytes_as(payload.data, self.torch_dtype), out)

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The plain reference of :meth:`encode` (a finiteness scan, the cast, an overflow scan)."""
        n = check_numel(x)
        x = x.detach()
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"x must be finite for the {self.dtype} codec")
        h = x.to(self.torch_dtype)
        if bool(torch.isinf(h).any()):
            raise self._overflow_error(x, h)
        data = h.contiguous().view(torch.uint8).clone()
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=data)

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         out: torch.Tensor | None = None, numel: int | None = None) -> torch.Tensor:
        """The plain reference of :meth:`decode` (with ``out``: the result copied into it)."""
        n = self._check(payload, numel)
        dtype = torch.float32 if dtype is None else dtype
        if out is not None:
            check_out(out, n, dtype, payload.data.device)
        x = payload.data.clone().view(self.torch_dtype).to(dtype)
        return x if out is None else out.copy_(x)
