"""All-reduce compatible max-norm quantized SGD (paper 004, "Unbiased
Single-scale and Multi-scale Quantizers for Distributed Optimization"):
QSGDMaxNorm (Algorithm 1), QSGDMaxNormMultiScale (Algorithm 2) and their
GlobalRandK forms (sections 3.3 and 3.4).

Per worker ``m`` at step ``t`` (Algorithm 2's line numbers; Algorithm 1 has no
lines 6-7)::

    5: ||w||  = MAX all-reduce of ||g_m||                       (one float32)
    6: s*,m   = per-coordinate scale index (eq. 11)
    7: s*     = MIN all-reduce of s*,m                           (uint8 per coordinate)
    8: zeta_m = sign(g_m) s* xi(g_m, ||w||, s*)                  (integer codes)
    9: zeta   = SUM all-reduce of zeta_m          (packed lanes, or codec.sum_dtype(M))
   10: g^     = ||w|| zeta / (M s*)                              (one reconstruction)

The integer codes travel packed in summable lanes (``codec.sum_lanes(M)``,
:mod:`lowbit.codecs.lanes`: ``log2(2 M s + 1)`` bits per code in int64 words that
the SUM adds lane by lane without a carry) wherever those send fewer bytes than
the narrowest integer dtype whose sum over ``M`` workers cannot overflow
(``codec.sum_dtype(M)``, int8 for 2-bit codes up to 127 workers), which they
take otherwise; or in ``sum_dtype`` if given (unpacked; ValueError when it is
too narrow).
The stochastic rounding of worker ``m`` draws from ``shared_generator(seed,
t, m)``.

GlobalRandK: every worker keeps the same ``K`` coordinates at step ``t``
(:class:`~lowbit.codecs.RandKCodec` seeded with ``global_index_seed(seed, t)``,
nothing sent for them); only those go through lines 5-10, and the average is
scattered back and rescaled by ``d / K`` (unbiased). ``K``: an int, or a
fraction of ``d`` when below 1.

One class, :class:`MaxNormSGD`, is all four: its options pick the quantizer
(``scales`` empty: Algorithm 1; given: Algorithm 2) and GlobalRandK (``k``
given); the registry's four names are presets of it with other defaults.

Bits: ``bits`` is the paper's precision ``p = log2(s + 1)`` ("QSGD-MN 2"), so
the codec is ``QSGDMaxNormCodec(bits=p + 1)`` with ``s = 2^p - 1`` levels;
``scales=(2, 6)`` is the paper's two-scale "(2, 6)". The nominal bits per
element are what a message of codes carries per coordinate, sign included:
for one scale the 2s + 1 levels at log2 (``QSGDMaxNormCodec.wire_bits``: 2.83
for p = 2, p + 1 from p = 4 on; the paper's legend "QSGD-MN p" leaves the sign
out); for multi-scale the paper's own count (section 3.2)
``r = ceil(log2 s_min) + 1 + ceil(log2 N)`` = ``min p_j + 1 + ceil(log2 N)``
(``MultiScaleMaxNormCodec.bits``: 4 for (2, 6)). The all-reduce itself sums
the codes in the narrowest integer type that cannot overflow, which the wire
bits count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..codecs import MultiScaleMaxNormCodec, QSGDMaxNormCodec, RandKCodec, global_index_seed
from ..codecs.base import SUM_DTYPES, SummableCodec
from ..codecs.lanes import Lanes
from ..codecs.rng import shared_generator
from ..comm.base import Transport, then
from .base import CentralizedAlgorithm, State, transient
from .config import BITS, Option, reads

SUM_DTYPE_NAMES = {str(d).replace("torch.", ""): d for d in SUM_DTYPES}


def parse_sum_dtype(name) -> torch.dtype | None:
    """The integer dtype named ``name`` (``"int8"``, ``"int16"``, ``"int32"``, ``"int64"``, or a
    torch dtype of those), None for None; a ValueError naming the choices otherwise."""
    if name is None or name in SUM_DTYPES:
        return name
    if name not in SUM_DTYPE_NAMES:
        raise ValueError(f"sum_dtype must be one of {', '.join(SUM_DTYPE_NAMES)}, got {name!r}")
    return SUM_DTYPE_NAMES[name]


def kept_count(k, d: int) -> int:
    """GlobalRandK's ``K`` for a vector of ``d`` elements: ``k`` itself (an integer >= 1),
    or ``max(1, round(k d))`` for a fraction ``0 < k < 1``."""
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k <= 0:
        raise ValueError(f"k must be > 0 (a count, or a fraction of d if < 1), got {k!r}")
    if k < 1:
        return max(1, int(math.floor(k * d + 0.5)))
    if k != int(k):
        raise ValueError(f"k must be an integer when >= 1 (or a fraction of d below 1), got {k!r}")
    return int(k)


def maxnorm_inner(precision: int, scales: tuple = ()) -> SummableCodec:
    """The paper's quantizer: single scale with precision ``p`` (``s = 2^p - 1``), or the
    multi-scale codec over ``scales`` (precisions) when given."""
    if scales:
        return MultiScaleMaxNormCodec(scales=tuple(scales))
    if isinstance(precision, bool) or not isinstance(precision, int) or not 1 <= precision <= 31:
        raise ValueError(f"bits (the max-norm precision log2(s + 1)) must be an integer in 1..31, got {precision!r}")
    return QSGDMaxNormCodec(bits=precision + 1)


def agree_scale_by(codec: SummableCodec, x: torch.Tensor, reduce: Callable[[torch.Tensor, str], torch.Tensor]):
    """Lines 5 and 7: the shared scale of a summable codec, agreed round by round. Each round
    reduces this worker's statistic ``codec.shared_scale(x, agreed so far)`` over the workers
    by ``reduce(stat, op)`` (``op`` is ``codec.scale_reduce_ops[r]``, ``"max"`` or ``"min"``; a
    transport's ``all_reduce``); returns the agreed value (one round) or the tuple of them.
    An agreed norm (a one-element float tensor) is read to the host here, once: the codecs'
    kernels take it as a number, and each use would read it again (on a GPU each read waits
    for the queued work); index tensors stay where they are."""
    agreed: list = []
    for op in codec.scale_reduce_ops:
        a = reduce(codec.shared_scale(x, tuple(agreed)), op)
        agreed.append(float(a) if a.numel() == 1 and a.is_floating_point() else a)
    return agreed[0] if len(agreed) == 1 else tuple(agreed)


def maxnorm_exchange(t: Transport, codec: SummableCodec, x: torch.Tensor, generator: torch.Generator | None,
                     sum_dtype: torch.dtype, dtype: torch.dtype, reduce: Callable | None = None,
                     lanes: Lanes | None = None):
    """Lines 5-10 over the transport ``t``: the shared scale (:func:`agree_scale_by`, by ``reduce``,
    default ``t.all_reduce``; synchronous, as the codes need it), this rank's integer codes
    drawn from ``generator``, their SUM all-reduce (asynchronous) and one reconstruction in
    ``dtype``. The sum travels as ``lanes`` (``codec.sum_lanes(...)``: int64 words of packed
    codes) where they send fewer bytes than ``sum_dtype`` for this many codes
    (:meth:`~lowbit.codecs.lanes.Lanes.pays`), else in ``sum_dtype``. Returns ``(future of
    the average, own)``, ``own()`` this rank's own decoded contribution (float64). Shared by
    :class:`MaxNormSGD` and the DDP hook."""
    scale = agree_scale_by(codec, x, t.all_reduce if reduce is None else reduce)  # lines 5 and 7
    d, n = x.numel(), t.world_size
    count = codec.kept(d) if isinstance(codec, RandKCodec) else d
    if lanes is not None and not lanes.pays(sum_dtype, count):
        lanes = None
    zeta = codec.encode_int(x, scale, generator, sum_dtype if lanes is None else lanes.code_dtype)  # line 8
    own = lambda: codec.decode_sum(zeta, scale, 1, numel=d, dtype=torch.float64)  # noqa: E731
    if lanes is None:  # line 9 in the overflow-safe dtype
        return then(t.all_reduce_async(zeta, "sum"),
                    lambda total: codec.decode_sum(total, scale, n, numel=d, dtype=dtype)), own  # line 10
    fut = t.all_reduce_async(lanes.pack(zeta), "sum", inplace=True)  # line 9 in packed lanes
    return then(fut, lambda words: codec.decode_sum(lanes.unpack(words, count), scale, n, numel=d,
                                                    dtype=dtype)), own  # line 10


@dataclass
class MaxNormState(State):
    """Nothing is remembered between steps: the vector's length ``d``, the integer dtype of
    the code sum and its summable lanes (None where they do not pay), fixed at setup, are
    kept as a cache (not checkpointed)."""

    d: int = transient(default=0)
    sum_dtype: torch.dtype | None = transient(default=None)
    lanes: Lanes | None = transient(default=None)


def _check_k(k) -> None:
    if not (isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k) and k > 0):
        raise ValueError(f"k must be > 0 (a count, or a fraction of d if < 1), got {k}")


SUM_DTYPE_OPT = Option("sum_dtype", None, "max-norm family: integer dtype of the code sum (int8, int16, int32, "
                       "int64; default the narrowest that cannot overflow)", str | None)
SCALES_OPT = Option("scales", None, "multi-scale bit widths, e.g. 2,6", str | None)
K_OPT = Option("k", None, "GlobalRandK: coordinates kept (an int, or a fraction of d if < 1)", float | None, _check_k)


def _scale_bits(cls, cfg) -> tuple[int, ...] | None:
    """``--scales 2,6`` as (2, 6); None (the class's default) when not given."""
    return cfg.scale_bits() or None


@dataclass(frozen=True)
class MaxNormSGD(CentralizedAlgorithm):
    """Max-norm quantized SGD: every worker rounds its gradient to integer codes against one
    scale that all workers agree on (the largest gradient norm), so the codes themselves can
    be summed by an ordinary all-reduce; all workers apply the decoded average.

    ``bits``: the precision ``p`` of Algorithm 1 (``s = 2^p - 1`` levels per sign).
    ``scales``: precisions of Algorithm 2's multi-scale quantizer, e.g. ``(2, 6)``
    (each coordinate takes the finest scale no worker overflows; ``bits`` then unused); empty
    for one scale. ``k``: GlobalRandK, the coordinates kept at each step (an int, or a
    fraction of ``d`` below 1; the same ones on every worker), None for all.
    ``sum_dtype``: the integer dtype of the code sum (default: the narrowest that cannot
    overflow). Paper 004, Algorithms 1 and 2 and section 3.3; see the module docstring."""

    # the precision p, the codec's one default; 1..31 here (maxnorm_inner checks it), wider than --bits
    bits: int = reads(BITS, default=QSGDMaxNormCodec.default_options()["bits"] - 1, check=False)
    scales: tuple[int, ...] = ()
    k: float | None = None
    sum_dtype: str | torch.dtype | None = reads(SUM_DTYPE_OPT, default=None)
    name = "maxnorm"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "scales", tuple(self.scales or ()))
        maxnorm_inner(self.bits, self.scales)
        object.__setattr__(self, "sum_dtype", parse_sum_dtype(self.sum_dtype))
        if self.k is not None:
            kept_count(self.k, 1)

    @property
    def inner(self) -> SummableCodec:
        """The quantizer of the kept coordinates (Algorithm 1's or Algorithm 2's)."""
        return maxnorm_inner(self.bits, self.scales)

    @classmethod
    def check_config(cls, cfg):
        algo = cls.from_config(cfg)
        inner = algo.inner
        try:
            inner.sum_dtype(cfg.workers, algo.sum_dtype)
        except ValueError:
            if algo.scales or cfg.sum_dtype is None:
                raise
            fits = str(inner.sum_dtype(cfg.workers, None)).replace("torch.", "")
            raise ValueError(f"sum_dtype={cfg.sum_dtype} would overflow: at bits={cfg.bits} a code is in "
                             f"[-{inner.max_code}, {inner.max_code}] (a sign and {cfg.bits} magnitude bits), and "
                             f"the sum of workers={cfg.workers} codes can reach {cfg.workers * inner.max_code}; "
                             f"use --sum-dtype {fits} or wider") from None

    def init(self, x, ctx):
        # a ValueError when sum_dtype cannot hold the sum of world_size codes
        inner = self.inner
        return MaxNormState(x.numel(), inner.sum_dtype(ctx.world_size, self.sum_dtype),
                            inner.sum_lanes(ctx.world_size, self.sum_dtype))

    def codec_at(self, ctx, step: int, d: int) -> SummableCodec:
        """The codec of step ``step`` for ``d`` elements (GlobalRandK: that step's shared
        selection of ``K`` coordinates, seeded by ``global_index_seed(seed, step)``)."""
        if self.k is None:
            return self.inner
        return RandKCodec(self.inner, k=kept_count(self.k, d)).with_seed(global_index_seed(ctx.seed, step))

    def worker_bits_per_element(self, state, ctx):
        # bits per coordinate of a message: multi-scale's index, sign and code; single-scale's
        # 2s + 1 levels at log2 (level_bits: 2.83 for precision 2, p + 1 from precision 4 on)
        p = self.inner.bits if self.scales else self.inner.wire_bits
        if self.k is not None and state is not None and state.d:
            return float(p) * min(kept_count(self.k, state.d), state.d) / state.d
        return float(p)

    def before_update(self, state, ctx, k, x, g, lr):
        fut, _ = maxnorm_exchange(ctx.transport, self.codec_at(ctx, k, state.d), g,
                                  shared_generator(ctx.seed, k, ctx.rank), state.sum_dtype, g.dtype,
                                  lanes=state.lanes)
        g.copy_(fut.wait())
        return state


@dataclass(frozen=True)
class MaxNormMultiScaleSGD(MaxNormSGD):
    """Multi-scale max-norm quantized SGD (Algorithm 2): :class:`MaxNormSGD` with the paper's
    two scales ``(2, 6)`` by default."""

    bits: int = field(default=MaxNormSGD.bits)  # not an option here: the scales set the precisions
    scales: tuple[int, ...] = reads(SCALES_OPT, build=_scale_bits, default=(2, 6))
    name = "maxnorm-multiscale"


@dataclass(frozen=True)
class GlobalRandKMaxNormSGD(MaxNormSGD):
    """GlobalRandK max-norm quantized SGD (section 3.3): :class:`MaxNormSGD` on ``k`` coordinates
    shared by all workers; ``k`` has no default."""

    k: float = reads(K_OPT, kw_only=True)
    name = "grandk-maxnorm"


@dataclass(frozen=True)
class GlobalRandKMaxNormMultiScaleSGD(MaxNormMultiScaleSGD):
    """GlobalRandK multi-scale max-norm quantized SGD (section 3.4): :class:`MaxNormMultiScaleSGD`
    on ``k`` coordinates shared by all workers; ``k`` has no default."""

    k: float = reads(K_OPT, kw_only=True)
    name = "grandk-maxnorm-multiscale"


__all__ = ["GlobalRandKMaxNormMultiScaleSGD", "GlobalRandKMaxNormSGD", "MaxNormMultiScaleSGD", "MaxNormSGD",
           "MaxNormState", "agree_scale_by", "kept_count", "maxnorm_exchange", "maxnorm_inner", "parse_sum_dtype"]
