"""Summable lanes (lowbit.codecs.lanes): the packed integer all-reduce of max-norm codes.

The no-carry bound at its worst cases (every worker at the top code, every worker at the
bottom code, every partial sum of a ring), the decoded sums bit for bit against the int8
(or wider) path, the fast path against the reference, hostile sums refused, and the
algorithm and the DDP hook sending the lanes (ledger) with the same results as int8."""

from __future__ import annotations

import math
import types

import pytest
import torch

from lowbit.algorithms import MaxNormSGD
from lowbit.codecs import MultiScaleMaxNormCodec, QSGDMaxNormCodec, RandKCodec
from lowbit.codecs.base import agree_scale
from lowbit.codecs.kernels import codec_path
from lowbit.codecs.kernels.cpu_lanes import SPECIALISE_FROM
from lowbit.codecs.lanes import Lanes, pack_lanes_reference, unpack_lanes_reference
from lowbit.codecs.rng import shared_generator
from lowbit.comm import run_threads
from lowbit.integrations.ddp_hooks.maxnorm import int_allreduce
from quadratic import quadratic_problem, run_quadratic

PATHS = ("fast", "reference")


def _k(R: int) -> int:
    """Codes per word from the definition, by brute force: R^k < 2^64 <= R^(k+1)."""
    k = 0
    while R ** (k + 1) < 2**64:
        k += 1
    return k


@pytest.mark.parametrize("s,n", [(1, 1), (1, 2), (1, 3), (1, 8), (3, 4), (7, 16), (127, 1), (2**20, 1000)])
def test_layout_is_the_densest_word_that_cannot_overflow(s, n):
    lanes = Lanes(s, n)
    R = 2 * n * s + 1
    assert lanes.radix == R and lanes.per_word == _k(R)
    assert R ** lanes.per_word < 2**64 <= R ** (lanes.per_word + 1)
    assert lanes.half_range == (R ** lanes.per_word - 1) // 2 <= 2**63 - 1
    # a worker's largest word, n of them, stay inside int64
    one = s * sum(R**i for i in range(lanes.per_word))
    assert n * one == lanes.half_range
    assert lanes.words(0) == 0 and lanes.words(lanes.per_word + 1) == 2
    assert lanes.nbytes(10 * lanes.per_word) == 80


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_bits_per_element_target(bits, n):
    """The all-reduce buffer of b-bit codes (sign included: codes in -s..s, s = 2^(b-1) - 1;
    the hook's bits=2 and the algorithm's bits=1 are b = 2) of n workers holds
    64 / k bits per element, k = the codes per word. At b = 2 (every n here) and b = 3 (up
    to 8 workers) that is at most b + ceil(log2 n) + 0.1; at b = 3 and 16 workers 64 / 9 =
    7.11 (97 values a lane: 97^10 > 2^64); at b = 4 the lanes where they beat int8's 8 bits."""
    codec = QSGDMaxNormCodec(bits=bits)
    lanes = Lanes(codec.max_code, n)
    R = 2 * n * codec.max_code + 1
    bound = bits + math.ceil(math.log2(n)) + 0.1
    assert lanes.bits_per_element == 64 / _k(R) >= math.log2(R)  # nothing packs below the lane's entropy
    chosen = codec.sum_lanes(n)
    sent = chosen.bits_per_element if chosen is not None else torch.iinfo(codec.sum_dtype(n)).bits
    if bits == 2 or (bits == 3 and n <= 8):
        assert chosen is not None and sent <= bound, (bits, n, sent)
    assert sent <= 8 and (chosen is None) == (_k(R) <= 8)


def _codes_of(codec, xs, seed=0):
    scale = agree_scale(codec, xs)
    return scale, [codec.encode_int(x, scale, shared_generator(seed, 0, m), torch.int8) for m, x in enumerate(xs)]


