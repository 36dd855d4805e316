"""DecentralizedDataParallel against the plain training loop, checkpoint/resume,
buffer policies, the averaged model, errors, the Bagua shim, and torchrun."""

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lowbit.algorithms import ALGORITHMS, GossipAlgorithm, State, build_worker
from lowbit.codecs import UniformCodec
from lowbit.codecs.rng import shared_generator
from lowbit.comm import ThreadWorld, run_threads
from lowbit.integrations import DecentralizedDataParallel, FlatParams
from lowbit.topology import make_topology
from wrapper_models import rank_batch, small_model

N = 4
ROOT = Path(__file__).resolve().parents[1]


def _model(bn=False, seed=0):
    return small_model(bn=bn, seed=seed)


_batch = rank_batch


def _opt(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _loss(model, rank, k):
    x, y = _batch(rank, k)
    return nn.functional.cross_entropy(model(x), y)


def _wrapper_steps(ddp, start, stop, user_zero_grad=False, call="ddp.step"):
    for k in range(start, stop):
        assert ddp.step_count == k
        if user_zero_grad:
            ddp.optimizer.zero_grad()  # PyTorch's default set_to_none=True: the wrapper must repair it
        else:
            ddp.zero_grad()
        _loss(ddp, ddp.rank, k).backward()
        if call == "ddp.step":
            ddp.step()
        else:  # the user's own loop: the optimizer's step hooks run the algorithm
            ddp.optimizer.step()


ALGO_OPTIONS = {"dpsgd": {}, "moniqua": {"bits": 2, "theta": 2.0}, "allreduce": {}}


def _build_plain(name, t):
    return build_worker(name, t, make_topology("ring", N) if ALGORITHMS[name].family == "decentralized" else None,
                        **ALGO_OPTIONS[name])


@pytest.mark.parametrize("name", ["dpsgd", "moniqua", "allreduce"])
@pytest.mark.parametrize("user_zero_grad", [False, True], ids=["ddp.zero_grad", "opt.zero_grad"])
@pytest.mark.parametrize("call", ["ddp.step", "optimizer.step"])
def test_wrapper_equals_plain_loop(name, user_zero_grad, call):
    """Both ``ddp.step()`` and the user's ``optimizer.step()`` run exactly the explicit
    sequence set_step, before_update, optimizer.step, after_update: same bits, same ledger."""
    steps = 6

    def plain(t):
        model = _model()
        flat = FlatParams(model)
        algo = _build_plain(name, t)
        algo.setup(flat.data)
        opt = _opt(model)
        for k in range(steps):
            t.set_step(k)
            flat.zero_grad()
            _loss(model, t.rank, k).backward()
            algo.before_update(k, flat.data, flat.grad, 0.1)
            opt.step()
            algo.after_update(k, flat.data, flat.grad, 0.1)
        return flat.data.clone(), t.ledger.to_rows()

    def wrapped(t):
        m = _model()
        ddp = DecentralizedDataParallel(m, _opt(m), name, transport=t, **ALGO_OPTIONS[name])
        _wrapper_steps(ddp, 0, steps, user_zero_grad, call)
        ddp.close()
        ddp.flat.check_aliasing()
        return ddp.flat.data.clone(), t.ledger.to_rows()

    ref, got = run_threads(N, plain), run_threads(N, wrapped)
    x0 = FlatParams(_model()).data
    for (xr, lr_), (xg, lg) in zip(ref, got):
        assert torch.equal(xr, xg)
        assert lr_ == lg  # the same messages, counted at the same steps
        assert not torch.equal(xg, x0)  # it trained
    if name != "allreduce":
        assert not torch.equal(got[0][0], got[1][0])  # gossip: workers differ (different data)


@dataclasses.dataclass
class ReplicaState(State):
    hat: dict  # {j: x̂_j} for itself and its neighbours


@dataclasses.dataclass(frozen=True)
class ReplicaGossip(GossipAlgorithm):
    """A small stateful (CHOCO-style) gossip for the resume test: replicas x̂_j of
    itself and its neighbours, updated by stochastically rounded differences
    q_j = Q(x_j - x̂_j); x += gamma sum_j W_ij (x̂_j - x̂_i)."""

    gamma: float = 0.5
    step: float = 0.01
    name = "test-replica"

    @property
    def codec(self):
        return UniformCodec(step=self.step, rounding="stochastic")

    def init(self, x, ctx):
        return ReplicaState({j: torch.zeros_like(x) for j in (ctx.rank, *ctx.neighbors)})

    def before_update(self, state, ctx, k, x, g, lr):
        hat = state.hat
        payload = self.codec.encode(x - hat[ctx.rank], generator=shared_generator(ctx.seed, k, ctx.rank))
        received = ctx.transport.neighbor_exchange(payload.to_wire(), ctx.neighbors)
        hat[ctx.rank] += self.codec.decode(payload).to(x.dtype)
        for j in ctx.neighbors:
            hat[j] += self.codec.decode(self.codec.payload_from_wire(received[j])).to(x.dtype)
        mix = sum(ctx.w[j] * (hat[j] - hat[ctx.rank]) for j in ctx.neighbors)
        x.add_(mix, alpha=self.gamma)
        return state


def _resume_cases():
    cases = [("dpsgd", {}), ("moniqua", {"bits": 2, "theta": 2.0}), (ReplicaGossip, {"gamma": 0.5})]
    for name in ("lowprec-decentralized", "choco"):  # stateful algorithms of the registry, where present
        if name in ALGORITHMS:
            cases.append((name, {}))
    return cases


@pytest.mark.parametrize("algorithm,options", _resume_cases(),
                         ids=lambda v: v if isinstance(v, str) else getattr(v, "name", ""))
def test_checkpoint_resume_is_bitwise_identical(algorithm, options):
    def run(t, start, stop, state=None, init_seed=0):
        m = _model(bn=True, seed=init_seed)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        ddp = DecentralizedDataParallel(m, opt, algorithm, transport=t, seed=3, **options)
        if state is not None:
            buf = io.BytesIO()
            torch.save(state[t.rank], buf)  # through bytes, as a file would be
            buf.seek(0)
            ddp.load_checkpoint_state(torch.load(buf, weights_only=False))
        _wrapper_steps(ddp, start, stop)
        return ddp.checkpoint_state(), ddp.flat.data.clone(), ddp.algorithm.state_tensors()

    full = run_threads(N, lambda t: run(t, 0, 10))
    half = run_threads(N, lambda t: run(t, 0, 5))
    states = [h[0] for h in half]
    assert all(s["step"] == 5 for s in states)
    # fresh modules (another x_0), optimizers and wrappers: everything comes from the checkpoint
    resumed = run_threads(N, lambda t: run(t, 5, 10, states, init_seed=7))
    for f, r in zip(full, resumed):
        assert torch.equal(f[1], r[1])
        for key, v in f[0]["module"].items():  # BatchNorm statistics too
            assert torch.equal(v, r[0]["module"][key]), key
        assert f[2].keys() == r[2].keys()
        for key in f[2]:
            assert torch.equal(f[2][key], r[2][key]), key
    if algorithm is ReplicaGossip:
        assert f[2] and any(t.abs().sum() > 0 for t in f[2].values())  # the state is real


def test_checkpoint_checks_rank_and_algorithm():
    def fn(t):
        m = _model()
        ddp = DecentralizedDataParallel(m, _opt(m), "dpsgd", transport=t)
        return ddp.checkpoint_state()

    states = run_threads(2, fn)

    def load(t):
        m = _model()
        ddp = DecentralizedDataParallel(m, _opt(m), "dpsgd", transport=t)
        with pytest.raises(ValueError, match="rank"):
            ddp.load_checkpoint_state(states[1 - t.rank])
        with pytest.raises(ValueError, match="load_checkpoint_state"):
            ddp.load_state_dict(states[t.rank])  # a checkpoint is not a module state dict
        m2 = _model()
        other = DecentralizedDataParallel(m2, _opt(m2), "moniqua", transport=t)
        with pytest.raises(ValueError, match="algorithm"):
            other.load_checkpoint_state(states[t.rank])
        return True

    assert run_threads(2, load) == [True, True]


def _bn_run(policy):
    def fn(t):
        m = _model(bn=True)
        ddp = DecentralizedDataParallel(m, _opt(m), "moniqua", transport=t, buffers=policy, bits=2, theta=2.0)
        _wrapper_steps(ddp, 0, 3)
        avg = ddp.averaged_module()
        return ({k: v.clone() for k, v in m.named_buffers()}, ddp.flat.data.clone(),
                FlatParams(avg).data.clone(), dict(avg.named_buffers()), ddp.bytes_sent)

    return run_threads(N, fn)


@pytest.mark.parametrize("policy", ["local", "average"])
def test_averaged_module_and_buffer_policy(policy):
    res = _bn_run(policy)
    own = [r[0] for r in res]
    assert not torch.equal(own[0]["1.running_mean"], own[1]["1.running_mean"])  # workers' statistics differ
    mean_x = torch.stack([r[1] for r in res]).mean(0)
    for rank, (_, x, avg_x, avg_bufs, _) in enumerate(res):
        torch.testing.assert_close(avg_x, mean_x, atol=1e-6, rtol=0)
        assert not torch.equal(avg_x, x)
        for name in ("1.running_mean", "1.running_var"):
            if policy == "local":
                assert torch.equal(avg_bufs[name], own[rank][name])
            else:
                expect = torch.stack([o[name] for o in own]).mean(0)
                torch.testing.assert_close(avg_bufs[name], expect, atol=1e-6, rtol=0)
        assert int(avg_bufs["1.num_batches_tracked"]) == 3
    # evaluation traffic is not counted: the ledger equals that of the same 3 steps without it
    assert len({r[4] for r in res}) == 1 and res[0][4] == _bn_run("local")[0][4]


def test_averaged_module_is_independent_copy():
    def fn(t):
        m = _model()
        ddp = DecentralizedDataParallel(m, _opt(m), "dpsgd", transport=t)
        avg = ddp.averaged_module()
        with torch.no_grad():
            next(avg.parameters()).add_(1.0)
        ddp.flat.check_aliasing()
        return torch.equal(ddp.flat.data, FlatParams(_model()).data)

    assert run_threads(2, fn) == [True, True]


def test_initial_parameters_come_from_rank0():
    def fn(t):
        m = _model(seed=t.rank)  # different x_0 on every rank
        ddp = DecentralizedDataParallel(m, _opt(m), "dpsgd", transport=t)
        return ddp.flat.data.clone(), ddp.bytes_sent

    res = run_threads(3, fn)
    x0 = FlatParams(_model(seed=0)).data
    assert all(torch.equal(x, x0) and sent == 0 for x, sent in res)


def test_close_calls_finish_once():
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Async(GossipAlgorithm):
        name = "test-async"
        synchronous = False

        def finish(self, state, ctx):
            calls.append(ctx.rank)
            return state

    def fn(t):
        m = _model()
        with DecentralizedDataParallel(m, _opt(m), Async, transport=t) as ddp:
            _wrapper_steps(ddp, 0, 2)
        ddp.close()
        with pytest.raises(RuntimeError, match="close"):
            ddp.step()
        return True

    run_threads(2, fn)
    assert sorted(calls) == [0, 1]


@pytest.mark.skipif("adpsgd" not in ALGORITHMS, reason="adpsgd is not registered")
def test_asynchronous_checkpoint_only_after_close():
    def run(t, start, stop, state=None):
        m = _model()
        ddp = DecentralizedDataParallel(m, _opt(m), "adpsgd", transport=t)
        if state is not None:
            ddp.load_checkpoint_state(state[t.rank])
        _wrapper_steps(ddp, start, stop)
        with pytest.raises(RuntimeError, match="after close"):
            ddp.checkpoint_state()
        ddp.close()
        return ddp.checkpoint_state(), ddp.flat.data.clone()

    half = run_threads(N, lambda t: run(t, 0, 3))
    resumed = run_threads(N, lambda t: run(t, 3, 6, [h[0] for h in half]))
    for h, r in zip(half, resumed):
        assert r[0]["step"] == 6 and torch.isfinite(r[1]).all() and not torch.equal(h[1], r[1])


def test_algorithm_instance_and_class():
    def fn(t):
        topo = make_topology("ring", 3)
        m1, m2, m4 = _model(), _model(), _model()
        a = DecentralizedDataParallel(m1, _opt(m1), ALGORITHMS["dpsgd"]().worker(t, topo))  # a bound worker
        b = DecentralizedDataParallel(m2, _opt(m2), ALGORITHMS["dpsgd"], transport=t, topology=topo)
        c = DecentralizedDataParallel(m4, _opt(m4), ALGORITHMS["dpsgd"](), transport=t, topology=topo)  # options
        assert a.transport is t and b.algorithm.neighbors == a.algorithm.neighbors == c.algorithm.neighbors
        with pytest.raises(ValueError, match="options"):
            m3 = _model()
            DecentralizedDataParallel(m3, _opt(m3), ALGORITHMS["dpsgd"]().worker(t, topo), bits=2)
        with pytest.raises(ValueError, match="options"):
            m3 = _model()
            DecentralizedDataParallel(m3, _opt(m3), ALGORITHMS["dpsgd"](), transport=t, bits=2)
        return True

    assert run_threads(3, fn) == [True] * 3


def test_errors():
    t = ThreadWorld(1).transport(0)
    m, other = _model(), _model()
    with pytest.raises(ValueError, match="not a trainable parameter"):
        DecentralizedDataParallel(m, _opt(other), "allreduce", transport=t)
    with pytest.raises(ValueError, match="algorithm='nope' is unknown"):
        DecentralizedDataParallel(m, _opt(m), "nope", transport=t)
    with pytest.raises(ValueError, match="buffers must be one of"):
        DecentralizedDataParallel(m, _opt(m), "allreduce", transport=t, buffers="sync")
    with pytest.raises(ValueError, match="topology is for decentralized"):
        DecentralizedDataParallel(m, _opt(m), "allreduce", transport=t, topology="ring")
    with pytest.raises(ValueError, match="does not take option.*bits"):
        DecentralizedDataParallel(m, _opt(m), "allreduce", transport=t, bits=2)
    with pytest.raises(ValueError, match="bits"):
        DecentralizedDataParallel(m, _opt(m), "moniqua", transport=t, bits=0)
    ddp = DecentralizedDataParallel(m, _opt(m), "allreduce", transport=t)
    with pytest.raises(ValueError, match="set_to_none"):
        ddp.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="checkpoint"):
        ddp.load_checkpoint_state({"module": {}})
    m.to(torch.float64)  # replaces the parameters' storage: caught at the next step
    ddp.zero_grad()
    with pytest.raises(RuntimeError, match="flat parameter buffer"):
        ddp.step()


