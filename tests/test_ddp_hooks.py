"""DDP communication hooks (lowbit.integrations.ddp_hooks) on real DDP models over gloo.

One launch per world size (2 and 4 processes) runs every check inside the workers
and returns numbers; the tests below assert on them. The reference gradient is
computed in every worker without communication: the data of rank r at step t is
drawn from a generator seeded by (r, t), so each worker can compute every rank's
local gradient with a plain (non-DDP) copy of the model and average them.
"""

from __future__ import annotations

import math
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.codecs import ModuloCodec, QSGDCodec, QSGDMaxNormCodec, RandKCodec, TernGradCodec
from lowbit.codecs.radix import radix_nbytes
from lowbit.comm import launch
from lowbit.integrations.ddp_hooks import (HOOKS, LowbitHookState, centralized_names, hook_table, lowbit_hook,
                                           make_hook, wire_method)

# the codec hooks, and three algorithm names (the algorithm's codec, options as lowbit train names them)
# the former global random-k codec hooks (deprecated names, still served) and three algorithms
ALL = list(HOOKS) + ["grandk_maxnorm", "grandk_maxnorm_multiscale", "qsgd", "terngrad", "powersgd"]
K = 50  # random-k kept coordinates per bucket in these tests
UNBIASED = ["qsgd-maxnorm", "qsgd-maxnorm-multiscale", "grandk_maxnorm", "grandk_maxnorm_multiscale",
            "grandk-fp32", "qsgd", "terngrad", "dithered"]
EF_HOOKS = ["sign", "powersgd"]
TRAIN_HOOKS = ["fp32", "qsgd-maxnorm", "qsgd-maxnorm-multiscale", "sign", "powersgd", "dithered"]
REPEATS = 12
# fine settings whose error has a small deterministic bound per coordinate (see _check_tight)
TIGHT = {"qsgd-maxnorm": {"bits": 16}, "qsgd-maxnorm-multiscale": {"scales": (12, 16)},
         "grandk_maxnorm": {"k": 100000, "bits": 16}, "qsgd": {"bits": 8}, "dithered": {"levels": 1000}}
LR = 0.05
# 2-bit multi-scale with the l2 norm over a 644-element bucket is noisier than the gradient
# (Lemma 2: up to (1 + sqrt(n) / 3) W^2); the l-inf norm makes it a usable training codec
TRAIN_OPTIONS = {"qsgd-maxnorm-multiscale": {"norm": "linf"}, "powersgd": {"powersgd_rank": 1}}
FOUR = ["fp32", "fp16", "qsgd-maxnorm", "qsgd-maxnorm-multiscale", "grandk_maxnorm", "dithered", "sign",
        "powersgd"]


def _options(name: str) -> dict:
    if name == "powersgd":
        return {"powersgd_rank": 1}
    return {"k": K} if name.startswith("grandk") else {}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _data(rank: int, step: int, batch: int = 8):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(batch, 16, generator=g)
    teacher = torch.Generator().manual_seed(7)
    a = torch.randn(16, 4, generator=teacher) / 4
    return x, torch.tanh(x @ a) * 2


