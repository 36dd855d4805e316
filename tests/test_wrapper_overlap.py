"""DecentralizedDataParallel overlaps a gossip algorithm's exchange with forward and backward
(issue 12, item 5): the same parameters and ledger as without overlap, bit for bit (thread
workers and a torchrun/gloo pair); no traffic from an evaluation forward; errors of the
communication thread raised in the caller; the wrapper's checks around the exchange in flight."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from lowbit.algorithms import DPSGD, Algorithm, NaiveQuantizedDPSGD
from lowbit.bench.overlap import bench_overlap
from lowbit.cli import main
from lowbit.codecs import DitheredCodec
from lowbit.comm import run_threads
from lowbit.integrations import DecentralizedDataParallel
from wrapper_models import rank_batch, small_model

N = 4
ROOT = Path(__file__).resolve().parents[1]


def _net(seed=0) -> nn.Module:
    return small_model(hidden=16, seed=seed)


_batch = rank_batch


def _wrap(t, algorithm="dpsgd", overlap=True, **options):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return net, DecentralizedDataParallel(net, opt, algorithm, transport=t, overlap=overlap, **options)


def _train(ddp, net, t, steps, forward="wrapper", micro=1, evaluate=False):
    """The user's loop; ``forward``: through the wrapper or the plain module; ``micro``
    forwards (gradient accumulation) per step; ``evaluate``: an eval forward before each."""
    overlapped = []
    for k in range(steps):
        x, y = _batch(t.rank, k)
        if evaluate:
            with torch.no_grad():
                net(x)
        ddp.optimizer.zero_grad()
        for part in range(micro):
            out = (ddp if forward == "wrapper" else net)(x[part::micro])
            (nn.functional.cross_entropy(out, y[part::micro]) / micro).backward()
        ddp.optimizer.step()
        overlapped.append(ddp.stats()["overlapped"])
    return overlapped


def _result(ddp, t, overlapped):
    out = ddp.flat.data.clone(), t.ledger.to_rows(), overlapped, ddp.overlap
    ddp.close()
    return out


# ---- bit-identical with and without overlap ---------------------------------------------------
@pytest.mark.parametrize("algorithm,options", [("dpsgd", {}), ("naive", {}),
                                               (NaiveQuantizedDPSGD, {"codec": DitheredCodec(levels=16)})],
                         ids=["dpsgd", "naive", "naive-dithered"])
@pytest.mark.parametrize("forward,micro", [("wrapper", 1), ("module", 1), ("module", 2)])
def test_overlap_is_bit_identical(algorithm, options, forward, micro):
    steps = 4

    def fn(t, overlap):
        net, ddp = _wrap(t, algorithm, overlap, **options)
        return _result(ddp, t, _train(ddp, net, t, steps, forward, micro))

    on = run_threads(N, lambda t: fn(t, True))
    off = run_threads(N, lambda t: fn(t, False))
    for (x_on, rows_on, ov_on, flag_on), (x_off, rows_off, ov_off, flag_off) in zip(on, off):
        assert flag_on and not flag_off
        assert ov_on == [1] * steps and ov_off == [0] * steps
        assert torch.equal(x_on, x_off)
        assert rows_on == rows_off and len(rows_on) == steps  # one exchange per step, booked at its step
    assert not torch.equal(on[0][0], on[1][0])  # the workers' models differ: the comparison is not vacuous


def test_finished_exchanges_are_not_kept(monkeypatch):
    """Each wrapper holds only its exchange in flight, and forgets it once it is waited for:
    nothing of a finished step (its model copy, the algorithm) stays referenced, and nothing
    is kept at module level."""
    import gc
    import weakref

    from lowbit.integrations import overlap

    made, init = [], overlap.Exchange.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((threading.get_ident(), weakref.ref(self)))  # made in the worker's thread

    monkeypatch.setattr(overlap.Exchange, "__init__", recorded)

    def fn(t):
        net, ddp = _wrap(t)
        overlapped = _train(ddp, net, t, 3)
        gc.collect()
        mine = [ref for ident, ref in list(made) if ident == threading.get_ident()]
        kept = ddp._exchange is not None or any(ref() is not None for ref in mine)  # the wrapper is alive
        ddp.close()
        return overlapped, len(mine), kept

    assert run_threads(N, fn) == [([1, 1, 1], 3, False)] * N


def test_overlap_only_where_the_algorithm_allows_it():
    def fn(t):
        _, gossip = _wrap(t)
        _, central = _wrap(t, "allreduce")  # reduces the gradient: communicates at the step
        flags = gossip.overlap, central.overlap, len(gossip._hooks), len(central._hooks)
        gossip.close()
        central.close()
        with pytest.raises(TypeError, match="overlap must be True or False"):
            _wrap(t, overlap="yes")
        return flags

    assert run_threads(1, fn) == [(True, False, 3, 2)]
    assert DPSGD.overlap and not Algorithm.overlap


def _count_concurrent_ops(t) -> list[int]:
    """Make every operation of transport ``t`` last 20 ms longer and count how many run at once;
    returns a one-element list holding the most seen."""
    lock, active, most = threading.Lock(), [0], [0]

    def counted(op):
        def run(*args, **kwargs):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            try:
                time.sleep(0.02)
                return op(*args, **kwargs)
            finally:
                with lock:
                    active[0] -= 1
        return run

    for name in ("neighbor_exchange", "all_reduce", "all_gather", "broadcast", "gather", "barrier"):
        setattr(t, name, counted(getattr(t, name)))
    return most


@pytest.mark.parametrize("second", ["dpsgd", "moniqua"])
def test_two_wrappers_on_one_transport_take_turns(second):
    """Two models, two optimizers, two wrappers on one process group (a GAN): the second
    wrapper's exchange (or its step's communication) waits for the first's in flight, so the
    ranks issue them in program order; bit-identical to no overlap, ledger included."""
    steps = 3

    def fn(t, overlap):
        net_a, ddp_a = _wrap(t, "dpsgd", overlap)
        net_b, ddp_b = _wrap(t, second, overlap, **({"bits": 2, "theta": 2.0} if second == "moniqua" else {}))
        most = _count_concurrent_ops(t)
        for k in range(steps):
            x, y = _batch(t.rank, k)
            ddp_a.optimizer.zero_grad()
            ddp_b.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp_a(x) + ddp_b(x), y)  # both forwards before either step
            loss.backward()
            ddp_a.optimizer.step()
            ddp_b.optimizer.step()
        assert most == [1]  # never two operations at once on this rank's channel
        out = ddp_a.flat.data.clone(), ddp_b.flat.data.clone(), t.ledger.to_rows(), ddp_b.stats()["overlapped"]
        ddp_a.close()
        ddp_b.close()
        return out

    on, off = run_threads(N, lambda t: fn(t, True)), run_threads(N, lambda t: fn(t, False))
    for (a_on, b_on, rows_on, ov_b), (a_off, b_off, rows_off, _) in zip(on, off):
        assert ov_b == (second == "dpsgd")
        assert torch.equal(a_on, a_off) and torch.equal(b_on, b_off) and rows_on == rows_off


# ---- an evaluation forward sends nothing -------------------------------------------------------
def test_eval_forward_starts_no_traffic():
    steps = 3

    def fn(t, evaluate):
        net, ddp = _wrap(t)
        x, _ = _batch(t.rank, 0)
        with torch.no_grad():
            ddp(x)
        net.eval()
        ddp(x)
        net.train()
        copy.deepcopy(net)(x)  # a copy of the module (an EMA model, averaged_module) starts nothing either
        quiet = ddp._exchange is None and t.ledger.bytes_sent == 0
        overlapped = _train(ddp, net, t, steps, evaluate=evaluate)
        return (quiet, *_result(ddp, t, overlapped))

    plain = run_threads(N, lambda t: fn(t, False))
    evaluated = run_threads(N, lambda t: fn(t, True))
    for (quiet, x, rows, ov, _), (quiet_e, x_e, rows_e, ov_e, _) in zip(plain, evaluated):
        assert quiet and quiet_e
        assert ov == ov_e == [1] * steps
        assert torch.equal(x, x_e) and rows == rows_e


def test_step_without_a_training_forward_communicates_at_the_step():
    """Gradients computed with no training forward of the module (here: under eval mode):
    the step's pre-hook communicates, as without overlap, bit for bit."""
    steps = 3

    def fn(t, overlap):
        net, ddp = _wrap(t, overlap=overlap)
        net.eval()  # no dropout or BN here: the same gradients as in training mode
        overlapped = _train(ddp, net, t, steps)
        return _result(ddp, t, overlapped)

    on, off = run_threads(N, lambda t: fn(t, True)), run_threads(N, lambda t: fn(t, False))
    for (x_on, rows_on, ov_on, _), (x_off, rows_off, _, _) in zip(on, off):
        assert ov_on == [0] * steps
        assert torch.equal(x_on, x_off) and rows_on == rows_off


