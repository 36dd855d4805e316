"""The centralized (gradient aggregation) family against plain references of
their equations, step by step, with the same shared randomness."""

import math

import numpy as np
import pytest
import torch

from lowbit.algorithms import (DQSG, NDQSG, QSGD, GlobalRandKMaxNormMultiScaleSGD, GlobalRandKMaxNormSGD,
                               MaxNormMultiScaleSGD, MaxNormSGD, OneBitEF, PowerSGD, TernGrad)
from lowbit.algorithms.dqsg import nested_codec
from lowbit.codecs import (DitheredCodec, MultiScaleMaxNormCodec, NestedDitheredCodec, QSGDCodec,
                           QSGDMaxNormCodec, RandKCodec, SignCodec, TernGradCodec, agree_scale, global_index_seed)
from lowbit.codecs.radix import level_bits, radix_nbytes
from lowbit.codecs.randk import select_reference
from lowbit.codecs.rng import counter_uniforms, draw_key, shared_generator  # the codecs' counter draws
from lowbit.comm import run_threads
from lowbit.train import TrainConfig, train
from quadratic import run_quadratic

D, STEPS, LR, SEED = 7, 6, 0.1, 3


def _problem(n, seed=0, spread=1.0, d=D):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(d, generator=g, dtype=torch.float64) * 0.1
    A = torch.rand(n, d, generator=g, dtype=torch.float64) + 0.5
    b0 = torch.randn(d, generator=g, dtype=torch.float64)
    b = b0 + spread * torch.randn(n, d, generator=g, dtype=torch.float64)
    return x0, A, b  # worker p: grad = A_p x - b_p


def _run(n, make_algo, x0, A, b, steps=STEPS):
    """Every worker starts at x0; returns the (common) trajectory and each worker's bytes per step."""
    res = run_quadratic(make_algo, x0.expand(n, -1), A, b, steps, LR,
                        observe=lambda k, x, algo, t: (x.clone(), t.ledger.step_bytes(k)))
    traj = [torch.stack([o[0] for o in seen]) for seen, *_ in res]
    for tr in traj[1:]:  # centralized: every worker holds the same model
        torch.testing.assert_close(tr, traj[0], atol=1e-12, rtol=0)
    return traj[0], [[o[1] for o in seen] for seen, *_ in res]


def _reference(n, x0, A, b, aggregate, steps=STEPS):
    x, out = x0.clone(), []
    for k in range(steps):
        G = A * x - b  # rows: workers
        x = x - LR * aggregate(k, G)
        out.append(x.clone())
    return torch.stack(out)


def _f32_up(v: float) -> float:
    f = np.float32(v)
    return float(np.nextafter(f, np.float32(np.inf))) if float(f) < v else float(f)


# ---- DQSG (Algorithm 1), both placements ------------------------------------------------------


@pytest.mark.parametrize("server", ["ps", "allgather"])
@pytest.mark.parametrize("n", [2, 5])
def test_dqsg_is_algorithm_1(server, n):
    M = 2
    x0, A, b = _problem(n)
    traj, sent = _run(n, lambda t: DQSG(levels=M, server=server).worker(t, seed=SEED), x0, A, b)

    def aggregate(k, G):
        rec = []
        for p in range(n):
            g = G[p]
            kappa = _f32_up(float(g.abs().max()))
            u = (counter_uniforms(draw_key(shared_generator(SEED, k, p)), D) - 0.5) / M  # u_p / kappa
            q = torch.floor(g / kappa * M + u * M + 0.5)  # index of the bin g/kappa + u lies in, Delta = 1/M
            assert int(q.abs().max()) <= M
            rec.append(kappa * (q / M - u))  # g~_p = kappa (Delta q_p - u_p)
        return torch.stack(rec).mean(0)

    torch.testing.assert_close(traj, _reference(n, x0, A, b, aggregate), atol=1e-6, rtol=0)
    nbytes = 8 + math.ceil(D * 3 / 8)  # header (numel, kappa) + 2M+1 = 5 indices in 3 bits
    for p in range(n):
        if server == "allgather":
            expect = (n - 1) * nbytes
        else:
            expect = math.ceil(math.log2(n)) * 4 * D if p == 0 else nbytes  # root broadcasts fp32
        assert sent[p] == [expect] * STEPS


