"""The quantized DDP hooks train a model as torch's DDP does (issue 29).

A user's script under torchrun (2 processes, a ~79k-parameter CNN, Adam, bf16 autocast) saw
the QSGD, QSGDMaxNorm and TernGrad hooks at 4 bits stall far below fp32 DDP. The cause was the
scale: one norm (QSGD, max-norm) or one ``max |g|`` (TernGrad) for a whole DDP bucket of
79k gradients, so a typical ``|g_i| / scale`` was ~ 1 / sqrt(79k) and almost every code was 0,
the few others huge (variance ~ sqrt(n) / s = 40 times ``||g||^2`` at s = 7). The hooks now
quantize as the papers do: QSGD and QSGDMaxNorm in buckets of 512 coordinates with one norm
each, TernGrad one scale per layer with the gradient clipped at 2.5 standard deviations.

Here 2 gloo processes train that CNN (conv 1->8, conv 8->16, max-pool, 256->296->6: 79,102
parameters) on scikit-learn's digits 0-5 (1,083 8x8 images, bundled with scikit-learn: no
network), with Adam, bf16 autocast, the same initialisation, batches and seed for every
contender, in one launch: torch's DDP without a hook (fp32 all-reduce) and each hook. Each
hook must end within 1 point of DDP's test accuracy after 200 steps. The default test runs
seed 0; the slow one runs seeds 0-3 (each its own split, initialisation and batches), and also
the hooks as they were (``bucket=None``, ``clip=None``, ``per_layer=False``), which after 120
steps trail DDP by more than a point on average over the seeds (measured here: 0.9 to 7.4
points per seed and hook; the fixed hooks 0.2 to 1.1): the check tells them apart. Trained
longer (300 steps) the hooks as they were also come within a point or two on this easy task:
they reach the accuracy later, which is what a race to a target accuracy measures.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.codecs import QSGDCodec, QSGDMaxNormCodec, TernGradCodec
from lowbit.codecs.base import Payload, PayloadError
from lowbit.comm import launch
from lowbit.integrations.ddp_hooks import HOOK_BUCKET, HOOK_CLIP, make_hook

WORLD = 2
BATCH = 32  # per rank
LR = 2e-3
SEED = 0
STEPS = 200
EARLY = 120  # where the slow test compares the hooks as they were
# (label, hook name or None for torch's DDP without a hook, make_hook options)
DDP_FP32 = ("torch-ddp-fp32", None, {})
HOOKS = [("qsgd-4bit", "qsgd", {"bits": 4}), ("qsgd-maxnorm-4bit", "qsgd-maxnorm", {"bits": 4}),
         ("terngrad", "terngrad", {})]
# the hooks as they were before the fix: one norm / scale for the whole DDP bucket
AS_BEFORE = [("qsgd-4bit-one-norm", "qsgd", {"bits": 4, "bucket": None}),
             ("qsgd-maxnorm-4bit-one-norm", "qsgd-maxnorm", {"bits": 4, "bucket": None}),
             ("terngrad-one-scale", "terngrad", {"clip": None, "per_layer": False})]


class DigitsCNN(nn.Module):
    """conv3x3(1->8) - ReLU - conv3x3(8->16) - ReLU - maxpool2 - linear(256->296) - ReLU - linear(296->6)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 296)
        self.fc2 = nn.Linear(296, 6)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _digits(seed: int = SEED):
    """Digits 0-5 as (N, 1, 8, 8) in [0, 1]; a fixed half/half train/test split (by ``seed``)."""
    from sklearn.datasets import load_digits

    d = load_digits(n_class=6)
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = len(y) // 2
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


def _evaluate(model, vx, vy) -> tuple[float, float]:
    with torch.no_grad():
        logits = model.module(vx)
    return float((logits.argmax(1) == vy).float().mean()), float(F.cross_entropy(logits, vy))


