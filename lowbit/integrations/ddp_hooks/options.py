"""Typed options of the codec hooks (:data:`~lowbit.integrations.ddp_hooks.HOOKS`), one frozen
dataclass per hook family, as torch's ``PowerSGDState`` types its parameters::

    state, hook = make_hook("qsgd-maxnorm", bits=5)               # the keywords build QSGDMaxNormHook
    state, hook = make_hook(QSGDMaxNormHook(bits=5, norm="linf"))  # or the options themselves

Each field's default is the codec class's own (:meth:`~lowbit.codecs.Codec.default_options`: one
default per option, wherever the codec is built), except where a hook follows a paper's
experiments (global random-k: ``k = 10000``, the max-norm paper's K). ``__post_init__`` checks
the options by building the codec: a bad value is a ValueError naming the option and its valid
values. :meth:`HookOptions.codec` is the codec the hook sends (before :func:`hook_codec` gives
it the papers' buckets and clipping). The centralized algorithms' hooks take their options
from :class:`~lowbit.algorithms.options.AlgorithmOptions` instead.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from ...codecs import (Codec, DitheredCodec, HalfCodec, IdentityCodec, MultiScaleMaxNormCodec, QSGDMaxNormCodec,
                       RandKCodec, SignCodec)

#: The max-norm paper's K, the kept coordinates of its global random-k experiments ("we choose
#: the value of K as 10000 for all the experiments"): the global random-k hooks' default ``k``
PAPER_K = 10000


def _default(codec: type[Codec], option: str):
    """The codec class's default of ``option``, as a dataclass field default."""
    value = codec.default_options()[option]
    return field(default=value)


@dataclass(frozen=True)
class HookOptions(ABC):
    """The options of one codec hook; subclasses say which codec they build (:meth:`codec`) and
    describe the hook (``description``)."""

    description: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.codec()  # the codec's own checks name the option and its valid values

    @abstractmethod
    def codec(self) -> Codec:
        """The codec this hook sends."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The names of the options (the dataclass fields)."""
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class FP32Hook(HookOptions):
    """Plain fp32 all-reduce average (the exact reference); no options."""

    description: ClassVar[str] = "plain fp32 all-reduce average (exact reference)"

    def codec(self) -> Codec:
        return IdentityCodec()


@dataclass(frozen=True)
class HalfHook(HookOptions):
    """fp16 or bf16 cast, all-reduce, cast back (torch's ``fp16_compress_hook`` and
    ``bf16_compress_hook``). ``dtype``: ``"fp16"`` or ``"bf16"``."""

    dtype: str = _default(HalfCodec, "dtype")
    description: ClassVar[str] = "half-precision cast, all-reduce, cast back"

    def codec(self) -> Codec:
        return HalfCodec(self.dtype)


@dataclass(frozen=True)
class QSGDMaxNormHook(HookOptions):
    """QSGDMaxNorm: MAX of the norms, one SUM all-reduce of the integer codes. ``bits``: the
    codec's bits per code, sign included (the paper's precision plus one: the default 3 is its
    "QSGD-MN 2", as the ``maxnorm`` algorithm's default ``bits=2``); ``norm``: ``"l2"`` or
    ``"linf"``."""

    bits: int = _default(QSGDMaxNormCodec, "bits")
    norm: str = _default(QSGDMaxNormCodec, "norm")
    description: ClassVar[str] = "QSGDMaxNorm: MAX norm, SUM of integer codes"

    def codec(self) -> Codec:
        return QSGDMaxNormCodec(bits=self.bits, norm=self.norm)


@dataclass(frozen=True)
class MultiScaleMaxNormHook(HookOptions):
    """Multi-scale QSGDMaxNorm: MAX of the norms, MIN of the scale indices, SUM of the codes.
    ``scales``: the scales' precisions (the paper's two-scale (2, 6) by default); ``norm``."""

    scales: tuple = _default(MultiScaleMaxNormCodec, "scales")
    norm: str = _default(MultiScaleMaxNormCodec, "norm")
    description: ClassVar[str] = "multi-scale QSGDMaxNorm: MAX norm, MIN scale index, SUM of codes"

    def codec(self) -> Codec:
        return MultiScaleMaxNormCodec(scales=tuple(self.scales), norm=self.norm)


@dataclass(frozen=True)
class GlobalRandKHook(HookOptions):
    """Global random-k with fp32 values: every rank keeps the same ``k`` coordinates of a bucket
    (``k``: the paper's 10000 by default), ``rescale`` by ``d / k``."""

    k: int = PAPER_K
    rescale: bool = _default(RandKCodec, "rescale")
    description: ClassVar[str] = "global random-k, fp32 values of the shared coordinates"

    def inner(self) -> Codec:
        """The codec of the kept values."""
        return IdentityCodec()

    def codec(self) -> Codec:
        return RandKCodec(self.inner(), k=self.k, rescale=self.rescale)


@dataclass(frozen=True)
class GlobalRandKMaxNormHook(GlobalRandKHook):
    """GlobalRandKMaxNorm: the shared ``k`` coordinates, QSGDMaxNorm on them (``bits``, ``norm``
    as :class:`QSGDMaxNormHook`'s)."""

    bits: int = _default(QSGDMaxNormCodec, "bits")
    norm: str = _default(QSGDMaxNormCodec, "norm")
    description: ClassVar[str] = "GlobalRandKMaxNorm: shared k coordinates, QSGDMaxNorm on them"

    def inner(self) -> Codec:
        return QSGDMaxNormCodec(bits=self.bits, norm=self.norm)


@dataclass(frozen=True)
class GlobalRandKMultiScaleHook(GlobalRandKHook):
    """GlobalRandKMaxNormMultiScale: the shared ``k`` coordinates, multi-scale on them."""

    scales: tuple = _default(MultiScaleMaxNormCodec, "scales")
    norm: str = _default(MultiScaleMaxNormCodec, "norm")
    description: ClassVar[str] = "GlobalRandKMaxNormMultiScale: shared k coordinates, multi-scale on them"

    def inner(self) -> Codec:
        return MultiScaleMaxNormCodec(scales=tuple(self.scales), norm=self.norm)


@dataclass(frozen=True)
class SignHook(HookOptions):
    """Scaled sign (EF-SignSGD), error feedback on: all-gather of 1-bit payloads. ``scale``: the
    codec's (``"mean_abs"``...)."""

    scale: str = _default(SignCodec, "scale")
    description: ClassVar[str] = "scaled sign (EF-SignSGD), error feedback on: all-gather of 1-bit payloads"

    def codec(self) -> Codec:
        return SignCodec(scale=self.scale)


@dataclass(frozen=True)
class DitheredHook(HookOptions):
    """DQSG: all-gather, each payload decoded with its sender's regenerated dither. ``levels``
    (M; 1 by default, the coarsest), ``subtractive``, ``partitions`` (the codec's defaults)."""

    levels: int = 1
    subtractive: bool = _default(DitheredCodec, "subtractive")
    partitions: int = _default(DitheredCodec, "partitions")
    description: ClassVar[str] = "DQSG: all-gather, decode with each sender's regenerated dither"

    def codec(self) -> Codec:
        return DitheredCodec(levels=self.levels, subtractive=self.subtractive, partitions=self.partitions)


__all__ = ["PAPER_K", "HookOptions", "FP32Hook", "HalfHook", "QSGDMaxNormHook", "MultiScaleMaxNormHook",
           "GlobalRandKHook", "GlobalRandKMaxNormHook", "GlobalRandKMultiScaleHook", "SignHook", "DitheredHook"]
