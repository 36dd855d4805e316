"""Real network shaping (namespaces + tc tbf, user-space latency) and a two-host run over a veth pair."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings

import pytest

from lowbit.comm.shaping import ShapedNetwork, shaping_unavailable_reason
from lowbit.train.config import TrainConfig
from lowbit.train.run import train

needs_root = pytest.mark.skipif(shaping_unavailable_reason() is not None,
                                reason=f"real shaping unavailable: {shaping_unavailable_reason()}")


def test_shaping_needs_the_torch_backend():
    with pytest.raises(ValueError, match="shape_bandwidth/shape_latency need backend='torch'"):
        TrainConfig(backend="thread", shape_latency="1ms")
    with pytest.raises(ValueError, match="shape_bandwidth/shape_latency need backend='torch'"):
        TrainConfig(backend="thread", shape_bandwidth="100mbit")


def test_shaping_rejects_bad_units():
    with pytest.raises(ValueError, match="bandwidth"):
        TrainConfig(backend="torch", shape_bandwidth="fast")
    with pytest.raises(ValueError, match="latency"):
        TrainConfig(backend="torch", shape_latency="-1ms")


def test_shaping_reports_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="shape_bandwidth: .*root"):
        TrainConfig(backend="torch", shape_bandwidth="100mbit")
    TrainConfig(backend="torch", shape_latency="1ms")  # user-space latency needs no privileges


def _ns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_root
def test_shaped_network_is_deleted_also_after_a_failure():
    before = _ns_list()
    with pytest.raises(RuntimeError, match="boom"):
        with ShapedNetwork(2, 1e8) as net:
            assert set(net.namespaces) | {net.hub} <= _ns_list()
            raise RuntimeError("boom")
    assert _ns_list() == before


def _shaped(steps: int, bw: str, lat: str, **opts) -> dict:
    cfg = TrainConfig(backend="torch", workers=2, hidden=2048, steps=steps, eval_every=steps, bandwidth=bw,
                      latency=lat, shape_bandwidth=bw, shape_latency=lat, **opts)
    return train(cfg).summary


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("opts", [{"algorithm": "dqsg", "server": "ps"}, {"algorithm": "dpsgd"}],
                         ids=["one-way", "two-way"])
def test_shaped_wall_clock_matches_the_network_model(opts):
    """A wide digits-mlp (d = 153,610) over 5 Mbit/s links: each step moves 614 KB of fp32
    one way (DQSG with a server: codes up, the average down) or both ways at once (D-PSGD on
    two workers), about 1 s on the link, against milliseconds of compute; so the wall-clock
    of the extra steps is what the alpha-beta model predicts for their ledger (within 30%).
    Differencing two runs cancels process start-up and the evaluations. Other load on the
    machine can only add time (wall-clock, and the compute the model is given): up to three
    pairs are timed and the closest communication-bound one counts."""
    bw, lat = "5mbit", "5ms"
    tries = []
    for _ in range(3):
        short, long = _shaped(2, bw, lat, **opts), _shaped(8, bw, lat, **opts)
        predicted = long["emulated_seconds"] - short["emulated_seconds"]
        comm = long["emulated_comm_seconds"] - short["emulated_comm_seconds"]
        tries.append((long["wall_seconds"] - short["wall_seconds"], predicted, comm))
        if comm > 0.9 * predicted and tries[-1][0] == pytest.approx(predicted, rel=0.30):
            break
    # communication-bound (compute under 10% of the prediction), so the check is about the network
    bound = [t for t in tries if t[2] > 0.9 * t[1]]
    assert bound, tries
    measured, predicted, _ = min(bound, key=lambda t: abs(t[0] / t[1] - 1))
    assert measured == pytest.approx(predicted, rel=0.30), tries
    assert long["bytes_sent"] == train(TrainConfig(workers=2, hidden=2048, steps=8, eval_every=8,
                                                   **opts)).summary["bytes_sent"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _two_hosts(out, port: int, timeout_s: float, args: list[str] | None = None, nproc: int = 1) -> str | None:
    """One two-host torchrun of ``lowbit train`` (outputs in ``out/h0``, ``out/h1``): None when
    both hosts finished in time, else what went wrong and both logs. Everything it made is deleted afterwards.
    ``args``: the ``lowbit`` arguments (default: 2 workers, 10 steps); ``nproc``: workers per host."""
    tag = uuid.uuid4().hex[:6]
    hosts = [f"lowbit-{tag}-h0", f"lowbit-{tag}-h1"]
    ifs = ["lbv0", "lbv1"]
    addrs = ["10.232.0.1", "10.232.0.2"]
    if args is None:
        args = ["train", "--backend", "torch", "--workers", "2", "--steps", "10", "--eval-every", "5", "--no-progress"]
    try:
        for h in hosts:
            _ip("netns", "add", h)
        _ip("link", "add", ifs[0], "netns", hosts[0], "type", "veth", "peer", "name", ifs[1], "netns", hosts[1])
        for h, i, a in zip(hosts, ifs, addrs):
            _ip("-n", h, "addr", "add", f"{a}/24", "dev", i)
            _ip("-n", h, "link", "set", i, "up")
            _ip("-n", h, "link", "set", "lo", "up")
        # Each process writes to a file, never to a pipe nobody reads while we wait on the other.
        procs, logs = [], [out / f"h{r}.log" for r in range(2)]
        for r, (h, i) in enumerate(zip(hosts, ifs)):
            # LOGLEVEL=INFO: the agents log their end ("worker group successfully finished", "Done
            # waiting for other agents", "Error waiting on exit barrier"), so a log says where it stopped.
            env = {**os.environ, "GLOO_SOCKET_IFNAME": i, "LOGLEVEL": "INFO"}
            cmd = ["ip", "netns", "exec", h, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", str(nproc), "--node-rank", str(r), "--master-addr", addrs[0],
                   "--master-port", str(port), "-m", "lowbit", *args, "--out", str(out / f"h{r}")]
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        # Watch both hosts at once. An agent checks into torchrun's exit barrier only when its
        # worker succeeded, and the other agent waits there for 300 s: a host that fails late
        # looks like the other one hanging, so say which host did what.
        deadline = time.monotonic() + timeout_s
        codes = [None, None]
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
        for p, c in zip(procs, codes):
            if c is None:
                with contextlib.suppress(ProcessLookupError):  # it ended after the last poll
                    os.killpg(p.pid, signal.SIGKILL)  # torchrun and its workers
                p.wait()
        if all(c == 0 for c in codes):
            return None
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        running = [r for r, c in enumerate(codes) if c is None]
        return (f"host(s) {failed} failed, host(s) {running} still running after {timeout_s} s\n"
                + "\n".join(f"--- host {r} (exit code {c}) ---\n{log.read_text()[-3000:]}"
                            for r, (c, log) in enumerate(zip(codes, logs))))
    finally:
        for h in hosts:
            subprocess.run(["ip", "netns", "del", h], capture_output=True)


@needs_root
def test_two_hosts_joined_by_a_veth_pair_match_the_thread_run(tmp_path):
    """Two network namespaces, each a host with its own address on a veth pair; torchrun in
    each. A run takes 12-50 s here. Twice (about one run in twenty, under load; then not in
    42 stressed runs) host 0's torchrun did not exit after training. The likely cause: host 0's
    agent holds the rendezvous store and waits up to 300 s in torchrun's exit barrier for the
    other agent, which never checks in when its worker failed. So a run that hangs or fails
    is reported with what each host did and both logs as a warning, and tried once more on a
    fresh pair of hosts; a second one fails the test."""
    out = tmp_path / "first"
    out.mkdir()
    trouble = _two_hosts(out, 29517, timeout_s=120)
    if trouble is not None:
        warnings.warn(f"two-host torchrun did not finish, trying again: {trouble}")
        out = tmp_path / "second"
        out.mkdir()
        trouble = _two_hosts(out, 29518, timeout_s=240)
        assert trouble is None, f"two-host torchrun did not finish twice; the second: {trouble}"
    s = json.loads((out / "h0" / "summary.json").read_text())
    assert s["config"]["workers"] == 2
    ref = train(TrainConfig(workers=2, steps=10, eval_every=5)).summary
    assert s["bytes_sent"] == ref["bytes_sent"]
    assert s["final_train_loss"] == pytest.approx(ref["final_train_loss"], abs=1e-5)
