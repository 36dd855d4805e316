"""``lowbit repro moniqua-table2``: every configuration present, mean/std computed from
the per-seed numbers, divergence flags following their rule, extra memory exactly
(degree + 1) d / degree d / d / 0 floats, seeds that really differ, the table's rows."""

import math
import statistics

import pytest
import torch

from lowbit.repro import EXPERIMENTS, table2
from lowbit.train import train
from lowbit.train.config import TrainConfig
from repro_quick import PNG, run_quick


QUANTIZED = ("dcd", "ecd", "choco", "deepsqueeze", "moniqua")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick("moniqua-table2", tmp_path_factory)


def _rows(res):
    return {r["key"]: r for r in res["rows"]}


@pytest.mark.parametrize("gpu,task", [(False, "fashion-lenet"), (True, "cifar10-resnet20")])
def test_registered_and_full_scale(monkeypatch, gpu, task):
    """Full mode trains LeNet-5 on Fashion-MNIST, or the paper's ResNet-20 on CIFAR-10
    where a GPU and the data are present."""
    assert EXPERIMENTS["moniqua-table2"][0] == "table2"
    monkeypatch.setattr(table2, "_cifar_on_gpu", lambda: gpu)
    full = table2.settings(quick=False)
    assert (full["task"], full["workers"], full["topology"]) == (task, 8, "ring")
    assert len(full["seeds"]) == 3 and len(set(full["seeds"])) == 3
    assert len(table2.CONFIGS) == 12  # 5 algorithms x {1, 2} bits + 2 fp32 references
    common = {k: v for k, v in full.items() if k != "seeds"}
    for _, _, opts, _ in table2.CONFIGS:  # every full-mode run config is valid (1 bit included)
        TrainConfig(**common, **opts, seed=full["seeds"][-1], device="cpu")


def test_cifar_needs_a_gpu_and_the_data(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not table2._cifar_on_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(table2, "find_dataset_dir", lambda name: (_ for _ in ()).throw(FileNotFoundError(name)))
    assert not table2._cifar_on_gpu()
    monkeypatch.setattr(table2, "find_dataset_dir", lambda name: str(tmp_path))
    assert table2._cifar_on_gpu()


def test_every_configuration_present(quick):
    out, res = quick
    assert res["experiment"] == "moniqua-table2" and res["quick"] is True
    rows = _rows(res)
    expected = {"allreduce", "dpsgd"} | {f"{a}-{b}bit" for a in QUANTIZED for b in (1, 2)}
    assert set(rows) == expected
    seeds = res["settings"]["seeds"]
    assert len(seeds) >= 2
    for key, r in rows.items():
        assert "not_runnable" not in r, (key, r.get("not_runnable"))  # all accept 1 bit today
        assert [p["seed"] for p in r["seeds"]] == seeds
        if r["bits"] is not None:
            assert r["options"] == table2.budget_options(key.split("-")[0], r["bits"])
            for p in r["seeds"]:
                if p["stopped"] is None:
                    assert p["nominal_bits_per_element"] == r["bits"]
    assert (out / "accuracy_vs_bits.png").read_bytes()[:8] == PNG


def test_mean_std_and_divergence_from_per_seed_numbers(quick):
    _, res = quick
    for r in res["rows"]:
        accs = [p["final_test_accuracy"] for p in r["seeds"] if p["final_test_accuracy"] is not None]
        agg = r["aggregate"]
        assert agg["accuracy_mean"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)
        mean = sum(accs) / len(accs)
        std = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1))
        assert agg["accuracy_std"] == pytest.approx(std, abs=1e-12)
        for p in r["seeds"]:
            if p["stopped"] is None:
                assert p["initial_train_loss"] == p["train_loss"][0]
                assert p["final_train_loss"] == p["train_loss"][-1]
                blew_up = not math.isfinite(p["final_train_loss"]) or p["final_train_loss"] > p["initial_train_loss"]
                assert p["diverged"] is blew_up
            else:
                assert p["diverged"] is True and p["final_test_accuracy"] is None
        assert agg["diverged_seeds"] == sum(p["diverged"] for p in r["seeds"])
    rows = _rows(res)
    # fp32 references learn, and so does Moniqua at 1 bit (the paper's claim); every run starts untrained
    for key in ("allreduce", "dpsgd", "moniqua-1bit", "moniqua-2bit"):
        assert rows[key]["aggregate"]["diverged_seeds"] == 0
        assert rows[key]["aggregate"]["accuracy_mean"] > 0.7
    assert all(p["test_accuracy"][0] < 0.3 for r in res["rows"] for p in r["seeds"] if p["stopped"] is None)


