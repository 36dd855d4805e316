"""``lowbit repro``: the registry, the two experiments that need no data, the command."""

import json
import math

import pytest
import torch

from lowbit.codecs.radix import level_bits
from lowbit.cli import main
from lowbit.repro import EXPERIMENTS, run_experiment
from lowbit.repro import throughput as tp

PNG = b"\x89PNG\r\n\x1a\n"


def _pngs(out):
    files = sorted(out.glob("*.png"))
    assert files, "no plot written"
    for f in files:
        assert f.read_bytes()[:8] == PNG
    return files


@pytest.fixture(scope="module")
def theorem1(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("theorem1")
    assert main(["repro", "moniqua-theorem1", "--out", str(out), "--quick"]) == 0
    return out


def test_theorem1_quick_writes_files_and_separates_naive_from_moniqua(theorem1):
    res = json.loads((theorem1 / "results.json").read_text())
    assert res["phi"] == pytest.approx(1 / 3)
    assert res["floor"] == pytest.approx((1 / 9) * 0.01 / (8 * (1 + 1 / 9)))  # 1.25e-4
    rows = {r["label"]: r for r in res["rows"]}
    naive = [r for k, r in rows.items() if k.startswith("naive")]
    moniqua = [r for k, r in rows.items() if k.startswith("moniqua")]
    assert len(naive) == 3 and len(moniqua) == 2
    for r in naive:
        assert r["final_grad_norm_sq"] > res["floor"], r["label"]
        assert not r["below_floor"]
    for r in moniqua:
        assert r["final_grad_norm_sq"] < res["floor"], r["label"]
        assert r["below_floor"]
    table = (theorem1 / "table.md").read_text()
    for r in res["rows"]:
        line = next(l for l in table.splitlines() if l.startswith(f"| {r['label']} |"))
        assert ("| no |" in line) == r["label"].startswith("naive")
    assert "1.25e-04" in table or "0.000125" in table
    _pngs(theorem1)


def test_throughput_cell_equals_hand_computation():
    # VGG-16, 2 bits, 1 Gbps: 32 nodes x 4 GPUs x 128 images per iteration.
    d, n, g = 14_728_266, 32, 4
    s = math.ceil(d * 2 / 8) + 4  # codes and the fp32 norm
    intra = 2 * (g - 1) * 10e-6 + 2 * (g - 1) / g * s * 8 / 200e9
    inter = 2 * (n - 1) * 50e-6 + 2 * (n - 1) / n * s * 8 / 1e9
    t = 0.035 + intra + inter
    vgg = next(m for m in tp.MODELS if m.name == "VGG-16")
    r = tp.iteration(vgg, 2, 1)
    assert r["message_bytes"] == s == 3_682_071
    assert r["iteration_seconds"] == pytest.approx(t, rel=1e-12)
    assert r["images_per_second"] == pytest.approx(n * g * 128 / t, rel=1e-12)
    fp32 = tp.iteration(vgg, None, 1)
    assert fp32["message_bytes"] == 4 * d
    assert fp32["images_per_second"] < r["images_per_second"]


def test_throughput_quick_writes_files_and_table(tmp_path):
    res = run_experiment("throughput-model", tmp_path, quick=True)
    assert len(res["rows"]) == 2 * 2 * 4  # models x bandwidths x (2, 4, 8 bits, fp32)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == res["rows"]
    table = (tmp_path / "table.md").read_text()
    assert "23520842" in table and "14728266" in table and "compute per iteration" in table
    for r in res["rows"]:
        if r["bits"] is None:
            assert r["speedup_vs_fp32"] == 1.0
        else:  # fewer bits, faster, and more so on the slower network
            assert r["speedup_vs_fp32"] > 1.0
    by = {(r["model"], r["ethernet_gbps"], r["bits"]): r["speedup_vs_fp32"] for r in res["rows"]}
    assert by[("VGG-16", 1, 2)] > by[("VGG-16", 10, 2)] and by[("ResNet-50", 1, 2)] > by[("ResNet-50", 1, 8)]
    assert {f.name for f in _pngs(tmp_path)} == {"throughput_resnet50.png", "throughput_vgg16.png"}


def test_throughput_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        tp.message_bytes(10, 0)
    with pytest.raises(ValueError, match="ethernet_gbps"):
        tp.iteration(tp.MODELS[0], 2, 0)


def test_unknown_name_exits_2_naming_the_known_ones(tmp_path, capsys):
    assert main(["repro", "no-such-experiment", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    for name in EXPERIMENTS:
        assert name in err
    assert not any(tmp_path.iterdir())


def test_maxnorm_quick_writes_curves_and_both_bit_counts(tmp_path):
    res = run_experiment("maxnorm", tmp_path, quick=True)
    rows = {r["label"]: r for r in res["rows"]}
    assert len(rows) == 10 and json.loads((tmp_path / "results.json").read_text())["rows"][0]["label"] == (
        "AllReduce SGD (fp32)")
    for b in (8, 4, 2):  # 2^(b+1) - 1 levels at log2, sign included: b + 1 from b = 4 on, 2.83 at b = 2
        assert rows[f"QSGD-MN {b} bits"]["nominal_bits_per_element"] == pytest.approx(level_bits(2 ** (b + 1) - 1))
    # two scales: the paper's r = ceil(log2 3) + 1 + ceil(log2 2) = 4 bits per coordinate
    assert rows["QSGD-MN-TS (2, 6) bits"]["nominal_bits_per_element"] == 4
    # integer codes travel in int8 at least; two scales need int16 codes and the scale-index round
    assert rows["QSGD-MN 2 bits"]["wire_bits_per_element"] == rows["QSGD-MN 4 bits"]["wire_bits_per_element"]
    assert rows["QSGD-MN-TS (2, 6) bits"]["wire_bits_per_element"] > rows["QSGD-MN 2 bits"]["wire_bits_per_element"]
    assert rows["PowerSGD rank 1"]["wire_bits_per_element"] < rows["PowerSGD rank 2"]["wire_bits_per_element"]
    assert all(len(r["train_loss"]) == len(r["steps"]) > 1 for r in rows.values())
    assert "| QSGD-MN-TS (8, 12) bits |" in (tmp_path / "table.md").read_text()
    assert {f.name for f in _pngs(tmp_path)} == {"train_loss.png", "test_accuracy.png"}