def test_dqsg_levels_from_bits_and_errors():
    assert TrainConfig(algorithm="dqsg", bits=3, workers=2).levels is None
    with pytest.raises(ValueError, match="bits"):
        TrainConfig(algorithm="dqsg", bits=1, workers=2)
    with pytest.raises(ValueError, match="levels"):
        TrainConfig(algorithm="dqsg", levels=0, workers=2)
    with pytest.raises(ValueError, match="server"):
        TrainConfig(algorithm="dqsg", server="hub", workers=2)


# ---- NDQSG (Algorithm 2) ---------------------------------------------------------------------


def _ndqsg_reference(n, n2, M, nested: NestedDitheredCodec):
    n1 = n - n2

    def aggregate(k, G):
        d1, d2, al = nested.delta1, nested.delta2, nested.alpha
        dec = []
        for p in range(n1):  # P1: DQSG
            g = G[p]
            kappa = _f32_up(float(g.abs().max()))
            u = (counter_uniforms(draw_key(shared_generator(SEED, k, p)), D) - 0.5) / M
            q = torch.floor(g / kappa * M + u * M + 0.5)
            dec.append(kappa * (q / M - u))
        g_bar = torch.stack(dec).mean(0)
        for p in range(n1, n):  # P2: eq. (6) at the worker, eq. (7) at the server, in order
            g = G[p]
            kappa = _f32_up(float(g.abs().max()))
            u = (counter_uniforms(draw_key(shared_generator(SEED, k, p)), D) - 0.5) * d1
            t = al * g / kappa + u
            s = d1 * torch.floor(t / d1 + 0.5) - d2 * torch.floor(t / d2 + 0.5)  # Q1(t) - Q2(t)
            y = g_bar / kappa
            r = s - u - al * y
            g_hat = kappa * (y + al * (r - d2 * torch.floor(r / d2 + 0.5)))
            dec.append(g_hat)
            g_bar = torch.stack(dec).mean(0)  # the running average of what is decoded so far
        return g_bar

    return aggregate


@pytest.mark.parametrize("server", ["ps", "allgather"])
@pytest.mark.parametrize("n,frac", [(2, 0.5), (4, 0.5), (6, 0.34)])
def test_ndqsg_is_algorithm_2(server, n, frac):
    M = 2
    nested = nested_codec(delta1=1 / 3, k=3)  # the paper's Figure 6: Delta1 = 1/3, Delta2 = 1, alpha = 1
    assert (nested.delta1, nested.delta2, nested.alpha, nested.k) == (1 / 3, 1.0, 1.0, 3)
    assert nested.bits == level_bits(3) == 1.6  # 5 trits per byte
    x0, A, b = _problem(n, spread=0.05)
    traj, sent = _run(n, lambda t: NDQSG(levels=M, nested=nested, nested_fraction=frac, server=server)
                      .worker(t, seed=SEED), x0, A, b)
    n2 = min(n - 1, int(math.floor(frac * n + 0.5)))
    assert n2 >= 1
    torch.testing.assert_close(traj, _reference(n, x0, A, b, _ndqsg_reference(n, n2, M, nested)), atol=1e-6, rtol=0)
    p1_bytes = 8 + radix_nbytes(D, 2 * M + 1)  # 5 levels in mixed radix
    p2_bytes = 4 + 4 + radix_nbytes(D, 3)  # kappa + nested header (numel) + 3 levels in mixed radix
    for p in range(n):
        own = p2_bytes if p >= n - n2 else p1_bytes
        if server == "allgather":
            expect = (n - 1) * own
        else:
            expect = math.ceil(math.log2(n)) * 4 * D if p == 0 else own
        assert sent[p] == [expect] * STEPS


