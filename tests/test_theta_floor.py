"""theta="auto"'s floor (issue 28, item 3; the module docstring of lowbit.algorithms.moniqua,
"theta's floor"): the formula at its bounds, the agreement of the floor inside the 16-byte
theta agreement, the decision at the floor's boundary, and the quadratic task at Moniqua's
defaults, whose identical models once shrank theta until verification failed."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from lowbit.algorithms import Moniqua
from lowbit.algorithms.moniqua import (THETA_FLOOR_GROWTH, THETA_FLOOR_ULPS, THETA_SHRINK, MoniquaState,
                                       floor_from_votes, floor_vote, theta_floor)
from lowbit.codecs import ModuloCodec
from lowbit.codecs.modulo import GRID_LIMIT
from lowbit.comm import run_threads
from lowbit.train import TrainConfig, train

EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps


def _pow2_ceil(f: float) -> float:
    """The smallest power of two >= f, by search (independent of frexp)."""
    p = 2.0 ** math.floor(math.log2(f)) / 4
    while p < f:
        p *= 2
    return p


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "stochastic"), (2, "nearest"), (8, "stochastic")])
def test_the_floor_is_the_larger_of_its_two_bounds(bits, rounding):
    """float32: Lemma 2's bound delta B_theta is THETA_FLOOR_ULPS eps M at the floor; float64: the
    grid integers M 2^bits / B_theta are 2^53 / THETA_FLOOR_GROWTH there (each the larger bound)."""
    codec = ModuloCodec(bits=bits, theta=1.0, rounding=rounding)
    M = 0.05
    f32 = theta_floor(codec, M, EPS32)
    at32 = ModuloCodec(bits=bits, theta=f32, rounding=rounding)
    assert at32.delta * at32.B_theta == pytest.approx(THETA_FLOOR_ULPS * EPS32 * M, rel=1e-12)
    assert M * at32.levels / at32.B_theta < GRID_LIMIT / THETA_FLOOR_GROWTH / 1e6  # the hash bound is far
    f64 = theta_floor(codec, M, EPS64)
    at64 = ModuloCodec(bits=bits, theta=f64, rounding=rounding)
    assert M * at64.levels / at64.B_theta == pytest.approx((GRID_LIMIT - at64.levels) / THETA_FLOOR_GROWTH, rel=1e-12)
    assert at64.delta * at64.B_theta > THETA_FLOOR_ULPS * EPS64 * M
    # the grid step in ulps of M: 4 with stochastic rounding, 8 with nearest
    assert at32.B_theta / at32.levels / (EPS32 * M) == pytest.approx(4.0 if rounding == "stochastic" else 8.0)
    assert theta_floor(codec, 0.0, EPS32) == 0.0


@pytest.mark.parametrize("n", [1, 2, 8, 1000, 65535])
def test_the_agreed_floor_is_the_smallest_power_of_two_above_every_workers_floor(n):
    rng = random.Random(n)
    theta = 0.0123
    for _ in range(20 if n < 1000 else 2):
        floors = [theta * 2.0 ** rng.uniform(-60, 40) for _ in range(min(n, 64))] + [0.0] * (n > 64)
        votes = [floor_vote(f, theta, n) for f in floors] + [0.0] * (n - len(floors))
        expect = _pow2_ceil(max(floors))
        for _ in range(3):  # any order of the additions gives the same floor
            rng.shuffle(votes)
            assert floor_from_votes(math.fsum(votes), theta, n) == expect
            assert floor_from_votes(sum(votes), theta, n) == expect
    # n workers all at the largest vote: the sum stays below the next power
    f = theta * 3.0
    assert floor_from_votes(n * floor_vote(f, theta, n), theta, n) == _pow2_ceil(f)


def test_the_floors_vote_at_its_boundaries():
    theta, n = 0.01, 8
    F = 2.0 ** -20
    up = math.nextafter(F, math.inf)
    down = math.nextafter(F, 0.0)
    assert floor_from_votes(floor_vote(F, theta, n), theta, n) == F  # a power of two is its own ceiling
    assert floor_from_votes(floor_vote(up, theta, n), theta, n) == 2 * F  # just above: the next power
    assert floor_from_votes(floor_vote(down, theta, n), theta, n) == F  # just below: the same
    # nothing to say: 0, non-finite, or far below theta (it cannot bind); far above: clipped, raised again later
    assert floor_vote(0.0, theta, n) == floor_vote(math.nan, theta, n) == floor_vote(math.inf, theta, n) == 0.0
    assert floor_vote(theta * 2.0 ** -70, theta, n) == 0.0 and floor_from_votes(0.0, theta, n) == 0.0
    assert floor_from_votes(floor_vote(theta * 2.0 ** 80, theta, n), theta, n) == _pow2_ceil(theta) * 2.0 ** 62


class _Identical:
    """The transport of n workers in the same state: an all-reduce SUM is n times the tensor."""

    def __init__(self, n):
        self.world_size, self.reduced = n, []

    def all_reduce(self, t, op):
        assert op == "sum"
        self.reduced.append(t.clone())
        return t * self.world_size


def _agree(theta, own_floor, lr=0.1, lr0=0.1, wrong=0, n=8, nb=4):
    """One agreement of n identical workers on a ring with these theta and floors, and its 16 bytes."""
    state = MoniquaState(theta=theta, lr0=lr0, window=[wrong, 10 * 2 * nb], codec=ModuloCodec(bits=2, theta=theta),
                         own_floor=own_floor, degrees=(2, 2 * n))
    ctx = SimpleNamespace(transport=_Identical(n), world_size=n)
    Moniqua._agree_theta(state, ctx)
    Moniqua._hold_floor(state, lr)
    (sent,) = ctx.transport.reduced
    assert sent.numel() * sent.element_size() == 16 and sent[0] == wrong
    return state


def test_theta_shrinks_to_the_floor_and_not_below():
    F = 2.0 ** -25
    above = F / THETA_SHRINK * (1 + 1e-12)  # a shrink lands just above F: it happens as before
    s = _agree(above, own_floor=F)
    assert s.theta == above * THETA_SHRINK and s.floor == F
    below = F / THETA_SHRINK * (1 - 1e-12)  # a shrink would land just below F: theta stops at F
    s = _agree(below, own_floor=F)
    assert s.theta == F and s.floor == F
    s = _agree(F, own_floor=F)  # at the floor, agreeing models: stays
    assert s.theta == F
    s = _agree(F, own_floor=F, wrong=10)  # wrong blocks: doubles from the floor
    assert s.theta == 2 * F
    s = _agree(F / 4, own_floor=F)  # below (theta_0 of a tiny first gradient): raised to it
    assert s.theta == F
    # the step size decayed 8-fold: theta_k = theta alpha_k / alpha_0 is held at F
    s = _agree(F, own_floor=F, lr=0.1 / 8)
    assert s.theta == pytest.approx(8 * F, rel=1e-15) and s.theta * (0.1 / 8) / 0.1 == pytest.approx(F, rel=1e-15)
    # a floor far below theta changes nothing, bit for bit
    s = _agree(0.05, own_floor=1e-9)
    assert s.theta == 0.05 * THETA_SHRINK and s.floor == _pow2_ceil(1e-9)


def test_workers_with_different_magnitudes_agree_on_one_floor():
    """A real SUM over 5 thread workers, each its own floor: every worker reads the same F,
    the smallest power of two at least the largest, and theta_k of the next step is F."""
    floors = [3e-9, 7.5e-8, 0.0, 1.1e-8, 7.4e-8]
    n, theta = len(floors), 1e-7

    def worker(t):
        state = MoniquaState(theta=theta, lr0=0.1, window=[0, 40], codec=ModuloCodec(bits=2, theta=theta),
                             own_floor=floors[t.rank], degrees=(2, 2 * n))
        ctx = SimpleNamespace(transport=t, world_size=n)
        Moniqua._agree_theta(state, ctx)
        Moniqua._hold_floor(state, 0.1)
        return state.theta, state.floor, Moniqua()._theta_k(state, 0.1).theta

    got = run_threads(n, worker)
    assert got == [(2.0 ** -23, 2.0 ** -23, 2.0 ** -23)] * n  # 0.8e-7 < 7.5e-8 <= 2^-23 = 1.19e-7


@pytest.mark.parametrize("algorithm", ["moniqua", "moniqua-d2"])
def test_quadratic_at_the_defaults_finishes_at_the_floor(algorithm):
    """The quadratic task's workers minimise one function: their models agree to the bit, no block
    is ever wrong, and theta shrinks until the floor holds it (about step 480; issue 28's run took
    it to 4.9e-18 and failed after step 1475). The defaults, 2 workers, 520 steps."""
    run = train(TrainConfig(task="quadratic", workers=2, steps=520, seed=0, algorithm=algorithm, backend="thread"))
    s = run.summary
    assert s["steps"] == 520 and math.isfinite(s["final_train_loss"])
    assert s["final_train_loss"] < 1e-12
    report = s["algorithm_report"]
    M = 0.05  # the optimum, delta / 2: every weight
    assert report["theta"] == report["theta_floor"] == _pow2_ceil(theta_floor(ModuloCodec(bits=2, theta=1.0), M, EPS32))
    assert report["mismatched_blocks"] == 0
