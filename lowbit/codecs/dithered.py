"""Dithered quantization of stochastic gradients, DQSG ("Nested Dithered
Quantization for Communication Reduction in Distributed Training", ICLR 2019
submission): section 2.1, section 3.1 eq. (2) and (4), Lemma 2, Lemma 3,
Algorithm 1.

The vector ``x`` is split into ``K`` contiguous parts of near-equal length
(eq. 4; ``K = 1`` is eq. 2). Part ``j`` is scaled by ``kappa_j = ||x_j||_inf``
and quantized with step ``Delta = 1/M`` after adding a dither
``u ~ U[-Delta/2, Delta/2)`` that the receiver regenerates from a shared seed:

    q = round(x / kappa / Delta + u / Delta)          (integer index, Remark 1)
    subtractive:    x~ = kappa * (Delta * q - u)      (eq. 2, Algorithm 1)
    half-dithered:  x~ = kappa *  Delta * q           (section 2.1, Lemma 2)

Index range. ``|x / kappa| <= 1`` and ``u / Delta`` lies in ``[-1/2, 1/2)``, so
with rounding half up (``round(w) = floor(w + 1/2)``) the index is
``floor(x / (kappa Delta) + r)`` with ``r = u / Delta + 1/2`` in ``[0, 1)``, which
lies in ``{-M, ..., M}``: exactly the paper's ``2M + 1`` levels, sent as
``q + M`` at about ``log2(2M + 1)`` bits each (mixed radix, :mod:`lowbit.codecs.radix`;
see Wire format). (Float rounding of
``x/kappa*M + r`` can reach ``M + 1`` when ``r`` is within ``2^-52`` of 1; those
indices are clamped to ``M``, an event of probability about ``2^-52``.)

Error. Subtractive: by Schuchman's theorem (Theorem 1; the integer grid never
overloads) ``(x~ - x) / kappa`` is uniform on ``[-Delta/2, Delta/2]`` and
independent of ``x``, so ``x~`` is unbiased and ``E||x~ - x||^2 =
sum_j n_j kappa_j^2 Delta^2 / 12`` (Lemma 3; ``n Delta^2 kappa^2 / 12`` for
``K = 1``). Half-dithered: the index is stochastic rounding of ``x/(kappa Delta)``
(Lemma 2: QSGD's quantizer, TernGrad for ``M = 1``), so ``x~`` is also
unbiased, but its error depends on the input: its variance is
``kappa^2 Delta^2 f (1 - f)`` with ``f`` the fractional part of
``x / (kappa Delta)``, between 0 and ``kappa^2 Delta^2 / 4``.

Shared randomness. The dither is ``u = (r - 1/2) Delta`` with ``r_i`` the
counter uniforms (:mod:`lowbit.codecs.rng`) of ONE key drawn from
``generator`` by ``encode``: 24-bit uniforms on ``[0, 1 - 2^-24]``, so the
dither is uniform up to a 2^-24 grid of the step (Theorem 1 and the
unbiasedness hold up to 2^-24 of a step). The receiver must pass ``decode`` a
generator of the same kind (same device) seeded identically, e.g. both ends
call ``shared_generator(run_seed, step, sender)`` from :mod:`lowbit.codecs.rng`;
``decode`` draws the same key and regenerates ``r_i`` element by element
(no tensor of uniforms is drawn). A generator from another seed gives a
silently wrong decode (the error is then a difference of two independent
dithers, not bounded by ``kappa Delta / 2``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .base import Codec, CodecKind, Payload, check_flat, frame_count, frame_header, frame_nbytes, frame_output, \
    frame_scale, frame_scales, pack_header
from .kernels import kernels_for
from .radix import level_bits, levels_nbytes, pack_levels, pack_levels_fast, unpack_levels, unpack_levels_fast
from .qsgd import exact_ratio, float32_header, round_up_float32, scale_bytes
from .quantize import INT32_MAX, check_int_range, check_numel
from .rng import counter_uniforms, draw_key

__all__ = ["DitheredCodec", "partition_sizes"]

_MAX_LEVELS = 2**31 - 1  # 2M + 1 codes must fit the 32-bit packing
_F32_MAX = float(np.finfo(np.float32).max)


def partition_sizes(n: int, parts: int) -> list[int]:
    """Lengths of the contiguous parts of eq. (4): ``min(parts, n)`` parts, the
    first ``n % parts`` of them one element longer (as ``torch.tensor_split``)."""
    p = min(parts, n)
    if p == 0:
        return []
    base, extra = divmod(n, p)
    return [base + 1] * extra + [base] * (p - extra)


def _uniforms(n: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """``r_0..r_{n-1}`` in ``[0, 1)``, float64 on ``device``: the counter uniforms of one key
    drawn from ``generator`` (torch's global generator if None), as the kernels draw them."""
    return counter_uniforms(draw_key(generator), n, device, torch.float64)


_float32_up = round_up_float32  # the name lowbit.algorithms.dqsg imports


def _scale_error(worst: float | None, limit: float = _F32_MAX) -> ValueError:
    got = "a non-finite element" if worst is None else f"max |x| = {worst}"
    return ValueError(f"x must be finite with |x| within the float32 range for the dithered codec: at most "
                      f"{limit:.9g} (a decode reaches |x| (M + 1/2) / M), got {got}")


@dataclass(frozen=True)
class DitheredCodec(Codec):
    """DQSG (eq. 2 / eq. 4): ``levels`` = M (step ``Delta = 1/M``, indices
    ``-M..M``), ``subtractive`` (True: the receiver subtracts the dither;
    False: half-dithered), ``partitions`` = K (one float32 scale per part).

    ``encode(x, generator=g)``: ``g`` supplies the dither; it is required when
    ``subtractive`` (otherwise the receiver could not regenerate it) and
    optional for half-dithered codecs (None: torch's global generator).

    ``decode(payload, generator=g2, dtype=None)``: kind is PLAIN (no reference
    model is needed) but a subtractive decode *needs* ``g2``, a generator of the
    same kind built from the same seed as the sender's ``g`` and not yet drawn
    from (ValueError without one). Half-dithered decodes ignore ``generator``.
    ``roundtrip(x, generator=g)`` handles this itself: it decodes with a copy
    of ``g`` taken before encoding.

    See the module docstring for the wire format and the error laws.

    Wire format. Header ``<if``: (numel, kappa_1) with kappa_1 the first part's
    scale as float32 (8 bytes, whatever ``K``). Data: the other ``min(K, n) - 1``
    scales as little-endian float32 (4 bytes each; empty for ``K = 1``), then the
    ``n`` codes ``q + M`` of ``2M + 1`` levels packed by
    :func:`~lowbit.codecs.radix.pack_levels`: mixed radix for ``2M + 1 <= 2^16`` (e.g.
    5 trits per byte for ``M = 1``, 1.6 bits; within 1% of ``log2(2M + 1)`` bits),
    ``ceil(log2(2M + 1))`` bits each beyond. So ``nbytes = 8 + 4 (min(K, n) - 1) + levels_nbytes(n, 2M + 1)``
    for ``n >= 1`` and 8 for ``n = 0``; ``bits`` is
    :func:`~lowbit.codecs.radix.level_bits` ``(2M + 1)``, the same count. When ``K > n``
    there are ``n`` parts of one element each.

    Scales are rounded *up* to float32 on the sender, and both ends use the
    float32 value. The index is ``q = clamp(floor(x s + r), -M, M)`` with
    ``s = M / kappa`` computed once per part (correctly rounded), and the
    reconstruction ``(kappa / M) (q - (r - 1/2))``. Non-finite inputs, or scales
    beyond the float32 range, raise ValueError. ``decode`` returns float32 unless
    ``dtype`` is given.

    Range. A decode reaches ``kappa (M + 1/2) / M`` (subtractive: ``q = +-M`` less the dither)
    or ``kappa`` (half-dithered), so ``encode`` takes finite ``x`` whose part scales, rounded up
    to float32, are at most :attr:`DitheredCodec.scale_limit` (float32's largest value times
    ``M / (M + 1/2)`` when subtractive), and raises ValueError naming ``x`` beyond: the float32
    decode is never inf. A payload whose scales are not finite, negative or beyond that
    limit, or whose data length does not match its count, is a PayloadError.

    Fast path and reference. ``encode_reference``/``decode_reference`` compute
    in float64 on whole tensors; the CPU fast path (numba, :mod:`.kernels.cpu_dithered`)
    runs the same operations in float64 registers, one element at a time, and
    gives the same bytes and decodes exactly. The CUDA fast path
    (:mod:`.kernels.gpu_dithered`, Triton) computes in float32 for float32/half
    input (float64 for float64): an index may then differ from the reference's
    by one on a tiny fraction of elements, and the subtractive error bound
    ``|x~ - x| <= kappa Delta / 2`` holds with the slack ``4 eps32 kappa (M + 1) / M``
    (``eps32 = 2^-24``: relative rounding of ``x s``, of ``x s + r`` and of
    ``q - r + 1/2`` and the product by ``kappa / M``, each at most ``eps32`` of
    a value of magnitude at most ``M + 1``, in units of the step ``kappa / M``).
    """

    levels: int
    subtractive: bool = True
    partitions: int = 1

    name = "dithered"
    gatherable = True
    kernel_family = "dithered"

    @property
    def dither_on_decode(self) -> bool:  # type: ignore[override]
        return self.subtractive
    kind = CodecKind.PLAIN
    unbiased = True  # both variants: subtractive by Theorem 1, half-dithered by Lemma 2
    header_format = "if"

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", check_int_range(self.levels, "levels", 1, _MAX_LEVELS))
        if not isinstance(self.subtractive, (bool, np.bool_)):
            raise ValueError(f"subtractive must be a bool, got {self.subtractive!r}")
        object.__setattr__(self, "subtractive", bool(self.subtractive))
        object.__setattr__(self, "partitions", check_int_range(self.partitions, "partitions", 1, INT32_MAX))

    # --- derived quantities ------------------------------------------------------

    @property
    def step(self) -> float:
        """``Delta = 1/M`` (relative to each part's scale ``kappa``)."""
        return 1.0 / self.levels

    @property
    def scale_limit(self) -> float:
        """The largest part scale (float32) this codec sends or accepts: float32's largest value,
        times ``M / (M + 1/2)`` when subtractive (a decode reaches ``kappa (M + 1/2) / M``)."""
        return _F32_MAX * self.levels / (self.levels + 0.5) if self.subtractive else _F32_MAX

    @property
    def num_codes(self) -> int:
        """Number of quantization indices, ``2M + 1``."""
        return 2 * self.levels + 1

    @property
    def bits(self) -> float:
        """Bits per index on the wire, :func:`~lowbit.codecs.radix.level_bits` ``(2M + 1)``:
        ``log2(2M + 1)`` within 1% where mixed radix applies (1.6 for ``M = 1``), else
        ``ceil(log2(2M + 1))`` (the scales, 32 bits per part, come on top)."""
        return level_bits(self.num_codes)

    @property
    def code_bits(self) -> int:
        """Width of one unpacked index, ``ceil(log2(2M + 1))`` (the kernels' code dtype)."""
        return (2 * self.levels).bit_length()

    def data_nbytes(self, n: int) -> int:
        """Bytes of ``payload.data`` for ``n`` elements."""
        if n == 0:
            return 0
        return 4 * (min(self.partitions, n) - 1) + levels_nbytes(n, self.num_codes)

    def dither(self, n: int, generator: torch.Generator | None, device=None) -> torch.Tensor:
        """The dither ``u / kappa`` in ``[-Delta/2, Delta/2)`` that ``encode`` draws from
        ``generator`` (float64, on ``device``, default the generator's)."""
        device = device if device is not None else (generator.device if generator is not None else "cpu")
        return (_uniforms(n, generator, device) - 0.5) / self.levels

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """Per-part scales ``kappa_j = ||x_j||_inf`` rounded up to float32, as float64
        (the values that travel on the wire)."""
        check_flat(x)
        return self._scales(x.detach().to(torch.float64)).to(torch.float64)

    def expected_sq_error(self, x: torch.Tensor) -> float:
        """``E||decode(encode(x)) - x||^2`` over the dither, for this ``x``.

        Subtractive (Lemma 3, exact by Theorem 1): ``sum_j n_j kappa_j^2 Delta^2 / 12``.
        Half-dithered: ``sum_i kappa_i^2 Delta^2 f_i (1 - f_i)``, ``f_i = frac(x_i / (kappa_i Delta))``.
        """
        check_flat(x)
        x64 = x.detach().to(torch.float64)
        if x64.numel() == 0:
            return 0.0
        kap = self._expand(self._scales(x64).to(torch.float64), x64.numel())
        if self.subtractive:
            return float((kap**2).sum()) * self.step**2 / 12
        w = torch.where(kap > 0, x64 / torch.where(kap > 0, kap, 1.0), 0.0) * self.levels
        f = w - torch.floor(w)
        return float((kap**2 * f * (1 - f)).sum()) * self.step**2

    # --- helpers -----------------------------------------------------------------

    def _scales(self, x64: torch.Tensor) -> torch.Tensor:
        """float32 scales (rounded up), one per part; ValueError if not finite."""
        n = x64.numel()
        a = x64.abs()
        sizes = partition_sizes(n, self.partitions)
        p = len(sizes)
        if p == 1:
            k = a.amax().reshape(1)
        else:
            base, extra = sizes[-1], n % p
            head = a[: extra * (base + 1)].view(extra, base + 1).amax(dim=1)
            tail = a[extra * (base + 1):].view(p - extra, base).amax(dim=1)
            k = torch.cat([head, tail])
        k32 = _float32_up(k)
        if not bool((k32 <= self.scale_limit).all()):  # NaN and inf fail too
            worst = float(k.max())
            raise _scale_error(worst if math.isfinite(worst) or worst == math.inf else None, self.scale_limit)
        return k32

    def _expand(self, kappa: torch.Tensor, n: int) -> torch.Tensor:
        """Per-element scale from the per-part scales."""
        sizes = partition_sizes(n, self.partitions)
        if len(sizes) == 1:
            return kappa.expand(n)
        return kappa.repeat_interleave(torch.tensor(sizes, device=kappa.device), output_size=n)

    # --- codec -------------------------------------------------------------------

    def _need_generator(self, generator, what: str) -> None:
        if self.subtractive and generator is None:
            if what == "encode":
                raise ValueError(
                    "DitheredCodec(subtractive=True).encode needs generator= (e.g. shared_generator(run_seed, step, "
                    "sender)): the receiver regenerates the dither from the same seed"
                )
            raise ValueError(
                "DitheredCodec(subtractive=True).decode needs generator=: a generator of the same kind seeded like "
                "the sender's (e.g. shared_generator(run_seed, step, sender)), to regenerate the dither"
            )

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float]:
        """The payload's count and first scale, its header, count, first scale and data length
        checked (PayloadError)."""
        n, k1 = frame_header(self, payload)
        frame_count(self, n, numel)
        frame_scale(self, k1, "scale", self.scale_limit)
        p = min(self.partitions, n)
        frame_nbytes(self, payload.data, self.data_nbytes(n),
                     lambda: f"{max(p - 1, 0)} more scales and {n} codes of {self.num_codes} levels")
        return n, k1

    def _scales_of(self, payload: Payload, n: int, k1: float) -> tuple[int, torch.Tensor, float]:
        """``(bytes of scales in data, the float32 scales on the data's device, the largest)`` of a
        payload :meth:`_frame` checked (its first scale ``k1``), the scales in the data checked too
        (PayloadError)."""
        p = min(self.partitions, n)
        extra = 4 * (p - 1)
        raw = torch.cat([payload.header[4:8].to(payload.data.device), payload.data[:extra]])
        k32 = raw.view(torch.float32)
        top = max(k1, frame_scales(self, k32[1:], "scale", self.scale_limit)) if p > 1 else k1
        return extra, k32, top

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """Eq. (2)/(4): scales, then indices ``q = round(x/(kappa Delta) + u/Delta)``."""
        n = check_numel(x)
        self._need_generator(generator, "encode")
        K = kernels_for(x, self.kernel_family)
        if K is None or n == 0:
            return self.encode_reference(x, generator=generator)
        amax, finite = K.dithered_scales(x, min(self.partitions, n))
        k32 = _float32_up(amax)
        finite, kmax = K.host_values(finite, k32.max())  # the one host read on CUDA
        if not finite or not kmax <= self.scale_limit:
            raise _scale_error(float(amax.max()) if finite else None, self.scale_limit)
        codes = K.dithered_encode(x, K.ratio(self.levels, k32), self.levels, self.code_bits, draw_key(generator))
        header, rest = float32_header(n, k32)
        packed = pack_levels_fast(codes, self.num_codes)
        return Payload(header=header, data=torch.cat([rest, packed]) if rest.numel() else packed)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        """``kappa (Delta q - u)`` (subtractive; ``generator`` required, same seed and
        kind as the sender's) or ``kappa Delta q`` (half-dithered). ``ref`` is unused."""
        self._need_generator(generator, "decode")
        n, k1 = self._frame(payload, numel)
        K = kernels_for(payload.data, self.kernel_family)
        if K is None or n == 0:
            return self.decode_reference(payload, generator=generator, dtype=dtype, numel=numel)
        extra, k32, top = self._scales_of(payload, n, k1)
        codes = unpack_levels_fast(payload.data[extra:], self.num_codes, n, K.code_dtype(self.code_bits),
                                   codec=self.name)
        key = draw_key(generator) if self.subtractive else 0
        return frame_output(self, K.dithered_decode(codes, k32.to(torch.float64) / self.levels, self.levels,
                                                    self.subtractive, key, torch.float32 if dtype is None else dtype),
                            top)

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (same bytes on the CPU)."""
        n = check_numel(x)
        self._need_generator(generator, "encode")
        dev = x.device
        if n == 0:
            return Payload(header=pack_header(self.header_format, 0, 0.0, device=dev),
                           data=torch.empty(0, dtype=torch.uint8, device=dev))
        x64 = x.detach().to(torch.float64)
        k32 = self._scales(x64)
        s = self._expand(exact_ratio(self.levels, k32), n)  # M / kappa, 0 for a zero part
        r = _uniforms(n, generator, dev)  # u / Delta = r - 1/2
        q = torch.floor(x64 * s + r).clamp_(-self.levels, self.levels).to(torch.int64)
        k_host = k32.cpu()
        header = pack_header(self.header_format, n, float(k_host[0]), device=dev)
        data = torch.cat([scale_bytes(k_host[1:]).to(dev), pack_levels(q + self.levels, self.num_codes)])
        return Payload(header=header, data=data)

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        self._need_generator(generator, "decode")
        n, k1 = self._frame(payload, numel)
        out_dtype = torch.float32 if dtype is None else dtype
        dev = payload.data.device
        if n == 0:
            return torch.empty(0, dtype=out_dtype, device=dev)
        extra, k32, top = self._scales_of(payload, n, k1)
        q = (unpack_levels(payload.data[extra:], self.num_codes, n, codec=self.name) - self.levels).to(torch.float64)
        step = self._expand(k32.to(torch.float64) / self.levels, n)  # kappa Delta
        if self.subtractive:
            xt = step * (q - (_uniforms(n, generator, dev) - 0.5))
        else:
            xt = step * q
        return frame_output(self, xt.to(out_dtype), top)