def _sum_words(words):
    """The SUM all-reduce of the words in int64 (as gloo and NCCL add them), checked against
    exact integer arithmetic at every partial sum of a ring (any rank first): none overflows."""
    total = torch.stack(words).sum(0)
    exact = [sum(int(w[j]) for w in words) for j in range(words[0].numel())]
    assert total.tolist() == exact
    n = len(words)
    lim = 2**63 - 1
    for start in range(n):  # every ring order's running sums
        acc = [0] * words[0].numel()
        for r in range(n):
            acc = [a + int(v) for a, v in zip(acc, words[(start + r) % n])]
            assert all(-lim <= a <= lim for a in acc)
    return total


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("s,n", [(1, 2), (1, 8), (1, 16), (3, 4), (7, 2), (7, 8), (68, 1), (1, 127)])
def test_worst_case_top_and_bottom_codes(path, s, n):
    """Every worker sends +s everywhere (the largest word), or -s everywhere, or the extremes
    mixed: each lane's sum is exact, no carry, no int64 overflow at any partial sum."""
    lanes = Lanes(s, n)
    for d in (3 * lanes.per_word, 3 * lanes.per_word + 2):  # whole words; digits past the codes too
        top = torch.full((d,), s, dtype=torch.int8 if s <= 127 else torch.int64)
        alt = torch.tensor([s if i % 2 else -s for i in range(d)], dtype=top.dtype)
        with codec_path(path):
            for per_worker in ([top] * n, [-top] * n, [alt if m % 2 else -alt for m in range(n)],
                               [top] * (n - 1) + [-top]):
                words = [lanes.pack(c) for c in per_worker]
                assert words[0].dtype == torch.int64 and words[0].numel() == lanes.words(d)
                if per_worker[0] is top and d % lanes.per_word == 0:
                    assert words[0].tolist() == [lanes.half_range // n] * 3  # n top words fill int64's range
                got = lanes.unpack(_sum_words(words), d)
                assert torch.equal(got.to(torch.int64), torch.stack(per_worker).to(torch.int64).sum(0))
                assert got.dtype == lanes.sum_dtype


def test_one_more_worker_would_carry():
    """The bound is tight: n + 1 workers at the top code overflow the lanes of n (the test
    can fail: a layout with a narrower radix would be caught here)."""
    s, n = 1, 8
    lanes = Lanes(s, n)
    top = torch.full((lanes.per_word,), s, dtype=torch.int8)
    words = [lanes.pack(top)] * (n + 1)
    total = torch.stack(words).sum(0)
    for path in PATHS:
        with codec_path(path), pytest.raises(ValueError, match="cannot be the sum"):
            lanes.unpack(total, lanes.per_word)
    # one more worker at 0 in the lowest lane only: still a sum the radix holds, read exactly
    low = torch.zeros(lanes.per_word, dtype=torch.int8)
    words = [lanes.pack(top)] * n + [lanes.pack(low)]
    assert torch.equal(lanes.unpack(torch.stack(words).sum(0), lanes.per_word).long(), top.long() * n)


CODECS = [QSGDMaxNormCodec(bits=2), QSGDMaxNormCodec(bits=3), QSGDMaxNormCodec(bits=4),
          MultiScaleMaxNormCodec(scales=(2, 6)), QSGDMaxNormCodec(bits=2, norm="linf")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}-{getattr(c, 'bits', '')}")
@pytest.mark.parametrize("n", [2, 4, 8])
def test_decoded_sums_identical_to_the_int8_path(path, codec, n):
    d = 1000
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(d, generator=g) * (1 + m) for m in range(n)]
    with codec_path(path):
        scale, codes = _codes_of(codec, xs)
        int8_sum = torch.stack(codes).sum(0, dtype=codec.sum_dtype(n))
        lanes = codec.sum_lanes(n)
        assert lanes is not None
        words = [lanes.pack(c) for c in codes]
        lane_sum = lanes.unpack(torch.stack(words).sum(0), d)
        assert torch.equal(lane_sum.long(), int8_sum.long())
        a = codec.decode_sum(int8_sum, scale, n, numel=d)
        b = codec.decode_sum(lane_sum, scale, n, numel=d)
        assert torch.equal(a, b)


