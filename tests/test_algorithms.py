"""Algorithms against their equations in matrix form (X W) on a small problem."""

import pytest
import torch

from lowbit.algorithms import DPSGD, AllReduceSGD, Moniqua, NaiveQuantizedDPSGD
from lowbit.codecs import DitheredCodec, ModuloCodec, UniformCodec
from lowbit.codecs.rng import shared_generator
from lowbit.comm import run_threads
from lowbit.topology import make_topology
from quadratic import quadratic_problem, run_quadratic

N, D, STEPS, LR = 5, 7, 6, 0.1


def _problem(seed=0):
    return quadratic_problem(N, D, seed)


def _run(make_algo, X0, A, b):
    """The trajectories (steps, N, D) and each worker's bytes sent."""
    res = run_quadratic(make_algo, X0, A, b, STEPS, LR)
    return torch.stack([torch.stack(seen) for seen, *_ in res], 1), [t.ledger.bytes_sent for _, _, t, _ in res]


def test_dpsgd_is_x_w_minus_lr_g():
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    W = torch.tensor(topo.mixing_matrix())
    traj, sent = _run(lambda t: DPSGD().worker(t, topo), X0, A, b)
    X = X0.clone()
    for k in range(STEPS):
        X = W.T @ X - LR * (A * X - b)  # rows are workers: x_i' = sum_j W_ji x_j
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
    assert sent == [STEPS * 2 * (4 + 4 * D)] * N  # fp32 + 4-byte length header, to 2 neighbours


def test_allreduce_sgd_is_mean_gradient():
    X0, A, b = _problem()
    X0[:] = X0[0]
    traj, _ = _run(lambda t: AllReduceSGD().worker(t), X0, A, b)
    x = X0[0].clone()
    for k in range(STEPS):
        x = x - LR * (A * x - b).mean(0)
        for i in range(N):
            torch.testing.assert_close(traj[k, i], x, atol=1e-6, rtol=0)


def _reference_quantized(X0, A, b, W, mix):
    X = X0.clone()
    out = []
    for k in range(STEPS):
        X = mix(k, X) - LR * (A * X - b)
        out.append(X.clone())
    return out


@pytest.mark.parametrize("codec", [UniformCodec(step=0.01), DitheredCodec(levels=4)], ids=["uniform", "dithered"])
def test_naive_quantized_gossip_is_equation_4(codec):
    """Also checks that a receiver regenerates a subtractive-dither sender's u from the seed."""
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    Wn = topo.mixing_matrix()
    traj, _ = _run(lambda t: NaiveQuantizedDPSGD(codec=codec).worker(t, topo, seed=3), X0, A, b)

    def mix(k, X):
        Q = torch.stack([codec.roundtrip(X[j], generator=shared_generator(3, k, j)) for j in range(N)])
        Y = torch.empty_like(X)
        for i in range(N):  # eq. (4): x_i W_ii + sum_{j != i} Q(x_j) W_ji
            Y[i] = X[i] * Wn[i, i] + sum(Q[j] * Wn[j, i] for j in topo.neighbors(i))
        return Y

    for k, X in enumerate(_reference_quantized(X0, A, b, Wn, mix)):
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits,rounding", [(2, "stochastic"), (4, "stochastic"), (1, "nearest"), (8, "nearest")])
def test_moniqua_is_algorithm_1(bits, rounding):
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    Wn = topo.mixing_matrix()
    theta = 0.5  # above |x_i - x_j| at x_0; Lemma 2's bound is checked whenever that still holds
    checked = []
    codec = ModuloCodec(bits=bits, theta=theta, rounding=rounding)
    # Algorithm 1 as written: plain W, and no verification (later steps break |x_i - x_j| < theta;
    # tests/test_moniqua.py checks that verification catches those)
    traj, sent = _run(lambda t: Moniqua(bits=bits, theta=theta, rounding=rounding, gamma=1.0,
                                        verify=False).worker(t, topo, seed=5), X0, A, b)

    def mix(k, X):
        Q = [codec.encode(X[j], generator=shared_generator(5, k, 0)) for j in range(N)]  # line 3, shared u
        Y = torch.empty_like(X)
        for i in range(N):
            own = codec.decode(Q[i], ref=X[i])  # line 4
            Y[i] = X[i] + sum((codec.decode(Q[j], ref=X[i]) - own) * Wn[j, i] for j in topo.neighbors(i))
            if all(float((X[i] - X[j]).abs().max()) < theta for j in topo.neighbors(i)):
                # Lemma 2 through line 6: the mix is within 2 delta B_theta (1 - W_ii) of D-PSGD's.
                exact = sum(X[j] * Wn[j, i] for j in range(N))
                assert float((Y[i] - exact).abs().max()) <= 2 * codec.delta * codec.B_theta * (1 - Wn[i, i]) + 1e-9
                checked.append((k, i))
        return Y

    for k, X in enumerate(_reference_quantized(X0, A, b, Wn, mix)):
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
    assert len(checked) >= N  # at least the first step satisfies Lemma 2's premise
    # each message: ceil(D * bits / 8) packed bytes (every worker knows D: no length header)
    assert sent[0] == STEPS * 2 * codec.encode(X0[0]).data.numel()
    assert codec.encode(X0[0]).data.numel() == -(-D * bits // 8)


def test_moniqua_and_dpsgd_hold_no_extra_memory():
    topo = make_topology("ring", 3)

    def worker(t):
        out = []
        for a in (DPSGD().worker(t, topo), Moniqua().worker(t, topo), AllReduceSGD().worker(t), NaiveQuantizedDPSGD().worker(t, topo)):
            a.setup(torch.zeros(D))
            out.append(a.extra_memory_bytes())
        return out

    assert run_threads(3, worker) == [[0, 0, 0, 0]] * 3


def test_moniqua_rejects_bad_theta_and_bits():
    for kw, word in ((dict(theta=0.0), "theta"), (dict(theta=-1.0), "theta"), (dict(bits=9), "bits"),
                     (dict(bits=0), "bits"), (dict(bits=1, rounding="stochastic"), "delta")):
        with pytest.raises(ValueError, match=word):
            Moniqua(**kw)


def test_topology_must_match_world_size():
    def worker(t):
        with pytest.raises(ValueError, match="workers"):
            DPSGD().worker(t, make_topology("ring", 4))
        return True

    assert all(run_threads(3, worker))
