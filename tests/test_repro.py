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
    t = 0.035 + 0.002 + intra + inter
    vgg = tp.Model("VGG-16", d, 0.035, {2: 0.002, None: 0.0}, {2: 10_000_000, None: 4 * d})
    r = tp.iteration(vgg, 2, 1)
    assert r["message_bytes"] == s == 3_682_071
    assert r["iteration_seconds"] == pytest.approx(t, rel=1e-12)
    assert r["images_per_second"] == pytest.approx(n * g * 128 / t, rel=1e-12)
    fp32 = tp.iteration(vgg, None, 1)
    assert fp32["message_bytes"] == 4 * d
    assert fp32["images_per_second"] < r["images_per_second"]
    w = tp.iteration(vgg, 2, 1, wire=True)  # what lowbit sends instead of the nominal size
    assert w["message_bytes"] == 10_000_000 and w["images_per_second"] < r["images_per_second"]


def _hand_models():
    return tuple(tp.Model(name, d, c, {2: 0.001, 4: 0.001, 8: 0.001, None: 0.0},
                          {2: d, 4: 2 * d, 8: 3 * d, None: 4 * d}) for name, d, c in
                 (("ResNet-50", 23_520_842, 0.111), ("VGG-16", 14_728_266, 0.035)))


def test_throughput_table_and_speedups(tmp_path):
    res = tp.run(tmp_path, models=_hand_models())
    assert len(res["rows"]) == 2 * 2 * 2 * 4  # models x bandwidths x (nominal, wire) x (2, 4, 8 bits, fp32)
    for r in res["rows"]:
        if r["bits"] is None:
            assert r["speedup_vs_fp32"] == 1.0
        else:  # fewer bytes, faster, and more so on the slower network
            assert r["speedup_vs_fp32"] > 1.0
    by = {(r["model"], r["ethernet_gbps"], r["bits"], r["wire"]): r["speedup_vs_fp32"] for r in res["rows"]}
    assert by[("VGG-16", 1, 2, False)] > by[("VGG-16", 10, 2, False)]
    assert by[("ResNet-50", 1, 2, False)] > by[("ResNet-50", 1, 8, False)]
    assert by[("VGG-16", 1, 2, False)] > by[("VGG-16", 1, 2, True)]  # the wire holds more than b bits


@pytest.mark.slow  # measures ResNet-50 and VGG-16 on the CPU: tens of seconds idle, minutes loaded
def test_throughput_quick_measures_and_writes_files(tmp_path):
    res = run_experiment("throughput-model", tmp_path, quick=True)
    assert len(res["rows"]) == 2 * 2 * 2 * 4
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == res["rows"]
    table = (tmp_path / "table.md").read_text()
    assert "23520842" in table and "14728266" in table and "compute per iteration" in table
    assert "measured by lowbit plan" in table
    for m in res["inputs"]["models"]:
        assert m["compute_seconds"] > 0 and all(v > 0 for v in m["encode_seconds"].values())
        d = m["parameters"]
        # 128 workers' sum of 2-bit codes (in [-1, 1]) takes at least log2(257) bits per element
        assert m["wire_bytes"]["2"] >= d * math.log2(2 * 128 + 1) / 8
        assert m["wire_bytes"]["None"] == 4 * d
    assert {f.name for f in _pngs(tmp_path)} == {"throughput_resnet50.png", "throughput_vgg16.png"}


def test_throughput_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        tp.message_bytes(10, 0)
    m = _hand_models()[0]
    with pytest.raises(ValueError, match="ethernet_gbps"):
        tp.iteration(m, 2, 0)
    with pytest.raises(ValueError, match="wire"):
        tp.iteration(tp.Model("x", 10, 1.0), 2, 1, wire=True)


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
    # integer code sums travel in summable lanes of log2(2 M s + 1) bits: fewer bits, fewer bytes;
    # two scales add the scale-index round
    wire = [rows[f"QSGD-MN {b} bits"]["wire_bits_per_element"] for b in (2, 4, 8)]
    assert wire[0] < wire[1] < wire[2]
    assert rows["QSGD-MN-TS (2, 6) bits"]["wire_bits_per_element"] > rows["QSGD-MN 2 bits"]["wire_bits_per_element"]
    assert rows["PowerSGD rank 1"]["wire_bits_per_element"] < rows["PowerSGD rank 2"]["wire_bits_per_element"]
    assert all(len(r["train_loss"]) == len(r["steps"]) > 1 for r in rows.values())
    assert "| QSGD-MN-TS (8, 12) bits |" in (tmp_path / "table.md").read_text()
    assert {f.name for f in _pngs(tmp_path)} == {"train_loss.png", "test_accuracy.png"}
