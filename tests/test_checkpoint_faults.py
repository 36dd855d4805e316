"""Checkpoint faults (issue 32): a refused newest checkpoint file (truncated, a flipped byte, a valid
checksum over missing content, a malicious pickle) is reported by name with the step every rank falls
back to, or refused with --resume-fallback error; every rank resumes from the same step; a restore that
fails on one rank fails every rank with the same error; a save killed midway leaves temporaries that the
next save or resume of that file removes. Under ``lowbit train`` (thread backend) and under the wrapper with two torchrun
processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from lowbit.cli import main
from lowbit.comm.inprocess import run_threads
from lowbit.integrations.checkpoint import (CheckpointError, CheckpointFallbackWarning, candidates, load_checkpoint,
                                            remove_stale_temporaries, save_checkpoint, seal)
from lowbit.train import train
from lowbit.train.config import TrainConfig
from lowbit.train.loop import run_worker

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(steps=12, workers=2, eval_every=5, algorithm="dpsgd", hidden=16)


# ---- the faults, written as a corrupt disk, another program or an attacker would ---------------
def _sealed(body: bytes) -> bytes:
    """``body`` (torch.save's bytes) with a valid lowbit checksum."""
    return seal(body)


class _Evil:
    """A pickle that would run code on load (``__reduce__``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def corrupt(path: Path, how: str, marker: Path) -> str:
    """Damage checkpoint ``path`` in place; returns a phrase of the reason its refusal gives."""
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
        return "truncated"
    if how == "flipped":
        path.write_bytes(raw[:-40] + bytes([raw[-40] ^ 0x01]) + raw[-39:])
        return "SHA-256 does not match"
    if how == "missing":  # a valid checksum over a state without the algorithm's tensors
        state = load_checkpoint(path)
        state["algorithm_state"] = {"extra": {}}
        buf = io.BytesIO()
        torch.save(state, buf)
        path.write_bytes(_sealed(buf.getvalue()))
        return "no field 'algorithm_state.tensors'"
    if how == "malicious":  # a valid header and checksum over a pickle that runs a command
        buf = io.BytesIO()
        torch.save({"step": 10, "x": _Evil(str(marker))}, buf)
        path.write_bytes(_sealed(buf.getvalue()))
        return "weights_only=True refuses"
    raise ValueError(how)


FAULTS = ["truncated", "flipped", "missing", "malicious"]


# ---- lowbit train (thread backend) --------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run checkpointed at steps 5 and 10 (rank{r}.pt at 10, rank{r}.pt.prev at 5), the files'
    bytes, and the uninterrupted run's parameters."""
    folder = tmp_path_factory.mktemp("ck")
    whole = train(TrainConfig(**BASE, checkpoint_every=5, checkpoint_dir=str(folder)))
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert sorted(files) == ["rank0.pt", "rank0.pt.prev", "rank1.pt", "rank1.pt.prev"]
    return files, [w.params for w in whole.workers]


def _folder(folder: Path, files: dict) -> Path:
    folder.mkdir(parents=True)
    for name, raw in files.items():
        (folder / name).write_bytes(raw)
    return folder


@pytest.mark.parametrize("how", FAULTS)
def test_train_reports_a_refused_newest_file_and_every_rank_resumes_from_the_agreed_step(tmp_path, trained, how):
    files, whole = trained
    folder = _folder(tmp_path / "ck", files)
    marker = tmp_path / "code-ran"
    phrase = corrupt(folder / "rank1.pt", how, marker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train(TrainConfig(**BASE, resume=str(folder)))
    notes = sorted(str(w.message) for w in caught if w.category is CheckpointFallbackWarning)
    assert len(notes) == 2, notes
    assert notes[0].startswith(f"rank 0: resuming from step 5 ({folder / 'rank0.pt.prev'})")
    assert f"{folder / 'rank0.pt'} is of step 10, which rank(s) [1] have no good checkpoint of" in notes[0]
    assert notes[1].startswith(f"rank 1: resuming from step 5 ({folder / 'rank1.pt.prev'})")
    assert f"{folder / 'rank1.pt'} was refused" in notes[1] and phrase in notes[1]
    # every rank resumed from step 5: the run ends bit-identical to the uninterrupted one
    for a, b in zip(whole, run.workers):
        assert torch.equal(a, b.params)
    assert run.summary["resume"]["resumed_from_step"] == 5 and run.summary["resume"]["fell_back"]
    assert str(folder / "rank1.pt") in run.summary["resume"]["refused"]
    assert not marker.exists()


def test_train_resume_fallback_error_refuses_a_corrupt_newest_file(tmp_path, trained):
    folder = _folder(tmp_path / "ck", trained[0])
    corrupt(folder / "rank1.pt", "flipped", tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"cannot resume: the newest checkpoint of rank\(s\) \[1\] was refused .*rank1\.pt is "
                                              r"corrupt.*fallback='error'"):
        train(TrainConfig(**BASE, resume=str(folder), resume_fallback="error"))
    intact = _folder(tmp_path / "intact", trained[0])  # nothing refused: 'error' resumes as 'warn' does
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointFallbackWarning)  # nothing to report
        run = train(TrainConfig(**BASE, resume=str(intact), resume_fallback="error"))
    assert run.summary["resume"] == {"resumed_from_step": 10, "fell_back": False, "refused": ""}


def test_train_both_files_of_a_rank_refused_is_an_error_naming_both(tmp_path, trained):
    folder = _folder(tmp_path / "ck", trained[0])
    corrupt(folder / "rank1.pt", "truncated", tmp_path / "m")
    corrupt(folder / "rank1.pt.prev", "missing", tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"no step has a good checkpoint on every rank.*rank1\.pt is truncated"
                                              r".*rank1\.pt\.prev has no field 'algorithm_state\.tensors'"):
        train(TrainConfig(**BASE, resume=str(folder)))
    corrupt(folder / "rank0.pt", "flipped", tmp_path / "m")  # every file refused: an error too, not a fresh start
    corrupt(folder / "rank0.pt.prev", "flipped", tmp_path / "m")
    with pytest.raises(CheckpointError, match="no step has a good checkpoint on every rank"):
        train(TrainConfig(**BASE, resume=str(folder), checkpoint_every=5))


def _train_format_1(state: dict) -> dict:
    """``state`` (a checkpoint of ``lowbit train`` now: the wrapper's, with the run's fields) in the
    layout of lowbit train's own former format 1: the parameters as one flat tensor, no module."""
    params = torch.cat([v.reshape(-1) for k, v in state["module"].items()])
    return {"format": 1, "rank": state["rank"], "world_size": state["world_size"], "step": state["step"],
            "config": state["config"], "params": params, "optimizer": state["optimizer"],
            "algorithm_state": state["algorithm_state"], "data_gen": state["data_gen"], "ledger": state["ledger"],
            "compute": state["compute"], "evals": state["evals"]}


def test_train_refuses_its_former_format_1_by_name_with_the_way_out(tmp_path, trained):
    folder = _folder(tmp_path / "ck", trained[0])
    assert load_checkpoint(folder / "rank0.pt")["format"] == 2  # lowbit train writes the wrapper's format
    for name in trained[0]:
        state = _train_format_1(load_checkpoint(folder / name))
        (folder / name).unlink()
        save_checkpoint(state, folder / name)
    with pytest.raises(CheckpointError) as e:
        train(TrainConfig(**BASE, resume=str(folder)))
    msg = str(e.value)
    assert f"checkpoint {folder / 'rank0.pt'} is of lowbit train's checkpoint format 1" in msg
    assert "start it afresh (without --resume, or with another --checkpoint-dir)" in msg


def _outcome(fn, *args):
    try:
        fn(*args)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_train_a_restore_failing_on_one_rank_fails_every_rank_with_the_same_error(tmp_path, trained):
    folder = _folder(tmp_path / "ck", trained[0])
    state = load_checkpoint(folder / "rank1.pt")
    state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"] * 2  # fields right, content wrong
    save_checkpoint(state, folder / "rank1.pt")  # (its old file becomes .prev: step 10 on both)
    cfg = TrainConfig(**BASE, resume=str(folder))
    t0 = time.monotonic()
    outcomes = run_threads(2, lambda t: _outcome(run_worker, t, cfg))
    assert time.monotonic() - t0 < 60
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"CheckpointError: cannot resume from {folder / 'rank1.pt'}: ValueError:")
    assert outcomes[0].endswith("(rank(s) [1])")


