"""DecentralizedDataParallel in the user's normal loop (issue 12, item 5): optimizer.step()
communicates through the optimizer's step hooks, state_dict() is the module's, an optimizer
over a subset of the parameters, per-step stats() and on_step callbacks, and a torchrun run of
a loop that calls only optimizer.step(). (The bit-identity of optimizer.step() with ddp.step()
and the explicit loop, with the same ledger, is test_wrapper.py::test_wrapper_equals_plain_loop.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lowbit.algorithms import ALGORITHMS
from lowbit.comm import ThreadWorld, run_threads
from lowbit.integrations import DecentralizedDataParallel, FlatParams, LogStats, TensorBoardStats
from lowbit.topology import make_topology

N, BATCH = 4, 8
ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    """A body (communicated when the optimizer holds it) and a head."""

    def __init__(self, seed=0):
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _loss(model, rank, k):
    g = torch.Generator().manual_seed(1000 * rank + k)
    x, y = torch.randn(BATCH, 5, generator=g) + rank, torch.randint(0, 3, (BATCH,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _user_steps(model, opts, rank, start, stop):
    """The user's loop: zero_grad, backward, optimizer.step() of each optimizer; nothing of lowbit."""
    for k in range(start, stop):
        for opt in opts:
            opt.zero_grad()
        _loss(model, rank, k).backward()
        for opt in opts:
            opt.step()


# ---- state_dict is the module's ----------------------------------------------------------
def test_state_dict_round_trip_with_a_plain_module():
    def fn(t):
        net = Net()
        ddp = DecentralizedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), "dpsgd", transport=t)
        _user_steps(net, [ddp.optimizer], t.rank, 0, 3)
        sd = ddp.state_dict()
        assert list(sd) == list(net.state_dict()) == list(Net().state_dict())
        plain = Net(seed=5)
        plain.load_state_dict(sd)  # the plain module takes the wrapper's state dict
        same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), net.parameters()))
        # and back: a plain state dict into the wrapper, in place (parameters stay views)
        ddp.load_state_dict(Net(seed=9).state_dict())
        loaded = torch.equal(ddp.flat.data, FlatParams(Net(seed=9)).data)
        ddp.zero_grad()
        _loss(net, t.rank, 3).backward()
        ddp.optimizer.step()  # training continues from the loaded parameters
        ddp.flat.check_aliasing()
        with pytest.raises(ValueError, match="assign"):
            ddp.load_state_dict(sd, assign=True)
        return same, loaded, ddp.step_count

    assert run_threads(2, fn) == [(True, True, 4)] * 2


# ---- the optimizer's step hooks ------------------------------------------------------------
def test_one_wrapper_per_optimizer_and_close_removes_the_hooks():
    def fn(t):
        net, net2 = Net(), Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t)
        with pytest.raises(ValueError, match="already wrapped"):
            DecentralizedDataParallel(net2, opt, "dpsgd", transport=t)
        _user_steps(net, [opt], t.rank, 0, 2)
        sent = ddp.bytes_sent
        ddp.close()
        x = ddp.flat.data.clone()
        _user_steps(net, [opt], t.rank, 2, 3)  # hooks removed: a plain local step, no communication
        local_step = ddp.bytes_sent == sent and ddp.step_count == 2 and not torch.equal(x, ddp.flat.data)
        # the optimizer is free again for a new wrapper (over the same module)
        again = DecentralizedDataParallel(net, opt, "dpsgd", transport=t)
        _user_steps(net, [opt], t.rank, 3, 4)
        again.close()
        return sent > 0, local_step, again.step_count

    assert run_threads(2, fn) == [(True, True, 1)] * 2


