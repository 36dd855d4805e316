"""Benchmark of the max-norm family's fast path (not a test): encode and decode of
each codec at 1e7 float32 elements on one thread, each round timing a
``dst.copy_(src)`` memcpy into a preallocated buffer beside the fast and the
reference encode/decode; the table gives the median over rounds of the per-round
ratios to the memcpy. RandK selects anew each round (a new seed: the encode
computes the selection, the decode finds it in the per-process cache). PowerSGD is compared with the math of torch's
``powerSGD_hook`` (``bmm``, Gram-Schmidt for rank <= 2, ``bmm``, ``bmm``) on the
same zero-padded matrix.

    OMP_NUM_THREADS=1 python tests/bench_fastpath_maxnorm.py [--size 10000000] [--rounds 9]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lowbit, not an installed one

from lowbit.codecs import MultiScaleMaxNormCodec, PowerSGDCodec, QSGDMaxNormCodec, RandKCodec, shared_generator
from lowbit.codecs.kernels import codec_path
from lowbit.codecs.powersgd import matrix_shape


def _t(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench(size: int, rounds: int, reference: bool) -> list[tuple]:
    torch.set_num_threads(1)
    x = torch.randn(size, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    cases = [("qsgd_maxnorm b=2", QSGDMaxNormCodec(bits=2)), ("qsgd_maxnorm b=3", QSGDMaxNormCodec(bits=3)),
             ("qsgd_maxnorm b=4", QSGDMaxNormCodec(bits=4)), ("qsgd_maxnorm b=8", QSGDMaxNormCodec(bits=8)),
             ("multiscale (2,6)", MultiScaleMaxNormCodec(scales=(2, 6))),
             ("randk k=1e4 (maxnorm b=8)", RandKCodec(QSGDMaxNormCodec(bits=8), k=10_000, seed=1)),
             ("randk k=d/2 (maxnorm b=8)", RandKCodec(QSGDMaxNormCodec(bits=8), k=size // 2, seed=1)),
             ("powersgd r=2", PowerSGDCodec(rank=2))]
    rows = []
    for label, c in cases:
        ratios = {k: [] for k in ("enc", "dec", "ref_enc", "ref_dec")}
        for rnd in range(rounds + 1):  # round 0 warms up (numba compile)
            if isinstance(c, RandKCodec):  # a new selection each round, as each training step
                c = c.with_seed(1000 + rnd)
            tm, _ = _t(lambda: dst.copy_(x))
            te, p = _t(lambda: c.encode(x, generator=shared_generator(0, rnd, 0)))
            td, _ = _t(lambda: c.decode(p))
            times = {"enc": te, "dec": td}
            if reference:
                with codec_path("reference"):
                    tre, pr = _t(lambda: c.encode(x, generator=shared_generator(0, rnd, 0)))
                    trd, _ = _t(lambda: c.decode(pr))
                times.update(ref_enc=tre, ref_dec=trd)
            if rnd:
                for k, v in times.items():
                    ratios[k].append(v / tm)
        rows.append((label, *(statistics.median(v) if v else float("nan") for v in ratios.values())))
    # PowerSGD against torch's powerSGD_hook math on the same (zero-padded) matrix
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    n, m = matrix_shape(size)
    M = torch.nn.functional.pad(x, (0, n * m - size)).view(1, n, m)
    q0 = torch.randn(1, m, 2, generator=torch.Generator().manual_seed(1))
    c = PowerSGDCodec(rank=2)
    hook, ours = [], []
    for rnd in range(rounds + 1):
        def hook_step():
            p = torch.bmm(M, q0)
            _orthogonalize(p, 0)
            q = torch.bmm(M.transpose(1, 2), p)
            return torch.bmm(p, q.transpose(1, 2))
        tm, _ = _t(lambda: dst.copy_(x))
        th, _ = _t(hook_step)
        to, _ = _t(lambda: c.decode(c.encode_with_state(x, q0[0])[0]))
        if rnd:
            hook.append(th / tm)
            ours.append(to / tm)
    rows.append(("powersgd r=2 vs powerSGD_hook math (enc+dec, hook)", statistics.median(ours),
                 statistics.median(hook), float("nan"), float("nan")))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-reference", action="store_true")
    a = ap.parse_args()
    rows = bench(a.size, a.rounds, not a.no_reference)
    print(f"| codec ({a.size} float32, 1 thread, median of {a.rounds} rounds) | encode x | decode x | "
          "reference encode x | reference decode x |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | " + " | ".join(f"{v:.1f}" for v in r[1:]) + " |")


if __name__ == "__main__":
    main()
