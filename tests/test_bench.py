"""``lowbit bench``: what it reports (structure, ratios computed right from given timings,
options validated with clear errors) and the reference codecs it compares against.
Nothing here asserts a speed: timings are for the benchmark itself."""

import json
import math

import pytest
import torch

from lowbit.bench import (bench_codecs, bench_references, codec_row, default_cases, median_ratio, pair_row,
                          reference_pairs, select, spread)
from lowbit.bench import references as refs
from lowbit.bench.step import (BASELINES, StepCase, bench_step, default_step_cases, select_steps, step_config,
                               step_end_times, step_seconds)
from lowbit.cli import main
from lowbit.codecs import ModuloCodec, shared_generator
from lowbit.train import TrainConfig

FAST = 1e-3  # min_run_time: a structural run, not a measurement


# --- ratios from given timings ------------------------------------------------------------

def _ratio_of_medians(rounds):
    import statistics

    return statistics.median(r["a"] for r in rounds) / statistics.median(r["b"] for r in rounds)


def test_median_of_per_round_ratios_not_ratio_of_medians():
    lopsided = [{"a": 10.0, "b": 1.0}, {"a": 10.0, "b": 5.0}, {"a": 1.0, "b": 1.0}]
    assert median_ratio(lopsided, "a", "b") == 2.0  # per-round ratios 10, 2, 1
    assert _ratio_of_medians(lopsided) == 10.0  # what unpaired medians would report
    assert spread(lopsided, "a", "b") == (1.0, 10.0)


def test_median_ratio_sums_several_numerators():
    rounds = [{"e": 1.0, "d": 3.0, "m": 2.0}, {"e": 2.0, "d": 2.0, "m": 1.0}]
    assert median_ratio(rounds, ("e", "d"), "m") == pytest.approx((2.0 + 4.0) / 2)


@pytest.mark.parametrize("rounds,match", [([], "at least one round"),
                                          ([{"a": 1.0}], "no timing 'b'"),
                                          ([{"a": 1.0, "b": 0.0}], "timing 'b' must be a finite number"),
                                          ([{"a": math.nan, "b": 1.0}], "timing 'a' must be a finite number")])
def test_median_ratio_rejects_bad_timings(rounds, match):
    with pytest.raises(ValueError, match=match):
        median_ratio(rounds, "a", "b")


def test_codec_row_from_given_timings():
    rounds = [{"memcpy": 1e-4, "encode": 1e-3, "decode": 5e-4},
              {"memcpy": 2e-4, "encode": 1e-3, "decode": 2e-4},
              {"memcpy": 1e-4, "encode": 3e-3, "decode": 1e-4}]
    row = codec_row("x", rounds, size=1000, nbytes=250)
    assert row["encode_x_memcpy"] == pytest.approx(10.0)  # ratios 10, 5, 30
    assert row["decode_x_memcpy"] == pytest.approx(1.0)  # ratios 5, 1, 1
    assert row["roundtrip_x_memcpy"] == pytest.approx(15.0)  # ratios 15, 6, 31
    assert row["roundtrip_x_memcpy_range"] == pytest.approx((6.0, 31.0))
    assert row["encode_gbps"] == pytest.approx(4000 / 1e9 / 1e-3)  # median encode 1 ms
    assert row["memcpy_gbps"] == pytest.approx(4000 / 1e9 / 1e-4)
    assert row["bytes_per_element"] == 0.25 and row["rounds"] == rounds


def test_pair_row_from_given_timings():
    rounds = [{"memcpy": 1.0, "lowbit": 4.0, "reference": 2.0}, {"memcpy": 1.0, "lowbit": 3.0, "reference": 6.0},
              {"memcpy": 2.0, "lowbit": 2.0, "reference": 4.0}]
    row = pair_row("q", "ref", rounds, size=100, lowbit_nbytes=30, reference_nbytes=104)
    assert row["lowbit_x_reference"] == pytest.approx(0.5)  # ratios 2, 0.5, 0.5
    assert row["lowbit_x_reference_range"] == pytest.approx((0.5, 2.0))
    assert row["lowbit_x_memcpy"] == pytest.approx(3.0) and row["reference_x_memcpy"] == pytest.approx(2.0)
    assert (row["lowbit_bytes_per_element"], row["reference_bytes_per_element"]) == (0.3, 1.04)


