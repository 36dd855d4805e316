"""An algorithm's options are its dataclass fields: how a field declares the options it reads.

An :class:`Option` is one name of ``lowbit train``/the wrapper/the hooks (``--theta-every``,
``theta_every=``), declared once: its default there, its help and its check. A field of an
algorithm class reads options with :func:`reads`::

    @dataclass(frozen=True)
    class Moniqua(GossipAlgorithm):
        theta_every: int = reads(THETA_EVERY, default=10)       # the option's value, checked
        codec: Codec = reads(CODEC, BITS, ROUNDING, build=...)  # built from several options

From the fields, :class:`~lowbit.algorithms.base.Algorithm` derives the rest: ``options`` (the
names an algorithm takes), ``from_config`` (a ``None`` option value, or a missing one, leaves
the field's default) and the checks of a field that holds one option's value
(``Algorithm.__post_init__``); :class:`~lowbit.algorithms.options.AlgorithmOptions` is the union
of every registered algorithm's options. A new option is one :class:`Option` and the field that
reads it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

from ..codecs import ROUNDINGS
from .gossip import check_gamma

__all__ = ["Option", "reads", "option_fields", "options_of", "values_from", "check_fields", "one_of", "int_at_least",
           "parse_theta", "codec_field", "CODEC", "BITS", "ROUNDING", "DELTA", "GAMMA", "CODEC_OPTIONS"]


@dataclass(frozen=True)
class Option:
    """One option: its ``name``, its ``default`` where every entry point names it, its ``help``
    (the CLI's), the annotation of its field in AlgorithmOptions (``type``), a ``check`` that
    raises a ValueError naming it for a bad value (None passes where the default is None), and
    CLI metadata (``cli``: ``type`` to parse it, ``aliases``)."""

    name: str
    default: Any
    help: str
    type: Any
    check: Callable[[Any], Any] | None = None
    cli: dict = field(default_factory=dict)

    def validate(self, value) -> None:
        """Raise the option's ValueError for a bad ``value``."""
        if self.check is not None and not (value is None and self.default is None):
            self.check(value)


def reads(*options: Option, build: Callable | None = None, check: bool = True, **field_kw) -> dataclasses.Field:
    """A dataclass field that reads ``options``: with no ``build``, the one option's value (checked
    by :meth:`Option.validate` unless ``check=False``: a class that takes a wider range than the
    command line, checking it itself); else ``build(cls, cfg)`` makes the value from the options
    of ``cfg`` (an AlgorithmOptions). ``field_kw``: ``default``, ``default_factory``, ``kw_only``."""
    if not options or (build is None and len(options) != 1):
        raise ValueError("reads() takes one option, or several with build=")
    return field(metadata={"options": options, "build": build, "check": check and build is None}, **field_kw)


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that read options, in field order."""
    return [f for f in dataclasses.fields(cls) if "options" in f.metadata]


def options_of(cls) -> tuple[Option, ...]:
    """The options ``cls`` reads, in field order, each once."""
    seen: dict[str, Option] = {}
    for f in option_fields(cls):
        for o in f.metadata["options"]:
            seen.setdefault(o.name, o)
    return tuple(seen.values())


def values_from(cls, cfg) -> dict:
    """The constructor arguments of ``cls`` from ``cfg``'s options: each field's ``build``, or the
    option's value; a value of None (or a build's None) leaves the field's default, and a field
    without one then is a ValueError naming the option."""
    kw = {}
    for f in option_fields(cls):
        build, (first, *_) = f.metadata["build"], f.metadata["options"]
        value = build(cls, cfg) if build is not None else getattr(cfg, first.name)
        if value is not None:
            kw[f.name] = value
        elif f.default is MISSING and f.default_factory is MISSING:
            flag = "--" + first.name.replace("_", "-")
            raise ValueError(f"algorithm={cls.name!r} needs {first.name} ({flag}: {first.help})")
    return kw


def check_fields(algorithm) -> None:
    """The checks of the fields of ``algorithm`` that hold one option's value."""
    for f in option_fields(type(algorithm)):
        if f.metadata["check"]:
            f.metadata["options"][0].validate(getattr(algorithm, f.name))


# ---- checks shared by several options -------------------------------------------------------
def one_of(name: str, choices) -> Callable:
    """A check that the value is one of ``choices``."""
    def check(v):
        if v not in choices:
            raise ValueError(f"{name}={v!r} is unknown; choose one of: {', '.join(choices)}")
    return check


def int_at_least(name: str, low: int, what: str = "") -> Callable:
    """A check that the value is an integer >= ``low`` (``what`` it counts, for the message)."""
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}{f' ({what})' if what else ''}, got {v!r}")
    return check


def parse_theta(v: str):
    """A CLI value that is a number or a word such as ``auto`` (anything else is reported by the checks)."""
    try:
        return float(v)
    except ValueError:
        return v


def _check_bits(v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {v}")


def _check_delta(v) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"delta must be > 0, got {v}")


# ---- the options that several families read -----------------------------------------------
CODEC = Option("codec", None, "codec of a quantized baseline (see the algorithm's list)", str | None)
BITS = Option("bits", 2, "bits per element (1..8)", int, _check_bits)
ROUNDING = Option("rounding", None, f"one of: {', '.join(ROUNDINGS)} (algorithm default if omitted)", str | None,
                  one_of("rounding", ROUNDINGS))
DELTA = Option("delta", 0.1, "quadratic offset and the naive quantizer's step (Theorem 1)", float, _check_delta)
GAMMA = Option("gamma", None, "consensus step size: Moniqua's slack matrix gamma W + (1 - gamma) I, ChocoSGD's gamma "
               "(algorithm default if omitted)", float | None, check_gamma)
#: The options that building a codec by name reads (``Codec.from_options``).
CODEC_OPTIONS = (CODEC, BITS, ROUNDING, DELTA)


def codec_field(**field_kw) -> dataclasses.Field:
    """The ``codec`` field of an algorithm with a ``codecs`` list: built by name from ``--codec``
    (default: the list's first) and the options a codec reads."""
    return reads(*CODEC_OPTIONS, build=lambda cls, cfg: cfg.make_codec(cls.codecs), **field_kw)
