"""The options of the algorithms, declared once: their names, types, defaults, help and checks.

:class:`AlgorithmOptions` is the table. Its fields are the options by which every
entry point names an algorithm's settings, with one default each:

- ``lowbit train`` (``lowbit.train.TrainConfig`` extends this class with the run's own
  options: task, workers, steps...; the CLI has one ``--option`` per field, its help
  the field's ``metadata["help"]``);
- ``DecentralizedDataParallel(module, optimizer, name, **options)`` and
  ``lowbit.algorithms.build_worker(name, transport, **options)``;
- the DDP hooks' ``make_hook(name, **options)``.

Each algorithm class names the options it reads in its ``options`` attribute and builds
itself from them in ``from_config(opts)``; an option it does not name is refused by the
wrapper and the hooks, and ignored by ``lowbit train`` (whose other algorithms may use it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from ..codecs import CODECS, ROUNDINGS, Codec, codec_name
from . import ALGORITHMS
from .compressed import SERVERS
from .dqsg import DEFAULT_FAILURE as NESTED_FAILURE, DEFAULT_K as NESTED_K
from .gossip import check_gamma
from .moniqua import THETA_EVERY, THETA_SCHEDULES, check_theta

__all__ = ["AlgorithmOptions", "algorithm_table", "first_sentence", "opt"]

def opt(default, help: str, **meta):
    """A dataclass field of an options table: its default, its help text and CLI metadata."""
    return field(default=default, metadata={"help": help, **meta})


def parse_theta(v: str):
    """--theta takes a number or ``auto`` (anything else is reported by the checks)."""
    try:
        return float(v)
    except ValueError:
        return v


@dataclass
class AlgorithmOptions:
    """Every algorithm's options by name, with one default each (see the module docstring)."""

    algorithm: str = opt("moniqua", f"one of: {', '.join(ALGORITHMS)}")
    bits: int = opt(2, "bits per element (1..8)")
    # --- the decentralized family ---
    theta: float | str | None = opt(None, "Moniqua's a priori bound theta (> 0), or 'auto' (the default of "
                                     "moniqua and moniqua-d2: follows the blocks verification finds wrong)",
                                     type=parse_theta)
    theta_schedule: str = opt("constant", "constant, or lr (theta_k ~ lr_k)")
    theta_every: int = opt(THETA_EVERY, "--theta auto: steps between two theta agreements")
    verify: bool = opt(True, "Moniqua: send a hash of the quantized model; the receiver checks what it recovered")
    verify_block: int | None = opt(None, "Moniqua verification: elements per hashed block (a failed block is "
                                    "repaired alone; default by bits: 512 at 1 bit, 256 above)")
    entropy: str | None = opt(None, "entropy-code Moniqua's payload: zlib, bz2, lzma or ans")
    gamma: float | None = opt(None, "consensus step size: Moniqua's slack matrix gamma W + (1 - gamma) I, "
                               "ChocoSGD's gamma (algorithm default if omitted)")
    delta: float = opt(0.1, "quadratic offset and the naive quantizer's step (Theorem 1)")
    codec: str | None = opt(None, "codec of a quantized baseline (see the algorithm's list)")
    rounding: str | None = opt(None, f"one of: {', '.join(ROUNDINGS)} (algorithm default if omitted)")
    peer_selection: str = opt("all", "lowprec-decentralized: Bagua's peer selection, all or shift_one")
    hierarchical: bool = opt(True, "lowprec-decentralized: Bagua's hierarchical mode (average inside a node, "
                                    "gossip between node leaders, broadcast back)")
    communication_interval: int = opt(1, "lowprec-decentralized: communicate every this many steps (Bagua's)")
    node_size: int | None = opt(None, "lowprec-decentralized: workers per node (default: LOCAL_WORLD_SIZE on the "
                                       "torch backend, 1 on the thread backend)")
    bucket_bytes: int = opt(10 * 1024 ** 2, "lowprec-decentralized: bytes per bucket, each quantized with its own "
                                             "min and max (Bagua's default 10 MiB)")
    shared_randomness: bool = opt(True, "Moniqua: all workers use the same stochastic-rounding offsets each step")
    # --- the centralized family ---
    server: str = opt("allgather", f"DQSG/NDQSG placement: {', '.join(SERVERS)}")
    scales: str | None = opt(None, "multi-scale bit widths, e.g. 2,6")
    k: float | None = opt(None, "GlobalRandK: coordinates kept (an int, or a fraction of d if < 1)")
    powersgd_rank: int = opt(2, "PowerSGD: the rank of its gradient approximation (--rank for short)",
                             aliases=("--rank",))
    levels: int | None = opt(None, "DQSG/NDQSG: M (2M+1 indices, Delta = 1/M); default the largest M with "
                              "2M+1 <= 2^bits")
    nested_fraction: float = opt(0.5, "NDQSG: fraction of workers in P2 (nested quantizer), in [0, 1)")
    nested_delta1: float | None = opt(None, "NDQSG: a fixed fine step Delta1 relative to ||g||_inf (default: auto, "
                                      "see --nested-sigma)")
    nested_k: int = opt(NESTED_K, "NDQSG: Delta2 = k Delta1, k >= 2 (ceil(log2 k) bits per element; default 2, "
                         "one bit)")
    nested_alpha: float | None = opt(None, "NDQSG: shrinkage alpha in (0, 1] with --nested-delta1 (default 1) or "
                                      "--nested-sigma (default matched)")
    nested_sigma: float | str | None = opt(None, "NDQSG: 'auto' (the default unless --nested-delta1): Theorem 6 "
                                            "every step for the side-information noise measured at the previous "
                                            "one; or a fixed noise std (relative to ||g||_inf)", type=parse_theta)
    nested_failure: float = opt(NESTED_FAILURE, "NDQSG: Theorem 6 target decoding-failure probability per "
                                 "element, for Gaussian side-information noise (auto or --nested-sigma)")
    sum_dtype: str | None = opt(None, "max-norm family: integer dtype of the code sum (int8, int16, int32, "
                                 "int64; default the narrowest that cannot overflow)")

    def check_options(self) -> None:
        """Raise a ValueError naming the option and its valid range for any option out of range."""
        from . import check_algorithm

        cls = check_algorithm(self.algorithm)  # a ValueError listing the names
        for name, choices in (("theta_schedule", THETA_SCHEDULES), ("server", SERVERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; choose one of: {', '.join(choices)}")
        if self.rounding is not None and self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is unknown; choose one of: {', '.join(ROUNDINGS)}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {self.bits}")
        for name in ("theta_every", "powersgd_rank", "verify_block"):
            v = getattr(self, name)
            if v is None and name == "verify_block":  # Moniqua's default by bits
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v}")
        if not (isinstance(self.delta, (int, float)) and math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"delta must be > 0, got {self.delta}")
        if self.theta is not None:
            check_theta(self.theta)
        if self.gamma is not None:
            check_gamma(self.gamma)
        if self.k is not None and not (math.isfinite(self.k) and self.k > 0):
            raise ValueError(f"k must be > 0 (a count, or a fraction of d if < 1), got {self.k}")
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