# ---- an optimizer over a subset of the parameters -------------------------------------------
def test_subset_optimizer_communicates_only_its_parameters():
    steps = 5

    def wrapped(t):
        net = Net()
        shared = torch.optim.SGD(net.body.parameters(), lr=0.1, momentum=0.9)
        own = torch.optim.SGD(net.head.parameters(), lr=0.1)  # the head stays this rank's
        ddp = DecentralizedDataParallel(net, shared, "dpsgd", transport=t)
        _user_steps(net, [shared, own], t.rank, 0, steps)
        avg = ddp.averaged_module()
        return (ddp.flat.data.clone(), [p.detach().clone() for p in net.head.parameters()], avg, ddp.stats(),
                len(ddp.flat), t.ledger.to_rows())

    def plain(t):  # the explicit sequence over the body only; the head steps on its own
        net = Net()
        flat = FlatParams(net, list(net.body.parameters()))
        algo = ALGORITHMS["dpsgd"]().worker(t, make_topology("ring", N))
        algo.setup(flat.data)
        shared = torch.optim.SGD(net.body.parameters(), lr=0.1, momentum=0.9)
        own = torch.optim.SGD(net.head.parameters(), lr=0.1)
        for k in range(steps):
            t.set_step(k)
            flat.zero_grad()
            own.zero_grad()
            _loss(net, t.rank, k).backward()
            algo.before_update(k, flat.data, flat.grad, 0.1)
            shared.step()
            algo.after_update(k, flat.data, flat.grad, 0.1)
            own.step()
        return flat.data.clone(), [p.detach().clone() for p in net.head.parameters()], t.ledger.to_rows()

    got, ref = run_threads(N, wrapped), run_threads(N, plain)
    body_numel = sum(p.numel() for p in Net().body.parameters())
    mean_body = torch.stack([g[0] for g in got]).mean(0)
    for (x, head, avg, stats, numel, rows), (x_ref, head_ref, rows_ref) in zip(got, ref):
        assert numel == body_numel and torch.equal(x, x_ref) and rows == rows_ref
        assert all(torch.equal(a, b) for a, b in zip(head, head_ref))
        torch.testing.assert_close(FlatParams(avg, list(avg.body.parameters())).data, mean_body, atol=1e-6, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip(avg.head.parameters(), head))  # local: this rank's own
        assert stats["wire_bits_per_element"] == 8.0 * stats["bytes_sent_step"] / body_numel > 0
    assert not torch.equal(got[0][1][0], got[1][1][0])  # the heads differ between ranks


def test_local_parameters_start_from_rank0():
    def fn(t):
        net = Net(seed=t.rank)  # a different x_0 on every rank, the head too
        ddp = DecentralizedDataParallel(net, torch.optim.SGD(net.body.parameters(), lr=0.1), "dpsgd", transport=t)
        return [p.detach().clone() for p in net.parameters()], ddp.bytes_sent

    ref = [p.detach() for p in Net(seed=0).parameters()]
    for params, sent in run_threads(3, fn):
        assert sent == 0 and all(torch.equal(a, b) for a, b in zip(params, ref))


def test_subset_optimizer_errors():
    t = ThreadWorld(1).transport(0)
    net = Net()
    with pytest.raises(ValueError, match="not a trainable parameter of module"):
        DecentralizedDataParallel(net, torch.optim.SGD(Net().body.parameters(), lr=0.1), "dpsgd", transport=t)
    net.head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="not a trainable parameter of module"):
        DecentralizedDataParallel(net, torch.optim.SGD([net.head.weight], lr=0.1), "dpsgd", transport=t)


# ---- per-step statistics ----------------------------------------------------------------------
@pytest.mark.parametrize("name,options", [("dpsgd", {}), ("moniqua", {"bits": 2, "theta": 2.0}), ("allreduce", {})])
def test_stats_and_on_step_equal_the_ledger(name, options):
    steps = 5

    def fn(t):
        seen = []

        def on_step(step, stats):
            led = t.ledger  # what the ledger says at that moment, read its own way
            seen.append((step, stats, led.step_bytes(step), led.bytes_sent, led.messages_sent,
                         sum(r.messages for r in led.records.get(step, ()))))

        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, name, transport=t, on_step=on_step, **options)
        assert ddp.stats() == {}
        _user_steps(net, [opt], t.rank, 0, steps)
        last = ddp.stats()
        report = ddp.algorithm.report()
        ddp.close()
        return seen, last, report, len(ddp.flat)

    for seen, last, report, numel in run_threads(N, fn):
        assert [s[0] for s in seen] == list(range(steps))
        for step, stats, step_bytes, total, messages, step_messages in seen:
            assert stats["step"] == step and stats["lr"] == 0.1
            assert stats["bytes_sent_step"] == step_bytes > 0
            assert stats["bytes_sent"] == total and stats["messages_sent"] == messages
            assert stats["messages_step"] == step_messages > 0
            assert stats["wire_bits_per_element"] == 8.0 * step_bytes / numel
        assert last == seen[-1][1]
        for key, value in report.items():  # the algorithm's report: Moniqua's theta and counters
            assert last[key] == value
        if name == "moniqua":
            assert last["theta"] == 2.0 and "mismatched_blocks" in last


