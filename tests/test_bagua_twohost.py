"""Bagua's hierarchical mode on two real hosts: two network namespaces joined by a
veth pair, torchrun with 2 workers per host, so LOCAL_WORLD_SIZE = 2 makes each host
a node (average inside the host, the ring of the two leaders across the veth,
broadcast back). It must match the thread runtime told node_size=2."""

import json
import warnings

import pytest

from lowbit.train.config import TrainConfig
from lowbit.train.run import train
from test_shaping import _two_hosts, needs_root

ARGS = ["train", "--backend", "torch", "--algorithm", "lowprec-decentralized", "--workers", "4", "--steps", "10",
        "--eval-every", "5", "--no-progress"]


@pytest.mark.slow
@needs_root
def test_hierarchical_on_two_hosts_matches_the_thread_run(tmp_path):
    out = tmp_path / "first"
    out.mkdir()
    trouble = _two_hosts(out, 29537, timeout_s=240, args=ARGS, nproc=2)
    if trouble is not None:  # the retry policy of test_shaping's two-host test
        warnings.warn(f"two-host torchrun did not finish, trying again: {trouble}")
        out = tmp_path / "second"
        out.mkdir()
        trouble = _two_hosts(out, 29538, timeout_s=400, args=ARGS, nproc=2)
        assert trouble is None, f"two-host torchrun did not finish twice; the second: {trouble}"
    s = json.loads((out / "h0" / "summary.json").read_text())
    assert s["config"]["workers"] == 4 and s["config"]["hierarchical"] is True
    ref = train(TrainConfig(algorithm="lowprec-decentralized", workers=4, node_size=2, steps=10, eval_every=5)).summary
    flat = train(TrainConfig(algorithm="lowprec-decentralized", workers=4, steps=10, eval_every=5)).summary
    assert s["bytes_sent"] == ref["bytes_sent"] != flat["bytes_sent"]
    assert s["final_train_loss"] == pytest.approx(ref["final_train_loss"], abs=1e-5)
