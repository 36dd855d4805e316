"""End to end: the paper's claims on the quadratic and on digits, both runtimes, the CLI."""

import json
import threading

import pytest
import torch

from lowbit.cli import main
from lowbit.topology import make_topology, smallest_nonzero_weight
from lowbit.train import TrainConfig, train
from lowbit.train.config import resolve_device


def _quad(**kw):
    base = dict(task="quadratic", workers=8, topology="ring", steps=400, dim=16, delta=0.1, eval_every=50)
    return TrainConfig(**{**base, **kw})


def test_theorem1_naive_floor_and_moniqua_below_it():
    phi = smallest_nonzero_weight(make_topology("ring", 8).mixing_matrix())
    delta = 0.1
    floor = phi ** 2 * delta ** 2 / (8 * (1 + phi ** 2))
    for lr, schedule in ((0.02, "constant"), (0.5, "constant"), (0.1, "cosine")):  # cosine decays to 0
        run = train(_quad(algorithm="naive", lr=lr, lr_schedule=schedule))
        tail = [m["grad_norm_sq"] for m in run.metrics[-4:]]
        assert min(tail) >= floor, (lr, schedule, tail, floor)
    run = train(_quad(algorithm="moniqua", bits=2, lr=0.1, theta=0.05))
    # per worker and step, two messages of 2-bit codes (4 bytes), one 16-bit block hash and a control byte
    assert run.summary["wire_bits_per_element"] == 2 * 8 * (4 + 2 + 1) / 16
    assert run.summary["final_grad_norm_sq"] <= floor / 10
    # Without shared randomness the rounding errors of workers do not cancel; with
    # theta_k following a decaying step size (Theorem 2) Moniqua still goes below the floor.
    run = train(_quad(algorithm="moniqua", bits=2, lr=0.1, lr_schedule="cosine", theta=0.02,
                      theta_schedule="lr", shared_randomness=False))
    assert run.summary["final_grad_norm_sq"] <= floor


def test_digits_moniqua_2bit_matches_dpsgd():
    moniqua = train(TrainConfig(algorithm="moniqua", bits=2)).summary
    dpsgd = train(TrainConfig(algorithm="dpsgd")).summary
    assert dpsgd["final_test_accuracy"] >= 0.90
    assert moniqua["final_test_accuracy"] >= 0.90
    assert moniqua["final_test_accuracy"] >= dpsgd["final_test_accuracy"] - 0.02
    # 2 bits per parameter plus verification (16-bit hashes per 64 elements, failed blocks resent
    # in fp32) against 32 bits
    assert moniqua["nominal_bits_per_element"] == 2 and dpsgd["nominal_bits_per_element"] == 32
    assert moniqua["bytes_sent"] * 5 < dpsgd["bytes_sent"]
    assert moniqua["extra_memory_bytes"] == 0


@pytest.mark.parametrize("algorithm", ["dpsgd", "moniqua"])
def test_both_runtimes_give_the_same_model_and_bytes(algorithm):
    cfg = TrainConfig(algorithm=algorithm, workers=4, steps=30, eval_every=10)
    a = train(cfg)
    b = train(TrainConfig(**{**cfg.to_dict(), "backend": "torch"}))
    for wa, wb in zip(a.workers, b.workers):
        torch.testing.assert_close(wa.params, wb.params, atol=1e-6, rtol=0)
        assert wa.ledger_rows == wb.ledger_rows
    assert a.summary["bytes_sent"] == b.summary["bytes_sent"] > 0


