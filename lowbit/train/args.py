"""The ``lowbit train`` options as argparse arguments, one per :class:`TrainConfig` field.

Shared by the command line (:mod:`lowbit.cli`) and by the experiments that
name their runs as ``lowbit train`` options (:func:`lowbit.repro.tables.train_config`),
so both parse the same options with the same defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..algorithms.options import AlgorithmOptions
from .config import TrainConfig


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Add one option per :class:`TrainConfig` field to ``p``, typed and documented by the field,
    then the run's ``--out``, ``--overwrite`` and ``--no-progress``."""
    hints = typing.get_type_hints(TrainConfig)
    algorithm_options = set(AlgorithmOptions.option_names())
    groups = {True: p.add_argument_group("algorithm options (the same names in DecentralizedDataParallel and "
                                         "make_hook)"),
              False: p.add_argument_group("run options")}
    for f in sorted(dataclasses.fields(TrainConfig), key=lambda f: f.name in algorithm_options):
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kw = dict(dest=f.name, default=f.default, help=f.metadata.get("help"))
        hint = hints[f.name]
        if hint is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
            kw["type"] = f.metadata.get("type", base[0] if len(base) == 1 else str)
        groups[f.name in algorithm_options].add_argument(*flags, **kw)
    p.add_argument("--out", default=None, help="directory for metrics.jsonl and summary.json (checked before "
                                                "training; a previous run there needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def train_parser(prog: str = "lowbit train") -> argparse.ArgumentParser:
    """A parser of ``lowbit train``'s options alone (no subcommand)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_train_arguments(parser)
    return parser
