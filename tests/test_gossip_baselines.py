"""CHOCO-SGD, DCD-PSGD, ECD-PSGD, DeepSqueeze and Bagua's low precision
decentralized SGD against their equations in matrix form (rows are workers,
W symmetric), their replica invariants, memory, ledger, both runtimes, the CLI."""

import pytest
import torch

from lowbit.algorithms import ChocoSGD, DCDPSGD, DeepSqueeze, ECDPSGD, LowPrecisionDecentralized
from lowbit.algorithms.lowprec import shift_one_peer
from lowbit.codecs import IdentityCodec, MinMaxCodec
from lowbit.codecs.rng import shared_generator
from lowbit.comm import launch, run_threads
from lowbit.topology import make_topology
from lowbit.train import TrainConfig, train
from quadratic import quadratic_problem, quadratic_step, run_quadratic

N, D, STEPS, LR, SEED = 5, 7, 6, 0.1, 3
CODECS = {"fp32": IdentityCodec(), "minmax4-stochastic": MinMaxCodec(bits=4, rounding="stochastic")}


def _problem(n=N, seed=0):
    return quadratic_problem(n, D, seed)


def _run(make_algo, X0, A, b, steps=STEPS):
    """Per step the models (steps, n, D), every worker's state tensors, and the bytes sent."""
    res = run_quadratic(make_algo, X0, A, b, steps, LR, observe=lambda k, x, algo, t: (
        x.clone(), {name: v.clone() for name, v in algo.state_tensors().items()}))
    traj = torch.stack([torch.stack([o[0] for o in seen]) for seen, *_ in res], 1)
    return traj, [[o[1] for o in seen] for seen, *_ in res], [t.ledger.bytes_sent for _, _, t, _ in res]


def _Q(codec, V, k):
    """Row j of V through the codec with worker j's shared randomness at step k (what any receiver decodes)."""
    return torch.stack([codec.roundtrip(V[j].clone(), generator=shared_generator(SEED, k, j)).to(V.dtype)
                        for j in range(V.shape[0])])


def _payload_bytes(codec):
    return codec.encode(torch.zeros(D)).nbytes  # fixed-size for the codecs used here


def _ring(n=N):
    topo = make_topology("ring", n)
    return topo, torch.tensor(topo.mixing_matrix())


# ---- matrix-form references ------------------------------------------------------------

@pytest.mark.parametrize("codec", CODECS.values(), ids=CODECS.keys())
def test_choco_is_algorithm_1(codec):
    X0, A, b = _problem()
    topo, W = _ring()
    gamma = 0.7
    traj, states, sent = _run(lambda t: ChocoSGD(codec=codec, gamma=gamma).worker(t, topo, seed=SEED), X0, A, b)
    X, Xh = X0.clone(), torch.zeros_like(X0)
    I = torch.eye(N, dtype=torch.float64)
    for k in range(STEPS):
        Xhalf = X - LR * (A * X - b)                               # line 4
        Xh = Xh + _Q(codec, Xhalf - Xh, k)                          # lines 5-8
        X = Xhalf + gamma * (W - I) @ Xh                            # line 9: sum_j w_ij (xh_j - xh_i)
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
        E = (W - I) @ Xh
        for i in range(N):  # memory-efficient form: xh_i and e_i = sum_j w_ij (xh_j - xh_i)
            torch.testing.assert_close(states[i][k]["xhat"], Xh[i], atol=1e-6, rtol=0)
            torch.testing.assert_close(states[i][k]["consensus"], E[i], atol=1e-6, rtol=0)
    assert sent == [STEPS * 2 * _payload_bytes(codec)] * N


@pytest.mark.parametrize("codec", CODECS.values(), ids=CODECS.keys())
def test_dcd_is_algorithm_1(codec):
    X0, A, b = _problem()
    topo, W = _ring()
    traj, states, sent = _run(lambda t: DCDPSGD(codec=codec).worker(t, topo, seed=SEED), X0, A, b)
    X = X0.clone()
    for k in range(STEPS):
        Xhalf = W @ X - LR * (A * X - b)                            # lines 2-3 (replicas are the models)
        X = X + _Q(codec, Xhalf - X, k)                             # lines 4-5
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
        for i in range(N):  # line 6: the replica of j is bitwise j's model
            for j in topo.neighbors(i):
                assert torch.equal(states[i][k][f"xhat.{j}"], traj[k, j]), (k, i, j)
    setup_bytes = 2 * D * 8  # x_0 (float64 here) to two neighbours, once
    assert sent == [setup_bytes + STEPS * 2 * _payload_bytes(codec)] * N


