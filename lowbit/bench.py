"""Codec throughput against memcpy: ``lowbit bench codecs``.

For each codec and bit width: encode and decode throughput in GB/s of fp32
input, wire bytes per element, and each time as a multiple of a plain copy of
the same tensor (the lower bound for touching the data once). Times are the
median of ``repeats`` runs after one warm-up, measured side by side in one
process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .codecs import Codec, CodecKind, shared_generator


@dataclass(frozen=True)
class BenchCase:
    label: str
    make: Callable[[], Codec]


def default_cases() -> list[BenchCase]:
    from . import codecs as c

    cases = [BenchCase("fp32", c.IdentityCodec), BenchCase("fp16", lambda: c.HalfCodec("fp16")),
             BenchCase("bf16", lambda: c.HalfCodec("bf16"))]
    for b in (1, 2, 4, 8):
        if b >= 2:
            cases.append(BenchCase(f"modulo b={b}", lambda b=b: c.ModuloCodec(bits=b, theta=0.1)))
        cases.append(BenchCase(f"minmax b={b}", lambda b=b: c.MinMaxCodec(bits=b)))
    cases.append(BenchCase("uniform step=0.01", lambda: c.UniformCodec(step=0.01)))
    for m in (1, 3, 7):  # 2, 3, 4 bits
        cases.append(BenchCase(f"dithered M={m}", lambda m=m: c.DitheredCodec(levels=m)))
    cases.append(BenchCase("nested k=4", lambda: c.NestedDitheredCodec(delta1=0.005, k=4)))
    for s in (1, 7, 127):
        cases.append(BenchCase(f"qsgd s={s}", lambda s=s: c.QSGDCodec(levels=s)))
    for b in (2, 4, 8):
        cases.append(BenchCase(f"qsgd_maxnorm b={b}", lambda b=b: c.QSGDMaxNormCodec(bits=b)))
    cases.append(BenchCase("multiscale (2,6)", lambda: c.MultiScaleMaxNormCodec(scales=(2, 6))))
    cases.append(BenchCase("globalrandk 1% maxnorm b=8",
                           lambda: c.RandKCodec(c.QSGDMaxNormCodec(bits=8), k=10_000, seed=1)))
    cases += [BenchCase("terngrad", c.TernGradCodec), BenchCase("sign", c.SignCodec),
              BenchCase("powersgd r=2", lambda: c.PowerSGDCodec(rank=2))]
    return cases


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs; on a GPU each run is timed
    from an idle device until its queued kernels have finished."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_codecs(size: int = 1_000_000, repeats: int = 5, cases: list[BenchCase] | None = None,
                 device: str = "cpu", seed: int = 0) -> list[dict]:
    """Encode and decode seconds of each codec on ``size`` fp32 elements on ``device``
    (``cpu``, ``cuda``, ``cuda:N`` or ``auto``), as multiples of a memcpy there."""
    from .train.config import resolve_device

    device = resolve_device(device)
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(size, generator=g) * 0.05).to(device)
    ref = x + (torch.rand(size, generator=g).to(device) - 0.5) * 0.01  # a neighbour's model, |x - ref| < 0.005
    gb = x.numel() * 4 / 1e9
    out = torch.empty_like(x)
    t_copy = _median_seconds(lambda: out.copy_(x), repeats, device)
    rows = [{"codec": "memcpy", "encode_gbps": gb / t_copy, "decode_gbps": gb / t_copy, "bytes_per_element": 4.0,
             "encode_x_memcpy": 1.0, "decode_x_memcpy": 1.0}]
    for case in cases or default_cases():
        codec = case.make()
        gen = lambda: shared_generator(seed, 0, 0, device="cpu")  # noqa: E731
        payload = codec.encode(x, generator=gen())
        ref_kw = {"ref": ref} if codec.kind is CodecKind.SIDE_INFO else {}
        t_enc = _median_seconds(lambda: codec.encode(x, generator=gen()), repeats, device)
        t_dec = _median_seconds(lambda: codec.decode(payload, generator=gen(), **ref_kw), repeats, device)
        rows.append({"codec": case.label, "encode_gbps": gb / t_enc, "decode_gbps": gb / t_dec,
                     "bytes_per_element": payload.nbytes / size,
                     "encode_x_memcpy": t_enc / t_copy, "decode_x_memcpy": t_dec / t_copy})
    return rows


def format_rows(rows: list[dict], size: int) -> str:
    lines = [f"codec throughput, {size} fp32 elements (times as multiples of memcpy: lower is better)",
             f"{'codec':<24} {'enc GB/s':>9} {'dec GB/s':>9} {'B/elem':>8} {'enc/memcpy':>11} {'dec/memcpy':>11}"]
    for r in rows:
        lines.append(f"{r['codec']:<24} {r['encode_gbps']:>9.3f} {r['decode_gbps']:>9.3f} {r['bytes_per_element']:>8.4f} "
                     f"{r['encode_x_memcpy']:>11.1f} {r['decode_x_memcpy']:>11.1f}")
    return "\n".join(lines)