def test_ndqsg_decodes_close_side_information_exactly():
    """Theorem 6: when |alpha z| stays below (Delta2 - Delta1)/2 in units of kappa, the nested
    decode is the fine dithered estimate: the average is within kappa Delta1 / 2 per P2 worker."""
    n, n2 = 4, 2
    x0, A, b = _problem(n, spread=0.001)
    A[:] = A[0]
    nested = nested_codec(delta1=1 / 3, k=3)
    G = A * x0 - b
    agg = _ndqsg_reference(n, n2, 2, nested)(0, G)
    exact = G.mean(0)
    kap = G.abs().amax(1)
    bound = (kap[: n - n2].sum() * 0.5 / 2 + kap[n - n2:].sum() * nested.delta1 / 2) / n
    assert float((agg - exact).abs().max()) <= float(bound) + 1e-12
    # and the algorithm agrees with it
    traj, _ = _run(n, lambda t: NDQSG(levels=2, nested=nested).worker(t, seed=SEED), x0, A, b, steps=1)
    torch.testing.assert_close(traj[0], x0 - LR * agg, atol=1e-9, rtol=0)


def test_ndqsg_theorem6_parameters_and_errors():
    c = TrainConfig(algorithm="ndqsg", workers=4, nested_sigma=0.1, nested_failure=0.05)
    codec = nested_codec(sigma=c.nested_sigma, failure=c.nested_failure, k=c.nested_k)
    assert codec.k == 2 and codec.failure_probability(0.1) == pytest.approx(0.05)  # exact, Gaussian z
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_sigma=0.1, nested_delta1=0.2)
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_sigma="auto", nested_delta1=0.2)
    with pytest.raises(ValueError, match="nested_sigma must be a number > 0 or 'auto'"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_sigma="often")
    with pytest.raises(ValueError, match="nested_alpha"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_alpha=0.5)
    with pytest.raises(ValueError, match="nested_failure"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_failure=1.0)
    with pytest.raises(ValueError, match="nested_fraction"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_fraction=1.0)
    with pytest.raises(ValueError, match="k"):
        TrainConfig(algorithm="ndqsg", workers=4, nested_k=1)


def _f32(v):
    return float(np.float32(v))


def _ndqsg_auto_reference(n, n2, M, server, failure=0.001, k=2):
    """Algorithm 2 with the auto setting, written out: P2 sends DQSG until it has a measured
    sigma_z, then the nested codec of Theorem 6 (alpha = 1, Gaussian failure ``failure``,
    Delta1 and alpha as float32); sigma_z^2 = (m^2 / alpha^2 - Delta1^2 / 12) / alpha^2 with m^2
    the mean square of (g_hat - g_bar) / kappa; with ``ps`` it reaches the worker as float32."""
    from lowbit.codecs.nested import choose_nested_parameters

    n1, sigma = n - n2, {}

    def dqsg(g, k, p):
        kappa = _f32_up(float(g.abs().max()))
        u = (counter_uniforms(draw_key(shared_generator(SEED, k, p)), D) - 0.5) / M
        return kappa * (torch.floor(g / kappa * M + u * M + 0.5) / M - u), kappa

    def aggregate(step, G):
        dec = [dqsg(G[p], step, p)[0] for p in range(n1)]
        g_bar = torch.stack(dec).mean(0)
        for p in range(n1, n):
            g = G[p]
            if p not in sigma:
                g_hat, kappa = dqsg(g, step, p)
                d1, al = 1 / M, 1.0
            else:
                par = choose_nested_parameters(sigma[p], failure, k=k, alpha=1.0, method="gaussian")
                d1, al = _f32(par.delta1), _f32(par.alpha)
                d2 = k * d1
                kappa = _f32_up(float(g.abs().max()))
                u = (counter_uniforms(draw_key(shared_generator(SEED, step, p)), D) - 0.5) * d1
                t = al * g / kappa + u
                s = d1 * torch.floor(t / d1 + 0.5) - d2 * torch.floor(t / d2 + 0.5)
                y = g_bar / kappa
                r = s - u - al * y
                g_hat = kappa * (y + al * (r - d2 * torch.floor(r / d2 + 0.5)))
            m2 = float((((g_hat - g_bar) / kappa) ** 2).mean())
            sz = math.sqrt(max((m2 / al**2 - d1**2 / 12) / al**2, 1e-12))
            sigma[p] = _f32(sz) if server == "ps" else sz
            dec.append(g_hat)
            g_bar = torch.stack(dec).mean(0)
        return g_bar

    return aggregate


