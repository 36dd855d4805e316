"""``lowbit repro moniqua-figure1``: files, time ordering, and re-pricing a ledger
under another network equals training under that network."""

import dataclasses
import math

import pytest
import torch

from lowbit.repro import EXPERIMENTS
from lowbit.repro import figure1
from lowbit.train import train
from lowbit.train.config import TrainConfig
from repro_quick import PNG, run_quick


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick("moniqua-figure1", tmp_path_factory)


def test_registered():
    assert EXPERIMENTS["moniqua-figure1"][0] == "figure1"


def test_quick_writes_table_json_and_one_png_per_network(quick):
    out, res = quick
    assert res["experiment"] == "moniqua-figure1" and res["quick"] is True
    assert [n["label"] for n in res["networks"]] == [n for n, _, _ in figure1.NETWORKS]
    labels = [a["label"] for a in res["algorithms"]]
    assert len(labels) == 7
    assert {a["options"]["algorithm"] for a in res["algorithms"]} == {
        "allreduce", "dpsgd", "dcd", "ecd", "choco", "deepsqueeze", "moniqua"}
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 4
    for f in pngs:
        assert f.read_bytes()[:8] == PNG
    table = (out / "table.md").read_text()
    assert "digits-mlp" in table
    for label in labels:
        assert label in table
    for n, _, _ in figure1.NETWORKS:
        assert n in table
    for a in res["algorithms"]:
        assert math.isfinite(a["final_train_loss"]) and a["final_train_loss"] < a["train_loss"][0]
        for n in a["networks"].values():
            # the curve's x ends at the total, and the total is compute + communication
            assert n["seconds_at_eval"][-1] == pytest.approx(n["emulated_seconds"])
            assert n["emulated_seconds"] == pytest.approx(n["compute_seconds"] + n["comm_seconds"])
            assert all(b >= a_ for a_, b in zip(n["seconds_at_eval"], n["seconds_at_eval"][1:]))


def test_time_ordering(quick):
    _, res = quick
    algos = {a["options"]["algorithm"]: a for a in res["algorithms"]}
    slow = "1 Mbps, 1 ms"
    # communication-bound: fp32 takes longer than 8-bit Moniqua
    for fp32 in ("allreduce", "dpsgd"):
        assert algos[fp32]["networks"][slow]["emulated_seconds"] > algos["moniqua"]["networks"][slow]["emulated_seconds"]
        assert algos[fp32]["bytes_sent"] > 2.5 * algos["moniqua"]["bytes_sent"]
    # the same run is slower on a slower network: bandwidth then latency
    nets = [n for n, _, _ in figure1.NETWORKS]
    for a in algos.values():
        comm = [a["networks"][n]["comm_seconds"] for n in nets]
        assert comm[0] < comm[1] < comm[2] < comm[3]
        # compute is measured once per run, the same under every network
        assert len({a["networks"][n]["compute_seconds"] for n in nets}) == 1


def test_repricing_equals_training_under_that_network():
    torch.set_num_threads(1)
    base = dict(task="digits-mlp", algorithm="moniqua", bits=8, workers=4, steps=6, eval_every=3, seed=0)
    _, bw_a, lat_a = figure1.NETWORKS[0]
    _, bw_b, lat_b = figure1.NETWORKS[3]
    cfg_a = TrainConfig(**base, bandwidth=bw_a, latency=lat_a)
    cfg_b = TrainConfig(**base, bandwidth=bw_b, latency=lat_b)
    run_a, run_b = train(cfg_a), train(cfg_b)
    assert run_a.summary["bytes_sent"] == run_b.summary["bytes_sent"]
    # run A's ledger priced under network B: the same communication seconds as training under B
    p = figure1.priced(cfg_a, run_a.workers, bw_b, lat_b)
    assert p["comm_seconds"] == pytest.approx(run_b.summary["emulated_comm_seconds"], rel=1e-12)
    assert p["comm_seconds"] > 10 * run_a.summary["emulated_comm_seconds"]  # a different network indeed
    # compute is measured (thread CPU time) and differs between two runs; pricing run B's own
    # workers under its own network gives exactly the emulated seconds that training reported
    own = figure1.priced(cfg_b, run_b.workers, bw_b, lat_b)
    assert own["emulated_seconds"] == pytest.approx(run_b.summary["emulated_seconds"], rel=1e-12)
    assert own["comm_seconds"] == pytest.approx(run_b.summary["emulated_comm_seconds"], rel=1e-12)
    # per-eval clock of the re-priced run equals lowbit train's metrics rows for network B
    from lowbit.train.run import metrics_rows

    rows = metrics_rows(dataclasses.replace(cfg_a, bandwidth=bw_b, latency=lat_b), run_a.workers)
    step_total = [a + b for a, b in zip(p["compute"], p["comm"])]
    assert [r["emulated_seconds"] for r in rows] == pytest.approx(
        [math.fsum(step_total[: r["step"]]) for r in rows], rel=1e-12)
