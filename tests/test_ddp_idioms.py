"""DDP's idioms under DecentralizedDataParallel, with DDP's meaning (issue 30, item 3):
``optimizer.step(closure)``, GradScaler's skipped steps, clipping of the averaged gradient,
``no_sync()`` for accumulation, and checkpoints that ``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lowbit.comm import run_threads
from lowbit.integrations import DecentralizedDataParallel
from lowbit.integrations.decentralized import InitialStateReplaced
from test_wrapper_loop import Net  # noqa: E402 - tests/ is on sys.path under pytest
from wrapper_models import rank_batch as _batch  # noqa: E402

N, BATCH = 2, 8
ROOT = Path(__file__).resolve().parents[1]




def _fp16():
    return torch.autocast("cpu", dtype=torch.float16)


def _loss(model, rank, k):
    x, y = _batch(rank, k)
    return nn.functional.cross_entropy(model(x), y)


# ---- optimizer.step(closure) ------------------------------------------------------------------
@pytest.mark.parametrize("algorithm,overlap", [("dpsgd", True), ("dpsgd", False), ("allreduce", False),
                                               ("moniqua", False)])
def test_step_with_closure_equals_backward_then_step(algorithm, overlap):
    options = {"bits": 2, "theta": 2.0} if algorithm == "moniqua" else {}

    def run(t, closure):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        ddp = DecentralizedDataParallel(net, opt, algorithm, transport=t, overlap=overlap, **options)
        losses = []
        for k in range(4):
            if closure:
                def fn(k=k):
                    opt.zero_grad()
                    loss = _loss(ddp, t.rank, k)
                    loss.backward()
                    return loss
                with torch.no_grad():  # the closure runs with gradients enabled, as torch's optimizers run it
                    losses.append(float(opt.step(fn)))
            else:
                opt.zero_grad()
                loss = _loss(ddp, t.rank, k)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return ddp.flat.data.clone(), losses, ddp.bytes_sent, ddp.stats()["overlapped"]

    plain = run_threads(N, lambda t: run(t, False))
    closed = run_threads(N, lambda t: run(t, True))
    for (x, losses, sent, ov), (x2, losses2, sent2, ov2) in zip(plain, closed):
        assert torch.equal(x, x2) and losses == losses2 and sent == sent2 and sent > 0 and ov == ov2


def test_closure_through_ddp_step_and_keyword():
    def fn(t):
        net = Net()
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t)

        def closure():
            opt.zero_grad()
            loss = _loss(net, t.rank, ddp.step_count)
            loss.backward()
            return loss

        a = ddp.step(closure)
        b = opt.step(closure=closure)
        return isinstance(a, torch.Tensor), isinstance(b, torch.Tensor), ddp.step_count

    assert run_threads(N, fn) == [(True, True, 2)] * N


def test_optimizer_that_reevaluates_the_closure_is_refused():
    def fn(t):
        net = Net()
        opt = torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=3)
        DecentralizedDataParallel(net, opt, "dpsgd", transport=t, overlap=False)

        def closure():
            opt.zero_grad()
            loss = _loss(net, t.rank, 0)
            loss.backward()
            return loss

        with pytest.raises(RuntimeError, match="more than once per step"):
            opt.step(closure)
        return True

    assert run_threads(N, fn) == [True] * N


# ---- torchrun (gloo): GradScaler, clipping and no_sync against torch's DDP -----------------------
def _torchrun(case):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "ddp_idioms_torchrun.py"), case]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stdout + out.stderr
    return out.returncode, json.loads(lines[-1]), out.stderr


@pytest.mark.parametrize("case", ["scaler", pytest.param("scaler-cuda", marks=pytest.mark.gpu)])
def test_torch_grad_scaler_skips_the_same_step_on_every_rank(case):
    """torch's own GradScaler, rank 1 alone overflowing at step 3: every rank finishes, skips
    exactly that step (the optimizer's update and the wrapper's step), keeps the same scale, and
    ends where the run in which both ranks overflow there ends, bit for bit; with allreduce, where
    torch's DDP with the same scaler ends. Also after unscale_ + ddp.clip_grad_norm_, and with a
    fused optimizer (which unscales in its own step)."""
    rc, res, err = _torchrun(case)
    assert rc == 0, err
    expect = [k != 3 for k in range(8)]
    for algorithm in ("dpsgd", "allreduce"):  # overlapped gossip, and gradient averaging
        for variant in ("", "clip-", "fused-"):
            one, both = res[f"{algorithm}/{variant}one"], res[f"{algorithm}/{variant}both"]
            for r in (one, both):
                assert r["error"] == [None, None], (algorithm, variant, r["error"])
                assert r["taken"] == [expect, expect] and r["steps"] == [7, 7]
                assert r["scales"][0] == r["scales"][1] and r["scales"][0][3] == r["scales"][0][2] / 2
            assert one["scales"] == both["scales"] and one["x"] == both["x"], (algorithm, variant)
            if algorithm == "allreduce":
                assert one["x"][0] == one["x"][1]  # the replicas stay equal
        assert res[f"{algorithm}/one"]["x"] != res[f"{algorithm}/clip-one"]["x"]  # the clip did clip
    assert res["warnings"]["messages"] == [[], []]  # not one warning from torch, on any path
    ddp = res["ddp/one"]
    assert ddp["taken"] == [expect, expect] and ddp["scales"] == res["allreduce/one"]["scales"]
    assert ddp["x"] == res["allreduce/one"]["x"]  # what torch's DDP does, bit for bit


def test_clip_and_no_sync_equal_torch_ddp():
    rc, res, err = _torchrun("ddp")
    assert rc == 0, err
    clip = res["clip"]
    for rank in range(2):
        # ddp.clip_grad_norm_ clips the averaged gradient: DDP + clip_grad_norm_, bit for bit
        assert clip["method"][rank] == clip["ddp"][rank] and clip["method_norms"][rank] == clip["ddp_norms"][rank]
        assert max(clip["ddp_norms"][rank]) > 1.0  # clipping was active
        # the plain call clips the local gradient, before the average: another result
        assert clip["plain"][rank] != clip["ddp"][rank]
        assert clip["method_bytes"][rank] == clip["plain_bytes"][rank] > 0  # one communication per step
    acc = res["no_sync"]
    for rank in range(2):
        assert acc["no_sync"][rank] == acc["ddp"][rank] == acc["summed"][rank]
        assert acc["no_sync_bytes"][rank] == acc["summed_bytes"][rank] > 0


# ---- clipping and no_sync on threads ----------------------------------------------------------
def test_decentralized_clip_is_the_local_clip_and_sends_nothing_extra():
    def run(t, how):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t)
        norms = []
        for k in range(4):
            opt.zero_grad()
            _loss(ddp, t.rank, k).backward()
            if how == "method":
                norms.append(float(ddp.clip_grad_norm_(0.5)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))
            opt.step()
        return ddp.flat.data.clone(), norms, ddp.bytes_sent

    a = run_threads(N, lambda t: run(t, "method"))
    b = run_threads(N, lambda t: run(t, "plain"))
    for (x, n, s), (x2, n2, s2) in zip(a, b):
        assert torch.equal(x, x2) and n == n2 and s == s2 and max(n) > 0.5


@pytest.mark.parametrize("algorithm", ["dpsgd", "allreduce"])
def test_no_sync_accumulates_and_starts_no_exchange(algorithm):
    def run(t, use_no_sync):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, algorithm, transport=t)
        started = []
        for k in range(3):
            opt.zero_grad()
            ctx = ddp.no_sync() if use_no_sync else contextlib.nullcontext()
            with ctx:
                _loss(ddp, t.rank, k).backward()
                started.append(ddp._exchange is not None)
                if use_no_sync:
                    with pytest.raises(RuntimeError, match="inside ddp.no_sync"):
                        opt.step()
            _loss(ddp, t.rank, 100 + k).backward()
            opt.step()
        return ddp.flat.data.clone(), ddp.bytes_sent, started, ddp.step_count

    a = run_threads(N, lambda t: run(t, True))
    b = run_threads(N, lambda t: run(t, False))
    for (x, s, started, steps), (x2, s2, started2, _) in zip(a, b):
        assert torch.equal(x, x2) and s == s2 and steps == 3
        assert not any(started)  # inside no_sync the forward started no exchange
        assert all(started2) == (algorithm == "dpsgd")  # without it, the overlapped gossip starts at once


# ---- checkpoints: torch.load(weights_only=True), the scheduler, a replaced initial state -----------
def _scheduled(t, folder, resume, stop):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t, scheduler=sched)
    path = os.path.join(folder, f"rank{t.rank}.pt")
    if resume:
        ddp.load_checkpoint(path)
    while ddp.step_count < stop:
        opt.zero_grad()
        _loss(ddp, t.rank, ddp.step_count).backward()
        opt.step()
        sched.step()
    if not resume:
        ddp.save_checkpoint(path)
    return ddp.flat.data.clone(), opt.param_groups[0]["lr"], sched.last_epoch


def test_checkpoint_loads_with_weights_only_and_carries_the_scheduler(tmp_path):
    whole = run_threads(N, lambda t: _scheduled(t, str(tmp_path / "w"), False, 6))
    run_threads(N, lambda t: _scheduled(t, str(tmp_path), False, 3))
    state = torch.load(tmp_path / "rank0.pt", weights_only=True)  # the file is torch.save's
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3
    Net(seed=4).load_state_dict(state["module"])  # a plain module takes the checkpoint's module state
    resumed = run_threads(N, lambda t: _scheduled(t, str(tmp_path), True, 6))
    for (x, lr, epoch), (x2, lr2, epoch2) in zip(whole, resumed):
        assert torch.equal(x, x2) and lr == lr2 == 0.1 * 0.5 ** 3 and epoch == epoch2 == 6


def test_scheduler_must_match_on_load_and_belong_to_the_optimizer(tmp_path):
    run_threads(N, lambda t: _scheduled(t, str(tmp_path), False, 1))

    def fn(t):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        other = torch.optim.SGD(Net().parameters(), lr=0.1)
        with pytest.raises(ValueError, match="scheduler belongs to another optimizer"):
            DecentralizedDataParallel(net, opt, "dpsgd", transport=t,
                                      scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
        with pytest.raises(TypeError, match="scheduler must be None or an LR scheduler"):
            DecentralizedDataParallel(net, opt, "dpsgd", transport=t, scheduler="cosine")
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t)  # no scheduler
        state = torch.load(tmp_path / f"rank{t.rank}.pt", weights_only=True)
        with pytest.raises(ValueError, match="no scheduler= to restore it into"):
            ddp.load_checkpoint_state(state)
        return True

    assert run_threads(N, fn) == [True] * N


@pytest.mark.parametrize("differ", [True, False])
def test_sync_initial_warns_when_it_replaces_a_rank_s_state(differ):
    def fn(t):
        net = Net(seed=t.rank if differ else 0)  # e.g. a state loaded into the module on rank 1 only
        ddp = DecentralizedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), "dpsgd", transport=t)
        return torch.equal(ddp.flat.data, x0)

    x0 = torch.cat([p.detach().reshape(-1) for p in Net(seed=0).parameters()])
    with warnings.catch_warnings(record=True) as caught:  # the threads' warnings, caught in this one
        warnings.simplefilter("always")
        assert run_threads(N, fn) == [True] * N
    mine = [str(w.message) for w in caught if issubclass(w.category, InitialStateReplaced)]
    assert len(mine) == (1 if differ else 0)  # rank 1 only: rank 0 keeps its own
    assert all(m.startswith("rank 1: sync_initial=True replaced") for m in mine)


@pytest.mark.parametrize("algorithm,scaler_cls", [("allreduce", "torch"), ("dpsgd", "torch"), ("allreduce", "lowbit")])
def test_grad_scaler_with_clipping_on_threads(algorithm, scaler_cls):
    """unscale_, ddp.clip_grad_norm_, scaler.step: the overflow of rank 1 at step 2 is every
    rank's skipped step (agreed at the end of backward, so the clip communicates nothing for it),
    and the steps after it communicate and clip as usual. lowbit.integrations.GradScaler is
    torch's scaler under the name kept for the code that uses it."""
    from lowbit.integrations import GradScaler

    cls = GradScaler if scaler_cls == "lowbit" else torch.amp.GradScaler

    def fn(t):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.3)
        ddp = DecentralizedDataParallel(net, opt, algorithm, transport=t)
        scaler = cls("cpu", init_scale=256.0, growth_interval=100)
        taken, sent = [], []
        for k in range(5):
            opt.zero_grad()
            with _fp16():
                loss = _loss(ddp, t.rank, k) * (float("inf") if (t.rank == 1 and k == 2) else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            ddp.clip_grad_norm_(0.5)
            sent.append(ddp.bytes_sent)
            before = ddp.step_count
            scaler.step(opt)
            scaler.update()
            taken.append(ddp.step_count > before)
        finite = bool(torch.isfinite(ddp.flat.data).all())
        ddp.close()
        return taken, float(scaler.get_scale()), finite, ddp.flat.data.clone(), sent

    res = run_threads(N, fn)
    assert [r[0] for r in res] == [[True, True, False, True, True]] * N
    assert [r[1] for r in res] == [128.0] * N and all(r[2] for r in res)
    for r in res:  # four steps' bytes in five iterations: nothing sent twice for the skipped step
        steps = [b - a for a, b in zip([0] + r[4][:-1], r[4])]  # (gossip: sent by the forward, kept)
        assert steps.count(0) == 1 and len(set(steps) - {0}) == 1
    if algorithm == "allreduce":
        assert torch.equal(res[0][3], res[1][3])  # the replicas stayed equal


@pytest.mark.parametrize("overlap", [False, True])
def test_overflow_without_a_scaler_names_the_rank(overlap):
    """fp16 autocast, no scaler: a step on the gradient that overflowed on rank 1 (and that the
    end of backward spread to rank 0) raises the same Diverged on every rank, naming rank 1, as
    the step's own agreement does without autocast."""
    from lowbit.algorithms.faults import Diverged

    def fn(t):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t, overlap=overlap)
        try:
            for k in range(4):
                opt.zero_grad()
                with _fp16():
                    loss = _loss(ddp, t.rank, k) * (float("inf") if (t.rank == 1 and k == 1) else 1.0)
                loss.backward()
                opt.step()
        except Diverged as e:
            ddp._close(agree=False)
            return e.step, e.what, e.rank
        return None

    assert run_threads(N, fn) == [(1, "gradient", 1)] * N


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_overflow_agreement_runs_under_fp16_only_and_changes_no_bit(dtype):
    """One all-reduce per backward pass under fp16 autocast, none under bf16 (nor inside
    no_sync()); without an overflow the run is bit for bit the one without the agreement."""
    def fn(t, quiet):
        calls = [0]
        all_reduce = t.all_reduce

        def counted(*a, **kw):
            calls[0] += 1
            return all_reduce(*a, **kw)

        t.all_reduce = counted
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t, overlap=False)  # dpsgd: no all-reduce
        try:
            for k in range(4):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=dtype):
                    loss = _loss(ddp, t.rank, k)
                with ddp.no_sync() if quiet else contextlib.nullcontext():
                    loss.backward()
                opt.step()
            ddp.close()
        finally:
            del t.all_reduce
        return ddp.flat.data.clone(), calls[0]

    agreed, quiet = run_threads(N, lambda t: fn(t, False)), run_threads(N, lambda t: fn(t, True))
    assert [c for _, c in agreed] == [4 if dtype == torch.float16 else 0] * N and [c for _, c in quiet] == [0] * N
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(agreed, quiet))



@pytest.mark.gpu
def test_thread_workers_sharing_a_gpu_warn_instead_of_hanging():
    """Thread workers on one GPU: autograd ends every rank's backward on its one device thread,
    where the overflow agreement would wait for ever; it warns once and does not run."""
    def fn(t):
        net = Net().cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, "allreduce", transport=t)
        scaler = torch.amp.GradScaler("cuda")
        for k in range(3):
            opt.zero_grad()
            x, y = (v.cuda() for v in _batch(t.rank, k))
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        ddp.close()
        return ddp.step_count

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_threads(N, fn) == [3] * N
    assert sum("overflow agreement does not run" in str(w.message) for w in caught) == N
