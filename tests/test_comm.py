"""comm: both runtimes (threads, real processes over gloo) give the same
results and the same ledgers; ledger byte counts; the network model; the launcher.

The process runtime is launched once per world size (spawning costs seconds):
one module-level worker runs every check and returns what it saw.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lowbit.comm import (
    CommRecord,
    NetworkModel,
    TorchDistributedTransport,
    Transport,
    init_from_env,
    is_torchrun,
    launch,
    parse_bandwidth,
    parse_latency,
    run_threads,
)
from lowbit.comm.netmodel import ring_allreduce_sent_bytes

WORLD_SIZES = (1, 2, 3, 4)
SEED = 7
OPS = ("sum", "max", "min")
DTYPES = {"float32": torch.float32, "int32": torch.int32}
BASE = (3, -1, 4, -1, 5, -9, 2, 6)  # 8 elements, shaped (2, 4)
M_BYTES = 8 * 4  # float32 and int32 buffers alike


# ---- neighbour sets (all symmetric) ---------------------------------------------
def ring_nbrs(r: int, n: int) -> list[int]:
    if n == 1:
        return []
    if n == 2:
        return [1 - r]
    return [(r - 1) % n, (r + 1) % n]


def complete_nbrs(r: int, n: int) -> list[int]:
    return [j for j in range(n) if j != r]


def star_nbrs(r: int, n: int) -> list[int]:
    return complete_nbrs(0, n) if r == 0 else [0]


def pair_nbrs(r: int, n: int) -> list[int]:
    """0-1, 2-3, ...; with n odd the last rank has no neighbour."""
    j = r ^ 1
    return [j] if j < n else []


TOPOLOGIES = {"ring": ring_nbrs, "complete": complete_nbrs, "star": star_nbrs, "pairs": pair_nbrs}


# ---- what each rank holds ----------------------------------------------------------
def values(r: int, dtype: torch.dtype) -> torch.Tensor:
    """Small exact numbers (dyadic floats), so any summation order gives the same sum."""
    x = torch.tensor(BASE, dtype=torch.float64).reshape(2, 4) * (r + 1) - 2 * r
    if dtype.is_floating_point:
        x = x * 0.25
    return x.to(dtype)


def nbuf(r: int, seed: int) -> torch.Tensor:
    """Rank r sends r+1 bytes of value r+seed: sizes differ per rank."""
    return torch.full((r + 1,), (r + seed) % 256, dtype=torch.uint8)


def noisy(r: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + r)
    return torch.randn(100, generator=g)


# ---- the worker: runs every check on one rank (module level: spawn pickles it) -------
def checks(t: Transport, seed: int) -> dict:
    r, n = t.rank, t.world_size
    out: dict = {"rank": r, "world_size": n, "fresh": []}

    t.set_step(0)
    for name, dtype in DTYPES.items():
        x = values(r, dtype)
        keep = x.clone()
        for op in OPS:
            y = t.all_reduce(x, op)
            out[f"all_reduce/{op}/{name}"] = y
            out["fresh"].append(y.data_ptr() != x.data_ptr() and torch.equal(x, keep))

    t.set_step(1)
    out["all_gather"] = t.all_gather(values(r, torch.float32))
    out["broadcast"] = t.broadcast(values(r, torch.int32), src=n - 1)
    out["gather"] = t.gather(values(r, torch.float32), dst=n // 2)

    t.set_step(2)
    for name, nbrs in TOPOLOGIES.items():
        buf = nbuf(r, seed)
        got = t.neighbor_exchange(buf, nbrs(r, n))
        out[f"neighbor/{name}"] = got
        out["fresh"].append(all(v.data_ptr() != buf.data_ptr() for v in got.values()))
    # an empty buffer on rank 0
    out["neighbor/empty0"] = t.neighbor_exchange(nbuf(r, seed)[:r], ring_nbrs(r, n))

    # a float sum of arbitrary values: in rank order when the runtime can be asked to
    det = getattr(t, "deterministic", None)
    if det is not None:
        t.deterministic = True
    out["float_sum_exact"] = t.all_reduce(noisy(r), "sum")
    if det is not None:
        t.deterministic = det

    with t.untracked():  # none of these reach the ledger
        t.all_reduce(torch.ones(1000))
        t.neighbor_exchange(torch.zeros(999, dtype=torch.uint8), ring_nbrs(r, n))
        t.all_gather(torch.ones(998))
        t.broadcast(torch.ones(997), src=0)
        t.gather(torch.ones(996), dst=0)
    out["float_sum_native"] = t.all_reduce(noisy(r), "sum")
    t.barrier()
    out["ledger"] = t.ledger.to_rows()
    return out


def expected(n: int, seed: int) -> list[dict]:
    """What every rank must see, computed from the definitions."""
    res = []
    for r in range(n):
        e: dict = {"rank": r, "world_size": n}
        for name, dtype in DTYPES.items():
            parts = [values(j, dtype) for j in range(n)]
            s = parts[0].clone()
            for p in parts[1:]:
                s += p
            e[f"all_reduce/sum/{name}"] = s
            e[f"all_reduce/max/{name}"] = torch.stack(parts).amax(0)
            e[f"all_reduce/min/{name}"] = torch.stack(parts).amin(0)
        e["all_gather"] = [values(j, torch.float32) for j in range(n)]
        e["broadcast"] = values(n - 1, torch.int32)
        e["gather"] = [values(j, torch.float32) for j in range(n)] if r == n // 2 else None
        for name, nbrs in TOPOLOGIES.items():
            e[f"neighbor/{name}"] = {j: nbuf(j, seed) for j in nbrs(r, n)}
        e["neighbor/empty0"] = {j: nbuf(j, seed)[:j] for j in ring_nbrs(r, n)}
        res.append(e)
    return res


def assert_same(a, b, where: str = "") -> None:
    """Exact equality of nested results: tensors by dtype, shape and values; dict key order too."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, f"{where}: {a} vs {b}"
        assert torch.equal(a, b), f"{where}: {a} vs {b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def runs(request):
    n = request.param
    threads = run_threads(n, functools.partial(checks, seed=SEED))
    procs = launch(n, checks, SEED, backend="gloo", timeout_s=120)
    return n, threads, procs


