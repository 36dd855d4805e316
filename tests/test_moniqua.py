"""Moniqua complete (slack matrix, auto theta, verification, entropy coding) and
D2 / Moniqua-D2, each against its equations in matrix form."""

import io
import math
import warnings

import pytest
import torch

from lowbit.algorithms import D2, DPSGD, Moniqua, MoniquaD2
from lowbit.algorithms.moniqua import GAMMA_NOISE, GAMMA_NOISE_1BIT, GAMMA_NOISE_INDEPENDENT, VERIFY_BLOCK
from lowbit.codecs import ModuloCodec
from lowbit.algorithms.moniqua.frame import REPAIR_LEVELS, ModuloFrame
from lowbit.codecs.rng import shared_generator
from lowbit.comm import run_threads
from lowbit.topology import make_topology, slack_matrix
from lowbit.train import TrainConfig, train
from quadratic import quadratic_problem, quadratic_step, run_quadratic

N, D, STEPS, LR = 5, 7, 6, 0.1


def _problem(seed=0, spread=0.01, d=D):
    return quadratic_problem(N, d, seed, scale=spread)


def _lr(k):
    return LR * (1 + 0.1 * k)  # varies, so that a_{k-1} G_{k-1} and a_k G_k differ


def _run(make_algo, X0, A, b, steps=STEPS, lr=_lr):
    """The trajectories (steps, N, d), each worker's ledger and algorithm."""
    res = run_quadratic(make_algo, X0, A, b, steps, lr)
    return (torch.stack([torch.stack(seen) for seen, *_ in res], 1), [t.ledger for _, _, t, _ in res],
            [algo for _, algo, _, _ in res])


def _grad(A, b, X):
    return A * X - b


def _modulo_mix(codec, X, W, neighbors, gamma, gen, wrong=None, dither=None):
    """Algorithm 1 lines 3-6 with the slack matrix; ``wrong`` collects (i, j) whose
    recovery differs from the sender's grid value (left out of the mix, as verification does).
    ``dither``: a generator for a shared subtractive dither, uniform over one grid cell."""
    step = codec.B_theta / codec.levels
    if dither is not None:
        v = (torch.rand(X.shape[1], generator=dither, dtype=torch.float64) - 0.5) * step
        X_in = X + v
        Y = _modulo_mix(codec, X_in, W, neighbors, gamma, gen, wrong)
        return X + (Y - X_in)  # the mix of the dithered values, v subtracted from every decode
    Q = [codec.encode(X[j], generator=gen()) for j in range(X.shape[0])]
    Y = torch.empty_like(X)
    for i in range(X.shape[0]):
        own = codec.decode(Q[i], ref=X[i])
        delta = torch.zeros_like(X[i])
        for j in neighbors(i):
            rec = codec.decode(Q[j], ref=X[i])
            if wrong is not None:
                true = codec.decode(Q[j], ref=X[j])  # the sender's own grid value
                if not torch.equal(torch.round(rec / step), torch.round(true / step)):
                    # Lemma 2: a wrong recovery needs |x_i - x_j| >= theta somewhere
                    assert float((X[i] - X[j]).abs().max()) >= codec.theta
                    wrong.append((i, j))
                    continue
            delta = delta + (rec - own) * W[j, i]
        Y[i] = X[i] + gamma * delta
    return Y


# ---- 1. the slack matrix at 1 bit (Theorem 3) ------------------------------------------

