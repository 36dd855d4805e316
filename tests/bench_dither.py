"""Benchmark of the "dither" family's codecs (DQSG, NDQSG, QSGD) against a memcpy, on
the CPU, one thread: each round times one encode, one decode (fast path and
reference) and one ``dst.copy_(src)`` of the same float32 input into a preallocated
buffer, interleaved; the table gives the median over rounds of each time divided by
that round's memcpy time.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/bench_dither.py [--n 10000000] [--rounds 9]

Not collected by pytest (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowbit.codecs import shared_generator
from lowbit.codecs.dithered import DitheredCodec
from lowbit.codecs.nested import NestedDitheredCodec
from lowbit.codecs.qsgd import QSGDCodec


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.n
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    y = x + 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(1))
    dst = torch.empty_like(x)
    codecs = {
        "dithered M=1 (2 bit)": (DitheredCodec(levels=1), None),
        "dithered M=3 (3 bit), half": (DitheredCodec(levels=3, subtractive=False), None),
        "dithered M=7 K=64 (4 bit)": (DitheredCodec(levels=7, partitions=64), None),
        "nested k=4 (2 bit)": (NestedDitheredCodec(delta1=0.02, k=4), y),
        "nested k=8 alpha=0.9 (3 bit)": (NestedDitheredCodec(delta1=0.01, k=8, alpha=0.9), y),
        "qsgd s=1 (2 bit)": (QSGDCodec(levels=1), None),
        "qsgd s=7 bucket=512 (4 bit)": (QSGDCodec(levels=7, bucket=512), None),
        "qsgd s=127 (8 bit)": (QSGDCodec(levels=127), None),
    }
    print(f"n={n}, threads={torch.get_num_threads()}, rounds={args.rounds}")
    # A decode returns a new tensor: the first touch of its pages is part of its cost. This
    # row shows that cost alone: a fresh buffer plus a copy, against the copy into a reused one.
    alloc = []
    for _ in range(args.rounds):
        mem = _time(lambda: dst.copy_(x))
        alloc.append(_time(lambda: torch.empty_like(x).copy_(x)) / mem)
    print(f"torch.empty_like(x).copy_(x): {statistics.median(alloc):.1f} x memcpy")
    print("| codec | encode x memcpy | decode x memcpy | reference encode x | reference decode x |")
    print("|---|---|---|---|---|")
    for name, (c, ref) in codecs.items():
        kw = {} if ref is None else {"ref": ref}
        c.decode(c.encode(x[:1000], generator=shared_generator(0, 0, 0)),
                 generator=shared_generator(0, 0, 0), **({} if ref is None else {"ref": ref[:1000]}))  # compile
        ratios = {k: [] for k in ("enc", "dec", "renc", "rdec")}
        for r in range(args.rounds):
            mem = _time(lambda: dst.copy_(x))
            p = None

            def enc():
                nonlocal p
                p = c.encode(x, generator=shared_generator(0, r, 0))
            ratios["enc"].append(_time(enc) / mem)
            mem = _time(lambda: dst.copy_(x))
            ratios["dec"].append(_time(lambda: c.decode(p, generator=shared_generator(0, r, 0), **kw)) / mem)
            if not args.no_reference and r < 3:
                mem = _time(lambda: dst.copy_(x))
                ratios["renc"].append(_time(lambda: c.encode_reference(x, generator=shared_generator(0, r, 0))) / mem)
                mem = _time(lambda: dst.copy_(x))
                ratios["rdec"].append(
                    _time(lambda: c.decode_reference(p, generator=shared_generator(0, r, 0), **kw)) / mem)
        med = {k: (f"{statistics.median(v):.1f}" if v else "-") for k, v in ratios.items()}
        print(f"| {name} | {med['enc']} | {med['dec']} | {med['renc']} | {med['rdec']} |", flush=True)


if __name__ == "__main__":
    main()
