"""Hooks by name: every centralized algorithm of ``lowbit train`` and the codec hooks of
:data:`HOOKS`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...algorithms import ALGORITHMS, from_options
from ...algorithms.allreduce import AllReduceSGD
from ...algorithms.base import Algorithm
from ...algorithms.compressed import GatheredAlgorithm, PowerSGD
from ...algorithms.dqsg import NDQSG
from ...algorithms.maxnorm import MaxNormSGD
from ...algorithms.options import first_sentence
from ...codecs.base import Codec
from ...codecs.dithered import DitheredCodec
from ...codecs.identity import IdentityCodec
from ...codecs.lowp import HalfCodec
from ...codecs.maxnorm import MultiScaleMaxNormCodec, QSGDMaxNormCodec
from ...codecs.qsgd import QSGDCodec
from ...codecs.randk import RandKCodec
from ...codecs.sign import SignCodec
from ...codecs.terngrad import TernGradCodec
from .hook import lowbit_hook
from .state import HOOK_BUCKET, HOOK_CLIP, LowbitHookState, wire_method

HOOKS: dict[str, tuple[Any, str]] = {  # codec hooks: name -> (codec factory, description)
    "fp32": (lambda: IdentityCodec(), "plain fp32 all-reduce average (exact reference)"),
    "fp16": (lambda: HalfCodec("fp16"), "fp16 cast, all-reduce, cast back"),
    "bf16": (lambda: HalfCodec("bf16"), "bf16 cast, all-reduce, cast back"),
    "qsgd_maxnorm": (lambda bits=4, norm="l2": QSGDMaxNormCodec(bits=bits, norm=norm),
                     "QSGDMaxNorm: MAX norm, SUM of integer codes"),
    "qsgd_maxnorm_multiscale": (lambda scales=(2, 6), norm="l2": MultiScaleMaxNormCodec(scales=tuple(scales), norm=norm),
                                "multi-scale QSGDMaxNorm: MAX norm, MIN scale index, SUM of codes"),
    "grandk_maxnorm": (lambda k=10000, bits=4, norm="l2", rescale=True:
                       RandKCodec(QSGDMaxNormCodec(bits=bits, norm=norm), k=k, rescale=rescale),
                       "GlobalRandKMaxNorm: shared k coordinates, QSGDMaxNorm on them"),
    "grandk_maxnorm_multiscale": (lambda k=10000, scales=(2, 6), norm="l2", rescale=True:
                                  RandKCodec(MultiScaleMaxNormCodec(scales=tuple(scales), norm=norm), k=k,
                                             rescale=rescale),
                                  "GlobalRandKMaxNormMultiScale: shared k coordinates, multi-scale on them"),
    "grandk_fp32": (lambda k=10000, rescale=True: RandKCodec(IdentityCodec(), k=k, rescale=rescale),
                    "global random-k, fp32 values of the shared coordinates"),
    "sign": (lambda scale="mean_abs": SignCodec(scale=scale),
             "scaled sign (EF-SignSGD), error feedback on: all-gather of 1-bit payloads"),
    "dithered": (lambda levels=1, subtractive=True, partitions=1:
                 DitheredCodec(levels=levels, subtractive=subtractive, partitions=partitions),
                 "DQSG: all-gather, decode with each sender's regenerated dither"),
}

_STATE_OPTIONS = ("process_group", "seed", "error_feedback", "model", "nonfinite", "per_layer")
_UNSET = object()


def hook_codec(codec, bucket=_UNSET, clip=_UNSET):
    """The codec as :func:`make_hook` sends it, with the papers' quantization: ``bucket``
    (default :data:`HOOK_BUCKET` = 512, None for one norm per DDP bucket) for the QSGD codec and
    the single-scale max-norm codec (also inside a global random-k), one norm per bucket of that
    many coordinates; ``clip`` (default :data:`HOOK_CLIP` = 2.5, None for none) for TernGrad,
    its clipping factor. ValueError for an option the codec does not take, or out of range
    (``bucket`` an integer in 1..2^31 - 1, ``clip`` a finite number > 0)."""
    if isinstance(codec, RandKCodec):
        inner = hook_codec(codec.inner, bucket, _UNSET) if isinstance(codec.inner, QSGDMaxNormCodec) else None
        if inner is None and bucket is not _UNSET:
            raise ValueError(f"bucket: the codec {type(codec.inner).__name__} inside RandK has no buckets (bucket is "
                             f"for qsgd and the single-scale max-norm codecs)")
        if clip is not _UNSET:
            raise ValueError("clip is for TernGrad (its clipping factor), not a RandK codec")
        return codec if inner is None else dataclasses.replace(codec, inner=inner)
    if bucket is not _UNSET and not isinstance(codec, (QSGDCodec, QSGDMaxNormCodec)):
        raise ValueError(f"bucket (coordinates per shared norm) is for qsgd and the single-scale max-norm codecs, "
                         f"not {type(codec).__name__}")
    if clip is not _UNSET and not isinstance(codec, TernGradCodec):
        raise ValueError(f"clip (TernGrad's clipping factor) is for TernGrad, not {type(codec).__name__}")
    if isinstance(codec, (QSGDCodec, QSGDMaxNormCodec)):
        return dataclasses.replace(codec, bucket=HOOK_BUCKET if bucket is _UNSET else bucket)
    if isinstance(codec, TernGradCodec):
        return dataclasses.replace(codec, clip=HOOK_CLIP if clip is _UNSET else clip)
    return codec


def centralized_names() -> list[str]:
    """The centralized algorithms of the registry (``lowbit train --algorithm`` names), each
    a hook name of :func:`make_hook` with the algorithm's own options."""
    return [name for name, cls in ALGORITHMS.items() if cls.family == "centralized"]


