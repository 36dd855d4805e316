"""On a real GPU (marker ``gpu``; skipped where torch sees no CUDA): every codec,
every algorithm on thread workers, DecentralizedDataParallel and the DDP hooks on
``cuda:0`` against the same run on the CPU, plus the three crashes first met on
an H100 (Moniqua's dither from a CPU generator, PowerSGD's first QR in several
threads at once, torchrun with more processes than GPUs).

The randomness is the same on both devices (lowbit draws it on the generator's
device and moves it), but a GPU rounds some float operations differently
(reduction order, fused multiply-add), so a value that falls on a rounding
boundary can land one grid step away: results are compared element-wise with a
tight tolerance, allowing a small fraction of elements outside it
(:func:`assert_mostly_close`). Where a tensor stays on the CPU, or a computation
leaves the device, the check fails outright.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from device_cases import (CODEC_CASES, DIM, WORKERS, WRAPPER_CASES, WRAPPER_IDS, algo_cases, inputs, roundtrip,
                          run_algorithm, wrapper_run)
from lowbit.bench.timing import host_syncs
from lowbit.codecs.base import CodecKind
from lowbit.codecs.maxnorm import MultiScaleMaxNormCodec, QSGDMaxNormCodec
from lowbit.codecs.rng import shared_generator
from lowbit.integrations.ddp_hooks import HOOKS, centralized_names, make_hook
from quadratic import quadratic_problem

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
DEVICE_ARG = "cuda"  # lowbit train --device
ROOT = Path(__file__).resolve().parents[1]


def assert_mostly_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6,
                        frac: float = 0.03) -> None:
    """Same shape and dtype; at most ``frac`` of the elements (at least one allowed when
    frac > 0) outside ``atol + rtol |want|`` (see the module docstring)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(g).all() == torch.isfinite(w).all()
    bad = int(((g - w).abs() > atol + rtol * w.abs()).sum())
    allowed = max(1, int(frac * w.numel())) if frac > 0 else 0
    assert bad <= allowed, f"{bad} of {w.numel()} elements differ (at most {allowed} allowed); max |diff| " \
                           f"{float((g - w).abs().max()):.3g}"


# ---- codecs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [37, 100_003], ids=["n37", "n100003"])
@pytest.mark.parametrize("codec", CODEC_CASES, ids=lambda c: repr(c)[:60])
def test_codec_on_cuda_matches_the_cpu(codec, n):
    x, ref = inputs(n=n)
    payload_cpu, out_cpu = roundtrip(codec, x, ref)
    payload, out = roundtrip(codec, x.to(CUDA), ref.to(CUDA))
    assert out.device == CUDA
    assert_mostly_close(out, out_cpu, rtol=1e-4 if "PowerSGD" in type(codec).__name__ else 1e-5, frac=1e-3)
    wire = payload.to_wire()
    assert wire.device == CUDA and wire.numel() == payload_cpu.to_wire().numel()
    # the bytes, received on the CPU and moved back, decode on the device as the sender's own decode
    side = codec.kind is CodecKind.SIDE_INFO
    again = codec.decode(codec.payload_from_wire(wire.cpu().to(CUDA)), ref=ref.to(CUDA) if side else None,
                         generator=shared_generator(7, 3, 1) if codec.dither_on_decode else None)
    assert again.device == CUDA and torch.equal(again, out)


# ---- algorithms: a few steps on thread workers, x and g on the GPU ---------------------------
@pytest.mark.filterwarnings("ignore:moniqua")  # its repair round (theta exceeded) runs too, on purpose
@pytest.mark.parametrize("name,opts", algo_cases())
def test_algorithm_on_cuda_thread_workers_matches_the_cpu(name, opts):
    X0, A, b = quadratic_problem(WORKERS, DIM, seed=1)  # float64: a rounding tie is out of reach
    if name == "lowprec-decentralized":  # Bagua's: every worker starts from one model
        X0 = X0[:1].repeat(WORKERS, 1)
    ref = run_algorithm(name, opts, X0, A, b)
    got = run_algorithm(name, opts, X0.to(CUDA), A.to(CUDA), b.to(CUDA))
    for (traj_ref, _, _), (traj, algo, x) in zip(ref, got):
        assert x.device == CUDA and traj.device == CUDA
        for key, t in algo.state_tensors().items():
            assert t.device == CUDA, f"{name}: state tensor {key} is on {t.device}"
        # a codec decodes to float32, computed in float32 on the GPU and in float64 then rounded
        # on the CPU: one float32 ulp apart at most (seen: 2^-27 on values below 0.1, min-max)
        assert_mostly_close(traj, traj_ref, rtol=1e-6, atol=2**-24 * float(traj_ref.abs().max()), frac=0.02)