def test_resume_fallback_is_checked_by_name(capsys):
    with pytest.raises(ValueError, match=r"resume_fallback='later' is unknown; choose one of: warn, error"):
        TrainConfig(resume_fallback="later")
    assert main(["train", "--no-progress", "--resume-fallback", "later", "--steps", "1"]) == 2
    assert "resume_fallback='later' is unknown" in capsys.readouterr().err


# ---- a save killed midway -----------------------------------------------------------------------
_KILLED_SAVE = """
import importlib.util, os, signal, sys, torch
spec = importlib.util.spec_from_file_location("ck", sys.argv[3])  # the module alone: a quicker start
checkpoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checkpoint)
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "fsync":
    os.fsync = die  # killed after writing PATH.tmp-PID, before the rename
else:
    real = os.replace
    os.replace = lambda a, b: die() if a.endswith(".prev.tmp-" + str(os.getpid())) else real(a, b)
checkpoint.save_checkpoint({"step": 99, "w": torch.zeros(3)}, sys.argv[1])
"""


def _killed_save(path: Path, where: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path), where,
                           str(ROOT / "lowbit" / "integrations" / "checkpoint.py")], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def test_a_killed_saves_temporaries_are_removed_at_the_next_save_and_resume(tmp_path):
    path = tmp_path / "rank0.pt"
    save_checkpoint({"step": 1, "w": torch.ones(3)}, path)

    def temporaries():
        return sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name)

    _killed_save(path, "fsync")  # killed with its PATH.tmp-PID written
    (first,) = temporaries()
    _killed_save(path, "prev")  # this save removes the first one's; killed with PATH.prev.tmp-PID linked too
    left = temporaries()
    assert first not in left and [n.split(".tmp-")[0] for n in left] == ["rank0.pt.prev", "rank0.pt"], left
    assert load_checkpoint(path)["step"] == 1  # nothing lost
    assert len(temporaries()) == 2
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # its PID is no longer alive
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # a live process's temporary, another checkpoint's and other files are left alone
        keep = [f"rank0.pt.tmp-{alive.pid}", f"rank1.pt.tmp-{done.pid}", f"notes.tmp-{done.pid}",
                f"rank0.pt.tmp-x{done.pid}"]
        for name in keep:
            (tmp_path / name).write_bytes(b"x")
        save_checkpoint({"step": 2, "w": torch.ones(3)}, path)
        assert temporaries() == sorted(keep)
        assert load_checkpoint(path)["step"] == 2 and load_checkpoint(str(path) + ".prev")["step"] == 1
        (tmp_path / f"rank0.pt.prev.tmp-{done.pid}").write_bytes(b"x")
        assert load_checkpoint(path)["step"] == 2  # a plain read removes nothing (a reader elsewhere
        assert temporaries() == sorted(keep + [f"rank0.pt.prev.tmp-{done.pid}"])  # cannot see the writer's PID)
        assert [c.step for c in candidates(path)] == [2, 1]  # a resume of path removes them
        assert temporaries() == sorted(keep)
    finally:
        alive.kill()
        alive.wait()
    assert remove_stale_temporaries(path) == [str(tmp_path / f"rank0.pt.tmp-{alive.pid}")]


