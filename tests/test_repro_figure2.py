"""``lowbit repro moniqua-figure2``: files, falling curves, Moniqua on D2 on one-label-per-worker
data, and what the 20 Mbps asynchronous comparison gives by construction (bytes at the bit
ratio, communication priced from them, curve clocks)."""

import itertools
import math

import pytest

from lowbit.repro import EXPERIMENTS, figure2
from repro_quick import PNG, run_quick


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick("moniqua-figure2", tmp_path_factory)


def test_registered():
    assert EXPERIMENTS["moniqua-figure2"][0] == "figure2"


def test_quick_writes_table_json_and_pngs(quick):
    out, res = quick
    assert res["experiment"] == "moniqua-figure2" and res["quick"] is True
    assert [r["options"]["algorithm"] for r in res["d2"]] == ["dpsgd", "moniqua", "d2", "moniqua-d2"]
    assert [a["options"]["algorithm"] for a in res["async"]] == ["dpsgd", "adpsgd", "moniqua-async"]
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["figure2a_test_accuracy.png", "figure2a_train_loss.png", "figure2b_train_loss_vs_time.png"]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == PNG
    table = (out / "table.md").read_text()
    assert "split=label" in table and "20Mbit" in table and "no slow worker" in table
    for r in res["d2"] + res["async"]:
        assert r["label"] in table
    # the settings the module states are the ones that ran
    s = res["settings"]
    assert s["d2"]["workers"] == 10 and s["d2"]["split"] == "label" and s["d2"]["momentum"] == 0.0
    assert s["async"]["workers"] == 6 and s["async"]["bandwidth"] == "20Mbit" and s["async"]["latency"] == "0.15ms"


def test_every_curve_falls(quick):
    _, res = quick
    for r in res["d2"] + res["async"]:
        losses = r["train_loss"]
        assert len(losses) >= 4 and all(math.isfinite(v) for v in losses)
        # early training: every evaluation is below the one before, and a quarter is gone by the end
        assert all(b < a_ for a_, b in itertools.pairwise(losses)), r["label"]
        assert losses[-1] < 0.75 * losses[0], r["label"]
        assert r["final_train_loss"] == losses[-1]
    for r in res["d2"]:
        assert r["test_accuracy"][-1] > r["test_accuracy"][0] + 0.5


def test_moniqua_on_d2_beats_dpsgd_and_moniqua_on_label_split(quick):
    _, res = quick
    d2 = {r["options"]["algorithm"]: r for r in res["d2"]}
    # the paper's point: on one-label-per-worker data D2 (and Moniqua on it) keeps converging,
    # D-PSGD (and Moniqua on D-PSGD) are held back by the outer variance
    for other in ("dpsgd", "moniqua"):
        assert d2["moniqua-d2"]["final_train_loss"] < 0.5 * d2[other]["final_train_loss"]
        assert d2["moniqua-d2"]["final_test_accuracy"] > d2[other]["final_test_accuracy"]
        assert d2["moniqua-d2"]["final_local_test_accuracy"] > d2[other]["final_local_test_accuracy"] + 0.3
    # ... while sending 4-bit codes: about 1/8 of fp32 (plus headers, hashes and fp32 repairs)
    assert d2["d2"]["bytes_sent"] == d2["dpsgd"]["bytes_sent"]  # both one fp32 model per neighbour per step
    for q in ("moniqua", "moniqua-d2"):
        assert 4 / 32 < d2[q]["bytes_sent"] / d2["d2"]["bytes_sent"] < 0.2