@pytest.mark.parametrize("argv", [["--algorithm", "powersgd"], ["--algorithm", "moniqua", "--bits", "1"],
                                  ["--algorithm", "moniqua", "--bits", "2"]],
                         ids=["powersgd", "moniqua-1bit-dither", "moniqua-2bit"])
def test_training_on_cuda_thread_workers_in_a_fresh_process(argv, tmp_path):
    """A new process each: PowerSGD's first QR runs in 8 threads at once (torch loads its
    CUDA linear algebra on first use; the runtime loads it before the workers start), and
    Moniqua's 1-bit dither comes from a CPU generator."""
    cmd = [sys.executable, "-m", "lowbit", "train", "--device", DEVICE_ARG, "--workers", "8", "--steps", "6",
           "--eval-every", "3", "--no-progress", "--out", str(tmp_path), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_train_loss"] == summary["final_train_loss"]  # not NaN


def test_thread_transport_returns_on_the_device_sent():
    from lowbit.comm import run_threads

    def worker(t):
        x = torch.arange(4, dtype=torch.float32, device=CUDA) + t.rank
        buf = torch.full((3,), t.rank, dtype=torch.uint8, device=CUDA)
        got = t.neighbor_exchange(buf, [j for j in range(t.world_size) if j != t.rank])
        outs = [t.all_reduce(x, "sum"), t.broadcast(x, 0), *t.all_gather(x), *got.values()]
        return [o.device for o in outs], float(outs[0].sum())

    res = run_threads(3, worker)
    assert all(d == CUDA for devices, _ in res for d in devices)
    assert all(total == sum(range(4)) * 3 + 4 * 3 for _, total in res)


# ---- DecentralizedDataParallel ----------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:moniqua")
@pytest.mark.parametrize("name,options", WRAPPER_CASES, ids=WRAPPER_IDS)
def test_wrapper_on_cuda_matches_the_cpu(name, options):
    ref = wrapper_run(name, "cpu", **options)
    got = wrapper_run(name, CUDA, **options)
    for (x_ref, ckpt_ref, avg_ref, _), (x, ckpt, avg, ddp) in zip(ref, got):
        assert x.device == CUDA
        assert_mostly_close(x, x_ref, frac=0.02)
        assert all(p.device == CUDA for p in ddp.module.parameters())
        assert all(t.device == CUDA for t in ddp.algorithm.state_tensors().values())
        assert all(v.device == CUDA for v in ckpt["module"].values())
        assert all(p.device == CUDA for p in avg.parameters())
        ddp.load_checkpoint_state(ckpt)  # restores onto the device, views intact
        assert torch.equal(ddp.flat.data, x)


# ---- DDP communication hooks: NCCL (one process) on the GPU against gloo on the CPU ------------
def _hook_options(name: str) -> dict:
    return {"k": 50} if name.startswith("grandk") else {}


def _ddp_hook_run(name: str, device: torch.device, backend: str, steps: int = 3):
    """Gradients DDP hands the optimizer after each of ``steps`` steps, with hook ``name``,
    in a process group of this one process; and the bytes the hook counted."""
    kw = {"device_id": device} if backend == "nccl" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.mkdtemp()  # a file store: no port to race other processes for
    dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1, **kw)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
        model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
        state, hook = make_hook(name, seed=1, **_hook_options(name))
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        grads = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            xb, yb = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            ((model(xb.to(device)) - yb.to(device)) ** 2).mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            opt.step()
        return torch.stack(grads), state.bytes_sent
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(HOOKS) + centralized_names())  # codec hooks and algorithm names
def test_ddp_hook_on_cuda_matches_the_cpu(name):
    backend = "nccl" if dist.is_nccl_available() else "gloo"  # gloo moves the CUDA tensors through the CPU
    cpu, cpu_bytes = _ddp_hook_run(name, torch.device("cpu"), "gloo")
    gpu, gpu_bytes = _ddp_hook_run(name, CUDA, backend)
    assert gpu.device == CUDA and gpu_bytes == cpu_bytes
    assert_mostly_close(gpu, cpu, rtol=1e-4, atol=1e-6, frac=0.01)