@pytest.mark.parametrize("server", ["ps", "allgather"])
@pytest.mark.parametrize("n", [2, 5])
def test_ndqsg_default_is_theorem6_on_the_measured_noise(server, n):
    """The default NDQSG (no nested option) step by step against the reference above, and its bytes:
    P2 sends one bit per element after a first DQSG step, with (Delta1, alpha) in front."""
    M = 1
    cfg = TrainConfig(algorithm="ndqsg", workers=n, server=server)
    assert nested_codec(delta1=cfg.nested_delta1, k=cfg.nested_k, alpha=cfg.nested_alpha, sigma=cfg.nested_sigma,
                        failure=cfg.nested_failure) is None  # the auto setting
    assert (cfg.nested_k, cfg.nested_failure, cfg.nested_fraction) == (2, 0.001, 0.5)
    x0, A, b = _problem(n, spread=0.05)
    traj, sent = _run(n, lambda t: NDQSG(levels=M, server=server).worker(t, seed=SEED), x0, A, b)
    n2 = min(n - 1, int(math.floor(0.5 * n + 0.5)))
    torch.testing.assert_close(traj, _reference(n, x0, A, b, _ndqsg_auto_reference(n, n2, M, server)),
                               atol=1e-6, rtol=0)
    p1_bytes = 8 + math.ceil(D * 2 / 8)  # numel, kappa, 3 levels in 2 bits
    for p in range(n):
        for step in range(STEPS):
            if p < n - n2:
                own = p1_bytes
            else:  # (Delta1, alpha), then DQSG's payload, or kappa + numel + 1-bit codes
                own = 8 + (p1_bytes if step == 0 else 4 + 4 + math.ceil(D / 8))
            if server == "allgather":
                expect = (n - 1) * own
            else:  # the server broadcasts the average and the n2 measured noises, fp32
                expect = math.ceil(math.log2(n)) * 4 * (D + n2) if p == 0 else own
            assert sent[p][step] == expect, (p, step)


def test_measured_sigma_recovers_the_side_information_noise():
    """The inversion of appendix E: decode x against y = x - z with Theorem 6's codec for sigma_z,
    and measured_sigma gives sigma_z back (few failures at 0.001; the rest is sampling)."""
    from lowbit.algorithms.dqsg import measured_sigma, theorem6_codec

    gen = torch.Generator().manual_seed(5)
    n = 200_000
    x = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
    for sigma in (0.02, 0.1, 0.3):
        z = torch.randn(n, generator=gen, dtype=torch.float64) * sigma
        codec = theorem6_codec(sigma, 2, 0.001)
        assert codec.k == 2 and codec.alpha == 1
        assert codec.failure_probability(sigma) == pytest.approx(0.001, rel=1e-3)
        xh = codec.roundtrip(x, generator=shared_generator(1, 2, 3), ref=x - z)
        assert measured_sigma(xh, x - z, 1.0, codec.delta1, codec.alpha) == pytest.approx(sigma, rel=0.02)
        # DQSG payload (alpha = 1, Delta1 = 1/M): m^2 = sigma^2 + Delta^2 / 12; the dither's share is
        # sampled too, so this first estimate is coarse when sigma^2 is far below Delta^2 / 12
        if sigma >= 0.1:
            dq = DitheredCodec(levels=1).roundtrip(x, generator=shared_generator(1, 2, 4))
            kappa = _f32_up(float(x.abs().max()))
            assert measured_sigma(dq, x - z, kappa, 1.0, 1.0) == pytest.approx(sigma / kappa, rel=0.05)
    assert measured_sigma(x, x, 0.0, 0.5, 1.0) is None  # a zero gradient says nothing


def test_ndqsg_auto_checkpoints_its_measured_noise():
    def worker(t):
        algo = NDQSG(levels=1).worker(t, seed=SEED)
        x = torch.zeros(D)
        algo.setup(x)
        for k in range(2):
            t.set_step(k)
            algo.before_update(k, x, torch.randn(D, generator=torch.Generator().manual_seed(k + t.rank)), LR)
        state = algo.state_dict()
        fresh = NDQSG(levels=1).worker(t, seed=SEED)
        fresh.setup(x)
        fresh.load_state_dict(state)
        return algo.state.sigma_z, fresh.state.sigma_z

    (s0, f0), (s1, f1) = run_threads(2, worker)
    assert s0 is None and f0 is None  # rank 0 is in P1
    assert s1 is not None and s1 > 0 and f1 == s1


# ---- QSGD, TernGrad, 1-bit SGD with error feedback -----------------------------------------------


