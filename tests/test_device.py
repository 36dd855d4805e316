"""Everything stays on the device of its input: codecs, algorithms and the
wrapper run on a fake ``cuda:0`` (tests/fakecuda.py: CPU compute, cuda
claims, mixing a cuda and a CPU tensor raises) and give the CPU's results bit
for bit, with the same (CPU) generators."""

import pytest
import torch

from fakecuda import fake_cuda, is_fake_cuda, no_real_cuda
from device_cases import (CODEC_CASES, DIM, N, WORKERS, WRAPPER_CASES, WRAPPER_IDS, algo_cases, inputs, roundtrip,
                          run_algorithm, wrapper_run)
from lowbit.codecs import CODECS, agree_scale, is_summable
from lowbit.codecs.base import CodecKind
from lowbit.codecs.rng import shared_generator

pytestmark = no_real_cuda  # where a real GPU is present, tests/test_gpu.py checks the same on it


def test_every_registered_codec_is_covered():
    assert {type(c) for c in CODEC_CASES} == set(CODECS.values())


@pytest.mark.parametrize("codec", CODEC_CASES, ids=lambda c: repr(c)[:60])
def test_codec_roundtrip_stays_on_device(codec):
    x, ref = inputs()
    payload_cpu, out_cpu = roundtrip(codec, x, ref)
    with fake_cuda():
        xc, refc = x.to("cuda"), ref.to("cuda")
        payload, out = roundtrip(codec, xc, refc)
        assert out.device.type == "cuda" and is_fake_cuda(out)
        assert out.dtype == out_cpu.dtype and out.shape == out_cpu.shape
        assert torch.equal(out.cpu(), out_cpu)
        wire = payload.to_wire()
        # the payload's bytes are the CPU's (a transport may take them from either device)
        assert torch.equal(wire.cpu(), payload_cpu.to_wire())
        # a receiver that got the bytes on the CPU (the in-process transport's form) decodes onto ref's device
        # or, for codecs without a reference, onto the device the bytes are moved to
        back = codec.payload_from_wire(wire.cpu().to("cuda"))
        side = codec.kind is CodecKind.SIDE_INFO
        again = codec.decode(back, ref=refc if side else None,
                             generator=shared_generator(7, 3, 1) if codec.dither_on_decode else None)
        assert again.device.type == "cuda" and torch.equal(again.cpu(), out_cpu)


# (random-k sums only with a global seed: the same coordinates on every worker)
SUMMABLE = [c for c in CODEC_CASES if is_summable(c) and getattr(c, "seed", 0) is not None]


@pytest.mark.parametrize("codec", SUMMABLE, ids=lambda c: repr(c)[:60])
def test_summable_sum_path_stays_on_device(codec):
    xs = [inputs(seed)[0] for seed in range(3)]

    def run(xs):
        scale = agree_scale(codec, xs)
        dtype = codec.sum_dtype(len(xs))
        codes = [codec.encode_int(x, scale, shared_generator(5, 0, i)).to(dtype) for i, x in enumerate(xs)]
        total = torch.stack(codes).sum(0, dtype=dtype)
        return codec.decode_sum(total, scale, len(xs), numel=N)

    ref = run(xs)
    with fake_cuda():
        out = run([x.to("cuda") for x in xs])
        assert out.device.type == "cuda" and torch.equal(out.cpu(), ref)


# --- algorithms: a few steps on the in-process runtime, x and g on the fake device ------------

from quadratic import quadratic_problem  # noqa: E402


@pytest.mark.filterwarnings("ignore:moniqua")  # its repair round (theta exceeded) runs too, on purpose
@pytest.mark.parametrize("name,opts", algo_cases())
def test_algorithm_stays_on_device(name, opts):
    X0, A, b = quadratic_problem(WORKERS, DIM, seed=1)
    X0, A, b = X0.float(), A.float(), b.float()
    if name == "lowprec-decentralized":  # Bagua's: every worker starts from one model
        X0 = X0[:1].repeat(WORKERS, 1)
    ref = run_algorithm(name, opts, X0, A, b)
    with fake_cuda():
        got = run_algorithm(name, opts, X0.to("cuda"), A.to("cuda"), b.to("cuda"))
        for (traj_ref, _, _), (traj, algo, x) in zip(ref, got):
            assert x.device.type == "cuda" and traj.device.type == "cuda"
            for key, t in algo.state_tensors().items():
                assert t.device.type == "cuda", f"{name}: state tensor {key} is on {t.device}"
            assert torch.equal(traj.cpu(), traj_ref), f"{name}: the fake-cuda run differs from the CPU run"


def test_thread_transport_returns_on_the_device_sent():
    from lowbit.comm import run_threads

    def worker(t):
        x = torch.arange(4, dtype=torch.float32, device="cuda") + t.rank
        buf = torch.full((3,), t.rank, dtype=torch.uint8, device="cuda")
        got = t.neighbor_exchange(buf, [j for j in range(t.world_size) if j != t.rank])
        outs = [t.all_reduce(x, "sum"), t.broadcast(x, 0), *t.all_gather(x), *got.values()]
        return [(o.device.type, is_fake_cuda(o)) for o in outs]

    with fake_cuda():
        res = run_threads(3, worker)
    assert all(r == ("cuda", True) for rows in res for r in rows)


# --- DecentralizedDataParallel: the module on the fake device --------------------------------
# Autograd cannot run on fake-cuda tensors (tests/fakecuda.py), so each step's gradient is computed
# by a CPU twin of the model at the wrapper's current parameters and copied into the flat gradient;
# everything else (FlatParams, the algorithm, the optimizer with momentum, checkpoints, the
# averaged model) runs on the fake device.


@pytest.mark.parametrize("name,options", WRAPPER_CASES, ids=WRAPPER_IDS)
def test_wrapper_stays_on_device(name, options):
    ref = wrapper_run(name, "cpu", **options)
    with fake_cuda():
        got = wrapper_run(name, "cuda", **options)
        for (x_ref, ckpt_ref, avg_ref, _), (x, ckpt, avg, ddp) in zip(ref, got):
            assert is_fake_cuda(x) and torch.equal(x.cpu(), x_ref)
            assert all(p.device.type == "cuda" for p in ddp.module.parameters())
            assert all(t.device.type == "cuda" for t in ddp.algorithm.state_tensors().values())
            for key, v in ckpt["module"].items():
                assert v.device.type == "cuda" and torch.equal(v.cpu(), ckpt_ref["module"][key])
            for key, v in ckpt["algorithm_state"]["tensors"].items():
                assert v.device.type == "cuda" and torch.equal(v.cpu(), ckpt_ref["algorithm_state"]["tensors"][key])
            for p, q in zip(avg.parameters(), avg_ref.parameters()):
                assert p.device.type == "cuda" and torch.equal(p.detach().cpu(), q.detach())
            ddp.load_checkpoint_state(ckpt)  # restores onto the device, views intact
            assert torch.equal(ddp.flat.data.cpu(), x_ref)