def _train(transport, contenders, steps: int, seed: int = SEED, early: int | None = None) -> dict:
    """Each contender from the same initialisation over the same batches: test accuracy and
    loss (also after ``early`` steps, if given), the hook's bytes per step (None for DDP), seconds."""
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    (tx, ty), (vx, vy) = _digits(seed)
    out = {}
    for label, name, options in contenders:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        model = DDP(DigitsCNN())
        state = None
        if name is not None:
            state, hook = make_hook(name, seed=seed, **options)
            model.register_comm_hook(state, hook)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        for k in range(steps):
            idx = torch.randint(0, len(ty), (BATCH * n,), generator=torch.Generator().manual_seed(1000 * seed + k))
            idx = idx[rank::n]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tx[idx]), ty[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if k + 1 == early:
                early_accuracy, _ = _evaluate(model, vx, vy)
        accuracy, test_loss = _evaluate(model, vx, vy)
        out[label] = {"accuracy": accuracy, "loss": test_loss,
                      "early_accuracy": early_accuracy if early else None,
                      "bytes_per_step": None if state is None else state.last_step_bytes,
                      "fp32_bytes": None if state is None else state.fp32_bytes_sent // max(1, state.step),
                      "seconds": time.perf_counter() - t0}
    return out


def _check(results: list[dict], hooks) -> dict:
    r0 = results[0]
    for res in results[1:]:  # every rank holds the same model: the same accuracy
        assert {k: v["accuracy"] for k, v in res.items()} == {k: v["accuracy"] for k, v in r0.items()}
    ref = r0[DDP_FP32[0]]["accuracy"]
    assert ref > 0.9, r0  # the task trains at all
    for label, _, _ in hooks:
        assert r0[label]["accuracy"] >= ref - 0.01, (label, r0[label]["accuracy"], ref)
        assert r0[label]["bytes_per_step"] < r0[label]["fp32_bytes"] / 4, (label, r0[label])
    return r0


def test_model_size():
    assert sum(p.numel() for p in DigitsCNN().parameters()) == 79102


def test_hooks_train_within_a_point_of_ddp():
    results = launch(WORLD, _train, [DDP_FP32] + HOOKS, STEPS, timeout_s=600)
    r0 = _check(results, HOOKS)
    print({k: (round(v["accuracy"], 4), v["bytes_per_step"], round(v["seconds"], 1)) for k, v in r0.items()})


def _seeds(transport, seeds, steps: int, early: int) -> dict:
    """:func:`_train` of every contender, the hooks as they were too, at each seed."""
    return {seed: _train(transport, [DDP_FP32] + HOOKS + AS_BEFORE, steps, seed, early) for seed in seeds}


@pytest.mark.slow
def test_hooks_train_within_a_point_of_ddp_at_every_seed_and_not_as_before():
    seeds = (0, 1, 2, 3)
    results = launch(WORLD, _seeds, seeds, STEPS, EARLY, timeout_s=1800)
    gaps = {label: [] for label, _, _ in HOOKS + AS_BEFORE}  # DDP's accuracy minus the hook's after EARLY steps
    for seed in seeds:
        r0 = _check([res[seed] for res in results], HOOKS)
        print(seed, {k: (round(v["early_accuracy"], 4), round(v["accuracy"], 4)) for k, v in r0.items()})
        for label in gaps:
            gaps[label].append(r0[DDP_FP32[0]]["early_accuracy"] - r0[label]["early_accuracy"])
    mean = {label: sum(g) / len(g) for label, g in gaps.items()}
    for (label, _, _), (before, _, _) in zip(HOOKS, AS_BEFORE):  # one scale per DDP bucket trains slower
        assert mean[before] > 0.01 and mean[before] > mean[label] + 0.01, (before, gaps[before], label, gaps[label])


# --- the quantizers the hooks now use ---------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grad_like(n: int, seed: int = 0) -> torch.Tensor:
    """A gradient-like vector: layers of very different scales, heavy-tailed."""
    with torch.random.fork_rng():  # StudentT draws from the global generator: seeded here, the same every run
        torch.manual_seed(seed)
        tails = torch.distributions.StudentT(3.0).sample((n,))
    g = torch.randn(n, generator=_gen(seed)) * tails
    return g * torch.logspace(-3, 0, n).flip(0)


@pytest.mark.parametrize("n", [0, 1, 511, 512, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bucketed_maxnorm_fast_path_is_the_reference(n, dtype):
    c = QSGDMaxNormCodec(bits=4, bucket=512)
    x = _grad_like(n).to(dtype)
    W = c.shared_scale(x)
    assert W.dtype == torch.float32 and W.numel() == max(1, math.ceil(n / 512)) == c.num_buckets(n)
    assert torch.equal(W, c.shared_scale_reference(x))
    assert c.scale_nbytes(n) == 4 * W.numel()
    other = c.shared_scale(_grad_like(n, 1).to(dtype))
    Wmax = torch.maximum(W, other)  # the MAX all-reduce of two workers
    codes = c.encode_int(x, Wmax, _gen(3), torch.int8)
    assert codes.dtype == torch.int8 and int(codes.abs().max() if n else 0) <= 7
    assert torch.equal(codes.long(), c.encode_int_reference(x, Wmax, _gen(3)))
    assert torch.equal(c.decode_sum(codes, Wmax, 2), c.decode_sum_reference(codes, Wmax, 2))
    p, q = c.encode(x, generator=_gen(4)), c.encode_reference(x, generator=_gen(4))
    assert torch.equal(p.header, q.header) and torch.equal(p.data, q.data)
    assert torch.equal(c.decode(p), c.decode_reference(p))


def test_bucketed_maxnorm_with_equal_norms_codes_as_one_norm():
    x = _grad_like(3000)
    one = QSGDMaxNormCodec(bits=4)
    W = float(one.shared_scale(x))
    bucketed = QSGDMaxNormCodec(bits=4, bucket=512)
    same = torch.full((bucketed.num_buckets(3000),), W)
    assert torch.equal(one.encode_int(x, W, _gen(5)), bucketed.encode_int(x, same, _gen(5)))
    # a number is one bucket's norm only
    with pytest.raises(ValueError, match="scale must hold 6 floating-point norms"):
        bucketed.encode_int(x, W, _gen(5))


def test_bucketed_maxnorm_sum_is_the_average_within_a_step_per_bucket():
    c = QSGDMaxNormCodec(bits=4, bucket=256)
    xs = [_grad_like(1000, r) for r in range(3)]
    W = torch.stack([c.shared_scale(x) for x in xs]).amax(0)
    total = sum(c.encode_int(x, W, _gen(10 + r), torch.int16).long() for r, x in enumerate(xs))
    avg = c.decode_sum(total, W, 3)
    step = (W / 7).repeat_interleave(256)[:1000]
    err = (avg.double() - torch.stack(xs).double().mean(0)).abs()
    assert bool((err <= step.double() + 1e-9).all())  # every code is one of the two levels around x_i


def test_bucketed_maxnorm_is_unbiased_and_within_lemma_1_per_bucket():
    c = QSGDMaxNormCodec(bits=4, bucket=512)
    x = _grad_like(2000)
    W = c.shared_scale(x)
    draws = torch.stack([c.decode_sum(c.encode_int(x, W, _gen(t)), W, 1, dtype=torch.float64) for t in range(400)])
    mse = float(((draws - x.double()) ** 2).sum(1).mean())
    assert mse <= c.variance_bound(2000, W)
    assert float((draws.mean(0) - x.double()).norm()) ** 2 <= 4 * mse / 400  # bias: only the mean's noise


def test_buckets_cut_the_variance_that_stalled_training():
    """One norm for a 79k-coordinate DDP bucket: ~sqrt(n) / s times ||x||^2 of noise; buckets of 512: a few times."""
    x = _grad_like(79102)
    rel = {}
    for bucket in (None, HOOK_BUCKET):
        c = QSGDMaxNormCodec(bits=4, bucket=bucket)
        W = c.shared_scale(x)
        rel[bucket] = float(((c.decode_sum(c.encode_int(x, W, _gen(1)), W, 1, dtype=torch.float64) - x.double())
                             ** 2).sum() / (x.double() ** 2).sum())
        q = QSGDCodec(levels=7, bucket=bucket)
        rel[("qsgd", bucket)] = float(((q.decode(q.encode(x, generator=_gen(2)), dtype=torch.float64) - x.double())
                                       ** 2).sum() / (x.double() ** 2).sum())
    assert rel[None] > 10 * rel[HOOK_BUCKET] and rel[("qsgd", None)] > 10 * rel[("qsgd", HOOK_BUCKET)], rel


def test_bucketed_maxnorm_bad_input():
    c = QSGDMaxNormCodec(bits=4, bucket=512)
    x = _grad_like(1024)
    W = c.shared_scale(x)
    with pytest.raises(ValueError, match="bucket must be an int in 1..2147483647"):
        QSGDMaxNormCodec(bits=4, bucket=0)
    low = torch.stack([W[0], x[512:].abs().max() / 2])  # bucket 1's norm below its largest |x_i|
    with pytest.raises(ValueError, match=r"scale\[1\]=.* smaller than this worker's max \|x_i\|.*bucket 1"):
        c.encode_int(x, low, _gen(0))
    with pytest.raises(ValueError, match=r"scale\[1\]=.* smaller"):
        c.encode_int_reference(x, low, _gen(0))
    with pytest.raises(ValueError, match="scale must hold 2 floating-point norms"):
        c.encode_int(x, W[:1], _gen(0))
    with pytest.raises(ValueError, match="finite, >= 0"):
        c.decode_sum(torch.zeros(1024, dtype=torch.int32), torch.tensor([1.0, float("nan")]), 2)
    bad = x.clone()
    bad[700] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        c.shared_scale(bad)


def test_bucketed_maxnorm_refuses_a_malformed_message():
    c = QSGDMaxNormCodec(bits=4, bucket=512)
    p = c.encode(_grad_like(1024), generator=_gen(0))
    assert p.header.numel() == 4 and p.data.numel() == 8 + (p.data.numel() - 8)
    with pytest.raises(PayloadError):
        c.decode(Payload(header=p.header, data=p.data[:-1]))
    for value in (-1.0, float("nan"), float("inf")):
        data = p.data.clone()
        data[4:8] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
        with pytest.raises(PayloadError, match="bucket norm"):
            c.decode(Payload(header=p.header, data=data))
    with pytest.raises(PayloadError):
        c.decode(p, numel=1000)


def test_terngrad_clips_at_c_standard_deviations():
    x = _grad_like(5000)
    x[17] = 50.0  # one outlier: without clipping it sets the scale
    plain, clipped = TernGradCodec(), TernGradCodec(clip=HOOK_CLIP)
    assert plain.unbiased and not clipped.unbiased and HOOK_CLIP == 2.5
    p, q = clipped.encode(x, generator=_gen(1)), clipped.encode_reference(x, generator=_gen(1))
    assert torch.equal(p.header, q.header) and torch.equal(p.data, q.data)
    d = clipped.decode(p)
    scale = float(d.abs().max())
    sigma = float(torch.std(x.double(), correction=0))
    assert abs(scale - 2.5 * sigma) <= 2.5 * sigma * 1e-5  # sigma from float32 reductions, rounded up
    beyond = x.abs() > scale
    assert bool(beyond.any()) and torch.equal(d[beyond], torch.sign(x[beyond]) * scale)  # clipped: +-scale
    err = {c: float(((c.decode(c.encode(x, generator=_gen(2))) - x) ** 2).sum()) for c in (plain, clipped)}
    assert err[clipped] < err[plain] / 5
    small = torch.full((10,), 0.25)  # a constant vector: sigma = 0, nothing clipped
    assert torch.equal(clipped.decode(clipped.encode(small, generator=_gen(0))), small)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2.5"):
        with pytest.raises(ValueError, match="clip"):
            TernGradCodec(clip=bad)


def test_make_hook_quantization_options():
    st = make_hook("qsgd-maxnorm", bits=4)[0]
    assert st.codec == QSGDMaxNormCodec(bits=4, bucket=HOOK_BUCKET)
    assert make_hook("qsgd-maxnorm", bits=4, bucket=64)[0].codec.bucket == 64
    assert make_hook("grandk_maxnorm", k=100, bucket=None)[0].codec.inner == QSGDMaxNormCodec()
    assert make_hook("qsgd", bits=4, bucket=1000)[0].codec == QSGDCodec(levels=7, bucket=1000)
    assert make_hook("terngrad", clip=1.5)[0].codec == TernGradCodec(clip=1.5)
    assert make_hook("qsgd", bits=4, per_layer=True)[0].per_layer
    assert not make_hook("qsgd", bits=4)[0].per_layer
    with pytest.raises(ValueError, match="bucket must be an int in 1..2147483647"):
        make_hook("qsgd", bits=4, bucket=0)
    with pytest.raises(ValueError, match="bucket .* is for qsgd and the single-scale max-norm codecs"):
        make_hook("fp16", bucket=512)
    with pytest.raises(ValueError, match="bucket .* is for qsgd and the single-scale max-norm codecs"):
        make_hook("qsgd-maxnorm-multiscale", bucket=512)
    with pytest.raises(ValueError, match="clip .* is for TernGrad"):
        make_hook("qsgd", clip=2.5)
    with pytest.raises(ValueError, match="clip"):
        make_hook("terngrad", clip=0)
    with pytest.raises(ValueError, match="per_layer=True is for the all-gathered codecs"):
        make_hook("qsgd-maxnorm", per_layer=True)
    with pytest.raises(ValueError, match="per_layer must be a bool"):
        make_hook("terngrad", per_layer="yes")
    with pytest.raises(ValueError, match="bucket: algorithm 'ndqsg' runs as itself"):
        make_hook("ndqsg", bucket=512)