@pytest.mark.parametrize("s,n", [(1, 2), (1, 8), (3, 4), (7, 4)])
def test_fast_path_matches_the_reference(s, n):
    lanes = Lanes(s, n)
    g = torch.Generator().manual_seed(s + n)
    for d in (0, 1, lanes.per_word - 1, lanes.per_word, 5 * lanes.per_word + 3, SPECIALISE_FROM + 7):
        codes = [torch.randint(-s, s + 1, (d,), generator=g, dtype=torch.int8) for _ in range(n)]
        fast = [lanes.pack(c) for c in codes]
        ref = [pack_lanes_reference(c, lanes) for c in codes]
        assert all(torch.equal(a, b) for a, b in zip(fast, ref))
        total = torch.stack(fast).sum(0) if d else torch.zeros(0, dtype=torch.int64)
        want = torch.stack(codes).long().sum(0) if d else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(lanes.unpack(total, d).long(), want)
        assert torch.equal(unpack_lanes_reference(total, lanes, d).long(), want)


@pytest.mark.parametrize("path", PATHS)
def test_hostile_sums_are_refused(path):
    lanes = Lanes(1, 4)
    for d in (2 * lanes.per_word - 1, SPECIALISE_FROM + 1):  # the last word's top digit past the codes
        assert lanes.per_word * lanes.words(d) > d
        _check_refused(lanes, d, path)


def _check_refused(lanes, d, path):
    with codec_path(path):
        good = lanes.pack(torch.ones(d, dtype=torch.int8))
        for bad_word in (lanes.half_range + 1, -lanes.half_range - 1, 2**63 - 1, -(2**63)):
            w = good.clone()
            w[0] = bad_word
            with pytest.raises(ValueError, match="out of range"):
                lanes.unpack(w, d)
        w = good.clone()
        w[-1] += lanes.radix ** (lanes.per_word - 1)  # the padding digit set
        with pytest.raises(ValueError, match="past the codes"):
            lanes.unpack(w, d)
        with pytest.raises(ValueError, match="words must be a 1-D int64"):
            lanes.unpack(good[:-1], d)
        with pytest.raises(ValueError, match="words must be a 1-D int64"):
            lanes.unpack(good.to(torch.int32), d)


