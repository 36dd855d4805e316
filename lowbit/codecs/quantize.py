"""The core of every uniform quantizer: rounding a real tensor to integers.

``stochastic``: ``floor(v) + 1[u < frac(v)]`` with ``u ~ U[0, 1)``, which is
``floor(v + u)`` written so that it stays exactly unbiased in floating point
(``E[round] = v``, error ``< 1``). ``nearest``: ``torch.round`` (half to even,
error ``<= 1/2``, biased).
"""

from __future__ import annotations

import math
import numbers

import torch

from .base import check_flat
from .rng import counter_uniforms, draw_key

__all__ = [
    "ROUNDINGS",
    "check_rounding",
    "round_to_int",
    "error_bound",
    "work_dtype",
    "check_int_range",
    "check_positive",
    "check_numel",
]

ROUNDINGS = ("stochastic", "nearest")


def check_rounding(rounding, field: str = "rounding") -> str:
    """Return ``rounding`` if it is one of :data:`ROUNDINGS`, else raise ValueError."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"{field} must be one of {ROUNDINGS}, got {rounding!r}")
    return rounding


class Rounded:
    """Mixin of a codec with a ``rounding`` option (one of :data:`ROUNDINGS`, checked by
    :func:`check_rounding`): its codes are unbiased exactly when the rounding is stochastic."""

    @property
    def unbiased(self) -> bool:
        return self.rounding == "stochastic"


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the rounding is done in: float64 stays, everything else is float32
    at least (half-precision uniforms would be too coarse to be unbiased)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def round_to_int(v: torch.Tensor, rounding: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round ``v`` element-wise to integers (returned as a floating tensor).

    The result has ``v``'s dtype when it is float32/float64 (half types are
    computed and returned in float32), and ``v``'s device. Stochastic rounding
    draws one key from ``generator`` (the global generator if None) and uses the
    counter uniforms of :func:`~lowbit.codecs.rng.counter_uniforms` for the
    elements in flat order, as the fast kernels do, so every device and code
    path sees the same draws.
    """
    check_rounding(rounding)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        raise TypeError(f"v must be a floating-point tensor, got {getattr(v, 'dtype', type(v).__name__)}")
    v = v.to(work_dtype(v.dtype))
    if rounding == "nearest":
        return torch.round(v)
    u = counter_uniforms(draw_key(generator), v.numel(), v.device, v.dtype).view(v.shape)
    lo = torch.floor(v)
    return lo + (u < (v - lo)).to(v.dtype)


def error_bound(step: float, rounding: str) -> float:
    """Worst-case ``|Q(x) - x|`` of rounding to the grid ``step * Z``: ``step``
    for stochastic (strictly less), ``step / 2`` for nearest."""
    check_rounding(rounding)
    step = check_positive(step, "step")
    return step if rounding == "stochastic" else step / 2


# --- field validation shared by the codecs -----------------------------------

INT32_MAX = 2**31 - 1


def check_int_range(value, field: str, lo: int, hi: int) -> int:
    """``value`` must be an int (not bool) in ``lo..hi``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
        raise ValueError(f"{field} must be an int in {lo}..{hi}, got {value!r}")
    return int(value)


def check_positive(value, field: str) -> float:
    """``value`` must be a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be a finite number > 0, got {value!r}")
    return float(value)


def check_numel(x: torch.Tensor) -> int:
    """The element count of ``x``, checked to be a flat floating tensor (:func:`check_flat`)
    whose count a header's int32 holds: the prelude of every encode."""
    check_flat(x)
    n = x.numel()
    if n > INT32_MAX:
        raise ValueError(f"x has {n} elements; a payload header holds at most {INT32_MAX} (int32)")
    return n


def finite_float64(x: torch.Tensor, codec: str) -> tuple[int, torch.Tensor]:
    """The common prelude of an encode: ``x`` flat, floating, at most int32 long
    and finite; returns its length and a float64 copy for the arithmetic."""
    n = check_numel(x)
    x64 = x.detach().to(torch.float64)
    if not bool(torch.isfinite(x64).all()):
        raise ValueError(f"x must be finite for the {codec} codec")
    return n, x64


#: lanes of the fixed-order float64 sums (the CPU kernels' ``i mod 8`` accumulators)
SUM_LANES = 8


def lane_sums_reference(terms64: torch.Tensor, bucket: int) -> torch.Tensor:
    """The float64 sum of ``terms64`` over each bucket of ``bucket`` consecutive elements (the
    last possibly shorter), in the fixed order the CPU kernels add in: lane ``i mod 8``
    (counted from the bucket's start) accumulates its terms in index order, then the lanes are
    added pairwise, ``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``. Eight independent
    accumulators keep the kernels' loops off the latency of one float64 add chain (a
    sequential sum of 1e6 terms took ~0.85 ms on one core, these 0.12 ms). An empty input
    gives one zero."""
    n = terms64.numel()
    k = max(1, -(-n // bucket))
    width = bucket + (-bucket) % SUM_LANES  # zeros fill each bucket up to whole lanes: t + 0.0 is t
    t = torch.nn.functional.pad(terms64, (0, k * bucket - n)).view(k, bucket)
    lanes = torch.nn.functional.pad(t, (0, width - bucket)).view(k, -1, SUM_LANES).cumsum(1)[:, -1]
    pairs = lanes[:, 0::2] + lanes[:, 1::2]  # (l0 + l1), (l2 + l3), (l4 + l5), (l6 + l7)
    quads = pairs[:, 0::2] + pairs[:, 1::2]
    return quads[:, 0] + quads[:, 1]
