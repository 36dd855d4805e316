"""The cases both device tests run: every codec, every algorithm (a few steps of a
quadratic on thread workers) and DecentralizedDataParallel, each on a device given
by the test -- the fake ``cuda:0`` of tests/fakecuda.py (tests/test_device.py, on
CPU-only machines) or a real GPU (tests/test_gpu.py) -- against the CPU."""

import pytest
import torch
from torch import nn

from lowbit.comm import run_threads
from lowbit.codecs import (DitheredCodec, EntropyCodedCodec, HalfCodec, IdentityCodec, MinMaxCodec,
                           ModuloCodec, MultiScaleMaxNormCodec, NestedDitheredCodec, PowerSGDCodec, QSGDCodec,
                           QSGDMaxNormCodec, RandKCodec, SignCodec, TernGradCodec, UniformCodec, global_index_seed)
from lowbit.codecs.base import CodecKind
from lowbit.codecs.rng import shared_generator
from lowbit.algorithms import ALGORITHMS
from lowbit.integrations import DecentralizedDataParallel, FlatParams
from lowbit.train.config import TrainConfig
from lowbit.train.loop import build_algorithm
from quadratic import run_quadratic

from lowbit.codecs.bagua_minmax import BaguaMinMaxCodec

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


def inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.1
    ref = x + (torch.rand(n, generator=g) - 0.5) * 0.01  # a neighbour's model: |x - ref| < theta
    return x, ref


def roundtrip(codec, x, ref):
    side = codec.kind is CodecKind.SIDE_INFO
    payload = codec.encode(x, generator=shared_generator(7, 3, 1))
    receiver = shared_generator(7, 3, 1) if codec.dither_on_decode else None
    out = codec.decode(payload, ref=ref if side else None, generator=receiver)
    return payload, out


WORKERS, DIM, STEPS, LR = 4, 11, 4, 0.05


def algo_cases():
    cases = []
    for name, cls in ALGORITHMS.items():
        opts = dict(momentum=0.0)  # the quadratic runner steps x -= lr g itself
        if name.startswith("grandk"):
            opts["k"] = 0.5
        for codec in cls.codecs or (None,):
            cases.append(pytest.param(name, {**opts, "codec": codec}, id=f"{name}-{codec}" if codec else name))
    # Moniqua at 1 bit: nearest rounding after a shared dither drawn from a CPU generator
    cases.append(pytest.param("moniqua", {**opts, "bits": 1}, id="moniqua-1bit-dither"))
    return cases


def run_algorithm(name, opts, X0, A, b):
    cfg = TrainConfig(algorithm=name, workers=WORKERS, steps=STEPS, seed=3, **opts)
    res = run_quadratic(lambda t: build_algorithm(cfg, t), X0, A, b, STEPS, LR, finish=True)
    return [(torch.stack(seen), algo, x) for seen, algo, _t, x in res]


def model():
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def cpu_grad(twin, twin_flat, params, rank, k):
    g = torch.Generator().manual_seed(1000 * rank + k)
    xb, yb = torch.randn(8, 5, generator=g) + rank, torch.randint(0, 3, (8,), generator=g)
    with torch.no_grad():
        twin_flat.data.copy_(params)  # a copy from the (fake) device to the CPU
    twin_flat.zero_grad()
    nn.functional.cross_entropy(twin(xb), yb).backward()
    return twin_flat.grad


# DecentralizedDataParallel: (algorithm, options) of each case, and their ids
WRAPPER_CASES = [("dpsgd", {}), ("moniqua", dict(theta=1.0)), ("allreduce", {}),
                 ("choco", dict(codec="uniform", delta=0.01)), ("adpsgd", {})]
WRAPPER_IDS = [name for name, _ in WRAPPER_CASES]


def wrapper_run(name, device, steps=4, **options):
    def worker(t):
        twin = model()
        twin_flat = FlatParams(twin)
        m = model().to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        ddp = DecentralizedDataParallel(m, opt, name, transport=t, seed=3, **options)
        for k in range(steps):
            ddp.zero_grad()
            ddp.flat.grad.copy_(cpu_grad(twin, twin_flat, ddp.flat.data, t.rank, k))
            ddp.step()
        ddp.close()
        ckpt = ddp.checkpoint_state()
        avg = ddp.averaged_module()
        return ddp.flat.data.clone(), ckpt, avg, ddp

    return run_threads(3, worker)