@pytest.mark.parametrize("codec", CODECS.values(), ids=CODECS.keys())
def test_ecd_is_algorithm_2(codec):
    X0, A, b = _problem()
    topo, W = _ring()
    traj, states, sent = _run(lambda t: ECDPSGD(codec=codec).worker(t, topo, seed=SEED), X0, A, b)
    X, Y = X0.clone(), X0.clone()
    for k in range(STEPS):
        t = k + 1
        Xnew = W @ Y - LR * (A * X - b)                             # lines 2-3
        Z = (1 - 0.5 * t) * X + 0.5 * t * Xnew                      # line 4
        Y = (1 - 2 / t) * Y + (2 / t) * _Q(codec, Z, k)             # line 5
        X = Xnew
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
        for i in range(N):
            torch.testing.assert_close(states[i][k][f"y.{i}"], Y[i], atol=1e-6, rtol=0)
            for j in topo.neighbors(i):  # i's estimate of j is bitwise j's estimate of itself
                assert torch.equal(states[i][k][f"y.{j}"], states[j][k][f"y.{j}"]), (k, i, j)
    if isinstance(codec, IdentityCodec):  # C = float32 rounding only: the estimates track the models
        torch.testing.assert_close(Y, X, atol=1e-6, rtol=0)
    assert sent == [2 * D * 8 + STEPS * 2 * _payload_bytes(codec)] * N


@pytest.mark.parametrize("codec", CODECS.values(), ids=CODECS.keys())
def test_deepsqueeze_is_algorithm_1(codec):
    X0, A, b = _problem()
    topo, W = _ring()
    eta = 0.6
    traj, states, sent = _run(lambda t: DeepSqueeze(codec=codec, eta=eta).worker(t, topo, seed=SEED), X0, A, b)
    X, Delta = X0.clone(), torch.zeros_like(X0)
    I = torch.eye(N, dtype=torch.float64)
    for k in range(STEPS):
        Xhalf = X - LR * (A * X - b)                                # line 2
        V = Xhalf + Delta                                           # line 3
        C = _Q(codec, V, k)                                         # line 4
        Delta = V - C
        X = Xhalf + eta * (W - I) @ C                               # line 5
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
        for i in range(N):
            torch.testing.assert_close(states[i][k]["delta"], Delta[i], atol=1e-6, rtol=0)
    if isinstance(codec, IdentityCodec):  # float32 rounding is all the error memory holds
        assert float(Delta.abs().max()) < 1e-6
    assert sent == [STEPS * 2 * _payload_bytes(codec)] * N


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_lowprec_all_is_bagua_algorithm(rounding):
    """Bagua's step (after the optimizer step, replicas start as the common x_0, nothing
    sent at setup) with lowbit's min-max codec in place of Bagua's; tests/test_bagua.py
    checks Bagua's own codec, buckets, 2-node ring and hierarchy."""
    X0, A, b = _problem()
    X0 = X0[:1].repeat(N, 1)  # Bagua: every worker starts from one model
    topo, W = _ring()
    codec = MinMaxCodec(bits=8, rounding=rounding)
    traj, states, sent = _run(lambda t: LowPrecisionDecentralized(codec=codec, hierarchical=False).worker(
        t, topo, seed=SEED), X0, A, b)
    X = X0.clone()
    for k in range(STEPS):
        T = W @ X - LR * (A * X - b) - X                            # steps 2-3 (replicas are the models)
        X = X + _Q(codec, T, k)                                     # step 4
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
        for i in range(N):  # step 5: the replicas are bitwise the neighbours' models
            assert torch.equal(states[i][k]["left_peer_weight"], traj[k, (i - 1) % N])
            assert torch.equal(states[i][k]["right_peer_weight"], traj[k, (i + 1) % N])
    assert sent == [STEPS * 2 * _payload_bytes(codec)] * N  # nothing at setup