# --- the codec bench ------------------------------------------------------------------------

def test_codec_bench_reports_every_selected_case_with_real_sizes():
    threads = torch.get_num_threads()
    size = 4096
    report = bench_codecs(size=size, rounds=2, codecs="fp16,sign,qsgd", min_run_time=FAST)
    assert torch.get_num_threads() == threads  # the pin is undone
    assert (report["threads"], report["rounds"], report["size"], report["device"]) == (1, 2, size, "cpu")
    assert "dst.copy_(src)" in report["memcpy"]
    labels = [c.label for c in default_cases() if c.family in ("fp16", "sign", "qsgd")]
    assert [r["codec"] for r in report["rows"]] == labels
    for r in report["rows"]:
        assert len(r["rounds"]) == 2 and all(t > 0 for rd in r["rounds"] for t in rd.values())
        assert r["roundtrip_x_memcpy"] == pytest.approx(median_ratio(r["rounds"], ("encode", "decode"), "memcpy"))
    by = {r["codec"]: r for r in report["rows"]}
    assert 2.0 < by["fp16"]["bytes_per_element"] < 2.0 + 64 / size  # 2 bytes plus the header
    assert 1 / 8 <= by["sign"]["bytes_per_element"] < 1 / 8 + 64 / size


def test_codec_bench_every_default_case_runs():
    report = bench_codecs(size=2048, rounds=1, min_run_time=FAST)
    assert [r["codec"] for r in report["rows"]] == [c.label for c in default_cases()]
    assert report["clock"] == "cpu"  # auto on the CPU: the thread's CPU time


def test_clocks():
    from lowbit.bench.timing import clock_for, resolve_clock

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [resolve_clock(c, d) for c, d in (("auto", cpu), ("auto", cuda), ("wall", cpu))] == ["cpu", "wall", "wall"]
    with pytest.raises(ValueError, match="clock='cpu' times the calling thread's CPU work; on CUDA use"):
        resolve_clock("cpu", cuda)
    import time

    assert clock_for(cpu) is time.thread_time
    report = bench_codecs(size=1024, rounds=1, codecs="fp32", min_run_time=FAST, clock="wall")
    assert report["clock"] == "wall"


def test_select_by_family_or_label_and_rejects_unknown():
    cases = default_cases()
    assert [c.label for c in select(cases, "qsgd-maxnorm b=4,sign")] == ["qsgd-maxnorm b=4", "sign", "sign rms", "sign none"]
    assert [c.label for c in select(cases, "qsgd-maxnorm b=4,sign rms")] == ["qsgd-maxnorm b=4", "sign rms"]
    assert all(c.family == "qsgd" for c in select(cases, ["qsgd"]))  # not qsgd-maxnorm
    with pytest.raises(ValueError, match="unknown 'nope'; choose from: .*qsgd"):
        select(cases, "sign,nope")
    with pytest.raises(ValueError, match="at least one codec"):
        select(cases, " , ")


