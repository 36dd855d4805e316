"""An algorithm's options are its dataclass fields (issue 31, item 4): each option declared once
(lowbit.algorithms.config.Option) and read by fields; ``options``, ``from_config`` and
AlgorithmOptions follow from them, and each option's check is one function whichever entry
point the value comes in by. Variants that are other algorithms are other classes."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from lowbit.algorithms import ALGORITHMS, GossipAlgorithm, LowPrecisionDecentralized, Moniqua, from_options
from lowbit.algorithms.config import BITS, GAMMA, Option, int_at_least, options_of, reads
from lowbit.algorithms.lowprec import ShiftOneLowPrecision, default_node_size
from lowbit.algorithms.options import AlgorithmOptions, all_options
from lowbit.comm import ThreadWorld
from lowbit.train import TrainConfig

EVERY = Option("toy_every", 4, "steps between two toy things", int, int_at_least("toy_every", 1))


@dataclass(frozen=True)
class Toy(GossipAlgorithm):
    """A new algorithm as a user writes one: fields that read options, nothing else."""

    bits: int = reads(BITS, default=3)
    gamma: float | None = reads(GAMMA, default=None)
    every: int = reads(EVERY, default=4)
    label: str = "not an option"
    name = "toy"


class _Cfg:
    """The options a run names (what from_config reads)."""

    def __init__(self, **kw):
        self.__dict__.update({"bits": 2, "gamma": None, "toy_every": 4, **kw})


def test_a_new_algorithm_declares_its_options_by_its_fields_alone():
    assert Toy.options == ("bits", "gamma", "toy_every")
    assert Toy.from_config(_Cfg(bits=5, gamma=0.5, toy_every=2)) == Toy(bits=5, gamma=0.5, every=2)
    # an option given as None keeps the class's default (bits 3 here, not the command line's 2)
    assert Toy.from_config(_Cfg(bits=None)) == Toy()
    for kw, word in ((dict(bits=9), "bits must be an integer in 1..8"), (dict(gamma=2.0), "gamma must be"),
                     (dict(every=0), "toy_every must be an integer >= 1")):
        with pytest.raises(ValueError, match=word):
            Toy(**kw)


def test_a_field_without_default_needs_its_option():
    @dataclass(frozen=True)
    class Needs(GossipAlgorithm):
        """Takes a required option."""

        every: int = reads(EVERY, kw_only=True)
        name = "needs"

    with pytest.raises(ValueError, match=r"algorithm='needs' needs toy_every \(--toy-every: steps between"):
        Needs.from_config(_Cfg(toy_every=None))
    assert Needs.from_config(_Cfg(toy_every=3)) == Needs(every=3)


def test_algorithm_options_is_the_union_of_the_registered_algorithms_options():
    union = {o.name: o for cls in ALGORITHMS.values() for o in options_of(cls)}
    assert [o.name for o in all_options()] == ["codec", *(n for n in union if n != "codec")]
    table = {f.name: f for f in fields(AlgorithmOptions)}
    assert set(table) == {"algorithm", *union, "codec"}
    for name, o in union.items():  # one declaration: its default and help are the table's
        assert union[name] is o and table[name].default == o.default and table[name].metadata["help"] == o.help


@pytest.mark.parametrize("kw,message", [(dict(theta_every=0), "theta_every must be an integer >= 1"),
                                        (dict(verify_block=0), "verify_block must be an integer >= 1"),
                                        (dict(gamma=1.5), r"gamma must be a number in \(0, 1\]"),
                                        (dict(theta="big"), "theta must be a finite number > 0 or 'auto'")])
def test_one_check_per_option_whichever_entry_point(kw, message):
    """The class, the run's config and build-by-name raise the same words (once declared, checked there)."""
    with pytest.raises(ValueError, match=message):
        Moniqua(**kw)
    with pytest.raises(ValueError, match=message):
        TrainConfig(algorithm="moniqua", **kw)
    with pytest.raises(ValueError, match=message):
        from_options("moniqua", **kw)


def test_shift_one_is_its_own_class():
    """peer_selection='shift_one' builds ShiftOneLowPrecision, by class or by name; Bagua's ring is not it."""
    a = LowPrecisionDecentralized(peer_selection="shift_one")
    assert type(a) is ShiftOneLowPrecision and a == ShiftOneLowPrecision()
    assert type(from_options("lowprec-decentralized", peer_selection="shift_one")) is ShiftOneLowPrecision
    assert type(LowPrecisionDecentralized()) is LowPrecisionDecentralized
    assert ShiftOneLowPrecision.init is not LowPrecisionDecentralized.init
    with pytest.raises(ValueError, match="peer_selection must be 'shift_one'"):
        ShiftOneLowPrecision(peer_selection="all")


def test_the_node_size_is_the_transports_capability():
    assert default_node_size(ThreadWorld(2).transport(0)) == 1

    class FourPerHost:
        local_world_size = 4

    assert default_node_size(FourPerHost()) == 4