def test_lowprec_fp32_codec_is_dpsgd():
    X0, A, b = _problem()
    X0 = X0[:1].repeat(N, 1)
    topo, W = _ring()
    traj, _, _ = _run(lambda t: LowPrecisionDecentralized(codec=IdentityCodec(), hierarchical=False).worker(t, topo),
                      X0, A, b)
    X = X0.clone()
    for k in range(STEPS):
        X = W @ X - LR * (A * X - b)
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)


def test_shift_one_pairing_is_a_matching_every_step():
    for n in (2, 4, 6, 8):
        h = n // 2
        met = {r: set() for r in range(h)}
        for k in range(3 * n):
            peers = [shift_one_peer(r, n, k) for r in range(n)]
            assert all(peers[peers[r]] == r and (peers[r] < h) != (r < h) for r in range(n)), (n, k, peers)
            for r in range(h):
                met[r].add(peers[r])
        assert all(met[r] == set(range(h, n)) for r in range(h))
    assert [shift_one_peer(r, 4, 0) for r in range(4)] == [2, 3, 0, 1]  # Bagua's formula at step 0
    assert [shift_one_peer(r, 4, 1) for r in range(4)] == [3, 2, 1, 0]


@pytest.mark.parametrize("codec", [IdentityCodec(), MinMaxCodec(bits=4, rounding="stochastic")],
                         ids=["fp32", "minmax4-stochastic"])
