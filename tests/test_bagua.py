"""Bagua's LowPrecisionDecentralizedAlgorithm, checked the way Bagua checks it.

The reference below is written from Bagua's description (seeds/001 and its
algorithm class: the step after ``optimizer.step()``, per bucket
``t = x + left/3 + right/3 - 5/3 w``, MinMaxUInt8 of t to the left and right ring
neighbours, replicas += what they receive, ``w = Q(t) + w``, ``x = w``; the
hierarchical mode averages inside a node first and broadcasts after). It uses
no lowbit algorithm or codec code: its quantizer is Bagua's formulas in plain
torch. Bagua's criterion: after 10 steps every rank's parameters are
``isclose(atol=1e-5)`` to the reference, on a small network, for several
input seeds; the replica invariants (a replica is bitwise the neighbour's model)
hold exactly.
"""

import numpy as np
import pytest
import torch
from torch import nn

from lowbit.algorithms import LowPrecisionDecentralized
from lowbit.bagua import LowPrecisionDecentralizedAlgorithm, with_bagua
from lowbit.codecs import IdentityCodec
from lowbit.comm import launch, run_threads
from lowbit.topology import make_topology
from quadratic import quadratic_problem, run_quadratic

STEPS, LR, MOMENTUM, WD = 10, 0.1, 0.9, 1e-3
SEEDS = [*range(5), *(pytest.param(s, marks=pytest.mark.slow) for s in range(5, 10))]  # 10 with -m slow


class Net(nn.Module):
    """The network of Bagua's algorithm tests: 2 -> 10 -> 50 -> 4."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=True)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


# ---- the plain reference ---------------------------------------------------------------

def ref_compress(t):
    """Bagua's MinMaxUInt8, float32: (min, max), uint8 codes."""
    lo, hi = t.min(), t.max()
    scale = 255.0 / (hi - lo + torch.tensor(1e-7, dtype=torch.float32))
    upper = torch.round(hi * scale)
    level = torch.clamp(torch.round(t * scale), max=upper)
    return (lo, hi), (level - (upper - 255.0)).clamp(min=0).to(torch.uint8)


def ref_decompress(minmax, codes):
    lo, hi = minmax
    scale = 255.0 / (hi - lo + torch.tensor(1e-7, dtype=torch.float32))
    lower = torch.round(hi * scale) - 255.0
    return (codes.float() + lower) / scale


def ref_buckets(sizes, bucket_bytes):
    """Bagua's split: tensors in reverse order, a bucket closed at >= bucket_bytes."""
    ends = torch.tensor(sizes).cumsum(0).tolist()
    out, cur, held = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        held += 4 * sizes[i]
        if held >= bucket_bytes:
            out.append(cur)
            cur, held = [], 0
    if cur:
        out.append(cur)
    return [(ends[c[-1]] - sizes[c[-1]], ends[c[0]]) for c in out]


def flat(m):
    return torch.cat([p.data.reshape(-1) for p in m.parameters()])


def set_flat(m, x):
    o = 0
    for p in m.parameters():
        p.data.copy_(x[o:o + p.numel()].view_as(p))
        o += p.numel()