def test_reference_bench_pairs_and_wire_sizes():
    size = 4096
    report = bench_references(size=size, rounds=2, min_run_time=FAST)
    assert report["against"] == "references" and report["threads"] == 1
    by = {r["codec"]: r for r in report["rows"]}
    assert list(by) == [p.label for p in reference_pairs(size)]
    for r in report["rows"]:
        assert r["lowbit_x_reference"] == pytest.approx(median_ratio(r["rounds"], "lowbit", "reference"))
    # the references send unpacked bytes: int8 codes + a float32 scale, bools, halves
    assert by["qsgd s=127"]["reference_bytes"] == size + 4
    assert by["sign (unscaled)"]["reference_bytes"] == size
    assert by["fp16"]["reference_bytes"] == 2 * size
    assert by["modulo b=2"]["reference_bytes"] == size
    # lowbit packs: 2 bits per Moniqua code, 1 per sign
    assert by["modulo b=2"]["lowbit_bytes"] < size / 4 + 64
    assert by["sign (unscaled)"]["lowbit_bytes"] < size / 8 + 64
    assert by["powersgd r=2"]["lowbit_bytes"] == by["powersgd r=2"]["reference_bytes"]  # P and Q as float32 both
    # global random-k: the k = 40 kept values' 8-bit codes, W and d, neither sends the indices
    assert by["randk 1% qsgd-maxnorm b=8"]["reference_bytes"] == size // 100 + 8
    assert by["randk 1% qsgd-maxnorm b=8"]["lowbit_bytes"] < size // 100 + 64


# --- the reference codecs compute what they claim ------------------------------------------

def _x(n=20_000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("ref", [refs.QSGDReference(7), refs.QSGDMaxNormReference(4)])
def test_qsgd_style_references_unbiased_and_bounded(ref):
    x = _x(2000)
    s = ref.levels
    wire = ref.encode(x, generator=shared_generator(0, 0, 0))
    codes, norm = wire
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= s
    assert float(norm) == pytest.approx(float(x.norm()))
    assert float((ref.decode(wire) - x).abs().max()) <= float(norm) / s * (1 + 1e-5)
    mean = torch.stack([ref.decode(ref.encode(x, generator=shared_generator(0, k, 0))) for k in range(400)]).mean(0)
    # per element std of the mean <= (norm / s / 2) / sqrt(400)
    assert float((mean - x).abs().max()) < 6 * float(norm) / s / 2 / 20


def test_global_randk_reference_keeps_the_shared_permutations_k_coordinates():
    x = _x(5000)
    ref = refs.GlobalRandKMaxNormReference(8, 50, seed=3)
    codes, W, d = ref.encode(x, generator=shared_generator(0, 0, 0))
    kept = torch.randperm(5000, generator=torch.Generator().manual_seed(3))[:50]
    assert codes.dtype == torch.int8 and codes.numel() == 50 and int(d) == 5000
    assert float(W) == pytest.approx(float(x[kept].norm()))
    y = ref.decode((codes, W, d))
    assert torch.equal(y.nonzero().view(-1), kept.sort().values[(codes[kept.argsort()] != 0)])
    assert float((y[kept] / 100 - x[kept]).abs().max()) <= float(W) / 127 * (1 + 1e-5)  # d / k = 100
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        refs.GlobalRandKMaxNormReference(8, 0)


def test_terngrad_reference_clips_and_is_ternary():
    x = _x()
    x[0] = 10.0  # an outlier beyond 2.5 sigma is clipped
    codes, scale = refs.TernGradReference().encode(x, generator=shared_generator(0, 0, 0))
    assert codes.dtype == torch.int8 and set(codes.unique().tolist()) <= {-1, 0, 1}
    sigma = float(((x - x.mean()) ** 2).mean().sqrt())
    assert float(scale) == pytest.approx(2.5 * sigma)
    assert torch.equal(refs.TernGradReference().decode((codes, scale)), codes.float() * scale)


def test_sign_and_half_references():
    x = _x(1000)
    (b,) = refs.SignSGDReference().encode(x)
    assert b.dtype == torch.bool
    assert torch.equal(refs.SignSGDReference().decode((b,)), torch.where(x >= 0, 1.0, -1.0))
    assert torch.equal(refs.HalfReference().decode(refs.HalfReference().encode(x)), x.half().float())


def test_moniqua_reference_meets_lemma2_bound():
    x = _x()
    y = x + (torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) - 0.5) * 0.1  # |x - y| < 0.05
    theta = 0.06
    ref = refs.MoniquaReference(2, theta)
    (codes,) = ref.encode(x, generator=shared_generator(0, 0, 0))
    assert codes.dtype == torch.uint8 and int(codes.max()) < 4
    bound = ModuloCodec(bits=2, theta=theta).error_bound
    assert float((ref.decode((codes,), ref=y) - x).abs().max()) <= bound * (1 + 1e-4)
    with pytest.raises(ValueError, match="needs ref"):
        ref.decode((codes,))