# ---- the Bagua-shaped entry point ---------------------------------------------------
def test_bagua_shim_rejects_what_it_does_not_support():
    from lowbit.bagua import LowPrecisionDecentralizedAlgorithm, with_bagua

    with pytest.raises(ValueError, match="hierarchical"):
        LowPrecisionDecentralizedAlgorithm(hierarchical="no")
    with pytest.raises(ValueError, match="communication_interval"):
        LowPrecisionDecentralizedAlgorithm(communication_interval=0)
    m = _model()
    algo = LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=1)
    with pytest.raises(ValueError, match="exactly one optimizer"):
        with_bagua(m, _opt(m), algo)
    with pytest.raises(ValueError, match="LowPrecisionDecentralizedAlgorithm"):
        with_bagua(m, [_opt(m)], "low_precision_decentralized")


def test_bagua_with_bagua_runs_lowprec():
    pytest.importorskip("lowbit.algorithms.lowprec")
    from lowbit.bagua import LowPrecisionDecentralizedAlgorithm, with_bagua

    def fn(t, bagua):
        m = _model()
        if bagua:
            ddp = with_bagua(m, [_opt(m)], LowPrecisionDecentralizedAlgorithm(hierarchical=False, communication_interval=1),
                             transport=t)
        else:
            ddp = DecentralizedDataParallel(m, _opt(m), "lowprec-decentralized", transport=t, bits=8)
        _wrapper_steps(ddp, 0, 4)
        return ddp.flat.data.clone(), ddp.transport.ledger.step_bytes(2)

    a = run_threads(N, lambda t: fn(t, True))
    b = run_threads(N, lambda t: fn(t, False))
    for (xa, sa), (xb, sb) in zip(a, b):
        assert torch.equal(xa, xb) and sa == sb > 0
    n_params = FlatParams(_model()).data.numel()
    # a step sends 8-bit differences (plus a small header) to two ring neighbours: about 1/4 of fp32
    assert 2 * n_params <= a[0][1] < 2 * 4 * n_params / 2


# ---- torchrun --------------------------------------------------------------------------
def test_torchrun_example(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "torchrun_cnn.py"), "--algorithm", "moniqua", "--bits", "2", "--theta", "0.5",
           "--eval-every", "10"]
    ck = tmp_path / "ck"
    out = subprocess.run(cmd + ["--steps", "20", "--checkpoint", str(ck)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step    20" in out.stdout and (ck / "rank0.pt").exists() and (ck / "rank1.pt").exists()
    acc = float(out.stdout.split("step    20")[1].split("test acc")[1].split()[0])
    assert acc > 0.5  # 20 steps of a CNN on digits: well above chance (0.1)
    from lowbit.integrations.checkpoint import load_checkpoint

    state = load_checkpoint(ck / "rank1.pt")  # checksummed, weights_only=True
    assert state["step"] == 20 and state["rank"] == 1 and state["world_size"] == 2