# ---- errors ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FailsAtStep1(DPSGD):
    """D-PSGD whose exchange of step 1 fails (in the communication thread)."""

    name = "fails"

    def before_update(self, state, ctx, k, x, g, lr):
        if k == 1:
            raise ValueError(f"rank {ctx.rank}: the exchange failed")
        return super().before_update(state, ctx, k, x, g, lr)


@dataclass(frozen=True)
class _ReadsTheGradient(DPSGD):
    """Declares overlap but reads g: the wrapper passes g=None, so it fails loudly."""

    name = "reads-g"

    def before_update(self, state, ctx, k, x, g, lr):
        g.sum()
        return state


def test_errors_of_the_thread_are_raised_by_the_step():
    def fn(t):
        net, ddp = _wrap(t, _FailsAtStep1())
        _train(ddp, net, t, 1)
        with pytest.raises(ValueError, match="the exchange failed"):
            _train(ddp, net, t, 1)
        assert ddp._exchange is None and ddp.step_count == 1
        ddp.close()

        net, ddp = _wrap(t, _ReadsTheGradient())
        with pytest.raises(AttributeError, match="NoneType"):
            _train(ddp, net, t, 1)
        ddp.close()
        return True

    assert run_threads(2, fn) == [True, True]


def test_errors_of_the_thread_are_raised_by_close_and_by_the_next_forward():
    def fn(t):
        net, ddp = _wrap(t, _FailsAtStep1())
        _train(ddp, net, t, 1)
        x, _ = _batch(t.rank, 1)
        ddp(x)  # starts the failing exchange; no step follows
        with pytest.raises(ValueError, match="the exchange failed"):
            ddp.close()
        assert ddp._closed

        net, ddp = _wrap(t, _FailsAtStep1())
        _train(ddp, net, t, 1)
        ddp(x)
        ddp._exchange.join()
        with pytest.raises(ValueError, match="the exchange failed"):
            ddp(x)  # gradient accumulation's second forward sees it
        ddp.close()
        return True

    assert run_threads(2, fn) == [True, True]