def test_powersgd_reference_projects_with_torch_helper_and_warm_starts():
    from lowbit.codecs.powersgd import matrix_shape

    x = _x(1000)
    ref = refs.PowerSGDReference(2)
    P, Q, N = ref.encode(x, generator=shared_generator(0, 0, 0))
    n, m = matrix_shape(1000)
    assert P.shape == (n, 2) and Q.shape == (m, 2) and int(N[0]) == 1000
    assert torch.allclose(P.t() @ P, torch.eye(2), atol=1e-5)  # orthonormal columns
    M = torch.nn.functional.pad(x, (0, n * m - 1000)).view(n, m)
    assert torch.allclose(ref.decode((P, Q, N)), (P @ P.t() @ M).flatten()[:1000], atol=1e-6)
    P2, _, _ = ref.encode(x)  # no generator needed once warm: it starts from the last Q
    assert torch.allclose(P2, torch.linalg.qr(M @ Q).Q * torch.sign(torch.diag(torch.linalg.qr(M @ Q).R)),
                          atol=1e-4)


@pytest.mark.parametrize("make,match", [(lambda: refs.QSGDReference(128), r"levels must be an integer in \[1, 127\]"),
                                        (lambda: refs.QSGDMaxNormReference(9), r"bits must be an integer in \[2, 8\]"),
                                        (lambda: refs.MoniquaReference(1, 0.1), r"bits must be an integer in \[2, 8\]"),
                                        (lambda: refs.MoniquaReference(2, 0.0), "theta must be a finite number > 0"),
                                        (lambda: refs.PowerSGDReference(0), "rank must be an integer >= 1")])
def test_reference_arguments_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --- the step bench -------------------------------------------------------------------------

def test_step_seconds_from_given_end_times():
    # two workers, 5 steps; step k ends when the later worker ends it
    ends = [[0.0, 1.0, 2.0, 3.5, 5.0], [0.5, 1.5, 2.0, 3.0, 4.0]]
    # T = 0.5, 1.5, 2.0, 3.5, 5.0: intervals 1.0, 0.5, 1.5, 1.5
    assert step_seconds(ends, warmup=1) == pytest.approx(1.25)  # median of 1.0, 0.5, 1.5, 1.5
    assert step_seconds(ends, warmup=2) == pytest.approx(1.5)  # of 0.5, 1.5, 1.5
    assert step_seconds(ends, warmup=4) == pytest.approx(1.5)
    stalled = [[0.0, 1.0, 2.0, 3.0, 104.0, 105.0]]  # one step lost 100 s to the scheduler
    assert step_seconds(stalled, warmup=1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"warmup must be in \[1, steps - 1\] = \[1, 4\], got 5"):
        step_seconds(ends, warmup=5)
    with pytest.raises(ValueError, match="equal-length"):
        step_seconds([[0.0, 1.0], [0.0]], warmup=1)


def test_every_worker_stamps_every_step():
    cfg = TrainConfig(task="quadratic", algorithm="dpsgd", workers=3, steps=5, device="cpu", eval_every=6)
    ends = step_end_times(cfg)
    assert len(ends) == 3 and all(len(t) == 5 and t == sorted(t) for t in ends)


def test_select_steps_keeps_baselines():
    cases = default_step_cases()
    assert [c.label for c in select_steps(cases, "moniqua")] == ["dpsgd", "allreduce", "moniqua 2-bit",
                                                                 "moniqua 1-bit", "moniqua 2-bit unverified"]
    assert [c.label for c in select_steps(cases, "moniqua 1-bit")] == ["dpsgd", "allreduce", "moniqua 1-bit"]
    with pytest.raises(ValueError, match="unknown 'sgd'; choose from: dpsgd, allreduce"):
        select_steps(cases, "sgd")


