import math

import numpy as np
import pytest

from lowbit.topology import (
    TOPOLOGIES,
    Topology,
    check_mixing_matrix,
    complete,
    exponential,
    make_topology,
    ring,
    slack_matrix,
    smallest_nonzero_weight,
    spectral_gap,
    spectral_rho,
    star,
    torus,
)

SIZES = {
    "ring": [1, 2, 3, 4, 5, 8, 13],
    "torus": [9, 12, 15, 16, 20, 25],
    "complete": [1, 2, 3, 5, 8],
    "star": [2, 3, 5, 8],
    "exponential": [1, 2, 3, 4, 5, 8, 12, 16],
}
CASES = [(name, n) for name, ns in SIZES.items() for n in ns]


@pytest.mark.parametrize("weights", ["uniform", "metropolis"])
@pytest.mark.parametrize("name,n", CASES)
def test_builders_give_doubly_stochastic(name, n, weights):
    topo = make_topology(name, n)
    assert isinstance(topo, Topology)
    assert topo.name == name and topo.n == n
    W = topo.mixing_matrix(weights)
    assert W.dtype == np.float64 and W.shape == (n, n)
    check_mixing_matrix(W)
    A = topo.adjacency
    assert A.dtype == bool and not A.diagonal().any()
    np.testing.assert_array_equal(A, A.T)
    # support of W is the graph plus the diagonal
    off = ~np.eye(n, dtype=bool)
    np.testing.assert_array_equal(W[off] > 0, A[off])
    assert np.all(W.diagonal() > 0)
    for i in range(n):
        nb = topo.neighbors(i)
        assert list(nb) == sorted(set(nb)) and i not in nb
        assert topo.degree(i) == len(nb) == A[i].sum()
        mw = topo.mixing_weights(i, W)
        assert set(mw) == {i, *nb}
        assert math.isclose(sum(mw.values()), 1.0, abs_tol=1e-12)
    assert topo.max_degree == max(topo.degree(i) for i in range(n))
    assert len(topo.edges) == A.sum() // 2
    assert all(i < j for i, j in topo.edges)
    rho = spectral_rho(W)
    assert 0.0 <= rho < 1.0 + 1e-12
    assert math.isclose(spectral_gap(W), 1.0 - rho)


@pytest.mark.parametrize("name,n", [c for c in CASES if c[1] >= 2])
def test_connected_graphs_have_rho_below_one(name, n):
    for weights in ("uniform", "metropolis"):
        assert spectral_rho(make_topology(name, n).mixing_matrix(weights)) < 1 - 1e-9


def test_metropolis_rule():
    topo = star(5)
    W = topo.mixing_matrix("metropolis")
    assert math.isclose(W[0, 1], 1 / 5)
    assert math.isclose(W[1, 1], 4 / 5)
    assert math.isclose(W[0, 0], 1 / 5)


def test_uniform_rule_irregular():
    topo = star(4)  # d_max = 3
    W = topo.mixing_matrix("uniform")
    assert math.isclose(W[0, 2], 1 / 4)
    assert math.isclose(W[2, 2], 3 / 4)
    assert math.isclose(W[0, 0], 1 / 4)


def test_unknown_weighting():
    with pytest.raises(ValueError, match="weights"):
        ring(4).mixing_matrix("bogus")


def test_ring_neighbours():
    assert ring(1).neighbors(0) == ()
    assert ring(1).edges == ()
    assert ring(2).neighbors(0) == (1,) and ring(2).neighbors(1) == (0,)
    assert ring(2).edges == ((0, 1),)
    r = ring(8)
    assert r.neighbors(0) == (1, 7)
    assert r.neighbors(3) == (2, 4)
    assert r.neighbors(7) == (0, 6)
    assert all(r.degree(i) == 2 for i in range(8))
    np.testing.assert_allclose(ring(1).mixing_matrix(), [[1.0]])
    np.testing.assert_allclose(ring(2).mixing_matrix(), np.full((2, 2), 0.5))


def test_ring_uniform_weights_and_rho():
    W = ring(8).mixing_matrix("uniform")
    for i in range(8):
        assert ring(8).mixing_weights(i, W) == pytest.approx(
            {i: 1 / 3, (i - 1) % 8: 1 / 3, (i + 1) % 8: 1 / 3}
        )
    expected = 1 / 3 + 2 / 3 * math.cos(2 * math.pi / 8)
    assert abs(spectral_rho(W) - expected) < 1e-12
    assert abs(spectral_gap(W) - (1 - expected)) < 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 6, 10])
def test_complete_uniform_is_averaging(n):
    W = complete(n).mixing_matrix("uniform")
    np.testing.assert_allclose(W, np.full((n, n), 1.0 / n), atol=1e-15)
    assert spectral_rho(W) < 1e-12
    assert complete(n).max_degree == n - 1


