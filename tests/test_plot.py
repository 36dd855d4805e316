"""lowbit plot: curves of real runs, clear errors, and the --tensorboard option."""

import json
import struct
import sys

import pytest

from lowbit.cli import main
from lowbit.plot import load_series, plot_runs, plot_series
from lowbit.train import TrainConfig, train

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _drawn_colors(path) -> int:
    """How many distinct non-gray colors the image holds (the curves are colored)."""
    from matplotlib.image import imread

    img = imread(path)[..., :3]
    rgb = (img * 255).round().astype(int).reshape(-1, 3)
    colored = rgb[(rgb.max(1) - rgb.min(1)) > 60]
    return len({tuple(c // 32) for c in colored})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, kw in (("moniqua", dict(algorithm="moniqua", bits=2)),
                     ("dpsgd", dict(algorithm="dpsgd")),
                     ("quad", dict(task="quadratic", algorithm="dpsgd"))):
        out[name] = root / name
        out[name + "_run"] = train(TrainConfig(workers=2, steps=10, eval_every=5, **kw), out=out[name])
    return out


def test_plot_two_real_runs_writes_a_png(runs, tmp_path):
    png = plot_runs([runs["moniqua"], runs["dpsgd"]], "step", "loss", tmp_path / "sub" / "loss.png")
    assert png == tmp_path / "sub" / "loss.png"
    w, h = _png_size(png)
    assert (w, h) == (768, 528)  # 6.4 x 4.4 inches at 120 dpi
    assert _drawn_colors(png) >= 2  # two differently colored curves were drawn


@pytest.mark.parametrize("x,y", [("seconds", "accuracy"), ("bytes", "loss"), ("step", "accuracy")])
def test_every_axis_pair_and_logy(runs, tmp_path, x, y):
    png = plot_runs([runs["moniqua"], runs["dpsgd"]], x, y, tmp_path / "p.png", title="t", logy=(y == "loss"))
    assert _png_size(png)[0] > 0 and png.stat().st_size > 0


def test_series_come_from_metrics_and_labels_from_summary(runs):
    rows = [json.loads(line) for line in (runs["moniqua"] / "metrics.jsonl").read_text().splitlines()]
    (lab_m, xs, ys), (lab_d, xs_d, _) = load_series([runs["moniqua"], runs["dpsgd"]], "bytes", "accuracy")
    assert xs == [r["bytes_sent"] for r in rows] and xs[0] == 0 and xs[-1] > 0
    assert ys == [r["test_accuracy"] for r in rows]
    assert xs_d[-1] > xs[-1]  # fp32 D-PSGD sends more than 2-bit Moniqua
    assert lab_m == "moniqua, 2 bits/elem"
    assert lab_d.startswith("dpsgd, 32 bits/elem")
    (_, secs, _), = load_series([runs["moniqua"]], "seconds", "loss")
    assert secs == [r["emulated_seconds"] for r in rows]
    # same algorithm twice: the directory names tell them apart; given labels are kept
    a, b = load_series([runs["moniqua"], runs["moniqua"]], "step", "loss")
    assert a[0] == b[0] == "moniqua, 2 bits/elem (moniqua)"
    assert [s[0] for s in load_series([runs["moniqua"], runs["dpsgd"]], "step", "loss", ["A", "B"])] == ["A", "B"]


def test_errors_are_named(runs, tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot_runs([tmp_path], "step", "loss", tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"x='time' is unknown; choose one of: step, seconds, bytes"):
        plot_runs([runs["moniqua"]], "time", "loss", tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"y='acc' is unknown; choose one of: loss, accuracy"):
        plot_runs([runs["moniqua"]], "step", "acc", tmp_path / "a.png")
    with pytest.raises(ValueError, match="has no test_accuracy.*quadratic.*--y loss"):
        plot_runs([runs["moniqua"], runs["quad"]], "step", "accuracy", tmp_path / "a.png")
    with pytest.raises(ValueError, match="labels must give one label per run"):
        plot_runs([runs["moniqua"]], "step", "loss", tmp_path / "a.png", labels=["a", "b"])
    with pytest.raises(ValueError, match="unknown image format 'xyz'"):
        plot_runs([runs["moniqua"]], "step", "loss", tmp_path / "a.xyz")
    with pytest.raises(ValueError, match="run_dirs must be a non-empty list"):
        plot_runs([], "step", "loss", tmp_path / "a.png")
    assert not list(tmp_path.glob("a.*"))
    # the quadratic run plots fine against its loss
    assert _png_size(plot_runs([runs["quad"]], "step", "loss", tmp_path / "q.png", logy=True))[0] > 0


def test_plot_series_with_a_floor(tmp_path):
    out = plot_series([("a", [0, 1, 2], [1.0, 0.5, 0.25]), ("b", [0, 1, 2], [1.0, None, 0.1])], "step", "loss",
                      tmp_path / "s.png", logy=True, hlines=[("floor", 0.05)])
    assert _png_size(out) == (768, 528)
    with pytest.raises(ValueError, match="series must hold at least one"):
        plot_series([], "x", "y", tmp_path / "e.png")
    with pytest.raises(ValueError, match=r"series\[0\] \('a'\): xs and ys must have the same length, got 2 and 3"):
        plot_series([("a", [0, 1], [1, 2, 3])], "x", "y", tmp_path / "e.png")
    with pytest.raises(ValueError, match=r"hlines\[0\] must be \(label, finite y\)"):
        plot_series([("a", [0, 1], [1, 2])], "x", "y", tmp_path / "e.png", hlines=[("floor", float("nan"))])


def test_cli_plot(runs, tmp_path, capsys):
    out = tmp_path / "cli.png"
    rc = main(["plot", str(runs["moniqua"]), str(runs["dpsgd"]), "--x", "bytes", "--y", "accuracy",
               "--out", str(out), "--label", "M", "--label", "D"])
    assert rc == 0 and f"wrote {out}" in capsys.readouterr().out
    assert _png_size(out)[0] > 0
    for argv, msg in (([str(runs["moniqua"]), "--x", "time"], "x='time' is unknown"),
                      ([str(runs["moniqua"]), str(runs["quad"]), "--y", "accuracy"], "has no test_accuracy"),
                      ([str(runs["moniqua"]), str(tmp_path / "nowhere")], "no metrics.jsonl")):
        rc = main(["plot"] + argv + ["--out", str(tmp_path / "e.png")])
        assert rc == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # --out is required
        main(["plot", str(runs["moniqua"])])
    assert e.value.code == 2


def test_tensorboard_missing_package_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(ValueError, match="tensorboard=.*pip install tensorboard"):
        TrainConfig(workers=2, steps=2, tensorboard=str(tmp_path / "tb"))
    rc = main(["train", "--no-progress", "--workers", "2", "--steps", "1", "--tensorboard", str(tmp_path / "tb")])
    assert rc == 2 and "pip install tensorboard" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tensorboard must be a directory path"):
        TrainConfig(workers=2, steps=2, tensorboard="")


def test_tensorboard_writes_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(TrainConfig(workers=2, steps=10, eval_every=5, tensorboard=str(tmp_path / "tb")))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("metrics/train_loss")}
    assert got == pytest.approx({r["step"]: r["train_loss"] for r in run.metrics})
    assert [e.value for e in acc.Scalars("final/bytes_sent")] == [run.summary["bytes_sent"]]


def test_tensorboard_metrics_are_written_live(tmp_path, monkeypatch):
    """The evaluation rows reach TensorBoard as the run goes (rank 0 writes each when it is
    measured), not only after the run: with the end-of-run writer disabled they are there."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import lowbit.train.run as run_module

    monkeypatch.setattr(run_module, "write_tensorboard", lambda logdir, run: None)
    run = train(TrainConfig(workers=2, steps=10, eval_every=5, tensorboard=str(tmp_path / "tb")))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("metrics/test_accuracy")}
    assert got == pytest.approx({r["step"]: r["test_accuracy"] for r in run.metrics})
    assert "final/bytes_sent" not in acc.Tags()["scalars"]