def test_step_bench_structure_on_a_small_run():
    report = bench_step(task="quadratic", workers=2, steps=6, warmup=2, rounds=2, algorithms="moniqua 2-bit")
    rows = {r["algorithm"]: r for r in report["rows"]}
    assert list(rows) == ["dpsgd", "allreduce", "moniqua 2-bit"]
    assert (report["threads"], report["device"], report["rounds"]) == (1, "cpu", 2)
    for b in BASELINES:
        assert rows[b][f"x_{b}"] == 1.0  # each round's ratio to itself
    m = rows["moniqua 2-bit"]
    per = [{"case": c, "dpsgd": d} for c, d in zip(m["rounds"], rows["dpsgd"]["rounds"])]
    assert m["x_dpsgd"] == pytest.approx(median_ratio(per, "case", "dpsgd"))
    assert m["step_ms"] > 0 and m["mean_step_ms"] > 0


def test_every_default_step_case_is_a_valid_run():
    cases = default_step_cases()
    assert {"dpsgd", "allreduce", "moniqua 2-bit", "moniqua 1-bit", "choco", "dcd", "deepsqueeze", "qsgd",
            "powersgd", "maxnorm"} <= {c.label for c in cases}
    for c in cases:
        cfg = step_config(c, "digits-mlp", 8, 40)  # validated as lowbit train validates it
        assert (cfg.backend, cfg.workers, cfg.eval_every) == ("thread", 8, 41)
        assert all(getattr(cfg, k) == v for k, v in c.options.items())


def test_step_bench_needs_its_baselines():
    with pytest.raises(ValueError, match="cases lack allreduce"):
        bench_step(task="quadratic", workers=2, steps=4, warmup=1, rounds=1,
                   cases=[StepCase("dpsgd", dict(algorithm="dpsgd"))])


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["codecs", "--size", "0"], "size must be an integer >= 1, got 0"),
    (["codecs", "--rounds", "0"], "rounds must be an integer >= 1, got 0"),
    (["codecs", "--min-run-time", "0"], "min_run_time must be a finite number > 0, got 0.0"),
    (["codecs", "--device", "tpu"], "device='tpu' is unknown"),
    (["codecs", "--clock", "tsc"], "clock='tsc' is unknown; choose one of: auto, cpu, wall"),
    (["codecs", "--against", "grace"], "against='grace' is unknown; choose one of: memcpy, references"),
    (["codecs", "--codecs", "zip"], "codecs: unknown 'zip'"),
    (["codecs", "--against", "references", "--codecs", "minmax"], "codecs: unknown 'minmax'"),
    (["step", "--warmup", "40"], r"warmup must be an integer in \[1, steps - 1\] = \[1, 39\], got 40"),
    (["step", "--workers", "0"], "workers must be an integer >= 1, got 0"),
    (["step", "--rounds", "0"], "rounds must be an integer >= 1, got 0"),
    (["step", "--algorithms", "adam"], "algorithms: unknown 'adam'"),
    (["step", "--task", "imagenet"], "task='imagenet' is unknown"),
    (["hooks", "--hooks", "zip"], "hooks must name lowbit hooks"),
    (["hooks", "--size", "0"], "size must be an integer >= 1, got 0"),
    (["hooks", "--rank", "0"], "rank must be an integer >= 1, got 0"),
    ([], "choose what to benchmark"),
])
def test_bad_arguments_are_clear_errors(argv, match, capsys):
    assert main(["bench", *argv]) == 2
    import re

    assert re.search(match, capsys.readouterr().err)


def test_cli_prints_thread_pin_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "codecs", "--size", "1024", "--rounds", "1", "--codecs", "terngrad", "--min-run-time", "0.001",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch.set_num_threads(1)" in text and "dst.copy_(src)" in text and "median" in text
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and [r["codec"] for r in report["rows"]] == ["terngrad"]


# --- the codec bench's options: the reference path, RandK's kept counts ------------------------

