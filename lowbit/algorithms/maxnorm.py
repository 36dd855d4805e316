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
    9: zeta   = SUM all-reduce of zeta_m                         (in codec.sum_dtype(M))
   10: g^     = ||w|| zeta / (M s*)                              (one reconstruction)

The integer codes travel in the narrowest integer dtype whose sum over ``M``
workers cannot overflow (``codec.sum_dtype(M)``, int8 for 2-bit codes up to
127 workers), or in ``sum_dtype`` if given (ValueError when it is too narrow).
The stochastic rounding of worker ``m`` draws from ``shared_generator(seed,
t, m)``.

GlobalRandK: every worker keeps the same ``K`` coordinates at step ``t``
(:class:`~lowbit.codecs.RandKCodec` seeded with ``global_index_seed(seed, t)``,
nothing sent for them); only those go through lines 5-10, and the average is
scattered back and rescaled by ``d / K`` (unbiased). ``K``: an int, or a
fraction of ``d`` when below 1.

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

import torch

from ..codecs import MultiScaleMaxNormCodec, QSGDMaxNormCodec, RandKCodec, global_index_seed
from ..codecs.base import SUM_DTYPES, SummableCodec
from ..codecs.rng import shared_generator
from .legacy import CentralizedAlgorithm

SUM_DTYPE_NAMES = {str(d).replace("torch.", ""): d for d in SUM_DTYPES}


def parse_sum_dtype(name) -> torch.dtype | None:
    if name is None:
        return None
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


class MaxNormSGD(CentralizedAlgorithm):
    """QSGDMaxNorm / QSGDMaxNormMultiScale, optionally GlobalRandK; see the module docstring."""

    name = "maxnorm"
    multiscale = False
    randk = False

    def __init__(self, transport, *, bits: int = 2, scales: tuple = (2, 6), k=None,
                 sum_dtype: torch.dtype | str | None = None, seed: int = 0):
        super().__init__(transport, seed=seed)
        self.inner = maxnorm_inner(bits, scales if self.multiscale else ())
        if isinstance(sum_dtype, str) or sum_dtype is None:
            sum_dtype = parse_sum_dtype(sum_dtype)
        self.dtype = self.inner.sum_dtype(self.world_size, sum_dtype)  # ValueError when it cannot hold the sum
        if self.randk:
            if k is None:
                raise ValueError(f"{self.name} needs k (coordinates kept: an int, or a fraction of d if < 1)")
            kept_count(k, 1)
        self.k = k

    @classmethod
    def _scales(cls, cfg):
        if not cls.multiscale:
            return ()
        return cfg.scale_bits() or (2, 6)

    @classmethod
    def check_config(cls, cfg):
        inner = maxnorm_inner(cfg.bits, cls._scales(cfg))
        try:
            inner.sum_dtype(cfg.workers, parse_sum_dtype(cfg.sum_dtype))
        except ValueError:
            if cls.multiscale or cfg.sum_dtype is None:
                raise
            fits = str(inner.sum_dtype(cfg.workers, None)).replace("torch.", "")
            raise ValueError(f"sum_dtype={cfg.sum_dtype} would overflow: at bits={cfg.bits} a code is in "
                             f"[-{inner.max_code}, {inner.max_code}] (a sign and {cfg.bits} magnitude bits), and "
                             f"the sum of workers={cfg.workers} codes can reach {cfg.workers * inner.max_code}; "
                             f"use --sum-dtype {fits} or wider") from None
        if cls.randk and cfg.k is None:
            raise ValueError(f"algorithm={cls.name!r} needs --k (coordinates kept: an int, or a fraction of d if < 1)")
        if cls.randk:
            kept_count(cfg.k, 1)

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, bits=cfg.bits, scales=cls._scales(cfg), k=cfg.k, sum_dtype=cfg.sum_dtype,
                   seed=cfg.seed)

    def setup(self, x):
        self.d = x.numel()
        self.K = kept_count(self.k, self.d) if self.randk else None

    def codec_at(self, step: int) -> SummableCodec:
        """The codec of step ``step`` (GlobalRandK: with that step's shared selection seed)."""
        if not self.randk:
            return self.inner
        return RandKCodec(self.inner, k=self.K).with_seed(global_index_seed(self.seed, step))

    def nominal_bits_per_element(self):
        # bits per coordinate of a message: multi-scale's index, sign and code; single-scale's
        # 2s + 1 levels at log2 (level_bits: 2.83 for precision 2, p + 1 from precision 4 on)
        p = self.inner.bits if self.multiscale else self.inner.wire_bits
        if self.randk and getattr(self, "d", 0):
            return float(p) * min(self.K, self.d) / self.d
        return float(p)

    def before_update(self, k, x, g, lr):
        t = self.transport
        codec = self.codec_at(k)
        agreed: list[torch.Tensor] = []
        for op in codec.scale_reduce_ops:  # line 5 (MAX of the norm), line 7 (MIN of the scale index)
            agreed.append(t.all_reduce(codec.shared_scale(g, tuple(agreed)), op))
        scale = agreed[0] if len(agreed) == 1 else tuple(agreed)
        zeta = codec.encode_int(g, scale, shared_generator(self.seed, k, self.rank))  # line 8
        total = t.all_reduce(zeta.to(self.dtype), "sum")  # line 9, in the overflow-safe dtype
        g.copy_(codec.decode_sum(total, scale, self.world_size, numel=self.d, dtype=g.dtype))  # line 10


class MaxNormMultiScaleSGD(MaxNormSGD):
    name = "maxnorm-multiscale"
    multiscale = True


class GlobalRandKMaxNormSGD(MaxNormSGD):
    name = "grandk-maxnorm"
    randk = True


class GlobalRandKMaxNormMultiScaleSGD(MaxNormSGD):
    name = "grandk-maxnorm-multiscale"
    multiscale = True
    randk = True


__all__ = ["GlobalRandKMaxNormMultiScaleSGD", "GlobalRandKMaxNormSGD", "MaxNormMultiScaleSGD", "MaxNormSGD",
           "kept_count", "maxnorm_inner", "parse_sum_dtype"]