def test_stats_continue_the_ledger_after_a_resume():
    def fn(t, state=None, start=0, stop=4):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, "moniqua", transport=t, bits=2, theta=2.0)
        if state is not None:
            ddp.load_checkpoint_state(state[t.rank])
        _user_steps(net, [opt], t.rank, start, stop)
        return ddp.checkpoint_state(), ddp.stats(), t.ledger.bytes_sent, t.ledger.messages_sent

    full = run_threads(2, fn)
    half = run_threads(2, lambda t: fn(t, stop=2))
    resumed = run_threads(2, lambda t: fn(t, [h[0] for h in half], 2, 4))
    for f, r in zip(full, resumed):
        assert r[1]["bytes_sent"] == r[2] == f[2] and r[1]["messages_sent"] == r[3] == f[3]
        assert r[1] == f[1]


def test_log_stats_callback(caplog):
    def fn(t):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ddp = DecentralizedDataParallel(net, opt, "moniqua", transport=t, bits=2, theta=2.0,
                                        on_step=LogStats(logging.getLogger(f"test.rank{t.rank}"), every=2))
        _user_steps(net, [opt], t.rank, 0, 5)
        return ddp.stats()

    with caplog.at_level(logging.INFO):
        last = run_threads(2, fn)[0]
    lines = [r.getMessage() for r in caplog.records if r.name == "test.rank0"]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 2", "step 4"]
    assert f"bytes_sent={last['bytes_sent']}" in lines[-1] and "theta=2" in lines[-1]
    with pytest.raises(ValueError, match="every"):
        LogStats(every=0)


def test_tensorboard_stats_callback(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def fn(t):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        cb = TensorBoardStats(tmp_path / f"rank{t.rank}")
        seen = []
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t,
                                        on_step=lambda k, s: (cb(k, s), seen.append(s["bytes_sent"])))
        _user_steps(net, [opt], t.rank, 0, 3)
        ddp.close()
        cb.close()
        return seen

    seen = run_threads(2, fn)[0]
    acc = EventAccumulator(str(tmp_path / "rank0"))
    acc.Reload()
    events = acc.Scalars("lowbit/bytes_sent")
    assert [e.step for e in events] == [0, 1, 2] and [e.value for e in events] == seen
    assert "lowbit/wire_bits_per_element" in acc.Tags()["scalars"]
    with pytest.raises(ValueError, match="exactly one"):
        TensorBoardStats()


# ---- torchrun: a loop that calls only optimizer.step() ---------------------------------------
def test_torchrun_user_loop_calls_only_optimizer_step():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "wrapper_user_loop.py"), "dpsgd"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert res["steps"] == 30 and res["bytes_sent"] > 0 and res["stats_bytes_sent"] == res["bytes_sent"]
    assert res["identical_to_ddp_step"] and res["same_ledger"]  # optimizer.step() is ddp.step(), bit for bit
    assert res["identical_to_explicit_loop"] and res["same_ledger_as_explicit_loop"]  # and the sequence itself
    # the models agree: gossip keeps them within a small fraction of what local steps drift apart
    assert res["consensus"] < 0.2 * res["consensus_local"]
    assert res["local_bytes_sent"] == 0 and res["local_steps_counted"] == 0


def test_backward_passes_are_counted_as_torch_counts_them_in_bounded_memory():
    """The wrapper's count of backward passes (the agreement's, stepping.CountPasses) equals torch's
    register_multi_grad_hook(mode="any") count: a pass that reaches any communicated parameter counts
    once, one that reaches only some counts, one that reaches none does not, a reentrant checkpoint's
    inner pass is a pass of its own; it remembers only the last passes; remove() stops it."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import checkpoint

    from lowbit.integrations.stepping import CountPasses

    torch.manual_seed(0)
    net, other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.Linear(4, 1)
    params = list(net.parameters())
    guard, torch_count = SimpleNamespace(passes=0), [0]
    counter = CountPasses(guard, params)
    handle = torch.autograd.graph.register_multi_grad_hook(
        params, lambda g: torch_count.__setitem__(0, torch_count[0] + 1), mode="any")
    x = torch.randn(3, 4, requires_grad=True)
    passes = [lambda: net(x).sum().backward(),  # every parameter
              lambda: net[0](x).sum().backward(),  # some
              lambda: other(x).sum().backward(),  # none
              lambda: net[1](checkpoint(net[0], x, use_reentrant=True)).sum().backward(),  # an inner pass too
              lambda: torch.autograd.grad(net(x).sum(), params[:1])]  # autograd.grad over one parameter
    for i in range(3 * CountPasses.REMEMBERED):
        passes[i % len(passes)]()
    handle.remove()
    assert guard.passes == torch_count[0] > 2 * CountPasses.REMEMBERED
    assert len(counter.seen) <= CountPasses.REMEMBERED
    counter.remove()
    net(x).sum().backward()
    assert guard.passes == torch_count[0]