def test_codec_bench_times_the_reference_path_too():
    report = bench_codecs(size=2048, rounds=2, codecs="fp16,qsgd-maxnorm b=2", min_run_time=FAST, path="both")
    assert report["path"] == "both" and report["fresh_buffer_x_memcpy"] > 0
    for r in report["rows"]:
        assert set(r["rounds"][0]) == {"memcpy", "encode", "decode", "ref_encode", "ref_decode"}
        assert r["ref_encode_x_memcpy"] == pytest.approx(median_ratio(r["rounds"], "ref_encode", "memcpy"))
    only = bench_codecs(size=2048, rounds=1, codecs="sign", min_run_time=FAST, path="reference")
    assert set(only["rows"][0]["rounds"][0]) == {"memcpy", "encode", "decode"}
    with pytest.raises(ValueError, match="path='slow' is unknown; choose one of: fast, reference, both"):
        bench_codecs(size=2048, rounds=1, codecs="sign", min_run_time=FAST, path="slow")


def test_randk_cases_and_a_new_selection_per_encode():
    from lowbit.bench.codecs import bench_data, codec_calls, randk_cases

    assert [c.label for c in randk_cases(1000)] == ["randk 1% qsgd-maxnorm b=8", "randk k=d/2 qsgd-maxnorm b=8"]
    assert [c.make().k for c in randk_cases(1000)] == [10, 500]
    assert [c.make().k for c in randk_cases(1000, [3, 1000])] == [3, 1000]
    for bad in (0, 1001, 2.5):
        with pytest.raises(ValueError, match=r"randk_k: each kept count must be an integer in \[1, size=1000\]"):
            randk_cases(1000, [bad])
    x, ref = bench_data(1000, torch.device("cpu"))
    enc, dec, _ = codec_calls(randk_cases(1000)[1].make(), x, ref, 0, torch.device("cpu"))
    seeds = {bytes(enc().header[4:12].tolist()) for _ in range(3)}  # the header's selection seed
    assert len(seeds) == 3 and torch.equal(dec(), dec())
    report = bench_codecs(size=1000, rounds=1, codecs="randk", min_run_time=FAST, randk_k=[7])
    assert [r["codec"] for r in report["rows"]] == ["randk k=7 qsgd-maxnorm b=8"]


def test_cli_codec_bench_options(capsys):
    assert main(["bench", "codecs", "--size", "1024", "--rounds", "1", "--codecs", "randk,sign", "--min-run-time",
                 "0.001", "--path", "both", "--randk-k", "10,512"]) == 0
    text = capsys.readouterr().out
    assert "randk k=10 qsgd-maxnorm b=8" in text and "randk k=512" in text and "ref enc" in text and "fresh buffer" in text
    assert main(["bench", "codecs", "--randk-k", "d/2"]) == 2
    assert "--randk-k must be comma-separated integers, got 'd/2'" in capsys.readouterr().err
    assert main(["bench", "codecs", "--against", "references", "--path", "both"]) == 2
    assert "--path and --randk-k apply to --against memcpy only" in capsys.readouterr().err


def test_decode_out_case_reuses_one_buffer():
    from lowbit.bench.codecs import bench_data, codec_calls
    from lowbit.codecs import HalfCodec

    x, ref = bench_data(1000, torch.device("cpu"))
    _, dec, _ = codec_calls(HalfCodec("fp16"), x, ref, 0, torch.device("cpu"), decode_out=True)
    first = dec()
    assert dec() is first and torch.equal(first, x.half().float())
    assert [c.label for c in default_cases() if c.decode_out] == ["fp16 out="]


# --- the DDP hook bench -------------------------------------------------------------------------