def test_extra_memory_exact_and_ordered(quick):
    _, res = quick
    d, mb = res["parameters"], res["mb_bytes"]
    assert d == 9610 and mb == 10 ** 6  # digits-mlp: 64*128 + 128 + 128*10 + 10
    rows = _rows(res)
    degree = 2  # ring
    floats = {"moniqua": 0, "deepsqueeze": d, "dcd": degree * d, "ecd": (degree + 1) * d,
              "choco": 2 * d, "allreduce": 0, "dpsgd": 0}  # CHOCO: x_hat and the consensus term
    for key, r in rows.items():
        alg = r["options"]["algorithm"]
        assert r["aggregate"]["extra_memory_bytes"] == 4 * floats[alg], key
        assert r["aggregate"]["extra_memory_mb"] == pytest.approx(4 * floats[alg] / mb, rel=1e-12)
    for b in (1, 2):
        m = {a: rows[f"{a}-{b}bit"]["aggregate"]["extra_memory_mb"] for a in QUANTIZED}
        assert 0 == m["moniqua"] < m["deepsqueeze"] < m["dcd"] == m["choco"] < m["ecd"]
    # the paper's (Table 2, ResNet-20): Moniqua 0 < DeepSqueeze < DCD = ECD = Choco; on a ring CHOCO's 2 x d is
    # the paper's "twice DeepSqueeze"
    paper = table2.PAPER["ResNet-20"]["extra_memory_mb"]
    assert 0 == paper["moniqua"] < paper["deepsqueeze"] < paper["dcd"] == paper["ecd"] == paper["choco"]


def test_seeds_really_differ(quick):
    _, res = quick
    for r in res["rows"]:
        done = [p for p in r["seeds"] if p["stopped"] is None]
        losses = [p["final_train_loss"] for p in done]
        assert len(set(losses)) == len(losses), r["key"]
        # and the models differ from the start: step-0 loss of different initialisations
        assert len({p["initial_train_loss"] for p in done}) == len(done), r["key"]


def test_table_rows(quick):
    out, res = quick
    table = (out / "table.md").read_text()
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert lines[0].startswith("| algorithm | options | test accuracy (mean ± std) |")
    body = {ln.split(" | ")[0][2:]: ln for ln in lines[1:]}
    assert len(body) == 12
    for r in res["rows"]:
        line = body[r["label"]]
        agg = r["aggregate"]
        assert f"{100 * agg['accuracy_mean']:.2f} ± {100 * agg['accuracy_std']:.2f} %" in line
        k = agg["diverged_seeds"]
        assert (f"diverged {k}/{len(r['seeds'])}" in line) == (k > 0)
    assert body["Moniqua 1 bit"].split(" | ")[5] == "0"
    assert body["ChocoSGD 1 bit"].split(" | ")[1] == "codec=sign"
    assert "digits-mlp" in table and "diverge" in body["DCD-PSGD 2 bit"]  # the paper's column


def test_aggregate_and_divergence_rule():
    assert table2.is_diverged(2.3, float("nan")) and table2.is_diverged(2.3, float("inf"))
    assert table2.is_diverged(2.3, 2.5) and not table2.is_diverged(2.3, 1.0)
    seeds = [{"final_test_accuracy": 0.8, "diverged": False, "extra_memory_bytes": 12},
             {"final_test_accuracy": 0.6, "diverged": False, "extra_memory_bytes": 12},
             {"final_test_accuracy": None, "diverged": True, "stopped": "training stopped"}]
    a = table2.aggregate(seeds)
    assert a["accuracy_mean"] == pytest.approx(0.7) and a["accuracy_std"] == pytest.approx(statistics.stdev([0.8, 0.6]))
    assert a["diverged_seeds"] == 1 and a["seeds_with_accuracy"] == 2 and a["extra_memory_bytes"] == 12
    with pytest.raises(ValueError, match="extra memory differs"):
        table2.aggregate([{"final_test_accuracy": 0.5, "diverged": False, "extra_memory_bytes": n} for n in (1, 2)])


def test_blowup_is_reported_not_raised():
    torch.set_num_threads(1)
    # a step size far too large: the model leaves the float range and the min-max codec refuses it
    cfg = TrainConfig(task="digits-mlp", algorithm="deepsqueeze", bits=1, workers=2, steps=40, eval_every=40,
                      lr=1e4, seed=0)
    p = table2.run_seed(cfg)
    assert p["diverged"] is True and p["final_test_accuracy"] is None
    assert p["stopped"].startswith("training stopped: ") and "finite" in p["stopped"]
    assert p["extra_memory_bytes"] == 4 * 9610  # DeepSqueeze's error memory, measured without the summary


def test_probe_equals_the_training_summary():
    torch.set_num_threads(1)
    for alg in QUANTIZED:
        cfg = TrainConfig(task="digits-mlp", algorithm=alg, bits=2, workers=4, steps=2, eval_every=2, seed=0)
        assert table2.probe_extra_memory(cfg) == train(cfg).summary["extra_memory_bytes"], alg


def test_full_mode_names_how_to_get_fashion_mnist(monkeypatch, tmp_path):
    def missing(name, data_dir=None):
        raise FileNotFoundError(f"no local copy of {name}")

    monkeypatch.setattr(table2, "find_dataset_dir", missing)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        table2.run(tmp_path, quick=False)
    table2.check_data("digits-mlp")  # quick needs no files