def test_single_worker_rho_zero():
    assert spectral_rho(np.ones((1, 1))) == 0.0
    assert spectral_gap(np.ones((1, 1))) == 1.0


def test_torus_shape_and_degree():
    t = torus(16)
    assert t.shape == (4, 4)
    assert all(t.degree(i) == 4 for i in range(16))
    assert t.neighbors(0) == (1, 3, 4, 12)
    assert torus(12).shape == (3, 4)
    assert torus(36).shape == (6, 6)
    assert torus(12, rows=4).shape == (4, 3)
    assert all(torus(9).degree(i) == 4 for i in range(9))


@pytest.mark.parametrize("n", [1, 2, 4, 6, 7, 8, 10, 11, 14])
def test_torus_bad_sizes(n):
    with pytest.raises(ValueError, match="workers"):
        torus(n)
    with pytest.raises(ValueError, match="workers"):
        make_topology("torus", n)


def test_torus_error_message():
    with pytest.raises(ValueError) as e:
        torus(7)
    msg = str(e.value)
    assert "workers=7" in msg and "rows, cols >= 3" in msg


def test_torus_bad_rows():
    with pytest.raises(ValueError, match="rows"):
        torus(12, rows=2)
    with pytest.raises(ValueError, match="rows"):
        torus(12, rows=5)


def test_star_and_exponential():
    s = star(5)
    assert s.neighbors(0) == (1, 2, 3, 4)
    assert s.neighbors(3) == (0,)
    with pytest.raises(ValueError, match="workers"):
        star(1)
    e = exponential(8)
    assert e.neighbors(0) == (1, 2, 4, 6, 7)
    assert e.neighbors(3) == (1, 2, 4, 5, 7)
    assert exponential(2).neighbors(0) == (1,)
    assert exponential(1).neighbors(0) == ()


def test_registry_and_errors():
    assert set(TOPOLOGIES) == {"ring", "torus", "complete", "star", "exponential"}
    with pytest.raises(ValueError) as e:
        make_topology("foo", 4)
    msg = str(e.value)
    assert "topology='foo'" in msg
    for name in TOPOLOGIES:
        assert name in msg
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        make_topology("ring", 0)
    with pytest.raises(ValueError, match="workers"):
        ring(-3)


@pytest.mark.parametrize("gamma", [0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("topo", [ring(8), torus(9), star(6), exponential(8)])
def test_slack_matrix(topo, gamma):
    W = topo.mixing_matrix("metropolis")
    Wg = slack_matrix(W, gamma)
    check_mixing_matrix(Wg)
    lam = np.sort(np.linalg.eigvalsh(W))[::-1]
    lam_g = np.sort(np.linalg.eigvalsh(Wg))[::-1]
    np.testing.assert_allclose(lam_g, gamma * lam + 1 - gamma, atol=1e-12)
    # rho from the positive side: lambda_2 >= 0 here and dominates after slack
    rho_pos = lam[1]
    if gamma * lam[-1] + 1 - gamma >= -(gamma * lam[1] + 1 - gamma):
        assert abs(spectral_rho(Wg) - (gamma * rho_pos + 1 - gamma)) < 1e-12


def test_slack_ring_rho():
    W = ring(8).mixing_matrix()
    rho = spectral_rho(W)  # attained by positive lambda_2 on ring(8)
    for gamma in (0.25, 0.5, 1.0):
        assert abs(spectral_rho(slack_matrix(W, gamma)) - (gamma * rho + 1 - gamma)) < 1e-12


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5, float("nan")])
def test_slack_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        slack_matrix(np.eye(3), gamma)


def test_smallest_nonzero_weight():
    assert smallest_nonzero_weight(ring(8).mixing_matrix("uniform")) == pytest.approx(1 / 3, abs=1e-15)
    assert smallest_nonzero_weight(star(5).mixing_matrix("uniform")) == pytest.approx(1 / 5)
    with pytest.raises(ValueError):
        smallest_nonzero_weight(np.zeros((2, 2)))


def test_check_mixing_matrix_failures():
    with pytest.raises(ValueError, match="symmetric"):
        check_mixing_matrix(np.array([[0.5, 0.5], [0.3, 0.7]]))
    with pytest.raises(ValueError, match="sum to 1"):
        check_mixing_matrix(np.array([[0.5, 0.2], [0.2, 0.5]]))
    with pytest.raises(ValueError, match="square"):
        check_mixing_matrix(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="negative"):
        check_mixing_matrix(np.array([[1.5, -0.5], [-0.5, 1.5]]))
    check_mixing_matrix(np.full((4, 4), 0.25))