@pytest.mark.parametrize("server", ["ps", "allgather"])
@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_qsgd_and_terngrad_average_the_decodes(name, server):
    n = 3
    x0, A, b = _problem(n)
    if name == "qsgd":
        codec, make = QSGDCodec(levels=7), (lambda t: QSGD(bits=4, server=server).worker(t, seed=SEED))
    else:
        codec, make = TernGradCodec(), (lambda t: TernGrad(server=server).worker(t, seed=SEED))
    traj, sent = _run(n, make, x0, A, b)

    def aggregate(k, G):
        return torch.stack([codec.decode(codec.encode(G[p], generator=shared_generator(SEED, k, p)),
                                         dtype=torch.float64) for p in range(n)]).mean(0)

    torch.testing.assert_close(traj, _reference(n, x0, A, b, aggregate), atol=1e-6, rtol=0)
    nbytes = 8 + math.ceil(D * (4 if name == "qsgd" else 2) / 8)
    assert sent[1] == [nbytes if server == "ps" else 2 * nbytes] * STEPS


def test_onebit_error_feedback():
    n = 4
    x0, A, b = _problem(n)
    traj, sent = _run(n, lambda t: OneBitEF().worker(t, seed=SEED), x0, A, b)
    E = torch.zeros(n, D, dtype=torch.float64)

    def aggregate(k, G):
        P = G + E  # p = g + e
        C = torch.stack([P[p].abs().mean() * torch.where(P[p] >= 0, 1.0, -1.0) for p in range(n)])  # ||p||_1/d sign
        E.copy_(P - C)  # e = p - C(p)
        return C.mean(0)

    torch.testing.assert_close(traj, _reference(n, x0, A, b, aggregate), atol=1e-6, rtol=0)
    assert sent[0] == [3 * (8 + 1)] * STEPS  # header (numel, scale) + 7 bits in one byte, to 3 others

    def worker(t):
        a = OneBitEF().worker(t)
        a.setup(torch.zeros(D))
        return a.extra_memory_bytes()

    assert run_threads(2, worker) == [4 * D] * 2
    assert SignCodec().bits == 1


# ---- the max-norm family (paper 004) -------------------------------------------------------------


def _maxnorm_reference(n, levels, k_keep=None, d=D):
    """Algorithms 1/2 in matrix form; levels: (s,) single scale or the multi-scale s_j."""
    s_min = levels[0]

    def aggregate(k, G):
        if k_keep is not None:
            idx = select_reference(d, k_keep, global_index_seed(SEED, k))
        else:
            idx = torch.arange(d)
        V = G[:, idx]
        W = _f32_up(max(max(float(torch.linalg.vector_norm(v)), float(v.abs().max())) for v in V))  # MAX
        a = V.abs() / W
        sc = torch.zeros_like(a)
        for s in levels:  # eq. (11): the largest s with s a <= min_j s_j, per worker ...
            sc = torch.where(a * s <= s_min, torch.full_like(a, float(s)), sc)
        s_star = sc.amin(0)  # ... then MIN over workers (scale sharing)
        codes = []
        for p in range(n):
            t = a[p] * s_star
            u = counter_uniforms(draw_key(shared_generator(SEED, k, p)), t.numel())
            xi = torch.floor(t) + (u < t - torch.floor(t)).double()
            codes.append(torch.sign(V[p]) * xi)
        zeta = torch.stack(codes).sum(0)
        out = torch.zeros(d, dtype=torch.float64)
        out[idx] = W * zeta / (n * s_star) * (d / len(idx))
        return out

    return aggregate


@pytest.mark.parametrize("cls,levels,k_keep", [
    (MaxNormSGD, (3,), None),
    (MaxNormMultiScaleSGD, (3, 63), None),
    (GlobalRandKMaxNormSGD, (3,), 3),
    (GlobalRandKMaxNormMultiScaleSGD, (3, 63), 3),
])
@pytest.mark.parametrize("n", [2, 8])
def test_maxnorm_family_is_algorithms_1_and_2(cls, levels, k_keep, n):
    x0, A, b = _problem(n)
    opts = dict(bits=2, **({"scales": (2, 6)} if len(levels) > 1 else {}), **({"k": k_keep} if k_keep else {}))
    traj, sent = _run(n, lambda t: cls(**opts).worker(t, seed=SEED), x0, A, b)
    torch.testing.assert_close(traj, _reference(n, x0, A, b, _maxnorm_reference(n, levels, k_keep)),
                               atol=1e-6, rtol=0)
    kept = D if k_keep is None else k_keep
    ring = lambda nbytes: (2 * (n - 1) * nbytes) // n  # noqa: E731
    expect = ring(4) + ring(kept * 1)  # MAX of the float32 norm, SUM of int8 codes
    if len(levels) > 1:
        expect += ring(kept * 1)  # MIN of the uint8 scale index
    assert sent[0] == [expect] * STEPS