def _loss(model, rank, step):
    x, y = _data(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _ref_grads(world: int, step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The true averaged gradient (and each rank's) at the initial parameters."""
    m = _net()
    per = []
    for r in range(world):
        m.zero_grad()
        _loss(m, r, step).backward()
        per.append(_flat_grad(m).clone())
    return torch.stack(per).mean(0), per


def _multi_bucket_ddp() -> DDP:
    # find_unused_parameters keeps the initial bucketing (no rebuild): two buckets,
    # the same layout in a fresh DDP (so a restored checkpoint meets the same buckets)
    return DDP(_net(), bucket_cap_mb=0.001, find_unused_parameters=True)


def _gradient_checks(world: int, rank: int, names, repeats: int = REPEATS) -> dict:
    ref, per = _ref_grads(world, 0)
    out = {"ref": ref, "per": per}
    # the unhooked DDP model as the baseline
    m = _multi_bucket_ddp()
    _loss(m, rank, 0).backward()
    out["unhooked"] = _flat_grad(m).clone()
    for name in names:
        state, hook = make_hook(name, seed=3, **_options(name))
        m = _multi_bucket_ddp()
        m.register_comm_hook(state, hook)
        grads = []
        for _ in range(repeats if name != "fp32" else 2):
            m.zero_grad()
            _loss(m, rank, 0).backward()
            grads.append(_flat_grad(m).clone())
            if len(grads) == 1:
                out[(name, "bytes")] = (dict(state.bucket_bytes), dict(state.bucket_numel), state.last_step_bytes)
        out[(name, "grads")] = torch.stack(grads)
        out[(name, "state")] = (state.step, state.bytes_sent, state.fp32_bytes_sent)
    for name, opts in TIGHT.items():  # fine settings: one step, checked against a deterministic bound
        state, hook = make_hook(name, seed=4, **opts)
        m = _multi_bucket_ddp()
        m.register_comm_hook(state, hook)
        _loss(m, rank, 0).backward()
        out[(name, "tight")] = _flat_grad(m).clone()
    return out


def _ef_identity(rank: int) -> dict:
    """Error feedback per parameter across DDP's bucket rebuild: with bucket_cap_mb_list the
    first iteration has two buckets and the later ones one. sum_t out_t + mean_r e_r = T ref."""
    out = {}
    for name in EF_HOOKS:
        m = DDP(_net(), bucket_cap_mb_list=[0.001] * 3)
        state, hook = make_hook(name, seed=5, model=m, **_options(name))
        log = []

        def logging_hook(st, bucket, log=log, hook=hook):
            log.append((st.step, bucket.index(), bucket.buffer().numel()))
            return hook(st, bucket)

        m.register_comm_hook(state, logging_hook)
        total = None
        for _ in range(6):
            m.zero_grad()
            _loss(m, rank, 0).backward()
            g = _flat_grad(m).clone().double()
            total = g if total is None else total + g
        names = [n for n, _ in m.module.named_parameters()]
        mem = torch.cat([state.param_memory[n].reshape(-1) for n in names])
        out[name] = (total, mem, log, state.memory_resets, state.powersgd_resets)
        # the same with memory per bucket: the rebuild resets the changed bucket's memory
        m = DDP(_net(), bucket_cap_mb_list=[0.001] * 3)
        st2, hook2 = make_hook(name, seed=5, **_options(name))
        m.register_comm_hook(st2, hook2)
        for _ in range(3):
            m.zero_grad()
            _loss(m, rank, 0).backward()
        out[(name, "bucket-keyed")] = (st2.memory_resets, bool(torch.isfinite(_flat_grad(m)).all()),
                                       sorted(st2.bucket_memory))
    return out


def _train(rank: int, steps: int = 50) -> dict:
    out = {}
    for name in TRAIN_HOOKS:
        m = _multi_bucket_ddp()
        state, hook = make_hook(name, seed=11, **TRAIN_OPTIONS.get(name, {}))
        m.register_comm_hook(state, hook)
        opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
        losses = []
        for t in range(steps):
            opt.zero_grad()
            loss = _loss(m, rank, 100 + t)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = (losses, state.bytes_sent, state.fp32_bytes_sent)
    return out


def _checkpoint(rank: int) -> dict:
    """Pickle the state mid-training; a fresh DDP model restored from the checkpoint with
    the unpickled state continues exactly as the original run."""
    out = {}
    for name in ["sign", "powersgd", "grandk_maxnorm", "dithered"]:
        m = _multi_bucket_ddp()
        state, hook = make_hook(name, seed=2, process_group=dist.group.WORLD, **_options(name))
        m.register_comm_hook(state, hook)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

        def run(model, optim, steps, start):
            for t in range(start, start + steps):
                optim.zero_grad()
                _loss(model, rank, 200 + t).backward()
                optim.step()

        run(m, opt, 3, 0)
        blob = pickle.dumps(state)
        ckpt = ({k: v.clone() for k, v in m.module.state_dict().items()}, pickle.dumps(opt.state_dict()))
        run(m, opt, 3, 3)
        original = torch.cat([p.detach().reshape(-1) for p in m.parameters()])

        m2 = _multi_bucket_ddp()
        m2.module.load_state_dict(ckpt[0])
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9)
        opt2.load_state_dict(pickle.loads(ckpt[1]))
        state2 = pickle.loads(blob)
        m2.register_comm_hook(state2, lowbit_hook)
        run(m2, opt2, 3, 3)
        restored = torch.cat([p.detach().reshape(-1) for p in m2.parameters()])
        out[name] = (float((original - restored).abs().max()), state2.process_group is None, state2.step,
                     state.step, state2.bytes_sent == state.bytes_sent)
    return out


def _state_dict_resume(rank: int) -> dict:
    """LowbitHookState.state_dict / load_state_dict on plain DDP, which rebuilds its buckets
    after the first step (one bucket in parameter order, then gradient order; with a small cap
    several buckets): saved mid-training with torch.save, loaded with weights_only into a fresh
    DDP model's state, the run continues bit for bit. A state that knows no model cannot replay
    the layout: its first restored step runs the fresh layout (a warning) and differs."""
    import io
    import warnings

    out = {}
    for name, opts in [("maxnorm", {"bits": 3}), ("qsgd", {"bits": 4}), ("powersgd", {"powersgd_rank": 1}),
                       ("sign", {})]:
        for cap in (None, 0.0001):  # the small cap: several buckets after the rebuild
            def fresh():
                return DDP(_net(), **({} if cap is None else {"bucket_cap_mb": cap}))

            def run(model, optim, state, start):
                for t in range(start, start + 3):
                    optim.zero_grad()
                    _loss(model, rank, 300 + t).backward()
                    optim.step()
                return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), dict(state.bucket_layout)

            m = fresh()
            state, hook = make_hook(name, seed=2, **opts)
            state.bind_model(m)
            m.register_comm_hook(state, hook)
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            run(m, opt, state, 0)
            blob = io.BytesIO()
            torch.save({"hook": state.state_dict(), "model": m.module.state_dict(), "opt": opt.state_dict()}, blob)
            original, layout = run(m, opt, state, 3)
            for bind in (True, False) if not state.error_feedback else (True,):
                saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
                m2 = fresh()
                m2.module.load_state_dict(saved["model"])
                opt2 = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9)
                opt2.load_state_dict(saved["opt"])
                state2, hook2 = make_hook(name, seed=2, **opts)
                if bind:
                    state2.bind_model(m2)
                state2.load_state_dict(saved["hook"])
                m2.register_comm_hook(state2, hook2)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    restored, layout2 = run(m2, opt2, state2, 3)
                out[f"{name} cap={cap} bind={bind}"] = (
                    torch.equal(original, restored), state2.step, state2.bytes_sent == state.bytes_sent,
                    len(layout), layout2 == layout, any("differs" in str(w.message) for w in caught))
    return out