def test_async_bytes_and_communication_by_construction(quick):
    _, res = quick
    a = {r["options"]["algorithm"]: r for r in res["async"]}
    s = res["settings"]["async"]
    bits, steps = s["bits"], s["steps"]
    # the same seeded partners and schedule: the same messages, each at bits/32 of fp32 (plus a header)
    assert a["moniqua-async"]["messages_sent"] == a["adpsgd"]["messages_sent"]
    ratio = a["moniqua-async"]["bytes_sent"] / a["adpsgd"]["bytes_sent"]
    assert bits / 32 <= ratio < bits / 32 * 1.01
    assert a["moniqua-async"]["nominal_bits_per_element"] == bits
    # the modelled network time, from the bytes by hand: 20 Mbit/s, 0.15 ms; D-PSGD one message
    # time per step (its two ring messages on parallel links), an asynchronous worker one round
    # trip per step (its request, then the reply on the link back), every message of one size
    bw, lat = 20e6, 0.15e-3
    for name, legs in (("dpsgd", 1), ("adpsgd", 2), ("moniqua-async", 2)):
        m = a[name]["bytes_sent"] / a[name]["messages_sent"]
        assert a[name]["network_seconds"] == pytest.approx(steps * legs * (lat + 8 * m / bw), rel=1e-9), name
    # on the clock: synchronous D-PSGD adds its communication to compute, an asynchronous worker
    # hides the part of its round trip that its compute covers (never more)
    d = a["dpsgd"]
    assert d["comm_seconds"] == pytest.approx(d["network_seconds"])
    for name in ("adpsgd", "moniqua-async"):
        r = a[name]
        assert 0 <= r["comm_seconds"] <= r["network_seconds"] * (1 + 1e-12)
        assert r["emulated_seconds"] >= r["network_seconds"] * (1 - 1e-12)
        assert r["emulated_seconds"] == pytest.approx(r["compute_seconds"] + r["comm_seconds"])
    # the deterministic part: async Moniqua spends less time on the network than both (the
    # measured compute is left out: this machine's load changes it; the full run's table has both)
    assert a["moniqua-async"]["network_seconds"] < 0.5 * a["adpsgd"]["network_seconds"]
    for other in ("dpsgd", "adpsgd"):
        assert a["moniqua-async"]["network_seconds"] < a[other]["network_seconds"]


def test_async_curves_are_runs_of_increasing_length(quick):
    _, res = quick
    s = res["settings"]["async"]
    for a in res["async"]:
        assert a["steps"] == list(range(0, s["steps"] + 1, s["eval_every"]))
        assert a["seconds"][0] == 0.0
        assert a["seconds"][-1] == pytest.approx(a["emulated_seconds"])
        assert a["emulated_seconds"] == pytest.approx(a["compute_seconds"] + a["comm_seconds"])
        assert all(y > x for x, y in itertools.pairwise(a["seconds"]))
    # every curve starts from the same model (same seed, same x_0)
    assert len({a["train_loss"][0] for a in res["async"]}) == 1
    target = res["async_target_loss"]
    assert target == max(a["final_train_loss"] for a in res["async"])
    for a in res["async"]:
        assert a["seconds_to_target"] is not None and 0 < a["seconds_to_target"] <= a["seconds"][-1]


def test_seconds_to_loss():
    assert figure2.seconds_to_loss([0.0, 1.0, 3.0], [2.0, 1.0, 0.5], 1.0) == 1.0
    assert figure2.seconds_to_loss([0.0, 1.0, 3.0], [2.0, 1.0, 0.5], 0.75) == pytest.approx(2.0)
    assert figure2.seconds_to_loss([0.0, 1.0], [2.0, 1.0], 0.1) is None
    assert figure2.seconds_to_loss([5.0], [1.0], 2.0) == 5.0
    # reaching the target exactly at a point gives that point's time
    assert figure2.seconds_to_loss([0.1, 0.7], [2.0, 0.3], 0.3) == 0.7
    with pytest.raises(ValueError, match="same length"):
        figure2.seconds_to_loss([0.0, 1.0], [1.0], 0.5)
    with pytest.raises(ValueError, match="non-decreasing"):
        figure2.seconds_to_loss([1.0, 0.0], [1.0, 0.5], 0.5)
    with pytest.raises(ValueError, match="target"):
        figure2.seconds_to_loss([0.0], [1.0], float("nan"))
