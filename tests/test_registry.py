"""One registry (issue 12 item 3): every algorithm is named, configured and documented in one place.

- ``lowbit.algorithms.ALGORITHMS`` names every algorithm; each class declares the options it
  reads (``options``, names of :class:`~lowbit.algorithms.options.AlgorithmOptions`) and the
  codecs it takes (``codecs``, names of ``lowbit.codecs.CODECS``);
- ``from_config`` reads those options and no others, so that ``lowbit train``, the wrapper's
  keywords and ``build_worker`` mean the same by each name, with the same defaults;
- ``docs/ALGORITHMS.md`` is generated from it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lowbit.algorithms import ALGORITHMS, Algorithm, build_worker, from_options
from lowbit.algorithms.options import DOCS_HEADER, AlgorithmOptions, algorithm_table
from lowbit.codecs import CODECS
from lowbit.comm import ThreadWorld
from lowbit.train import TrainConfig

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ALGORITHMS.md"
NAMES = sorted(ALGORITHMS)

# A valid value other than the default for every option: changing an option an algorithm
# does not declare must not change the algorithm it builds.
OTHER = dict(bits=3, theta=0.3, theta_schedule="lr", theta_every=7, verify=False, verify_block=128, entropy="zlib",
             gamma=0.5, delta=0.2, rounding="nearest", peer_selection="shift_one", hierarchical=False,
             communication_interval=2, node_size=2, bucket_bytes=4096, shared_randomness=False, server="allreduce",
             scales="2,6", k=0.25, powersgd_rank=3, levels=2, nested_fraction=0.25, nested_delta1=0.1, nested_k=4,
             nested_alpha=0.5, nested_sigma=0.01, nested_failure=1e-3, sum_dtype="int32")


def test_every_option_has_another_value_here():
    assert set(OTHER) | {"algorithm", "codec"} == set(AlgorithmOptions.option_names())


def test_the_docs_table_is_current():
    expected = DOCS_HEADER + algorithm_table()
    assert DOCS.read_text() == expected, "regenerate: python -m lowbit.algorithms.options > docs/ALGORITHMS.md"


@pytest.mark.parametrize("name", NAMES)
def test_an_algorithm_declares_its_name_family_options_and_codecs(name):
    cls = ALGORITHMS[name]
    assert issubclass(cls, Algorithm) and dataclasses.is_dataclass(cls)
    assert cls.name == name
    assert cls.family in ("centralized", "decentralized")
    assert set(cls.options) <= set(AlgorithmOptions.option_names()) - {"algorithm"}, cls.options
    assert len(set(cls.options)) == len(cls.options)
    assert set(cls.codecs) <= set(CODECS)
    assert ("codec" in cls.options) == bool(cls.codecs), "an algorithm with a codec list reads --codec"
    assert (cls.__doc__ or "").strip(), "the docs table quotes the docstring's first sentence"


def _required(cls) -> dict:
    """Values for the options a class has no default for (GlobalRandK's k)."""
    return {f.name: OTHER[f.name] for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


@pytest.mark.parametrize("name", NAMES)
def test_the_class_defaults_are_the_registry_defaults(name):
    """``ALGORITHMS[name]()`` (the class with no arguments) is the algorithm that ``lowbit
    train --algorithm name`` runs: one default per concept, whichever entry point."""
    cls = ALGORITHMS[name]
    required = _required(cls)
    assert cls(**required) == from_options(name, **required)
    for option in required:
        with pytest.raises(ValueError, match=f"needs {option}"):
            from_options(name)


@pytest.mark.parametrize("name", NAMES)
def test_from_config_reads_only_the_declared_options(name):
    cls = ALGORITHMS[name]
    required = _required(cls)
    base = from_options(name, **required)
    for option, value in OTHER.items():
        if option in cls.options:
            continue
        cfg = AlgorithmOptions(algorithm=name, **{**required, option: value})
        assert cls.from_config(cfg) == base, f"{name} reads {option} but does not declare it"


@pytest.mark.parametrize("name", NAMES)
def test_an_undeclared_option_is_refused_by_name(name):
    undeclared = next(o for o in OTHER if o not in ALGORITHMS[name].options)
    with pytest.raises(ValueError, match=f"does not take option.*{undeclared}"):
        from_options(name, **{undeclared: OTHER[undeclared]})
    with pytest.raises(ValueError, match="not an option of any algorithm"):
        from_options(name, no_such_option=1)


def test_a_bad_value_is_refused_with_its_range():
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        from_options("qsgd", bits=9)


def test_build_worker_by_name_uses_the_options_of_lowbit_train():
    """The wrapper's ``DecentralizedDataParallel(net, opt, "moniqua", bits=2)`` builds through
    ``build_worker``: the same theta default as ``lowbit train`` (issue 12: it was 0.5
    against 0.05)."""
    w = build_worker("moniqua", ThreadWorld(4).transport(0), bits=2)
    assert w.algorithm == ALGORITHMS["moniqua"].from_config(TrainConfig(algorithm="moniqua", bits=2))
