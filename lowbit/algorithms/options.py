"""The options of every algorithm by name: :class:`AlgorithmOptions`, generated.

Each option is declared once (:class:`~lowbit.algorithms.config.Option`: name, default,
help, check) and read by the dataclass fields of the algorithms that take it
(:func:`~lowbit.algorithms.config.reads`). :class:`AlgorithmOptions` is the union of the
registered algorithms' options, one field each, with its default: the names by which every
entry point names an algorithm's settings:

- ``lowbit train`` (``lowbit.train.TrainConfig`` extends this class with the run's own
  options: task, workers, steps...; the CLI has one ``--option`` per field, its help
  the field's ``metadata["help"]``);
- ``DecentralizedDataParallel(module, optimizer, name, **options)`` and
  ``lowbit.algorithms.build_worker(name, transport, **options)``;
- the DDP hooks' ``make_hook(name, **options)``.

An algorithm's ``options`` and ``from_config(opts)`` follow from its fields; an option it does
not read is refused by the wrapper and the hooks, and ignored by ``lowbit train`` (whose other
algorithms may use it).
"""

from __future__ import annotations

import re
from dataclasses import field, fields, make_dataclass

from ..codecs import CODECS, Codec, codec_name
from . import ALGORITHMS
from .config import CODEC, Option, options_of

__all__ = ["AlgorithmOptions", "algorithm_table", "all_options", "first_sentence", "opt"]


def opt(default, help: str, **meta):
    """A dataclass field of an options table: its default, its help text and CLI metadata."""
    return field(default=default, metadata={"help": help, **meta})


class _OptionsTable:
    """The methods of :class:`AlgorithmOptions` (its fields are generated, :func:`all_options`)."""

    def check_options(self) -> None:
        """Raise a ValueError naming the option and its valid range for any option out of range
        (each option's one check, :class:`~lowbit.algorithms.config.Option`), or a codec the
        algorithm cannot take."""
        from . import check_algorithm

        cls = check_algorithm(self.algorithm)  # a ValueError listing the names
        for o in all_options():
            o.validate(getattr(self, o.name))
        if self.codec is not None and not cls.codecs:
            raise ValueError(f"codec={self.codec!r}: algorithm={self.algorithm!r} sends one fixed format; "
                             f"omit --codec")
        if cls.codecs:
            self.make_codec(cls.codecs)  # a bad combination fails here, before any worker starts

    def make_codec(self, allowed: tuple[str, ...]) -> Codec:
        """The codec ``codec`` names (default: the first of ``allowed``, names of
        ``lowbit.codecs.CODECS``), built from these options by its ``from_options``."""
        name = codec_name(self.codec) if self.codec else allowed[0]  # a former spelling: warned
        if name not in allowed:
            raise ValueError(f"codec={name!r} is not available for algorithm={self.algorithm!r}; "
                             f"choose one of: {', '.join(allowed)}")
        return CODECS[name].from_options(self)

    def scale_bits(self) -> tuple[int, ...]:
        """``scales="2,6"`` as (2, 6)."""
        if self.scales is None:
            return ()
        try:
            return tuple(int(s) for s in str(self.scales).split(","))
        except ValueError:
            raise ValueError(f"scales must be comma-separated integers such as 2,6, got {self.scales!r}") from None

    @classmethod
    def option_names(cls) -> list[str]:
        """The field names: every option of the table."""
        return [f.name for f in fields(cls)]


def all_options() -> tuple[Option, ...]:
    """Every registered algorithm's options, each once: ``codec``, then in registry order."""
    seen = {CODEC.name: CODEC}
    for cls in ALGORITHMS.values():
        for o in options_of(cls):
            if seen.setdefault(o.name, o) is not o:
                raise TypeError(f"option {o.name!r} is declared twice ({cls.__name__}'s differs): declare it once")
    return tuple(seen.values())


AlgorithmOptions = make_dataclass(
    "AlgorithmOptions",
    [("algorithm", str, opt("moniqua", f"one of: {', '.join(ALGORITHMS)}")),
     *((o.name, o.type, opt(o.default, o.help, **o.cli)) for o in all_options())],
    bases=(_OptionsTable,),
    namespace={"__doc__": "Every algorithm's options by name, with one default each (see the module docstring)."})
AlgorithmOptions.__module__ = __name__


def first_sentence(cls) -> str:
    """What ``cls`` is: the first sentence of its docstring, on one line ("" without one)."""
    doc = " ".join((cls.__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def algorithm_table() -> str:
    """The markdown table of every registered algorithm (``docs/ALGORITHMS.md``): its name,
    family, what it is (its docstring's first sentence), the ``codec`` values it takes (the
    first is its default) and the options it reads, each a link-free option name."""
    rows = ["| algorithm | family | what it is | codec | options |", "|---|---|---|---|---|"]
    for name, cls in ALGORITHMS.items():
        first = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", first_sentence(cls)).replace("``", "`")  # reST roles to markdown
        rows.append(f"| `{name}` | {cls.family} | {first.replace('|', '/')} | "
                    f"{', '.join(f'`{c}`' for c in cls.codecs) or '-'} | "
                    f"{', '.join(f'`{o}`' for o in cls.options) or '-'} |")
    return "\n".join(rows) + "\n"


DOCS_HEADER = """# Algorithms

Every algorithm `lowbit train --algorithm NAME`, `DecentralizedDataParallel(module, optimizer, NAME, **options)`
and, for the centralized ones, `make_hook(NAME, **options)` accept, with the options each reads
(`lowbit train --help` says what each option means; the same names and defaults everywhere).
Generated from the registry by `python -m lowbit.algorithms.options > docs/ALGORITHMS.md`;
`tests/test_registry.py` checks that this file is current.

"""

if __name__ == "__main__":
    print(DOCS_HEADER + algorithm_table(), end="")