# ---- both runtimes ------------------------------------------------------------------
def test_results_match_definitions(runs):
    n, threads, procs = runs
    for runtime, res in (("threads", threads), ("gloo", procs)):
        assert [o["rank"] for o in res] == list(range(n))
        for r, (got, want) in enumerate(zip(res, expected(n, SEED))):
            for k, v in want.items():
                assert_same(got[k], v, f"{runtime} rank {r} {k}")


def test_runtimes_identical(runs):
    n, threads, procs = runs
    for r in range(n):
        a = {k: v for k, v in threads[r].items() if k != "float_sum_native"}
        b = {k: v for k, v in procs[r].items() if k != "float_sum_native"}
        assert_same(a, b, f"rank {r}")
        # the backend's own summation order may differ from rank order in the last bits
        torch.testing.assert_close(threads[r]["float_sum_native"], procs[r]["float_sum_native"])


def test_new_tensors_and_inputs_untouched(runs):
    _, threads, procs = runs
    for res in (threads, procs):
        for o in res:
            assert all(o["fresh"])


def test_ledger_bytes(runs):
    n, threads, procs = runs
    for r in range(n):
        rows = procs[r]["ledger"]
        assert rows == threads[r]["ledger"]
        # 6 all-reduces, 3 collectives, 5 exchanges, 2 float sums; untracked ops absent
        assert [s for s, *_ in rows] == [0] * 6 + [1] * 3 + [2] * 7
        assert all(nbytes < 996 for _, _, nbytes, *_ in rows)
        for step, op, nbytes, sent, messages, peers in rows[:6]:
            assert (op, nbytes) == ("all_reduce", M_BYTES)
            assert sent == 2 * (n - 1) * M_BYTES // n == ring_allreduce_sent_bytes(M_BYTES, n)
            assert messages == 2 * (n - 1)
        nb_rows = [row for row in rows if row[1] == "neighbor"]
        sizes = [r + 1] * len(TOPOLOGIES) + [r]
        nbr_sets = [f(r, n) for f in TOPOLOGIES.values()] + [ring_nbrs(r, n)]
        assert len(nb_rows) == len(sizes)
        for (_, _, nbytes, sent, messages, peers), size, nbrs in zip(nb_rows, sizes, nbr_sets):
            assert nbytes == size
            assert peers == len(nbrs)
            if n > 1:
                assert sent == size * len(nbrs) and messages == len(nbrs)
            else:
                assert sent == 0
        ag = [row for row in rows if row[1] == "all_gather"][0]
        assert ag[3] == (n - 1) * M_BYTES


# ---- network model --------------------------------------------------------------------
def test_network_model_neighbor_seconds():
    model = NetworkModel.parse("100Mbit", "1ms")
    rec = CommRecord("neighbor", 10**6, 10**6, 1, 1)
    assert model.op_seconds(rec, 2) == pytest.approx(1e-3 + 8e6 / 1e8)
    assert model.op_seconds(rec, 1) == 0.0


@pytest.mark.parametrize(
    "text,bits", [("100Mbit", 1e8), ("1Gbit", 1e9), ("200mbps", 2e8), ("1gbit", 1e9), (5e6, 5e6)]
)
def test_parse_bandwidth(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text,seconds", [("1ms", 1e-3), ("150us", 1.5e-4), ("0.002s", 2e-3), (0, 0.0)])
def test_parse_latency(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["abc", "-100Mbit", "-1", -5.0, 0, ""])
def test_parse_bandwidth_rejects(bad):
    with pytest.raises(ValueError):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["abc", "-1ms", "-0.5", -1e-3, ""])
