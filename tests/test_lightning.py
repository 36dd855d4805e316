"""LowbitStrategy with the real ``lightning`` package: 2 ranks on CPU (gloo) under torchrun,
each case fitted for two epochs with a ModelCheckpoint, then resumed from the first epoch's
checkpoint (tests/lightning_run.py). Checked: the bytes on the wire, the ranks' agreement
(exact under a hook, the gossip's consensus under the wrapper), that the resumed run continues
the curve and the byte count, accumulation, clipping and bf16."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

from lowbit.codecs.identity import IdentityCodec  # noqa: E402
from lowbit.comm.netmodel import op_messages_and_bytes  # noqa: E402
from lowbit.integrations.ddp_hooks.options import QSGDMaxNormHook  # noqa: E402
from lowbit.integrations.lightning import LowbitStrategy, side_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LR = 0.1  # tests/lightning_run.py
STEPS = 8  # two epochs of 4 steps per rank
CASES = [
    {"name": "ddp", "algorithm": "ddp", "clip": 0.05, "resume": False},  # Lightning's own DDP, the reference
    {"name": "allreduce", "algorithm": "allreduce", "clip": 0.05},
    {"name": "dpsgd", "algorithm": "dpsgd", "precision": "16-mixed", "sync_dist": True},
    {"name": "maxnorm", "algorithm": "maxnorm", "options": {"bits": 4, "seed": 3}, "noreplay": True,
     "precision": "bf16-mixed", "accumulate": 2},
    {"name": "moniqua", "algorithm": "moniqua", "options": {"bits": 2, "theta": 0.5}, "accumulate": 2,
     "clip": 0.5},
    # hooks with a seed (their randomness per step and bucket), error feedback, PowerSGD's warm start
    {"name": "powersgd", "algorithm": "powersgd", "options": {"seed": 2}, "noreplay": True, "clip": 0.5},
    {"name": "onebit-ef", "algorithm": "onebit-ef"},  # error memory per parameter; one scale per bucket
    {"name": "qsgd", "algorithm": "qsgd", "options": {"bits": 4, "seed": 1}, "noreplay": True},
    {"name": "lost", "algorithm": "dpsgd", "drop_side_rank": 1},  # rank 1's lowbit file is gone at the resume
    {"name": "overflow", "algorithm": "dpsgd", "precision": "16-mixed", "overflow_at": 1, "resume": False},
    # asynchronous: refused at setup with a ModelCheckpoint; saved after fit without one
    {"name": "adpsgd", "algorithm": "adpsgd", "resume": False, "async_checkpoint": True},
]
HOOK_RESUMES = ["allreduce", "maxnorm", "powersgd", "onebit-ef", "qsgd"]


def _torchrun(out, cases, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "lightning_run.py"), str(out), *map(json.dumps, cases)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {c["name"]: [json.load(open(os.path.join(out, f"{c['name']}-rank{r}.json"))) for r in range(2)]
            for c in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("lightning"), CASES)


def _params(rank_result, run="a"):
    return torch.tensor(rank_result[run]["params"])


def test_allreduce_hook_sends_fp32_all_reduce_bytes_and_ranks_agree_exactly(runs):
    r = runs["allreduce"]
    numel = r[0]["a"]["numel"]
    per_step = op_messages_and_bytes("all_reduce", 4 * numel, 2)[1]
    for rank in r:  # the hook is registered on CPU (Lightning's DDPStrategy registers it only on CUDA)
        assert rank["a"]["bytes"] == [per_step * (k + 1) for k in range(STEPS)]
    assert torch.equal(_params(r[0]), _params(r[1]))
    # the same training as Lightning's DDP, clipping the averaged gradient as DDP does
    assert torch.allclose(_params(r[0]), _params(runs["ddp"][0]), atol=1e-6)
    assert runs["ddp"][0]["a"]["bytes"] == [0] * STEPS  # plain "ddp" has no ledger


def test_dpsgd_wrapper_bytes_and_gossip_consensus(runs):
    r = runs["dpsgd"]
    for rank in r:  # 16-mixed: Lightning's own scaler, torch's (its skipped steps agreed by the wrapper)
        assert rank["a"]["scaler"] == rank["b"]["scaler"] == "torch.amp.grad_scaler.GradScaler"
    numel = r[0]["a"]["numel"]
    per_step = len(IdentityCodec().encode(torch.zeros(numel)).to_wire())  # x_k to the one neighbour
    for rank in r:
        assert rank["a"]["bytes"] == [per_step * (k + 1) for k in range(STEPS)]
    # two ranks, uniform weights: x_i <- (x_0 + x_1) / 2 - lr g_i, so the ranks differ by lr (g_1 - g_0)
    diff = _params(r[0]) - _params(r[1])
    expected = -LR * (torch.tensor(r[0]["a"]["grad"]) - torch.tensor(r[1]["a"]["grad"]))
    assert diff.abs().max() > 1e-4
    assert torch.allclose(diff, expected, atol=1e-6)


@pytest.mark.parametrize("case", HOOK_RESUMES + ["dpsgd", "moniqua"])
def test_resume_from_model_checkpoint_continues_curve_and_bytes(runs, case):
    """Run B, resumed from run A's first epoch, is run A's second epoch bit for bit: the hook
    state (step, error memory, PowerSGD's Q, the bucket layout DDP had rebuilt, which the first
    restored step replays) or the wrapper's whole state comes back from each rank's file."""
    accumulate = next(c.get("accumulate", 1) for c in CASES if c["name"] == case)
    for rank in runs[case]:
        a, b = rank["a"], rank["b"]
        half = len(a["losses"]) // 2
        assert b["bytes"] == a["bytes"][half:]  # the ledger continues
        assert a["global_step"] == b["global_step"] == STEPS // accumulate
        for f in ("epoch=0.ckpt", "epoch=1.ckpt"):  # every rank's own lowbit file beside Lightning's
            assert f in a["files"] and all(os.path.basename(side_path(f, r)) in a["files"] for r in (0, 1))
        assert b["losses"] == a["losses"][half:]  # the second epoch again, bit for bit
        assert b["params"] == a["params"]
    if case in HOOK_RESUMES:  # run B's hook saw run A's rebuilt bucket layout from its first step on
        a, b = runs[case][0]["a"], runs[case][0]["b"]
        assert all(layout == a["layouts"][-1] for layout in b["layouts"][accumulate - 1:])


def test_quantized_hooks_change_the_curve_a_resume_must_replay(runs):
    """The resume test above could not pass by accident: each hook's curve differs from plain
    fp32 all-reduce, and the layout replay is what makes it exact (a run resumed without it,
    in the fresh bucket order, departs from run A at the first restored step: the quantizer's
    random numbers and blocks follow the layout, PowerSGD's warm start is kept per bucket
    signature). onebit-ef's sign and bucket-wide scale do not depend on the order: its resume
    checks the error memory alone."""
    fp32 = runs["allreduce"][0]["a"]["losses"]
    for case in ("maxnorm", "powersgd", "qsgd"):
        a = runs[case][0]["a"]
        assert a["losses"][2:] != fp32[2:]
        noreplay = runs[case][0]["c"]
        half = len(a["losses"]) // 2
        accumulate = next(c.get("accumulate", 1) for c in CASES if c["name"] == case)
        assert noreplay["losses"][:accumulate] == a["losses"][half:half + accumulate]
        # DDP's fresh bucket is in parameter order, the rebuilt one (run A's) in gradient order
        assert noreplay["layouts"][accumulate - 1] != a["layouts"][-1] == noreplay["layouts"][-1]
        assert noreplay["params"] != a["params"]


def test_asynchronous_algorithm_with_model_checkpoint_is_refused_at_setup(runs):
    for rank in runs["adpsgd"]:
        error = rank["refused"]
        assert error.startswith("ValueError") and "'adpsgd' is asynchronous" in error
        assert "enable_checkpointing=False" in error
        assert rank["refused_files"] == [] and rank["refused_bytes"] == []  # no file, no step
        # without the callback it trains, and trainer.save_checkpoint after fit writes each rank's state
        assert rank["a"]["bytes"][-1] > 0 and rank["a"]["global_step"] == STEPS
        assert rank["saved_after_fit"] == ["final.ckpt", "final.ckpt.lowbit-rank0", "final.ckpt.lowbit-rank1"]


def test_resume_without_every_ranks_file_starts_lowbit_afresh_on_every_rank(runs):
    a0, b0 = runs["lost"][0]["a"], runs["lost"][0]["b"]
    a1, b1 = runs["lost"][1]["a"], runs["lost"][1]["b"]
    per_step = a0["bytes"][0]
    # no rank restored alone (which would hang the others): both start from rank 0's module,
    # with the wrapper's ledger and step afresh; Lightning's own loop state is restored
    assert b0["bytes"] == b1["bytes"] == [per_step * (k + 1) for k in range(STEPS // 2)]
    assert b0["losses"][0] == a0["losses"][STEPS // 2]  # rank 0 continues from its own module
    assert b1["losses"][0] != a1["losses"][STEPS // 2]  # rank 1 starts from rank 0's
    assert b0["global_step"] == b1["global_step"] == STEPS


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(runs):
    """rank 1's gradient is inf at the second step: Lightning's own scaler (torch's) skips it on
    every rank, both scalers halve, and the ranks stay in step to the end (the wrapper agrees the
    overflow at the end of backward, as DDP's all-reduce spreads it). The skipped step's exchange (overlapped: sent during its forward) is
    kept for the step that follows, as x_k is unchanged: one step fewer on the wire."""
    r = runs["overflow"]
    clean = runs["dpsgd"][0]["a"]  # the same run without the overflow
    for rank in r:
        assert rank["a"]["bytes"][2] == rank["a"]["bytes"][1] == clean["bytes"][1]
        assert rank["a"]["bytes"][-1] == clean["bytes"][-2]
        assert rank["a"]["scale"] == clean["scale"] / 2
    assert r[0]["a"]["params"] != r[1]["a"]["params"] and r[0]["a"]["global_step"] == r[1]["a"]["global_step"]


def test_accumulation_communicates_once_per_optimizer_step(runs):
    for case in ("maxnorm", "moniqua"):  # a hook (DDP's no_sync) and the wrapper
        for rank in runs[case]:
            by = rank["a"]["bytes"]
            assert by[0] == 0 and by[1] > 0 and by[2] == by[1] and by[3] == 2 * by[1]


def test_quantized_runs_send_less_and_agree(runs):
    fp32 = runs["allreduce"][0]["a"]["bytes"][0]
    maxnorm = runs["maxnorm"]
    assert 0 < maxnorm[0]["a"]["bytes"][1] < fp32 / 2  # 4-bit codes in summable lanes, bf16 autocast
    assert torch.equal(_params(maxnorm[0]), _params(maxnorm[1]))  # a hook: the same averaged gradient
    moniqua = runs["moniqua"]
    assert 0 < moniqua[0]["a"]["bytes"][1] < runs["dpsgd"][0]["a"]["bytes"][0] / 4
    # Moniqua's modulo decoding is right while neighbours are within theta (= 0.5 here) coordinatewise
    spread = (_params(moniqua[0]) - _params(moniqua[1])).abs().max()
    assert 0 < spread < 0.5


def test_bad_options_are_refused_at_construction():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        LowbitStrategy("nope")
    with pytest.raises(ValueError, match="bits"):
        LowbitStrategy("dpsgd", bits=2)
    with pytest.raises(ValueError):
        LowbitStrategy("qsgd", theta=0.1)
    with pytest.raises(ValueError, match="ddp_kwargs"):
        LowbitStrategy("moniqua", ddp_kwargs={"find_unused_parameters": True})
    with pytest.raises(ValueError, match="algorithm must be a name"):
        LowbitStrategy(3)
    assert LowbitStrategy("fp16").uses_hook and not LowbitStrategy("choco", bits=4).uses_hook
    typed = LowbitStrategy(QSGDMaxNormHook(bits=4))  # typed hook options, as make_hook takes them
    assert typed.uses_hook and typed.hook_state.codec.bits == 4
    assert LowbitStrategy("allreduce").bytes_sent == 0


@pytest.mark.slow
def test_lightning_own_launcher_runs_the_digits_example():
    """devices=2 without torchrun: Lightning starts the second process by re-running the script."""
    script = os.path.join(HERE, os.pardir, "examples", "lightning_digits.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, script, "--algorithm", "maxnorm", "--epochs", "2", "bits=4"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("maxnorm rank ")]
    assert len(rows) == 2
    sent = [int(r[r.index("bytes_sent") + 1]) for r in rows]
    acc = [float(r[r.index("accuracy") + 1]) for r in rows]
    fp32 = op_messages_and_bytes("all_reduce", 4 * 9610, 2)[1] * int(rows[0][-1])  # the MLP's 9,610 parameters
    assert sent[0] == sent[1] and 0 < sent[0] < fp32 / 4
    assert acc[0] == acc[1] > 0.85


def test_hook_state_file_round_trips_through_the_side_file(tmp_path):
    """What a hook run writes beside Lightning's checkpoint is the hook state's state_dict; it
    loads back with weights_only (lowbit's checkpoint file) into a fresh strategy's state."""
    from lowbit.integrations.checkpoint import load_checkpoint, save_checkpoint

    net = torch.nn.Linear(8, 16)
    state = LowbitStrategy("onebit-ef", seed=5).hook_state
    state.bind_model(net)  # as LowbitStrategy does: memory per parameter name
    state.step, state.bytes_sent = 7, 1234
    state.param_memory = {"weight": torch.randn(16, 8).flatten()}
    state.bucket_layout = {0: ("bias", "weight")}
    path = save_checkpoint(state.state_dict(), tmp_path / "x.ckpt.lowbit-rank0")
    fresh = LowbitStrategy("onebit-ef", seed=5).hook_state
    fresh.bind_model(net)
    fresh.load_state_dict(load_checkpoint(path))
    assert (fresh.step, fresh.bytes_sent) == (7, 1234) and fresh.bucket_layout == state.bucket_layout
    assert torch.equal(fresh.param_memory["weight"], state.param_memory["weight"])
    with pytest.raises(ValueError, match="seed=5"):
        LowbitStrategy("onebit-ef", seed=6).hook_state.load_state_dict(load_checkpoint(path))


def test_asynchronous_algorithm_refuses_a_checkpoint_while_the_wrapper_runs():
    """trainer.save_checkpoint called by hand during fit (no callback): refused before any file."""
    from types import SimpleNamespace

    strategy = LowbitStrategy("adpsgd")
    strategy.wrapper = SimpleNamespace(algorithm=SimpleNamespace(synchronous=False))  # as after setup
    strategy._fitting = True
    with pytest.raises(RuntimeError, match="enable_checkpointing=False"):
        strategy.save_checkpoint({}, "nowhere.ckpt")