def test_half_hook_wire_is_torchs_quotient_cast_on_cuda():
    """The fp16/bf16 hooks' wire, the bucket divided by the world size and cast in one kernel:
    torch's ``(x / N).to(dtype)`` on CUDA bit for bit; unchecked (``nonfinite="propagate"``)
    without a host synchronisation; the decode into the bucket is torch's cast."""
    from lowbit.codecs import HalfCodec
    from lowbit.integrations.ddp_hooks.floats import _half_wire, write_average

    x = torch.randn(100_003, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0)) * 100
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for N in (1, 2, 3, 7):
            wire = _half_wire(HalfCodec(name), x, N, checked=True)
            assert torch.equal(wire.view(torch.int16), (x / N).to(dtype).view(torch.int16)), (name, N)
            _half_wire(HalfCodec(name), x, N, checked=False)  # compiles the unchecked kernel
            torch.cuda.synchronize()
            unchecked, reads = host_syncs(lambda: _half_wire(HalfCodec(name), x, N, checked=False))
            assert not reads and torch.equal(unchecked, wire)
            buf = torch.empty_like(x)
            assert write_average(buf, wire) is buf and torch.equal(buf, wire.float())


@pytest.mark.parametrize("codec, reads", [(QSGDMaxNormCodec(bits=4), 3),
                                          (MultiScaleMaxNormCodec(scales=(2, 6)), 5)], ids=["qsgd", "multiscale"])
def test_maxnorm_exchange_reads_the_gpu_back_only_where_it_must(codec, reads):
    """Lines 5-10 of the max-norm algorithms on CUDA (a world of one: the reduce is the identity)
    read back to the host: the norm statistics (max |x|, sum x^2 and the finiteness flag
    together), the agreed norm, the encode's error flags, and for the multi-scale codec the
    index round's flags and the decode's."""
    from lowbit.algorithms.maxnorm import agree_scale_by

    x = torch.randn(65_536, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    sum_dtype = codec.sum_dtype(1, None)

    def exchange():
        scale = agree_scale_by(codec, x, lambda stat, op: stat)
        zeta = codec.encode_int(x, scale, shared_generator(1, 0, 0), sum_dtype)  # a CPU generator, as the hook's
        return codec.decode_sum(zeta, scale, 1, numel=x.numel(), dtype=x.dtype)

    exchange()  # compiles the kernels
    torch.cuda.synchronize()
    where = host_syncs(exchange)[1]
    assert len(where) <= reads, where


def test_hook_bench_on_cuda_pairs_torchs_hooks_and_matches_their_float_results():
    """``lowbit bench hooks --device cuda``: a one-process NCCL group; with one process the float
    hooks' results are torch's exactly, as on the CPU."""
    from lowbit.bench.hooks import bench_hooks

    report = bench_hooks(size=4096, rounds=1, hooks="fp16,bf16,powersgd,qsgd_maxnorm", min_run_time=1e-3,
                         device=DEVICE_ARG)
    rows = {r["hook"]: r for r in report["hooks"]}
    assert report["device"].startswith("cuda") and set(rows) == {"fp16", "bf16", "powersgd", "qsgd_maxnorm"}
    for h in ("fp16", "bf16"):
        assert 0 < rows[h]["error"] == rows[h]["torch_error"]
    assert all(r["ms"] > 0 and r["torch_ms"] > 0 for r in rows.values())
    assert not dist.is_initialized()


# ---- torchrun: more processes than GPUs -----------------------------------------------------
def test_torchrun_with_more_processes_than_gpus_shares_them(tmp_path):
    """One process more than there are GPUs: the default backend is gloo, the GPUs are
    shared (local rank r on GPU r modulo their number), and the run matches the thread
    runtime's on the same device."""
    n = torch.cuda.device_count() + 1
    args = ["train", "--device", DEVICE_ARG, "--workers", str(n), "--steps", "6", "--eval-every", "3", "--no-progress",
            "--algorithm", "dpsgd"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", "lowbit",
           *args, "--backend", "torch", "--out", str(tmp_path / "torchrun")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = subprocess.run([sys.executable, "-m", "lowbit", *args, "--out", str(tmp_path / "threads")], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert threads.returncode == 0, threads.stderr[-3000:]
    s, ref = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("torchrun", "threads"))
    assert s["bytes_sent"] == ref["bytes_sent"]
    assert s["final_train_loss"] == pytest.approx(ref["final_train_loss"], rel=1e-4)