def test_parse_latency_rejects(bad):
    with pytest.raises(ValueError):
        parse_latency(bad)


# ---- launcher and environment ---------------------------------------------------------
def failing(t: Transport, bad_rank: int):
    if t.rank == bad_rank:
        raise ValueError(f"boom from rank {t.rank}")
    t.barrier()  # the others wait for the failed rank until terminated
    return t.rank


def test_launcher_surfaces_worker_exception():
    with pytest.raises(RuntimeError) as info:
        launch(2, failing, 1, timeout_s=60)
    msg = str(info.value)
    assert "rank 1" in msg and "ValueError" in msg and "boom from rank 1" in msg
    assert "Traceback" in msg


def test_launch_validates_arguments():
    with pytest.raises(ValueError, match="world_size"):
        launch(0, failing, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch(1, failing, 0, timeout_s=0)


def test_init_from_env_needs_torchrun_variables(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    assert not is_torchrun()
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_from_env("gloo")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert is_torchrun()
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        init_from_env("gloo")


def test_transport_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        TorchDistributedTransport()


# ---- futures: the asynchronous collectives ------------------------------------------
def async_checks(t: Transport) -> dict:
    """Each async op against its synchronous form, and the ledger rows of both."""
    from lowbit.comm.base import then

    r = t.rank
    out: dict = {"same": [], "futures": []}
    for name, dtype in DTYPES.items():
        x = values(r, dtype)
        for op in OPS + (("band",) if not dtype.is_floating_point else ()):
            t.set_step(0)
            want = t.all_reduce(x, op)
            t.set_step(1)
            fut = t.all_reduce_async(x, op)
            out["futures"].append(isinstance(fut, torch._C.Future))  # torch.futures.Future or a .then of one
            out["same"].append(torch.equal(fut.wait(), want))
            out[f"async/{op}/{name}"] = want
    t.set_step(0)
    want = t.all_gather(values(r, torch.float32))
    t.set_step(1)
    got = t.all_gather_async(values(r, torch.float32)).wait()
    out["same"].append(len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)))
    det = getattr(t, "deterministic", None)
    if det is not None:  # a float sum in rank order, through the future too
        t.deterministic = True
    with t.untracked():
        out["same"].append(torch.equal(t.all_reduce_async(noisy(r), "sum").wait(), t.all_reduce(noisy(r), "sum")))
    if det is not None:
        t.deterministic = det
    # then(): at once on a done future, and the chained value
    t.set_step(2)
    out["chained"] = then(t.all_reduce_async(torch.ones(2), "sum"), lambda v: v * 2).wait()
    rows = t.ledger.to_rows()
    out["ledger_sync"] = [row[1:] for row in rows if row[0] == 0]
    out["ledger_async"] = [row[1:] for row in rows if row[0] == 1]
    return out


def group_checks(t: Transport) -> dict:
    """A transport on the process group of global ranks 1 and 2 (a 3-process launch)."""
    import torch.distributed as dist

    group = dist.new_group([1, 2])  # every rank takes part in creating it
    if dist.get_rank() == 0:
        with pytest.raises(ValueError, match="not in the group"):
            TorchDistributedTransport(process_group=group)
        return {}
    g = TorchDistributedTransport(process_group=group)
    r = g.rank
    return {"rank": r, "world_size": g.world_size,
            "sum": g.all_reduce_async(torch.tensor([float(r + 1)]), "sum").wait(),
            "gathered": g.all_gather(torch.tensor([r])),
            "broadcast": g.broadcast(torch.tensor([10 + r]), src=0),
            "neighbor": g.neighbor_exchange(torch.full((r + 1,), r, dtype=torch.uint8), [1 - r]),
            "ledger": len(g.ledger.to_rows())}


def _async_and_group(t: Transport) -> dict:
    return {"async": async_checks(t), "group": group_checks(t)}


@pytest.fixture(scope="module")
def async_runs():
    return run_threads(3, async_checks), launch(3, _async_and_group, backend="gloo", timeout_s=120)


def test_async_ops_are_the_synchronous_ops(async_runs):
    threads, procs = async_runs
    for res in list(threads) + [p["async"] for p in procs]:
        assert all(res["futures"]) and all(res["same"])
        assert res["ledger_async"] == res["ledger_sync"] and len(res["ledger_sync"]) == 8
        assert torch.equal(res["chained"], torch.full((2,), 6.0))
    for a, b in zip(threads, procs):  # both runtimes give the same numbers
        assert_same({k: v for k, v in a.items() if k.startswith("async/")},
                    {k: v for k, v in b["async"].items() if k.startswith("async/")})
    band = threads[0]["async/band/int32"]
    assert torch.equal(band, values(0, torch.int32) & values(1, torch.int32) & values(2, torch.int32))