def data(seed, n):
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(8, 2, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def init_state(seed):
    torch.manual_seed(seed)
    return Net().state_dict()


def reference(n, seed, node_size=1, interval=1, bucket_bytes=10 * 1024 ** 2, steps=STEPS):
    """Every rank's parameters after each step: (steps, n, d)."""
    batches = data(seed, n)
    models = []
    for _ in range(n):
        m = Net()
        m.load_state_dict(init_state(seed))
        models.append(m)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD) for m in models]
    m_nodes = n // node_size
    x0 = flat(models[0])
    w = [x0.clone() for _ in range(m_nodes)]
    left = [x0.clone() for _ in range(m_nodes)]
    right = [x0.clone() for _ in range(m_nodes)]
    buckets = ref_buckets([p.numel() for p in models[0].parameters()], bucket_bytes)
    out = []
    for k in range(steps):
        for i in range(n):
            opts[i].zero_grad()
            nn.functional.cross_entropy(models[i](batches[i][0]), batches[i][1]).backward()
            opts[i].step()
        if k % interval == 0:
            xs = [flat(m) for m in models]
            avg = []
            for v in range(m_nodes):
                a = xs[v * node_size].clone()
                for j in range(1, node_size):
                    a += xs[v * node_size + j]
                avg.append(a / node_size if node_size > 1 else a)
            for s, e in buckets:
                q = []
                for v in range(m_nodes):
                    t = avg[v][s:e].clone()
                    t += 1 / 3 * left[v][s:e]
                    t += 1 / 3 * right[v][s:e]
                    t -= 5 / 3 * w[v][s:e]
                    q.append(ref_decompress(*ref_compress(t)))
                for v in range(m_nodes):
                    left[v][s:e] += q[(v - 1) % m_nodes]
                    right[v][s:e] += q[(v + 1) % m_nodes]
                    w[v][s:e] = q[v] + w[v][s:e]
            for i in range(n):
                set_flat(models[i], w[i // node_size])
        out.append(torch.stack([flat(m) for m in models]))
    return torch.stack(out)


# ---- lowbit, through with_bagua ----------------------------------------------------------

def lowbit_worker(t, seed, steps=STEPS, init=None, **options):
    """(per step: this rank's parameters and its algorithm state), as with_bagua runs it.
    ``init``: the initial state dict (threads must not draw from torch's global RNG at once)."""
    batch = data(seed, t.world_size)[t.rank]
    m = Net()
    m.load_state_dict(init_state(seed) if init is None else init)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    ddp = with_bagua(m, [opt], LowPrecisionDecentralizedAlgorithm(**options), transport=t)
    seen = []
    for _ in range(steps):
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(batch[0]), batch[1]).backward()
        ddp.step()
        seen.append((ddp.flat.data.clone(), {k: v.clone() for k, v in ddp.algorithm.state_tensors().items()}))
    return seen, t.ledger.to_rows()


def run_lowbit(n, seed, **options):
    init = init_state(seed)
    res = run_threads(n, lambda t: lowbit_worker(t, seed, init=init, **options))
    traj = torch.stack([torch.stack([s[k][0] for s, _ in res]) for k in range(STEPS)])
    states = [[s[k][1] for s, _ in res] for k in range(STEPS)]
    return traj, states, [rows for _, rows in res]


def assert_replicas_exact(traj, states, n, node_size=1):
    """On every leader after every step: weight is the model, left/right are bitwise the
    neighbour leaders' models; every worker of a node holds its leader's model."""
    m = n // node_size
    for k in range(len(states)):
        for v in range(m):
            r = v * node_size
            st = states[k][r]
            assert torch.equal(st["weight"], traj[k, r]), (k, r)
            assert torch.equal(st["left_peer_weight"], traj[k, ((v - 1) % m) * node_size]), (k, r)
            assert torch.equal(st["right_peer_weight"], traj[k, ((v + 1) % m) * node_size]), (k, r)
            for j in range(r + 1, r + node_size):
                assert states[k][j] == {}  # only leaders keep Bagua's states
                assert torch.equal(traj[k, j], traj[k, r])


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("seed", SEEDS)
def test_bagua_check_after_10_steps(n, seed):
    ref = reference(n, seed)
    traj, states, _ = run_lowbit(n, seed, hierarchical=False)
    assert torch.isclose(traj[-1], ref[-1], rtol=0, atol=1e-5).all(), \
        float((traj[-1] - ref[-1]).abs().max())
    assert_replicas_exact(traj, states, n)


def test_two_nodes_weigh_the_peer_twice():
    """n = 2: the one peer is the left and the right neighbour: with a lossless codec the
    step is x <- W x - lr g with W = [[1/3, 2/3], [2/3, 1/3]], not the 1/2-1/2 average."""
    X0, A, b = quadratic_problem(2, 6, seed=5)
    X0 = X0[:1].repeat(2, 1)  # Bagua: one initial model
    res = run_quadratic(lambda t: LowPrecisionDecentralized(codec=IdentityCodec(), hierarchical=False).worker(
        t, make_topology("ring", 2)), X0, A, b, 5, 0.1)
    traj = torch.stack([torch.stack(seen) for seen, *_ in res], 1)
    W3 = torch.tensor([[1 / 3, 2 / 3], [2 / 3, 1 / 3]], dtype=torch.float64)
    W2 = torch.full((2, 2), 0.5, dtype=torch.float64)
    X = Y = X0.clone()
    for k in range(5):
        X = W3 @ X - 0.1 * (A * X - b)
        Y = W2 @ Y - 0.1 * (A * Y - b)
        torch.testing.assert_close(traj[k], X, atol=1e-6, rtol=0)
    assert float((X - Y).abs().max()) > 1e-3
    _, _, rows = run_lowbit(2, 0, hierarchical=False)
    assert [(r[0], r[5]) for r in rows[0][:2]] == [(0, 1), (0, 1)]  # two messages to the one peer


@pytest.mark.parametrize("seed", range(3))
def test_hierarchical_two_nodes_of_two(seed):
    ref = reference(4, seed, node_size=2)
    traj, states, _ = run_lowbit(4, seed, hierarchical=True, node_size=2)
    assert torch.isclose(traj[-1], ref[-1], rtol=0, atol=1e-5).all()
    assert_replicas_exact(traj, states, 4, node_size=2)
    flat_ring = reference(4, seed)
    assert not torch.isclose(ref[-1], flat_ring[-1], rtol=0, atol=1e-5).all()  # the mode matters


def test_hierarchical_one_node_and_three_nodes():
    ref1 = reference(4, 1, node_size=4)
    traj1, _, _ = run_lowbit(4, 1, hierarchical=True, node_size=4)
    assert torch.isclose(traj1[-1], ref1[-1], rtol=0, atol=1e-5).all()
    ref3 = reference(6, 2, node_size=2)
    traj3, states3, _ = run_lowbit(6, 2, hierarchical=True, node_size=2)
    assert torch.isclose(traj3[-1], ref3[-1], rtol=0, atol=1e-5).all()
    assert_replicas_exact(traj3, states3, 6, node_size=2)


def test_communication_interval():
    ref = reference(4, 3, interval=3)
    traj, states, rows = run_lowbit(4, 3, hierarchical=False, communication_interval=3)
    assert torch.isclose(traj[-1], ref[-1], rtol=0, atol=1e-5).all()
    assert sorted({r[0] for r in rows[0]}) == [0, 3, 6, 9]  # only those steps send
    for k in (1, 2, 4):  # between communications the workers drift apart
        assert not torch.equal(traj[k, 0], traj[k, 1])


def test_buckets_have_their_own_min_and_max():
    sizes = [p.numel() for p in Net().parameters()]  # 20, 500, 50, 200
    assert ref_buckets(sizes, 1000) == [(520, 770), (20, 520), (0, 20)]
    ref = reference(3, 4, bucket_bytes=1000)
    traj, states, rows = run_lowbit(3, 4, hierarchical=False, bucket_bytes=1000)
    assert torch.isclose(traj[-1], ref[-1], rtol=0, atol=1e-5).all()
    assert_replicas_exact(traj, states, 3)
    one = reference(3, 4)
    assert not torch.isclose(ref[-1], one[-1], rtol=0, atol=1e-5).all()  # per-bucket ranges matter
    # one message per bucket and neighbour: 32 + align32(n) bytes each
    step0 = [r for r in rows[0] if r[0] == 0]
    assert [r[2] for r in step0] == [32 + 256, 32 + 512, 32 + 32]
    assert all(r[3] == 2 * r[2] and r[4] == 2 for r in step0)


def test_ledger_is_baguas_wire_layout_and_nothing_at_setup():
    d = sum(p.numel() for p in Net().parameters())
    per_msg = 32 + 800  # Bagua's block + align32(770) code bytes
    assert d == 770
    for n, peers in ((2, 1), (3, 2), (5, 2)):
        _, _, rows = run_lowbit(n, 0, hierarchical=False)
        for r in range(n):
            assert len(rows[r]) == STEPS * (2 if n == 2 else 1)  # n = 2: two messages to the one peer
            assert all(row[2] == per_msg and row[1] == "neighbor" and row[5] == peers for row in rows[r])
            assert sum(row[3] for row in rows[r]) == STEPS * 2 * per_msg  # two messages a step, none at setup


def test_hierarchical_ledger():
    d = sum(p.numel() for p in Net().parameters())
    _, _, rows = run_lowbit(4, 0, hierarchical=True, node_size=2)
    per_step = {r: [row for row in rows[r] if row[0] == 0] for r in range(4)}
    # leader 0: empty reduce reply to its worker, 2 ring messages to the other leader, broadcast of d floats
    assert [(row[2], row[3]) for row in per_step[0]] == [(0, 0), (832, 832), (832, 832), (4 * d, 4 * d)]
    # worker 1: its model to the leader, an empty broadcast reply
    assert [(row[2], row[3]) for row in per_step[1]] == [(4 * d, 4 * d), (0, 0)]


def _process_worker(t, init=None):
    seen, rows = lowbit_worker(t, 0, steps=4, init=init, hierarchical=True, node_size=2)
    return seen[-1][0], rows


def test_hierarchical_thread_and_torch_backends_agree_exactly():
    init = init_state(0)  # drawn once: thread workers drawing from torch's global RNG at once would race
    threads = run_threads(4, lambda t: _process_worker(t, init))
    procs = launch(4, _process_worker, backend="gloo", timeout_s=120)
    for (xa, la), (xb, lb) in zip(threads, procs):
        assert torch.equal(xa, xb)
        assert la == lb


def test_different_initial_models_are_refused():
    topo = make_topology("ring", 3)

    def worker(t):
        LowPrecisionDecentralized(hierarchical=False).worker(t, topo).setup(torch.full((5,), float(t.rank)))

    with pytest.raises(ValueError, match="initial models differ"):
        run_threads(3, worker)


def test_bad_options_name_the_argument():
    topo = make_topology("ring", 4)

    lazy = np.eye(4) / 2 + np.roll(np.eye(4), 1, axis=1) / 4 + np.roll(np.eye(4), -1, axis=1) / 4

    def worker(t):
        for kw, word in ((dict(communication_interval=0), "communication_interval"),
                         (dict(node_size=0), "node_size"), (dict(bucket_bytes=0), "bucket_bytes"),
                         (dict(hierarchical="yes"), "hierarchical"),
                         (dict(peer_selection="shift_one", node_size=2), "shift_one")):
            with pytest.raises(ValueError, match=word):
                LowPrecisionDecentralized(**kw)
        x = torch.zeros(5)
        # what depends on the workers is checked when the worker starts
        for make, word in ((lambda: LowPrecisionDecentralized(node_size=3).worker(t, topo), "node_size"),
                           (lambda: LowPrecisionDecentralized().worker(t, topo, W=lazy), "weights"),
                           (lambda: LowPrecisionDecentralized().worker(t, make_topology("complete", 4)), "ring")):
            with pytest.raises(ValueError, match=word):
                make().setup(x)
        return True

    assert all(run_threads(4, worker))
    for kw, word in ((dict(hierarchical=1), "hierarchical"),
                     (dict(communication_interval=0), "communication_interval")):
        with pytest.raises(ValueError, match=word):
            LowPrecisionDecentralizedAlgorithm(**kw)


def test_train_cli_options():
    from lowbit.train import TrainConfig, train

    with pytest.raises(ValueError, match="node_size"):
        TrainConfig(algorithm="lowprec-decentralized", workers=4, node_size=3)
    with pytest.raises(ValueError, match="rounding"):
        TrainConfig(algorithm="lowprec-decentralized", rounding="stochastic")
    with pytest.raises(ValueError, match="ring"):
        TrainConfig(algorithm="lowprec-decentralized", topology="complete", workers=4)
    with pytest.raises(ValueError, match="weights"):
        TrainConfig(algorithm="lowprec-decentralized", weights="metropolis")
    run = train(TrainConfig(algorithm="lowprec-decentralized", workers=4, node_size=2, communication_interval=2,
                            steps=6, eval_every=3))
    assert run.summary["bytes_sent"] > 0


def test_shift_one_is_lowbits_own():
    """Bagua has no low-precision shift_one (its shift_one is full precision only):
    peer_selection='shift_one' is lowbit's own variant (per-partner replicas and
    mirrors, mixing 1/2-1/2 with one peer per step). It has no hierarchical mode and
    no communication interval; its exact equations are tested in
    test_gossip_baselines.py::test_lowprec_shift_one."""
    topo = make_topology("ring", 4)

    def worker(t):
        a = LowPrecisionDecentralized(peer_selection="shift_one").worker(t, topo)
        x = torch.full((6,), float(t.rank))
        a.setup(x)  # sends x_0 once: different initial models are fine here
        for k in range(3):
            g = x.clone()
            a.before_update(k, x, g, 0.1)
            x -= 0.1 * g
            a.after_update(k, x, g, 0.1)
        with pytest.raises(ValueError, match="communication_interval"):
            LowPrecisionDecentralized(peer_selection="shift_one", communication_interval=2)
        return x, sorted(a.state_tensors())

    res = run_threads(4, worker)
    assert res[0][1] == ["mirror.2", "mirror.3", "xhat.2", "xhat.3"]
    assert len({float(x.mean()) for x, _ in res}) > 1  # pairwise gossip, not yet at consensus