def _timed(out: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out[key] = fn(*args)
    out.setdefault("seconds", {})[key] = time.perf_counter() - t0


def _worker2(transport):
    rank = dist.get_rank()
    out: dict = {}
    _timed(out, "grad", _gradient_checks, 2, rank, ALL)
    _timed(out, "ef", _ef_identity, rank)
    _timed(out, "train", _train, rank)
    _timed(out, "ckpt", _checkpoint, rank)
    _timed(out, "state_dict", _state_dict_resume, rank)
    return out


def _worker4(transport):
    rank = dist.get_rank()
    return {"grad": _gradient_checks(4, rank, FOUR, repeats=8)}


@pytest.fixture(scope="module")
def two():
    return launch(2, _worker2, timeout_s=300)


@pytest.fixture(scope="module")
def four():
    return launch(4, _worker4, timeout_s=300)


def _ring(m: int, n: int) -> int:
    return 2 * (n - 1) * m // n


def _code_sum_bytes(n: int, s: int, world: int) -> int:
    """The all-reduce buffer of n codes in -s..s summed over world ranks: int8 (n * s * world
    <= 127 here), or the summable lanes where those are smaller: balanced radix-(2 world s + 1)
    digits, k of them per int64 word, k the largest with (2 world s + 1)^k < 2^64."""
    R, k = 2 * world * s + 1, 0
    while R ** (k + 1) < 2**64:
        k += 1
    return min(n, 8 * math.ceil(n / k))


def _expected_bucket_bytes(name: str, n: int, world: int) -> int:
    """Wire bytes of one bucket of n gradient elements, from the formats (independent of the hook code)."""
    gather = (world - 1)
    kk = min(K, n)
    if name == "fp32":
        return _ring(4 * n, world)
    if name in ("fp16", "bf16"):
        return _ring(2 * n, world)
    if name == "qsgd-maxnorm":  # the codec's default bits: codes -s..s, in lanes where smaller
        return _ring(4, world) + _ring(_code_sum_bytes(n, QSGDMaxNormCodec().max_code, world), world)
    if name == "qsgd-maxnorm-multiscale":  # (2, 6): norm, 1-bit index plane, codes -3..3
        return _ring(4, world) + _ring(math.ceil(n / 8), world) + _ring(_code_sum_bytes(n, 3, world), world)
    if name == "grandk_maxnorm":
        return _ring(4, world) + _ring(_code_sum_bytes(kk, QSGDMaxNormCodec().max_code, world), world)
    if name == "grandk_maxnorm_multiscale":
        return _ring(4, world) + _ring(math.ceil(kk / 8), world) + _ring(_code_sum_bytes(kk, 3, world), world)
    if name == "grandk-fp32":
        return _ring(4 * kk, world)
    if name == "qsgd":  # bits 2 (lowbit train's default): s = 1, 3 codes in mixed radix, header numel + norm
        return gather * (8 + radix_nbytes(n, 3))
    if name == "terngrad":  # per layer (make_hook's default): header (numel, scale) and 5 trits a byte each
        layers = {164: (128, 4, 32), 512: (512,)}[n]
        return gather * sum(8 + radix_nbytes(m, 3) for m in layers)
    if name == "dithered":  # 3 codes (levels 1) in mixed radix: 5 per byte
        return gather * (8 + radix_nbytes(n, 3))
    if name == "sign":
        return gather * (8 + math.ceil(n / 8))
    if name == "powersgd":  # rank 1, per tensor; the buckets are [W2 (4x32), b2, b1] and [W1 (32x16)]
        if n == 164:  # first: P of W2 (4) + b2 (4) + b1 (32); second: Q of W2 (32)
            return _ring(4 * 40, world) + _ring(4 * 32, world)
        assert n == 512  # first: P of W1 (32); second: Q of W1 (16)
        return _ring(4 * 32, world) + _ring(4 * 16, world)
    raise AssertionError(name)


def _check_gradients(results, world, names):
    r0 = results[0]["grad"]
    ref, per = r0["ref"], r0["per"]
    scale = torch.stack(per).abs().mean(0)  # mean_r |g_r|
    # the unhooked DDP baseline matches the reference
    for res in results:
        assert torch.allclose(res["grad"]["unhooked"], ref, atol=1e-6)
    for name in names:
        g = [res["grad"][(name, "grads")] for res in results]
        for other in g[1:]:  # every rank ends with the same averaged gradient
            assert torch.equal(other, g[0]), name
        g = g[0]
        if name == "fp32":
            assert (g - ref).abs().max() <= 1e-6
        elif name in ("fp16", "bf16"):
            u = 2.0**-11 if name == "fp16" else 2.0**-8
            # x / world rounded once, then world - 1 rounded additions of partial sums
            bound = 2 * world * u * scale + 1e-6
            err = (g[0] - ref).abs()
            assert bool((err <= bound).all()), (name, float((err - bound).max()))
            assert float(err.max()) > 0  # it really went through 16 bits
        elif name in UNBIASED:
            e_single = ((g - ref) ** 2).sum(1).mean()  # E||g_hat - ref||^2, estimated
            e_mean = ((g.mean(0) - ref) ** 2).sum()
            assert e_single > 0
            # an unbiased estimate: the error of the mean of T draws is ~ E||.||^2 / T
            assert e_mean <= 3 * e_single / g.shape[0], (name, float(e_mean), float(e_single))
            if name == "qsgd-maxnorm":
                # deterministic bound: every coordinate of every rank is off by < W / s, W = max_r ||g_r||
                w = max(float(p.norm()) for p in per)
                assert float((g - ref).abs().max()) <= w / QSGDMaxNormCodec().levels + 1e-6
        elif name in EF_HOOKS:
            assert float(((g - ref) ** 2).sum(1).mean()) > 0


def _check_tight(results):
    r0 = results[0]["grad"]
    ref, per = r0["ref"], r0["per"]
    w2 = max(float(p.norm()) for p in per)  # >= every rank's l2 norm of any bucket
    winf = max(float(p.abs().max()) for p in per)
    bounds = {"qsgd-maxnorm": w2 / 32767, "qsgd-maxnorm-multiscale": w2 / 4095, "grandk_maxnorm": w2 / 32767,
              "qsgd": w2 / 127, "dithered": winf / 1000}  # subtractive dither: kappa / (2M) per coordinate
    for name, bound in bounds.items():
        err = (r0[(name, "tight")] - ref).abs().max()
        assert 0 < float(err) <= bound + 1e-6, (name, float(err), bound)
        for res in results[1:]:
            assert torch.equal(res["grad"][(name, "tight")], r0[(name, "tight")])


def _check_bytes(results, world, names):
    for res in results:
        for name in names:
            bb, numel, step_bytes = res["grad"][(name, "bytes")]
            assert sorted(numel.values()) == [164, 512]  # two buckets: [W2, b2, b1], [W1]
            for b, n in numel.items():
                assert bb[b] == _expected_bucket_bytes(name, n, world), (name, b, n)
            assert step_bytes == sum(bb.values())
            steps, sent, fp32 = res["grad"][(name, "state")]
            assert fp32 == steps * _ring(4 * 676, world)
            assert sent == steps * step_bytes


def test_two_ranks_gradients(two):
    _check_gradients(two, 2, ALL)
    _check_tight(two)


def test_two_ranks_bytes(two):
    _check_bytes(two, 2, ALL)


def test_four_ranks_gradients_and_bytes(four):
    _check_gradients(four, 4, FOUR)
    _check_tight(four)
    _check_bytes(four, 4, FOUR)


def test_error_feedback_survives_bucket_rebuild(two):
    ref = two[0]["grad"]["ref"].double()
    for name in EF_HOOKS:
        total = two[0]["ef"][name][0]
        mean_mem = sum(res["ef"][name][1] for res in two) / len(two)
        # sum_t out_t = T ref - mean_r e_r  (exact bookkeeping of error feedback)
        assert torch.allclose(total + mean_mem, 6 * ref, atol=1e-5), name
        assert float(mean_mem.abs().max()) > 1e-4  # there is memory to account for
        log, resets, q_resets = two[0]["ef"][name][2:]
        first = sorted(n for s, _, n in log if s == 0)
        later = sorted(n for s, _, n in log if s == 1)
        assert first != later and later == [676]  # DDP really rebuilt its buckets
        assert resets == 0  # per-parameter memory needs no reset
        assert q_resets == (1 if name == "powersgd" else 0)  # PowerSGD's warm start is per bucket
        b_resets, finite, keys = two[0]["ef"][(name, "bucket-keyed")]
        assert b_resets == 1 and finite and 0 in keys


def test_training_converges(two):
    for name in TRAIN_HOOKS:
        losses, sent, fp32 = two[0]["train"][name]
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < 0.3 * first, (name, first, last)
        if name not in ("fp32",):
            assert sent < fp32


def test_checkpoint_continues_identically(two):
    for res in two:
        for name, (diff, no_group, step2, step1, same_bytes) in res["ckpt"].items():
            assert diff <= 1e-7, (name, diff)
            assert no_group and step2 == step1 == 6 and same_bytes


def test_state_dict_resume_replays_the_bucket_layout_bit_for_bit(two):
    for res in two:
        cases = res["state_dict"]
        assert len(cases) == 12  # four hooks, two caps; the bound state alone for the two with memory
        for key, (same, step, same_bytes, buckets, same_layout, warned) in cases.items():
            if key.endswith("bind=True"):
                assert same and same_layout and not warned and same_bytes and step == 6, key
            else:  # no model bound: the fresh layout's first step, told, and another result
                assert warned and not same, key
        # the small cap rebuilds into several buckets, which the first restored step replays
        assert cases["maxnorm cap=0.0001 bind=True"][3] > 1 and cases["maxnorm cap=None bind=True"][3] == 1


def test_state_dict_refuses_another_hook_and_unbound_memory():
    state, _ = make_hook("sign", seed=3)
    saved = state.state_dict()
    with pytest.raises(ValueError, match="seed=3"):
        make_hook("sign", seed=4)[0].load_state_dict(saved)
    with pytest.raises(ValueError, match="method='allgather'"):
        make_hook("fp16")[0].load_state_dict(saved)
    with pytest.raises(ValueError, match="missing"):
        state.load_state_dict({"step": 1})
    state.per_parameter = True
    state.param_memory = {"0.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="bind_model"):
        make_hook("sign", seed=3)[0].load_state_dict(state.state_dict())


# --- every centralized algorithm by its lowbit train name ----------------------------------

# options as lowbit train names them (AlgorithmOptions), not the default everywhere
CLI_OPTIONS = {"allreduce": {}, "dqsg": {"bits": 3}, "ndqsg": {"nested_fraction": 0.5}, "qsgd": {"bits": 4},
               "terngrad": {}, "onebit-ef": {}, "maxnorm": {"bits": 3, "sum_dtype": "int32"},
               "maxnorm-multiscale": {"scales": "2,6"}, "grandk-maxnorm": {"k": 0.1},
               "grandk-maxnorm-multiscale": {"k": 30}, "powersgd": {"powersgd_rank": 1}}
# the hook's average against the algorithm's aggregate on the same bucket: fp32, the deterministic
# 1-bit sign (the hook encodes in float64, the algorithm in float32), NDQSG (the algorithm itself)
SAME_AS_ALGORITHM = {"allreduce": 1e-6, "onebit-ef": 1e-6, "ndqsg": 0.0}


def _algorithm_hooks(transport):
    from lowbit.comm.distributed import TorchDistributedTransport
    from lowbit.integrations.ddp_hooks import hook_algorithm

    rank = dist.get_rank()
    out = {}
    for name in centralized_names():
        state, hook = make_hook(name, seed=6, **CLI_OPTIONS[name])
        m = DDP(_net())  # one bucket of 676 gradients
        seen = []

        def spy(st, bucket, seen=seen, hook=hook):
            seen.append(bucket.buffer().detach().clone())
            return hook(st, bucket).then(lambda f: seen.append(f.value().detach().clone()) or f.value())

        m.register_comm_hook(state, spy)
        _loss(m, rank, 0).backward()
        local, avg = seen
        out[name] = {"avg": avg, "bytes": state.bytes_sent, "method": state.method, "step": state.step}
        if name in SAME_AS_ALGORITHM:  # the algorithm on the same bucket, same seed, step 0
            w = hook_algorithm(name, **CLI_OPTIONS[name]).worker(TorchDistributedTransport(), seed=6)
            g = local.clone()
            w.setup(g)
            w.before_update(0, g, g, 0.0)
            out[name]["algorithm"] = g
    return out


@pytest.fixture(scope="module")
def named():
    return launch(2, _algorithm_hooks, timeout_s=300)


def test_make_hook_takes_every_centralized_algorithm_with_cli_options(named):
    assert set(CLI_OPTIONS) == set(centralized_names())
    ref, _ = _ref_grads(2, 0)
    for name in CLI_OPTIONS:
        a, b = named[0][name], named[1][name]
        assert torch.equal(a["avg"], b["avg"]), name  # every rank ends with the same average
        assert a["step"] == 1 and a["bytes"] > 0, name
        assert bool(torch.isfinite(a["avg"]).all()), name
        if name == "allreduce":
            assert a["method"] == "allreduce-float" and float((a["avg"].sum() - ref.sum()).abs()) < 1e-5
        if name == "ndqsg":
            assert a["method"] == "algorithm"


def test_hook_average_is_the_algorithm_aggregate(named):
    for res in named:
        for name, tol in SAME_AS_ALGORITHM.items():
            hook, algo = res[name]["avg"], res[name]["algorithm"]
            assert float((hook - algo).abs().max()) <= tol * float(algo.abs().max()), name


# --- on a process group that is not the default one -------------------------------------

SUBGROUP = ["fp16", "qsgd-maxnorm-multiscale", "grandk_maxnorm", "dithered", "sign", "powersgd"]


def _subgroup_hooks(transport):
    """Global ranks 1 and 2 of three train on their own process group: group rank r sees
    what rank r of the two-process launch sees."""
    group = dist.new_group([1, 2])  # every rank takes part in creating it
    if dist.get_rank() == 0:
        return {}
    rank = dist.get_rank(group)
    out = {}
    for name in SUBGROUP + ["ndqsg"]:
        state, hook = make_hook(name, seed=3, process_group=group, **_options(name))
        m = DDP(_net(), bucket_cap_mb=0.001, find_unused_parameters=True, process_group=group)
        m.register_comm_hook(state, hook)
        _loss(m, rank, 0).backward()
        out[name] = (_flat_grad(m).clone(), dict(state.bucket_bytes), dict(state.bucket_numel))
    return out


def test_hooks_on_a_process_group(two):
    procs = launch(3, _subgroup_hooks, timeout_s=300)
    assert procs[0] == {}
    for r, res in enumerate(procs[1:]):
        for name in SUBGROUP:  # the same gradient and bytes as on the default group of two ranks
            grad, bb, numel = res[name]
            assert torch.equal(grad, two[r]["grad"][(name, "grads")][0]), name
            assert all(bb[b] == _expected_bucket_bytes(name, n, 2) for b, n in numel.items()), name
        assert torch.equal(res["ndqsg"][0], procs[1]["ndqsg"][0]) and sum(res["ndqsg"][1].values()) > 0


# --- without processes ---------------------------------------------------------------------


def test_make_hook_and_table():
    state, hook = make_hook("grandk_maxnorm", k=10, bits=3, seed=4)
    assert hook is lowbit_hook and state.seed == 4 and state.error_feedback is False
    assert isinstance(state.codec, RandKCodec) and state.codec.inner == QSGDMaxNormCodec(bits=3, bucket=512)
    assert make_hook("sign")[0].error_feedback and make_hook("powersgd")[0].error_feedback
    assert make_hook("sign", error_feedback=False)[0].error_feedback is False
    methods = {name: method for name, method, _ in hook_table()}
    assert set(centralized_names()) | set(HOOKS) == set(methods)
    assert methods["maxnorm"] == methods["maxnorm-multiscale"] == "allreduce-int"
    assert methods["grandk-maxnorm"] == "allreduce-randk" and methods["ndqsg"] == "algorithm"
    assert methods["allreduce"] == "allreduce-float" and methods["dqsg"] == methods["onebit-ef"] == "allgather"
    # the algorithm's codec and defaults: one name, one default per concept
    # ... quantized as the papers do (make_hook's bucket=512, TernGrad per layer, clip=2.5); None: as lowbit train
    assert make_hook("qsgd", bits=4)[0].codec == QSGDCodec(levels=7, bucket=512)
    assert make_hook("qsgd", bits=4, bucket=None)[0].codec == QSGDCodec(levels=7)
    assert make_hook("maxnorm")[0].codec == QSGDMaxNormCodec(bits=3, bucket=512)  # lowbit train's bits=2: p = 2
    assert make_hook("maxnorm", bucket=None)[0].codec == QSGDMaxNormCodec(bits=3)
    tern = make_hook("terngrad")[0]
    assert tern.codec == TernGradCodec(clip=2.5) and tern.per_layer
    tern = make_hook("terngrad", clip=None, per_layer=False)[0]
    assert tern.codec == TernGradCodec() and not tern.per_layer
    assert make_hook("powersgd")[0].codec.rank == 2 and make_hook("onebit-ef")[0].error_feedback
    st = make_hook("grandk-maxnorm", k=0.25, sum_dtype="int32")[0]
    assert st.kept == 0.25 and st.sum_dtype == torch.int32
    assert methods["qsgd-maxnorm"] == methods["qsgd-maxnorm-multiscale"] == "allreduce-int"
    assert methods["dithered"] == methods["sign"] == methods["qsgd"] == methods["terngrad"] == "allgather"
    assert methods["grandk-fp32"] == "allreduce-randk" and methods["powersgd"] == "powersgd"
    assert wire_method(RandKCodec(QSGDCodec(levels=2), k=3, send_indices=True)) == "allgather"
    with pytest.raises(ValueError, match="inner"):
        wire_method(RandKCodec(QSGDMaxNormCodec(), k=3, send_indices=True))


def test_bad_input():
    with pytest.raises(ValueError, match="name"):
        make_hook("nope")
    with pytest.raises(ValueError, match="seed"):
        make_hook("fp32", seed=-1)
    with pytest.raises(ValueError, match="error_feedback"):
        make_hook("fp32", error_feedback="yes")
    with pytest.raises(ValueError, match=r"hook 'sign' does not take option\(s\) bits; it takes: scale"):
        make_hook("sign", bits=3)
    with pytest.raises(ValueError, match="codec"):
        LowbitHookState(ModuloCodec(bits=2, theta=0.5))
    with pytest.raises(ValueError, match="bits"):
        make_hook("qsgd-maxnorm", bits=1)
    # an algorithm name takes lowbit train's option names: anything else is named, with the list
    with pytest.raises(ValueError, match="levels; it takes: .*bits"):
        make_hook("qsgd", levels=4)
    with pytest.raises(ValueError, match="rank.*powersgd_rank"):
        make_hook("powersgd", rank=2)
    with pytest.raises(ValueError, match="needs k"):
        make_hook("grandk-maxnorm")
    with pytest.raises(ValueError, match="server"):
        make_hook("dqsg", server="ps")
    with pytest.raises(ValueError, match="bits must be an integer in 2..8"):
        make_hook("qsgd", bits=1)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        make_hook("fp16", nonfinite="ignore")
    for name, kw in (("qsgd-maxnorm", {}), ("sign", {}), ("fp16", {"error_feedback": True})):
        with pytest.raises(ValueError, match="nonfinite='propagate' is for the fp32, fp16 and bf16 hooks"):
            make_hook(name, nonfinite="propagate", **kw)


def test_state_pickles_without_group():
    state, _ = make_hook("powersgd", powersgd_rank=2, seed=9)
    state.process_group = object()  # stands for a (non-picklable) process group
    state.step = 5
    state.bucket_memory[0] = (((3,),), torch.ones(3))
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and copy.step == 5 and copy.codec == state.codec
    assert torch.equal(copy.bucket_memory[0][1], torch.ones(3))


def test_state_pickled_before_nonfinite_loads_with_raise():
    state, _ = make_hook("fp16", nonfinite="propagate")
    assert pickle.loads(pickle.dumps(state)).nonfinite == "propagate"
    old = state.__getstate__()
    del old["nonfinite"]
    restored = LowbitHookState.__new__(LowbitHookState)
    restored.__setstate__(old)
    assert restored.nonfinite == "raise"


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_half_hook_wire_in_one_pass_is_the_reference_paths(name):
    """The fp16/bf16 hooks' wire on the fast path (the quotient ``x / N`` and its cast in one
    pass) has the bits of the reference path's (torch's division, then the codec's encode),
    for world sizes that divide exactly and that do not; the bucket is left as it was; errors
    alike; the decode into the bucket is torch's cast."""
    from lowbit.codecs import HalfCodec
    from lowbit.codecs.kernels import codec_path
    from lowbit.integrations.ddp_hooks.floats import _half_wire, write_average

    codec = HalfCodec(name)
    x = torch.randn(50_001, generator=torch.Generator().manual_seed(3)) * 300
    x0 = x.clone()
    for N in (1, 2, 3, 6):
        with codec_path("reference"):
            ref = _half_wire(codec, x, N, checked=True)
        for checked in (True, False):
            assert torch.equal(_half_wire(codec, x, N, checked=checked).view(torch.int16), ref.view(torch.int16))
        assert torch.equal(x, x0)
        buf = torch.empty_like(x)
        assert write_average(buf, ref) is buf and torch.equal(buf, ref.float())
    bad = torch.tensor([1.0, float("inf")])
    for path in ("fast", "reference"):
        with codec_path(path), pytest.raises(ValueError, match="must be finite.*divided by the world size"):
            _half_wire(codec, bad, 3, checked=True)


def test_half_hooks_raise_or_propagate_a_nonfinite_bucket():
    """An fp16 overflow and a NaN in the bucket: by default the clear error, which names the
    option; with ``nonfinite="propagate"`` the result of torch's own hook, bit for bit (inf and
    NaN where torch has them; a NaN's bits are not compared: torch's bf16 cast makes 0xFFFF in
    its vectorised loop and 0x7FC0 in its scalar one)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    from lowbit.bench.hooks import GradBucketStandIn

    g = torch.randn(64 * 64, generator=torch.Generator().manual_seed(0)) * 0.01
    g[5], g[77] = 1e5, float("nan")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, torch_hook in (("fp16", dh.fp16_compress_hook), ("bf16", dh.bf16_compress_hook)):
            bucket = GradBucketStandIn([torch.nn.Parameter(torch.empty(64, 64, device=g.device))], g)
            expected = torch_hook(None, bucket).wait().clone()
            bucket.buffer().copy_(g)
            state, hook = make_hook(name)
            with pytest.raises(ValueError, match="must be finite.*nonfinite='propagate'"):
                hook(state, bucket)
            bucket.buffer().copy_(g)
            state, hook = make_hook(name, nonfinite="propagate")
            out = hook(state, bucket).wait()
            nan = torch.isnan(expected)  # NaN's bits are torch's and differ between its own paths
            assert torch.equal(torch.isnan(out), nan), name
            assert torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32)), name
            assert (name == "fp16") == bool(torch.isinf(out[5])) and bool(torch.isnan(out[77]))
        g[77] = 0.0  # the overflow alone
        bucket = GradBucketStandIn([torch.nn.Parameter(torch.empty(64, 64, device=g.device))], g)
        with pytest.raises(ValueError, match="overflows fp16"):
            make_hook("fp16")[1](make_hook("fp16")[0], bucket)
    finally:
        dist.destroy_process_group()


def test_fp16_hook_trains_under_a_grad_scaler_with_propagate():
    """torch.amp.GradScaler's first scale (2^30 here) overflows fp16: with
    ``nonfinite="propagate"`` the hook passes the inf on, the scaler skips those steps and
    lowers its scale until the gradients fit, and then training proceeds; by default the
    hook refuses the first overflowing bucket."""
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for nonfinite in ("raise", "propagate"):
            model = DDP(_net())
            state, hook = make_hook("fp16", nonfinite=nonfinite)
            model.register_comm_hook(state, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
            losses = []
            for step in range(40):
                opt.zero_grad()
                loss = _loss(model, 0, step)
                if nonfinite == "raise":
                    with pytest.raises((ValueError, RuntimeError), match="overflows fp16"):
                        scaler.scale(loss).backward()
                    break
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
            if nonfinite == "propagate":
                assert scaler.get_scale() < 2.0**30  # steps were skipped
                assert math.isfinite(losses[-1]) and losses[-1] < losses[0]
    finally:
        dist.destroy_process_group()


def test_hooks_work_in_a_half_buckets_dtype():
    """fp16 and bf16 buckets (a half-precision model): every family returns the bucket's dtype,
    finite; with one process the fp32 hook gives the bucket back exactly (PowerSGD multiplies
    a half bucket in float32)."""
    from lowbit.bench.hooks import GradBucketStandIn

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dt in (torch.float16, torch.bfloat16):
            g = (torch.randn(64 * 64, generator=torch.Generator().manual_seed(0)) * 0.01).to(dt)
            for name in ("fp32", "fp16", "bf16", "powersgd", "qsgd-maxnorm", "qsgd", "sign"):
                bucket = GradBucketStandIn([torch.nn.Parameter(torch.empty(64, 64, device=g.device))], g)
                state, hook = make_hook(name)
                for _ in range(2):  # the second step with error memory and PowerSGD's warm start
                    bucket.buffer().copy_(g)
                    out = hook(state, bucket).wait()
                assert out.dtype == dt and bool(torch.isfinite(out).all()), (dt, name)
                if name == "fp32":
                    assert torch.equal(out, g)
        # entries of 1e4: P = M Q reaches ~8e4, past fp16's 65504, so the products must be float32
        big = (torch.randn(64 * 64, generator=torch.Generator().manual_seed(1)) * 1e4).to(torch.float16)
        bucket = GradBucketStandIn([torch.nn.Parameter(torch.empty(64, 64, device=big.device))], big)
        state, hook = make_hook("powersgd")
        assert bool(torch.isfinite(hook(state, bucket).wait()).all())
    finally:
        dist.destroy_process_group()