def hook_algorithm(name: str, **options) -> Algorithm:
    """The centralized algorithm ``name`` with ``options`` (names of
    :class:`~lowbit.algorithms.options.AlgorithmOptions`, as ``lowbit train`` takes them: its
    defaults for the others): ValueError for an option the algorithm does not read (listing
    those it reads) or out of range."""
    return from_options(name, also=_STATE_OPTIONS, **options)


def algorithm_codec(algo: Algorithm) -> tuple[Codec | Algorithm, dict]:
    """What a hook sends for the centralized algorithm ``algo``: ``(codec, state options)``
    for :class:`LowbitHookState`. The algorithm's codec and rank, so that a hook and ``lowbit
    train`` quantize alike; the algorithm itself where no codec path carries it (NDQSG)."""
    if isinstance(algo, AllReduceSGD):
        return IdentityCodec(), {}
    if isinstance(algo, MaxNormSGD):
        inner, kw = algo.inner, {"sum_dtype": algo.sum_dtype}
        if algo.k is None:
            return inner, kw
        if algo.k < 1:  # a fraction of each bucket
            return RandKCodec(inner, k=1), {**kw, "kept": algo.k}
        return RandKCodec(inner, k=int(algo.k)), kw
    if isinstance(algo, PowerSGD):
        return algo.codec, {}
    if isinstance(algo, GatheredAlgorithm) and not isinstance(algo, NDQSG):
        if algo.server != "allgather":
            raise ValueError(f"server={algo.server!r}: the DDP hooks all-gather the payloads (server='allgather')")
        return algo.codec, {}
    return algo, {}


def make_hook(name: str, **options) -> tuple[LowbitHookState, Any]:
    """``(state, hook)`` for the hook ``name``: a centralized algorithm of ``lowbit train``
    (:func:`centralized_names`, e.g. ``make_hook("qsgd", bits=4, seed=1)``, its options named
    as the CLI names them: ``bits``, ``k``, ``scales``, ``powersgd_rank``, ``levels``,
    ``sum_dtype``...), or a codec hook of :data:`HOOKS` (e.g. ``make_hook("qsgd_maxnorm",
    bits=4)``, the options of its codec). ``process_group``, ``seed``, ``error_feedback``,
    ``model``, ``nonfinite`` and ``per_layer`` go to :class:`LowbitHookState`.

    The quantizers get the papers' practice (:func:`hook_codec`): QSGD and single-scale
    QSGDMaxNorm (``qsgd``, ``maxnorm``, ``grandk-maxnorm``, ``qsgd_maxnorm``, ``grandk_maxnorm``)
    one norm per ``bucket`` = 512 coordinates, TernGrad one scale per layer (``per_layer``) with
    its gradient clipped at ``clip`` = 2.5 standard deviations; ``bucket=None`` / ``clip=None``
    / ``per_layer=False`` send the algorithm's codec as ``lowbit train`` does."""
    quant = {k: options.pop(k) for k in ("bucket", "clip") if k in options}
    state_kw = {k: options.pop(k) for k in _STATE_OPTIONS if k in options}
    if name in ALGORITHMS and ALGORITHMS[name].family == "centralized":
        codec, kw = algorithm_codec(hook_algorithm(name, **options))
        if not isinstance(codec, Codec):
            if quant:
                raise ValueError(f"{', '.join(quant)}: algorithm {name!r} runs as itself in the hook, without them")
            return LowbitHookState(codec, **state_kw, **kw), lowbit_hook
        return LowbitHookState(hook_codec(codec, **quant), **state_kw, **kw), lowbit_hook
    if name not in HOOKS:
        raise ValueError(f"name must be one of {sorted(set(HOOKS) | set(centralized_names()))}, got {name!r}")
    factory = HOOKS[name][0]
    try:
        codec = factory(**options)
    except TypeError as e:
        raise ValueError(f"bad options for hook {name!r}: {e}") from None
    return LowbitHookState(hook_codec(codec, **quant), **state_kw), lowbit_hook


def hook_table() -> list[tuple[str, str, str]]:
    """(name, wire method, description) of every hook name: the centralized algorithms (at
    their defaults; GlobalRandK with k = 1) and the codec hooks of :data:`HOOKS`."""
    rows = []
    for name in centralized_names():
        cls = ALGORITHMS[name]
        codec, _ = algorithm_codec(hook_algorithm(name, **({"k": 1} if "k" in cls.options else {})))
        rows.append((name, wire_method(codec), first_sentence(cls)))  # wire_method: the same with hook_codec
    return rows + [(name, wire_method(factory()), desc) for name, (factory, desc) in HOOKS.items()]
