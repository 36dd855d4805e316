"""Reliability (issue 13): liveness, checkpoints, hostile peers, Moniqua's verification,
one error path for the CLI, divergence, signals and bounds."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lowbit.cli import main
from lowbit.comm import launch
from lowbit.comm.inprocess import run_threads
from lowbit.comm.launcher import MAX_LOCAL_WORKERS, WorkerDied, WorkerFailed, WorkerStalled
from lowbit.integrations import DecentralizedDataParallel
from lowbit.integrations.checkpoint import (CheckpointError, load_checkpoint, rng_state, save_checkpoint,
                                            set_rng_state)
from lowbit.train.config import MAX_THREAD_WORKERS, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


# ---- liveness -----------------------------------------------------------------------------
def _stop_rank1(transport):
    transport.set_step(3)
    if transport.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


def _beating(transport, seconds):
    t_end = time.monotonic() + seconds
    k = 0
    while time.monotonic() < t_end:
        transport.set_step(k)
        k += 1
        time.sleep(0.2)
    return k


def _die_at_step(transport):
    transport.set_step(7)
    if transport.rank == 1:
        os._exit(3)
    time.sleep(30)


def test_launch_has_no_whole_run_deadline_and_heartbeats_keep_a_run_alive():
    import inspect

    assert inspect.signature(launch).parameters["timeout_s"].default is None
    # every worker beats every 0.2 s for 3 s: longer than the stall timeout, never silent that long
    steps = launch(2, _beating, 3.0, stall_timeout_s=1.5)
    assert all(s > 5 for s in steps)


def test_a_stopped_worker_is_found_by_the_stall_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerStalled, match=r"rank 1 \(last step 3.*process stopped"):
        launch(2, _stop_rank1, stall_timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_a_dead_worker_is_named_with_its_step():
    with pytest.raises(WorkerDied, match=r"rank 1 of 2 exited with code 3 at step 7"):
        launch(2, _die_at_step)


def test_sigterm_to_the_launcher_ends_its_workers(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from lowbit.comm import launch

        def work(transport, folder):
            open(os.path.join(folder, f"pid{{transport.rank}}"), "w").write(str(os.getpid()))
            while True:
                transport.set_step(0)
                time.sleep(0.1)

        if __name__ == "__main__":
            launch(2, work, {str(tmp_path)!r})
    """))
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
    time.sleep(0.5)
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
    assert alive == []


def test_workers_are_bounded_per_runtime():
    with pytest.raises(ValueError, match=f"at most {MAX_THREAD_WORKERS}"):
        TrainConfig(workers=MAX_THREAD_WORKERS + 1, topology="complete")
    with pytest.raises(ValueError, match=f"at most {MAX_LOCAL_WORKERS}"):
        TrainConfig(workers=MAX_LOCAL_WORKERS + 1, backend="torch", topology="complete")
    with pytest.raises(ValueError, match=f"at most {MAX_LOCAL_WORKERS}"):
        launch(MAX_LOCAL_WORKERS + 1, _beating, 0.0)


# ---- hostile peers ------------------------------------------------------------------------
def _oversized(transport):
    if transport.rank == 0:
        transport.max_message_bytes = 100
    transport.neighbor_exchange(torch.zeros(1000, dtype=torch.uint8), [1 - transport.rank])


def test_a_stated_size_beyond_the_bound_is_refused_before_allocation():
    with pytest.raises(WorkerFailed) as info:
        launch(2, _oversized, stall_timeout_s=60)
    assert isinstance(info.value.cause, ValueError)
    assert "rank 1 stated a neighbour-exchange message of 1000 bytes" in str(info.value.cause)


# ---- checkpoints --------------------------------------------------------------------------
def test_checkpoint_round_trip_atomic_and_previous_kept(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"step": 1, "x": torch.arange(5)}, path)
    save_checkpoint({"step": 2, "x": torch.arange(6)}, path)
    assert load_checkpoint(path)["step"] == 2
    assert load_checkpoint(str(path) + ".prev")["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "c.pt.prev"]  # no temporary left


def test_checkpoint_refuses_a_flipped_bit_truncation_and_foreign_files(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"step": 3, "w": torch.ones(100)}, path)
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0x01  # one bit of the body
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)
    path.write_bytes(bytes(raw[:-10]))
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)

    class Evil:  # a pickle that would run code on load
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"x": Evil()}, path)
    with pytest.raises(CheckpointError, match="not a lowbit checkpoint"):
        load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_rng_states_are_tensors_and_restore_exactly():
    state = rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    a = (np.random.rand(3), random.random(), torch.rand(3))
    set_rng_state(loaded)
    b = (np.random.rand(3), random.random(), torch.rand(3))
    assert np.array_equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2])