def test_maxnorm_presets_are_maxnormsgd_with_other_defaults():
    """The four registry names are one class: each preset runs as MaxNormSGD with the same options."""
    x0, A, b = _problem(2)
    for preset, opts in ((MaxNormMultiScaleSGD(), dict(scales=(2, 6))), (GlobalRandKMaxNormSGD(k=3), dict(k=3)),
                         (GlobalRandKMaxNormMultiScaleSGD(k=0.5), dict(scales=(2, 6), k=0.5))):
        composed = MaxNormSGD(**opts)
        assert (preset.bits, preset.scales, preset.k) == (composed.bits, composed.scales, composed.k)
        traj_p, sent_p = _run(2, lambda t: preset.worker(t, seed=SEED), x0, A, b)
        traj_c, sent_c = _run(2, lambda t: composed.worker(t, seed=SEED), x0, A, b)
        assert torch.equal(traj_p, traj_c) and sent_p == sent_c
    with pytest.raises(TypeError, match="k"):
        GlobalRandKMaxNormSGD()  # k has no default


def test_maxnorm_sum_dtype_widens_with_workers_in_process():
    """130 workers with s = 1 (bits=1): the code sum reaches 130 > int8: the algorithm sends int16."""
    n, d = 130, 3
    x0, A, b = _problem(n, d=d)
    A[:] = 1.0
    b[:] = -1.0  # every worker's gradient is x0 + 1: with the linf norm every code is +-1 at once

    def make(t):
        a = MaxNormSGD(bits=1).worker(t, seed=SEED)
        a.setup(torch.zeros(d))
        assert a.state.sum_dtype == torch.int16
        return a

    traj, sent = _run(n, make, x0, A, b, steps=1)
    torch.testing.assert_close(traj, _reference(n, x0, A, b, _maxnorm_reference(n, (1,), d=d), steps=1),
                               atol=1e-6, rtol=0)
    assert sent[0][0] == (2 * (n - 1) * 4) // n + (2 * (n - 1) * 2 * d) // n


@pytest.mark.parametrize("codec", [QSGDMaxNormCodec(bits=2), QSGDMaxNormCodec(bits=5),
                                   MultiScaleMaxNormCodec(scales=(2, 6)), MultiScaleMaxNormCodec(scales=(7, 9))])
def test_code_sums_of_1024_workers_do_not_overflow(codec):
    """Worst case: every worker's codes at +max_code (all gradients equal, linf-like). The sum,
    accumulated rank by rank in codec.sum_dtype(M) as a ring would, equals the int64 sum."""
    m, d = 1024, 5
    g = torch.Generator().manual_seed(0)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    base[0] = 0.0
    xs = [base.clone() for _ in range(m - 2)] + [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(2)]
    scale = agree_scale(codec, xs)
    codes = [codec.encode_int(x, scale, shared_generator(0, 0, p)) for p, x in enumerate(xs)]
    dtype = codec.sum_dtype(m)
    acc = torch.zeros(d, dtype=dtype)
    for c in codes:
        acc += c.to(dtype)
    exact = torch.stack(codes).sum(0)
    assert torch.equal(acc.to(torch.int64), exact)
    narrower = {torch.int16: torch.int8, torch.int32: torch.int16}.get(dtype)
    if narrower is not None:  # the test can fail: a narrower dtype would have wrapped for the worst case
        assert m * codec.max_code > torch.iinfo(narrower).max
    avg = codec.decode_sum(acc.to(torch.int64), scale, m, dtype=torch.float64)
    assert float((avg - torch.stack(xs).mean(0)).abs().max()) <= float(scale if not isinstance(scale, tuple)
                                                                      else scale[0])