# ---- the wrapper under torchrun (two processes) -----------------------------------------------
_WRAPPER = textwrap.dedent('''
    """Each case: train 4 steps saving at 2 and 4, rank 1 damages its newest file, then every rank resumes."""
    import datetime, hashlib, io, json, os, sys, warnings
    import torch, torch.distributed as dist
    sys.path.insert(0, os.environ["FAULTS_DIR"])
    from test_checkpoint_faults import corrupt
    from lowbit.integrations import DecentralizedDataParallel
    from lowbit.integrations.checkpoint import load_checkpoint, save_checkpoint

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, root = dist.get_rank(), sys.argv[1]
    os.makedirs(root, exist_ok=True)

    def wrapper(seed):
        torch.manual_seed(seed)
        net = torch.nn.Linear(6, 2)
        return DecentralizedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), "dpsgd")

    def train(ddp, steps, path=None):
        while ddp.step_count < steps:
            g = torch.Generator().manual_seed(100 * ddp.step_count + rank)
            ddp.zero_grad()
            ddp(torch.randn(4, 6, generator=g)).pow(2).sum().backward()
            ddp.step()
            if path and ddp.step_count % 2 == 0:
                ddp.save_checkpoint(path)
                if ddp.step_count == 2:
                    at2 = ddp.flat.data.clone()
        return at2 if path else None

    for case, how, call in [("truncated", "truncated", "latest"), ("flipped", "flipped", "latest"),
                            ("missing", "missing", "latest"), ("malicious", "malicious", "latest"),
                            ("strict", "flipped", "strict"), ("missing-load", "missing", "load"),
                            ("load_state_dict", "shape", "load")]:
        path = os.path.join(root, case, f"rank{rank}.pt")
        ddp = wrapper(0)
        at2 = train(ddp, 4, path)
        ddp.close()
        dist.barrier()
        phrase = None
        if rank == 1:
            if how == "shape":  # a valid file whose module does not fit: load_state_dict raises
                state = load_checkpoint(path)
                state["module"]["weight"] = torch.zeros(3, 6)
                save_checkpoint(state, path)
                phrase = "size mismatch"
            else:
                phrase = corrupt(__import__("pathlib").Path(path), how, __import__("pathlib").Path(root) / "ran")
        dist.barrier()
        ddp = wrapper(7)  # another x_0: what it resumes comes from the checkpoint
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if call == "load":
                    ddp.load_checkpoint(path)
                    got = ddp.step_count
                else:
                    got = ddp.resume_latest(path, fallback="error" if call == "strict" else "warn")
                error = None
            except Exception as e:
                got, error = None, f"{type(e).__name__}: {e}"
        same = got is not None and torch.equal(ddp.flat.data, at2)
        if error is None:  # (after an error the ranks hold different states: no close(), whose agreement says so)
            train(ddp, 6)  # training goes on together from the agreed step
            ddp.close()
        with open(os.path.join(root, f"records{rank}.jsonl"), "a") as f:  # (one file per rank: no interleaving)
            f.write(json.dumps({"case": case, "rank": rank, "step": got, "error": error, "same_as_step2": same,
                                "warnings": [str(w.message) for w in caught], "phrase": phrase,
                                "code_ran": os.path.exists(os.path.join(root, "ran"))}) + "\\n")
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not a teardown at exit: it sometimes aborts after the work is done (docs/FAULTS.md)
''')