def _wrapped(transport, folder, save_at, steps, stagger):
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ddp = DecentralizedDataParallel(net, opt, "moniqua", transport=transport, bits=2, theta=0.5)
    path = os.path.join(folder, f"rank{transport.rank}.pt")
    if save_at is None:  # resume
        ddp.load_checkpoint(path)
    g = torch.Generator().manual_seed(transport.rank)
    while ddp.step_count < steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * ddp.step_count + transport.rank))
        ddp.zero_grad()
        ddp(x).pow(2).sum().backward()
        ddp.step()
        if save_at is not None and ddp.step_count == save_at + (stagger if transport.rank == 1 else 0):
            ddp.save_checkpoint(path)
    del g
    return ddp.flat.data.clone(), ddp.bytes_sent


def test_wrapper_resume_is_exact_and_carries_bytes_sent(tmp_path):
    whole = run_threads(2, lambda t: _wrapped(t, str(tmp_path), 4, 10, 0))
    resumed = run_threads(2, lambda t: _wrapped(t, str(tmp_path), None, 10, 0))
    for (xa, ba), (xb, bb) in zip(whole, resumed):
        assert torch.equal(xa, xb)
        assert ba == bb > 0
    state = torch.load(tmp_path / "rank0.pt", weights_only=True)  # the file is torch.save's, checksum and all
    assert state["step"] == 4


def test_ranks_resuming_from_different_steps_get_a_clear_error(tmp_path):
    run_threads(2, lambda t: _wrapped(t, str(tmp_path), 4, 8, stagger=2))  # rank 1 saved at step 6
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"different steps \(step 4: rank\(s\) \[0\]; step 6: rank\(s\) \[1\]\)"):
        run_threads(2, lambda t: _wrapped(t, str(tmp_path), None, 8, 0))
    assert time.monotonic() - t0 < 30