def test_arguments_are_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_code"):
            Lanes(bad, 2)
        with pytest.raises(ValueError, match="world_size"):
            Lanes(1, bad)
    with pytest.raises(ValueError, match="int64"):
        Lanes(2**62, 2)
    lanes = Lanes(7, 2)
    with pytest.raises(ValueError, match="codes must be"):
        lanes.pack(torch.zeros(3))
    with pytest.raises(ValueError, match="codes must be"):
        lanes.pack(torch.zeros(2, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="dtype must be"):
        lanes.unpack(lanes.pack(torch.zeros(3, dtype=torch.int8)), 3, torch.float32)
    with pytest.raises(ValueError, match="numel"):
        lanes.words(-1)


def test_sum_lanes_picks_the_fewer_bytes():
    c2 = QSGDMaxNormCodec(bits=2)
    assert c2.sum_lanes(8) == Lanes(1, 8)
    assert c2.sum_lanes(8, torch.int8) is None  # asked for: sent as asked
    assert QSGDMaxNormCodec(bits=8).sum_lanes(1) is None  # 255 values: 8 per word, int8 is as small
    assert QSGDMaxNormCodec(bits=8).sum_lanes(2) == Lanes(127, 2)  # 509 values: 7 per word, 9.1 bits < int16
    # bits=5 over 16 workers: 481 values, 7 per word (9.1 bits): beats the int16 sum, and the
    # int32 a transport without int16 sends
    c5 = QSGDMaxNormCodec(bits=5)
    assert c5.sum_dtype(16) == torch.int16 and c5.sum_lanes(16) == Lanes(15, 16)
    assert c5.sum_lanes(16, plain=torch.int32) == Lanes(15, 16)
    assert QSGDMaxNormCodec(bits=4).sum_lanes(16) is None  # 225 values: 8 per word, as int8
    assert QSGDMaxNormCodec(bits=4).sum_lanes(16, plain=torch.int32) == Lanes(7, 16)
    rk = RandKCodec(c2, k=10, seed=1)
    assert rk.sum_lanes(4) == Lanes(1, 4)
    lanes = Lanes(1, 2)
    assert lanes.pays(torch.int8) and not lanes.pays(torch.int8, 1) and lanes.pays(torch.int8, 9)
    assert lanes.code_dtype == torch.int8 and Lanes(200, 1).code_dtype == torch.int16


# ---- the algorithm and the DDP hook send the lanes -------------------------------------------

def _run_maxnorm(n, d, steps=3, **kw):
    X0, A, b = quadratic_problem(n, d, seed=1)
    res = run_quadratic(lambda t: MaxNormSGD(**kw).worker(t, seed=5), X0[:1].expand(n, -1), A, b, steps, 0.1,
                        observe=lambda k, x, algo, t: (x.clone(), t.ledger.step_bytes(k)))
    return [[o[0] for o in seen] for seen, *_ in res], [[o[1] for o in seen] for seen, *_ in res], res


@pytest.mark.parametrize("kw", [{"bits": 1}, {"bits": 2}, {"scales": (2, 6)}, {"bits": 1, "k": 0.5}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_algorithm_sends_lanes_bit_for_bit_as_int8(kw):
    n, d = 4, 3000
    packed, sent, res = _run_maxnorm(n, d, **kw)
    plain, sent8, _ = _run_maxnorm(n, d, sum_dtype="int8", **kw)
    for a, b in zip(packed, plain):  # every worker, every step: the same model
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    algo = res[0][1]
    lanes = algo.state.lanes
    assert lanes is not None and lanes.world_size == n
    m = d if "k" not in kw else max(1, round(kw["k"] * d))
    ring = lambda nbytes: 2 * (n - 1) * nbytes // n  # noqa: E731
    assert sent8[0][0] - sent[0][0] == ring(m) - ring(lanes.nbytes(m))  # only the code sum shrank
    assert 8 * lanes.nbytes(m) / m <= lanes.bits_per_element + 64 / m


def test_algorithm_keeps_the_dtype_where_lanes_do_not_pay():
    _, _, res = _run_maxnorm(2, 3, steps=1, bits=1)  # 3 codes: 3 bytes of int8 beat one 8-byte word
    assert res[0][1].state.lanes == Lanes(1, 2)
    packed, sent, _ = _run_maxnorm(2, 3, steps=1, bits=1)
    _, sent8, _ = _run_maxnorm(2, 3, steps=1, bits=1, sum_dtype="int8")
    assert sent == sent8


@pytest.mark.parametrize("codec", [QSGDMaxNormCodec(bits=2), QSGDMaxNormCodec(bits=4),
                                   MultiScaleMaxNormCodec(scales=(2, 6))], ids=lambda c: c.name + str(c.bits))
def test_hook_exchange_sends_lanes_bit_for_bit_as_int8(codec):
    """The DDP hooks' all-reduce of codes (int_allreduce) over the thread runtime: the same
    average as an int8 sum, and the ledger counts the lanes' words."""
    n, d = 4, 2000
    xs = [torch.randn(d, generator=torch.Generator().manual_seed(m)) for m in range(n)]

    def worker(t, sum_dtype):
        state = types.SimpleNamespace(sum_dtype=sum_dtype)
        fut, _ = int_allreduce(state, t, codec, xs[t.rank], shared_generator(0, 0, t.rank))
        return fut.wait(), t.ledger.step_bytes(0)

    packed = run_threads(n, lambda t: worker(t, None))
    plain = run_threads(n, lambda t: worker(t, torch.int8))
    for (a, bytes_a), (b, bytes_b) in zip(packed, plain):
        assert torch.equal(a, b)
        lanes = codec.sum_lanes(n)
        ring = lambda nbytes: 2 * (n - 1) * nbytes // n  # noqa: E731
        assert bytes_b - bytes_a == ring(d) - ring(lanes.nbytes(d))
