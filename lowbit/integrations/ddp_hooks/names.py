"""Hooks by name: every centralized algorithm of ``lowbit train`` and the codec hooks of
:data:`HOOKS`."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ...algorithms import ALGORITHMS, from_options
from ...algorithms.allreduce import AllReduceSGD
from ...algorithms.base import Algorithm
from ...algorithms.compressed import GatheredAlgorithm, PowerSGD
from ...algorithms.dqsg import NDQSG
from ...algorithms.maxnorm import MaxNormSGD
from ...algorithms.options import first_sentence
from ...codecs.base import Codec
from ...codecs.identity import IdentityCodec
from ...codecs.maxnorm import QSGDMaxNormCodec
from ...codecs.qsgd import QSGDCodec
from ...codecs.randk import RandKCodec
from ...codecs.terngrad import TernGradCodec
from .hook import lowbit_hook
from .options import (DitheredHook, FP32Hook, GlobalRandKHook, GlobalRandKMaxNormHook, GlobalRandKMultiScaleHook,
                      HalfHook, HookOptions, MultiScaleMaxNormHook, QSGDMaxNormHook, SignHook)
from .state import HOOK_BUCKET, HOOK_CLIP, LowbitHookState, wire_method

#: The codec hooks: name -> (typed options class, options the name fixes). Names are the codec
#: registry's (``lowbit.codecs.CODECS``: lowercase, hyphens), and ``bf16``, the fp16 codec's other
#: dtype (as torch names its hooks). The centralized algorithms are hooks under their own names.
HOOKS: dict[str, tuple[type[HookOptions], dict]] = {
    "fp32": (FP32Hook, {}),
    "fp16": (HalfHook, {"dtype": "fp16"}),
    "bf16": (HalfHook, {"dtype": "bf16"}),
    "qsgd-maxnorm": (QSGDMaxNormHook, {}),
    "qsgd-maxnorm-multiscale": (MultiScaleMaxNormHook, {}),
    "grandk-fp32": (GlobalRandKHook, {}),
    "sign": (SignHook, {}),
    "dithered": (DitheredHook, {}),
}

#: Former hook names, accepted with a DeprecationWarning naming the current one. The codec hooks
#: of the global random-k max-norm codecs are the algorithms ``grandk-maxnorm`` and
#: ``grandk-maxnorm-multiscale`` (whose ``bits`` is the paper's precision, one less than the
#: codec's, and whose ``k`` has no default); the former names keep their own options.
RENAMED_HOOKS: dict[str, tuple[str, tuple[type[HookOptions], dict] | None]] = {
    "qsgd_maxnorm": ("qsgd-maxnorm", None),
    "qsgd_maxnorm_multiscale": ("qsgd-maxnorm-multiscale", None),
    "grandk_fp32": ("grandk-fp32", None),
    "grandk_maxnorm": ("grandk-maxnorm", (GlobalRandKMaxNormHook, {})),
    "grandk_maxnorm_multiscale": ("grandk-maxnorm-multiscale", (GlobalRandKMultiScaleHook, {})),
}

_STATE_OPTIONS = ("process_group", "seed", "error_feedback", "model", "nonfinite", "per_layer")
_QUANT_OPTIONS = ("bucket", "clip")
_UNSET = object()


def hook_codec(codec, bucket=_UNSET, clip=_UNSET):
    """The codec as :func:`make_hook` sends it, with the papers' quantization: ``bucket``
    (default :data:`HOOK_BUCKET` = 512, None for one norm per DDP bucket) for the QSGD codec and
    the single-scale max-norm codec (also inside a global random-k), one norm per bucket of that
    many coordinates; ``clip`` (default :data:`HOOK_CLIP` = 2.5, None for none) for TernGrad,
    its clipping factor. ValueError for an option the codec does not take, or out of range
    (``bucket`` an integer in 1..2^31 - 1, ``clip`` a finite number > 0).

    Quantization as the papers do it (:func:`hook_codec`, applied by :func:`make_hook`). A DDP
    bucket holds up to 25 MB of gradients of many layers; one norm (QSGD, QSGDMaxNorm) or one
    ``max |g|`` (TernGrad) for all of it makes a typical ``|g_i| / scale`` about ``1 / sqrt(n)``,
    so nearly every code is 0 and the rest are huge: a variance ``~ sqrt(n) / s`` times
    ``||g||^2`` (40 at n = 79k, s = 7), which left a 79k-parameter CNN under Adam at 4 bits
    2 to 5 points of test accuracy below fp32 DDP (a user's run ended at chance). So :func:`make_hook` gives the QSGD codec and the
    single-scale max-norm codec (also inside a global random-k) one norm per ``bucket`` =
    :data:`HOOK_BUCKET` = 512 consecutive coordinates (QSGD's bucketing; for the max-norm codec
    each bucket's norm is shared by the MAX all-reduce, ``4 ceil(n / 512)`` bytes, counted in the
    ledger), and TernGrad one message and scale per parameter (``per_layer``) with the gradient
    clipped at ``clip`` = :data:`HOOK_CLIP` = 2.5 standard deviations (TernGrad's section 3.3).
    ``bucket=None``, ``clip=None``, ``per_layer=False`` send the algorithm's own codec, as
    ``lowbit train`` does (its algorithms are unchanged). The multi-scale codecs keep one norm.
    ``tests/test_hooks_train.py`` trains the CNN with each hook within 1 point of torch's DDP.
    """
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


def _hook_options(name: str, options: dict) -> HookOptions:
    """The typed options of the codec hook ``name`` (of :data:`HOOKS`, or a former name of
    :data:`RENAMED_HOOKS`, warned) from keywords: a ValueError naming an option the hook does not
    take and those it takes."""
    if name in RENAMED_HOOKS:
        new, spec = RENAMED_HOOKS[name]
        warnings.warn(f"hook name {name!r} is deprecated: use {new!r}"
                      + ("" if spec is None else " (the algorithm's options: bits is the paper's precision, one "
                                                 "less than here; k has no default, the paper's is 10000)"),
                      DeprecationWarning, stacklevel=3)
        cls, fixed = spec or HOOKS[new]
    else:
        cls, fixed = HOOKS[name]
    unknown = sorted(set(options) - set(cls.option_names()))
    fixed_given = sorted(set(options) & set(fixed))
    if unknown or fixed_given:
        takes = [o for o in cls.option_names() if o not in fixed]
        what = unknown + [f"{o} (set by the name {name!r})" for o in fixed_given]
        raise ValueError(f"hook {name!r} does not take option(s) {', '.join(what)}; it takes: "
                         f"{', '.join(takes) or 'no codec options'} (and the state's {', '.join(_STATE_OPTIONS)}, "
                         f"{', '.join(_QUANT_OPTIONS)})")
    return cls(**{**options, **fixed})


def make_hook(name: str | HookOptions, **options) -> tuple[LowbitHookState, Any]:
    """``(state, hook)`` for the hook ``name``: a centralized algorithm of ``lowbit train``
    (:func:`centralized_names`, e.g. ``make_hook("qsgd", bits=4, seed=1)``, its options named
    as the CLI names them: ``bits``, ``k``, ``scales``, ``powersgd_rank``, ``levels``,
    ``sum_dtype``...), or a codec hook of :data:`HOOKS` (e.g. ``make_hook("qsgd-maxnorm",
    bits=4)``, the fields of its typed options, :mod:`~lowbit.integrations.ddp_hooks.options`),
    or those typed options themselves (``make_hook(QSGDMaxNormHook(bits=4))``). ``process_group``,
    ``seed``, ``error_feedback``, ``model``, ``nonfinite`` and ``per_layer`` go to
    :class:`LowbitHookState`. An option the hook does not take is a ValueError naming it and
    those the hook takes.

    The quantizers get the papers' practice (:func:`hook_codec`): QSGD and single-scale
    QSGDMaxNorm (``qsgd``, ``maxnorm``, ``grandk-maxnorm``, ``qsgd-maxnorm``) one norm per
    ``bucket`` = 512 coordinates, TernGrad one scale per layer (``per_layer``) with its gradient
    clipped at ``clip`` = 2.5 standard deviations; ``bucket=None`` / ``clip=None`` /
    ``per_layer=False`` send the algorithm's codec as ``lowbit train`` does."""
    quant = {k: options.pop(k) for k in _QUANT_OPTIONS if k in options}
    state_kw = {k: options.pop(k) for k in _STATE_OPTIONS if k in options}
    if isinstance(name, HookOptions):
        if options:
            raise ValueError(f"options {', '.join(sorted(options))}: give them to {type(name).__name__}")
        return LowbitHookState(hook_codec(name.codec(), **quant), **state_kw), lowbit_hook
    if name in ALGORITHMS and ALGORITHMS[name].family == "centralized":
        codec, kw = algorithm_codec(hook_algorithm(name, **options))
        if not isinstance(codec, Codec):
            if quant:
                raise ValueError(f"{', '.join(quant)}: algorithm {name!r} runs as itself in the hook, without them")
            return LowbitHookState(codec, **state_kw, **kw), lowbit_hook
        return LowbitHookState(hook_codec(codec, **quant), **state_kw, **kw), lowbit_hook
    if name not in HOOKS and name not in RENAMED_HOOKS:
        raise ValueError(f"name must be one of {', '.join(hook_names())}, got {name!r}")
    return LowbitHookState(hook_codec(_hook_options(name, options).codec(), **quant), **state_kw), lowbit_hook


def hook_names() -> list[str]:
    """Every hook name: the centralized algorithms and the codec hooks of :data:`HOOKS`."""
    return centralized_names() + list(HOOKS)


def hook_table() -> list[tuple[str, str, str]]:
    """(name, wire method, description) of every hook name: the centralized algorithms (at
    their defaults; GlobalRandK with k = 1) and the codec hooks of :data:`HOOKS`."""
    rows = []
    for name in centralized_names():
        cls = ALGORITHMS[name]
        codec, _ = algorithm_codec(hook_algorithm(name, **({"k": 1} if "k" in cls.options else {})))
        rows.append((name, wire_method(codec), first_sentence(cls)))  # wire_method: the same with hook_codec
    return rows + [(name, wire_method(cls(**fixed).codec()), cls.description) for name, (cls, fixed) in HOOKS.items()]