def test_parameters_changed_between_forward_and_step_is_an_error():
    def fn(t):
        net, ddp = _wrap(t)
        x, y = _batch(t.rank, 0)
        nn.functional.cross_entropy(ddp(x), y).backward()
        with torch.no_grad():
            net[0].weight.mul_(0.5)  # the neighbours already have the old x_k
        with pytest.raises(RuntimeError, match="changed in place between the forward of step 0"):
            ddp.optimizer.step()
        ddp(x)  # a new exchange starts (the failed one was consumed)
        with torch.no_grad():
            net[2].bias.add_(1.0)
        with pytest.raises(RuntimeError, match="changed in place"):
            ddp(x)  # the second forward (accumulation) notices
        ddp.close()
        return True

    assert run_threads(2, fn) == [True, True]


def test_checkpoints_between_steps_only_and_averaged_module_waits():
    steps = 3

    def fn(t, mid):
        net, ddp = _wrap(t)
        avgs = []
        for k in range(steps):
            x, y = _batch(t.rank, k)
            ddp.optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            if mid:  # between the forward and the step, with the exchange in flight
                with pytest.raises(RuntimeError, match="checkpoint_state.. between a training forward"):
                    ddp.checkpoint_state()
                with pytest.raises(RuntimeError, match="load_checkpoint_state.. between"):
                    ddp.load_checkpoint_state({})
                avgs.append(ddp.averaged_module()[0].weight.detach().clone())
            ddp.optimizer.step()
            if not mid:
                avgs.append(ddp.averaged_module()[0].weight.detach().clone())
        ddp.checkpoint_state()  # between steps: fine
        return (*_result(ddp, t, None)[:2], avgs)

    mid, after = run_threads(N, lambda t: fn(t, True)), run_threads(N, lambda t: fn(t, False))
    for (x_m, rows_m, avg_m), (x_a, rows_a, avg_a) in zip(mid, after):
        assert torch.equal(x_m, x_a) and rows_m == rows_a  # averaged_module traffic is untracked
        torch.testing.assert_close(avg_m[1:], avg_a[:-1], atol=1e-6, rtol=0)  # the average of x_k, before step k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_overlap_on_cuda_is_bit_identical():
    """On a GPU the thread's kernels run on the stream current at the forward (after the copy
    of x_k), and the step's copy of x_{k+1/2} follows them on that stream."""
    steps = 4

    def fn(t, overlap):
        net = _net().cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t, overlap=overlap)
        overlapped = []
        for k in range(steps):
            x, y = _batch(t.rank, k)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x.cuda()), y.cuda()).backward()
            opt.step()
            overlapped.append(ddp.stats()["overlapped"])
        return _result(ddp, t, overlapped)

    on = run_threads(2, lambda t: fn(t, True), device="cuda")
    off = run_threads(2, lambda t: fn(t, False), device="cuda")
    for (x_on, rows_on, ov_on, _), (x_off, rows_off, ov_off, _) in zip(on, off):
        assert ov_on == [1] * steps and ov_off == [0] * steps
        assert x_on.is_cuda and torch.equal(x_on, x_off) and rows_on == rows_off


