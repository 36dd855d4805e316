"""``lowbit bench race``: the target logic on synthetic curves, argument checks, and a tiny race on
real processes (shaped where this machine can shape: root, ip and tc)."""

import json
import os

import pytest

from lowbit.bench.race import METHODS, NETWORKS, RaceMethod, bench_race, format_race_report, time_to_target
from lowbit.cli import main
from lowbit.comm.shaping import shaping_unavailable_reason

SHAPING = shaping_unavailable_reason()
KEYS = ("seconds_to_target", "steps_to_target", "final_accuracy", "bytes_per_step", "step_seconds")


# --- the seconds/steps-to-target computation ---------------------------------------------------

def test_time_to_target_is_the_first_evaluation_at_or_above_the_target():
    curve = [(0, 0.0, 0.1), (10, 1.5, 0.6), (20, 3.0, 0.8), (30, 4.5, 0.7), (40, 6.0, 0.9)]
    assert time_to_target(curve, 0.8) == (3.0, 20)  # reached exactly: counts
    assert time_to_target(curve, 0.75) == (3.0, 20)
    assert time_to_target(curve, 0.85) == (6.0, 40)  # the dip at step 30 does not matter
    assert time_to_target(curve, 0.1) == (0.0, 0)
    assert time_to_target(curve, 0.95) == (None, None)  # never
    assert time_to_target([], 0.5) == (None, None)


def test_time_to_target_skips_points_without_accuracy_and_refuses_bad_input():
    # ranks other than 0 record no accuracy: only evaluated points count
    assert time_to_target([(0, 0.0, None), (5, 1.0, 0.99), (10, 2.0, None)], 0.9) == (1.0, 5)
    with pytest.raises(ValueError, match="step order"):
        time_to_target([(10, 1.0, 0.1), (5, 2.0, 0.2)], 0.9)
    for bad in (0, 1.5, -0.1, True, "0.9", float("nan")):
        with pytest.raises(ValueError, match="target"):
            time_to_target([(0, 0.0, 0.5)], bad)


# --- bad arguments are refused by name, before anything starts -------------------------------

@pytest.mark.parametrize("kw, name", [
    ({"workers": 1}, "workers"), ({"steps": 1}, "steps"), ({"eval_every": 0}, "eval_every"),
    ({"target": 1.5}, "target"), ({"target": 0}, "target"), ({"batch": 0}, "batch"), ({"lr": -0.1}, "lr"),
    ({"lr": float("inf")}, "lr"), ({"momentum": 1.0}, "momentum"), ({"networks": "10Gbit"}, "networks"),
    ({"networks": ""}, "networks"), ({"methods": "torch-ddp-fp16"}, "methods"), ({"task": "nope"}, "task"),
    ({"task": "quadratic"}, "task"), ({"backend": "mpi"}, "backend"), ({"seed": -1}, "seed"),
    ({"warmup": 60}, "warmup"), ({"eval_samples": 0}, "eval_samples"), ({"task_options": [1]}, "task_options"),
    ({"repeats": 0}, "repeats"), ({"repeats": 1.5}, "repeats"),
])
def test_bad_arguments_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        bench_race(quick=True, progress=None, **kw)


def test_cli_refuses_bad_arguments_with_a_named_error(capsys):
    assert main(["bench", "race", "--quick", "--workers", "1"]) != 0
    assert "workers" in capsys.readouterr().err
    assert main(["bench", "race", "--quick", "--networks", "5G"]) != 0
    assert "networks" in capsys.readouterr().err


def test_every_method_is_named_and_described():
    assert list(NETWORKS) == ["100Mbit", "1Gbit", "loopback"]
    assert set(METHODS) == {"torch-ddp-fp32", "torch-fp16", "torch-powersgd", "lowbit-qsgd-maxnorm-2",
                            "lowbit-qsgd-maxnorm-4", "lowbit-multiscale", "lowbit-fp16", "lowbit-powersgd",
                            "moniqua-2", "lowprec", "choco"}
    assert METHODS["torch-ddp-fp32"].kind == "torch" and METHODS["torch-ddp-fp32"].hook is None  # the anchor
    assert all(m.description for m in METHODS.values())


# --- a tiny race on real processes ------------------------------------------------------------