@pytest.fixture(scope="module")
def wrapper_cases(tmp_path_factory):
    """Every case's record on every rank (one torchrun launch of two processes for all cases)."""
    tmp = tmp_path_factory.mktemp("wrapper")
    script = tmp / "cases.py"
    script.write_text(_WRAPPER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FAULTS_DIR": str(ROOT / "tests")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp / "ck")], env=env, capture_output=True, text=True, timeout=240,
                         cwd=tmp)
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    records = [json.loads(line) for r in (0, 1) for line in (tmp / "ck" / f"records{r}.jsonl").read_text().splitlines()]
    by_case: dict[str, dict[int, dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["rank"]] = r
    assert all(sorted(v) == [0, 1] for v in by_case.values()) and len(by_case) == 7, by_case.keys()
    return by_case, elapsed, tmp / "ck"


@pytest.mark.parametrize("how", FAULTS)
def test_wrapper_resume_latest_reports_a_refused_newest_file_on_every_rank(wrapper_cases, how):
    by_case, _, ck = wrapper_cases
    r0, r1 = by_case[how][0], by_case[how][1]
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["step"] == r1["step"] == 2 and r0["same_as_step2"] and r1["same_as_step2"]
    assert len(r1["warnings"]) == 1 and len(r0["warnings"]) == 1, (r0, r1)
    file1 = str(ck / how / "rank1.pt")
    assert r1["warnings"][0].startswith(f"rank 1: resuming from step 2 ({file1}.prev)")
    assert f"{file1} was refused" in r1["warnings"][0] and r1["phrase"] in r1["warnings"][0]
    assert r0["warnings"][0].startswith(f"rank 0: resuming from step 2 ({ck / how / 'rank0.pt'}.prev)")
    assert "rank(s) [1] have no good checkpoint of" in r0["warnings"][0] and file1 in r0["warnings"][0]
    assert not r0["code_ran"] and not r1["code_ran"]


def test_wrapper_resume_latest_fallback_error_fails_every_rank_alike(wrapper_cases):
    r0, r1 = wrapper_cases[0]["strict"][0], wrapper_cases[0]["strict"][1]
    assert r0["error"] == r1["error"] is not None, (r0, r1)
    assert r0["error"].startswith("CheckpointError: cannot resume: the newest checkpoint of rank(s) [1] was refused")
    assert f"{wrapper_cases[2] / 'strict' / 'rank1.pt'} is corrupt" in r0["error"] and "fallback='error'" in r0["error"]


@pytest.mark.parametrize("case", ["missing-load", "load_state_dict"])
def test_wrapper_load_checkpoint_failing_on_one_rank_fails_every_rank_with_the_same_error(wrapper_cases, case):
    by_case, elapsed, ck = wrapper_cases
    r0, r1 = by_case[case][0], by_case[case][1]
    assert r0["error"] == r1["error"] is not None, (r0, r1)
    file1 = str(ck / case / "rank1.pt")
    assert r0["error"].startswith("CheckpointError: ") and r0["error"].endswith("(rank(s) [1])")
    assert file1 in r0["error"] and r1["phrase"] in r0["error"]
    if case == "load_state_dict":
        assert f"cannot resume from {file1}: RuntimeError: Error(s) in loading state_dict" in r0["error"]
    assert elapsed < 200  # liveness: the whole launch, every case on both ranks
