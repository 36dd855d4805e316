"""Everything stays on the device of its input: codecs, algorithms and the
wrapper run on a fake ``cuda:0`` (tests/fakecuda.py: CPU compute, cuda
claims, mixing a cuda and a CPU tensor raises) and give the CPU's results bit
for bit, with the same (CPU) generators."""

import pytest
import torch

from fakecuda import fake_cuda, is_fake_cuda
from lowbit.codecs import (CODECS, DitheredCodec, EntropyCodedCodec, HalfCodec, IdentityCodec, MinMaxCodec,
                           ModuloCodec, MultiScaleMaxNormCodec, NestedDitheredCodec, PowerSGDCodec, QSGDCodec,
                           QSGDMaxNormCodec, RandKCodec, SignCodec, TernGradCodec, UniformCodec, agree_scale,
                           global_index_seed, is_summable)
from lowbit.codecs.bagua_minmax import BaguaMinMaxCodec
from lowbit.codecs.base import CodecKind
from lowbit.codecs.rng import shared_generator

N = 37  # not a multiple of 8: packing tails are exercised

CODEC_CASES = [
    IdentityCodec(),
    UniformCodec(step=0.01),
    UniformCodec(step=0.01, rounding="nearest"),
    MinMaxCodec(),
    ModuloCodec(bits=3, theta=0.5),
    DitheredCodec(levels=4),
    DitheredCodec(levels=3, subtractive=False, partitions=2),
    NestedDitheredCodec(delta1=0.02, k=4),
    QSGDCodec(levels=4),
    QSGDCodec(levels=2, bucket=8),
    TernGradCodec(),
    SignCodec(),
    HalfCodec(),
    PowerSGDCodec(rank=2),
    EntropyCodedCodec(UniformCodec(step=0.01), method="zlib"),
    QSGDMaxNormCodec(bits=3),
    MultiScaleMaxNormCodec(),
    RandKCodec(QSGDMaxNormCodec(bits=4), k=9),
    RandKCodec(QSGDMaxNormCodec(bits=4), k=9, send_indices=True),
    RandKCodec(QSGDMaxNormCodec(bits=4), k=9).with_seed(global_index_seed(1, 2)),
    BaguaMinMaxCodec(),
]


def test_every_registered_codec_is_covered():
    assert {type(c) for c in CODEC_CASES} == set(CODECS.values())


def _inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.1
    ref = x + (torch.rand(n, generator=g) - 0.5) * 0.01  # a neighbour's model: |x - ref| < theta
    return x, ref


def _roundtrip(codec, x, ref):
    side = codec.kind is CodecKind.SIDE_INFO
    payload = codec.encode(x, generator=shared_generator(7, 3, 1))
    receiver = shared_generator(7, 3, 1) if codec.dither_on_decode else None
    out = codec.decode(payload, ref=ref if side else None, generator=receiver)
    return payload, out


@pytest.mark.parametrize("codec", CODEC_CASES, ids=lambda c: repr(c)[:60])
def test_codec_roundtrip_stays_on_device(codec):
    x, ref = _inputs()
    payload_cpu, out_cpu = _roundtrip(codec, x, ref)
    with fake_cuda():
        xc, refc = x.to("cuda"), ref.to("cuda")
        payload, out = _roundtrip(codec, xc, refc)
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
    xs = [_inputs(seed)[0] for seed in range(3)]

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

from lowbit.algorithms import ALGORITHMS  # noqa: E402
from lowbit.train.config import TrainConfig  # noqa: E402
from lowbit.train.loop import build_algorithm  # noqa: E402
from quadratic import quadratic_problem, run_quadratic  # noqa: E402

WORKERS, DIM, STEPS, LR = 4, 11, 4, 0.05


def _algo_cases():
    cases = []
    for name, cls in ALGORITHMS.items():
        opts = dict(momentum=0.0)  # the quadratic runner steps x -= lr g itself
        if name.startswith("grandk"):
            opts["k"] = 0.5
        for codec in cls.codecs or (None,):
            cases.append(pytest.param(name, {**opts, "codec": codec}, id=f"{name}-{codec}" if codec else name))
    return cases


def _run_algorithm(name, opts, X0, A, b):
    cfg = TrainConfig(algorithm=name, workers=WORKERS, steps=STEPS, seed=3, **opts)
    res = run_quadratic(lambda t: build_algorithm(cfg, t), X0, A, b, STEPS, LR, finish=True)
    return [(torch.stack(seen), algo, x) for seen, algo, _t, x in res]


@pytest.mark.filterwarnings("ignore:moniqua")  # its repair round (theta exceeded) runs too, on purpose
@pytest.mark.parametrize("name,opts", _algo_cases())
def test_algorithm_stays_on_device(name, opts):
    X0, A, b = quadratic_problem(WORKERS, DIM, seed=1)
    X0, A, b = X0.float(), A.float(), b.float()
    if name == "lowprec-decentralized":  # Bagua's: every worker starts from one model
        X0 = X0[:1].repeat(WORKERS, 1)
    ref = _run_algorithm(name, opts, X0, A, b)
    with fake_cuda():
        got = _run_algorithm(name, opts, X0.to("cuda"), A.to("cuda"), b.to("cuda"))
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

from torch import nn  # noqa: E402

from lowbit.integrations import DecentralizedDataParallel, FlatParams  # noqa: E402


def _model():
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def _cpu_grad(twin, twin_flat, params, rank, k):
    g = torch.Generator().manual_seed(1000 * rank + k)
    xb, yb = torch.randn(8, 5, generator=g) + rank, torch.randint(0, 3, (8,), generator=g)
    with torch.no_grad():
        twin_flat.data.copy_(params)  # a copy from the (fake) device to the CPU
    twin_flat.zero_grad()
    nn.functional.cross_entropy(twin(xb), yb).backward()
    return twin_flat.grad


def _wrapper_run(name, device, steps=4, **options):
    from lowbit.comm import run_threads

    def worker(t):
        twin = _model()
        twin_flat = FlatParams(twin)
        m = _model().to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        ddp = DecentralizedDataParallel(m, opt, name, transport=t, seed=3, **options)
        for k in range(steps):
            ddp.zero_grad()
            ddp.flat.grad.copy_(_cpu_grad(twin, twin_flat, ddp.flat.data, t.rank, k))
            ddp.step()
        ddp.close()
        ckpt = ddp.state_dict()
        avg = ddp.averaged_module()
        return ddp.flat.data.clone(), ckpt, avg, ddp

    return run_threads(3, worker)


@pytest.mark.parametrize("name,options", [("dpsgd", {}), ("moniqua", dict(theta=1.0)), ("allreduce", {}),
                                          ("choco", dict(codec="uniform")), ("adpsgd", {})],
                         ids=["dpsgd", "moniqua", "allreduce", "choco", "adpsgd"])
def test_wrapper_stays_on_device(name, options):
    from lowbit.codecs import make_codec

    if "codec" in options:
        options = {**options, "codec": make_codec(options["codec"], step=0.01)}
    ref = _wrapper_run(name, "cpu", **options)
    with fake_cuda():
        got = _wrapper_run(name, "cuda", **options)
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
            ddp.load_state_dict(ckpt)  # restores onto the device, views intact
            assert torch.equal(ddp.flat.data.cpu(), x_ref)