def test_maxnorm_rejects_a_sum_dtype_that_can_overflow():
    with pytest.raises(ValueError, match="overflow"):
        TrainConfig(algorithm="maxnorm", bits=2, workers=64, sum_dtype="int8")  # 64 * 3 > 127
    TrainConfig(algorithm="maxnorm", bits=2, workers=42, sum_dtype="int8")  # 42 * 3 = 126 fits
    with pytest.raises(ValueError, match="sum_dtype"):
        TrainConfig(algorithm="maxnorm", workers=2, sum_dtype="int7")
    with pytest.raises(ValueError, match="int64"):
        QSGDMaxNormCodec(bits=32).sum_dtype(2**33)
    with pytest.raises(ValueError, match="k"):
        TrainConfig(algorithm="grandk-maxnorm", workers=2)
    with pytest.raises(ValueError, match="integer"):
        TrainConfig(algorithm="grandk-maxnorm", workers=2, k=2.5)


def test_randk_codec_sees_the_global_selection():
    codec = RandKCodec(QSGDMaxNormCodec(bits=3), k=3).with_seed(global_index_seed(SEED, 4))
    assert torch.equal(codec.indices(D), select_reference(D, 3, global_index_seed(SEED, 4)))


# ---- PowerSGD ------------------------------------------------------------------------------------


def test_powersgd_is_vogels_algorithm():
    n, d, r = 3, 12, 2  # 4 x 3 matrix, rank 2
    x0, A, b = _problem(n, d=d)
    traj, sent = _run(n, lambda t: PowerSGD(rank=r).worker(t, seed=SEED), x0, A, b)
    Q = torch.randn(3, r, generator=shared_generator(SEED, 0, 0), dtype=torch.float32).double()
    E = torch.zeros(n, d, dtype=torch.float64)

    def aggregate(k, G):
        nonlocal Q
        Ms = [(G[p] + E[p]).view(4, 3) for p in range(n)]  # error feedback
        P = sum((M @ Q).float().double() for M in Ms) / n  # all-reduce mean of P (float32 on the wire)
        Ph, _ = torch.linalg.qr(P)
        Ph = Ph.float().double()
        Qs = [M.T @ Ph for M in Ms]
        Qm = sum(q.float().double() for q in Qs) / n  # all-reduce mean of Q
        for p in range(n):
            E[p] = (Ms[p] - Ph @ Qs[p].float().double().T).reshape(-1)  # e = M - P Q_p^T
        Q = Qm.float().double()  # warm start
        return (Ph @ Qm.T).reshape(-1)

    torch.testing.assert_close(traj, _reference(n, x0, A, b, aggregate, steps=STEPS), atol=1e-6, rtol=0)
    ring = lambda nbytes: (2 * (n - 1) * nbytes) // n  # noqa: E731
    assert sent[0] == [ring(4 * 4 * r) + ring(4 * 3 * r)] * STEPS


# ---- both runtimes, end to end ---------------------------------------------------------------------


def _two_algorithms(t):
    """NDQSG with the server placement (variable-size and empty buffers), then 2-bit two-scale
    max-norm (int8 SUM, uint8 MIN, float32 MAX all-reduces), on the quadratic of _problem."""
    x0, A, b = _problem(t.world_size, spread=0.05)
    out = []
    for algo in (NDQSG(levels=2, server="ps").worker(t, seed=SEED),
                 MaxNormMultiScaleSGD(scales=(2, 6)).worker(t, seed=SEED)):
        x = x0.clone().float()
        algo.setup(x)
        for k in range(3):
            t.set_step(k)
            g = (A[t.rank] * x.double() - b[t.rank]).float()
            algo.before_update(k, x, g, LR)
            x -= LR * g
        out.append(x)
    return torch.stack(out), t.ledger.to_rows()


def test_both_runtimes_agree():
    """One lowbit.comm.launch run (gloo processes) against run_threads: same models, same ledgers."""
    from lowbit.comm import launch

    threads = run_threads(2, _two_algorithms)
    procs = launch(2, _two_algorithms, timeout_s=120)
    for (xa, rows_a), (xb, rows_b) in zip(threads, procs):
        torch.testing.assert_close(xa, xb, atol=1e-6, rtol=0)
        assert rows_a == rows_b
    assert threads[1][1][0][1] == "neighbor"  # NDQSG's variable-size exchange went over the wire