def test_cli_writes_metrics_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--task", "digits-mlp", "--algorithm", "moniqua", "--bits", "2", "--workers", "4",
               "--steps", "20", "--eval-every", "10", "--no-progress", "--no-verify", "--theta", "0.05", "--out", str(out)])
    assert rc == 0
    assert "bytes sent" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[-1]["bytes_sent"] > rows[1]["bytes_sent"] > rows[0]["bytes_sent"] == 0
    s = json.loads((out / "summary.json").read_text())
    for key in ("final_test_accuracy", "final_train_loss", "final_grad_norm_sq", "bytes_sent",
                "nominal_bits_per_element", "wire_bits_per_element", "extra_memory_bytes", "emulated_seconds", "wall_seconds",
                "steps", "config"):
        assert key in s
    assert s["steps"] == 20 and s["config"]["bits"] == 2
    assert s["emulated_seconds"] > s["emulated_comm_seconds"] > 0
    # network model: one 2-bit message per step on parallel links, 1 ms + bytes / 100 Mbit/s
    msg = -(-s["parameters"] * 2 // 8)  # the packed codes alone: no header, no verification word
    assert s["bytes_sent"] == 20 * 4 * 2 * msg
    assert s["emulated_comm_seconds"] == pytest.approx(20 * (1e-3 + msg * 8 / 1e8))


def test_allreduce_ring_bytes_and_seconds():
    s = train(TrainConfig(algorithm="allreduce", workers=4, steps=5, eval_every=5)).summary
    m = s["parameters"] * 4
    assert s["bytes_sent"] == 5 * 4 * (2 * 3 * m // 4)
    assert s["emulated_comm_seconds"] == pytest.approx(5 * (2 * 3 * 1e-3 + 2 * 3 / 4 * m * 8 / 1e8))


@pytest.mark.parametrize("argv,word", [
    (["--bits", "9"], "bits"),
    (["--bits", "0"], "bits"),
    (["--task", "nope"], "task"),
    (["--algorithm", "nope"], "algorithm"),
    (["--topology", "nope"], "topology"),
    (["--workers", "0"], "workers"),
    (["--topology", "torus", "--workers", "7"], "workers"),
    (["--theta", "0"], "theta"),
    (["--theta", "-1"], "theta"),
    (["--algorithm", "moniqua", "--bits", "1", "--rounding", "stochastic"], "delta"),
    (["--algorithm", "moniqua", "--codec", "minmax"], "codec"),
    (["--algorithm", "naive", "--codec", "nope"], "codec"),
    (["--bandwidth", "fast"], "bandwidth"),
    (["--backend", "mpi"], "backend"),
    (["--rounding", "up"], "rounding"),
    (["--theta-schedule", "auto"], "theta_schedule"),
    (["--theta", "big"], "theta"),
    (["--split", "nope"], "split"),
    (["--slow", "0"], "slow"),
    (["--slow", "9:2"], "slow"),
    (["--slow", "0:0.5"], "slow"),
    (["--gamma", "0"], "gamma"),
    (["--gamma", "1.5"], "gamma"),
    (["--server", "nope"], "server"),
    (["--k", "-1"], "k"),
    (["--rank", "0"], "powersgd_rank"),
    (["--algorithm", "dpsgd", "--codec", "minmax"], "codec"),
    (["--algorithm", "moniqua", "--bits", "1", "--rounding", "stochastic", "--backend", "torch"], "delta"),  # before any process starts
])
def test_cli_rejects_bad_input_naming_the_option(argv, word, capsys):
    rc = main(["train", "--no-progress", "--steps", "1"] + argv)
    assert rc == 2
    assert word in capsys.readouterr().err


def test_torchrun_launch_joins_and_matches_threads(tmp_path):
    """The CLI under torchrun: each process is one worker; rank 0 writes the results."""
    import subprocess
    import sys

    args = ["train", "--backend", "torch", "--workers", "2", "--steps", "20", "--eval-every", "10", "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "lowbit",
                           *args, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    ref = train(TrainConfig(workers=2, steps=20, eval_every=10)).summary
    assert s["bytes_sent"] == ref["bytes_sent"]
    assert s["final_train_loss"] == pytest.approx(ref["final_train_loss"], abs=1e-5)


def test_every_config_field_is_a_cli_option(tmp_path):
    """The train options are generated from TrainConfig: each field round-trips through argv."""
    import argparse

    from lowbit import cli

    parser = argparse.ArgumentParser()
    cli._add_train(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--rank", "3", "--no-verify", "--theta", "auto", "--split", "label",
                              "--slow", "1:2", "--k", "0.01", "--gamma", "0.5"])
    assert (args.powersgd_rank, args.verify, args.theta, args.split, args.slow, args.k, args.gamma) == (
        3, False, "auto", "label", "1:2", 0.01, 0.5)
    assert set(TrainConfig.option_names()) <= set(vars(args))


@pytest.mark.parametrize("workers", [10, 4, 16])
def test_label_split_gives_each_worker_its_classes(workers):
    from lowbit.train.tasks import DigitsMLP

    task = DigitsMLP(split="label")
    shards = [task.shard(r, workers, seed=0) for r in range(workers)]
    labels = [set(s.y.tolist()) for s in shards]
    assert sum(len(s.y) for s in shards) == len(task.y_train)  # nothing lost, nothing repeated
    if workers <= 10:
        assert all(labels[r] == {c for c in range(10) if c % workers == r} for r in range(workers))
    else:  # workers outnumber classes: those sharing a class split its samples
        assert all(labels[r] == {r % 10} for r in range(workers))
        assert len(shards[0].y) + len(shards[10].y) == int((task.y_train == 0).sum())


class _TickClock:
    """Stands in for the ``time`` module of the training loop: each thread's CPU clock
    advances one tick per reading, and sleeps are recorded, not slept."""

    TICK = 1e-3

    def __init__(self):
        self._local = threading.local()
        self.sleeps: list[tuple[str, float]] = []

    def thread_time(self):
        self._local.ticks = getattr(self._local, "ticks", 0) + 1
        return self._local.ticks * self.TICK

    def sleep(self, seconds):
        self.sleeps.append((threading.current_thread().name, seconds))


def test_slow_worker_is_charged_its_factor(monkeypatch):
    """``--slow 1:3``: rank 1 sleeps twice its measured gradient time after each gradient
    and is charged for it; rank 0 is untouched and the training is the same. A clock that
    ticks once per reading makes the gradient time one tick, so the charges are exact."""
    import lowbit.train.loop as loop

    runs = {}
    for slow in (None, "1:3"):
        clock = _TickClock()
        monkeypatch.setattr(loop, "time", clock)
        # on the CPU: its clock is the thread's CPU time (a GPU's is the synchronized wall clock)
        runs[slow] = train(TrainConfig(algorithm="dpsgd", workers=2, steps=20, eval_every=10, slow=slow,
                                       device="cpu")).workers, clock
    (fast, fast_clock), (slowed, slow_clock) = runs[None], runs["1:3"]
    torch.testing.assert_close(fast[1].params, slowed[1].params, atol=0, rtol=0)  # same training, slower clock
    tick = _TickClock.TICK
    assert fast_clock.sleeps == []
    assert [s for _, s in slow_clock.sleeps] == pytest.approx([2 * tick] * 20)
    assert fast[0].compute_seconds == slowed[0].compute_seconds == pytest.approx([2 * tick] * 20)
    assert slowed[1].compute_seconds == pytest.approx([4 * tick] * 20)  # two ticks read, two slept


# ---- where workers compute ----------------------------------------------------------------
@pytest.mark.parametrize("device,match", [("gpu", "unknown"), ("cuda:x", "unknown"), ("cuda", "no CUDA"),
                                          ("cuda:0", "no CUDA")])
def test_bad_or_unavailable_device_is_a_clear_error(device, match):
    if torch.cuda.is_available() and match == "no CUDA":
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=f"device={device!r}.*{match}"):
        TrainConfig(device=device)


def test_auto_device_is_cuda_only_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(TrainConfig().device, 3) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    cfg = TrainConfig(device="auto")
    assert resolve_device(cfg.device, 5) == torch.device("cuda", 1)  # local rank 5 on 4 GPUs
    assert resolve_device(cfg.device, None) == torch.device("cuda", 2)  # thread workers: the current GPU
    assert resolve_device(TrainConfig(device="cuda:3").device, 0) == torch.device("cuda", 3)
    assert resolve_device(TrainConfig(device="cpu").device, 0) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"GPU index must be in \[0, 3\]"):
        TrainConfig(device="cuda:4")


def test_a_worker_computes_on_the_device_its_transport_names(monkeypatch):
    """worker_device asks the transport (Transport.local_rank): a thread world's workers share the
    process's current GPU; a torch.distributed process uses LOCAL_RANK, else its rank."""
    from lowbit.comm.distributed import TorchDistributedTransport
    from lowbit.comm.inprocess import run_threads
    from lowbit.train.loop import worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    cfg = TrainConfig(device="auto")
    threads = run_threads(2, lambda t: (t.local_rank, worker_device(cfg, t)))
    assert threads == [(None, torch.device("cuda", 2))] * 2
    proc = object.__new__(TorchDistributedTransport)  # no process group: only its rank is read
    proc.rank = 6
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert proc.local_rank == 6 and worker_device(cfg, proc) == torch.device("cuda", 2)  # 6 on 4 GPUs
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert proc.local_rank == 1 and worker_device(cfg, proc) == torch.device("cuda", 1)