def test_transport_on_a_process_group(async_runs):
    _, procs = async_runs
    assert procs[0]["group"] == {}
    for r, p in enumerate(procs[1:]):
        g = p["group"]
        assert (g["rank"], g["world_size"]) == (r, 2)
        assert torch.equal(g["sum"], torch.tensor([3.0]))
        assert_same(g["gathered"], [torch.tensor([0]), torch.tensor([1])])
        assert torch.equal(g["broadcast"], torch.tensor([10]))  # group rank 0 is global rank 1
        assert_same(g["neighbor"], {1 - r: torch.full((2 - r,), 1 - r, dtype=torch.uint8)})
        assert g["ledger"] == 4


def test_then_raises_with_the_error_type_on_a_done_future():
    from lowbit.comm.base import completed, then

    def boom(v):
        raise ValueError(f"bad {v}")

    with pytest.raises(ValueError, match="bad 1"):
        then(completed(1), boom)
    with pytest.raises(ValueError, match="band.*integer"):
        run_threads(1, lambda t: t.all_reduce_async(torch.ones(2), "band"))


def test_then_reads_a_done_future_with_wait():
    """An NCCL collective's future is done once its kernels are queued; its value is safe to read
    only after ``wait()``, which makes the current CUDA stream wait for them (``value()`` does not:
    on an H200 the DDP hooks then decoded stale memory)."""
    from lowbit.comm.base import then

    class Queued:  # a done future whose value() is not yet synchronised
        def done(self):
            return True

        def value(self):
            return "stale"

        def wait(self):
            return "synchronised"

    assert then(Queued(), lambda v: v).wait() == "synchronised"


def test_a_collective_done_at_issue_needs_no_future_hop():
    """The torch runtime's asynchronous collectives: a work whose future is done at issue (an
    NCCL one, its kernels queued) gives its result after ``wait()`` with no ``Future.then``;
    one still running (gloo) chains it, and its error reaches ``wait()``."""
    from lowbit.comm.distributed import _future

    class Work:
        def __init__(self, done):
            self.fut = torch.futures.Future()
            if done:
                self.fut.set_result(None)
            self.hops = 0
            then = self.fut.then

            def counted(fn):
                self.hops += 1
                return then(fn)

            self.fut.then = counted

        def get_future(self):
            return self.fut

    done = Work(done=True)
    assert _future(done, lambda: 7).wait() == 7 and done.hops == 0
    running = Work(done=False)
    fut = _future(running, lambda: 8)
    assert running.hops == 1 and not fut.done()
    running.fut.set_result(None)
    assert fut.wait() == 8
    failing = Work(done=False)
    fut = _future(failing, lambda: 9)
    failing.fut.set_exception(RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        fut.wait()


def test_nccl_has_no_bitwise_and_and_the_max_norm_hook_then_sends_the_uint8_min():
    """NCCL reduces no ``band``: a TorchDistributedTransport on NCCL leaves it out of
    ``reduce_ops`` and refuses it by name; the multi-scale hook's scale-index MIN then goes as
    one uint8 MIN all-reduce instead of packed bit-planes (same result)."""
    from lowbit.codecs import MultiScaleMaxNormCodec
    from lowbit.comm.distributed import TorchDistributedTransport
    from lowbit.comm.inprocess import ThreadTransport
    from lowbit.integrations.ddp_hooks.maxnorm import _scale_reduce

    nccl = object.__new__(TorchDistributedTransport)
    nccl._nccl = True
    assert "band" not in nccl.reduce_ops and "min" in nccl.reduce_ops
    nccl._nccl = False
    assert "band" in nccl.reduce_ops

    class NoAnd(ThreadTransport):
        reduce_ops = ("sum", "max", "min")

    codec = MultiScaleMaxNormCodec(scales=(2, 6))
    idx = [torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8), torch.tensor([1, 1, 0, 1, 0], dtype=torch.uint8)]

    def worker(t, no_and):
        if no_and:
            t.__class__ = NoAnd
        got = _scale_reduce(t, codec)(idx[t.rank].clone(), "min")
        return got, [(r.op, r.nbytes) for rows in t.ledger.records.values() for r in rows]

    for no_and, nbytes in ((False, 1), (True, 5)):  # one packed plane of 5 bits, or 5 uint8 indices
        for got, rows in run_threads(2, functools.partial(worker, no_and=no_and)):
            assert got.tolist() == [1, 0, 0, 1, 0]
            assert rows == [("all_reduce", nbytes)]

    def band(t):
        t.__class__ = NoAnd
        t.all_reduce(torch.ones(2, dtype=torch.uint8), "band")

    with pytest.raises(ValueError, match="'band' is not reduced"):
        run_threads(1, band)
