"""Encode and decode of the "plain" codecs (fast path and reference) as multiples of a
memcpy, one thread: each timing is taken right after a ``dst.copy_(src)`` into a
preallocated buffer, and the table shows the median of the per-round ratios (the
machine may be shared). Not a test (no timed assertions); run it as

    OMP_NUM_THREADS=1 python tests/bench_fastpath_plain.py [--size 10000000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lowbit

from lowbit.codecs import (HalfCodec, IdentityCodec, MinMaxCodec, SignCodec, TernGradCodec,  # noqa: E402
                           UniformCodec, shared_generator)
from lowbit.codecs.kernels import codec_path  # noqa: E402


def cases():
    return [("fp32", IdentityCodec()), ("fp16", HalfCodec("fp16")), ("bf16", HalfCodec("bf16")),
            *[(f"minmax b={b}", MinMaxCodec(bits=b)) for b in (1, 2, 4, 8)],
            ("minmax b=4 stochastic", MinMaxCodec(bits=4, rounding="stochastic")),
            ("uniform step=0.01", UniformCodec(step=0.01)),
            ("uniform step=0.01 nearest", UniformCodec(step=0.01, rounding="nearest")),
            ("terngrad", TernGradCodec()), ("sign mean_abs", SignCodec()), ("sign rms", SignCodec("rms")),
            ("sign none", SignCodec("none"))]


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(args.size, generator=torch.Generator().manual_seed(0)) * 0.05
    dst = torch.empty_like(x)
    memcpy = lambda: dst.copy_(x)  # noqa: E731
    print(f"{args.size} fp32 elements, {torch.get_num_threads()} thread, median of {args.rounds} rounds "
          f"(memcpy {min(_seconds(memcpy) for _ in range(3)) * 1e3:.1f} ms)")
    print(f"{'codec':<26} {'encode x':>9} {'decode x':>9} {'ref enc x':>10} {'ref dec x':>10}")
    for label, codec in cases():
        payload = codec.encode(x, generator=shared_generator(0, 0, 0))
        fns = {
            "enc": lambda c=codec: c.encode(x, generator=shared_generator(0, 0, 0)),
            "dec": lambda c=codec, p=payload: c.decode(p),
            "renc": lambda c=codec: c.encode_reference(x, generator=shared_generator(0, 0, 0)),
            "rdec": lambda c=codec, p=payload: c.decode_reference(p),
        }
        with codec_path("fast"):
            for f in fns.values():  # warm-up (numba compiles, or loads its cache)
                f()
        ratios = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                t_copy = _seconds(memcpy)
                ratios[k].append(_seconds(f) / t_copy)
        med = {k: statistics.median(v) for k, v in ratios.items()}
        print(f"{label:<26} {med['enc']:>9.1f} {med['dec']:>9.1f} {med['renc']:>10.1f} {med['rdec']:>10.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
