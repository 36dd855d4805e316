"""All-reduce compatible stochastic quantizers with a norm shared by MAX over the
workers (paper 004, "Unbiased single-scale and multi-scale quantizers for
distributed optimization": QSGDMaxNorm, section 3.1, eqs. 7-9, Lemma 1,
Algorithm 1; QSGDMaxNormMultiScale, section 3.2, eqs. 10-13, Lemma 2,
Algorithm 2).

Single scale. All workers agree on ``W = max_m ||x_m||`` (a MAX all-reduce of
one float32). With ``a_i = |x_i| / W`` in ``[0, 1]`` each worker sends the
integer ``code_i = sign(x_i) * s * xi_i``, where ``s * xi_i`` is ``s * a_i``
rounded stochastically to one of its two neighbouring integers (eq. 8), so
``E[code_i] = s * x_i / W``. Codes of all workers are summed as integers and
``W * sum / (s * M)`` is the average of the workers' reconstructions (eq. 9).

Bits and levels. ``bits`` is the number of bits each coordinate takes on the
wire, the paper's ``r = ceil(log2 s) + 1``: one sign bit plus a magnitude
``s * xi_i`` in ``0..s``. The largest ``s`` whose magnitudes fit ``bits - 1``
bits is ``s = 2^(bits-1) - 1``, for which ``ceil(log2 s) + 1 = bits`` holds
exactly (``bits >= 3``; ``bits = 2`` gives the ternary ``s = 1``, where the
paper's formula undercounts the magnitude bit). The paper's "precision" or
"number of bits" ``log2 s`` of a scale (the numbers in its legends, e.g.
QSGD-MN 8) is ``precision = bits - 1 = log2(s + 1)``: QSGD-MN with precision
``p`` is ``QSGDMaxNormCodec(bits=p + 1)``, with ``s = 2^p - 1`` levels.

Multiple scales. ``MultiScaleMaxNormCodec(scales=(2, 6))`` is the paper's
two-scale "(2, 6)": the scales are given by their precision ``p_j`` (log2 of
the number of levels), ``s_j = 2^p_j - 1``, i.e. levels ``(3, 63)``. Each
coordinate uses the largest scale ``s`` with ``s <= (W / |x_i|) * min_j s_j``
(eq. 11), so its code magnitude ``ceil(s * a_i)`` never exceeds
``min_j s_j`` and fits the bits of the smallest scale. Workers share the scale
index by MIN (scale sharing, a second all-reduce of ``ceil(log2 N)`` bits per
coordinate), after which all codes of a coordinate are on the same scale and
can be summed; decoding divides element-wise by the coordinate's scale
(eq. 13). Bits per coordinate: ``min_j p_j + 1 + ceil(log2 N)``.

Wire form (``encode``/``decode``, one worker's message): header ``<if``
(numel, W as float32); data: single scale, the offset codes ``code + s`` of
``2s + 1 = 2^bits - 1`` levels packed by :func:`~lowbit.codecs.radix.pack_levels`
(mixed radix, ``wire_bits`` = :func:`~lowbit.codecs.radix.level_bits` ``(2s + 1)``
bits per coordinate: 1.6 for ``bits = 2``, ``17 / 6`` for 3, ``43 / 11`` for 4, ...,
exactly ``bits`` from ``bits = 5`` on, where one code per ``bits`` bits is already
within 1% of ``log2(2s + 1)``); multi-scale, ``code + s_min`` with the scale index in
the bits above, packed LSB-first with :func:`pack_wide`, exactly ``bits`` bits per
coordinate. A single-scale
``MultiScaleMaxNormCodec(scales=(p,))`` quantizes like
``QSGDMaxNormCodec(bits=p + 1)``. Without ``scale=``, ``encode`` uses the
worker's own norm (and scale indices), i.e. ``M = 1``.

Precision: norms, ratios and reconstructions are float64; the shared norm is
rounded UP to float32 (so the header holds it exactly and ``a_i <= 1``).
``norm="linf"`` shares ``max_m max_i |x_{m,i}|`` instead of the l2 norm.

Fast path (the default; ``encode_reference``, ``decode_reference``,
``shared_scale_reference``, ``encode_int_reference``, ``decode_sum_reference``
keep the float64 whole-tensor code). On the CPU, numba kernels
(:mod:`lowbit.codecs.kernels.cpu_maxnorm`) read x once per pass in its own
dtype and compute in float64 registers: one pass for the norm (max |x| and the
sum of squares in a fixed order, 8 interleaved lanes combined pairwise, which
the reference reproduces with :func:`sum_squares_reference`) and one pass that
checks finiteness and ``|x_i| <= W``, rounds stochastically with the counter
uniforms and writes the offset codes as uint8 (``bits <= 8``); multi-scale
chooses each coordinate's scale in the same pass. They give the reference's
bytes and decodes exactly. On CUDA, Triton kernels
(:mod:`lowbit.codecs.kernels.gpu_maxnorm`) compute the ratio ``|x_i| / W`` and
the rounding in float32 for float32/half input (float64 for float64): the
ratio carries a relative error of at most ``eps32 = 2^-24`` (one rounding),
so ``t_i = s a_i`` is off by at most ``s eps32`` and a code may differ from the
reference's by one level, on a fraction ``~ s eps32`` of the coordinates
(``a_i <= 1`` still holds exactly: ``|x_i| <= W`` and float division is
monotone). Each code stays unbiased for the float32 ratio, so Lemma 1's bound
holds with ``W^2`` replaced by ``W^2 (1 + 2 eps32)``; decodes
``code * (W / s)`` carry one more float32 rounding (``eps32 |x_hat_i|``).
The sum of squares on CUDA is a float64 sum of per-block float64 partials,
so ``W >= ||x||`` (rounded up to float32) as on the CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .base import (
    Payload,
    PayloadError,
    SummableCodec,
    check_flat,
    check_world_size,
    frame_count,
    frame_header,
    frame_nbytes,
    frame_output,
    frame_scale,
    frame_scales,
    pack_header,
)
from .kernels import kernels_for
from .packing import pack_wide, packed_nbytes, unpack_wide
from .radix import level_bits, levels_nbytes, pack_levels, pack_levels_fast, unpack_levels, unpack_levels_fast
from .qsgd import round_up_float32
from .quantize import INT32_MAX, check_int_range, check_numel, lane_sums_reference, round_to_int
from .rng import draw_key

__all__ = ["NORMS", "QSGDMaxNormCodec", "MultiScaleMaxNormCodec", "sum_squares_reference"]

FAMILY = "maxnorm"

NORMS = ("l2", "linf")
_MAX_SCALES = 16
_F32_MAX = float(np.finfo(np.float32).max)


def _check_norm(norm) -> str:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    return norm


def _f32_up(value: float) -> float:
    """The smallest float32 value >= ``value`` (``value`` finite, >= 0)."""
    if not math.isfinite(value) or value > _F32_MAX:
        raise ValueError(f"the norm of x ({value}) is not finite or does not fit the float32 header")
    f = np.float32(value)
    if float(f) < value:
        f = np.nextafter(f, np.float32(np.inf), dtype=np.float32)
    return float(f)


def _as_float64(x: torch.Tensor) -> torch.Tensor:
    check_flat(x)
    check_numel(x)
    x64 = x.detach().to(torch.float64)
    if x64.numel() and not bool(torch.isfinite(x64).all()):
        raise ValueError("x must be finite for the max-norm codecs")
    return x64


def sum_squares_reference(x64: torch.Tensor) -> float:
    """``sum x_i^2`` in float64 in the fixed order that the CPU kernel reproduces
    (:func:`~lowbit.codecs.quantize.lane_sums_reference`: lane ``i mod 8``, then pairwise)."""
    return float(lane_sums_reference(x64 * x64, max(1, x64.numel()))[0])


def _norm_of(amax: float, sumsq: float, norm: str) -> float:
    """``||x||``, never below ``max |x_i|`` (which it is mathematically; taking the max
    guards float rounding so that ``|x_i| / W <= 1`` exactly)."""
    return amax if norm == "linf" else max(math.sqrt(sumsq), amax)


def _local_statistic(x64: torch.Tensor, norm: str) -> float:
    """``||x||`` in float64 (see :func:`_norm_of`)."""
    if x64.numel() == 0:
        return 0.0
    return _norm_of(float(x64.abs().max()), sum_squares_reference(x64) if norm == "l2" else 0.0, norm)


def _over_error(W: float, amax: float, norm: str) -> ValueError:
    return ValueError(
        f"scale={W} is smaller than this worker's max |x_i| = {amax}: the shared {norm} norm must be "
        "the MAX of the workers' shared_scale values (scale_reduce_op='max')"
    )


def _level_error() -> ValueError:
    return ValueError(
        "scale[1] (the scale index) exceeds this worker's admissible scale for some coordinate: "
        "indices must be the MIN over workers of shared_scale(x, (W,)) (eq. 11)"
    )


def _index_error(N: int) -> ValueError:
    return ValueError(f"scale[1] (the scale index) must lie in 0..{N - 1}")


def _raise_flags(K, flags, x: torch.Tensor, W: float, norm: str, nscales: int = 1) -> None:
    """The fast path's errors, in the reference's order (one read of the kernel's flags)."""
    flags = int(flags)
    if not flags:
        return
    if flags & K.FLAG_NONFINITE:
        raise ValueError("x must be finite for the max-norm codecs")
    if flags & K.FLAG_INDEX:
        raise _index_error(nscales)
    if flags & K.FLAG_OVER:
        raise _over_error(W, float(x.detach().abs().max()), norm)
    if flags & K.FLAG_LEVEL:
        raise _level_error()


def _fast_norm(K, x: torch.Tensor, norm: str) -> float:
    """This worker's W (float32-representable) from the one-pass statistics of x."""
    amax, sumsq, finite = K.norm_stats(x)
    if not finite:
        raise ValueError("x must be finite for the max-norm codecs")
    return _f32_up(_norm_of(float(amax), float(sumsq), norm)) if x.numel() else 0.0


def _out_dtype(dtype) -> torch.dtype:
    return torch.float32 if dtype is None else dtype


@functools.lru_cache(maxsize=64)
def _levels_on(levels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The multi-scale levels as a float64 tensor on ``device``, made once per device (a copy
    from the host at every call would wait for the GPU each time). Read only."""
    return torch.tensor(levels, dtype=torch.float64, device=device)


def _norm_value(scale, field: str = "scale") -> float:
    """The agreed norm W from a tensor of one element or a real number, as the float32
    value the header carries."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{field} must hold one value (the shared norm), got shape {tuple(scale.shape)}")
        v = float(scale.reshape(()))
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        v = float(scale)
    else:
        raise ValueError(f"{field} must be a one-element tensor or a number, got {type(scale).__name__}")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{field} (the shared norm) must be finite and >= 0, got {v}")
    return _f32_up(v)


def _ratios(x64: torch.Tensor, W: float, norm: str) -> torch.Tensor:
    """``a_i = |x_i| / W`` in [0, 1]; ValueError when W is below this worker's ``max |x_i|``."""
    ax = x64.abs()
    amax = float(ax.max()) if ax.numel() else 0.0
    if amax > W:
        raise _over_error(W, amax, norm)
    return ax / W if W > 0 else torch.zeros_like(ax)


def _signed(x64: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    return (torch.sign(x64) * mag).to(torch.int64)


def _check_int_sum(int_sum: torch.Tensor, numel, field: str = "int_sum") -> int:
    if not isinstance(int_sum, torch.Tensor) or int_sum.dim() != 1 or int_sum.is_floating_point() \
            or int_sum.is_complex() or int_sum.dtype == torch.bool:
        desc = f"{int_sum.dtype} {tuple(int_sum.shape)}" if isinstance(int_sum, torch.Tensor) else type(int_sum).__name__
        raise ValueError(f"{field} must be a 1-D integer tensor, got {desc}")
    n = int_sum.numel()
    if numel is not None and numel != n:
        raise ValueError(f"numel={numel} does not match the {n} summed codes")
    return n


def _kernels(t: torch.Tensor):
    """The max-norm kernel module for ``t``'s fast path, or None (the reference)."""
    return kernels_for(t, FAMILY) if isinstance(t, torch.Tensor) else None


def _x_kernels(x: torch.Tensor):
    """:func:`_kernels` for an input ``x``, after checking it is a flat floating tensor that a
    header can count (:func:`~lowbit.codecs.quantize.check_numel`: a TypeError or ValueError
    naming ``x``, as every codec's, never a kernel's typing error)."""
    check_numel(x)
    return _kernels(x)


def _frame(codec, payload: Payload, numel: int | None, need) -> tuple[int, float]:
    """``(n, W)`` of a max-norm payload, its frame checked (PayloadError): the header, the
    count, ``W`` finite in ``[0, float32 max]``, and ``need(n)`` data bytes."""
    n, W = frame_header(codec, payload)
    frame_count(codec, n, numel)
    frame_scale(codec, W, "norm W", _F32_MAX)
    frame_nbytes(codec, payload.data, need(n), lambda: f"{n} codes of {codec.bits} bits")
    return n, W


def _lemma_bound(numel: int, s_hat: int, W: float, norm: str) -> float:
    if norm == "l2":
        return (1 + min(numel / s_hat**2, math.sqrt(numel) / s_hat)) * W**2
    return (1 + numel / s_hat**2) * W**2


@dataclass(frozen=True)
class QSGDMaxNormCodec(SummableCodec):
    """QSGDMaxNorm (section 3.1): ``s = 2^(bits-1) - 1`` levels, ``bits`` bits per
    coordinate (sign + magnitude), norm shared by MAX; unbiased; kind SUMMABLE.

    ``shared_scale(x)``: ``[W_m]`` (float32, one element), combined by ``max``.
    ``encode_int(x, W)``: int64 codes in ``-s..s``. ``decode_sum(sum, W, M)``:
    ``W * sum / (s * M)``. ``encode(x, scale=W)`` / ``decode``: one message.

    ``bucket``: None (the paper's one norm for the whole vector), or ``d`` in
    ``1..2^31 - 1``: one shared norm per bucket of ``d`` consecutive coordinates (the last
    possibly shorter), as QSGD quantizes (Alistarh et al. use ``d = 512``; the DDP hooks'
    default, :data:`~lowbit.integrations.ddp_hooks.HOOK_BUCKET`). ``shared_scale(x)`` is then
    the ``ceil(n / d)`` float32 norms of this worker's buckets, combined by ``max`` element by
    element (one MAX all-reduce of ``4 ceil(n / d)`` bytes, :meth:`scale_nbytes`), and every
    coordinate is coded against its bucket's shared norm ``W_j``: Lemma 1 holds per bucket,
    ``E||Q(x) - x||^2 <= sum_j (1 + min(d_j / s^2, sqrt(d_j) / s)) W_j^2``. With one norm for
    ``n`` coordinates a typical ``|x_i| / W`` is ``~ 1 / sqrt(n)``: at ``n = 79k`` and ``s = 7``
    almost every code is 0 and the rest are ``+-W / 7``, a variance ``~ sqrt(n) / s = 40``
    times ``||x||^2`` (the l2 factor of Lemma 1); buckets of 512 bring the factor to 3.2. The
    codes, their sum and its dtype are as without buckets (the same uniforms: with equal norms
    the codes are the same). One message: header ``<i`` (numel), data the float32 norms, then
    the packed codes. The fast path's bucketed kernels are the CPU's; elsewhere the float64
    reference runs.
    """

    bits: int = 3  # the paper's "QSGD-MN 2" (precision 2): the default of every entry point
    norm: str = "l2"
    bucket: int | None = None

    name = "qsgd-maxnorm"
    kernel_family = FAMILY
    unbiased = True
    scale_reduce_ops = ("max",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int_range(self.bits, "bits", 2, 32))
        _check_norm(self.norm)
        if self.bucket is not None:
            object.__setattr__(self, "bucket", check_int_range(self.bucket, "bucket", 1, INT32_MAX))

    @property
    def header_format(self) -> str:  # type: ignore[override]
        """``<if`` (numel, W) with one norm; ``<i`` (numel) with buckets (the norms lead the data)."""
        return "if" if self.bucket is None else "i"

    def num_buckets(self, numel: int) -> int:
        """Shared norms of a vector of ``numel`` coordinates: 1, or ``ceil(numel / bucket)`` (at least 1)."""
        return 1 if self.bucket is None else max(1, -(-numel // self.bucket))

    @property
    def levels(self) -> int:
        """``s = 2^(bits-1) - 1``: the paper's number of quantization levels."""
        return (1 << (self.bits - 1)) - 1

    @property
    def precision(self) -> int:
        """The paper's precision ``log2(s + 1) = bits - 1`` (QSGD-MN <precision>)."""
        return self.bits - 1

    @property
    def max_code(self) -> int:
        return self.levels

    @property
    def num_codes(self) -> int:
        """Codes of one message, ``2s + 1 = 2^bits - 1`` (offset codes ``code + s``)."""
        return 2 * self.levels + 1

    @property
    def wire_bits(self) -> float:
        """Bits per coordinate of a message on the wire, :func:`~lowbit.codecs.radix.level_bits`
        ``(2s + 1)``: at most ``bits``, below it where mixed radix saves (1.6 for ``bits = 2``)."""
        return level_bits(self.num_codes)

    def scale_nbytes(self, numel: int) -> int:
        """4 bytes (one float32 norm) per bucket."""
        return 4 * self.num_buckets(numel)

    def variance_bound(self, numel: int, scale) -> float:
        """Lemma 1: ``E||Q(x) - x||^2 <= (1 + min(n / s^2, sqrt(n) / s)) W^2`` for the l2
        norm; for ``linf`` the same argument (``sum_i p_i <= n``) gives ``(1 + n / s^2) W^2``.
        With buckets, the sum of that bound over the buckets (``n = d_j``, ``W = W_j``)."""
        if self.bucket is None:
            return _lemma_bound(numel, self.levels, _norm_value(scale), self.norm)
        W = self._bucket_norms(scale, numel, torch.device("cpu")).tolist()
        sizes = [min(self.bucket, numel - j * self.bucket) for j in range(len(W))]
        return sum(_lemma_bound(d, self.levels, w, self.norm) for d, w in zip(sizes, W))

    # --- buckets: one shared norm per bucket --------------------------------------------

    def _bucket_norms(self, scale, n: int, device) -> torch.Tensor:
        """The agreed bucket norms from ``scale`` (a tensor of :meth:`num_buckets` values, or a
        number when there is one bucket) as float64 on ``device``, each rounded up to float32
        (the values the wire carries): ValueError unless they are finite and >= 0."""
        k = self.num_buckets(n)
        if isinstance(scale, torch.Tensor):
            v = scale.detach().reshape(-1)
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            v = torch.tensor([float(scale)], dtype=torch.float64)
        else:
            raise ValueError(f"scale must be a tensor of the {k} shared bucket norms (or a number for one bucket), "
                             f"got {type(scale).__name__}")
        if v.numel() != k or v.is_complex() or not v.is_floating_point():
            raise ValueError(f"scale must hold {k} floating-point norms (one per bucket of {self.bucket} of the {n} "
                             f"coordinates), got {v.dtype} of {v.numel()}")
        v = v.to(device=device, dtype=torch.float64)
        lo, hi = torch.aminmax(v)
        if not (float(lo) >= 0 and float(hi) <= _F32_MAX):
            raise ValueError(f"scale (the shared bucket norms) must be finite, >= 0 and within float32, got values in "
                             f"[{float(lo)}, {float(hi)}]")
        return round_up_float32(v).to(torch.float64)

    def _bucket_over_error(self, x: torch.Tensor, W: torch.Tensor) -> ValueError:
        n, d = x.numel(), self.bucket
        k = W.numel()
        amax = torch.nn.functional.pad(x.detach().abs().to(torch.float64).cpu(), (0, k * d - n)).view(k, d).amax(1)
        j = int(torch.nonzero(amax > W.cpu())[0])
        return ValueError(f"scale[{j}]={float(W[j])} is smaller than this worker's max |x_i| = {float(amax[j])} in "
                          f"bucket {j}: the shared {self.norm} norms must be the MAX of the workers' shared_scale "
                          "values (scale_reduce_op='max')")

    def _bucket_kernels(self, t: torch.Tensor):
        """The CPU kernels of the bucketed fast path for ``t``, or None (the reference)."""
        K = _kernels(t)
        return K if K is None else kernels_for(t, FAMILY, "qsgd_encode_buckets")

    def _bucket_flags(self, flags, x: torch.Tensor, W: torch.Tensor, K) -> None:
        flags = int(flags)
        if flags & K.FLAG_NONFINITE:
            raise ValueError("x must be finite for the max-norm codecs")
        if flags & K.FLAG_OVER:
            raise self._bucket_over_error(x, W)

    def _shared_bucket_norms(self, x: torch.Tensor) -> torch.Tensor:
        check_numel(x)
        K = self._bucket_kernels(x)
        if K is None:
            return self._bucket_norms_reference(x)
        norms, finite = K.bucket_norms(x.detach(), self.bucket, self.norm == "linf")
        if not finite:
            raise ValueError("x must be finite for the max-norm codecs")
        return self._float32_norms(norms, x.device)

    def _float32_norms(self, norms: torch.Tensor, device) -> torch.Tensor:
        up = round_up_float32(norms)
        if not bool(torch.isfinite(up).all()):
            raise ValueError(f"the norm of a bucket of x ({float(norms.max())}) does not fit the float32 sent on the "
                             "wire")
        return up.to(device)

    def _bucket_norms_reference(self, x: torch.Tensor) -> torch.Tensor:
        x64 = _as_float64(x)
        n, d = x64.numel(), self.bucket
        k = self.num_buckets(n)
        amax = torch.nn.functional.pad(x64.abs(), (0, k * d - n)).view(k, d).amax(1)
        if self.norm == "l2":
            amax = torch.maximum(torch.sqrt(lane_sums_reference(x64 * x64, d)), amax)
        return self._float32_norms(amax, x.device)

    def _expand(self, W: torch.Tensor, n: int) -> torch.Tensor:
        return W.repeat_interleave(self.bucket)[:n]

    def _bucket_encode_int_reference(self, x: torch.Tensor, scale, generator) -> torch.Tensor:
        x64 = _as_float64(x)
        n = x64.numel()
        W = self._bucket_norms(scale, n, x64.device)
        We = self._expand(W, n)
        ax = x64.abs()
        if n and bool((ax > We).any()):
            raise self._bucket_over_error(x64, W)
        a = torch.where(We > 0, ax / torch.where(We > 0, We, torch.ones_like(We)), torch.zeros_like(ax))
        return _signed(x64, round_to_int(a * self.levels, "stochastic", generator))

    def _bucket_decode_reference(self, int_sum: torch.Tensor, scale, m: int, dtype) -> torch.Tensor:
        n = int_sum.numel()
        W = self._bucket_norms(scale, n, int_sum.device)
        out = int_sum.to(torch.float64) * self._expand(W / self.levels, n) / m
        return out.to(_out_dtype(dtype))

    def _bucket_frame(self, payload: Payload, numel: int | None) -> tuple[int, torch.Tensor, torch.Tensor, float]:
        """``(n, float32 norms, packed codes, largest norm)`` of a bucketed message, its frame
        checked (PayloadError)."""
        (n,) = frame_header(self, payload)
        frame_count(self, n, numel)
        k = self.num_buckets(n)
        frame_nbytes(self, payload.data, 4 * k + levels_nbytes(n, self.num_codes),
                     lambda: f"{k} bucket norms and {n} codes of {self.num_codes} levels")
        norms = payload.data[: 4 * k].clone().view(torch.float32)
        return n, norms, payload.data[4 * k:], frame_scales(self, norms, "bucket norm", _F32_MAX)

    def _bucket_message(self, x: torch.Tensor, W: torch.Tensor, packed: torch.Tensor) -> Payload:
        header = pack_header(self.header_format, x.numel(), device=x.device)
        return Payload(header=header, data=torch.cat([W.to(torch.float32).view(torch.uint8).to(x.device), packed]))

    # --- the summable protocol (fast path) --------------------------------------------

    def shared_scale(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        if self.bucket is not None:
            if len(agreed) != 0:
                raise ValueError(f"{type(self).__name__} has one scale round; agreed must be empty, got {len(agreed)}")
            return self._shared_bucket_norms(x)
        K = _x_kernels(x)
        if K is None:
            return self.shared_scale_reference(x, agreed)
        if len(agreed) != 0:
            raise ValueError(f"{type(self).__name__} has one scale round; agreed must be empty, got {len(agreed)}")
        return K.as_scale(_fast_norm(K, x, self.norm), x)

    def encode_int(self, x: torch.Tensor, scale, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
        dtype = self.code_dtype(dtype)
        if self.bucket is not None:
            check_numel(x)
            K = self._bucket_kernels(x)
            if K is None:
                return self.encode_int_reference(x, scale, generator).to(dtype)
            W = self._bucket_norms(scale, x.numel(), torch.device("cpu"))
            codes, flags = K.qsgd_encode_buckets(x.detach(), W, self.bucket, self.levels, 0, draw_key(generator), dtype)
            self._bucket_flags(flags, x, W, K)
            return codes
        K = _x_kernels(x)
        if K is None:
            return self.encode_int_reference(x, scale, generator).to(dtype)
        W = _norm_value(scale)
        codes, flags = K.qsgd_encode(x, W, self.levels, 0, draw_key(generator), dtype)
        _raise_flags(K, flags, x, W, self.norm)
        return codes

    def decode_sum(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        n = _check_int_sum(int_sum, numel)
        m = check_world_size(world_size)
        if self.bucket is not None:
            K = self._bucket_kernels(int_sum)
            if K is None:
                return self._bucket_decode_reference(int_sum, scale, m, dtype)
            W = self._bucket_norms(scale, n, torch.device("cpu"))
            return K.qsgd_decode_buckets(int_sum, 0, W, self.bucket, self.levels, m, _out_dtype(dtype))
        W = _norm_value(scale)
        K = _kernels(int_sum)
        if K is None:
            return self.decode_sum_reference(int_sum, W, m, dtype=dtype)
        return K.qsgd_decode(int_sum, 0, W, self.levels, m, _out_dtype(dtype))

    # --- one message (fast path) ------------------------------------------------------------

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        """One worker's message; ``scale``: the agreed norm (default: this worker's own), or with
        buckets the agreed bucket norms."""
        if self.bucket is not None:
            check_numel(x)
            K = self._bucket_kernels(x)
            if K is None:
                return self.encode_reference(x, generator=generator, scale=scale)
            W = self._bucket_norms(self.shared_scale(x) if scale is None else scale, x.numel(), torch.device("cpu"))
            codes, flags = K.qsgd_encode_buckets(x.detach(), W, self.bucket, self.levels, self.levels,
                                                 draw_key(generator), K.code_dtype(self.bits))
            self._bucket_flags(flags, x, W, K)
            return self._bucket_message(x, W, pack_levels_fast(codes, self.num_codes))
        K = _x_kernels(x)
        if K is None:
            return self.encode_reference(x, generator=generator, scale=scale)
        W = _fast_norm(K, x, self.norm) if scale is None else _norm_value(scale)
        codes, flags = K.qsgd_encode(x, W, self.levels, self.levels, draw_key(generator), K.code_dtype(self.bits))
        _raise_flags(K, flags, x, W, self.norm)
        header = pack_header(self.header_format, x.numel(), W, device=x.device)
        return Payload(header=header, data=pack_levels_fast(codes, self.num_codes))

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float]:
        return _frame(self, payload, numel, lambda n: levels_nbytes(n, self.num_codes))

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        if self.bucket is not None:
            K = self._bucket_kernels(payload.data)
            if K is None:
                return self.decode_reference(payload, dtype=dtype, numel=numel)
            n, norms, data, top = self._bucket_frame(payload, numel)
            codes = unpack_levels_fast(data, self.num_codes, n, K.code_dtype(self.bits), codec=self.name)
            out = K.qsgd_decode_buckets(codes, self.levels, norms.to(torch.float64), self.bucket, self.levels, 1,
                                        _out_dtype(dtype))
            return frame_output(self, out, top)
        K = _kernels(payload.data)
        if K is None:
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        n, W = self._frame(payload, numel)
        codes = unpack_levels_fast(payload.data, self.num_codes, n, K.code_dtype(self.bits), codec=self.name)
        return frame_output(self, K.qsgd_decode(codes, self.levels, W, self.levels, 1, _out_dtype(dtype)), W)

    # --- the float64 references -------------------------------------------------------------

    def shared_scale_reference(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        if len(agreed) != 0:
            raise ValueError(f"{type(self).__name__} has one scale round; agreed must be empty, got {len(agreed)}")
        if self.bucket is not None:
            return self._bucket_norms_reference(x)
        W = _f32_up(_local_statistic(_as_float64(x), self.norm))
        return torch.tensor([W], dtype=torch.float32, device=x.device)

    def encode_int_reference(self, x: torch.Tensor, scale, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.bucket is not None:
            return self._bucket_encode_int_reference(x, scale, generator)
        x64 = _as_float64(x)
        W = _norm_value(scale)
        t = _ratios(x64, W, self.norm) * self.levels  # <= s exactly, since a <= 1
        return _signed(x64, round_to_int(t, "stochastic", generator))

    def decode_sum_reference(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
        _check_int_sum(int_sum, numel)
        m = check_world_size(world_size)
        if self.bucket is not None:
            return self._bucket_decode_reference(int_sum, scale, m, dtype)
        W = _norm_value(scale)
        out = int_sum.to(torch.float64) * (W / self.levels) / m
        return out.to(_out_dtype(dtype))

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        if scale is None:
            scale = self.shared_scale_reference(x)
        if self.bucket is not None:
            W = self._bucket_norms(scale, x.numel(), x.device)
            codes = self.encode_int_reference(x, W, generator)
            return self._bucket_message(x, W, pack_levels(codes + self.levels, self.num_codes))
        W = _norm_value(scale)
        codes = self.encode_int_reference(x, W, generator)
        header = pack_header(self.header_format, codes.numel(), W, device=x.device)
        return Payload(header=header, data=pack_levels(codes + self.levels, self.num_codes))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        if self.bucket is not None:
            n, norms, data, top = self._bucket_frame(payload, numel)
            codes = unpack_levels(data, self.num_codes, n, codec=self.name) - self.levels
            return frame_output(self, self._bucket_decode_reference(codes, norms, 1, dtype), top)
        n, W = self._frame(payload, numel)
        codes = unpack_levels(payload.data, self.num_codes, n, codec=self.name) - self.levels
        return frame_output(self, self.decode_sum_reference(codes, W, 1, dtype=dtype), W)


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
        dtype = self.code_dtype(dtype)
        K = _x_kernels(x)
        if K is None:
            return self.encode_int_reference(x, scale, generator).to(dtype)
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
