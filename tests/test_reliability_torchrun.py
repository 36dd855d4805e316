"""A worker killed at a random step under ``torchrun --max-restarts 1``: the example resumes
from its last good checkpoint by itself and ends with the uninterrupted run's model."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowbit.integrations.checkpoint import CheckpointError, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchrun_cnn.py"
STEPS = 400


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cmd(*extra, restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), str(EXAMPLE), "--steps", str(STEPS), "--eval-every", "1000", *extra]


def _digests(out: str) -> str:
    m = re.search(r"per rank: ([0-9a-f ]+)", out)
    assert m, out[-3000:]
    return m.group(1).strip()


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` under the torchrun process ``parent`` (from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def _saved_step(path: Path) -> int:
    try:
        return int(load_checkpoint(path)["step"])
    except CheckpointError:
        return -1


def _kill_rank1_and_finish(cmd, ck, kill_after, cwd) -> str:
    """Run ``cmd`` (torchrun with a restart allowed), SIGKILL rank 1 once its checkpoint in ``ck``
    has passed step ``kill_after``, and return the run's output; the kill happened and the run
    still ended well."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=cwd)
    try:
        deadline = time.monotonic() + 240
        victim = None
        while time.monotonic() < deadline and proc.poll() is None:
            if (ck / "rank1.pt").exists() and _saved_step(ck / "rank1.pt") >= kill_after:
                victim = _rank_pid(proc.pid, 1)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert victim is not None, f"never killed a worker (run too fast?):\n{out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_worker_killed_at_random_step_resumes_to_the_uninterrupted_model(tmp_path):
    whole = subprocess.run(_cmd(), capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = _digests(whole.stdout)

    kill_after = random.Random().randrange(20, 200, 10)  # a checkpointed step; the kill lands a little later
    ck = tmp_path / "ck"
    out = _kill_rank1_and_finish(_cmd("--checkpoint", str(ck), "--checkpoint-every", "10", restarts=1), ck,
                                 kill_after, tmp_path)
    m = re.search(r"resumed from step (\d+)", out)
    assert m, f"no resume after the kill at step >= {kill_after}:\n{out[-3000:]}"
    assert int(m.group(1)) >= kill_after
    assert _digests(out) == expected


def _train_cmd(out, *extra, restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), "-m", "lowbit", "train", "--backend", "torch", "--workers", "2",
            "--steps", str(STEPS), "--hidden", "16", "--eval-every", "100", "--out", str(out), "--no-progress", *extra]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_lowbit_train_resumes_by_itself_after_a_worker_is_killed(tmp_path):
    import json

    whole = subprocess.run(_train_cmd(tmp_path / "whole"), capture_output=True, text=True, env=_env(), timeout=300,
                           cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    kill_after = random.Random().randrange(20, 200, 20)
    ck = tmp_path / "ck"
    _kill_rank1_and_finish(_train_cmd(tmp_path / "killed", "--checkpoint-every", "20", "--resume", str(ck), restarts=1),
                           ck, kill_after, tmp_path)
    a = json.loads((tmp_path / "whole" / "summary.json").read_text())
    b = json.loads((tmp_path / "killed" / "summary.json").read_text())
    for key in ("final_train_loss", "final_test_accuracy", "final_consensus_distance", "bytes_sent", "messages_sent"):
        assert a[key] == b[key], key