def test_lowprec_shift_one(codec):
    n = 6
    X0, A, b = _problem(n)
    topo = make_topology("ring", n)
    traj, states, sent = _run(lambda t: LowPrecisionDecentralized(peer_selection="shift_one", codec=codec).worker(
        t, topo, seed=SEED), X0, A, b)
    X = X0.clone()
    known = {(i, j): X0[i].clone() for i in range(n) for j in range(n)}  # i's model as j knows it
    for k in range(STEPS):
        P = [shift_one_peer(i, n, k) for i in range(n)]
        Xhalf = 0.5 * X + 0.5 * X[P] - LR * (A * X - b)             # mix with this step's peer's exact model
        Pn = [shift_one_peer(i, n, k + 1) for i in range(n)]
        Q = _Q(codec, torch.stack([Xhalf[i] - known[i, Pn[i]] for i in range(n)]), k)
        X = torch.stack([known[i, Pn[i]] + Q[i] for i in range(n)])
        for i in range(n):
            known[i, Pn[i]] = X[i].clone()
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
        for i in range(n):  # the replica of the next peer is bitwise that peer's model
            assert torch.equal(states[i][k][f"xhat.{Pn[i]}"], traj[k, Pn[i]])
            assert torch.equal(states[i][k][f"mirror.{Pn[i]}"], traj[k, i])
    if isinstance(codec, IdentityCodec):  # lossless: pairwise gossip averaging
        X = X0.clone()
        for k in range(STEPS):
            P = [shift_one_peer(i, n, k) for i in range(n)]
            X = 0.5 * X + 0.5 * X[P] - LR * (A * X - b)
        torch.testing.assert_close(traj[-1], X, atol=1e-6, rtol=0)
    assert sent == [(n // 2) * D * 8 + STEPS * _payload_bytes(codec)] * n  # one peer per step


# ---- memory, errors ---------------------------------------------------------------------

def test_extra_memory_is_the_papers():
    n, d = 4, 11
    topo = make_topology("ring", n)

    def worker(t):
        out = []
        for algo in (ChocoSGD(), DCDPSGD(), ECDPSGD(), DeepSqueeze(), LowPrecisionDecentralized(),
                     LowPrecisionDecentralized(peer_selection="shift_one")):
            algo = algo.worker(t, topo)
            algo.setup(torch.zeros(d))
            out.append(algo.extra_memory_bytes())
        return out

    deg = 2
    # CHOCO: x_hat and the consensus term (2 d, any degree); Bagua: w, left, right
    want = [2 * d * 4, deg * d * 4, (deg + 1) * d * 4, d * 4, 3 * d * 4, n * d * 4]
    assert run_threads(n, worker) == [want] * n


def test_state_dict_round_trip_continues_exactly():
    X0, A, b = _problem()
    topo, _ = _ring()

    def worker(t):
        x = X0[t.rank].clone()
        a = ECDPSGD().worker(t, topo, seed=SEED)
        a.setup(x)
        for k in range(3):
            g = A[t.rank] * x - b[t.rank]
            a.before_update(k, x, g, LR)
            x -= LR * g
            a.after_update(k, x, g, LR)
        state = a.state_dict()
        bcopy = ECDPSGD().worker(t, topo, seed=SEED)
        bcopy.setup(x)
        bcopy.load_state_dict(state)
        assert bcopy.state.t == a.state.t == 4
        return all(torch.equal(u, v) for u, v in zip(a.state_tensors().values(), bcopy.state_tensors().values()))

    assert all(run_threads(N, worker))


def test_bad_options_raise_clear_errors():
    topo = make_topology("ring", 3)

    def worker(t):
        for make, word in ((lambda: ChocoSGD(gamma=0.0), "gamma"),
                           (lambda: ChocoSGD(gamma=1.5), "gamma"),
                           (lambda: DeepSqueeze(eta=-0.1), "eta"),
                           (lambda: LowPrecisionDecentralized(peer_selection="ring"), "peer_selection"),
                           (lambda: LowPrecisionDecentralized(peer_selection="shift_one").worker(t, topo).setup(
                               torch.zeros(3)), "even"),  # the number of workers: known to the worker
                           (lambda: LowPrecisionDecentralized(bits=9), "bits"),
                           (lambda: LowPrecisionDecentralized(rounding="up"), "rounding"),
                           (lambda: ECDPSGD(codec=MinMaxCodec(rounding="nearest")), "unbiased")):
            with pytest.raises(ValueError, match=word):
                make()
        return True

    assert all(run_threads(3, worker))
    with pytest.raises(ValueError, match="gamma"):
        TrainConfig(algorithm="choco", gamma=1.5)
    with pytest.raises(ValueError, match="codec"):
        TrainConfig(algorithm="lowprec-decentralized", codec="sign")
    with pytest.raises(ValueError, match="codec"):
        TrainConfig(algorithm="dcd", codec="modulo")
    with pytest.raises(ValueError, match="unbiased"):
        TrainConfig(algorithm="ecd", rounding="nearest")
    with pytest.raises(ValueError, match="codec"):
        TrainConfig(algorithm="ecd", codec="sign")


# ---- both runtimes, the training loop ----------------------------------------------------

def _all_algorithms(t, steps=4):
    """Module level (picklable) for the process runtime: every algorithm a few steps."""
    n = t.world_size
    X0, A, b = _problem(n)
    topo = make_topology("ring", n)
    q = MinMaxCodec(bits=3, rounding="stochastic")
    algos = [ChocoSGD(codec=q), DCDPSGD(codec=q), ECDPSGD(codec=q), DeepSqueeze(codec=q),
             LowPrecisionDecentralized(hierarchical=False),
             LowPrecisionDecentralized(peer_selection="shift_one", rounding="stochastic")]
    out = []
    for i, algo in enumerate(algos):
        x = X0[0 if i == 4 else t.rank].clone()  # Bagua's lowprec: every worker starts from one model
        algo = algo.worker(t, topo, seed=SEED)
        algo.setup(x)
        for k in range(steps):
            quadratic_step(algo, t, k, x, A, b, LR)
        out.append(x)
    return torch.stack(out), t.ledger.to_rows()


def test_thread_and_process_runtimes_agree_exactly():
    threads = run_threads(4, _all_algorithms)
    procs = launch(4, _all_algorithms, backend="gloo", timeout_s=120)
    for (xa, la), (xb, lb) in zip(threads, procs):
        assert torch.equal(xa, xb)
        assert la == lb


@pytest.mark.parametrize("name", ["choco", "dcd", "ecd", "deepsqueeze", "lowprec-decentralized"])
def test_train_runs_end_to_end(name):
    run = train(TrainConfig(algorithm=name, steps=30, workers=4, eval_every=10))
    s = run.summary
    assert s["bytes_sent"] > 0 and s["extra_memory_bytes"] > 0
    assert s["final_test_accuracy"] > 0.3  # well above chance (0.1) after 30 steps