NAMES = {"dqsg": {}, "ndqsg": {}, "qsgd": dict(bits=4), "terngrad": {}, "onebit-ef": {}, "maxnorm": {},
         "maxnorm-multiscale": dict(scales="2,6"), "grandk-maxnorm": dict(k=0.5),
         "grandk-maxnorm-multiscale": dict(k=0.5), "powersgd": {}}


@pytest.mark.parametrize("name", list(NAMES))
def test_end_to_end_train_config(name):
    cfg = TrainConfig(algorithm=name, workers=4, steps=30, eval_every=30, hidden=16, **NAMES[name])
    run = train(cfg)
    s = run.summary
    first, last = run.metrics[0], run.metrics[-1]
    assert last["train_loss"] < first["train_loss"]
    assert s["final_consensus_distance"] < 1e-10  # one aggregate: every worker holds the same model
    d = s["parameters"]
    assert s["wire_bits_per_element"] == pytest.approx(8 * s["bytes_sent"] / (4 * 30 * d))
    # the wire's bits per element: mixed radix for 3 levels (DQSG M=1, TernGrad) and QSGD's 2s+1 = 15;
    # NDQSG's default: 2 of the 4 workers in P1 (DQSG M = 1), 2 in P2 (nested k = 2, 1 bit);
    # multi-scale (2, 6): min p + 1 + ceil(log2 2) = 4 bits per coordinate, the paper's r
    nominal = {"dqsg": level_bits(3), "ndqsg": (level_bits(3) + 1) / 2, "qsgd": level_bits(15),
               "terngrad": level_bits(3), "onebit-ef": 1, "maxnorm": level_bits(7),
               "maxnorm-multiscale": 4, "grandk-maxnorm": level_bits(7) * (d // 2) / d,
               "grandk-maxnorm-multiscale": 4 * (d // 2) / d}
    if name in nominal:
        assert s["nominal_bits_per_element"] == pytest.approx(nominal[name])
    else:  # PowerSGD: float32 factors of the n x m matrix at rank 2
        n = math.isqrt(d - 1) + 1
        m = -(-d // n)
        assert s["nominal_bits_per_element"] == pytest.approx(32 * (n + m) * 2 / d)
    assert s["wire_bits_per_element"] < 32


def test_dithered_codec_matches_reference_draws():
    """The DQSG reference above draws the dither as the codec does (one key, then a counter uniform per element)."""
    x = torch.randn(D, dtype=torch.float64)
    codec = DitheredCodec(levels=2)
    y = codec.roundtrip(x, generator=shared_generator(SEED, 1, 2))
    kappa = _f32_up(float(x.abs().max()))
    u = (counter_uniforms(draw_key(shared_generator(SEED, 1, 2)), D) - 0.5) / 2
    q = torch.floor(x / kappa * 2 + u * 2 + 0.5)
    torch.testing.assert_close(y.double(), (kappa * (q / 2 - u)).float().double(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scales", [(2, 6), (1, 3, 5), (4,), (2, 4, 6, 8, 10)])
def test_multiscale_nominal_bits_are_the_wire_bits_per_coordinate(scales):
    """Paper 004, section 3.2: r = ceil(log2 s_min) + 1 + ceil(log2 N) bits per coordinate, which is
    what one worker's encoded message carries (its packed data, the header apart)."""
    n = 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    codec = MultiScaleMaxNormCodec(scales=scales)
    payload = codec.encode(x, generator=shared_generator(SEED, 0, 0))
    assert 8 * payload.data.numel() == n * codec.bits
    s_min = (1 << min(scales)) - 1
    r = math.ceil(math.log2(s_min)) + 1 + math.ceil(math.log2(len(scales))) if s_min > 1 else 2 + math.ceil(
        math.log2(len(scales)))  # s_min = 1: the sign and one magnitude bit
    assert codec.bits == r

    def nominal(t):
        algo = MaxNormMultiScaleSGD(scales=scales).worker(t, seed=SEED)
        algo.setup(x.float())
        return algo.nominal_bits_per_element()

    assert run_threads(1, nominal) == [float(codec.bits)]