@pytest.mark.parametrize("rounding", [None, "nearest"], ids=["dithered", "nearest"])
def test_one_bit_moniqua_with_slack_matrix_is_theorem_3(rounding):
    """1 bit: nearest rounding (delta = 1/4); by default of a shared subtractive dither."""
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    W = topo.mixing_matrix()
    gamma, theta = 0.3, 4.0
    codec = ModuloCodec(bits=1, theta=theta, rounding="nearest")
    traj, ledgers, algos = _run(lambda t: Moniqua(bits=1, theta=theta, gamma=gamma,
                                                  rounding=rounding).worker(t, topo, seed=5), X0, A, b)
    assert all(a.codec.rounding == "nearest" and a.gamma == gamma for a in algos)  # 1 bit defaults to nearest
    assert all(a.dithered == (rounding is None) for a in algos)
    X = X0.clone()
    wrong = []
    for k in range(STEPS):
        dither = shared_generator(5, k, 0) if rounding is None else None
        Y = _modulo_mix(codec, X, W, topo.neighbors, gamma, lambda: None, wrong, dither=dither)
        X = Y - _lr(k) * _grad(A, b, X)
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
    assert wrong == [] and sum(a.state.mismatches for a in algos) == 0
    # x_{k+1/2} = X W~ exactly when nothing is quantized: W~ = gamma W + (1 - gamma) I
    Wt = torch.tensor(slack_matrix(W, gamma))
    torch.testing.assert_close(X0 + gamma * (torch.tensor(W).T @ X0 - X0), Wt.T @ X0, atol=1e-12, rtol=0)
    # one bit per element plus a 16-bit hash per block and the control byte, to 2 neighbours
    assert ledgers[0].bytes_sent == STEPS * 2 * (-(-D // 8) + _overhead(D))


def test_default_gamma_keeps_the_rounding_noise_inside_theta():
    """gamma = min(1, (2 r / (1 + r)) / (1 - lambda_min(W))), r = R theta / s (R = GAMMA_NOISE_1BIT at
    1 bit): s = 2 theta at 1 bit
    (nearest, B_theta = 4 theta), theta at 2 bits and theta / 3 at 3 bits (stochastic, B_theta = 4
    theta and 8 theta / 3); lambda_min = -1/3 on a ring with 1/3 weights, 0 on a complete graph."""
    def g(r):
        return 2 * r / (1 + r)

    def gamma(t, topo, bits):
        w = Moniqua(bits=bits).worker(t, topo)
        w.setup(torch.zeros(D))
        return w.state.gamma  # None picks it for the worker's W

    def worker(t, topo):
        return Moniqua(bits=1).codec.rounding, gamma(t, topo, 1), gamma(t, topo, 2), gamma(t, topo, 3)

    for topo, lam_min in ((make_topology("ring", 8), -1 / 3), (make_topology("complete", 5), 0.0)):
        for rounding, g1, g2, g3 in run_threads(topo.n, lambda t: worker(t, topo)):
            assert rounding == "nearest"
            assert g1 == pytest.approx(g(GAMMA_NOISE_1BIT / 2) / (1 - lam_min))
            assert g2 == pytest.approx(g(GAMMA_NOISE) / (1 - lam_min))
            assert g3 == pytest.approx(min(1.0, g(3 * GAMMA_NOISE) / (1 - lam_min)))
    # one worker: W = [[1]] mixes nothing, any gamma does the same (the CLI fuzz test found a division by 0)
    assert run_threads(1, lambda t: gamma(t, make_topology("ring", 1), 2)) == [1.0]
    # without shared randomness, above 1 bit: the smaller R of independent rounding
    def independent(t):
        w = Moniqua(bits=2, shared_randomness=False).worker(t, make_topology("ring", 8))
        w.setup(torch.zeros(D))
        return w.state.gamma

    assert GAMMA_NOISE_INDEPENDENT < GAMMA_NOISE
    assert run_threads(8, independent) == [pytest.approx(g(GAMMA_NOISE_INDEPENDENT) / (4 / 3))] * 8
    # the mode that decays slowest, not the spectral gap: one gamma on every ring with 1/3 weights
    expect = pytest.approx(g(GAMMA_NOISE) / (4 / 3))
    assert run_threads(4, lambda t: gamma(t, make_topology("ring", 4), 2)) == [expect] * 4


# ---- 2. D2 and Moniqua-D2 ---------------------------------------------------------------

def _d2_reference(X0, A, b, mix, steps=STEPS):
    X_prev, step_prev, X = X0.clone(), torch.zeros_like(X0), X0.clone()  # X_{-1} = X_0, G_{-1} = 0
    out = []
    for k in range(steps):
        step = _lr(k) * _grad(A, b, X)
        half = 2 * X - X_prev - step + step_prev
        X_prev, step_prev = X, step
        X = mix(k, half)
        out.append(X.clone())
    return out


def test_d2_is_its_matrix_form():
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    W = torch.tensor(topo.mixing_matrix())
    traj, ledgers, algos = _run(lambda t: D2().worker(t, topo), X0, A, b)
    for k, X in enumerate(_d2_reference(X0, A, b, lambda k, H: W.T @ H)):
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
    assert all(a.extra_memory_bytes() == 2 * D * 8 for a in algos)  # X_{k-1} and a_{k-1} G_{k-1}
    assert set(algos[0].state_dict()["tensors"]) == {"prev_x", "prev_step"}
    assert ledgers[0].bytes_sent == STEPS * 2 * (4 + 4 * D)  # fp32 gossip


def test_d2_removes_the_outer_variance_bias_of_dpsgd():
    """Different local optima: with a constant step D-PSGD stalls O(lr) away from the
    optimum of the average, D2 converges to it (Tang et al. 2018)."""
    X0, A, b = _problem(seed=1)
    topo = make_topology("ring", N)
    x_star = b.sum(0) / A.sum(0)
    errs = {}
    for name, cls in (("dpsgd", DPSGD), ("d2", D2)):
        traj, _, _ = _run(lambda t: cls().worker(t, topo), X0, A, b, steps=300, lr=lambda k: 0.2)
        errs[name] = float((traj[-1] - x_star).abs().max())
    assert errs["d2"] < 1e-4 < 0.05 < errs["dpsgd"], errs


def test_moniqua_d2_is_d2_with_modulo_gossip():
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    W = topo.mixing_matrix()
    theta = 50.0  # D2's extrapolation moves the models further apart than D-PSGD's step
    codec = ModuloCodec(bits=2, theta=theta)
    traj, _, algos = _run(lambda t: MoniquaD2(bits=2, theta=theta, gamma=1.0).worker(t, topo, seed=7), X0, A, b)
    wrong = []

    def mix(k, H):
        return _modulo_mix(codec, H, W, topo.neighbors, 1.0, lambda: shared_generator(7, k, 0), wrong)

    for k, X in enumerate(_d2_reference(X0, A, b, mix)):
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
    assert wrong == [] and sum(a.state.gossip.mismatches for a in algos) == 0
    assert algos[0].extra_memory_bytes() == 2 * D * 8
    moniqua = Moniqua(bits=2, theta=theta, gamma=1.0)  # D2 around Moniqua's gossip
    assert isinstance(algos[0].algorithm, D2) and algos[0].algorithm.gossip == moniqua
    assert MoniquaD2(bits=2, theta=theta, gamma=1.0) == MoniquaD2(moniqua) == MoniquaD2(gossip=moniqua)
    with pytest.raises(TypeError, match="gossip"):
        MoniquaD2(DPSGD())
    assert "blocks in" in MoniquaD2.run_warning({"theta": 1.0, "mismatched_blocks": 3, "mismatched_messages": 2})


def test_d2_rejects_momentum_and_takes_weight_decay():
    with pytest.raises(ValueError, match="momentum"):
        TrainConfig(algorithm="d2", momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        TrainConfig(algorithm="moniqua-d2", momentum=0.5)
    TrainConfig(algorithm="moniqua-d2", momentum=0.0, weight_decay=1e-4)


# ---- 3. theta = "auto" (Theorem 2) ---------------------------------------------------------

def test_auto_theta_survives_a_zero_step_size():
    """A schedule that starts at (or passes through) lr 0: theta_0 falls back to 1 and theta_k
    does not follow alpha_k = 0 (the codec needs theta > 0)."""
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    traj, _, algos = _run(lambda t: Moniqua(bits=2).worker(t, topo, seed=2), X0, A, b,
                          lr=lambda k: 0.0 if k in (0, 3) else LR)
    assert algos[0].state.theta_start == 1.0 and all(torch.isfinite(t).all() for t in traj)


@pytest.mark.parametrize("far", [False, True], ids=["close", "far"])
def test_auto_theta_starts_from_the_first_gradient_and_follows_the_wrong_blocks(far, monkeypatch):
    """theta_0 = THETA_START alpha_0 max_i ||g_0,i||_inf; then every theta_every steps it doubles when
    more than THETA_TARGET of the blocks checked were wrong, shrinks by THETA_SHRINK when none was."""
    import lowbit.algorithms.moniqua as moniqua_module

    X0, A, b = _patchy_problem() if far else _problem()
    if not far:  # equal models (A4): the first gradients bound the first steps' distance
        X0 = X0[:1].expand_as(X0).clone()
    topo = make_topology("ring", N)
    every, steps = 2, 8
    seen = []  # (rank, theta before, wrong, checked, theta after) of every agreement
    agree = Moniqua._agree_theta

    def spy(state, ctx):
        before, window = state.theta, list(state.window)
        agree(state, ctx)
        seen.append((ctx.rank, before, *window, state.theta))

    monkeypatch.setattr(Moniqua, "_agree_theta", staticmethod(spy))
    traj, ledgers, algos = _run(lambda t: Moniqua(bits=2, theta="auto", theta_every=every,
                                                  verify_block=8).worker(t, topo, seed=2),
                                X0, A, b, steps=steps, lr=lambda k: LR)
    theta0 = moniqua_module.THETA_START * LR * float(_grad(A, b, X0).abs().max())
    rounds = [[r for r in seen if r[0] == i] for i in range(N)]
    agreed_after = [k for k in range(steps) if k < every or (k + 1) % every == 0]  # [0, 1, 3, 5, 7]
    assert all(len(r) == len(agreed_after) for r in rounds)
    assert rounds[0][0][1] == pytest.approx(theta0, rel=1e-12)
    for k, after in enumerate(agreed_after):
        wrong = sum(r[k][2] for r in rounds)
        checked = sum(r[k][3] for r in rounds)
        window = after - (agreed_after[k - 1] if k else -1)  # steps since the last agreement
        assert checked == window * N * 2 * -(-X0.shape[1] // 8)  # every block of every message
        factor = 2.0 if wrong > moniqua_module.THETA_TARGET * checked else moniqua_module.THETA_SHRINK if wrong == 0 else 1.0
        for r in rounds:  # all workers in lock step
            assert r[k][4] == pytest.approx(r[k][1] * factor, rel=1e-12)
    first = rounds[0][0]  # far apart: wrong blocks, theta doubles; close: none, theta shrinks
    assert (first[2] > 0, first[4] / first[1]) == ((True, 2.0) if far else (False, pytest.approx(0.8)))
    # the agreements are counted all-reduces: 8 bytes at the start, then 16 per agreement
    ops = [r.nbytes for recs in ledgers[0].records.values() for r in recs if r.op == "all_reduce"]
    assert ops == [8] + [16] * len(agreed_after)
    # theta is checkpointed: a fresh instance restores it
    state = algos[0].state_dict()

    def restore(t):
        a = Moniqua(theta="auto", theta_every=every).worker(t, topo)
        a.setup(X0[t.rank].clone())
        a.load_state_dict(state)
        return a.state.theta, a.state.window

    assert run_threads(N, restore)[0] == (algos[0].state.theta, algos[0].state.window)


# ---- 4. verification -----------------------------------------------------------------------

def _overhead(d, block=VERIFY_BLOCK, asked=None):
    """Verification bytes of one message: a 16-bit hash per block and the control byte,
    plus ``asked`` (neighbour, block mask) repair requests and their count."""
    nb = -(-d // block)
    return 2 * nb + 1 + (2 + len(asked) * (2 + -(-nb // 8)) if asked else 0)


def _verified_reference(X0, A, b, topo, theta0, steps, seed, block=VERIFY_BLOCK):
    """Moniqua with verification (gamma 1), in matrix form, per block of ``block`` elements. A wrong
    block of a recovery (its grid integers differ from the sender's) is left out of the mix;
    the blocks of an edge with a wrong recovery at step k (asked by either end) are mixed
    from the repair at step k + 1 (both ends' float32 values as 16-bit min-max codes of their
    block: :func:`_repair16`), the rest of the edge normally. Returns the trajectory, the
    wrong (k, i, j, block), worker 0's bytes and the final theta."""
    W = topo.mixing_matrix()
    d = X0.shape[1]
    nb = -(-d // block)
    spans = [slice(c * block, min((c + 1) * block, d)) for c in range(nb)]
    X, theta, nack = X0.clone(), theta0, {i: {} for i in range(N)}
    out, wrong_all, bytes0 = [], [], 0
    for k in range(steps):
        codec = ModuloCodec(bits=2, theta=theta)
        step = codec.B_theta / codec.levels
        Q = [codec.encode(X[j], generator=shared_generator(seed, k, 0)) for j in range(N)]
        own = [codec.decode(Q[i], ref=X[i]) for i in range(N)]
        R = torch.stack([_repair16(X[j], spans) for j in range(N)])
        repair = {i: {j: nack[i].get(j, set()) | nack[j].get(i, set()) for j in topo.neighbors(i)} for i in range(N)}
        new_nack = {i: {} for i in range(N)}
        Y = torch.empty_like(X)
        for i in range(N):
            delta = torch.zeros_like(X[i])
            for j in topo.neighbors(i):
                rec = codec.decode(Q[j], ref=X[i])
                for c, sl in enumerate(spans):
                    ok = torch.equal(torch.round(rec[sl] / step), torch.round(own[j][sl] / step))
                    if not ok:
                        assert float((X[i, sl] - X[j, sl]).abs().max()) >= theta  # Lemma 2, in this block
                        new_nack[i].setdefault(j, set()).add(c)
                        wrong_all.append((k, i, j, c))
                    if c in repair[i][j]:
                        delta[sl] += (R[j, sl] - R[i, sl]) * W[j, i]
                    elif ok:
                        delta[sl] += (rec[sl] - own[i][sl]) * W[j, i]
            Y[i] = X[i] + delta
        bytes0 += 2 * (Q[0].data.numel() + _overhead(d, block, nack[0]))
        union = set().union(*repair[0].values())
        if union:  # one repair message of the union of the repaired blocks to each asked edge: the block
            nrep = sum(1 for blocks in repair[0].values() if blocks)  # mask, min and max, 16-bit codes
            bytes0 += nrep * (-(-nb // 8) + 8 * len(union) + 2 * sum(spans[c].stop - spans[c].start for c in union))
        nack = new_nack
        X = Y - LR * _grad(A, b, X)
        out.append(X.clone())
    return out, wrong_all, bytes0, theta


def _repair16(x, spans):
    """x's float32 values as the repair carries them: per block, nearest of 2^16 - 1 steps
    from its min to its max, back in float32."""
    out = torch.empty_like(x)
    for sl in spans:
        v = x[sl].float().double()
        lo, hi = float(v.min()), float(v.max())
        q = torch.round((v - lo) * (65535 / (hi - lo))) * ((hi - lo) / 65535) if hi > lo else torch.zeros_like(v)
        out[sl] = (lo + q).float().double()
    return out


def _spread(X):
    return float((X[:, None, :] - X[None, :, :]).abs().max())


def _patchy_problem(d=40, block=8):
    """Models far apart in the first blocks only, close elsewhere: with a small theta
    some blocks of a message are recovered wrong and the others right."""
    X0, A, b = _problem(spread=1.0, d=d)
    scale = torch.ones(d, dtype=torch.float64)
    scale[2 * block:] = 0.001
    return X0 * scale, A, b * scale  # local optima b_i / A_i close there too


def test_verification_detects_every_wrong_block_and_repairs_only_those():

    d, block = 40, 8
    # models far apart in blocks 0 and 1 ...
    X0, A, b = _patchy_problem(d, block)
    topo = make_topology("ring", N)
    theta0, steps = 0.01, 30  # ... and a far too small theta there
    traj, ledgers, algos = _run(lambda t: Moniqua(bits=2, theta=theta0, verify_block=block,
                                                  gamma=1.0).worker(t, topo, seed=4), X0, A, b, steps=steps,
                                lr=lambda k: LR)
    ref, injected, bytes0, theta = _verified_reference(X0, A, b, topo, theta0, steps, 4, block)
    for k in range(steps):
        torch.testing.assert_close(traj[k], ref[k], atol=1e-6, rtol=0)
    assert len(injected) >= 30
    # partial messages happen: some wrong blocks, the rest of the message right and used
    per_msg = {}
    for k, i, j, c in injected:
        per_msg.setdefault((k, i, j), set()).add(c)
    assert any(len(blocks) < d // block for blocks in per_msg.values())
    for i in range(N):  # every wrong block detected by its receiver, and nothing else
        assert algos[i].state.mismatches == sum(1 for _, r, _, _ in injected if r == i)
        assert algos[i].state.mismatched_messages == sum(1 for (_, r, _) in per_msg if r == i)
        assert algos[i].state.theta == theta  # all workers in lock step
    assert theta == theta0
    # theta stays too small for the local optima's spread; the repaired blocks still pull together
    assert _spread(traj[-1][:, :2 * block]) < 0.5 * _spread(X0[:, :2 * block])
    # one warning for the whole run, with the counts summed over workers
    report = {k: sum(a.report()[k] for a in algos) if isinstance(v, int) else v for k, v in algos[0].report().items()}
    assert f"{sum(a.state.mismatches for a in algos)} blocks in" in Moniqua.run_warning(report)
    assert Moniqua.run_warning({**report, "mismatched_blocks": 0}) is None
    # theta='auto' that ran away (the noise sets the distance) says so
    runaway = Moniqua.run_warning({**report, "mismatched_blocks": 0, "theta_start": report["theta"] / 300})
    assert "grew 300-fold" in runaway and "--gamma" in runaway
    assert Moniqua.run_warning({**report, "mismatched_blocks": 0, "theta_start": report["theta"] / 200}) is None
    assert algos[0].state_dict()["extra"]["mismatches"] == algos[0].state.mismatches
    # every byte counted: codes, block hashes, control byte, repair requests and the fp32 block repairs
    assert ledgers[0].bytes_sent == bytes0
    assert {r.op for recs in ledgers[0].records.values() for r in recs} == {"neighbor"}


@pytest.mark.filterwarnings("ignore:moniqua:RuntimeWarning")
def test_repair_sends_only_the_failed_blocks():
    """Same run with one block for the whole vector: every repair resends all of it."""
    d = 40
    X0, A, b = _patchy_problem(d, 8)
    topo = make_topology("ring", N)
    _, small, _ = _run(lambda t: Moniqua(bits=2, theta=0.01, verify_block=8).worker(t, topo, seed=4), X0, A, b,
                       steps=10, lr=lambda k: LR)
    _, whole, _ = _run(lambda t: Moniqua(bits=2, theta=0.01, verify_block=d).worker(t, topo, seed=4), X0, A, b,
                       steps=10, lr=lambda k: LR)
    codes = 10 * 2 * -(-d * 2 // 8)
    assert small[0].bytes_sent - codes < 0.7 * (whole[0].bytes_sent - codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_repair_message_is_16_bit_min_max_per_block(dtype):
    """A repair carries each block's float32 min and max and 16-bit codes: exact byte count,
    each value within (max - min) / (2 (2^16 - 1)) of its float32 value (then rounded to
    float32), a constant block exact, zeros outside; a wrong length is a clear error."""
    frame = ModuloFrame(bits=2, block=64, verify=True, entropy=None, peers=2, rank=0)
    d = 300  # 5 blocks, the last one of 44 elements
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(d, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, d, dtype=torch.float64)).to(dtype)
    x[64:128] = 0.3  # a constant block
    blocks = {1, 2, 4}
    msg = frame.repair_message(x, blocks)
    at = frame.block_elements(blocks, d, "cpu")[0]
    assert torch.equal(at, torch.cat([torch.arange(64, 192), torch.arange(256, 300)]))
    assert msg.dtype == torch.uint8 and msg.numel() == 1 + 8 * len(blocks) + 2 * at.numel()
    got_at, vals = frame.read_repair(msg, d, "cpu", sender=1)
    assert torch.equal(got_at, at) and vals.dtype == torch.float32
    got = torch.zeros(d, dtype=torch.float32)
    got[at] = vals
    x32 = x.float()
    for c in sorted(blocks):
        sl = slice(64 * c, min(64 * (c + 1), d))
        span = float(x32[sl].max() - x32[sl].min())
        err = (got[sl].double() - x32[sl].double()).abs()
        ulp = x32[sl].abs().double() * 2.0 ** -24  # the final rounding to float32
        assert bool((err <= span / (2 * REPAIR_LEVELS) + ulp).all()), (c, float(err.max()), span)
    assert torch.equal(got[64:128], torch.full((64,), 0.3, dtype=torch.float32))
    with pytest.raises(ValueError, match="worker 0 got a malformed repair message from worker 1"):
        frame.read_repair(msg[:-1], d, "cpu", sender=1)


@pytest.mark.filterwarnings("ignore:moniqua:RuntimeWarning")
def test_pending_block_repairs_are_checkpointed():
    d, block = 40, 8
    X0, A, b = _patchy_problem(d, block)
    topo = make_topology("ring", N)
    _, _, algos = _run(lambda t: Moniqua(bits=2, theta=0.01, verify_block=block).worker(t, topo, seed=4), X0, A, b,
                       steps=3, lr=lambda k: LR)
    states = [a.state_dict() for a in algos]
    assert any(s["extra"]["nack"] for s in states)

    def restore(t):
        a = Moniqua(bits=2, theta=0.01, verify_block=block).worker(t, topo)
        a.setup(X0[t.rank].clone())
        a.load_state_dict(states[t.rank])
        return a.state_dict()

    assert states == run_threads(N, restore)
    # what a checkpoint holds loads without running code (lowbit.integrations.checkpoint)
    buf = io.BytesIO()
    torch.save(states, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == states


def test_a_checkpoint_holds_only_saved_values_and_refuses_grow_theta_runs():
    """The checkpoint holds MoniquaSaved's fields, none of the caches; a checkpoint written by a
    run with the removed grow_theta (alarms pending or theta doubled) is refused by name, one
    with those entries empty (every other run's) loads."""
    from lowbit.algorithms.moniqua import MoniquaSaved

    w = Moniqua(bits=2, theta=0.5).worker(run_threads(1, lambda t: t)[0], make_topology("ring", 1))
    w.setup(torch.zeros(16))
    extra = w.state_dict()["extra"]
    assert set(extra) == {f for f in MoniquaSaved.__dataclass_fields__}
    w.load_state_dict({"tensors": {}, "extra": {**extra, "pending_alarms": [], "theta_doublings": 0}})
    for old in ({"pending_alarms": [3]}, {"theta_doublings": 2}):
        with pytest.raises(ValueError, match="grow_theta"):
            w.load_state_dict({"tensors": {}, "extra": {**extra, **old}})


def test_verification_has_no_false_alarms_with_a_correct_theta():
    X0, A, b = _problem(spread=1.0, d=40)
    topo = make_topology("ring", N)
    theta0 = 20.0
    traj, ledgers, algos = _run(lambda t: Moniqua(bits=2, theta=theta0, verify_block=8,
                                                  gamma=1.0).worker(t, topo, seed=4),
                                X0, A, b, steps=STEPS, lr=lambda k: LR)
    ref, injected, bytes0, theta = _verified_reference(X0, A, b, topo, theta0, STEPS, 4, block=8)
    assert injected == [] and theta == theta0
    assert [a.state.mismatches for a in algos] == [0] * N
    assert ledgers[0].bytes_sent == bytes0 == STEPS * 2 * (-(-40 * 2 // 8) + _overhead(40, 8))
    for k in range(STEPS):
        torch.testing.assert_close(traj[k], ref[k], atol=1e-6, rtol=0)


def test_without_verification_no_word_is_sent():
    X0, A, b = _problem()
    topo = make_topology("ring", N)
    _, ledgers, _ = _run(lambda t: Moniqua(bits=2, theta=4.0, verify=False).worker(t, topo), X0, A, b)
    assert ledgers[0].bytes_sent == STEPS * 2 * -(-D * 2 // 8)


# ---- 5. entropy coding -----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["zlib", "ans"])
def test_entropy_coding_sends_fewer_bytes_and_the_same_values(method):
    X0, A, b = _problem(d=2000)  # models close to each other and to 0: few codes are used
    topo = make_topology("ring", N)
    plain, lp, _ = _run(lambda t: Moniqua(bits=4, theta=2.0).worker(t, topo, seed=1), X0, A, b, steps=3)
    coded, lc, algos = _run(lambda t: Moniqua(bits=4, theta=2.0, entropy=method).worker(t, topo, seed=1), X0, A, b,
                            steps=3)
    assert torch.equal(plain, coded)
    assert sum(a.state.mismatches for a in algos) == 0
    assert lc[0].bytes_sent < 0.8 * lp[0].bytes_sent, (lc[0].bytes_sent, lp[0].bytes_sent)


# ---- 6. validation ------------------------------------------------------------------------------

def test_bad_options_name_the_argument():
    for kw, word in ((dict(gamma=0.0), "gamma"), (dict(gamma=1.5), "gamma"), (dict(theta="big"), "theta"),
                     (dict(theta_every=0), "theta_every"), (dict(theta="auto", verify=False), "verify=True"),
                     (dict(entropy="gzip"), "entropy"), (dict(verify="yes"), "verify"),
                     (dict(verify_block=0), "verify_block"), (dict(verify_block=2.0), "verify_block"),
                     (dict(bits=1, rounding="stochastic"), "delta"), (dict(dither="yes"), "dither"),
                     (dict(dither=True, rounding="stochastic"), "dither")):
        with pytest.raises(ValueError, match=word):
            Moniqua(**kw)
        with pytest.raises(ValueError, match=word):
            MoniquaD2(**kw)
    with pytest.raises(ValueError, match="entropy"):
        TrainConfig(algorithm="moniqua", entropy="gzip")


# ---- 7. both runtimes --------------------------------------------------------------------------

def _three_algorithms(t):
    """Module level (spawn pickles it): Moniqua 1-bit with the slack matrix and auto theta,
    D2, Moniqua-D2 with entropy coding, one after the other on this rank."""
    torch.set_num_threads(1)
    topo = make_topology("ring", t.world_size)
    X0, A, b = _problem(spread=0.1)
    makers = {"moniqua": lambda: Moniqua(bits=1, theta="auto", theta_every=2, gamma=0.3).worker(t, topo, seed=3),
              "d2": lambda: D2().worker(t, topo),
              "moniqua-d2": lambda: MoniquaD2(bits=2, theta=0.05, entropy="zlib").worker(t, topo, seed=3)}
    out = {}
    for name, make in makers.items():
        x = X0[t.rank].clone()
        algo = make()
        algo.setup(x)
        for k in range(STEPS):
            quadratic_step(algo, t, k, x, A, b, _lr(k))
        out[name] = (x, algo.state_dict()["extra"])
    return out, t.ledger.to_rows()


def test_both_runtimes_agree_exactly():
    from lowbit.comm import launch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # theta=0.05 is too small for moniqua-d2 here
        threads = run_threads(3, _three_algorithms)
    procs = launch(3, _three_algorithms, backend="gloo", timeout_s=120)
    for (a, rows_a), (b, rows_b) in zip(threads, procs):
        assert rows_a == rows_b
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), name
            assert a[name][1] == b[name][1], name
    assert threads[0][0]["moniqua-d2"][1]["gossip"]["mismatches"] > 0  # the mismatch path ran on both


def test_train_runs_the_new_algorithms_from_their_config():
    for algorithm, extra in (("moniqua", dict(bits=1, theta="auto", theta_every=2)),
                             ("d2", dict(momentum=0.0)),
                             ("moniqua-d2", dict(momentum=0.0, bits=2, entropy="ans", theta=1.0))):
        s = train(TrainConfig(algorithm=algorithm, workers=3, steps=4, eval_every=4, hidden=8, **extra)).summary
        assert s["bytes_sent"] > 0 and math.isfinite(s["final_train_loss"])


def test_block_masks_round_trip_and_repairs_lacking_a_block_are_refused():
    """The request and repair block masks decode to the blocks packed (a short mask is an
    error), and a neighbour's repair that lacks a block of the edge is refused naming it."""
    from types import SimpleNamespace

    from lowbit.algorithms.moniqua.frame import pack_mask, unpack_mask
    from lowbit.algorithms.moniqua.verify import repair

    g = torch.Generator().manual_seed(3)
    for nb in (1, 7, 8, 9, 6501):
        blocks = set(torch.randperm(nb, generator=g)[: max(1, nb // 3)].tolist())
        assert unpack_mask(pack_mask(blocks, nb), nb) == blocks
    with pytest.raises(ValueError, match="needs 2 bytes"):
        unpack_mask(b"\x01", 9)
    frame = ModuloFrame(bits=2, block=8, verify=True, entropy=None, peers=2, rank=0)
    x = torch.randn(40, generator=g)
    theirs = frame.repair_message(torch.randn(40, generator=g), {1})  # the edge asked for blocks 1 and 3
    ctx = SimpleNamespace(rank=0, transport=SimpleNamespace(neighbor_exchange=lambda msg, peers: {1: theirs}))
    with pytest.raises(ValueError, match=r"malformed repair message from worker 1: it lacks blocks"):
        repair(frame, ctx, x, {1: {1, 3}})
    ctx.transport.neighbor_exchange = lambda msg, peers: {1: frame.repair_message(x + 1, {1, 3})}
    (at, ex), = repair(frame, ctx, x, {1: {1, 3}}).values()
    assert torch.equal(at, torch.cat([torch.arange(8, 16), torch.arange(24, 32)]))
    assert float((ex - 1).abs().max()) < 1e-3  # (x + 1) - x through two 16-bit repairs
