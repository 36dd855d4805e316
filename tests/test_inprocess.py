"""The thread runtime's scheduling (run slots, mailboxes, blocking) and where
processes compute under torchrun: results never depend on how many workers run
at once, a waiting worker lets another run, and the choice of backend when
processes outnumber GPUs (the GPU count faked)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from lowbit.algorithms import ADPSGD, Moniqua
from lowbit.comm import run_threads
from lowbit.comm.distributed import default_backend, init_from_env
from lowbit.comm.inprocess import ThreadWorld, blocking, default_max_running, prepare_cuda
from lowbit.topology import make_topology
from lowbit.train.config import resolve_device

N, D = 5, 40


def _moniqua_and_collectives(t, steps=6):
    """Moniqua gossip (exchanges, a repair round where theta is exceeded) and every
    collective, on per-rank data: what each rank ends with."""
    g = torch.Generator().manual_seed(t.rank)
    x = torch.randn(D, generator=g, dtype=torch.float64) * (0.05 + 0.2 * (t.rank == 2))
    algo = Moniqua(bits=2, theta=0.2).worker(t, make_topology("ring", t.world_size), seed=1)
    algo.setup(x)
    out = []
    for k in range(steps):
        t.set_step(k)
        algo.before_update(k, x, torch.zeros_like(x), 0.1)
        x -= 0.01 * torch.sin(x * (t.rank + 1))
        out += [t.all_reduce(x, "sum"), t.broadcast(x, k % t.world_size), *t.all_gather(x[:3])]
        t.barrier()
    return x.clone(), torch.cat([o.reshape(-1) for o in out]), algo.state.mismatches, t.ledger.bytes_sent


@pytest.mark.filterwarnings("ignore:moniqua")
def test_results_do_not_depend_on_how_many_workers_run_at_once():
    runs = {m: run_threads(N, _moniqua_and_collectives, max_running=m) for m in (1, 2, N)}
    ref = runs[N]
    assert sum(r[2] for r in ref) > 0  # the repair round ran too
    for m in (1, 2):
        for got, want in zip(runs[m], ref):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[2:] == want[2:]


def test_asynchronous_gossip_runs_with_one_slot():
    """AD-PSGD's exchanges (the active thread runs the passive's handler) with one run slot:
    no deadlock, and the same models as with a slot per worker."""
    topo = make_topology("ring", 4)

    def worker(t):
        x = torch.full((8,), float(t.rank), dtype=torch.float64)
        algo = ADPSGD(slow={1: 2.0}).worker(t, topo, seed=0)
        algo.setup(x)
        for k in range(5):
            algo.before_update(k, x, torch.zeros_like(x), 0.1)
            x -= 0.01 * (t.rank + 1)
            algo.after_update(k, x, torch.zeros_like(x), 0.1)
        algo.finish()
        return x.clone()

    one, every = run_threads(4, worker, max_running=1), run_threads(4, worker, max_running=4)
    assert all(torch.equal(a, b) for a, b in zip(one, every))


def test_at_most_max_running_workers_compute_at_once():
    running, peak, lock = [0], [0], threading.Lock()

    def worker(t):
        for k in range(4):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.005)  # "compute" while holding the slot
            with lock:
                running[0] -= 1
            t.neighbor_exchange(torch.full((3,), t.rank, dtype=torch.uint8), [(t.rank + 1) % 6, (t.rank - 1) % 6])
            t.all_reduce(torch.ones(2))
        return True

    assert run_threads(6, worker, max_running=2) == [True] * 6
    assert 1 <= peak[0] <= 2


def test_blocking_gives_the_slot_to_another_worker():
    """With one slot, rank 0 waits (inside ``blocking``) for something rank 1 does:
    only possible if the wait gave the slot up."""
    done = threading.Event()

    def worker(t):
        if t.rank == 0:
            with blocking():
                got = done.wait(timeout=30)
            return got
        done.set()
        return True

    assert run_threads(2, worker, max_running=1) == [True, True]
    with blocking():  # outside thread workers: nothing to give up
        pass


def test_a_failure_releases_workers_waiting_for_a_slot():
    def worker(t):
        if t.rank == 0:
            raise ZeroDivisionError("rank 0 fails")
        t.barrier()
        return True

    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="rank 0 fails"):
        run_threads(4, worker, max_running=1)
    assert time.monotonic() - start < 30  # released, not timed out


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_max_running_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_running must be an int >= 1"):
        ThreadWorld(3, max_running=bad)


def test_default_max_running_is_the_cores_at_most_the_workers():
    assert default_max_running(1) == 1
    assert 1 <= default_max_running(64) <= 64
    assert ThreadWorld(3, max_running=10).run_slots.limit == 3


def test_prepare_cuda_does_nothing_on_the_cpu():
    prepare_cuda("cpu")
    prepare_cuda(None)  # CUDA not initialised (or absent): nothing to load


# ---- torchrun: more processes than GPUs on a host ------------------------------------------
def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_default_backend_is_nccl_only_with_a_gpu_per_process(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _fake_gpus(monkeypatch, 0)
    assert default_backend() == "gloo"
    _fake_gpus(monkeypatch, 1)
    assert default_backend() == "nccl"  # one process (no torchrun)
    for procs, gpus, backend in ((2, 1, "gloo"), (2, 2, "nccl"), (8, 4, "gloo"), (3, 4, "nccl")):
        _fake_gpus(monkeypatch, gpus)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(procs))
        assert default_backend() == backend, (procs, gpus)


def _torchrun_env(monkeypatch, rank, world, local_rank, local_world):
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank),
                        ("LOCAL_WORLD_SIZE", local_world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("local_rank", [0, 1])
def test_nccl_with_more_processes_than_gpus_is_a_clear_error(monkeypatch, local_rank):
    """Every rank refuses (not only the one without a GPU), before joining any group."""
    _fake_gpus(monkeypatch, 1)
    _torchrun_env(monkeypatch, local_rank, 2, local_rank, 2)
    with pytest.raises(ValueError, match=r"2 processes on this host but only 1 CUDA device.*nproc-per-node 1.*gloo"):
        init_from_env(backend="nccl")


def test_processes_share_the_gpus_under_gloo(monkeypatch):
    """Two processes on one GPU: the default backend is gloo and local rank 1 computes on
    GPU 0 (rank 1 of a world of 2 cannot be started here, so the group is this one
    process with torchrun's local numbering)."""
    import torch.distributed as dist

    _fake_gpus(monkeypatch, 1)
    _torchrun_env(monkeypatch, 0, 1, 1, 2)
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 0)
    assert resolve_device("auto", local_rank=3) == torch.device("cuda", 0)
    t = init_from_env()
    try:
        assert t.backend == "gloo" and dist.get_backend() == "gloo"
    finally:
        t.close()
