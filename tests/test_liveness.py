"""Issue 32 (items 1, 3, 4, 13): no unpickling of peer data; one liveness story under torchrun
and lowbit's launcher (a stopped, killed or overdue rank ends every rank, with summary.json);
workers leave with their launcher; the per-collective limit is an option; --checkpoint-dir and
a full filesystem are errors naming the option and the path."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lowbit.cli import main
from lowbit.comm import launch, wire_objects
from lowbit.comm.launcher import WorkerFailed
from lowbit.train.config import TrainConfig
from test_reliability_torchrun import _rank_pid  # noqa: E402 - tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "torchrun_hostile_result.py"
LINUX = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _train_args(out, *extra):
    return ["train", "--backend", "torch", "--workers", "2", "--task", "quadratic", "--out", str(out),
            "--no-progress", *extra]


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


# ---- 1. no unpickling of what a peer sends ------------------------------------------------
class _Hostile:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').write('code ran')",))


def _send_a_pickle(transport, marker):
    if transport.rank == 1:  # this worker process's own encoder now sends a pickle, as a hostile worker would
        wire_objects.dumps = lambda value: pickle.dumps(_Hostile(marker))
    return transport.rank


def test_the_launcher_never_unpickles_what_a_worker_sends(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(wire_objects.BadPeerData, match=r"worker rank 1 sent a result that is not a well-formed"):
        launch(2, _send_a_pickle, str(marker), stall_timeout_s=60)
    assert not marker.exists()


def test_frames_round_trip_and_refuse_what_is_not_one():
    from lowbit.train.loop import WorkerResult

    res = WorkerResult(rank=1, params=torch.arange(5.0), ledger_rows=[(0, "neighbor", 4, 4, 1, 2)],
                       compute_seconds=[0.5], extra_memory_bytes=3, nominal_bits_per_element=2.0,
                       report={"a": 1, "b": 0.5}, evals=[{"step": 0, "x": float("nan"), "y": None}])
    value = {"r": res, "t": (1, "a", b"\x00"), 3: [torch.ones(2, 2, dtype=torch.bool)]}
    frame = wire_objects.dumps(value)
    back = wire_objects.loads(frame, sender="rank 1", max_nbytes=len(frame))
    assert back["r"].ledger_rows == res.ledger_rows and back["t"] == value["t"] and 3 in back
    assert torch.equal(back["r"].params, res.params) and torch.equal(back[3][0], value[3][0])
    with pytest.raises(TypeError, match="cannot send a"):
        wire_objects.dumps(_Hostile("x"))
    for bad, why in [(pickle.dumps(res), "starts with"), (frame[:-1], "needs"), (frame + b"\0", "follow its last"),
                     (b"", "shorter"), (frame, "more than the 10 accepted")]:
        with pytest.raises(wire_objects.BadPeerData, match=f"rank 1 sent .*{why}"):
            wire_objects.loads(bad, sender="rank 1", max_nbytes=10 if "accepted" in why else 1 << 20)
    for header, why in [({"v": {"C": "os.system", "F": {}}, "t": []}, "not a registered dataclass"),
                        ({"v": {"X": 0}, "t": [["float32", [1 << 40], "cpu"]]}, "needs 4398046511104 bytes"),
                        ({"v": {"X": 0}, "t": [["object", [1], "cpu"]]}, "known dtype"),
                        ({"v": [{"X": 0}, {"X": 0}], "t": [["uint8", [0], "cpu"]]}, "each used once")]:
        h = json.dumps(header).encode()
        with pytest.raises(wire_objects.BadPeerData, match=why):
            wire_objects.loads(struct.pack("<8sQ", wire_objects.MAGIC, len(h)) + h, sender="rank 1",
                               max_nbytes=1 << 20)


def test_a_worker_error_comes_back_as_its_class_without_pickle():
    from lowbit.train.errors import Diverged

    for e in (Diverged(4, "gradient", 1), FileNotFoundError(2, "No such file", "/x"), KeyError("k")):
        rec = wire_objects.exception_record(e, "traceback text")
        back = wire_objects.rebuild_exception(rec, sender="rank 1")
        assert type(back) is type(e) and str(back) == str(e)
    assert wire_objects.rebuild_exception({"types": ["os.system"], "message": "m"}, sender="r").args == ("m",)


@LINUX
def test_torchrun_rank0_refuses_a_hostile_result_and_runs_none_of_it(tmp_path):
    marker, out = tmp_path / "ran", tmp_path / "out"
    run = subprocess.run(_torchrun(str(HOSTILE), str(marker), "--", *_train_args(out, "--steps", "10",
                                                                                   "--eval-every", "10")),
                         capture_output=True, text=True, env=_env(), timeout=240, cwd=tmp_path)
    assert run.returncode != 0
    assert not marker.exists(), marker.read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_kind"] == "worker"
    assert "rank 1 sent a result that is not a well-formed lowbit frame" in summary["error"]
    assert "lowbit: error: rank 1 sent a result" in run.stdout + run.stderr


# ---- 3. one liveness story under torchrun ---------------------------------------------------
def _torchrun_fault(tmp_path, sig, *extra, victim=1):
    """Start `lowbit train` under torchrun, wait for its second evaluation, send ``sig`` to rank
    ``victim`` (None: nothing), and return (seconds from the fault until torchrun and both ranks were gone,
    output, summary)."""
    out = tmp_path / "out"
    cmd = _torchrun("-m", "lowbit", *_train_args(out, "--steps", "1000000", "--eval-every", "20", *extra))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        pids = [None, None]
        while time.monotonic() < deadline and proc.poll() is None and not (
                None not in pids and (out / "metrics.jsonl").exists()
                and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            pids = [_rank_pid(proc.pid, r) for r in range(2)]
            time.sleep(0.1)
        assert None not in pids and proc.poll() is None, "the run never got going" + (
            "; its output:\n" + proc.communicate()[0][-6000:] if proc.poll() is not None else "")
        t0 = time.monotonic()
        if sig is not None:
            os.kill(pids[victim], sig)
        output, _ = proc.communicate(timeout=120)
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(_alive(p) for p in pids)
    assert (out / "summary.json").is_file(), f"no summary.json after {elapsed:.1f} s; the run's output:\n{output[-6000:]}"
    return elapsed, output, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@LINUX
def test_torchrun_a_stopped_rank_ends_every_rank_at_the_stall_timeout(tmp_path):
    elapsed, output, summary = _torchrun_fault(tmp_path, signal.SIGSTOP, "--stall-timeout", "5")
    assert summary["status"] == "failed" and summary["error_kind"] == "stalled"
    assert "rank 1 (last step" in summary["error"] and "process stopped (SIGSTOP?)" in summary["error"]
    assert output.count("lowbit: error: torchrun: no progress from") == 2, output[-3000:]  # both ranks, one message
    assert elapsed < 60, elapsed  # liveness: about the stall timeout, never torch's 30 minutes
    print(f"SIGSTOP of rank 1, --stall-timeout 5: every rank gone after {elapsed:.1f} s")


@pytest.mark.slow
@LINUX
def test_torchrun_a_killed_rank_leaves_a_summary_naming_it(tmp_path):
    elapsed, output, summary = _torchrun_fault(tmp_path, signal.SIGKILL)
    assert summary["status"] == "failed" and summary["error_kind"] == "worker"
    assert "worker rank 1 of 2 died" in summary["error"], summary["error"]
    assert elapsed < 60, elapsed
    print(f"SIGKILL of rank 1: every rank gone after {elapsed:.1f} s")


@pytest.mark.slow
@LINUX
def test_torchrun_a_killed_rank0_leaves_a_summary_written_by_rank1(tmp_path):
    elapsed, output, summary = _torchrun_fault(tmp_path, signal.SIGKILL, victim=0)
    assert summary["status"] == "failed" and "worker rank 0 of 2 died" in summary["error"], summary["error"]
    assert elapsed < 60, elapsed
    print(f"SIGKILL of rank 0: every rank gone after {elapsed:.1f} s")


@pytest.mark.slow
@LINUX
def test_torchrun_timeout_ends_the_run(tmp_path):
    elapsed, output, summary = _torchrun_fault(tmp_path, None, "--timeout", "25")
    assert summary["error_kind"] == "stalled" and "did not finish within timeout_s=25" in summary["error"]
    print(f"--timeout 25: every rank gone {elapsed:.1f} s after the second evaluation")


def test_peer_monitor_verdicts_on_one_store():
    """Two ranks' monitors on one in-process store: a rank whose beats stop is named with its last
    step; the first verdict is the one every rank reports."""
    import torch.distributed as dist

    from lowbit.comm.liveness import PeerMonitor, WorkerStalled

    store = dist.HashStore()
    ends: list = []
    mons = [PeerMonitor(r, 2, stall_timeout_s=0.5, timeout_s=None, on_end=ends.append, store=store, interval_s=0.05)
            for r in range(2)]
    for m in mons:
        store.set(f"pid/{m.rank}", f"{m.pid} elsewhere")  # another host: no /proc shortcut
        m._publish()
    mons[1].beat(7)
    mons[1]._publish()
    mons[0]._read()
    mons[0].beat(8)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:  # rank 0 beats on, rank 1 is silent
        mons[0].beat()
        time.sleep(0.05)
    mons[0]._read()
    verdict = mons[0]._stalled(time.monotonic())
    assert isinstance(verdict, WorkerStalled) and "rank 1 (last step 7" in str(verdict) and "rank 0" not in str(verdict)
    first = mons[0]._publish_end(verdict, own=False)
    assert str(first) == str(verdict)
    second = mons[1]._publish_end(ValueError("later"), own=True)
    assert type(second) is WorkerStalled and str(second) == str(verdict)


def test_a_rank_that_ends_goes_on_ignoring_sigterm():
    """torchrun's agent sends SIGTERM to a rank once its peer died: a rank already ending with the
    run's verdict keeps ignoring it after the block, until it has written its summary and exited
    (the CI failure of 2026-11-28: rank 1 killed between the block and summary.json)."""
    from lowbit.comm.liveness import Terminated, sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    try:
        ending = False
        with pytest.raises(Terminated):
            with sigterm_as_interrupt("rank: signal {signum}", ignore_while=lambda: ending):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
        assert signal.getsignal(signal.SIGTERM) is before  # left running: the old handler is back
        with sigterm_as_interrupt("rank: signal {signum}", ignore_while=lambda: ending):
            ending = True
            os.kill(os.getpid(), signal.SIGTERM)  # ignored: the rank is ending
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)  # still ignored after the block
    finally:
        signal.signal(signal.SIGTERM, before)


# ---- 4. workers leave with their launcher ---------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


@pytest.mark.slow
@LINUX
def test_sigkill_of_the_launcher_ends_its_workers(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lowbit", *_train_args(out, "--steps", "1000000", "--eval-every", "5")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        workers: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None and not (
                len(workers) >= 2 and (out / "metrics.jsonl").exists()
                and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            workers = [p for p in _children(proc.pid) if "lowbit" in Path(f"/proc/{p}/cmdline").read_text()
                       or "multiprocessing" in Path(f"/proc/{p}/cmdline").read_text()]
            time.sleep(0.1)
        workers = [p for p in _children(proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 2, "the run never got going"
        t0 = time.monotonic()
        proc.kill()
        proc.wait()
        while any(_alive(p) for p in workers) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(_alive(p) for p in workers), "workers outlived their launcher"  # nobody left to append
    print(f"SIGKILL of the launcher: both workers gone after {elapsed:.2f} s")


def test_an_orphan_notices_without_the_parent_death_signal(tmp_path):
    """The portable fallback alone (no prctl): a child whose parent is SIGKILLed exits."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from lowbit.comm.liveness import watch_parent
        watch_parent(os.getppid(), pdeathsig=False, interval_s=0.1)
        open({str(tmp_path / "pid")!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """))
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, {str(child)!r}]); time.sleep(120)"])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int((tmp_path / "pid").read_text())
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        while _alive(pid) and time.monotonic() - t0 < 20:
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not _alive(pid)


# ---- 13. the per-collective limit, --checkpoint-dir, a full filesystem ----------------------
def test_collective_timeout_is_an_option_passed_to_the_launcher(monkeypatch, capsys):
    import lowbit.comm.launcher as launcher
    from lowbit.train.run import _torch_job

    assert main(["train", "--collective-timeout", "0"]) == 2
    assert "collective_timeout must be a number of seconds > 0" in capsys.readouterr().err
    assert main(["train", "--collective-timeout", "nan"]) == 2
    seen = {}
    monkeypatch.setattr(launcher, "launch", lambda *a, **kw: seen.update(kw) or [])
    _torch_job(TrainConfig(backend="torch", workers=2, collective_timeout=7.5), progress=False)
    assert seen["collective_timeout_s"] == 7.5


def _a_slow_barrier(transport):
    if transport.rank == 1:
        time.sleep(20)  # no heartbeat: the collective limit, not the stall timeout, must end rank 0's wait
    transport.barrier()
    return transport.rank


@pytest.mark.slow
def test_the_collective_limit_ends_a_wait():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 0"):
        launch(2, _a_slow_barrier, collective_timeout_s=3, stall_timeout_s=None)
    assert time.monotonic() - t0 < 19  # well before rank 1's 20 s: rank 0 gave up waiting


def test_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "out"
    code = main(["train", "--workers", "2", "--steps", "4", "--task", "quadratic", "--out", str(out), "--no-progress",
                 "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "afile")])
    assert code == 4
    assert f"--checkpoint-dir {tmp_path / 'afile'} is a file" in capsys.readouterr().err
    assert not (out / "summary.json").exists() and (out / "metrics.jsonl").read_text() == ""


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (root and mount needed; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount for a tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_read_only_and_full_checkpoint_dirs_are_refused_before_training(tmp_path, tiny_tmpfs, capsys):
    (tiny_tmpfs / "fill").write_bytes(b"\0" * (64 * 1024 - 2048))  # what is left is under one write test
    base = ["train", "--workers", "2", "--steps", "4", "--task", "quadratic", "--no-progress",
            "--checkpoint-every", "2"]
    assert main([*base, "--out", str(tmp_path / "o1"), "--checkpoint-dir", str(tiny_tmpfs / "ck")]) == 4
    err = capsys.readouterr().err
    assert f"--checkpoint-dir: cannot write {tiny_tmpfs / 'ck'}" in err and "filesystem is full" in err
    (tiny_tmpfs / "fill").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    assert main([*base, "--out", str(tmp_path / "o2"), "--checkpoint-dir", str(tiny_tmpfs / "ck")]) == 4
    err = capsys.readouterr().err
    assert f"--checkpoint-dir: cannot write {tiny_tmpfs / 'ck'} (Read-only file system)" in err
    assert not (tmp_path / "o2" / "summary.json").exists()


def test_a_full_filesystem_during_training_names_the_file_and_the_option(tmp_path, monkeypatch, capsys):
    import lowbit.integrations.checkpoint as checkpoint

    def full(state, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_checkpoint", full)
    monkeypatch.setattr("lowbit.train.loop.save_checkpoint", full)
    out = tmp_path / "out"
    code = main(["train", "--workers", "2", "--steps", "4", "--task", "quadratic", "--out", str(out), "--no-progress",
                 "--checkpoint-every", "2"])
    assert code == 4
    err = capsys.readouterr().err
    assert f"--checkpoint-dir: cannot write {out / 'checkpoints' / 'rank'}" in err and "No space left" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error_kind"] == "io" and "--checkpoint-dir" in summary["error"]


def test_a_full_filesystem_under_metrics_and_summary_names_the_file_and_out(tmp_path, monkeypatch):
    from lowbit.train.errors import NoSpace
    from lowbit.train.loop import _MetricsStream
    from lowbit.train.run import write_atomic

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    stream = _MetricsStream(str(tmp_path / "metrics.jsonl"), rank=0)
    monkeypatch.setattr(stream.f, "write", full)
    with pytest.raises(NoSpace, match=f"--out: cannot write {tmp_path / 'metrics.jsonl'}: No space left"):
        stream.write({"step": 0})
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(NoSpace, match=f"--out: cannot write {tmp_path / 'summary.json'}: No space left"):
        write_atomic(tmp_path / "summary.json", "{}")
    assert not (tmp_path / "summary.json").exists() and not list(tmp_path.glob(".summary.json.tmp-*"))