def test_hook_bench_pairs_each_hook_with_torchs_and_times_the_same_computation():
    from lowbit.bench.hooks import bench_hooks, format_hooks_report, matrix_of

    assert matrix_of(1_000_000) == (1000, 1000) and matrix_of(4096) == (64, 64) and matrix_of(13) == (1, 13)
    powersgd = not torch.cuda.is_available()  # else torch's PowerSGD hook fails on CPU buckets: the next test
    report = bench_hooks(size=4096, rounds=2, hooks="fp32,fp16,bf16,qsgd" + ",powersgd" * powersgd,
                         min_run_time=FAST)
    rows = {r["hook"]: r for r in report["hooks"]}
    assert {h: r["torch"] for h, r in rows.items()} == {"fp32": "torch allreduce", "fp16": "torch fp16",
                                                         "bf16": "torch bf16", "qsgd": "torch allreduce",
                                                         **({"powersgd": "torch powersgd"} if powersgd else {})}
    assert (report["rows"], report["cols"], report["threads"]) == (64, 64, 1)
    for r in rows.values():
        assert r["x_torch"] > 0 and r["ms"] > 0 and r["torch_ms"] > 0
    # one process: the average is the rank's own decode, so the float hooks compute exactly torch's
    assert rows["fp32"]["error"] == rows["fp32"]["torch_error"] == 0.0
    for h in ("fp16", "bf16"):
        assert 0 < rows[h]["error"] == rows[h]["torch_error"]
    assert rows["qsgd"]["error"] > 0 and (not powersgd or 0 < rows["powersgd"]["error"] < 1.5)
    text = format_hooks_report(report)
    assert ("torch powersgd" in text) == powersgd and "refill" in text and report["skipped"] == {}
    import torch.distributed as dist

    assert not dist.is_initialized()  # the bench's own group is gone


def test_hook_bench_on_the_cpu_of_a_cuda_machine_leaves_torchs_powersgd_out(monkeypatch):
    """torch's powerSGD_hook calls torch.cuda.synchronize on a CPU bucket's device where CUDA
    is available, and fails: the default hooks leave powersgd out and say so; by name it is a
    clear error."""
    from lowbit.bench.hooks import DEFAULT_HOOKS, bench_hooks, format_hooks_report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="powersgd .*CUDA_VISIBLE_DEVICES"):
        bench_hooks(size=64, rounds=1, hooks="fp32,powersgd", min_run_time=FAST)
    report = bench_hooks(size=64, rounds=1, min_run_time=FAST)
    assert [r["hook"] for r in report["hooks"]] == [h for h in DEFAULT_HOOKS if h != "powersgd"]
    assert set(report["skipped"]) == {"powersgd"}
    assert "powersgd: not timed, torch's powerSGD_hook, which fails on a CPU bucket" in format_hooks_report(report)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_host_syncs_needs_cuda_and_says_so():
    from lowbit.bench.timing import host_syncs

    with pytest.raises(RuntimeError, match="CUDA is not available"):
        host_syncs(lambda: None)


def test_syncs_within_counts_only_the_reads_inside_the_call_and_names_their_caller():
    """What host_syncs counts, without a GPU: a synchronisation warning raised inside ``fn`` is
    counted at the line that raised it; one raised as the warnings are turned off (``stop``, as
    torch's ``set_sync_debug_mode("default")``), one that is not about a synchronisation, and
    one raised on another thread are not."""
    import threading
    import warnings

    from lowbit.bench.timing import syncs_within

    def fn():
        warnings.warn("called a synchronizing CUDA operation")  # counted: this line
        warnings.warn("something else")
        t = threading.Thread(target=lambda: warnings.warn("called a synchronizing CUDA operation"))
        t.start()
        t.join()
        return 7

    line = fn.__code__.co_firstlineno + 1
    result, where = syncs_within(fn, start=lambda: None,
                                 stop=lambda: warnings.warn("called a synchronizing CUDA operation"))
    assert result == 7 and where == [f"{__file__}:{line}"]


def test_every_codec_bench_label_starts_with_a_registered_name():
    from lowbit.bench.codecs import default_cases, reference_pairs
    from lowbit.codecs import CODECS

    for case in default_cases(1000) + reference_pairs(1000):
        assert case.family in CODECS, case.label
        assert type(case.make()).name == case.family, case.label
