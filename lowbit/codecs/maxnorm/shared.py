"""What the max-norm codecs (:mod:`lowbit.codecs.maxnorm`) share: norms, range checks, the
frame, and the opening of their fast paths (:func:`fast_encode_int`).

Wire form (``encode``/``decode``, one worker's message): header ``<if``
(numel, W as float32); data: single scale, the offset codes ``code + s`` of
``2s + 1 = 2^bits - 1`` levels packed by :func:`~lowbit.codecs.radix.pack_levels`
(mixed radix, ``wire_bits`` = :func:`~lowbit.codecs.radix.level_bits` ``(2s + 1)``
bits per coordinate: 1.6 for ``bits = 2``, ``17 / 6`` for 3, ``43 / 11`` for 4, ...,
exactly ``bits`` from ``bits = 5`` on); multi-scale, ``code + s_min`` with the scale
index in the bits above, packed LSB-first with :func:`~lowbit.codecs.packing.pack_wide`,
exactly ``bits`` bits per coordinate. Without ``scale=``, ``encode`` uses the worker's own
norm (and scale indices), i.e. ``M = 1``.

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
uniforms and writes the offset codes; multi-scale chooses each coordinate's scale
in the same pass. They give the reference's bytes and decodes exactly. On CUDA,
Triton kernels (:mod:`lowbit.codecs.kernels.gpu_maxnorm`) compute the ratio
``|x_i| / W`` and the rounding in float32 for float32/half input (float64 for
float64): the ratio carries a relative error of at most ``eps32 = 2^-24``, so a
code may differ from the reference's by one level on a fraction ``~ s eps32`` of
the coordinates (``a_i <= 1`` still holds exactly). Each code stays unbiased for
the float32 ratio, so Lemma 1's bound holds with ``W^2`` replaced by
``W^2 (1 + 2 eps32)``; decodes ``code * (W / s)`` carry one more float32 rounding.
The sum of squares on CUDA is a float64 sum of per-block float64 partials, so
``W >= ||x||`` (rounded up to float32) as on the CPU.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..base import Payload, check_flat, frame_count, frame_header, frame_nbytes, frame_scale
from ..kernels import kernels_for
from ..quantize import check_numel, lane_sums_reference

__all__ = ["FAMILY", "NORMS", "fast_encode_int", "sum_squares_reference"]


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


def fast_encode_int(codec, x: torch.Tensor, scale, generator, dtype: torch.dtype, kernels=_x_kernels):
    """The opening both max-norm codecs' ``encode_int`` share: ``(code dtype, kernels, None)``
    where ``x`` has a fast path (``kernels(x)``: the max-norm family's, after checking ``x``),
    else ``(code dtype, None, the float64 reference's codes)``."""
    dtype = codec.code_dtype(dtype)
    K = kernels(x)
    return dtype, K, (codec.encode_int_reference(x, scale, generator).to(dtype) if K is None else None)