# ---- torchrun: two gloo processes -----------------------------------------------------------
def test_torchrun_overlap_is_bit_identical():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "wrapper_overlap_loop.py")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    for algorithm in ("dpsgd", "naive"):
        r = res[algorithm]
        assert r["overlapped_on"] == r["steps"] and r["overlapped_off"] == 0 and r["bytes_sent"] > 0
        assert r["identical"] and r["same_ledger"]


# ---- the benchmark ----------------------------------------------------------------------------
def test_bench_overlap_cli_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    assert main(["bench", "overlap", "--hidden", "32", "--layers", "2", "--batch", "4", "--steps", "4", "--warmup", "1",
                 "--rounds", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "overlap / no overlap" in text and "exchange alone" in text
    report = json.loads(out.read_text())
    assert report["params"] == 2 * (32 * 32 + 32) and len(report["per_round"]) == 2
    for key in ("step_ms_overlap", "step_ms_no_overlap", "compute_ms", "exchange_ms", "x_no_overlap"):
        assert report[key] > 0


@pytest.mark.parametrize("kwargs,match", [({"algorithm": "moniqua"}, "algorithm must be one of"),
                                          ({"workers": 1}, "workers"), ({"warmup": 19}, "warmup"),
                                          ({"latency_ms": -1.0}, "latency_ms"), ({"bandwidth_mbit": 0}, "bandwidth")])
def test_bench_overlap_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench_overlap(**kwargs)
