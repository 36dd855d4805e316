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
    {"name": "maxnorm", "algorithm": "maxnorm", "options": {"bits": 4, "seed": 3}, "precision": "bf16-mixed",
     "accumulate": 2},
    {"name": "moniqua", "algorithm": "moniqua", "options": {"bits": 2, "theta": 0.5}, "accumulate": 2,
     "clip": 0.5},
    {"name": "lost", "algorithm": "dpsgd", "drop_side_rank": 1},  # rank 1's lowbit file is gone at the resume
    {"name": "overflow", "algorithm": "dpsgd", "precision": "16-mixed", "overflow_at": 1, "resume": False},
]


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
    for rank in r:  # 16-mixed: the scaler whose skipped steps every rank skips together
        assert rank["a"]["scaler"] == rank["b"]["scaler"] == "lowbit.integrations.amp.GradScaler"
    numel = r[0]["a"]["numel"]
    per_step = len(IdentityCodec().encode(torch.zeros(numel)).to_wire())  # x_k to the one neighbour
    for rank in r:
        assert rank["a"]["bytes"] == [per_step * (k + 1) for k in range(STEPS)]
    # two ranks, uniform weights: x_i <- (x_0 + x_1) / 2 - lr g_i, so the ranks differ by lr (g_1 - g_0)
    diff = _params(r[0]) - _params(r[1])
    expected = -LR * (torch.tensor(r[0]["a"]["grad"]) - torch.tensor(r[1]["a"]["grad"]))
    assert diff.abs().max() > 1e-4
    assert torch.allclose(diff, expected, atol=1e-6)


@pytest.mark.parametrize("case", ["allreduce", "dpsgd", "maxnorm", "moniqua"])
def test_resume_from_model_checkpoint_continues_curve_and_bytes(runs, case):
    accumulate = next(c.get("accumulate", 1) for c in CASES if c["name"] == case)
    for rank in runs[case]:
        a, b = rank["a"], rank["b"]
        half = len(a["losses"]) // 2
        assert b["bytes"] == a["bytes"][half:]  # the ledger continues
        assert a["global_step"] == b["global_step"] == STEPS // accumulate
        for f in ("epoch=0.ckpt", "epoch=1.ckpt"):  # every rank's own lowbit file beside Lightning's
            assert f in a["files"] and all(os.path.basename(side_path(f, r)) in a["files"] for r in (0, 1))
        if case == "maxnorm":
            # torch DDP builds a fresh model's bucket in parameter order and rebuilds it in gradient
            # order after the first step: the quantizer's 512-coordinate blocks then differ once
            assert b["losses"][:accumulate] == a["losses"][half:half + accumulate]
            assert torch.allclose(torch.tensor(b["losses"]), torch.tensor(a["losses"][half:]), rtol=0.05)
        else:
            assert b["losses"] == a["losses"][half:]  # the second epoch again, bit for bit
            assert b["params"] == a["params"]


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
    """rank 1's gradient is inf at the second step: every rank skips it, both scalers halve, and
    the ranks stay in step to the end (torch's own scaler would skip on rank 1 only, and the ranks
    would fall out of step). The skipped step's exchange (overlapped: sent during its forward) is
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


def test_hook_state_file_round_trips_counters_and_memories(tmp_path):
    """What a hook run writes beside Lightning's checkpoint (error memory per parameter and per
    bucket, PowerSGD's warm start, the counters) loads back with weights_only and restores them."""
    from lowbit.integrations.checkpoint import load_checkpoint, save_checkpoint
    from lowbit.integrations.lightning import _hook_state_dict, _load_hook_state

    strategy = LowbitStrategy("sign", seed=5)
    state = strategy.hook_state
    state.step, state.bytes_sent, state.messages, state.fp32_bytes_sent = 7, 1234, 14, 9999
    state.param_memory = {"net.0.weight": torch.randn(16, 8).flatten()}
    state.bucket_memory = {0: (((16, 8), (16,)), torch.randn(144))}
    state.powersgd_q = {1: (((4, 3),), torch.randn(3, 2))}
    path = save_checkpoint(_hook_state_dict(state), tmp_path / "x.ckpt.lowbit-rank0")
    fresh = LowbitStrategy("sign", seed=5).hook_state
    _load_hook_state(fresh, load_checkpoint(path), path)
    assert (fresh.step, fresh.bytes_sent, fresh.messages, fresh.fp32_bytes_sent) == (7, 1234, 14, 9999)
    assert torch.equal(fresh.param_memory["net.0.weight"], state.param_memory["net.0.weight"])
    assert fresh.bucket_memory[0][0] == ((16, 8), (16,)) and torch.equal(fresh.bucket_memory[0][1],
                                                                         state.bucket_memory[0][1])
    assert fresh.powersgd_q[1][0] == ((4, 3),) and torch.equal(fresh.powersgd_q[1][1], state.powersgd_q[1][1])
    with pytest.raises(ValueError, match="missing"):
        _load_hook_state(fresh, {"step": 1}, "somewhere")


def test_asynchronous_algorithm_refuses_a_checkpoint_during_training():
    from types import SimpleNamespace

    strategy = LowbitStrategy("adpsgd")
    strategy.wrapper = SimpleNamespace(algorithm=SimpleNamespace(synchronous=False))  # as after setup
    with pytest.raises(RuntimeError, match="enable_checkpointing=False"):
        strategy._lowbit_state()