def test_lowbit_train_resume_is_bit_identical(tmp_path):
    base = dict(steps=12, workers=3, eval_every=5, algorithm="moniqua", hidden=16)
    from lowbit.train import train

    whole = train(TrainConfig(**base, checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    resumed = train(TrainConfig(**base, resume=str(tmp_path)))
    assert load_checkpoint(tmp_path / "rank0.pt")["step"] == 10
    for a, b in zip(whole.workers, resumed.workers):
        assert torch.equal(a.params, b.params)
    assert whole.summary["bytes_sent"] == resumed.summary["bytes_sent"]
    drop = lambda rows: [{k: v for k, v in r.items() if k != "emulated_seconds"} for r in rows]  # noqa: E731
    assert drop(whole.metrics) == drop(resumed.metrics)
    with pytest.raises(CheckpointError, match="differs from the checkpointed one in lr"):
        train(TrainConfig(**base, lr=0.05, resume=str(tmp_path)))


# ---- Moniqua's verification ---------------------------------------------------------------
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_grid_integers_boundary(path):
    """Verification hashes grid integers up to 2^53 (exact in float64) and refuses beyond; the
    encode refuses an x whose grid integer, rounded up, could pass 2^53 (issue 32: the codec's
    range is enforced on encode, so a value is never sent that the receiver decodes wrong)."""
    from lowbit.codecs import ModuloCodec
    from lowbit.codecs.kernels import codec_path

    codec = ModuloCodec(bits=2, theta=0.375, rounding="nearest")  # B_theta = 1: grid integers 4 k
    with codec_path(path):
        p = codec.encode(torch.zeros(1, dtype=torch.float64))  # the code of every integer k
        for k, ok in ((2 ** 51, True), (-(2 ** 51), True), (2 ** 51 + 1, False)):
            ref = torch.tensor([float(k)], dtype=torch.float64)
            if ok:
                x_hat, _ = codec.decode_hashed(p, ref=ref, block=1)
                assert torch.equal(x_hat, ref)
            else:
                with pytest.raises(OverflowError, match="beyond 2\\^53"):
                    codec.decode_hashed(p, ref=ref, block=1)
        assert codec.encode(torch.tensor([2.0 ** 51 - 1], dtype=torch.float64)).data.numel() == 1
        with pytest.raises(ValueError, match="x is out of the modulo codec's range"):
            codec.encode(torch.tensor([2.0 ** 51], dtype=torch.float64))


def test_a_theta_whose_grid_overflows_is_an_error_not_a_silent_bypass():
    from lowbit.train import train

    with pytest.raises(ValueError, match="Raise theta"):
        train(TrainConfig(theta=1e-18, steps=2, workers=2, hidden=8))


# ---- the CLI's one error path -------------------------------------------------------------
def _cli(capsys, *argv):
    code = main(["train", "--no-progress", *argv])
    err = capsys.readouterr().err
    return code, err


def test_out_is_checked_before_training_and_a_previous_run_needs_overwrite(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    code, err = _cli(capsys, "--out", str(f), "--steps", "1")
    assert code == 4 and "is a file" in err and "Traceback" not in err
    out = tmp_path / "run"
    assert _cli(capsys, "--out", str(out), "--steps", "2", "--workers", "2", "--hidden", "8")[0] == 0
    first = (out / "summary.json").read_text()
    code, err = _cli(capsys, "--out", str(out), "--steps", "2", "--workers", "2")
    assert code == 4 and "--overwrite" in err
    assert (out / "summary.json").read_text() == first
    assert json.loads(first)["status"] == "finished"


@pytest.mark.parametrize("algorithm", ["dpsgd", "allreduce", "choco", "dcd"])
def test_divergence_is_one_behaviour(tmp_path, capsys, algorithm):
    out = tmp_path / algorithm
    code, err = _cli(capsys, "--algorithm", algorithm, "--lr", "1e8", "--steps", "40", "--workers", "2",
                     "--eval-every", "1", "--hidden", "8", "--out", str(out))
    assert code == 3, err
    assert "diverged at step" in err and err.count("\n") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at_step"] >= 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[0]["step"] == 0


@pytest.mark.parametrize("argv,needle", [
    (["--weight-decay", "nan"], "weight_decay must be a finite number"),
    (["--weight-decay", "inf"], "weight_decay must be a finite number"),
    (["--task", "quadratic", "--noise", "nan"], "noise must be a finite number"),
    (["--algorithm", "ndqsg", "--nested-failure", "inf"], "nested_failure must be a number in (0, 1), got inf"),
    (["--algorithm", "grandk-maxnorm", "--k", "1000000", "--task", "quadratic"], "more than the model's d=16"),
])
def test_bad_floats_and_k_are_one_line_errors(capsys, argv, needle):
    code, err = _cli(capsys, *argv, "--steps", "1", "--workers", "2")
    assert code == 2 and needle in err and "Traceback" not in err


def test_summary_is_strict_json(tmp_path):
    from lowbit.train.run import to_json

    text = to_json({"a": float("nan"), "b": [1.0, float("inf")], "c": 2})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": 2, "non_finite": ["a", "b[1]"]}


def test_data_errors_are_one_line(tmp_path, capsys):
    code, err = _cli(capsys, "--task", "fashion-lenet", "--data-dir", str(tmp_path / "none"), "--steps", "1")
    assert code == 4 and "--data-dir" in err and err.count("\n") == 1
    from lowbit.data import write_idx

    for stem, arr in (("train-images-idx3-ubyte", np.zeros((4, 28, 28), np.uint8)),
                      ("train-labels-idx1-ubyte", np.array([0, 1, 2, 12], np.uint8)),
                      ("t10k-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8)),
                      ("t10k-labels-idx1-ubyte", np.array([0, 1], np.uint8))):
        write_idx(str(tmp_path / stem), arr)
    code, err = _cli(capsys, "--task", "fashion-lenet", "--data-dir", str(tmp_path), "--steps", "1", "--workers", "1")
    assert code == 5 and "label 12 is out of range 0..9" in err and err.count("\n") == 1


# ---- interrupted extraction ---------------------------------------------------------------
def test_an_interrupted_extraction_is_redone(tmp_path, monkeypatch):
    import importlib

    dl = importlib.import_module("lowbit.data.download")

    src = tmp_path / "src" / "cifar-10-batches-bin"
    src.mkdir(parents=True)
    for name in dl._CIFAR_FILES:
        (src / name).write_bytes(b"\0" * 3073)
    archive = tmp_path / "cache" / "cifar10" / "cifar-10-binary.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="cifar-10-batches-bin")
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    spec = {**dl.DATASETS["cifar10"], "files": {"cifar-10-binary.tar.gz": ("md5", digest)}}
    monkeypatch.setitem(dl.DATASETS, "cifar10", spec)
    folder = str(archive.parent)
    half = archive.parent / "cifar-10-batches-bin"  # an extraction killed half way: three files, no marker
    half.mkdir()
    for name in dl._CIFAR_FILES[:3]:
        (half / name).write_bytes(b"\0" * 3073)
    assert not dl._complete(folder, spec)
    assert dl.download("cifar10", cache_dir=str(tmp_path / "cache")) == folder  # verified archive: no network
    assert dl._complete(folder, spec)
    assert all((half / name).exists() for name in dl._CIFAR_FILES)


# ---- misc ---------------------------------------------------------------------------------
def test_sum_dtype_message_names_the_bits_given(capsys):
    code, err = _cli(capsys, "--algorithm", "maxnorm", "--sum-dtype", "int8", "--bits", "8", "--steps", "1")
    assert code == 2 and "bits=8" in err and "bits=9" not in err


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    import lowbit.train.run as run_mod

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(run_mod, "_thread_job", oom)
    code, err = _cli(capsys, "--steps", "1", "--workers", "2")
    assert code == 6 and "out of memory" in err and "--batch-size" in err and err.count("\n") == 1


def test_divergence_on_the_torch_backend_is_the_same_error(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _cli(capsys, "--backend", "torch", "--algorithm", "dpsgd", "--lr", "1e8", "--steps", "30",
                     "--workers", "2", "--hidden", "8", "--eval-every", "1", "--out", str(out))
    assert code == 3 and err.startswith("lowbit: error: diverged at step") and err.count("\n") == 1, err
    assert json.loads((out / "summary.json").read_text())["status"] == "diverged"
    assert (out / "metrics.jsonl").read_text().count("\n") >= 1