def _check_schema(report: dict, networks: list[str], methods: list[str]) -> None:
    assert list(report["networks"]) == networks
    for net in networks:
        rows = report["networks"][net]
        assert list(rows) == methods
        for m in methods:
            row = rows[m]
            assert all(k in row for k in KEYS), (net, m, sorted(row))
            assert not row.get("failed"), (net, m, row.get("failed"))
            assert row["bytes_per_step"] > 0
            assert row["step_seconds"] > 0
            assert 0 <= row["final_accuracy"] <= 1
            assert (row["seconds_to_target"] is None) == (row["steps_to_target"] is None)
            secs, steps = time_to_target([(p["step"], p["seconds"], p["accuracy"]) for p in row["curve"]],
                                         report["settings"]["target"])
            assert (row["seconds_to_target"], row["steps_to_target"]) == (secs, steps)
            split = row["compute_seconds"] + row["encode_decode_seconds"] + row["comm_wait_seconds"]
            assert split >= row["step_seconds"] * 0.999 and min(row["compute_seconds"], row["encode_decode_seconds"],
                                                                row["comm_wait_seconds"]) >= 0
        fp32 = rows["torch-ddp-fp32"]["bytes_per_step"]
        # one all-reduce of every fp32 gradient, counted as the ring does: 2 (n - 1) / n * 4 bytes each
        params = 64 * 4096 + 4096 + 4096 * 10 + 10
        assert fp32 == pytest.approx(2 * (2 - 1) / 2 * 4 * params)
        for m in methods:
            if m != "torch-ddp-fp32":
                assert rows[m]["bytes_per_step"] < fp32, (net, m)


def test_quick_race_reports_every_method_on_every_network(tmp_path):
    """2 workers (shaped at 100 Mbit/s where shaping is available), a digits MLP whose gradient
    fills two DDP buckets (torch's PowerSGD hook then issues collectives from its callbacks while
    the next bucket's start: the race runs it in order), a few steps."""
    methods = ["torch-ddp-fp32", "torch-powersgd", "lowbit-qsgd-maxnorm-2", "moniqua-2"]
    networks = ["loopback"] if SHAPING else ["100Mbit", "loopback"]
    report = bench_race(quick=True, networks=networks if SHAPING is None else None, methods=methods, steps=12,
                        eval_every=6, target=0.5, task_options={"hidden": 4096}, plot_dir=str(tmp_path),
                        progress=None)
    if SHAPING is not None:  # the shaped networks are skipped, and said so
        assert set(report["skipped_networks"]) == {"100Mbit", "1Gbit"}
        assert SHAPING in report["shaping"]
    _check_schema(report, networks, methods)
    assert report["settings"]["latency_ms"] == 0.0
    for net in networks:
        assert os.path.getsize(tmp_path / f"race-{net}.png") > 0
    text = format_race_report(report)
    for m in methods:
        assert text.count(m) >= len(networks)
    json.dumps(report)  # the --json file


def test_a_failing_method_is_reported_and_the_others_still_run(monkeypatch):
    monkeypatch.setitem(METHODS, "broken", RaceMethod("hook", "a hook that does not exist", hook="no-such-hook"))
    report = bench_race(quick=True, networks="loopback", methods="torch-ddp-fp32,broken,lowbit-fp16", steps=4,
                        eval_every=2, progress=None)
    rows = report["networks"]["loopback"]
    assert list(rows) == ["torch-ddp-fp32", "broken", "lowbit-fp16"]
    assert "no-such-hook" in rows["broken"]["failed"]
    assert all(rows["broken"][k] is None for k in KEYS)
    for m in ("torch-ddp-fp32", "lowbit-fp16"):
        assert rows[m]["bytes_per_step"] > 0 and not rows[m].get("failed")
    assert "FAILED" in format_race_report(report)


def test_the_median_run_counts_a_missed_target_as_the_slowest():
    from lowbit.bench.race import _median_run

    def row(t, step=0.1):
        return {"seconds_to_target": t, "step_seconds": step, "curve": [t]}

    assert _median_run([row(3.0)]) == row(3.0)  # one run: its row as it is
    got = _median_run([row(5.0, 0.5), row(None, 0.9), row(2.0, 0.2)])
    assert got["seconds_to_target"] == 5.0 and got["curve"] == [5.0] and got["step_seconds"] == 0.5
    assert got["repeats_seconds_to_target"] == [5.0, None, 2.0] and got["repeats_step_seconds"] == [0.5, 0.9, 0.2]
    failed = {"seconds_to_target": None, "step_seconds": None, "failed": "x"}
    assert _median_run([row(None), failed, failed]).get("failed") == "x"  # most runs failed: the median failed


def test_repeats_run_every_method_that_often_and_report_the_median_ratio():
    report = bench_race(quick=True, networks="loopback", methods="torch-ddp-fp32,lowbit-fp16", steps=12, eval_every=6,
                        target=0.3, repeats=2, progress=None)
    assert report["settings"]["repeats"] == 2
    rows = report["networks"]["loopback"]
    for m, r in rows.items():
        runs = r["repeats_seconds_to_target"]
        assert len(runs) == 2 and all(t > 0 for t in runs), (m, runs)
        assert r["seconds_to_target"] in runs and len(r["repeats_step_seconds"]) == 2
        ratios = [a / t for a, t in zip(rows["torch-ddp-fp32"]["repeats_seconds_to_target"], runs)]
        assert r["x_ddp_median"] == pytest.approx(sum(ratios) / 2)  # the median of two: their mean
    assert rows["torch-ddp-fp32"]["x_ddp_median"] == 1.0
    assert "runs' s to target" in format_race_report(report)
