"""lowbit_prepare with the real ``accelerate`` package: 2 ranks on CPU (gloo) started by
``accelerate launch`` (tests/accelerate_run.py), gradient accumulation 2 through
``accelerator.accumulate``. Checked: the bytes on the wire, the ranks' agreement (exact under a
hook, the gossip's consensus under the wrapper), and that a hook reproduces plain Accelerate."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

from lowbit.codecs.identity import IdentityCodec  # noqa: E402
from lowbit.comm.netmodel import op_messages_and_bytes  # noqa: E402
from lowbit.integrations.accelerate import lowbit_prepare  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LR = 0.1  # tests/accelerate_run.py
BATCHES = 8  # two epochs of 4 batches per rank: 4 optimizer steps with accumulation 2
CASES = [
    {"name": "plain", "algorithm": None, "clip": 0.05},  # accelerator.prepare alone, the reference
    {"name": "allreduce", "algorithm": "allreduce", "clip": 0.05},
    {"name": "maxnorm", "algorithm": "maxnorm", "options": {"bits": 4, "seed": 3}},
    {"name": "dpsgd", "algorithm": "dpsgd"},
    {"name": "moniqua", "algorithm": "moniqua", "options": {"bits": 2, "theta": 0.5}, "clip": 0.5},
    {"name": "adpsgd", "algorithm": "adpsgd"},  # asynchronous gossip on the default group
]


def _launch(out, cases, precision="no"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", precision, "--dynamo_backend", "no", "--main_process_port", "0",
           os.path.join(HERE, "accelerate_run.py"), str(out), *map(json.dumps, cases)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {c["name"]: [json.load(open(os.path.join(out, f"{c['name']}-rank{r}.json"))) for r in range(2)]
            for c in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("accelerate"), CASES)


def _params(result):
    return torch.tensor(result["params"])


def _per_step(bytes_step):
    """The byte counts after each batch when every second batch communicates bytes_step."""
    return [bytes_step * ((k + 1) // 2) for k in range(BATCHES)]


def test_allreduce_hook_on_the_prepared_model_is_plain_accelerate(runs):
    numel = runs["allreduce"][0]["numel"]
    per_step = op_messages_and_bytes("all_reduce", 4 * numel, 2)[1]
    for rank in runs["allreduce"]:
        assert rank["bytes"] == _per_step(per_step)  # once per optimizer step: accumulate's no_sync holds
    assert torch.equal(_params(runs["allreduce"][0]), _params(runs["allreduce"][1]))
    # clip_grad_norm_ clips the averaged gradient, as under plain DDP: the same run, bit for bit
    assert runs["allreduce"][0]["params"] == runs["plain"][0]["params"]


def test_maxnorm_hook_sends_less_and_ranks_agree(runs):
    fp32 = runs["allreduce"][0]["bytes"][1]
    r = runs["maxnorm"]
    assert 0 < r[0]["bytes"][1] < fp32 / 2 and r[0]["bytes"] == _per_step(r[0]["bytes"][1])
    assert torch.equal(_params(r[0]), _params(r[1]))
    assert not torch.equal(_params(r[0]), _params(runs["plain"][0]))


def test_dpsgd_wrapper_bytes_and_gossip_consensus(runs):
    r = runs["dpsgd"]
    per_step = len(IdentityCodec().encode(torch.zeros(r[0]["numel"])).to_wire())
    for rank in r:
        assert rank["bytes"] == _per_step(per_step)
    # two ranks, uniform weights: x_i <- (x_0 + x_1) / 2 - lr g_i
    diff = _params(r[0]) - _params(r[1])
    expected = -LR * (torch.tensor(r[0]["grad"]) - torch.tensor(r[1]["grad"]))
    assert diff.abs().max() > 1e-4
    assert torch.allclose(diff, expected, atol=1e-6)


def test_moniqua_wrapper_sends_two_bits_and_stays_within_theta(runs):
    r = runs["moniqua"]
    assert 0 < r[0]["bytes"][1] < runs["dpsgd"][0]["bytes"][1] / 4
    spread = (_params(r[0]) - _params(r[1])).abs().max()
    assert 0 < spread < 0.5  # theta: Moniqua's modulo decoding holds while neighbours are this close


def test_asynchronous_adpsgd_trains_and_gossips_under_accelerate(runs):
    """AD-PSGD (no collective per step: each rank gossips with a partner when it is ready) runs
    under lowbit_prepare: every loss finite, whole fp32 models on the wire (at least one per
    optimizer step, each counted whole), the two ranks' models apart (asynchronous) but as close
    as D-PSGD keeps them (measured: 0.5-1.0x its spread)."""
    r = runs["adpsgd"]
    message = len(IdentityCodec().encode(torch.zeros(r[0]["numel"])).to_wire())
    for rank in r:
        assert all(torch.isfinite(torch.tensor(rank["losses"])))
        steps = torch.tensor(rank["bytes"]).diff()
        assert bool((steps >= 0).all()) and bool((steps % message == 0).all()), rank["bytes"]
        assert rank["bytes"][-1] >= (BATCHES // 2) * message
    spread = (_params(r[0]) - _params(r[1])).abs().max()
    assert 0 < spread < 2 * (_params(runs["dpsgd"][0]) - _params(runs["dpsgd"][1])).abs().max()


def test_bad_algorithm_or_option_is_refused_before_prepare():
    class NoPrepare:
        def prepare(self, *objects):
            raise AssertionError("prepare must not be reached")

    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        lowbit_prepare(NoPrepare(), net, opt, algorithm="nope")
    with pytest.raises(ValueError, match="theta"):
        lowbit_prepare(NoPrepare(), net, opt, algorithm="qsgd", theta=0.5)
    with pytest.raises(ValueError, match="optimizer"):
        lowbit_prepare(NoPrepare(), net, "sgd", algorithm="allreduce")


@pytest.mark.slow
def test_bf16_runs_the_wrapper_forward_under_autocast(tmp_path):
    cases = [{"name": "maxnorm", "algorithm": "maxnorm", "options": {"bits": 4, "seed": 3}},
             {"name": "moniqua", "algorithm": "moniqua", "options": {"bits": 2, "theta": 0.5}}]
    runs = _launch(tmp_path, cases, precision="bf16")
    for case in ("maxnorm", "moniqua"):  # the prepared DDP model and the wrapper alike
        for rank in runs[case]:
            assert rank["dtypes"] == {"inner": "torch.bfloat16", "output": "torch.float32"}
            assert rank["bytes"][1] > 0 and rank["losses"][-1] < rank["losses"][0] * 2
    assert torch.equal(_params(runs["maxnorm"][0]), _params(runs["maxnorm"][1]))
